"""Generation speed: decoding with the caches (dsv32_jax.posttrain.generate.generate_stream: MLA latent cache +
indexer key cache, one jitted step per token) against re-running the whole prefix for every token
(generate_no_cache), side by side in one run; and prefill / decode tokens/s at long context with DSA vs dense
attention (the GPU figure: --config=small --prompt_len=32768 --attention=kernel,sparse,dense --modes=cache).

    python bench/generate.py                                  # CPU: tiny preset, 256-token prompt, 32 new tokens
    python bench/generate.py --config=small --prompt_len=32768 --new_tokens=64 --attention=kernel,sparse,dense \
        --modes=cache --dtype=bfloat16                        # the 32K figure (a GPU)

Random weights (the preset's initialization; speed does not depend on the values), greedy decoding, batch 1, one
untimed warm-up run per mode (compilation). Prints one line per (attention, mode) and a JSON summary
(--json=PATH to write it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

try:  # installed (or the installed layout on PYTHONPATH: dsv32_jax.kernels exists only there), else this checkout
    import dsv32_jax  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dsv32_jax  # noqa: E402
from dsv32_jax import RunOptions, Transformer  # noqa: E402
from dsv32_jax.posttrain.generate import generate_no_cache, generate_stream  # noqa: E402
from dsv32_jax.posttrain.sampler import SamplingConfig  # noqa: E402


def timed_stream(model, ids, cfg):
    """(prefill seconds incl. the first token, decode seconds for the rest, tokens)."""
    t0 = time.perf_counter()
    out, t1 = [], None
    for tok in generate_stream(model, ids, cfg):
        out.append(tok)
        if t1 is None:
            t1 = time.perf_counter()
    return t1 - t0, time.perf_counter() - t1, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny", help="preset (dsv32_jax/presets) or config.json")
    ap.add_argument("--prompt_len", type=int, default=256)
    ap.add_argument("--new_tokens", type=int, default=32)
    ap.add_argument("--attention", default="sparse",
                    help="comma list of sparse (DSA, plain-JAX gather) / kernel (DSA with the Pallas kernels) / dense")
    ap.add_argument("--modes", default="cache,nocache", help="comma list of cache / nocache")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--indexer_fp8", action="store_true", help="the FP8 indexer's selection (production form)")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the preset's)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    cfg = dsv32_jax.load_preset(args.config).replace(num_nextn_predict_layers=0)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    need = args.prompt_len + args.new_tokens
    if cfg.max_position_embeddings < need:
        cfg = cfg.replace(max_position_embeddings=need)
    ids = np.random.default_rng(0).integers(2, cfg.vocab_size, args.prompt_len).tolist()
    scfg = SamplingConfig(max_new_tokens=args.new_tokens, greedy=True, eos_id=-1)
    dtype = jnp.dtype(args.dtype)
    rows, cached = [], {}
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); config {args.config} "
          f"({cfg.num_hidden_layers} layers, index_topk {cfg.index_topk}), prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, {args.dtype}", flush=True)
    for attention in args.attention.split(","):
        if attention not in ("sparse", "kernel", "dense"):
            raise SystemExit(f"--attention: unknown attention {attention!r} (sparse, kernel, dense)")
        options = RunOptions(dsa=attention != "dense", attention="kernel" if attention == "kernel" else "sparse",
                             indexer_fp8=args.indexer_fp8)
        model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, options=options)
        tokens = {}
        for mode in args.modes.split(","):
            if mode == "cache":
                timed_stream(model, ids, scfg)  # warm-up: compilation
                prefill_s, decode_s, out = timed_stream(model, ids, scfg)
                row = dict(attention=attention, mode=mode, prefill_tok_s=args.prompt_len / prefill_s,
                           decode_tok_s=(len(out) - 1) / decode_s, tok_s=len(out) / (prefill_s + decode_s),
                           seconds=prefill_s + decode_s)
            elif mode == "nocache":
                generate_no_cache(model, ids, scfg)
                t0 = time.perf_counter()
                out = generate_no_cache(model, ids, scfg)
                seconds = time.perf_counter() - t0
                row = dict(attention=attention, mode=mode, tok_s=len(out) / seconds, seconds=seconds)
            else:
                raise SystemExit(f"--modes: unknown mode {mode!r} (cache, nocache)")
            tokens[mode] = out
            if mode == "cache":
                cached[attention] = out
            rows.append(row)
            print(f"{attention:6} {mode:7} " + " ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                       if isinstance(v, float)), flush=True)
        if len(tokens) == 2:
            same = tokens["cache"] == tokens["nocache"]
            ratio = next(r["tok_s"] for r in rows[-2:] if r["mode"] == "cache") / rows[-1]["tok_s"]
            print(f"{attention}: cache / re-run-prefix tokens/s ratio {ratio:.1f}x (same tokens: {same})", flush=True)
            rows.append(dict(attention=attention, ratio=ratio, same_tokens=same))
    if "kernel" in cached and "sparse" in cached:  # same weights (one seed): the kernels must pick the same tokens
        same = cached["kernel"] == cached["sparse"]
        print(f"kernel vs sparse (plain JAX) greedy tokens equal: {same}", flush=True)
        rows.append(dict(attention="kernel", vs="sparse", same_tokens=same))
    summary = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, config=args.config,
                   prompt_len=args.prompt_len, new_tokens=args.new_tokens, dtype=args.dtype, rows=rows)
    print(json.dumps(summary))
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
