# Two set-up commands for a fresh machine (Python 3.11, no GPU):
#   make demo   install into .venv and generate from the embedded demo model
#   make test   install into .venv with the test extras and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; a GPU machine keeps the torch it has (see README).
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test install install-test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .

install-test: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"

demo: install
	$(BIN)/moestream generate -p "def fibonacci(n):" --max-tokens 96 --temperature 0
	@echo
	@echo "Serve it (OpenAI-compatible API on 127.0.0.1:8000):  $(BIN)/moestream serve"
	@echo "Chat with it:                                        $(BIN)/moestream chat"

# One worker a core (pytest-xdist), a test file's tests on one worker (module fixtures built once).
test: install-test
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile

lint: install-test
	$(BIN)/ruff check moestream tests
	$(BIN)/ruff format --check moestream tests
