"""Renders training curves: `python -m dsv32_jax.train.plot RUN_DIR [RUN_DIR ...] --out curves.png` (the format
--out's extension names: png, pdf, svg, ...; none: PNG).

Every metrics.jsonl under the given directories becomes one line per metric panel (labelled by its directory).
Evaluations (`eval_*` panels) are drawn as points, unsmoothed. An agentic run (train/agent_grpo.py) logs, in its
first row, the evaluations before any training (`start_eval_*`) and after the recall stage and cold start
(`pre_eval_*`): its eval panels show them left of step 0, where GRPO begins (a dashed vertical line in every panel
of such a run), so the jump from chance to the cold start's level is visible next to what GRPO adds."""

from __future__ import annotations

import argparse
import glob
import os

from dsv32_jax.checkpoint.io_utils import check_output_parent
from dsv32_jax.optional import require
from dsv32_jax.train.metrics import read_steps

PANELS = ("loss", "lm_loss", "eval_loss", "indexer_kl", "captured_mass", "mtp_loss", "grad_norm", "lr", "tokens_per_s",
          "reward_mean", "accuracy", "response_length", "kl", "clip_fraction", "opsm_masked_fraction",
          "success", "eval_success", "turns", "format_errors")


def find_runs(paths) -> dict[str, list[dict]]:
    runs = {}
    for path in paths:
        files = [path] if path.endswith(".jsonl") else sorted(glob.glob(os.path.join(path, "**", "metrics.jsonl"),
                                                                            recursive=True))
        for f in files:
            runs[os.path.relpath(os.path.dirname(f))] = read_steps(f)
    return runs


def grpo_phases(rows: list[dict], name: str) -> list[tuple[float, float, str]]:
    """(x, value, text) of an agentic run's evaluations before GRPO for panel `name` (eval_*: start_<name> and
    pre_<name> of the first row); [] when the run has none (not an agentic run, or not an eval panel). x: the start
    left of step 0 by a tenth of the run (at least 1 step), the post-cold-start one at 0, where GRPO begins."""
    if not rows or not name.startswith("eval_"):
        return []
    first, last = rows[0], rows[-1]["step"]
    gap = max(1.0, 0.1 * last)
    out = []
    for key, x, text in ((f"start_{name}", -gap, "start"), (f"pre_{name}", 0.0, "cold start")):
        if key in first:
            out.append((x, first[key], text))
    return out


def plot(runs: dict[str, list[dict]], out: str, smooth: int = 5) -> list[str]:
    matplotlib = require("matplotlib", "plot", "Plotting training curves")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [p for p in PANELS if any(p in r or f"pre_{p}" in r for rows in runs.values() for r in rows)]
    if not panels:
        raise ValueError(f"no known metric in {sorted(runs)}")
    cols = min(3, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.2 * rows_n), squeeze=False)
    colors = {label: f"C{i}" for i, label in enumerate(runs)}
    for ax, name in zip(axes.flat, panels):
        for label, rows in runs.items():
            pts = [(r["step"], r[name]) for r in rows if name in r]
            phases = grpo_phases(rows, name)
            if not pts and not phases:
                continue
            if rows and any(k.startswith("pre_eval_") for k in rows[0]):  # agentic: GRPO begins at step 0
                ax.axvline(0, color=colors[label], ls="--", lw=0.8, alpha=0.6)
            if name.startswith("eval_"):
                # evaluations are a few points: unsmoothed, with markers; the pre-GRPO ones left of step 0
                pre = [(x, y) for x, y, _ in phases]
                xs = [x for x, _ in pre] + [s for s, _ in pts]
                ys = [y for _, y in pre] + [v for _, v in pts]
                ax.plot(xs, ys, color=colors[label], marker="o", ms=4, label=label)
                for x, y, text in phases:
                    ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, -10 if y > 0.5 else 6),
                                fontsize=7, color=colors[label])
                continue
            if not pts:
                continue
            x, y = map(np.asarray, zip(*pts))
            if smooth > 1 and len(y) > smooth:
                y = np.convolve(y, np.ones(smooth) / smooth, mode="valid")
                x = x[smooth - 1:]
            ax.plot(x, y, label=label, color=colors[label])
        if name.startswith("eval_") and any(grpo_phases(rows, name) for rows in runs.values()):
            ax.text(0, 1.0, " GRPO", transform=ax.get_xaxis_transform(), fontsize=7, va="top", color="0.4")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=c, label=label) for label, c in colors.items()]
    fig.legend(handles=handles, loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    root, ext = os.path.splitext(out)
    fmt = ext[1:].lower() or "png"  # the format --out names (a .pdf got PNG bytes: the temporary name said .png)
    tmp = f"{root}.tmp-{os.getpid()}{ext}"
    try:
        fig.savefig(tmp, dpi=110, format=fmt)
        os.replace(tmp, out)
    except ValueError as e:  # a format matplotlib cannot write
        raise ValueError(f"--out={out}: {e}") from None
    finally:  # (nothing but the finished file is left: a failed write or rename, an interrupt)
        plt.close(fig)
        if os.path.lexists(tmp) and not os.path.isdir(tmp):
            os.remove(tmp)
    return panels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", help="workdirs (searched for metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--out", default="curves.png")
    parser.add_argument("--smooth", type=int, default=5, help="moving-average window")
    args = parser.parse_args(argv)
    try:  # (before the work: a directory or a regular file on the way was a traceback after the rendering)
        if os.path.isdir(args.out):
            raise SystemExit(f"error: --out={args.out} is a directory: name the image file")
        check_output_parent(args.out)
    except OSError as e:
        raise SystemExit(f"error: --out={e}") from None
    try:
        runs = find_runs(args.runs)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    if not runs:
        raise SystemExit(f"no metrics.jsonl under {args.runs}")
    try:
        panels = plot(runs, args.out, args.smooth)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:  # (not writable, a full disk)
        raise SystemExit(f"error: --out={args.out}: {e.strerror or e}") from None
    print(f"wrote {args.out}: {', '.join(panels)} for {len(runs)} run(s)")


if __name__ == "__main__":
    main()
