"""Where a step's device time goes: one profiled training step (or prefill forward) of the small config, its GPU
kernels summed by name, in one process.

    python bench/profile_step.py --cases=train:kernel:8192,prefill:kernel:32768 --layers=2     # a GPU
    python bench/profile_step.py --model=tiny --cases=train:sparse:64 --dtype=float32           # CPU smoke

A case is what:attention:context[:flags]: "train" is the sparse-stage training step as bench/train_step.py builds it (the
trainer's compiled step, batch 1), "prefill" the model's forward over the prompt (the last position's logits, what
generation's prefill computes); attention is kernel (the Pallas kernels), sparse (plain-JAX DSA) or dense (the
dense stage / dense attention); flags, joined by "+", are the per-case flags of bench/train_step.py
(kl_scatter_add, kl_segment_sum, indexer_fp8, mla_bwd_stored, mla_bwd_recompute, mla_bwd_atomic,
mla_fwd_mgpu, mla_pds_mgpu), each also a global flag here. After --warmup untimed runs one run is traced with
`jax.profiler.trace` and the device plane's kernel events are summed by kernel name (the top --top, then shares by
kind). A CPU run has no device plane and reports the XLA ops of the host's trace instead. --out PATH writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("pallas: top-k", r"_filter_kernel|_fallback_kernel|_bracket_kernel|_emit_kernel|_refine|_topk"),
    ("pallas: sparse MLA", r"_fwd_kernel|_dq_kernel|_dkv_kernel|_probs_kernel|sparse_mla"),
    ("pallas: indexer", r"indexer|hadamard|_logits_kernel|mgpu"),
    ("gemm (cuBLAS / cutlass)", r"gemm|xmma|nvjet|cutlass|cublas|sm90_|wgmma"),
    ("scatter / sort", r"scatter|sort|radix|cub"),
    ("reduce", r"reduce|reduction"),
    ("XLA fusion", r"fusion|loop_|input_|transpose|copy|concatenate|dynamic|slice"),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name, re.IGNORECASE):
            return kind
    return "other"


def build(what: str, attention: str, context: int, args, flags=()):
    """A zero-argument callable running one step / forward (blocking)."""
    import jax
    import numpy as np

    if what == "train":
        from train_step import make_trainer
        ns = argparse.Namespace(mode="dense" if attention == "dense" else ("reference" if attention == "sparse"
                                                                          else "sparse"),
                                model=args.model, dtype=args.dtype, attention="kernel", scan=False,
                                layers=args.layers, chunk=args.chunk, context=context,
                                indexer_fp8=args.indexer_fp8 or "indexer_fp8" in flags,
                                kl_scatter_add=args.kl_scatter_add or "kl_scatter_add" in flags,
                                kl_segment_sum=args.kl_segment_sum or "kl_segment_sum" in flags,
                                mla_bwd_stored=args.mla_bwd_stored or "mla_bwd_stored" in flags,
                                mla_bwd_recompute=args.mla_bwd_recompute or "mla_bwd_recompute" in flags,
                                mla_bwd_atomic=args.mla_bwd_atomic or "mla_bwd_atomic" in flags,
                                mla_pds_mgpu=args.mla_pds_mgpu or "mla_pds_mgpu" in flags,
                                mla_fwd_mgpu=args.mla_fwd_mgpu or "mla_fwd_mgpu" in flags)
        trainer, batch = make_trainer(ns)
        return lambda: jax.block_until_ready(trainer.train_step(batch))
    import jax.numpy as jnp
    from flax import nnx

    import dsv32_jax
    from dsv32_jax import RunOptions, Transformer
    cfg = dsv32_jax.load_preset(args.model).replace(num_nextn_predict_layers=0)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    if cfg.max_position_embeddings < context:
        cfg = cfg.replace(max_position_embeddings=context)
    dtype = jnp.dtype(args.dtype)
    options = RunOptions(dsa=attention != "dense", attention="kernel" if attention == "kernel" else "sparse",
                         attn_chunk=args.chunk, index_chunk=args.chunk,
                         indexer_fp8=args.indexer_fp8 or "indexer_fp8" in flags,
                         mla_fwd="mosaic_gpu" if args.mla_fwd_mgpu or "mla_fwd_mgpu" in flags else "triton",
                         mla_pds="mosaic_gpu" if args.mla_pds_mgpu or "mla_pds_mgpu" in flags else "triton")
    model = Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype, options=options)
    ids = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (1, context)), jnp.int32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids)[:, -1]

    return lambda: jax.block_until_ready(forward(state, ids))


def device_events(xplane: str):
    """(name, duration in us) of every kernel on the device plane's streams, or of the host's XLA ops on a CPU."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(xplane)
    out = []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU") or plane.name.startswith("/device:TPU"):
            for line in plane.lines:
                if line.name.startswith("Stream") or line.name == "XLA Ops" and plane.name.startswith("/device:TPU"):
                    out += [(ev.name, ev.duration_ns / 1e3) for ev in line.events]
    if out:
        return out, "device"
    for plane in data.planes:  # CPU: the thunks XLA:CPU ran
        if plane.name == "/host:CPU":
            for line in plane.lines:
                if line.name.startswith("tf_XLA") or "Eigen" in line.name:
                    out += [(ev.name, ev.duration_ns / 1e3) for ev in line.events]
    return out, "host"


def profile_case(case: str, args) -> dict:
    import jax
    from train_step import parse_case
    what, rest = case.split(":", 1)
    attention, context, flags = parse_case(rest)
    t0 = time.perf_counter()
    fn = build(what, attention, context, args, flags)
    fn()
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        fn()
    t0 = time.perf_counter()
    fn()
    wall_s = time.perf_counter() - t0
    tmp = tempfile.mkdtemp(prefix="dsv32_profile_")
    with jax.profiler.trace(tmp):
        fn()
    files = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
    events, source = device_events(files[0]) if files else ([], "none")
    if os.environ.get("PROFILE_HOST"):  # what the host did meanwhile (compiles, syncs, transfers)
        from jax.profiler import ProfileData
        host = collections.defaultdict(float)
        for plane in ProfileData.from_file(files[0]).planes:
            if plane.name == "/host:CPU":
                for line in plane.lines:
                    for ev in line.events:
                        host[ev.name[:120]] += ev.duration_ns / 1e6
        for name, ms in sorted(host.items(), key=lambda kv: -kv[1])[:30]:
            print(f"  host {ms:10.1f} ms  {name}", flush=True)
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, us in events:
        by_name[name][0] += us
        by_name[name][1] += 1
    total = sum(v[0] for v in by_name.values())
    by_kind = collections.defaultdict(float)
    for name, (us, _) in by_name.items():
        by_kind[kind_of(name)] += us
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]
    return {"case": case, "layers": args.layers, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "wall_s": wall_s, "compile_s": compile_s, "source": source, "kernel_ms": total / 1e3,
            "kinds": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "ms": us / 1e3, "count": c} for n, (us, c) in top]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="train:kernel:8192,prefill:kernel:32768")
    p.add_argument("--model", default="small")
    p.add_argument("--layers", type=int, default=2, help="num_hidden_layers (0: the preset's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--indexer_fp8", action="store_true", help="the FP8 indexer's selection (production form)")
    p.add_argument("--kl_scatter_add", action="store_true", help="eq. 4's key gradient as autodiff's scatter-add")
    p.add_argument("--kl_segment_sum", action="store_true", help="eq. 4's key gradient as rows + one segment sum")
    p.add_argument("--mla_bwd_stored", action="store_true", help="the sparse MLA kernel's stored backward (default)")
    p.add_argument("--mla_bwd_recompute", action="store_true", help="the sparse MLA kernel's recomputing backward")
    p.add_argument("--mla_bwd_atomic", action="store_true",
                   help="the sparse MLA kernel's stored backward with dkv added in place (fp32 atomics)")
    p.add_argument("--mla_pds_mgpu", action="store_true",
                   help="the sparse MLA kernel's stored backward with its P / dS kernel in Mosaic GPU")
    p.add_argument("--mla_fwd_mgpu", action="store_true", help="the sparse MLA kernel's Mosaic GPU forward")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = []
    for case in args.cases.split(","):
        row = profile_case(case, args)
        rows.append(row)
        print(f"\n== {case} ({row['layers']} layers, {row['device']}, jax {row['jax']}): wall {row['wall_s']:.3f} s, "
              f"{row['source']} kernels {row['kernel_ms']:.1f} ms, compile + first run {row['compile_s']:.0f} s")
        print("  by kind: " + "; ".join(f"{k} {v:.1f} ms" for k, v in row["kinds"].items()))
        for t in row["top"]:
            print(f"  {t['ms']:9.2f} ms  x{t['count']:<5d} {t['name']}")
        if args.out:
            from dsv32_jax.checkpoint.io_utils import write_text_atomic
            write_text_atomic(args.out, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
