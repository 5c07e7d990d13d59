#!/usr/bin/env bash
# The measurements owed to the next task with a GPU (issue 31; BENCHMARKS.md, "On a GPU, 2026-11-28"), one device
# call each (each fits the 10-minute command limit), in order of value: a session's 15 minutes of device time hold
# about one call and a half, so call 0 alone should settle the most. 2026-11-28 measured the kernel table at 32K and
# 128K (one-pass top-k, both backwards) and the 4-layer step at 32K / 64K / 128K with every fast flag on.
#   bash bench/gpu_owed.sh 0   # the chip tests of the kernels never run on a chip (the Mosaic GPU sparse MLA forward
#                                and its gathering producer, the Mosaic GPU P / dS and dq / dkv kernels, the atomic
#                                backward, the FP8 indexer under the accumulator model), then the kernel table's
#                                sparse MLA rows at 32K: the forwards (Triton, Mosaic GPU split and ping-pong), the
#                                stored / atomic / Mosaic GPU backwards, and
#                                each backward cut into its kernels (the stage rows: where the backward's time goes)
#   bash bench/gpu_owed.sh 1   # the tiles at 32K: each Triton forward, P / dS and dq / dkv tile that compiles for
#                                sm_90a without spills or mma.sync (bench/tile_sweep_h100.json, tools/gpu_compile
#                                --sweep: 6, 14 and 23 candidates) timed, then both backwards at the fastest
#   bash bench/gpu_owed.sh 2   # the atomic backward in the 4-layer step: 32K beside stored, and 64K
#   bash bench/gpu_owed.sh 3   # a 32K profile of the step with the atomic backward
#   bash bench/gpu_owed.sh 4   # the other chip tests not reached (top-k, stored backward, sparse MLA gradients), then
#                                the indexer / top-k rows at 8K (item 4's 8K rate; the k_steps=8 row) and 32K
#   bash bench/gpu_owed.sh 5   # profile at 32K: the default kernel step beside the fast flags', dense, prefill
#   bash bench/gpu_owed.sh 6   # 4-layer step at 32K, the parts separated: defaults, + FP8 selection, + segment sum,
#                                the recomputing backward, dense
#   bash bench/gpu_owed.sh 7   # 4-layer step with remat=full + token_chunk: 64K with the defaults, dense at 128K
#   bash bench/gpu_owed.sh 8   # the model-level chip tests not reached yet, then the kernels' 32K prefill
# Call 0's never-run kernels are tested one kernel per process (gpu_session.sh: TEST_K groups split by ';', 35 s each,
# -vv names each test as it starts), so a kernel that hangs or faults the device costs its own group only.
# No step call times the Mosaic GPU forward or P / dS kernel: the small config's heads are padded for them (to 32 by
# their keys-as-M forms), so the kernel table's 128-head rows and its 32-head rows (call 0: `fwd (..., 32 heads)`,
# the P / dS stage at 32 heads) are their fair test (BENCHMARKS.md, "Head padding").
# Call 0 triages each group of never-run kernels whose tests fail or hang, the atomic backward's and the FP8 indexer's
# too (TEST_TRIAGE: bench/mgpu_triage.py, a ladder of cases from one token and one key block to the tests' shape, with
# where each goes wrong: $OUT/triage.md), so the session after a failure can debug on a CPU. The indexer's triage fits
# the accumulator model to the chip's logits; its calib stage runs that fit on the two small shapes that failed on the
# H200 even when the tests pass (about 20 s). Every call ends by itself CALL_S (565) seconds after it starts
# (gpu_session.sh's CALL_END: each stage's limit is cut to fit, and the logs are packed into one tar when $OUT would
# hold more files than the device tool brings back); run it with timeout_s 600.
# DRY=1 prints the environment of each call instead of running it. Carried wheels (.whl) are installed first, as
# the device README says. Results land in $OUT like bench/gpu_session.sh's.
set -u
call=${1:?usage: bash bench/gpu_owed.sh 0|1|2|3|4|5|6|7|8}
export CALL_END=${CALL_END:-$(( $(date +%s) + ${CALL_S:-565} ))}
run() {
  if [ -n "${DRY:-}" ]; then echo "call $call: $*"; return; fi
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      >/dev/null 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  env "$@" bash bench/gpu_session.sh
}
case $call in
  0) run STAGES=tests TEST_S=35 TEST_LOG=test_new_kernels_gpu.log "TEST_ARGS=-rA -vv" TRIAGE_S=75 \
       "TEST_K=sparse_mla_mgpu or sparse_mla_mosaic_gpu;sparse_mla_pds;sparse_mla_dqkv;gather_producer" \
       "TEST_TRIAGE=echo-split,echo-pp,echo-block,fwd,fwd-pp,fwd-t;echo-split,echo-block,pds,pds-t;echo-slice,echo-slice32,dqkv,dqkv-t;gather"
     run STAGES="tests calib bench" TEST_S=70 "TEST_K=atomic;indexer_logits" "TEST_TRIAGE=atomic;idx,idx-64,idx-k2,idx-k8" \
       TRIAGE_S=60 CALIB_TARGETS=idx CALIB_S=40 \
       LENGTHS=32768 "BENCH_ARGS=--ops ^sparse_mla.(fwd|bwd.\()" BENCH_S=300 ;;
  1) run STAGES=bench LENGTHS=32768 BENCH_S=480 \
       "BENCH_ARGS=--ops ^sparse_mla.(fwd|bwd.\((stored|atomic)\))(.tiles)?$ --tile_sweep bench/tile_sweep_h100.json" ;;
  2) run STAGES=step STEP_S=390 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=95 "STEP_ARGS=--layers 4 --remat=full --token_chunk=4096" \
       STEP_CASES=sparse:32768:indexer_fp8+kl_segment_sum,sparse:32768:indexer_fp8+kl_segment_sum+mla_bwd_atomic,sparse:65536:indexer_fp8+kl_segment_sum+mla_bwd_atomic ;;
  3) run STAGES=profile PROFILE_S=200 PROFILE_CASES=train:kernel:32768:kl_segment_sum+indexer_fp8+mla_bwd_atomic ;;
  4) run STAGES="tests bench" TEST_S=230 "TEST_K=topk or stored or sparse_mla_gradients" \
       LENGTHS=8192,32768 "BENCH_ARGS=--ops ^(indexer|topk|hadamard)" BENCH_S=300 ;;
  5) run STAGES=profile PROFILE_S=420 \
       PROFILE_CASES=train:kernel:32768,train:kernel:32768:kl_segment_sum+indexer_fp8,train:dense:32768,prefill:kernel:32768 ;;
  6) run STAGES=step STEP_S=560 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=105 "STEP_ARGS=--layers 4" \
       STEP_CASES=sparse:32768,sparse:32768:indexer_fp8,sparse:32768:indexer_fp8+kl_segment_sum,sparse:32768:indexer_fp8+kl_segment_sum+mla_bwd_recompute,dense:32768 ;;
  7) run STAGES=step STEP_S=560 STEP_WARMUP=1 STEP_STEPS=2 STEP_CASE_S=230 \
       "STEP_ARGS=--layers 4 --remat=full --token_chunk=4096" STEP_CASES=sparse:65536,dense:131072 ;;
  8) run STAGES="tests gen" TEST_S=300 GEN_S=240 \
       "TEST_K=tiny_model_kernel or runs_the_indexer or decode_with_kernel or hf_long_golden or triton_kernels_lower" ;;
  *) echo "bench/gpu_owed.sh: no call $call (0-8)" >&2; exit 2 ;;
esac
