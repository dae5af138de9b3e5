# The two commands of the README: `make run` (the main job: the latency-hiding experiment) and `make test` (lint,
# types and the whole suite). Both set up everything first (scripts/setup.sh is idempotent).
.PHONY: setup run demo test test-unit lint docs bench bench-peers fresh-check

setup:
	@scripts/setup.sh

run: setup
	.venv/bin/python -m bench.experiment

demo: setup
	.venv/bin/bunshin demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

test: setup lint docs fresh-check
	.venv/bin/python -m pytest -q

# The documentation site (mkdocs.yml) into site/; --strict: a broken link, a missing reference or an undocumented
# public name fails it. Benchmark pages come from bench/results/*.record.json: `.venv/bin/python bench/report.py`.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet

# The unit tier alone: pure logic (tests marked `unit`), no set-up, root, CRIU or workspace; well under a minute.
# Any user can run it: scripts/unit-env.sh picks .venv, or makes a small environment of the user's own (once).
# No cache directory, so it also runs from a read-only checkout. Only the modules that mark a test `unit` (written
# `pytest.mark.unit` in the module) are collected: importing and assertion-rewriting the other ~75 took most of the time.
UNIT_MODULES = $(shell grep -rlE --include='test_*.py' --exclude-dir=dockerfiles 'mark\.unit\b' tests | sort)
test-unit:
	PYTHONPATH=$(CURDIR) scripts/unit-env.sh -m pytest -q -m unit -p no:cacheprovider $(UNIT_MODULES)

# The clean-root set-up check: the set-up on a minimal Debian root that has never seen Bunshin (scripts/).
# Debian 12, then Debian 13, whose Python 3.13 also runs the agent and workspace tests and the wheel test (a second
# host Python).
fresh-check:
	scripts/check-fresh-setup.sh bookworm
	FRESH_TESTS="tests/host/agent tests/host/test_kernel.py tests/workspace/test_isolation.py \
		tests/workspace/test_lifecycle.py tests/workspace/test_tools.py tests/setup/test_wheel.py \
		tests/integrations/test_harnesses.py::test_harbor_suite" scripts/check-fresh-setup.sh trixie

# Each benchmark through the report generator: its JSON is recorded (date, machine, load, command) in
# bench/results/NAME.record.json and the pages of docs/benchmarks and README's headline table are regenerated.
BENCHES = workspace fork kmod cache experiment gui security images peers integrations e2b cluster soak
bench: setup
	for b in $(BENCHES); do .venv/bin/python bench/report.py run $$b || exit 1; done
	.venv/bin/python -m bench.experiment --workload terminal --repeats 5 --time-scale 0.25 --out bench/results/terminal
	.venv/bin/python bench/security_bench.py --compare userns

# Bunshin beside Docker, Podman and bubblewrap (installs podman and bubblewrap on first use).
bench-peers: setup
	.venv/bin/python bench/peer_bench.py
