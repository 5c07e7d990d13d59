"""Renders training curves to PNG: `python -m dsv32_jax.train.plot RUN_DIR [RUN_DIR ...] --out curves.png`.

Every metrics.jsonl under the given directories becomes one line per metric panel (labelled by its directory)."""

from __future__ import annotations

import argparse
import glob
import os

from dsv32_jax.optional import require
from dsv32_jax.train.metrics import read_jsonl

PANELS = ("loss", "lm_loss", "indexer_kl", "captured_mass", "mtp_loss", "grad_norm", "lr", "tokens_per_s",
          "reward_mean", "accuracy", "response_length", "kl", "clip_fraction", "opsm_masked_fraction",
          "success", "eval_success", "turns", "format_errors")


def find_runs(paths) -> dict[str, list[dict]]:
    runs = {}
    for path in paths:
        files = [path] if path.endswith(".jsonl") else sorted(glob.glob(os.path.join(path, "**", "metrics.jsonl"),
                                                                            recursive=True))
        for f in files:
            rows = {}
            for row in read_jsonl(f):
                rows[row["step"]] = row  # a resumed run re-logs steps: keep the last
            runs[os.path.relpath(os.path.dirname(f))] = [rows[s] for s in sorted(rows)]
    return runs


def plot(runs: dict[str, list[dict]], out: str, smooth: int = 5) -> list[str]:
    matplotlib = require("matplotlib", "plot", "Plotting training curves")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [p for p in PANELS if any(p in r for rows in runs.values() for r in rows)]
    if not panels:
        raise ValueError(f"no known metric in {sorted(runs)}")
    cols = min(3, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.2 * rows_n), squeeze=False)
    colors = {label: f"C{i}" for i, label in enumerate(runs)}
    for ax, name in zip(axes.flat, panels):
        for label, rows in runs.items():
            pts = [(r["step"], r[name]) for r in rows if name in r]
            if not pts:
                continue
            x, y = map(np.asarray, zip(*pts))
            if smooth > 1 and len(y) > smooth:
                y = np.convolve(y, np.ones(smooth) / smooth, mode="valid")
                x = x[smooth - 1:]
            ax.plot(x, y, label=label, color=colors[label])
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=c, label=label) for label, c in colors.items()]
    fig.legend(handles=handles, loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)
    plt.close(fig)
    return panels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", help="workdirs (searched for metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--out", default="curves.png")
    parser.add_argument("--smooth", type=int, default=5, help="moving-average window")
    args = parser.parse_args(argv)
    runs = find_runs(args.runs)
    if not runs:
        raise SystemExit(f"no metrics.jsonl under {args.runs}")
    panels = plot(runs, args.out, args.smooth)
    print(f"wrote {args.out}: {', '.join(panels)} for {len(runs)} run(s)")


if __name__ == "__main__":
    main()
