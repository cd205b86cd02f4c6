# Everything runs from a fresh clone: the venv is created on first use.
#   make install   the package (editable) with the notebook and examples extras
#   make demo      a two-worker mesh on loopback running examples/grid_search.py
#   make lint      ruff check src and tests, and mypy (its config in pyproject.toml names what it checks)
#   make test      the test suite (dev extra), on TEST_WORKERS=2 pytest-xdist workers
#   make test-engines  the conformance suite on the native mesh and the engines in ENGINES
#                      (default "dask ray"; CI runs ENGINES=dask)
#   make test-spawn    the integration, fault and conformance suites with every worker on
#                      the spawn runtime (GPUMESH_RUNTIME=spawn; see docs/architecture.md)
#   make test-docker  the Dockerfile and docker-compose.yaml built and run with podman
#                     (as root; apt-installs podman, podman-compose, debootstrap, runc)
#   make bench     benchmarks/run.py
#   make clean     build and cache files (make distclean also removes .venv)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: venv install demo lint test test-engines test-spawn test-docker bench clean distclean

venv: $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

# (installed once per change of pyproject.toml, as the dev extra below: a second
# `make demo` starts at once, and works offline)
INSTALLED := $(VENV)/.installed
$(INSTALLED): $(PY) pyproject.toml
	$(PIP) install -q -e '.[notebook,examples]'
	touch $@

install: $(INSTALLED)

demo: $(INSTALLED)
	$(PY) scripts/demo.py

# The package (editable) with the dev extra, installed once per change of pyproject.toml:
# CI's lint, test, test-spawn and test-docker would otherwise each pay pip's check (and an
# editable rebuild) again. Code changes need no reinstall (editable).
DEV := $(VENV)/.dev-installed
$(DEV): $(PY) pyproject.toml
	$(PIP) install -q -e '.[dev]'
	touch $@

# The dev extra pins ruff and mypy, so a new release cannot fail this on unchanged code.
lint: $(DEV)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

# The suite on TEST_WORKERS pytest-xdist workers (processes; 2 by default, the CI
# machine's cores): most integration tests wait on their coordinators and workers, so
# two run side by side in little more than the time of one. --dist loadfile keeps a
# module's tests (and its module-scoped mesh) on one worker; --no-loadscope-reorder
# hands modules out in collection order, which tests/conftest.py starts with the slowest.
# Every test runs in its own tmp dir, HOME and free port (tests/conftest.py).
# TEST_WORKERS=0 runs everything in this one process, as plain pytest does.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(DEV)
	$(PY) -m pytest $(XDIST)

# Workers started by these suites inherit GPUMESH_RUNTIME: the same tests, no fork.
# Left out (make test runs every one of them, on the fork runtime):
#  - test_winsurface: spawn already, whatever the variable;
#  - modules whose subject is not how a worker runs tasks: proxies, discovery, installs,
#    version checks, the CLI, doctor, the dashboard, the notebook caller, a dropped
#    link's heartbeats;
#  - the coordinator's side: /metrics, the pool views (their workers are HTTP requests,
#    no worker process at all), big request bodies, job status, fair-share order,
#    serve --tailscale/--public;
#  - the caller's side: routing and probe trust, the bounded wait with no worker alive
#    (faults/test_no_worker), a slow link's transfers (the agent's, not the task's);
#  - script jobs (test_scripts): Executor.run_script starts the script as a fresh
#    process on either runtime (SpawnExecutor inherits it);
#  - the examples (test_examples): their subject is what each example prints; functions
#    defined in a user's __main__ on spawn workers are test_cases' and the conformance
#    suite's (grid_search.py) subject.
SPAWN_SKIP := integration/test_winsurface integration/test_proxies integration/test_radar \
	integration/test_install_from_coordinator integration/test_python_skew \
	integration/test_version_skew integration/test_datadir_lock integration/test_doctor \
	integration/test_doctor_pool integration/test_cli integration/test_cli_more \
	integration/test_troubleshooting integration/test_dashboard_browser \
	integration/test_notebook integration/test_windows_details faults/test_network \
	integration/test_metrics integration/test_pool_views integration/test_streaming_body \
	integration/test_job_status integration/test_fair_share integration/test_reach \
	integration/test_routing integration/test_probe_trust faults/test_no_worker \
	integration/test_slow_link integration/test_scripts integration/test_examples
test-spawn: $(DEV)
	GPUMESH_RUNTIME=spawn $(PY) -m pytest $(XDIST) tests/integration tests/faults tests/conformance \
		$(foreach m,$(SPAWN_SKIP),--ignore=tests/$(m).py)

# The same decorator/.map tests on the native mesh, a Dask LocalCluster and a local Ray.
# NATIVE=0 leaves out the native variant: CI runs this right after make test, which ran
# exactly those tests (same runtime, same mesh); the engines' own tests still run.
ENGINES ?= dask ray
NATIVE ?= 1
comma := ,
empty :=
space := $(empty) $(empty)
test-engines: $(PY)
	$(PIP) install -q -e '.[dev,$(subst $(space),$(comma),$(strip $(ENGINES)))]'
	$(PY) -m pytest tests/conformance $(if $(filter 0,$(NATIVE)),-m "not native")

# A Debian base image from Debian packages (no Docker Hub needed), the image built on it,
# a pod and the compose file run from it (tests/docker/test_image.py).
CONTAINER_TOOLS := podman podman-compose debootstrap runc
test-docker: $(DEV)
	@missing=""; for t in $(CONTAINER_TOOLS); do command -v $$t >/dev/null 2>&1 || \
		[ -x /usr/sbin/$$t ] || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi
	GPUMESH_TEST_DOCKER=1 $(PY) -m pytest tests/docker -x -q

bench: $(PY)
	$(PIP) install -q -e '.[notebook,bench]'
	$(PY) benchmarks/run.py

clean:
	rm -rf build dist .pytest_cache .ruff_cache .mypy_cache .demo
	find . -path ./$(VENV) -prune -o -name '*.egg-info' -prune -exec rm -rf {} + \
		-o -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
