#!/usr/bin/env bash
# The thinking-retention ablation (BENCHMARKS.md, "Agentic post-training") once per run: `make agent-demo`'s recipe
# (configs/agent_lookup.py) in thinking mode, once with reasoning kept across tool calls (drop_thinking=after_user,
# V3.2) and once dropped at every turn (every_turn, R1), evaluated greedily after the cold start at the recipe's
# 512-slot cache and at a 384-slot one (config.agent.eval_capacities), one GRPO step; then each arm's figures as
# min / median / max over the runs. A run is a seed (config.seed) or `Np`: seed N with config.init_perturb=1e-6.
# The two arms of a run go side by side, each pinned to one core when the machine has two or more (taskset):
#   tools/thinking_sweep.sh 0 1 2        # SWEEP_DIR (runs/thinking_sweep); about 30 min a run on 2 cores
# Runs resume when rerun (the learner's checkpoints). Exit status: non-zero when a run failed.
set -u
source "$(dirname "$0")/run_spec.sh"
py=${PY:-.venv/bin/python}
out=${SWEEP_DIR:-runs/thinking_sweep}
[ $# -ge 1 ] || { echo "usage: tools/thinking_sweep.sh RUN [RUN...]  (RUN: a seed N, or Np for seed N perturbed)" >&2; exit 2; }
pin() { if command -v taskset > /dev/null && [ "$(nproc)" -ge 2 ]; then taskset -c "$1" "${@:2}"; else "${@:2}"; fi; }
arms=(after_user every_turn)
for run in "$@"; do
  run_spec tools/thinking_sweep.sh "$run" || exit 2
  start=$(date +%s)
  pids=()
  for i in 0 1; do
    dir=$out/${arms[$i]}/$run
    mkdir -p "$dir"
    pin "$i" "$py" -m dsv32_jax.train.main --config=configs/agent_lookup.py --workdir="$dir" --config.seed="$seed" \
      --config.agent.thinking=True --config.agent.max_new_tokens=48 --config.agent.drop_thinking="${arms[$i]}" \
      --config.agent.eval_capacities="(384,)" --config.steps=1 "${perturb[@]}" > "$dir/log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    wait "${pids[$i]}"; rc=$?
    echo "run $run ${arms[$i]}: exit $rc in $(( $(date +%s) - start )) s ($out/${arms[$i]}/$run/log)"
    [ $rc -eq 0 ] || exit $rc
  done
done
for arm in "${arms[@]}"; do
  echo "drop_thinking=$arm"
  "$py" -m dsv32_jax.train.agent_report --metrics=pre_eval_success,pre_eval_context_tokens/lookup,pre_eval_model_tokens/lookup,pre_eval_segments/lookup,pre_eval_success_cap384,pre_eval_context_full_cap384/lookup,eval_success \
    $(for run in "$@"; do echo "$out/$arm/$run"; done) || exit $?
done
