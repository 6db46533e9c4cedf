# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo lint bench clean schemas

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,lint,bench,plot]'
	touch $(STAMP)

test: $(STAMP)
	./scripts/ensure-tools
	$(PY) -m pytest -n auto -q

demo: $(STAMP)
	$(VENV)/bin/gateway-capacity demo

lint: $(STAMP)
	$(VENV)/bin/ruff check sidecar shm_layout handler_shim capacity_router gateway_capacity tests
	$(VENV)/bin/mypy sidecar shm_layout handler_shim capacity_router gateway_capacity

# the JSON Schemas of availability/inspect --json, generated from gateway_capacity/schemas.py
schemas: $(STAMP)
	$(PY) -m gateway_capacity.schemas docs/schemas

bench: $(STAMP)
	./scripts/ensure-tools --bench
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
