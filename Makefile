# One command checks everything: `make check` (what scripts/test and CI run).
# Run scripts/bootstrap first on a new machine; it creates .venv.

PY ?= .venv/bin/python
BIN := $(dir $(PY))

.PHONY: help check format format-check lint typecheck imports proto proto-check test test-unit bench-micro

help:  ## List the targets.
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

check: format-check lint typecheck imports proto-check test  ## Everything CI checks.

format:  ## Reformat the code.
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

format-check:  ## Fail when the code is not formatted.
	$(PY) -m ruff format --check .

lint:  ## ruff with the ASYNC, B, UP, SIM and RUF rules.
	$(PY) -m ruff check .

typecheck:  ## mypy (strict on kvcore).
	$(PY) -m mypy

imports:  ## import-linter: the layering contracts.
	$(BIN)lint-imports

proto:  ## Regenerate kvcore/pb from proto/.
	$(PY) scripts/gen_proto.py

proto-check:  ## Fail when kvcore/pb is not what proto/ generates.
	$(PY) scripts/gen_proto.py --check

test:  ## Every test: unit, integration (real NATS, etcd, PostgreSQL) and end to end.
	$(PY) -m pytest

test-unit:  ## Only the tests that need no servers.
	$(PY) -m pytest tests/unit

bench-micro:  ## The routing core's micro benchmarks, each figure beside its target.
	$(PY) -m bench.micro
