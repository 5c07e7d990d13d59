# dsv32-jax. `make train` runs the built-in demo (tiny config, CPU, built-in data); `make test` runs the tests.
# The virtualenv lives in .venv and is (re)built when pyproject.toml changes. PYTHON=... picks the interpreter.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: all venv test test-slow test-all train golden clean

all: test

$(STAMP): pyproject.toml
	@set -e; interp=$$(tools/find_python.sh); echo "using $$interp"; \
	  if [ ! -x $(PY) ]; then "$$interp" -m venv $(VENV); fi; \
	  $(PY) -m pip install -q --upgrade pip; \
	  $(PY) -m pip install -q -e '.[test]'; \
	  touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -n 2 --dist loadgroup --durations=15 $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# The paper's recipe in miniature: dense LM pre-training -> dense warm-up of the indexer (eq. 3) -> sparse
# training (eq. 4), then curves in runs/demo/curves.png. Re-running resumes (finished stages are skipped).
train: $(STAMP)
	$(PY) -m dsv32_jax.train.main --config=configs/dense_tiny.py --workdir=runs/demo/dense
	$(PY) -m dsv32_jax.train.main --config=configs/warmup_tiny.py --workdir=runs/demo/warmup
	$(PY) -m dsv32_jax.train.main --config=configs/sparse_tiny.py --workdir=runs/demo/sparse
	$(PY) -m dsv32_jax.train.plot runs/demo --out runs/demo/curves.png

# Regenerates tests/fixtures/hf_* with HF transformers (needs torch + transformers: pip install '.[hf]').
golden:
	$${HF_PYTHON:-$(PY)} tools/make_hf_golden.py --out tests/fixtures

clean:
	rm -rf $(VENV) .pytest_cache
