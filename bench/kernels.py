"""Benchmark of the DSA kernels (dsv32_jax.kernels, in pallas_kernels/) against their XLA references, in one run.

Per op and key length L it prints the kernel time (median of --iters after --warmup, timed with
jax.block_until_ready), TFLOP/s with the FLOP conventions of shared/docs/kernels.md section 2, and the XLA
reference's time measured in the same run; then a summary table; --out PATH also writes PATH.json and PATH.md.

  python bench/kernels.py                                  # H100: L = 8K, 32K, 128K; 4096 queries; H 128, k 2048
  python bench/kernels.py --smoke                          # tiny shapes in interpret mode (CPU), keeps this alive
  python bench/kernels.py --smoke --impl=interpret_tpu     # the same through the TPU kernel bodies
  (on a TPU, the default impl is pallas_tpu: the Mosaic kernels, with the reference top-k)

FLOP conventions: indexer 2*H_I*d_I per visible (query, key) pair (causal: the 4096 queries are the last
positions of the L keys); sparse MLA forward 2*H*k*(d_qk + d_v) per query, backward 2*H*k*(3*d_qk + 2*d_v)
per query (all k slots counted, as FlashMLA/TileLang); top-k is reported as GB/s of fp32 logits read.
XLA references that would not fit in memory (the indexer's [T, H_I, L] intermediate, dense MQA at 128K) run on
--ref-rows queries and are scaled linearly to all queries (marked "~").
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv32_jax import kernels  # noqa: E402
from dsv32_jax import attention  # noqa: E402
from dsv32_jax.indexer import quantize_indexer  # noqa: E402
from dsv32_jax.kernels.indexer_logits import indexer_logits_reference  # noqa: E402
from dsv32_jax.kernels.topk import topk_reference  # noqa: E402


@dataclasses.dataclass
class Shapes:
    queries: int = 4096
    heads: int = 128
    d_qk: int = 576
    d_v: int = 512
    topk: int = 2048
    index_heads: int = 64
    index_dim: int = 128
    q_chunk: int = 256  # indexer_topk query chunk


SMOKE = Shapes(queries=8, heads=16, d_qk=48, d_v=32, topk=16, index_heads=16, index_dim=128, q_chunk=4)


@dataclasses.dataclass
class Row:
    op: str
    length: int
    kernel_ms: float
    rate: float | None  # TFLOP/s (or GB/s for top-k)
    unit: str
    xla_ms: float | None
    xla_scaled: bool = False

    def speedup(self):
        return None if self.xla_ms is None else self.xla_ms / self.kernel_ms


def timed(fn, *args, warmup, iters):
    out = None
    for _ in range(max(warmup, 1)):
        out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def causal_pairs(length, queries):
    first = length - queries
    return sum(first + t + 1 for t in range(queries))


def bench_length(length, sh: Shapes, args, key) -> list[Row]:
    impl, w, it = args.impl, args.warmup, args.iters
    t = min(sh.queries, length)
    rows = []
    ks = jax.random.split(key, 8)
    q_index = jnp.arange(length - t, length, dtype=jnp.int32)[None]
    starts, ends = jnp.zeros_like(q_index), q_index + 1
    ref_rows = min(args.ref_rows, t)

    # ---- indexer: hadamard_quant + logits
    qi = jax.random.normal(ks[0], (1, t, sh.index_heads, sh.index_dim), jnp.bfloat16)
    ki = jax.random.normal(ks[1], (1, length, sh.index_dim), jnp.bfloat16)
    wi = jax.random.normal(ks[2], (1, t, sh.index_heads), jnp.float32) * sh.index_heads**-0.5
    q8, k8, kscale, w8 = quantize_indexer(qi, ki, wi)
    hq = jax.jit(lambda x: kernels.hadamard_quant(x, impl=impl))
    ms, _ = timed(hq, qi, warmup=w, iters=it)
    ref_ms, _ = timed(jax.jit(lambda x: kernels.hadamard_quant(x, impl="reference")), qi, warmup=w, iters=it)
    rows.append(Row("hadamard_quant(q)", length, ms, qi.size * 2 * sh.index_dim / ms / 1e9, "TFLOP/s", ref_ms))

    logits_fn = jax.jit(lambda a, b, c, d, s, e: kernels.indexer_logits(a, b, c, d, starts=s, ends=e, impl=impl))
    ms, logits = timed(logits_fn, q8, k8, kscale, w8, starts, ends, warmup=w, iters=it)
    flops = 2 * sh.index_heads * sh.index_dim * causal_pairs(length, t)
    ref_fn = jax.jit(lambda a, b, c, d, s, e: indexer_logits_reference(a, b, c, d, s, e))
    sl = slice(t - ref_rows, t)
    ref_ms, _ = timed(ref_fn, q8[:, sl], k8, kscale, w8[:, sl], starts[:, sl], ends[:, sl], warmup=w, iters=it)
    rows.append(Row("indexer_logits", length, ms, flops / ms / 1e9, "TFLOP/s", ref_ms * t / ref_rows,
                    ref_rows < t))

    # ---- top-k over the causal logits
    scores = logits[0]
    tk = jax.jit(lambda x: kernels.topk(x, sh.topk, impl=impl))
    ms, _ = timed(tk, scores, warmup=w, iters=it)
    ref_ms, _ = timed(jax.jit(lambda x: topk_reference(x, sh.topk)), scores, warmup=w, iters=it)
    rows.append(Row("topk", length, ms, scores.size * 4 / ms / 1e6, "GB/s", ref_ms))

    # ---- indexer_topk (fp8 composition, chunked over queries)
    seg = jnp.zeros((1, length), jnp.int32)
    it_fn = jax.jit(lambda a, b, c: kernels.indexer_topk(a, b, c, q_index, seg[:, :t], seg, sh.topk, fp8=True,
                                                                q_chunk=sh.q_chunk, impl=impl))
    ms, idx = timed(it_fn, qi, ki, wi, warmup=w, iters=it)
    rows.append(Row("indexer_topk(fp8)", length, ms, flops / ms / 1e9, "TFLOP/s", None))

    # ---- sparse MLA forward / backward on random unique-ish indices (no locality, as FlashMLA's perf tests)
    q = jax.random.normal(ks[3], (1, t, sh.heads, sh.d_qk), jnp.bfloat16)
    kv = jax.random.normal(ks[4], (1, length, sh.d_qk), jnp.bfloat16)
    sel = jax.random.randint(ks[5], (1, t, sh.topk), 0, length, jnp.int32)
    scale = sh.d_qk**-0.5
    fwd_flops = 2 * sh.heads * sh.topk * (sh.d_qk + sh.d_v) * t
    bwd_flops = 2 * sh.heads * sh.topk * (3 * sh.d_qk + 2 * sh.d_v) * t

    def mla(which):
        if which == "reference":
            return lambda a, c, i: attention.sparse_mla(a, c, i, scale, sh.d_v)
        return lambda a, c, i: kernels.sparse_mla(a, c, i, scale, sh.d_v, impl=which)

    def fwd_bwd(which):
        f = mla(which)
        return jax.jit(jax.grad(lambda a, c, i: f(a, c, i)[0].astype(jnp.float32).sum(), argnums=(0, 1)))

    fwd_ms, _ = timed(jax.jit(mla(impl)), q, kv, sel, warmup=w, iters=it)
    ref_fwd, _ = timed(jax.jit(mla("reference")), q, kv, sel, warmup=w, iters=it)
    rows.append(Row("sparse_mla fwd", length, fwd_ms, fwd_flops / fwd_ms / 1e9, "TFLOP/s", ref_fwd))
    both_ms, _ = timed(fwd_bwd(impl), q, kv, sel, warmup=w, iters=it)
    ref_both, _ = timed(fwd_bwd("reference"), q, kv, sel, warmup=w, iters=it)
    bwd_ms = max(both_ms - fwd_ms, 1e-6)
    rows.append(Row("sparse_mla bwd", length, bwd_ms, bwd_flops / bwd_ms / 1e9, "TFLOP/s", ref_both - ref_fwd))

    # ---- DSA layer (indexer_topk + sparse MLA fwd on its selection) vs dense causal MQA attention
    layer = jax.jit(lambda a, b, c, qq, cc: kernels.sparse_mla(
        qq, cc, kernels.indexer_topk(a, b, c, q_index, seg[:, :t], seg, sh.topk, fp8=True,
                                            q_chunk=sh.q_chunk, impl=impl), scale, sh.d_v, impl=impl)[0])
    ms, _ = timed(layer, qi, ki, wi, q, kv, warmup=w, iters=it)
    dense = jax.jit(lambda a, c, qi_: attention.dense_mqa(a, c, qi_, qi_ * 0, seg, scale, sh.d_v, q_chunk=64)[0])
    dense_ms, _ = timed(dense, q[:, sl], kv, q_index[:, sl], warmup=w, iters=it)
    rows.append(Row("DSA layer fwd", length, ms, (flops + fwd_flops) / ms / 1e9, "TFLOP/s",
                    dense_ms * t / ref_rows, ref_rows < t))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| op | L | kernel ms | rate | XLA ref ms | speed-up |", "|---|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r.rate is None else f"{r.rate:.1f} {r.unit}"
        ref = "-" if r.xla_ms is None else ("~" if r.xla_scaled else "") + f"{r.xla_ms:.3f}"
        sp = "-" if r.speedup() is None else f"{r.speedup():.2f}x"
        lines.append(f"| {r.op} | {r.length} | {r.kernel_ms:.3f} | {rate} | {ref} | {sp} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8192,32768,131072", help="comma-separated key lengths L")
    p.add_argument("--impl", default=None, help="kernel impl (default: by platform)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ref-rows", type=int, default=256, help="queries for the memory-bound XLA references")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, one iteration, impl=interpret (or --impl=interpret_tpu for the TPU kernels)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    sh = Shapes()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.smoke:
        sh, lengths = SMOKE, [40]
        args.impl = args.impl if args.impl in ("interpret", "interpret_tpu") else "interpret"
        args.warmup, args.iters, args.ref_rows = 0, 1, 4
    device = jax.devices()[0]
    header = (f"device: {getattr(device, 'device_kind', device.platform)}; jax {jax.__version__}; "
              f"impl {args.impl or 'auto'}; {datetime.date.today().isoformat()}; shapes {dataclasses.asdict(sh)}")
    print(header)
    rows = []
    for i, length in enumerate(lengths):
        for r in bench_length(length, sh, args, jax.random.key(i)):
            print(f"  {r.op:18s} L={r.length:7d} kernel {r.kernel_ms:9.3f} ms  "
                  f"{'' if r.rate is None else f'{r.rate:8.1f} {r.unit}'}  "
                  f"xla {'-' if r.xla_ms is None else f'{r.xla_ms:9.3f} ms'}", flush=True)
            rows.append(r)
    md = header + "\n\n" + table(rows)
    print("\n" + md)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"header": header, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(md + "\n")
    return rows


if __name__ == "__main__":
    main()
