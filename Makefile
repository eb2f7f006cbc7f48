# Two commands do all the set-up: `make demo` and `make test`. Both (re)create .venv as needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
COLOSSALAI := colossalai==0.5.0
DEMO_DIR ?= outputs/demo

.PHONY: venv demo demo-stream test clean-venv

venv: $(STAMP)

# Re-run only when the dependency lists change: seconds when nothing changed.
$(STAMP): requirements.txt setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first, pinned to the CPU build on disk when it is there; otherwise keep any torch>=2.6 already present
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.6"
	$(PY) -m pip install -q -r requirements.txt
	# colossalai pins torch<=2.5.1 / transformers==4.51.3 / diffusers==0.29.0 in its metadata: skip its deps
	$(PY) -m pip install -q --no-deps --no-build-isolation $(COLOSSALAI)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: venv
	$(PY) tools/run_demo.py --out $(DEMO_DIR)

# make demo's teacher (reused when make demo trained it) -> causal ODE init -> Self-Forcing -> streamed samples, scored
demo-stream: venv
	$(PY) tools/run_demo.py --stream --out $(DEMO_DIR)

test: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	# yapf (imported by mmengine) writes its grammar pickles on the first import of a fresh venv, not atomically: one
	# process writes them before two workers import it at once (the other read a half-written file: EOFError)
	$(PY) -c "import mmengine"
	# two workers, whole files each (module fixtures stay in one process): ~19 instead of ~26 min on 2 cores
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

clean-venv:
	rm -rf $(VENV)
