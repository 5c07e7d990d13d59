"""Held-out evaluation: next-token loss of a model on a held-out split, with dense attention or with DSA.

Does DSA adaptation preserve the model? The paper compares the sparse model with the dense one on the same
benchmarks; here the measure is the held-out LM loss (nats per token) of

    the dense model        (stage 0, dense attention)
    the warm-up model      (the same weights + the trained indexer, DSA top-k attention)
    the sparse model       (after sparse continued training, DSA top-k attention)

at the training context and on a long-context split (documents of at least `seq_len` tokens packed into rows of
`seq_len`, where the top-k selection is active: seq_len >= 8 x index_topk).

    python -m dsv32_jax.train.eval --workdirs=runs/demo/dense,runs/demo/warmup,runs/demo/sparse \\
        --seq_lens=128,512 --batches=8 --out=runs/demo/eval

prints a markdown table and writes <out>.md and <out>.json. The trainer runs the same evaluation every
`config.eval.every` steps (metric eval_loss). Built-in data: data.split='heldout' (stdlib docstrings disjoint from
the training corpus, train/data/builtin.py); other sources: config.eval.paths in the trainer, and in the CLI
--source=jsonl|parquet|arrayrecord|text --paths=held/*.jsonl [--tokenizer=tokenizer.json] [--text_field=text].
The text is tokenized with the tokenizer every workdir records (its trainer's data.tokenizer, or a converted
checkpoint's tokenizer.json); --tokenizer overrides it, and is needed where they differ or record none.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv32_jax.checkpoint.io_utils import check_output_parent, write_text_atomic
from dsv32_jax.model.options import RunOptions
from dsv32_jax.train import data as data_lib
from dsv32_jax.train.losses import token_nll

EVAL_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
ATTENTIONS = {"dense": RunOptions(dsa=False, attention="dense"), "dsa": RunOptions(attention="sparse")}


def eval_data_config(data_cfg: dict, eval_cfg, seq_len: int | None = None, long: bool = False) -> data_lib.DataConfig:
    """The held-out DataConfig: the training data's config with the held-out split (builtin) or eval.paths,
    eval.seq_len / eval.batch_size; long=True keeps only documents of at least seq_len tokens."""
    d = dict(data_cfg)
    if eval_cfg.get("paths"):
        if d.get("source", "builtin") == "builtin":
            raise ValueError("config.eval.paths is set but data.source='builtin' reads no files: set data.source "
                             "to the held-out files' format (jsonl, parquet, arrayrecord, text), or leave "
                             "config.eval.paths empty for the built-in corpus's held-out split")
        d["paths"] = tuple(eval_cfg.paths)
    else:
        if d.get("source", "builtin") != "builtin":
            raise ValueError("config.eval.paths: held-out files are needed for data.source="
                             f"{d.get('source')!r} (the built-in corpus has its own held-out split)")
        d["split"] = "heldout"
    d["seq_len"] = int(seq_len or eval_cfg.get("seq_len") or d["seq_len"])
    d["batch_size"] = int(eval_cfg.get("batch_size") or d["batch_size"])
    d["seed"] = int(eval_cfg.get("seed", 0))
    d["num_epochs"] = None
    d["shards"] = 0
    d["min_doc_tokens"] = d["seq_len"] if long else 0
    return data_lib.DataConfig(**d)


def eval_batches(cfg: data_lib.DataConfig, vocab_size: int, num_batches: int, shard=None) -> list[dict]:
    """This process's rows of the first `num_batches` batches of the held-out stream (fixed: every evaluation sees
    the same tokens). shard: (i, n), the block of rows this process's devices own (trainer.data_shard; None: the
    process index of the process count). Every process reads the one held-out stream and keeps row block i of n of
    each batch, so the held-out set is the same on any number of processes (a stream sharded per process packed
    other rows on 2 processes than on 1: another eval_loss for the same parameters)."""
    i, n = shard or (jax.process_index(), jax.process_count())
    if cfg.batch_size % n:
        raise ValueError(f"the held-out batch of {cfg.batch_size} rows cannot be split into {n} row blocks "
                         "(config.eval.batch_size)")
    rows = cfg.batch_size // n
    # one pass over the held-out documents, counted: the stream repeats to fill num_batches, and the table's token
    # count then includes repeats (a one-document file was scored as 17 tokens per column without a word)
    one_pass = len(_first_batches(dataclasses.replace(cfg, num_epochs=1), vocab_size, num_batches))
    if one_pass < num_batches:
        from absl import logging

        logging.warning("held-out data (%s%s): one pass holds %d batch(es) of %d x %d tokens, fewer than the %d "
                        "evaluated: its documents are scored more than once (the tokens column counts repeats)",
                        cfg.source, f" {list(cfg.paths)}" if cfg.paths else f", {cfg.split} split", one_pass,
                        cfg.batch_size, cfg.seq_len, num_batches)
    return [{k: np.asarray(b[k])[i * rows:(i + 1) * rows] for k in EVAL_KEYS}
            for b in _first_batches(cfg, vocab_size, num_batches)]


def _first_batches(cfg: data_lib.DataConfig, vocab_size: int, num_batches: int) -> list[dict]:
    """Up to `num_batches` whole batches of `cfg`'s stream (fewer where a finite stream ends)."""
    it = data_lib.make_iterator(cfg, vocab_size=vocab_size)  # (the whole batch: the stream of process 0 of 1)
    out = []
    try:
        for _ in range(num_batches):
            out.append(next(it))
    except StopIteration:
        pass
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return out


def lm_eval_step(model_state: nnx.State, batch: dict, *, graphdef, options: RunOptions) -> dict:
    """Summed next-token NLL and token count of one batch under `options` (no MTP head, no indexer loss)."""
    model = nnx.merge(graphdef, model_state)
    model.options = options
    logits = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    nll = token_nll(logits, batch["targets"])
    mask = batch["loss_mask"]
    return {"nll": jnp.sum(nll * mask), "tokens": jnp.sum(mask)}


# one jitted step for every unsharded Evaluator: the graph and options are its static arguments, so an evaluation of
# another model of the same architecture (the eval table's next workdir, split or length) reuses the compiled
# program; a jax.jit per Evaluator compiled it again for each (8 compiles for 2 programs; audit, 2026-12-07)
_lm_eval_step = jax.jit(lm_eval_step, static_argnames=("graphdef", "options"))


@dataclasses.dataclass
class Evaluator:
    """Held-out loss of a model state on fixed batches: `evaluator(model_state) -> {"loss", "tokens"}`."""
    batches: list[dict]
    step: object  # jitted (model_state, batch) -> {"nll", "tokens"}
    put: object  # numpy batch -> device batch

    @classmethod
    def create(cls, batches: list[dict], *, graphdef, options: RunOptions, model_shardings=None,
               batch_sharding=None, rows: int | None = None):
        """rows: the global batch's (with batch_sharding: each process holds its row block's share of them)."""
        if batch_sharding is None:
            return cls(batches, functools.partial(_lm_eval_step, graphdef=graphdef, options=options), lambda b: b)
        fn = functools.partial(lm_eval_step, graphdef=graphdef, options=options)
        if rows is None:
            raise ValueError("Evaluator.create: a batch_sharding needs the global batch's rows")
        step = jax.jit(fn, in_shardings=(model_shardings, {k: batch_sharding for k in EVAL_KEYS}))
        put = lambda b: {k: jax.make_array_from_process_local_data(  # noqa: E731
            batch_sharding, v, (rows,) + np.shape(v)[1:]) for k, v in b.items()}
        return cls(batches, step, put)

    def __call__(self, model_state) -> dict:
        nll, tokens = 0.0, 0.0
        for b in self.batches:
            out = jax.device_get(self.step(model_state, self.put(b)))
            nll += float(out["nll"])
            tokens += float(out["tokens"])
        return {"loss": nll / max(tokens, 1.0), "tokens": tokens}


def evaluate_model(model, batches: list[dict], attention: str) -> dict:
    """Held-out loss of a loaded `Transformer` with attention 'dense' or 'dsa' (single process)."""
    graphdef, state = nnx.split(model)
    return Evaluator.create(batches, graphdef=graphdef, options=ATTENTIONS[attention])(state)


def _workdir_label(path: str) -> str:
    from dsv32_jax.checkpoint import orbax_io

    if orbax_io.is_training_workdir(path):
        tc = orbax_io.training_checkpoint(path)
        return f"{os.path.basename(os.path.normpath(path))} ({tc.meta.get('stage', '?')}, step {tc.step})"
    return os.path.basename(os.path.normpath(path))


class SeqLenError(ValueError):
    """A --seq_lens context longer than a model's."""


def eval_table(workdirs: list[str], seq_lens: list[int], batches: int, batch_size: int = 8,
               attentions: dict[str, list[str]] | None = None, data: dict | None = None,
               paths: tuple[str, ...] = ()) -> dict:
    """{"rows": [{"model", "attention", "split", "seq_len", "loss", "tokens"}], ...} for every workdir x attention
    x split. attentions: workdir -> which attentions (default: 'dense' for a dense-stage workdir, else both).
    A context at which no held-out document is long enough has no heldout-long rows; "skipped" names it.
    data: DataConfig fields (default: the built-in corpus, whose held-out split is used); paths: the held-out files
    of any other source (config.eval.paths)."""
    import dsv32_jax
    from dsv32_jax.checkpoint import orbax_io

    data = dict(data or {"source": "builtin"})
    eval_cfg = {"batch_size": batch_size, "seed": 0, "paths": tuple(paths)}
    rows, cache, skipped = [], {}, {}
    for path in workdirs:
        model = dsv32_jax.from_pretrained(path, dtype=jnp.float32)
        stage = orbax_io.training_checkpoint(path).meta.get("stage") if orbax_io.is_training_workdir(path) else None
        which = (attentions or {}).get(path) or (["dense"] if stage == "dense" else ["dense", "dsa"])
        ctx = int(model.config.max_position_embeddings)
        if max(seq_lens) > ctx:  # (positions past the context: RoPE the model never saw, scored as if it had)
            raise SeqLenError(f"{max(seq_lens)} exceeds the context of {path}: {ctx} positions "
                              "(max_position_embeddings of its model config)")
        for seq_len in seq_lens:
            for split, long in (("heldout", False), ("heldout-long", True)):
                key = (seq_len, long, model.config.vocab_size)
                if key not in cache:
                    cfg = eval_data_config(data, _Cfg(eval_cfg), seq_len, long)
                    try:
                        cache[key] = eval_batches(cfg, model.config.vocab_size, batches)
                    except data_lib.NoDocuments:
                        if not long:
                            raise
                        cache[key] = None  # (the other columns are still worth having)
                        skipped[f"{split} @ {seq_len}"] = f"no held-out document of >= {seq_len} tokens"
                if cache[key] is None:
                    continue
                for attention in which:
                    r = evaluate_model(model, cache[key], attention)
                    rows.append({"model": _workdir_label(path), "workdir": path, "attention": attention,
                                 "split": split, "seq_len": seq_len, "index_topk": model.config.index_topk, **r})
    return {"rows": rows, "batches": batches, "batch_size": batch_size, "skipped": skipped}


class _Cfg(dict):
    __getattr__ = dict.__getitem__


def markdown(table: dict) -> str:
    """Loss (nats/token) per model x attention (rows) and split x context (columns); the gap of each row to the
    first row (the dense model) below."""
    cols = sorted({(r["split"], r["seq_len"]) for r in table["rows"]}, key=lambda c: (c[1], c[0]))
    models = []
    for r in table["rows"]:
        if (r["model"], r["attention"]) not in models:
            models.append((r["model"], r["attention"]))
    value = {(r["model"], r["attention"], r["split"], r["seq_len"]): r["loss"] for r in table["rows"]}
    topk = table["rows"][0]["index_topk"] if table["rows"] else 0
    head = "| model | attention | " + " | ".join(f"{s} @ {n} (ctx/topk {n // max(topk, 1)})" for s, n in cols) + " |"
    lines = [head, "|---|---|" + "---|" * len(cols)]
    base = models[0] if models else None
    for m in models:
        cells = []
        for c in cols:
            v = value.get((*m, *c))
            b = value.get((*base, *c))
            cells.append("" if v is None else f"{v:.4f}" + ("" if m == base or b is None else f" ({v - b:+.4f})"))
        lines.append(f"| {m[0]} | {m[1]} | " + " | ".join(cells) + " |")
    tokens = {(r["split"], r["seq_len"]): int(r["tokens"]) for r in table["rows"]}
    lines.append("")
    lines.append("Held-out loss in nats/token (difference to the first row in brackets); tokens per column: "
                 + ", ".join(f"{s} @ {n}: {t}" for (s, n), t in sorted(tokens.items(), key=lambda x: x[0][1])))
    if table.get("skipped"):
        lines.append("Not evaluated: " + "; ".join(f"{c} ({why})" for c, why in table["skipped"].items()) + ".")
    return "\n".join(lines)


def recorded_tokenizer(path: str) -> str | None:
    """The tokenizer a workdir or checkpoint was trained with: a training workdir's recorded data.tokenizer ("byte"
    or a tokenizer.json path, `data.tokenizers.tokenizer_record`), else the tokenizer.json beside a converted checkpoint;
    None when neither says."""
    from dsv32_jax.checkpoint import orbax_io

    if orbax_io.is_training_workdir(path):
        meta = orbax_io.training_checkpoint(path).meta
        spec = meta.get("tokenizer") if isinstance(meta, dict) else None
        if isinstance(spec, str):
            return spec
    own = os.path.join(path, "tokenizer.json")
    return own if os.path.isfile(own) else None


def eval_tokenizer(workdirs: list[str], override: str = "") -> str:
    """The tokenizer the held-out text is read with: `override` (--tokenizer; a warning names each workdir that
    records another one), else the one every workdir records. The table compares nats per token, so workdirs
    that record different tokenizers (or none) need --tokenizer. The CLI's default was "byte" whatever the
    workdirs were trained with: a BPE-trained model was scored on byte ids without a word."""
    from dsv32_jax.train.data.tokenizers import tokenizer_record

    def same(a: str, b: str) -> bool:  # (a directory and the tokenizer.json in it are one tokenizer)
        return tokenizer_record(a) == tokenizer_record(b)

    recorded = {w: recorded_tokenizer(w) for w in workdirs}
    if override:
        for w, spec in recorded.items():
            if spec is not None and not same(spec, override):
                print(f"warning: --tokenizer={override}, but {w} was trained with {spec}", file=sys.stderr,
                      flush=True)
        return override
    missing = [w for w, spec in recorded.items() if spec is None]
    if missing:
        raise ValueError(f"--workdirs: {', '.join(missing)} record(s) no tokenizer (no recorded data.tokenizer, no "
                         "tokenizer.json beside the checkpoint): pass --tokenizer")
    specs = list(dict.fromkeys(recorded.values()))
    if any(not same(specs[0], s) for s in specs[1:]):
        raise ValueError("--workdirs record different tokenizers (" + "; ".join(f"{w}: {s}" for w, s in
                         recorded.items()) + "): a loss per token compares only under one; pass --tokenizer")
    if specs[0].startswith("chat:"):
        raise ValueError(f"--workdirs were trained with the chat codec {specs[0]}: the held-out text is read with "
                         "'byte' or a tokenizer.json; pass --tokenizer")
    return specs[0]


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Held-out loss of training workdirs with dense attention and DSA.")
    p.add_argument("--workdirs", required=True, help="comma-separated training workdirs / checkpoint dirs")
    p.add_argument("--seq_lens", default="128", help="comma-separated contexts (long split: documents >= context)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--out", default="", help="write <out>.md and <out>.json")
    p.add_argument("--source", default="builtin", choices=data_lib.SOURCES,
                   help="held-out data format: builtin (the built-in corpus's held-out split) or the files' format")
    p.add_argument("--paths", default="", help="comma-separated held-out files, directories or globs (--source "
                   "other than builtin)")
    p.add_argument("--tokenizer", default="", help="byte, a tokenizer.json, or a checkpoint dir holding one "
                   "(default: the one every workdir records: its trainer's data.tokenizer, or a checkpoint's own "
                   "tokenizer.json)")
    p.add_argument("--text_field", default="text", help="JSONL key / Parquet column / ArrayRecord JSON key")
    a = p.parse_args(argv)
    workdirs = [w for w in a.workdirs.split(",") if w]
    if not workdirs:
        raise SystemExit(f"error: --workdirs names no workdir or checkpoint (got {a.workdirs!r})")
    for w in workdirs:
        if not os.path.exists(w):
            raise SystemExit(f"error: --workdirs: {w} does not exist (run the training stage first)")
    try:
        seq_lens = [int(x) for x in a.seq_lens.split(",") if x]
    except ValueError:
        raise SystemExit(f"error: --seq_lens must be comma-separated integers, got {a.seq_lens!r}") from None
    if not seq_lens or min(seq_lens) < 2:
        raise SystemExit(f"error: --seq_lens must be integers >= 2 (a next-token target needs two), got {a.seq_lens!r}")
    for flag in ("batches", "batch_size"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"error: --{flag} must be >= 1, got {getattr(a, flag)}")
    paths = tuple(x for x in a.paths.split(",") if x)
    if (a.source == "builtin") == bool(paths):
        raise SystemExit("error: --paths " + (f"is set ({a.paths!r}) but --source=builtin reads no files: set --source "
                                              "to their format" if paths else
                                              f"names no held-out files: --source={a.source} needs them"))
    try:
        tokenizer = eval_tokenizer(workdirs, a.tokenizer)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    data = {"source": a.source, "tokenizer": tokenizer, "text_field": a.text_field}
    if paths:  # the check DataConfig makes, up front (a missing file otherwise surfaces mid-table)
        data_lib.DataConfig(**data, paths=paths)
    from dsv32_jax.checkpoint.safetensors_io import CheckpointError
    from dsv32_jax.model.config import ConfigError

    if a.out:  # before any evaluation: a parent that cannot be created surfaced only after the whole table
        for path in (a.out + ".md", a.out + ".json"):
            if os.path.isdir(path):
                raise SystemExit(f"error: --out={a.out}: {path} is a directory")
        try:
            check_output_parent(a.out)  # a regular file on the way: named, not "File exists"
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        except OSError as e:
            raise SystemExit(f"error: --out={a.out}: {e.strerror}") from None

    try:
        table = eval_table(workdirs, seq_lens, a.batches, a.batch_size, data=data, paths=paths)
    except SeqLenError as e:
        raise SystemExit(f"error: --seq_lens: {e}") from None
    except (CheckpointError, ConfigError) as e:
        raise SystemExit(f"error: --workdirs: {e}") from None
    except (ValueError, KeyError, OSError) as e:  # the data: files, records' fields, tokenizer, vocabulary
        raise SystemExit(f"error: held-out data (--source {a.source}, --paths {a.paths!r}, --tokenizer "
                         f"{tokenizer}): {e}") from None
    text = markdown(table)
    print(text, flush=True)
    if a.out:
        try:
            write_text_atomic(a.out + ".md", text + "\n")
            write_text_atomic(a.out + ".json", json.dumps(table, indent=1))
        except OSError as e:  # (each file is written whole or not at all)
            raise SystemExit(f"error: --out={a.out}: {e.strerror or e}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
