# One command checks everything: `make check` (what scripts/test and CI run).
# Run scripts/bootstrap first on a new machine; it creates .venv.

PY ?= .venv/bin/python
BIN := $(dir $(PY))

.PHONY: help check format format-check lint typecheck imports proto proto-check docs native clean-native test test-unit bench-micro check-integrations

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

typecheck:  ## mypy (strict on kvcore and kvruntime).
	$(PY) -m mypy

imports:  ## import-linter: the layering contracts.
	$(BIN)lint-imports

proto:  ## Regenerate kvcore/pb from proto/.
	$(PY) scripts/gen_proto.py

proto-check:  ## Fail when kvcore/pb is not what proto/ generates.
	$(PY) scripts/gen_proto.py --check

docs:  ## Regenerate docs/configuration.md and docs/admin-api.md from the code (pytest checks them).
	$(PY) scripts/gen_docs.py

native:  ## Compile the proxy's request path with mypyc (dataplane/native.py) when a source changed.
	@$(PY) -m dataplane.native --quiet || { \
	  echo "native: compiling $$($(PY) -c 'import dataplane.native as n; print(*n.MODULES)')"; \
	  find dataplane kvcore -name "*.so" -delete && KVROUTE_NATIVE=1 $(PY) setup.py -q build_ext --inplace --force \
	    >build-native.log 2>&1 || { cat build-native.log; exit 1; }; rm -f build-native.log; }

clean-native:  ## Remove the compiled modules: the proxy runs from source.
	find dataplane kvcore -name "*.so" -delete

test: native  ## Every test: unit, integration (real NATS, etcd, PostgreSQL) and end to end.
	$(PY) -m pytest

test-unit: native  ## Only the tests that need no servers.
	$(PY) -m pytest tests/unit

INTEGRATIONS := .venv-integrations
check-integrations:  ## LiteLLM and guidellm against kvroute up, offline (own venv: several GB, guidellm needs torch).
	@test -x $(INTEGRATIONS)/bin/python || $(PY) -m venv $(INTEGRATIONS)
	@want=$$(sha256sum pyproject.toml | cut -d' ' -f1); \
	if [ "$$(cat $(INTEGRATIONS)/.installed 2>/dev/null)" != "$$want" ]; then \
	  echo "check-integrations: installing kvroute[integrations] into $(INTEGRATIONS)"; \
	  $(INTEGRATIONS)/bin/python -m pip install -q -e '.[integrations]' && echo "$$want" > $(INTEGRATIONS)/.installed; \
	fi
	$(INTEGRATIONS)/bin/python -m pytest -q tests/unit/enginesim/test_sim_model_files.py  # with transformers
	cd integrations && ../$(INTEGRATIONS)/bin/python -m pytest -c pytest.ini .

bench-micro:  ## The routing core's micro benchmarks, each figure beside its target.
	$(PY) -m bench.micro
