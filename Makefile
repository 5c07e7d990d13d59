# dsv32-jax. `make train` runs the built-in demo (tiny config, CPU, built-in data); `make test` runs the tests.
# The virtualenv lives in .venv and is (re)built when pyproject.toml changes. PYTHON=... picks the interpreter.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

VENV_CUDA := .venv-cuda
PY_CUDA := $(VENV_CUDA)/bin/python
STAMP_CUDA := $(VENV_CUDA)/.installed

# The jax of the lent GPUs (the device notes: jax 0.11.2 with CUDA 13), where the owed chip runs happen.
LENT_JAX ?= 0.11.2
VENV_LENT := .venv-cuda-lent
PY_LENT := $(VENV_LENT)/bin/python
STAMP_LENT := $(VENV_LENT)/.installed-$(LENT_JAX)

VENV_TPU := .venv-tpu
PY_TPU := $(VENV_TPU)/bin/python
STAMP_TPU := $(VENV_TPU)/.installed

.PHONY: all venv venv-cuda venv-tpu test test-heavy test-slow test-all test-gpu-compile gpu-compile-table \
	venv-cuda-lent test-gpu-compile-lent gpu-tile-sweep test-tpu-compile tpu-compile-table test-step-compile train agent-demo golden clean

all: test

$(STAMP): pyproject.toml
	@set -e; interp=$$(tools/find_python.sh); echo "using $$interp"; \
	  if [ ! -x $(PY) ]; then "$$interp" -m venv $(VENV); fi; \
	  $(PY) -m pip install -q --upgrade pip; \
	  $(PY) -m pip install -q -e '.[test]'; \
	  touch $(STAMP)

venv: $(STAMP)

# Compile-only CUDA venv for the deviceless H100 compile (no GPU needed): jax[cuda13] at the same jax version as
# .venv, nvdisasm for SASS, and tools/gpu_compile/ptxas_wrapper.sh in front of ptxas (it logs `ptxas -v`).
$(STAMP_CUDA): pyproject.toml $(STAMP) tools/gpu_compile/ptxas_wrapper.sh
	@set -e; interp=$$(tools/find_python.sh); jaxv=$$($(PY) -c 'import jax; print(jax.__version__)'); \
	  if [ ! -x $(PY_CUDA) ]; then "$$interp" -m venv $(VENV_CUDA); fi; \
	  $(PY_CUDA) -m pip install -q --upgrade pip; \
	  $(PY_CUDA) -m pip install -q -e . "jax[cuda13]==$$jaxv" nvidia-cuda-nvdisasm; \
	  bin=$$($(PY_CUDA) -c 'import nvidia, os; print(next(os.path.join(p, "cu13", "bin") for p in nvidia.__path__ if os.path.exists(os.path.join(p, "cu13", "bin", "ptxas"))))'); \
	  if [ ! -f "$$bin/ptxas.real" ]; then mv "$$bin/ptxas" "$$bin/ptxas.real"; fi; \
	  cp tools/gpu_compile/ptxas_wrapper.sh "$$bin/ptxas"; chmod +x "$$bin/ptxas"; \
	  touch $(STAMP_CUDA)

venv-cuda: $(STAMP_CUDA)

# Every Pallas GPU kernel (forward and backward) compiled for an H100 at production and tiny shapes, no GPU:
# fails on a lowering/compile error, shared memory over 90%, register spills, or a missing FP8 wgmma. CI runs the
# subset GPU_COMPILE_ARGS picks (default: the CI subset, all but one model-level case, see
# tools/gpu_compile/gpu_compile.py); `make gpu-compile-table` runs them all.
GPU_COMPILE_ARGS ?= --subset ci
test-gpu-compile: $(STAMP_CUDA)
	$(PY_CUDA) tools/gpu_compile/gpu_compile.py --check --json runs/gpu_compile.json $(GPU_COMPILE_ARGS)

# The same, and the per-kernel table written into BENCHMARKS.md.
gpu-compile-table: $(STAMP_CUDA)
	$(PY_CUDA) tools/gpu_compile/gpu_compile.py --check --json runs/gpu_compile.json --benchmarks BENCHMARKS.md

# The same compile check under the lent GPUs' jax (LENT_JAX, older than CI's): an overlay venv holding only that
# jax, jaxlib and CUDA plugin, which takes everything else (nvidia wheels, the ptxas wrapper, flax, the editable
# install) from .venv-cuda. A kernel that compiles on CI's jax and not on the chip's fails here, before a device
# call is spent on it (2026-11-28: the atomic backward's mask, which jax 0.11.2's Triton lowering does not broadcast).
$(STAMP_LENT): $(STAMP_CUDA)
	@set -e; interp=$$(tools/find_python.sh); rm -rf $(VENV_LENT); "$$interp" -m venv $(VENV_LENT); \
	  $(PY_LENT) -m pip install -q --no-deps "jax==$(LENT_JAX)" "jaxlib==$(LENT_JAX)" \
	    "jax-cuda13-plugin==$(LENT_JAX)" "jax-cuda13-pjrt==$(LENT_JAX)"; \
	  own=$$($(PY_LENT) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  base=$$($(PY_CUDA) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  echo "$$base" > "$$own/0_venv_cuda.pth"; cp "$$base"/__editable__.dsv32_jax*.pth "$$own/"; \
	  test "$$($(PY_LENT) -c 'import jax; print(jax.__version__)')" = "$(LENT_JAX)"; \
	  touch $(STAMP_LENT)

venv-cuda-lent: $(STAMP_LENT)

# Every case (LENT_COMPILE_ARGS narrows it). Not in CI (about 30 minutes of a 2-core CI's time beside the heavy
# suite): run it by hand when a GPU kernel changes and before a device session (BUILD.md).
LENT_COMPILE_ARGS ?=
test-gpu-compile-lent: $(STAMP_LENT)
	$(PY_LENT) tools/gpu_compile/gpu_compile.py --check --json runs/gpu_compile_lent.json $(LENT_COMPILE_ARGS)

# The sparse MLA Triton forward and the stored backward's two kernels at every candidate tile (deviceless, about 5
# minutes): what compiles for sm_90a without spills or mma.sync goes to bench/tile_sweep_h100.json, which
# `bench/kernels.py --tile_sweep` times on a chip (bench/gpu_owed.sh 1).
gpu-tile-sweep: $(STAMP_CUDA)
	$(PY_CUDA) tools/gpu_compile/gpu_compile.py --sweep bench/tile_sweep_h100.json

# Compile-only TPU venv for the deviceless TPU compile (no TPU needed): jax[tpu] (libtpu from PyPI) at the same jax
# version as .venv. When the libtpu that jax[tpu] pins is not in the package index yet (2026-12-06: jax 0.12.1 pins
# libtpu 0.0.53, the index ends at 0.0.52), the same jax with the newest libtpu there (0.0.52 compiles jax 0.12.1's
# Mosaic kernels); the versions used are printed.
$(STAMP_TPU): pyproject.toml $(STAMP)
	@set -e; interp=$$(tools/find_python.sh); jaxv=$$($(PY) -c 'import jax; print(jax.__version__)'); \
	  if [ ! -x $(PY_TPU) ]; then "$$interp" -m venv $(VENV_TPU); fi; \
	  $(PY_TPU) -m pip install -q --upgrade pip; \
	  if ! $(PY_TPU) -m pip install -q -e . "jax[tpu]==$$jaxv"; then \
	    echo "jax[tpu]==$$jaxv did not install (its pinned libtpu is not in the index?): jax $$jaxv with the newest libtpu there"; \
	    $(PY_TPU) -m pip install -q -e . "jax==$$jaxv" "jaxlib==$$jaxv" libtpu; \
	  fi; \
	  $(PY_TPU) -c 'import importlib.metadata as m; print("TPU venv: jax", m.version("jax"), "libtpu", m.version("libtpu"))'; \
	  touch $(STAMP_TPU)

venv-tpu: $(STAMP_TPU)

# Every Mosaic TPU kernel (forward and backward) compiled for TPU v5p and v6e, no TPU: fails on a compile error,
# scoped VMEM over budget, or an oversized negative control that compiles. CI runs the subset TPU_COMPILE_ARGS
# picks (default: the CI subset, see tools/tpu_compile/tpu_compile.py); `make tpu-compile-table` runs them all.
TPU_COMPILE_ARGS ?= --subset ci
test-tpu-compile: $(STAMP_TPU)
	$(PY_TPU) tools/tpu_compile/tpu_compile.py --check --json runs/tpu_compile.json $(TPU_COMPILE_ARGS)

# The full matrix, and the per-kernel table and TPU roofline written into BENCHMARKS.md.
tpu-compile-table: $(STAMP_TPU)
	$(PY_TPU) tools/tpu_compile/tpu_compile.py --check --json runs/tpu_compile.json --benchmarks BENCHMARKS.md

# Whole sharded train steps with attention="kernel", compiled without devices for the chip the mesh is made of: the
# tiny sparse and warm-up steps on a 4-chip v5p slice (fsdp:2,tensor:2) and the tiny sparse step on 8 H100s
# (fsdp:2,tensor:2,seq:2); each fails if the compiled program holds no Pallas kernel, and the negative control (the
# same TPU step with the plain-JAX attention) must fail that check. Then the 671B recipes' data layout on a
# 2048-chip v5p (512 hosts): the block of batch rows each host loads (bench/row_blocks.py; fails if one is no block).
STEP_COMPILE := bench/abstract_step.py --compile --layers=2 --require_kernels
test-step-compile: $(STAMP_TPU) $(STAMP_CUDA)
	@set -eo pipefail; mkdir -p runs; t0=$$(date +%s); \
	  $(PY_TPU) $(STEP_COMPILE) --config=sparse_tiny --platform=tpu --topology=v5p:2x2x1 --mesh=fsdp:2,tensor:2 --attention=kernel 2>&1 | grep -E "^(sparse|warmup|lowered|compiled|Pallas|FAILED)"; \
	  $(PY_TPU) $(STEP_COMPILE) --config=warmup_tiny --platform=tpu --topology=v5p:2x2x1 --mesh=fsdp:2,tensor:2 --attention=kernel 2>&1 | grep -E "^(sparse|warmup|lowered|compiled|Pallas|FAILED)"; \
	  $(PY_CUDA) $(STEP_COMPILE) --config=sparse_tiny --platform=gpu --mesh=fsdp:2,tensor:2,seq:2 --attention=kernel 2>&1 | grep -E "^(sparse|warmup|lowered|compiled|Pallas|FAILED)"; \
	  if $(PY_TPU) $(STEP_COMPILE) --config=sparse_tiny --platform=tpu --topology=v5p:2x2x1 --mesh=fsdp:2,tensor:2 --attention=sparse > runs/step_compile_negative.log 2>&1; then \
	    echo "FAILED: the negative control (attention=sparse) passed --require_kernels"; exit 1; fi; \
	  grep -E "^FAILED" runs/step_compile_negative.log; \
	  for c in sparse_671b_v5p warmup_671b; do \
	    $(PY_TPU) bench/row_blocks.py --config=$$c --topology=v5p:16x16x8 2>&1 | grep -E "^($$c|FAILED)"; done; \
	  echo "test-step-compile: ok in $$(( $$(date +%s) - t0 )) s"

# The fast suite (< 15 min on 2 cores); `make test-heavy` the integration checks CI also runs; `make test-slow` the
# learning demos and production-size checks (hours in all).
test: $(STAMP)
	$(PY) -m pytest -m "not slow and not heavy" -n 2 --dist loadgroup --durations=15 $(PYTEST_ARGS)

test-heavy: $(STAMP)
	$(PY) -m pytest -m "heavy and not slow" -n 2 --dist loadgroup --durations=15 $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# The paper's recipe in miniature: dense LM pre-training -> dense warm-up of the indexer (eq. 3) -> sparse
# training (eq. 4), then curves in runs/demo/curves.png and the held-out table (dense vs DSA-adapted model) in
# runs/demo/eval.md. Re-running resumes (finished stages are skipped).
train: $(STAMP)
	$(PY) -m dsv32_jax.train.main --config=configs/dense_tiny.py --workdir=runs/demo/dense
	$(PY) -m dsv32_jax.train.main --config=configs/warmup_tiny.py --workdir=runs/demo/warmup
	$(PY) -m dsv32_jax.train.main --config=configs/sparse_tiny.py --workdir=runs/demo/sparse
	$(PY) -m dsv32_jax.train.plot runs/demo --out runs/demo/curves.png
	$(PY) -m dsv32_jax.train.eval --workdirs=runs/demo/dense,runs/demo/warmup,runs/demo/sparse --seq_lens=128,512 \
	  --batches=8 --out=runs/demo/eval

# Agentic post-training on CPU (configs/agent_lookup.py): recall (copying) stage, cold start on the lookup
# environment's demonstrations, GRPO over multi-turn tool trajectories; curves in runs/agent/lookup/curves.png, the
# three evaluations (before training, after the cold start, after GRPO) as a table at the end.
# AGENT_DEMO_ARGS: extra flags, e.g. AGENT_DEMO_ARGS="--config.seed=3" AGENT_DEMO_DIR=runs/agent/lookup_s3.
AGENT_DEMO_DIR ?= runs/agent/lookup
AGENT_DEMO_ARGS ?=
agent-demo: $(STAMP)
	@echo "agent-demo: about 20 minutes on 2 CPU cores (18-20 measured on one core: recall ~9.5, cold start ~8, 10 GRPO steps and evaluations ~2), longer beside other jobs; BENCHMARKS.md, 'make agent-demo over seeds ... the cosine cold start'"
	$(PY) -m dsv32_jax.train.main --config=configs/agent_lookup.py --workdir=$(AGENT_DEMO_DIR) $(AGENT_DEMO_ARGS)
	$(PY) -m dsv32_jax.train.plot $(AGENT_DEMO_DIR) --out $(AGENT_DEMO_DIR)/curves.png
	$(PY) -m dsv32_jax.train.agent_report $(AGENT_DEMO_DIR)

# Regenerates tests/fixtures/hf_* with HF transformers (needs torch + transformers: pip install '.[hf]').
golden:
	$${HF_PYTHON:-$(PY)} tools/make_hf_golden.py --out tests/fixtures
	$${HF_PYTHON:-$(PY)} tools/make_hf_v3_fixture.py

clean:
	rm -rf $(VENV) $(VENV_CUDA) $(VENV_LENT) $(VENV_TPU) .pytest_cache
