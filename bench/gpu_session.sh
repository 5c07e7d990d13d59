#!/usr/bin/env bash
# Everything a lent GPU session owes, in one call (the device tool's working-tree copy, repository root):
#   1. lay the tree out as installed (the machine's own jax / flax / optax; dsv32_jax.kernels needs that layout);
#   2. bench/kernels.py at L = 8K, 32K, 128K: timings beside the XLA references, each checked against them;
#   3. tests/test_kernels.py on the compiled kernels (DSV32_TEST_KERNELS_ON_GPU=1: impl pallas_gpu / mosaic_gpu),
#      fp32 references at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest).
#   4. step: bench/train_step.py, the small config's sparse-stage training step as users run it (the trainer's
#      compiled step on a 1-device mesh, MoE blocks scanned), with the kernels beside the plain-JAX reference step
#      and the dense stage, at STEP_CASES (mode:context[:flags]); STEP_CASE_S seconds per case, STEP_WARMUP untimed
#      (the first compiles) and STEP_STEPS timed steps.
#   5. gen: bench/generate.py, the small config's prefill and decode tokens/s at GEN_LEN (32K) context, bf16, with
#      GEN_ATTENTION (kernel = DSA with the Pallas kernels, sparse = DSA in plain JAX, dense).
#   6. profile: bench/profile_step.py, one traced train step / prefill per PROFILE_CASES at PROFILE_LAYERS layers,
#      the GPU kernels' time summed by name. STEP_ARGS / PROFILE_ARGS / GEN_ARGS: extra flags (e.g. --indexer_fp8).
# Results land in $OUT (bench: dsa_kernels.md/.json, step: train_step.json, gen: generate.json, logs). Stage time
# limits: BENCH_S, TEST_S, STEP_S, GEN_S seconds; STAGES picks and orders the stages (default "bench tests"), LENGTHS
# the bench's key lengths, TEST_K / TEST_ARGS the tests' -k / flags (TEST_K "a;b": a process per group, TEST_S each).
# TEST_TRIAGE "t1,t2;t3": for each group of TEST_K that fails or times out, bench/mgpu_triage.py over that group's
# targets (TRIAGE_S seconds; TRIAGE_ARGS extra flags): where its kernel goes wrong, in $OUT/triage.jsonl / .md.
# Stage calib: CALIB_TARGETS over CALIB_CASES through the same triage whether the tests passed or not (the FP8
# indexer's accumulator fit: "accumulator fit" lines in $OUT/triage.md).
# CALL_END (epoch seconds; bench/gpu_owed.sh sets it): every stage's limit is cut to end PACK_S (10) seconds before
# it, and a stage with under 5 s left is skipped, so the call ends by itself, before the device tool's limit. At the
# end, if $OUT holds more than OUT_FILES (8: what the device tool brings back) files, the logs go into logs.tar.
set -u
OUT=${OUT:-/tmp/dsv32_gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
# the installed layout (pyproject's package-dir) without pip: a copy of dsv32_jax/ with the mapped folders linked in
rm -rf /tmp/dsv32_site && mkdir -p /tmp/dsv32_site && cp -r dsv32_jax /tmp/dsv32_site/ \
  && ln -s "$PWD/pallas_kernels" /tmp/dsv32_site/dsv32_jax/kernels && ln -s "$PWD/train" /tmp/dsv32_site/dsv32_jax/train \
  && ln -s "$PWD/configs" /tmp/dsv32_site/dsv32_jax/configs || exit 1
export PYTHONPATH=/tmp/dsv32_site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # after carried wheels (--target dirs)
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  | tee -a "$OUT/device.txt"
limited() {  # limited NAME SECONDS CMD...: CMD under `timeout`, its limit cut to what CALL_END leaves (skipped: 124)
local name=$1 s=$2 left; shift 2
if [ -n "${CALL_END:-}" ]; then
  left=$(( CALL_END - $(date +%s) - ${PACK_S:-10} ))
  if [ "$left" -lt "$s" ]; then s=$left; fi
  if [ "$s" -lt 5 ]; then echo "$name: skipped, $s s left before the call's deadline (CALL_END)" >&2; return 124; fi
fi
timeout "$s" "$@"
}

bench() {
t0=$(date +%s)
limited bench "${BENCH_S:-330}" python3 bench/kernels.py --lengths "${LENGTHS:-8192,32768,131072}" ${BENCH_ARGS:-} \
  --out "$OUT/dsa_kernels" \
  >"$OUT/bench.log" 2>&1
echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; grep -v "^\s*$" "$OUT/bench.log" | grep -v "^|" | tail -40
}

tests() {  # TEST_K "a;b;c": one pytest process per -k group, each with its own TEST_S seconds and log (.N.log), so a
           # kernel that hangs or faults the device costs its own group, not the groups after it
local groups triage log t0 rc i=0 n k
IFS=';' read -ra groups <<< "${TEST_K:-not tpu and not benchmark_smoke}"
IFS=';' read -ra triage <<< "${TEST_TRIAGE:-}"
n=${#groups[@]}
for k in "${groups[@]}"; do
  log="$OUT/${TEST_LOG:-test_kernels_gpu.log}"
  if [ "$n" -gt 1 ]; then log="${log%.log}.$i.log"; fi
  t0=$(date +%s)
  DSV32_TEST_KERNELS_ON_GPU=1 JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false \
    limited "tests [$k]" "${TEST_S:-150}" bash -c "cd /tmp && python3 -m pytest -q -p no:cacheprovider \
    -c '$PWD/pyproject.toml' --rootdir '$PWD' '$PWD/tests/test_kernels.py' -k '$k' ${TEST_ARGS:--rA}" >"$log" 2>&1
  rc=$?
  echo "tests [$k] rc=$rc in $(( $(date +%s) - t0 )) s"
  grep -E "PASSED|FAILED|passed|failed|Error|assert|skipped, " "$log" | cut -c1-300 | tail -${TEST_TAIL:-25}
  if [ "$rc" != 0 ] && [ "$rc" != 5 ] && [ -n "${triage[$i]:-}" ]; then triage_group "${triage[$i]}"; fi
  i=$((i + 1))
done
}

triage_group() {  # the triage of one failed test group's kernels (bench/mgpu_triage.py): a JSON line per case start
                  # and end in $OUT/triage.jsonl (a hang leaves a start without an end), the table in $OUT/triage.md
local t0=$(date +%s)
limited "triage [$1]" "${TRIAGE_S:-90}" python3 bench/mgpu_triage.py --targets "$1" --out "$OUT/triage" \
  ${TRIAGE_ARGS:-} >>"$OUT/triage.log" 2>&1
echo "triage [$1] rc=$? in $(( $(date +%s) - t0 )) s"
# the table again from the record: a case that hung (or met the limit) has a start line and no end
timeout 30 python3 bench/mgpu_triage.py --report "$OUT/triage.jsonl" >"$OUT/triage.md.tmp" 2>/dev/null \
  && mv "$OUT/triage.md.tmp" "$OUT/triage.md"
rm -f "$OUT/triage.md.tmp"
grep -E "^- " "$OUT/triage.md" 2>/dev/null | cut -c1-600
}

calib() {  # CALIB_TARGETS over CALIB_CASES whatever the tests gave: the FP8 indexer's accumulator fitted to the
           # chip's logits on the shapes that failed on the H200 (issue 31 item 4), in CALIB_S seconds; the cases that
           # a failed group's triage already ended are not run again (mgpu_triage.py --skip_done)
[ -n "${CALIB_TARGETS:-}" ] || return 0
TRIAGE_S=${CALIB_S:-40} TRIAGE_ARGS="--cases ${CALIB_CASES:-heads,tokens} --skip_done ${CALIB_ARGS:-}" \
  triage_group "$CALIB_TARGETS"
}

pack() {  # the device tool brings back at most 8 files from $OUT: past OUT_FILES, the logs go into one tar
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt "${OUT_FILES:-8}" ] && ls "$OUT"/*.log >/dev/null 2>&1; then
  (cd "$OUT" && tar -rf logs.tar -- *.log && rm -f -- *.log) && echo "pack: the logs are in $OUT/logs.tar"
fi
}

step() {
t0=$(date +%s)
limited step "${STEP_S:-300}" python3 bench/train_step.py --scan --attention kernel --warmup "${STEP_WARMUP:-2}" --steps "${STEP_STEPS:-3}" \
  --timeout "${STEP_CASE_S:-200}" ${STEP_ARGS:-} \
  --cases "${STEP_CASES:-reference:8192,sparse:8192,dense:32768,sparse:32768,dense:65536,sparse:65536,sparse:131072}" \
  --out "$OUT/train_step.json" >"$OUT/step.log" 2>&1
echo "step rc=$? in $(( $(date +%s) - t0 )) s"; grep -E '^\||^longest|^\{"mode' "$OUT/step.log" | cut -c1-400 | tail -24
}

gen() {
t0=$(date +%s)
limited gen "${GEN_S:-240}" python3 bench/generate.py --config=small --prompt_len="${GEN_LEN:-32768}" --new_tokens=64 \
  --attention="${GEN_ATTENTION:-kernel,dense}" --modes=cache --dtype=bfloat16 --json="$OUT/generate.json" ${GEN_ARGS:-} \
  >"$OUT/gen.log" 2>&1
echo "gen rc=$? in $(( $(date +%s) - t0 )) s"; grep -v "^{" "$OUT/gen.log" | cut -c1-300 | tail -12
}

profile() {
t0=$(date +%s)
limited profile "${PROFILE_S:-200}" python3 bench/profile_step.py --layers "${PROFILE_LAYERS:-2}" ${PROFILE_ARGS:-} \
  --cases "${PROFILE_CASES:-train:kernel:8192,train:sparse:8192,prefill:kernel:32768}" --out "$OUT/profile.json" \
  >"$OUT/profile.log" 2>&1
echo "profile rc=$? in $(( $(date +%s) - t0 )) s"; grep -E "^==|^  " "$OUT/profile.log" | cut -c1-200
}

for stage in ${STAGES:-bench tests}; do "$stage"; done
echo; cat "$OUT/dsa_kernels.md" 2>/dev/null
pack
