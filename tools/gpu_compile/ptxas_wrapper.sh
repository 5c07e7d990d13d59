#!/usr/bin/env bash
# Installed as nvidia/cu13/bin/ptxas in the compile-only venv (.venv-cuda, `make venv-cuda`); the real binary is
# ptxas.real beside it. With PTXAS_LOG set it adds -v and writes the resource report (registers, spills) to
# PTXAS_LOG.<time>.<pid>, and copies the PTX it assembles next to it, so tools/gpu_compile/gpu_compile.py can read
# both. Without PTXAS_LOG it is the real ptxas.
real="$(dirname "$0")/ptxas.real"
if [ -z "${PTXAS_LOG:-}" ]; then exec "$real" "$@"; fi
prev=""
for arg in "$@"; do  # the input PTX: the first existing file argument that is not the -o output
  if [ "$prev" != "-o" ] && [ -f "$arg" ] && head -c 4096 "$arg" | grep -q "\.target"; then
    cp "$arg" "$(dirname "$PTXAS_LOG")/ptx_$(date +%s%N)_$$.ptx"; break
  fi
  prev="$arg"
done
# one report file per invocation (XLA runs several ptxas at once): $PTXAS_LOG.<time>.<pid>. The report also goes on
# to the caller's stderr: Mosaic GPU in jax 0.11.2 keeps it as its kernel's .ptxas dump, and learns the PTX ISA
# version from the error message of a ptxas run it makes fail on purpose.
log="$PTXAS_LOG.$(date +%s%N).$$"
exec 3>&1
"$real" -v "$@" 2>&1 1>&3 3>&- | tee "$log" >&2
exit "${PIPESTATUS[0]}"
