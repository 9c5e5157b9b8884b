PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Tandem with the test extra: every optional feature plus the test and lint tools. The
# editable install imports Tandem from its sources: their bytecode is compiled once here, so
# that every process the suite starts loads it even where PYTHONDONTWRITEBYTECODE is set
# (about 0.1 CPU-s less per process; Python checks each file's timestamp, and compiles in
# memory a source edited since)
install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m compileall -q tandem bench tests

# the demo's data set (scikit-learn) and plots (matplotlib, for --trace)
demo: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[demo,plot]'
	$(BIN)/tandem demo

# lint, format, types, then the whole suite on TEST_WORKERS pytest-xdist processes. CI has 2
# cores; a third worker keeps them busy while other tests wait on their processes, sockets and
# timers (the suite uses about 1.8 cores with 3 workers, 1.4 with 2). Files with slow tests are
# collected first (tests/conftest.py) and `--dist load` hands tests out in that order as
# workers free up: the long ones start early and the session ends on short ones. The first
# failing step stops it
TEST_WORKERS ?= 3
test: install lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install
	$(BIN)/python -m bench.pipeline --json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
