"""The held-out table of `train/eval.py` over several runs of the same recipe (seeds, a perturbed start): each
cell as min / median / max over the runs, so that a figure quoted from it is not one run's draw.

    python -m dsv32_jax.train.eval_sweep runs/sweep/*/eval.json --out=runs/sweep/summary

(tools/train_sweep.sh runs `make train`'s recipe once per seed, then this.) For every model x attention row and
split x context column: the loss, and for every row but the first (the dense model) the difference to the first
row's loss of the same run, each as min / median / max. Rows and columns are matched by name across the runs; a
run whose table lacks a cell another run has is refused, naming both files.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from dsv32_jax.checkpoint.io_utils import check_output_parent, write_text_atomic


def _stat(v) -> list[float] | None:
    return None if v is None else [float(v.min()), float(np.median(v)), float(v.max())]


def read_tables(paths: list[str]) -> list[dict]:
    tables = []
    for path in paths:
        try:
            with open(path) as f:
                table = json.load(f)
            rows = table["rows"]
            cells = {(r["model"], r["attention"], r["split"], int(r["seq_len"])): float(r["loss"]) for r in rows}
        except OSError as e:
            raise ValueError(f"{path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not an eval table of train/eval.py ({e!r})") from None
        if not cells:
            raise ValueError(f"{path}: the table has no rows")
        order = [(r["model"], r["attention"]) for r in rows]
        tables.append({"path": path, "cells": cells, "base": order[0],
                       "rows": list(dict.fromkeys(order))})
    first = tables[0]
    for t in tables[1:]:
        if set(t["cells"]) != set(first["cells"]) or t["base"] != first["base"]:
            missing = sorted(set(first["cells"]) ^ set(t["cells"]))[:3]
            raise ValueError(f"{t['path']} and {first['path']} hold different tables (cells in one only: {missing}; "
                             f"first rows {t['base']} / {first['base']})")
    return tables


def summarize(tables: list[dict]) -> dict:
    """{"runs", "rows": [{model, attention, split, seq_len, loss: [min, median, max], gap: [min, median, max] or
    None}]}: gap = the row's loss minus the first row's, per run."""
    first = tables[0]
    base = first["base"]
    out = []
    for (model, attention) in first["rows"]:
        for (m, a, split, seq_len) in sorted(k for k in first["cells"] if k[:2] == (model, attention)):
            loss = np.array([t["cells"][(m, a, split, seq_len)] for t in tables])
            gap = None
            if (model, attention) != base and (*base, split, seq_len) in first["cells"]:
                gap = loss - np.array([t["cells"][(*base, split, seq_len)] for t in tables])
            out.append({"model": model, "attention": attention, "split": split, "seq_len": seq_len,
                        "loss": _stat(loss), "gap": _stat(gap)})
    return {"runs": [t["path"] for t in tables], "rows": out}


def markdown(summary: dict) -> str:
    rows = summary["rows"]
    cols = sorted({(r["split"], r["seq_len"]) for r in rows}, key=lambda c: (c[1], c[0]))
    models = list(dict.fromkeys((r["model"], r["attention"]) for r in rows))
    cell = {(r["model"], r["attention"], r["split"], r["seq_len"]): r for r in rows}
    lines = [f"Held-out loss over {len(summary['runs'])} runs, min / median / max (nats/token); in brackets the "
             "difference to the first row within each run, min / median / max", "",
             "| model | attention | " + " | ".join(f"{s} @ {n}" for s, n in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for m in models:
        cells = []
        for c in cols:
            r = cell.get((*m, *c))
            if r is None:
                cells.append("")
                continue
            text = " / ".join(f"{v:.4f}" for v in r["loss"])
            if r["gap"] is not None:
                text += " (" + " / ".join(f"{v:+.4f}" for v in r["gap"]) + ")"
            cells.append(text)
        lines.append(f"| {m[0]} | {m[1]} | " + " | ".join(cells) + " |")
    lines += ["", "Runs: " + ", ".join(summary["runs"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="min / median / max of train/eval.py's held-out tables over runs")
    p.add_argument("tables", nargs="+", help="eval.json files, one per run")
    p.add_argument("--out", default="", help="write <out>.md and <out>.json")
    a = p.parse_args(argv)
    if len(a.tables) < 2:
        raise SystemExit(f"error: a summary needs the tables of at least 2 runs, got {len(a.tables)}")
    try:
        summary = summarize(read_tables(a.tables))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    text = markdown(summary)
    print(text, flush=True)
    if a.out:
        try:
            check_output_parent(a.out)
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            write_text_atomic(a.out + ".md", text + "\n")
            write_text_atomic(a.out + ".json", json.dumps(summary, indent=1))
        except OSError as e:
            raise SystemExit(f"error: --out={a.out}: {e.strerror or e}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
