#!/usr/bin/env bash
# A GRPO recipe once per run and its greedy evaluation accuracy (metric eval_accuracy, every grpo.eval_every steps)
# as min / median / max over the runs at each evaluated step, so that the accuracy BENCHMARKS.md quotes is not one
# run's draw. A run is a seed (config.seed: initialization, prompts and sampling keys) or `Np`: seed N with
# config.init_perturb=1e-6 (a start as another CPU's float rounding would make it):
#   tools/grpo_sweep.sh 0 1 2 3 0p             # CONFIG (configs/grpo_sum_tiny.py), SWEEP_DIR (runs/grpo_sweep)
# Runs resume when rerun (the learner's checkpoints). Exit status: non-zero when a run failed.
set -u
source "$(dirname "$0")/run_spec.sh"
py=${PY:-.venv/bin/python}
config=${CONFIG:-configs/grpo_sum_tiny.py}
out=${SWEEP_DIR:-runs/grpo_sweep}
[ $# -ge 2 ] || { echo "usage: tools/grpo_sweep.sh RUN RUN [RUN...]  (RUN: a seed N, or Np for seed N perturbed)" >&2; exit 2; }
dirs=()
for run in "$@"; do
  run_spec tools/grpo_sweep.sh "$run" || exit 2
  dir=$out/$run
  mkdir -p "$dir"
  start=$(date +%s)
  "$py" -m dsv32_jax.train.main --config="$config" --workdir="$dir" --config.seed="$seed" "${perturb[@]}" \
    > "$dir/log" 2>&1
  rc=$?
  echo "run $run: exit $rc in $(( $(date +%s) - start )) s ($dir/log)"
  [ $rc -eq 0 ] || exit $rc
  dirs+=("$dir")
done
"$py" - "${dirs[@]}" <<'PY'
import os, sys
import numpy as np
from dsv32_jax.train.metrics import read_steps
runs = {d: {r["step"]: r["eval_accuracy"] for r in read_steps(os.path.join(d, "metrics.jsonl")) if "eval_accuracy" in r}
        for d in sys.argv[1:]}
steps = sorted(set.intersection(*(set(v) for v in runs.values())))
print(f"greedy eval_accuracy over {len(runs)} runs ({', '.join(runs)}), min / median / max")
print("| step | min | median | max | per run |")
print("|---|---|---|---|---|")
for s in steps:
    v = np.array([runs[d][s] for d in runs])
    print(f"| {s} | {v.min():.2f} | {np.median(v):.2f} | {v.max():.2f} | {' '.join(f'{x:.2f}' for x in v)} |")
best = np.array([max(r.values()) for r in runs.values()])
print(f"best over the run: min / median / max {best.min():.2f} / {np.median(best):.2f} / {best.max():.2f}")
PY
