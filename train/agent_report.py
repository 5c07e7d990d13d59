"""The three evaluations of an agentic run as a table: `python -m dsv32_jax.train.agent_report RUN_DIR [RUN_DIR ...]`.

For each workdir of stage "agent" (train/agent_grpo.py; its metrics.jsonl), the greedy held-out evaluation before any
training (`start_eval_*`), after the recall stage and cold start (`pre_eval_*`) and at the last GRPO step
(`eval_*`), the sampled success of the training rollouts over the first and the last `--window` GRPO steps, and the
wall time (the sum of the steps' `step_s`: everything but the process start and the first compile of the model).
With several workdirs, one line per run and the min / median / max of every column (`make agent-demo` prints the
first form; BENCHMARKS.md's seed sweeps the second). `--metrics=KEY,KEY,...`: those metrics.jsonl keys instead, each
run's value from the last row that holds it (`pre_eval_*` from step 1's, `eval_*` from the last evaluation), one
line per run and their min / median / max (tools/thinking_sweep.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from dsv32_jax.train.metrics import read_steps

COLUMNS = (("start", "greedy success before training"), ("cold_start", "greedy success after the cold start"),
           ("end", "greedy success after GRPO"), ("rollout_first", "rollout success, first steps"),
           ("rollout_last", "rollout success, last steps"), ("minutes", "wall minutes"))


def load(workdir: str) -> list[dict]:
    path = workdir if workdir.endswith(".jsonl") else os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"not a workdir of stage 'agent' (no {path})")
    rows = read_steps(path)
    if not rows:
        raise ValueError(f"no metrics in {path}")
    return rows


def summarize(rows: list[dict], window: int = 5) -> dict:
    """The run's three greedy evaluations (success and reward), rollout success over the first / last `window`
    GRPO steps, the final KL to pi_ref and the wall minutes."""
    first, last = rows[0], rows[-1]
    evals = [r for r in rows if "eval_success" in r]
    if "pre_eval_success" not in first or not evals:
        raise ValueError("not an agentic run with a cold start and a final evaluation (pre_eval_success, eval_success)")
    end = evals[-1]
    w = max(1, min(window, len(rows) // 2))
    out = {"steps": last["step"], "end_step": end["step"], "window": w,
           "start": first.get("start_eval_success", float("nan")), "cold_start": first["pre_eval_success"],
           "end": end["eval_success"], "start_reward": first.get("start_eval_reward", float("nan")),
           "cold_start_reward": first.get("pre_eval_reward", float("nan")),
           "end_reward": end.get("eval_reward", float("nan")),
           "rollout_first": float(np.mean([r["success"] for r in rows[:w]])),
           "rollout_last": float(np.mean([r["success"] for r in rows[-w:]])),
           "kl_end": last.get("kl", float("nan")),
           "minutes": sum(r.get("step_s", 0.0) for r in rows) / 60}
    for k in ("sampled_success", "sampled_reward"):
        if f"pre_eval_{k}" in first and f"eval_{k}" in end:
            out[f"cold_start_{k}"], out[f"end_{k}"] = first[f"pre_eval_{k}"], end[f"eval_{k}"]
    return out


def table(s: dict) -> str:
    """One run: the three evaluations, then the rollouts' success and the time."""
    lines = ["| evaluation (held-out, greedy) | step | success | reward |", "|---|---|---|---|",
             f"| before training | 0 | {s['start']:.3f} | {s['start_reward']:.3f} |",
             f"| after recall + cold start | 0 | {s['cold_start']:.3f} | {s['cold_start_reward']:.3f} |",
             f"| after GRPO | {s['end_step']} | {s['end']:.3f} | {s['end_reward']:.3f} |"]
    if "cold_start_sampled_success" in s:
        lines.append(f"sampled evaluation (same keys): success {s['cold_start_sampled_success']:.3f} -> "
                     f"{s['end_sampled_success']:.3f}, reward {s['cold_start_sampled_reward']:.3f} -> "
                     f"{s['end_sampled_reward']:.3f}")
    lines.append(f"GRPO rollouts' success: {s['rollout_first']:.3f} (steps 1-{s['window']}) -> {s['rollout_last']:.3f} "
                 f"(last {s['window']} of {s['steps']}); KL to pi_ref at the end {s['kl_end']:.4f}; "
                 f"{s['minutes']:.1f} wall minutes")
    return "\n".join(lines)


def sweep_table(runs: dict[str, dict]) -> str:
    """Several runs: one line each and the min / median / max of every column."""
    return runs_table(runs, COLUMNS)


def metric_values(rows: list[dict], keys: list[str]) -> dict[str, float]:
    """Each key's value in the last row that holds it; ValueError naming the keys no row holds."""
    out = {}
    for row in rows:
        out.update({k: float(row[k]) for k in keys if k in row})
    missing = [k for k in keys if k not in out]
    if missing:
        raise ValueError(f"no row holds {', '.join(missing)}")
    return {k: out[k] for k in keys}


def runs_table(runs: dict[str, dict[str, float]], columns) -> str:
    """One line per run and the min / median / max of each (key, title) column ("minutes" to 0.1, the rest to
    0.001)."""
    def cell(k, v):
        return f"{v:.1f}" if k == "minutes" else f"{v:.3f}"

    lines = ["| run | " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * (len(columns) + 1)]
    lines += [f"| {name} | " + " | ".join(cell(k, v[k]) for k, _ in columns) + " |" for name, v in runs.items()]
    for label, fn in (("min", np.min), ("median", np.median), ("max", np.max)):
        lines.append(f"| **{label}** | " + " | ".join(cell(k, fn([v[k] for v in runs.values()])) for k, _ in columns)
                     + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="workdirs of stage 'agent' (or their metrics.jsonl)")
    parser.add_argument("--window", type=int, default=5, help="GRPO steps averaged for the rollouts' success")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")
    parser.add_argument("--metrics", default="", help="comma-separated metrics.jsonl keys to tabulate instead "
                        "(each run's value from the last row holding it), e.g. pre_eval_success,eval_success")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.metrics.split(",") if k.strip()]
    runs, skipped = {}, []
    for r in args.runs:
        try:
            rows = load(r)
            runs[os.path.relpath(r)] = metric_values(rows, keys) if keys else summarize(rows, args.window)
        except ValueError as e:  # a run still in progress, a log file from a glob: named, not a traceback
            skipped.append(f"{r}: {e}")
    for msg in skipped:
        print(f"skipped {msg}", file=sys.stderr)
    if not runs:
        parser.exit(2, "agent_report: no run to report\n")
    if args.json:
        print(json.dumps(runs, indent=1))
    elif keys:
        print(runs_table(runs, [(k, k) for k in keys]))
    elif len(runs) == 1:
        print(table(next(iter(runs.values()))))
    else:
        print(sweep_table(runs))


if __name__ == "__main__":
    main()
