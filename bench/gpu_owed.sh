#!/usr/bin/env bash
# The measurements owed to the next task with a GPU (issue 31; BENCHMARKS.md, "Kernels in the sharded steps"), one
# device call each (each fits the 10-minute command limit; in order of value):
#   bash bench/gpu_owed.sh 0   # the kernel table at 8K / 32K / 128K (one-pass top-k; sparse MLA backward recompute
#                                beside stored) + the top-k and sparse MLA gradient chip tests
#   bash bench/gpu_owed.sh 1   # profile at 32K: kernel step (key-block skipping) beside kl_segment_sum, dense, prefill
#   bash bench/gpu_owed.sh 2   # 4-layer step at 32K: sparse (exact / segment_sum + FP8 selection) vs dense
#   bash bench/gpu_owed.sh 3   # 4-layer step at 64K and 128K with remat=full + token_chunk: sparse vs dense, fits?
#   bash bench/gpu_owed.sh 4   # the chip tests not reached yet + the FP8 indexer's under the accumulator model, then
#                                the kernels' 32K prefill
# DRY=1 prints the environment of each call instead of running it. Carried wheels (.whl) are installed first, as
# the device README says. Results land in $OUT like bench/gpu_session.sh's.
set -u
call=${1:?usage: bash bench/gpu_owed.sh 0|1|2|3|4}
run() {
  if [ -n "${DRY:-}" ]; then echo "call $call: $*"; return; fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >/dev/null 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  env "$@" bash bench/gpu_session.sh
}
case $call in
  0) run STAGES="bench tests" BENCH_S=380 TEST_S=180 "TEST_K=topk or sparse_mla_gradients or stored" ;;
  1) run STAGES=profile PROFILE_S=420 \
       PROFILE_CASES=train:kernel:32768,train:kernel:32768:kl_segment_sum+mla_bwd_stored,train:dense:32768,prefill:kernel:32768 ;;
  2) run STAGES=step STEP_S=520 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=170 "STEP_ARGS=--layers 4" \
       STEP_CASES=sparse:32768,sparse:32768:kl_segment_sum+indexer_fp8+mla_bwd_stored,dense:32768 ;;
  3) run STAGES=step STEP_S=560 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=185 \
       "STEP_ARGS=--layers 4 --remat=full --token_chunk=4096" \
       STEP_CASES=sparse:65536:kl_segment_sum+indexer_fp8+mla_bwd_stored,dense:65536,sparse:131072:kl_segment_sum+indexer_fp8+mla_bwd_stored ;;
  4) run STAGES="tests gen" TEST_S=300 GEN_S=240 \
       "TEST_K=tiny_model_kernel or runs_the_indexer or decode_with_kernel or hf_long_golden or triton_kernels_lower or indexer_logits" ;;
  *) echo "bench/gpu_owed.sh: no call $call (0-4)" >&2; exit 2 ;;
esac
