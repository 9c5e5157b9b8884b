PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'

demo: install
	$(BIN)/tandem demo

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python -m bench.pipeline --json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
