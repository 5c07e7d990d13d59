"""Training-step benchmark: dense vs sparse (DSA) attention for the small config at long context.

    python bench/train_step.py --contexts=8192,32768,65536,131072 --out=bench_train.json      # on a GPU
    python bench/train_step.py --smoke                                                        # CPU, tiny, seconds

Each (mode, context) runs in its own subprocess (clean peak-memory statistics, OOM isolation): batch 1,
`--warmup` untimed steps then the median of `--steps` timed steps. Modes: "dense" = the dense stage (MQA-mode
dense attention, no indexer); "sparse" = the sparse stage (indexer top-k + sparse MLA + the eq. 4 KL), with
`--attention` sparse (plain JAX gather) or kernel (Pallas); "reference" = the sparse stage with the plain-JAX
attention whatever --attention says (the kernels' step beside the reference step in one run). `--cases
mode:context[:flags],...` replaces the modes x contexts grid; flags, joined by "+", switch on per case what
the global flags of the same names switch on for all (`sparse:8192:kl_scatter_add`: that case only). The step is
the recipe's (a 1-device mesh, the trainer's compiled step); `--scan` runs the MoE blocks as one lax.scan (compile
time independent of depth), `--layers N` overrides the depth. Prints a table and the longest context that fits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CASE_FLAGS = ("kl_scatter_add", "kl_segment_sum", "indexer_fp8", "mla_bwd_stored", "mla_bwd_recompute", "mla_bwd_atomic",
              "mla_fwd_mgpu", "mla_pds_mgpu")


def parse_case(text: str) -> tuple[str, int, tuple[str, ...]]:
    """"mode:context[:flag+flag]" -> (mode, context, flags); a bad case names itself and the flags allowed."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise SystemExit(f"--cases: {text!r} is not mode:context[:flags]")
    flags = tuple(f for f in (parts[2].split("+") if len(parts) == 3 else ()) if f)
    bad = [f for f in flags if f not in CASE_FLAGS]
    if bad:
        raise SystemExit(f"--cases: {text!r} names unknown flag(s) {bad}; per-case flags: {', '.join(CASE_FLAGS)}")
    return parts[0], int(parts[1]), flags


def make_trainer(args):
    """(Trainer, batch): the recipe's compiled step for args.mode at args.context (batch 1, random tokens)."""
    import numpy as np

    from dsv32_jax.train.config import default_config
    from dsv32_jax.train.trainer import Trainer

    config = default_config()
    config.stage = "dense" if args.mode == "dense" else "sparse"
    config.model = args.model
    config.dtype = args.dtype
    config.param_dtype = "float32"
    config.attention = "sparse" if args.mode == "reference" else args.attention
    config.scan_layers = args.scan
    config.indexer_fp8 = getattr(args, "indexer_fp8", False)
    config.remat = getattr(args, "remat", "none")
    config.kl_key_grad = ("scatter" if getattr(args, "kl_scatter_add", False) else
                          "segment_sum" if getattr(args, "kl_segment_sum", False) else "dense")
    # mla_bwd_stored: the default since 2026-11-28 (kept so recorded command lines still run)
    config.mla_bwd = ("recompute" if getattr(args, "mla_bwd_recompute", False) else
                      "atomic" if getattr(args, "mla_bwd_atomic", False) else "stored")
    config.mla_fwd = "mosaic_gpu" if getattr(args, "mla_fwd_mgpu", False) else "triton"
    config.mla_pds = "mosaic_gpu" if getattr(args, "mla_pds_mgpu", False) else "triton"
    config.loss.token_chunk = getattr(args, "token_chunk", 0)
    if args.layers:
        config.model_overrides = {"num_hidden_layers": args.layers}
    config.attn_chunk = args.chunk
    config.index_chunk = args.chunk
    config.data.seq_len = args.context
    config.data.batch_size = 1
    config.checkpoint.use_async = False
    trainer = Trainer(config, "/tmp/bench_train_unused")
    rng = np.random.default_rng(0)
    vocab = trainer.cfg.vocab_size
    tokens = rng.integers(0, vocab, (1, args.context), dtype=np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
             "segment_ids": np.ones_like(tokens), "positions": np.arange(args.context, dtype=np.int32)[None],
             "loss_mask": np.ones(tokens.shape, np.float32)}
    return trainer, batch


def run_case(args) -> dict:
    import jax

    trainer, batch = make_trainer(args)
    config = trainer.config
    t0 = time.perf_counter()
    jax.block_until_ready(trainer.train_step(batch))
    compile_s = time.perf_counter() - t0
    print(f"PROGRESS compile + first step {compile_s:.1f} s", flush=True)  # what a timed-out case still reports
    for _ in range(args.warmup - 1):
        jax.block_until_ready(trainer.train_step(batch))
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = jax.block_until_ready(trainer.train_step(batch))
        times.append(time.perf_counter() - t0)
        print(f"PROGRESS step {times[-1]:.3f} s", flush=True)
    stats = jax.devices()[0].memory_stats() or {}
    from dsv32_jax.model import sharding as shd
    from dsv32_jax.kernels.inspect import pallas_calls
    with shd.use_mesh(trainer.mesh):  # the Pallas kernels in the step that ran (0: reference / dense)
        kernels = pallas_calls(jax.make_jaxpr(trainer._step_fn)(trainer.ts.state, trainer.device_batch(batch)))
    step = statistics.median(times)
    return {"mode": args.mode, "attention": config.attention if args.mode != "dense" else "dense",
            "indexer_fp8": bool(config.get("indexer_fp8", False)),
            "kl_scatter_add": config.kl_key_grad == "scatter", "kl_segment_sum": config.kl_key_grad == "segment_sum",
            "mla_bwd_stored": config.mla_bwd == "stored", "mla_bwd_atomic": config.mla_bwd == "atomic",
            "mla_fwd_mgpu": config.mla_fwd == "mosaic_gpu", "mla_pds_mgpu": config.mla_pds == "mosaic_gpu",
            "remat": config.get("remat", "none"), "token_chunk": int(config.loss.get("token_chunk", 0)),
            "layers": trainer.cfg.num_hidden_layers,
            "context": args.context, "step_s": step, "tokens_per_s": args.context / step,
            "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30, "compile_s": compile_s,
            "loss": float(metrics["loss"]), "kernels": sorted({name for name, _ in kernels}), "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default=None, help="default 8192,32768,65536,131072 (--smoke: 64,128)")
    p.add_argument("--modes", default="dense,sparse")
    p.add_argument("--model", default="small")
    p.add_argument("--attention", default="kernel", help="sparse-mode attention: sparse (plain JAX) or kernel")
    p.add_argument("--cases", default="", help="mode:context,... (replaces --modes x --contexts)")
    p.add_argument("--scan", action="store_true", help="config.scan_layers (MoE blocks as one lax.scan)")
    p.add_argument("--layers", type=int, default=0, help="num_hidden_layers override (0: the preset's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--indexer_fp8", action="store_true", help="config.indexer_fp8: the FP8 indexer's selection")
    p.add_argument("--kl_scatter_add", action="store_true",
                   help="config.kl_key_grad='scatter': eq. 4's key gradient as autodiff's scatter-add (the old default)")
    p.add_argument("--kl_segment_sum", action="store_true",
                   help="config.kl_key_grad='segment_sum': eq. 4's key gradient as float32 rows and one segment sum")
    p.add_argument("--mla_bwd_stored", action="store_true",
                   help="config.mla_bwd='stored' (the default): the sparse MLA kernel's backward without recomputation")
    p.add_argument("--mla_bwd_recompute", action="store_true",
                   help="config.mla_bwd='recompute': the sparse MLA kernel's recomputing backward")
    p.add_argument("--mla_bwd_atomic", action="store_true",
                   help="config.mla_bwd='atomic': the stored backward adding dkv rows in place (fp32 atomics)")
    p.add_argument("--mla_pds_mgpu", action="store_true",
                   help="config.mla_pds='mosaic_gpu': the stored backward's P / dS kernel in Mosaic GPU (issue 31 item 3)")
    p.add_argument("--mla_fwd_mgpu", action="store_true",
                   help="config.mla_fwd='mosaic_gpu': the sparse MLA kernel's Mosaic GPU forward (issue 31 item 2)")
    p.add_argument("--remat", default="none", help="config.remat (none | full | dots | dots_no_batch)")
    p.add_argument("--token_chunk", type=int, default=0, help="config.loss.token_chunk (0: unchunked LM head loss)")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=int, default=900, help="seconds per case")
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="tiny config, 2 short contexts, float32 (CPU)")
    p.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="sparse", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args)), flush=True)
        return
    if args.smoke:
        args.model, args.dtype, args.attention, args.warmup, args.chunk = "tiny", "float32", "sparse", 1, 32
        args.steps = min(args.steps, 2)
    args.contexts = args.contexts or ("64,128" if args.smoke else "8192,32768,65536,131072")
    rows = []
    if args.cases:
        cases = [parse_case(x) for x in args.cases.split(",")]
    else:
        cases = [(m, c, ()) for m in args.modes.split(",") for c in map(int, args.contexts.split(","))]
    modes = list(dict.fromkeys(m for m, _, _ in cases))
    for mode, context, flags in cases:
        cmd = [sys.executable, os.path.abspath(__file__), "--case", f"--mode={mode}", f"--context={context}",
               f"--model={args.model}", f"--attention={args.attention}", f"--dtype={args.dtype}",
               f"--chunk={args.chunk}", f"--warmup={args.warmup}", f"--steps={args.steps}",
               f"--layers={args.layers}"] + (["--scan"] if args.scan else []) + \
            [f"--{f}" for f in CASE_FLAGS if getattr(args, f) or f in flags] + \
            [f"--remat={args.remat}", f"--token_chunk={args.token_chunk}"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            lines = [l for l in res.stdout.splitlines() if l.startswith("RESULT ")]
            if lines:
                row = json.loads(lines[-1][7:])
            else:
                oom = "RESOURCE_EXHAUSTED" in res.stderr or "out of memory" in res.stderr.lower()
                row = {"mode": mode, "context": context, "flags": "+".join(flags),
                       "error": "OOM" if oom else res.stderr[-400:]}
        except subprocess.TimeoutExpired as e:
            partial = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            done = "; ".join(l[9:] for l in partial.splitlines() if l.startswith("PROGRESS "))
            error = f"timeout {args.timeout}s" + (f" after {done}" if done else "")
            row = {"mode": mode, "context": context, "flags": "+".join(flags), "error": error}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| mode | attention | flags | context | step (s) | tokens/s | peak GiB | compile (s) | Pallas kernels in the "
          "step |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        on = "+".join(f for f in CASE_FLAGS if r.get(f))
        if "error" in r:
            print(f"| {r['mode']} | | {r.get('flags', '')} | {r['context']} | {r['error'][:120]!r} | | | | |")
        else:
            print(f"| {r['mode']} | {r['attention']} | {on} | {r['context']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | "
                  f"{r['peak_gib']:.2f} | {r['compile_s']:.0f} | {', '.join(r['kernels']) or 'none'} |")
    for mode in modes:
        fits = [r["context"] for r in rows if r["mode"] == mode and "error" not in r]
        print(f"longest context that fits ({mode}): {max(fits) if fits else 'none'}")
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    if any("error" in r for r in rows) and args.smoke:
        sys.exit(1)


if __name__ == "__main__":
    main()
