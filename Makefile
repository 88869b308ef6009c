# The two commands: `make demo` (set up, then run the demo) and `make test` (set up, then test).
.PHONY: setup demo test test-fast bench clean

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/spotlight run demo

# Lint first (ruff: pyproject [tool.ruff]), then the tests: asyncio debug mode and warnings as errors
# (pyproject [tool.pytest.ini_options]).
test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q

test-fast: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -m "not slow"

bench: setup
	.venv/bin/python bench/seed_selection.py

clean:
	rm -rf runs .pytest_cache
