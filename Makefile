# The README's two commands (demo, test), each setting up what it needs first (idempotent);
# test-fast is for between edits.
.PHONY: demo test test-fast lint fuzz

# DEMO_ARGS: extra `syncscope demo` flags, e.g. DEMO_ARGS="--duration 20" (.ci/run uses it).
DEMO_ARGS ?=

demo:
	scripts/setup demo
	.venv/bin/syncscope demo $(DEMO_ARGS)

# Most of its time is real multi-rank jobs (docs/evaluation.md, "The test suite"); their ranks
# are forked from one process that has already imported torch (syncscope/lab/forkserver.py).
# Those jobs mostly wait (the machine sits ~85 % idle during one), so two test files run at
# once (pytest-xdist; each file's jobs stay on one worker). The tests marked quiet judge timing
# a starved core moves (lateness across emulated nodes, the pacing controller) and run
# afterwards, alone: beside other jobs a clean rank really is late now and then, and the
# rules say so. They run even when the rest failed; the target fails if either did.
test:
	scripts/setup test
	.venv/bin/ruff check .
	.venv/bin/mypy agent exporter sim syncscope bench
	.venv/bin/pytest -q --durations=30 -n 2 --dist loadfile -m "not quiet"; rest=$$?; \
	.venv/bin/pytest -q --durations=15 -m quiet && exit $$rest

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
