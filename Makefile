# The README's two commands (demo, test), each setting up what it needs first (idempotent);
# test-fast is for between edits.
.PHONY: demo test test-fast lint fuzz

# DEMO_ARGS: extra `syncscope demo` flags, e.g. DEMO_ARGS="--duration 20" (.ci/run uses it).
DEMO_ARGS ?=

demo:
	scripts/setup demo
	.venv/bin/syncscope demo $(DEMO_ARGS)

# The tests start hundreds of Python processes (ranks, exporters, pytest workers) that import
# syncscope and the tests: with PYTHONDONTWRITEBYTECODE set (as some images do) each compiles
# them afresh (collecting the suite: 12.6 s of CPU against 7.0 s with the caches written), and
# torch too, which scripts/setup installs without byte-compiling it. An empty value lets Python
# write its __pycache__ (git-ignored, and in .venv).
demo test test-fast fuzz: export PYTHONDONTWRITEBYTECODE :=

# Idle priority where the scheduler has it (SCHED_IDLE: a core goes to such a process only when
# nothing else wants it), else the lowest nice.
IDLE := $(shell chrt --idle 0 true >/dev/null 2>&1 && echo "chrt --idle 0" || echo "nice -n 19")

# Most of its time is real multi-rank jobs (docs/evaluation.md, "The test suite"); their ranks
# are forked from one process that has already imported torch (syncscope/lab/forkserver.py).
# The machine's cores are the limit, so `make test` fills them in two phases:
#  1. the tests marked quiet, one at a time: they judge timing a starved core moves (lateness
#     across emulated nodes, link shares, the pacing controller), and leave about half of the
#     cores idle while their jobs wait for rule windows. Beside them, at idle priority: mypy,
#     and one after another the tests marked background (every unit test but those marked
#     clock, and others that judge no job's timing; those also marked serial after them, in one
#     process), then those marked relative (verdicts that compare a job's ranks with each
#     other), two files at a time. They take only what the quiet tests leave, so the quiet
#     jobs run as if alone.
#  2. the rest, two files at a time (pytest-xdist; each file's jobs stay on one worker).
# Every phase runs even when another failed; the target fails if any did.
test:
	scripts/setup test
	.venv/bin/ruff check .
	@log=$$(mktemp); start=$$(date +%s); \
	$(IDLE) .venv/bin/mypy agent exporter sim syncscope bench >"$$log.mypy" 2>&1 & \
	typed=$$!; \
	$(IDLE) sh -c 'rc=0; \
		.venv/bin/pytest -q -p no:cacheprovider --durations=10 -n 2 --dist loadfile \
			-m "background and not serial" || rc=1; \
		.venv/bin/pytest -q -p no:cacheprovider -m "background and serial" || rc=1; \
		.venv/bin/pytest -q -p no:cacheprovider --durations=10 -n 2 --dist loadfile \
			-m relative || rc=1; \
		exit $$rc' >"$$log" 2>&1 & \
	background=$$!; \
	.venv/bin/pytest -q --durations=15 -m quiet; quiet=$$?; \
	wait $$typed; types=$$?; wait $$background; idle=$$?; phase1=$$(( $$(date +%s) - start )); \
	echo "== beside them, at idle priority ($(IDLE)): mypy, the background and relative tests"; \
	cat "$$log.mypy" "$$log"; rm -f "$$log" "$$log.mypy"; \
	.venv/bin/pytest -q --durations=30 -n 2 --dist loadfile \
		-m "not quiet and not background and not relative"; \
	rest=$$?; \
	echo "== phase 1: $$phase1 s; phases 1 and 2: $$(( $$(date +%s) - start )) s"; \
	[ $$quiet -eq 0 ] && [ $$types -eq 0 ] && [ $$idle -eq 0 ] && [ $$rest -eq 0 ]

# Between edits: ruff, then the unit tests not marked slow (the slow ones start real
# servers, promtool runs or multi-process jobs; `make test` runs them all). The generated
# files' check (`syncscope generate --check`: rules, dashboards, metric contract, reference
# pages) is one of these unit tests (test_rules.py), the docs check (test_docs.py) another.
# No setup step: run `make test` or `scripts/setup test` once first. About 2 minutes here
# (2 shared cores). pytest-xdist -n 2 did not help here (2:01 and 2:26
# against 1:42 and 2:19 serial: each worker pays the ~20 s of imports again).
test-fast:
	.venv/bin/ruff check .
	.venv/bin/pytest -q -m "not slow" tests/unit

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy agent exporter sim syncscope bench
	.venv/bin/ruff format --check .

# The full fuzz run (docs/reliability.md): 10,000 examples per test, counts to
# fuzz-report.json (git-ignored). About 7 minutes here.
fuzz:
	scripts/setup test
	SYNCSCOPE_FUZZ_EXAMPLES=10000 SYNCSCOPE_FUZZ_REPORT=fuzz-report.json \
		.venv/bin/pytest -q tests/unit/test_fuzz_ingest.py -p no:cacheprovider -s
