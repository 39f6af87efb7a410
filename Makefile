# ql3: `make demo` runs the main job; `make test` proves it against real servers.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
LOCK := requirements/dev.txt
BENCH_LOCK := requirements/bench.txt
UV_VERSION := 0.13.9
UV_COMPILE := .tmp/lock-tool/bin/uv pip compile pyproject.toml --quiet --universal \
	--python-version 3.11 --generate-hashes

.PHONY: lock setup system-packages demo test test-sql test-py test-ha lint bench db-up db-down clean

setup: system-packages $(VENV)/.installed

system-packages:
	@scripts/ensure-system-packages

# The venv holds exactly the lock (requirements/dev.txt: every package at one version, with
# hashes) and ql3 itself, editable; it is built anew whenever the lock changes.
$(VENV)/.installed: $(LOCK) pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# `make lock` re-resolves the locks from pyproject.toml's ranges with uv, itself pinned and
# kept out of the project's venv. Commit the changed requirements/*.txt.
lock:
	$(PYTHON) -m venv .tmp/lock-tool
	.tmp/lock-tool/bin/pip install -q uv==$(UV_VERSION)
	$(UV_COMPILE) --extra all --extra dev -o $(LOCK)
	$(UV_COMPILE) --extra all --extra dev --extra bench -o $(BENCH_LOCK)

# The Node.js client test's packages, exactly as its package-lock.json pins them.
NODE_CLIENT := tests/clients/node
$(NODE_CLIENT)/node_modules/.package-lock.json: $(NODE_CLIENT)/package-lock.json
	cd $(NODE_CLIENT) && npm ci --no-audit --no-fund --loglevel=error

demo: setup
	$(PY) -m ql3.demo $(if $(DSN),--dsn '$(DSN)')

# pytest runs everything: pytest-postgresql starts a throwaway cluster (or uses
# QL3_TEST_DSN), tests/py/test_pgtap.py runs the pgTAP files through pg_prove against it,
# and tests/py/test_node_client.py the Node.js client test.
test: setup lint $(NODE_CLIENT)/node_modules/.package-lock.json
	$(BIN)/pytest -q tests/py

test-sql: setup
	$(BIN)/pytest -q tests/py/test_pgtap.py

test-py: setup $(NODE_CLIENT)/node_modules/.package-lock.json
	$(BIN)/pytest -q tests/py --ignore=tests/py/test_pgtap.py

# Failover under load with a primary and a streaming replica (tests/py/test_ha.py, marker
# ha): synchronous replication loses no acknowledged write and passes `ql3 verify`; the
# asynchronous run reports what it lost. `make test` runs it too.
test-ha: setup
	$(BIN)/pytest -q -m ha tests/py

lint: setup
	$(BIN)/sqlfluff lint --dialect postgres --processes 2 sql tests/sql
	$(BIN)/ruff check python tests bench examples
	$(BIN)/ruff format --check python tests bench examples
	$(BIN)/mypy

# Benchmarks start their own servers with PostgreSQL's durable defaults (fsync on), unlike
# the tests; set QL3_TEST_DSN / QL3_TEST_REDIS_URL to measure existing servers instead.
# The `bench` extra adds DBOS Transact, the peer the pairs benchmark is compared with.
bench: setup $(VENV)/.bench-installed
	$(PY) -m bench

$(VENV)/.bench-installed: $(BENCH_LOCK) $(VENV)/.installed
	$(BIN)/pip install -q --require-hashes --no-deps -r $(BENCH_LOCK)
	touch $@

# Development servers on loopback that outlive the command: PostgreSQL with a migrated
# database `ql3`, and Redis. db-up prints their settings (also in .tmp/devservers/env).
db-up: setup
	@$(PY) -m ql3.devservers up .tmp/devservers

# Stopping needs no install: without a venv, no development server can be running.
db-down:
	@if [ -x $(PY) ]; then $(PY) -m ql3.devservers down .tmp/devservers; fi

clean: db-down
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
