#!/usr/bin/env bash
# deviceless sm_90a compile of a probe: cc.sh TAG script.py args...   (dumps under ./dumps/TAG)
tag="$1"; shift
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../../.." && pwd)
BIN=$root/.venv-cuda/lib/python3.12/site-packages/nvidia/cu13/bin
d=$here/dumps/$tag; rm -rf "$d"; mkdir -p "$d/mosaic"
cd "$here" && JAX_PLATFORMS=cpu PATH=${PROBE_PATH:+$PROBE_PATH:}$BIN:$PATH PTXAS_LOG=$d/ptxas.log MOSAIC_GPU_DUMP_TO=$d/mosaic \
  XLA_FLAGS="--xla_gpu_enable_libnvptxcompiler=false --xla_gpu_enable_libnvjitlink=false" \
  "$root/.venv-cuda/bin/python" "$@"
