# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo lint bench drill clean

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
	$(VENV)/bin/ruff check sidecar shm_layout handler_shim capacity_router gateway_capacity tests examples drill
	$(VENV)/bin/mypy sidecar shm_layout handler_shim capacity_router gateway_capacity examples drill

# The upgrade drill, long form (a few minutes): real gunicorn, sidecar, router; writes the plot
# that docs/RELIABILITY.md shows. Its short form runs in `make test`.
drill: $(STAMP)
	$(PY) drill/upgrade_drill.py --plot docs/upgrade-drill.png

bench: $(STAMP)
	./scripts/ensure-tools --bench
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
