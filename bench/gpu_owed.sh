#!/usr/bin/env bash
# The measurements owed to the next task with a GPU (issue 31; BENCHMARKS.md, "On a GPU, 2026-11-28"), one device
# call each (each fits the 10-minute command limit; in order of value). 2026-11-28 measured the kernel table at 32K
# and 128K (one-pass top-k, both backwards) and the 4-layer step at 32K / 64K / 128K with every fast flag on.
#   bash bench/gpu_owed.sh 0   # the chip tests not reached (the Mosaic GPU sparse MLA forward first, then top-k /
#                                stored backward, the gathering producer, the FP8 indexer under the accumulator
#                                model, the sparse MLA gradients), then the kernel table at 8K (with the Mosaic GPU
#                                forward's row beside the Triton forward and XLA)
#   bash bench/gpu_owed.sh 1   # profile at 32K: the default kernel step beside the fast flags', dense, prefill
#   bash bench/gpu_owed.sh 2   # 4-layer step at 32K, the parts separated: defaults, + FP8 selection, + segment sum,
#                                the recomputing backward, dense
#   bash bench/gpu_owed.sh 3   # 4-layer step with remat=full + token_chunk: 64K with the defaults, dense at 128K
#   bash bench/gpu_owed.sh 4   # the model-level chip tests not reached yet, then the kernels' 32K prefill
#   bash bench/gpu_owed.sh 5   # the Mosaic GPU sparse MLA forward (mla_fwd_mgpu) in the 4-layer step at 32K and
#                                64K, beside the same step with the Triton forward, then a 32K profile of it
#   bash bench/gpu_owed.sh 6   # the backward's new paths (issue 31 item 3): the kernel table's sparse MLA rows at
#                                32K (stored, atomic, stored with the Mosaic GPU P / dS kernel), then the 4-layer step
#                                at 32K with stored / atomic / atomic + mla_pds_mgpu and at 64K with atomic
#   bash bench/gpu_owed.sh 7   # 32K profiles of the step with atomic, and with atomic + the Mosaic GPU P / dS kernel
# DRY=1 prints the environment of each call instead of running it. Carried wheels (.whl) are installed first, as
# the device README says. Results land in $OUT like bench/gpu_session.sh's.
set -u
call=${1:?usage: bash bench/gpu_owed.sh 0|1|2|3|4|5|6|7}
run() {
  if [ -n "${DRY:-}" ]; then echo "call $call: $*"; return; fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >/dev/null 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  env "$@" bash bench/gpu_session.sh
}
case $call in
  0) run STAGES=tests TEST_S=100 TEST_LOG=test_sparse_mla_mgpu_gpu.log \
       "TEST_K=sparse_mla_mgpu or sparse_mla_mosaic_gpu or sparse_mla_pds"
     run STAGES="tests bench" TEST_S=230 LENGTHS=8192 BENCH_S=160 \
       "TEST_K=topk or stored or sparse_mla_gradients or indexer_logits or gather_producer" ;;
  1) run STAGES=profile PROFILE_S=420 \
       PROFILE_CASES=train:kernel:32768,train:kernel:32768:kl_segment_sum+indexer_fp8,train:dense:32768,prefill:kernel:32768 ;;
  2) run STAGES=step STEP_S=560 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=105 "STEP_ARGS=--layers 4" \
       STEP_CASES=sparse:32768,sparse:32768:indexer_fp8,sparse:32768:indexer_fp8+kl_segment_sum,sparse:32768:indexer_fp8+kl_segment_sum+mla_bwd_recompute,dense:32768 ;;
  3) run STAGES=step STEP_S=560 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=230 \
       "STEP_ARGS=--layers 4 --remat=full --token_chunk=4096" STEP_CASES=sparse:65536,dense:131072 ;;
  4) run STAGES="tests gen" TEST_S=300 GEN_S=240 \
       "TEST_K=tiny_model_kernel or runs_the_indexer or decode_with_kernel or hf_long_golden or triton_kernels_lower" ;;
  5) run STAGES="step profile" STEP_S=385 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=95 \
       "STEP_ARGS=--layers 4 --remat=full --token_chunk=4096" \
       STEP_CASES=sparse:32768:indexer_fp8+kl_segment_sum,sparse:32768:indexer_fp8+kl_segment_sum+mla_fwd_mgpu,sparse:65536:indexer_fp8+kl_segment_sum,sparse:65536:indexer_fp8+kl_segment_sum+mla_fwd_mgpu \
       PROFILE_S=150 PROFILE_CASES=train:kernel:32768:kl_segment_sum+indexer_fp8+mla_fwd_mgpu ;;
  6) run STAGES="bench step" LENGTHS=32768 "BENCH_ARGS=--ops ^sparse_mla" BENCH_S=170 \
       STEP_S=390 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=95 "STEP_ARGS=--layers 4 --remat=full --token_chunk=4096" \
       STEP_CASES=sparse:32768:indexer_fp8+kl_segment_sum,sparse:32768:indexer_fp8+kl_segment_sum+mla_bwd_atomic,sparse:32768:indexer_fp8+kl_segment_sum+mla_bwd_atomic+mla_pds_mgpu,sparse:65536:indexer_fp8+kl_segment_sum+mla_bwd_atomic ;;
  7) run STAGES=profile PROFILE_S=300 \
       PROFILE_CASES=train:kernel:32768:kl_segment_sum+indexer_fp8+mla_bwd_atomic,train:kernel:32768:kl_segment_sum+indexer_fp8+mla_bwd_atomic+mla_pds_mgpu ;;
  *) echo "bench/gpu_owed.sh: no call $call (0-7)" >&2; exit 2 ;;
esac
