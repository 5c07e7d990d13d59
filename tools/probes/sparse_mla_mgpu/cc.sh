#!/usr/bin/env bash
# deviceless sm_90a compile of a probe: cc.sh TAG script.py args...   (dumps under ./dumps/TAG)
# PROBE_VENV (default .venv-cuda, jax 0.12): the venv whose jax compiles, e.g. .venv-cuda-lent (jax 0.11.2, the lent
# GPUs' version, which keeps setmaxnreg); ptxas comes from .venv-cuda either way (the lent venv shares its packages).
tag="$1"; shift
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../../.." && pwd)
BIN=$root/.venv-cuda/lib/python3.12/site-packages/nvidia/cu13/bin
d=$here/dumps/$tag; rm -rf "$d"; mkdir -p "$d/mosaic"
cd "$here" && JAX_PLATFORMS=cpu PATH=${PROBE_PATH:+$PROBE_PATH:}$BIN:$PATH PTXAS_LOG=$d/ptxas.log MOSAIC_GPU_DUMP_TO=$d/mosaic \
  XLA_FLAGS="--xla_gpu_enable_libnvptxcompiler=false --xla_gpu_enable_libnvjitlink=false" \
  "$root/${PROBE_VENV:-.venv-cuda}/bin/python" "$@"
