#!/usr/bin/env bash
# `make train`'s recipe (dense pre-training, the warm-up of eq. 3, sparse training of eq. 4, then the held-out
# table of train/eval.py) once per run, and the table's min / median / max over the runs (train/eval_sweep.py), so
# that the held-out figures BENCHMARKS.md quotes are not one run's draw. A run is a seed (config.seed, and
# data.seed 10 s, 10 s + 1, 10 s + 2 for the three stages: s = 0 is `make train` itself) or a seed with a
# perturbed start (`Np`: seed N, config.init_perturb=1e-6, as another CPU's float rounding would make it):
#   tools/train_sweep.sh 0 1 2 3 4 0p        # SWEEP_DIR (runs/sweep) / <run> / {dense,warmup,sparse,eval.*, log}
# Each stage resumes when rerun (the trainer's checkpoints), so an interrupted sweep continues where it stopped.
# About 2.5 minutes a run alone on 2 CPU cores (5-6.5 beside other jobs). Exit status: non-zero when a run or the summary failed.
set -u
source "$(dirname "$0")/run_spec.sh"
py=${PY:-.venv/bin/python}
out=${SWEEP_DIR:-runs/sweep}
[ $# -ge 2 ] || { echo "usage: tools/train_sweep.sh RUN RUN [RUN...]  (RUN: a seed N, or Np for seed N perturbed)" >&2; exit 2; }
tables=()
for run in "$@"; do
  run_spec tools/train_sweep.sh "$run" || exit 2
  dir=$out/$run
  mkdir -p "$dir"
  start=$(date +%s)
  {
    "$py" -m dsv32_jax.train.main --config=configs/dense_tiny.py --workdir="$dir/dense" --config.seed="$seed" \
      --config.data.seed=$((10 * seed)) "${perturb[@]}" &&
    "$py" -m dsv32_jax.train.main --config=configs/warmup_tiny.py --workdir="$dir/warmup" --config.seed="$seed" \
      --config.data.seed=$((10 * seed + 1)) --config.init_from="$dir/dense" &&
    "$py" -m dsv32_jax.train.main --config=configs/sparse_tiny.py --workdir="$dir/sparse" --config.seed="$seed" \
      --config.data.seed=$((10 * seed + 2)) --config.init_from="$dir/warmup" &&
    "$py" -m dsv32_jax.train.eval --workdirs="$dir/dense,$dir/warmup,$dir/sparse" --seq_lens=128,512 --batches=8 \
      --out="$dir/eval"
  } > "$dir/log" 2>&1
  rc=$?
  echo "run $run: exit $rc in $(( $(date +%s) - start )) s ($dir/log)"
  [ $rc -eq 0 ] || exit $rc
  tables+=("$dir/eval.json")
done
"$py" -m dsv32_jax.train.eval_sweep "${tables[@]}" --out="$out/summary"
