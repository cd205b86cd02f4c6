# Everything runs from a fresh clone: the venv is created on first use.
#   make install   the package (editable) with the notebook and examples extras
#   make demo      a two-worker mesh on loopback running examples/grid_search.py
#   make test      the test suite (dev extra)
#   make bench     benchmarks/run.py
#   make clean     build and cache files (make distclean also removes .venv)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: venv install demo test bench clean distclean

venv: $(PY)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

install: $(PY)
	$(PIP) install -q -e '.[notebook,examples]'

demo: install
	$(PY) scripts/demo.py

test: $(PY)
	$(PIP) install -q -e '.[dev]'
	$(PY) -m pytest

bench: install
	$(PY) benchmarks/run.py

clean:
	rm -rf build dist .pytest_cache .ruff_cache .demo
	find . -path ./$(VENV) -prune -o -name '*.egg-info' -prune -exec rm -rf {} + \
		-o -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
