# The two commands in the README. Each sets up what it needs first (idempotent).
.PHONY: demo test lint

demo:
	scripts/setup demo
	.venv/bin/syncscope demo

test:
	scripts/setup test
	.venv/bin/ruff check .
	.venv/bin/mypy agent exporter sim syncscope
	.venv/bin/pytest -q

lint:
	.venv/bin/ruff check .
	.venv/bin/mypy agent exporter sim syncscope
	.venv/bin/ruff format --check .
