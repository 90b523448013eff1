# The two commands of the README: `make demo` (the main job) and `make test` (the tests).
# Each sets up .venv on a fresh machine first; nothing needs installing by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The Node clients the tests drive (the official `openai` package from npm), installed from the lock file.
NODE_STAMP := tests/node/node_modules/.installed

.PHONY: setup test lint demo bench clean reliability

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

# The reliability suite at full scale (issue 15; minutes to an hour): every fault many times, the 1,000-session
# load, Hypothesis's thorough profile. `make test` runs the same tests at a small bounded scale. The figures land in
# test-output/reliability-figures.jsonl and then in the table of docs/reliability.md. The thorough Hypothesis tests run
# in a pytest process of their own: after their thousands of examples, a RecursionError that a later test provokes
# on purpose (deep nesting, an xfail) left CPython 3.11 unable to compile pytest's report (an INTERNALERROR).
# The whole target at the bounded scale, into a copy of the page (a check that it runs end to end, in minutes):
#   make reliability RELIABILITY=default RELIABILITY_HYPOTHESIS=dev RELIABILITY_PAGE=/tmp/reliability.md
RELIABILITY ?= full
RELIABILITY_HYPOTHESIS ?= thorough
RELIABILITY_PAGE ?= docs/reliability.md
reliability: $(STAMP)
	mkdir -p test-output
	rm -f test-output/reliability-figures.jsonl
	SESSIONLOG_RELIABILITY=$(RELIABILITY) HYPOTHESIS_PROFILE=$(RELIABILITY_HYPOTHESIS) $(BIN)/pytest -q -rxX \
		tests/test_reliability_bad_input.py -k "mutated_fixture or bad_bytes"
	SESSIONLOG_RELIABILITY=$(RELIABILITY) $(BIN)/pytest -q -rxX tests/test_reliability_*.py --deselect \
		tests/test_reliability_bad_input.py::test_a_mutated_fixture_is_imported_whole_or_refused_typed_with_nothing_written \
		--deselect tests/test_reliability_bad_input.py::test_append_refuses_bad_bytes_typed_and_queues_nothing
	$(BIN)/python tests/reliability_table.py --mode $(RELIABILITY) --write $(RELIABILITY_PAGE)

demo: $(STAMP)
	$(BIN)/sessionlog demo

# The whole suite (about 20 minutes on 2 cores): bench/results.json, the plots in bench/plots, the goals table.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) tests/node/node_modules .mypy_cache .ruff_cache .pytest_cache .hypothesis
