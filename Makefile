# The two commands of the README: `make demo` (the main job) and `make test` (the tests).
# Each sets up .venv on a fresh machine first; nothing needs installing by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The Node clients the tests drive (the official `openai` package from npm), installed from the lock file.
NODE_STAMP := tests/node/node_modules/.installed

.PHONY: setup test lint demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(NODE_STAMP): tests/node/package.json tests/node/package-lock.json
	cd tests/node && npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

setup: $(STAMP) $(NODE_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check shared services tests bench examples
	$(BIN)/ruff format --check shared services tests bench examples
	$(BIN)/mypy

test: lint $(NODE_STAMP)
	$(BIN)/pytest -q

demo: $(STAMP)
	$(BIN)/sessionlog demo

# The whole suite (about 20 minutes on 2 cores): bench/results.json, the plots in bench/plots, the goals table.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) tests/node/node_modules .mypy_cache .ruff_cache .pytest_cache .hypothesis
