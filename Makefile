# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo lint bench soak clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,lint,bench]'
	touch $(STAMP)

test: $(STAMP)
	./scripts/ensure-tools
	$(PY) -m pytest -n auto -q

demo: $(STAMP)
	$(VENV)/bin/gateway-capacity demo

lint: $(STAMP)
	$(VENV)/bin/ruff check sidecar shm_layout handler_shim capacity_router gateway_capacity tests
	$(VENV)/bin/mypy sidecar shm_layout handler_shim capacity_router gateway_capacity

# The chaos soak, long form (minutes; a short form runs in `make test`). SOAK_SECONDS to change.
SOAK_SECONDS ?= 240
soak: $(STAMP)
	$(PY) tests/soak/soak.py --seconds $(SOAK_SECONDS) --workers 12 --hammers 2

bench: $(STAMP)
	./scripts/ensure-tools --bench
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
