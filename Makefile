# ql3: `make demo` runs the main job; `make test` proves it against real servers.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

.PHONY: setup system-packages demo test test-sql test-py lint bench db-up db-down clean

setup: system-packages $(VENV)/.installed

system-packages:
	@scripts/ensure-system-packages

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: setup
	$(PY) -m ql3.demo $(if $(DSN),--dsn '$(DSN)')

test: setup lint
	$(PY) tests/servers.py -- scripts/run-tests

test-sql: setup
	$(PY) tests/servers.py -- scripts/run-tests sql

test-py: setup
	$(PY) tests/servers.py -- scripts/run-tests py

lint: setup
	$(BIN)/sqlfluff lint --dialect postgres --processes 2 sql tests/sql
	$(BIN)/ruff check python tests bench examples
	$(BIN)/ruff format --check python tests bench examples
	$(BIN)/mypy

# Benchmarks start their own servers with PostgreSQL's durable defaults (fsync on), unlike
# the tests; set QL3_TEST_DSN / QL3_TEST_REDIS_URL to measure existing servers instead.
# The `bench` extra adds DBOS Transact, the peer the pairs benchmark is compared with.
bench: setup
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(PY) -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
