# The two commands of the README: `make demo` (the main job) and `make test` (the whole suite).
# Both set up everything first (scripts/setup.sh is idempotent).
.PHONY: setup demo test lint bench

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/bunshin demo

lint: setup
	.venv/bin/ruff check bunshin_async speculator tests bench examples
	.venv/bin/mypy

test: setup lint
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python bench/workspace_bench.py
