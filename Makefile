# The two commands in the README. Each sets up what it needs first (idempotent).
.PHONY: demo test lint fuzz

# DEMO_ARGS: extra `syncscope demo` flags, e.g. DEMO_ARGS="--duration 20" (.ci/run uses it).
DEMO_ARGS ?=

demo:
	scripts/setup demo
	.venv/bin/syncscope demo $(DEMO_ARGS)

test:
	scripts/setup test
	.venv/bin/ruff check .
	.venv/bin/mypy agent exporter sim syncscope bench
	.venv/bin/pytest -q --durations=60

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy agent exporter sim syncscope bench
	.venv/bin/ruff format --check .

# The full fuzz run of issue 7 (docs/reliability.md): 10,000 examples per test, counts to
# fuzz-report.json (git-ignored). About 7 minutes here.
fuzz:
	scripts/setup test
	SYNCSCOPE_FUZZ_EXAMPLES=10000 SYNCSCOPE_FUZZ_REPORT=fuzz-report.json \
		.venv/bin/pytest -q tests/unit/test_fuzz_ingest.py -p no:cacheprovider -s
