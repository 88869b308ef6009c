# The two commands: `make demo` (set up, then run the demo) and `make test` (set up, then test).
.PHONY: setup demo test test-fast bench clean

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/spotlight run demo

# Lint first (ruff: pyproject [tool.ruff]), then the tests: asyncio debug mode and warnings as errors
# (pyproject [tool.pytest.ini_options]), in two worker processes (pytest-xdist): much of the suite
# waits on spawned actors, so two at a time on the 2-core CI machine took 505 s against 863 s
# one at a time (docs/BENCHMARKS.md). `make test PYTEST_WORKERS=0` runs them in this process.
PYTEST_WORKERS ?= 2
test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -n $(PYTEST_WORKERS)

test-fast: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -n $(PYTEST_WORKERS) -m "not slow"

bench: setup
	.venv/bin/python bench/seed_selection.py

clean:
	rm -rf runs .pytest_cache
