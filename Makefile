# The two commands: `make demo` (set up, then run the demo) and `make test` (set up, then test).
.PHONY: setup demo test test-fast bench clean

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/spotlight run demo

# Lint first (ruff: pyproject [tool.ruff]), then the tests: asyncio debug mode and warnings as errors
# (pyproject [tool.pytest.ini_options]), in two pytest-xdist workers that steal work from each
# other (the long multi-process tests do not end up queued behind one worker). On the 2-core
# machine that took 583-630 s against 755-907 s one test at a time (interleaved, 0.73 of the time;
# docs/BENCHMARKS.md "The test suite's time"): the multi-process tests spend much of their time
# waiting on leases, heartbeats and traces, so a second test fits beside them. Every time bound a
# test asserts keeps seconds of slack for a loaded machine. `make test PYTEST_WORKERS=0` runs one
# test at a time.
PYTEST_WORKERS ?= 2
test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal

test-fast: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "not slow"

bench: setup
	.venv/bin/python bench/seed_selection.py

clean:
	rm -rf runs .pytest_cache
