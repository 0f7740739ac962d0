# Quick start: `make demo` runs the main job, `make test` the whole suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test cts bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(PY) -m nnrt.demo

test: $(STAMP)
	$(PY) -m pytest -q

cts: $(STAMP)
	$(PY) -m nnrt.testing.cts ../shared/cts/V1_0 ../shared/cts/V1_1 ../shared/cts/V1_2

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
