"""Benchmark of the DSA kernels (dsv32_jax.kernels, in pallas_kernels/) against their XLA references, in one run.

Per op and key length L it prints the kernel time (median of --iters after --warmup, timed with
jax.block_until_ready), TFLOP/s with the FLOP conventions of shared/docs/kernels.md section 2, and the XLA
reference's time measured in the same run; then a summary table; --out PATH also writes PATH.json and PATH.md.

  python bench/kernels.py                                  # H100: L = 8K, 32K, 128K; 4096 queries; H 128, k 2048
  python bench/kernels.py --smoke                          # tiny shapes in interpret mode (CPU), keeps this alive
  python bench/kernels.py --smoke --impl=interpret_tpu     # the same through the TPU kernel bodies
  python bench/kernels.py --lengths 32768 --tile_sweep bench/tile_sweep_h100.json  # the forward's and the
      # stored backward's tiles that compile for sm_90a (tools/gpu_compile --sweep), each kernel timed per
      # candidate, then the whole backwards at the fastest (bench/gpu_owed.sh 1)
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
import functools
import importlib.util
import datetime
import json
import math
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

if importlib.util.find_spec("dsv32_jax") is None:  # not installed: the source tree (without dsv32_jax.kernels,
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # which needs the install)

from dsv32_jax import kernels  # noqa: E402
from dsv32_jax.model import attention  # noqa: E402
from dsv32_jax.model.indexer import quantize_indexer  # noqa: E402
from dsv32_jax.kernels.indexer_logits import indexer_logits_reference  # noqa: E402
from dsv32_jax.kernels.topk import topk_reference  # noqa: E402

sparse_mla_module = importlib.import_module("dsv32_jax.kernels.sparse_mla")  # `kernels.sparse_mla` is the function


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
    check: str = ""  # the kernel's output against the XLA reference's, at these shapes

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


def rel(a, b) -> float:
    """max |a - b| / max |b| in float32 (the tests' relative error)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def same_scores(idx, ref_idx, scores) -> float:
    """Fraction of rows whose selected score multisets equal the reference's (ties may pick other indices)."""
    def picked(i):
        return jnp.sort(jnp.where(i >= 0, jnp.take_along_axis(scores, jnp.maximum(i, 0), -1), -jnp.inf), -1)
    return float(jnp.mean(jnp.all(picked(idx) == picked(ref_idx), -1)))


def causal_pairs(length, queries):
    first = length - queries
    return sum(first + t + 1 for t in range(queries))


def bench_length(length, sh: Shapes, args, key, emit) -> None:
    """Times every op at key length `length`; emit(Row) as each finishes. An op that fails (compile error, out of
    memory) emits a row with the error in `check` and the rest still run. Arrays go into the jitted functions as
    arguments: closed over, they are constants that XLA constant-folds (minutes at L = 32K on an H200)."""
    impl, w, it = args.impl, args.warmup, args.iters
    t = min(sh.queries, length)
    ks = jax.random.split(key, 8)
    q_index = jnp.arange(length - t, length, dtype=jnp.int32)[None]
    starts, ends = jnp.zeros_like(q_index), q_index + 1
    ref_rows = min(args.ref_rows, t)
    sl = slice(t - ref_rows, t)
    seg = jnp.zeros((1, length), jnp.int32)
    flops = 2 * sh.index_heads * sh.index_dim * causal_pairs(length, t)
    state = {}

    def guarded(op, body):
        if args.ops and not re.search(args.ops, op):
            return
        try:
            emit(body())
        except Exception as e:  # noqa: BLE001 -- a benchmark row per op, whatever breaks
            emit(Row(op, length, float("nan"), None, "", None, check=f"FAILED {type(e).__name__}: {str(e)[:300]}"))

    def guarded_rows(op, body):  # as guarded, for a body that returns several rows
        if args.ops and not re.search(args.ops, op):
            return
        try:
            rows = body()
        except Exception as e:  # noqa: BLE001
            rows = [Row(op, length, float("nan"), None, "", None, check=f"FAILED {type(e).__name__}: {str(e)[:300]}")]
        for r in rows:
            emit(r)

    # ---- indexer: hadamard_quant + logits
    qi = jax.random.normal(ks[0], (1, t, sh.index_heads, sh.index_dim), jnp.bfloat16)
    ki = jax.random.normal(ks[1], (1, length, sh.index_dim), jnp.bfloat16)
    wi = jax.random.normal(ks[2], (1, t, sh.index_heads), jnp.float32) * sh.index_heads**-0.5
    q8, k8, kscale, w8 = quantize_indexer(qi, ki, wi)

    def hadamard():
        hq = jax.jit(lambda x: kernels.hadamard_quant(x, impl=impl))
        ms, (codes, scale) = timed(hq, qi, warmup=w, iters=it)
        ref_ms, (r_codes, r_scale) = timed(jax.jit(lambda x: kernels.hadamard_quant(x, impl="reference")), qi,
                                           warmup=w, iters=it)
        mism = float(jnp.mean(codes.astype(jnp.float32) != r_codes.astype(jnp.float32)))
        check = f"scales {'equal' if bool(jnp.all(scale == r_scale)) else 'DIFFER'}, code mismatch {mism:.1e}"
        return Row("hadamard_quant(q)", length, ms, qi.size * 2 * sh.index_dim / ms / 1e9, "TFLOP/s", ref_ms,
                   check=check)

    def logits_row(k_steps=None):
        logits_fn = jax.jit(lambda a, b, c, d, s, e: kernels.indexer_logits(a, b, c, d, starts=s, ends=e, impl=impl,
                                                                             k_steps=k_steps))
        ms, logits = timed(logits_fn, q8, k8, kscale, w8, starts, ends, warmup=w, iters=it)
        if k_steps is None:
            state["scores"] = logits[0]
        ref_fn = jax.jit(lambda a, b, c, d, s, e: indexer_logits_reference(a, b, c, d, s, e))
        if "logits_ref" not in state:
            state["logits_ref"] = timed(ref_fn, q8[:, sl], k8, kscale, w8[:, sl], starts[:, sl], ends[:, sl],
                                        warmup=w, iters=it)
        ref_ms, ref = state["logits_ref"]
        out = logits[:, sl]
        finite = jnp.isfinite(ref)
        same_mask = bool(jnp.all(jnp.isneginf(out) == jnp.isneginf(ref)))
        err = rel(jnp.where(finite, out, 0), jnp.where(finite, ref, 0))
        return Row("indexer_logits" + ("" if k_steps is None else f" (k_steps={k_steps})"), length, ms,
                   flops / ms / 1e9, "TFLOP/s", ref_ms * t / ref_rows, ref_rows < t,
                   check=f"rel {err:.1e} on {ref_rows} rows, -inf mask {'equal' if same_mask else 'DIFFERS'}")

    def topk_row():
        scores = state["scores"]
        tk = jax.jit(lambda x: kernels.topk(x, sh.topk, impl=impl))
        ms, idx = timed(tk, scores, warmup=w, iters=it)
        ref_ms, ref_idx = timed(jax.jit(lambda x: topk_reference(x, sh.topk)), scores, warmup=w, iters=it)
        state["idx_ref"] = ref_idx  # indexer_topk's check below
        return Row("topk", length, ms, scores.size * 4 / ms / 1e6, "GB/s", ref_ms,
                   check=f"rows with the reference's scores {same_scores(idx, ref_idx, scores):.4f}")

    def indexer_topk_row():
        it_fn = jax.jit(lambda a, b, c, qx, sg: kernels.indexer_topk(a, b, c, qx, sg[:, :t], sg, sh.topk, fp8=True,
                                                                     q_chunk=sh.q_chunk, impl=impl))
        ms, idx = timed(it_fn, qi, ki, wi, q_index, seg, warmup=w, iters=it)
        check = ""
        if "idx_ref" in state:  # the reference top-k of the kernel logits above: same selection, chunked
            check = f"rows with the reference selection's scores {same_scores(idx[0], state['idx_ref'], state['scores']):.4f}"
        return Row("indexer_topk(fp8)", length, ms, flops / ms / 1e9, "TFLOP/s", None, check=check)

    guarded("hadamard_quant(q)", hadamard)
    guarded("indexer_logits", logits_row)
    if impl in (None, "pallas_gpu") and jax.default_backend() == "gpu":
        # issue 31 item 4: the Mosaic GPU kernel with chunks of 8 key blocks per program (queries loaded once)
        guarded("indexer_logits (k_steps=8)", functools.partial(logits_row, 8))
    if "scores" in state:
        guarded("topk", topk_row)
    guarded("indexer_topk(fp8)", indexer_topk_row)
    state.clear()

    # ---- sparse MLA forward / backward on random unique-ish indices (no locality, as FlashMLA's perf tests)
    q = jax.random.normal(ks[3], (1, t, sh.heads, sh.d_qk), jnp.bfloat16)
    kv = jax.random.normal(ks[4], (1, length, sh.d_qk), jnp.bfloat16)
    sel = jax.random.randint(ks[5], (1, t, sh.topk), 0, length, jnp.int32)
    scale = sh.d_qk**-0.5
    fwd_flops = 2 * sh.heads * sh.topk * (sh.d_qk + sh.d_v) * t
    bwd_flops = 2 * sh.heads * sh.topk * (3 * sh.d_qk + 2 * sh.d_v) * t

    def mla(which, **kw):
        if which == "reference":
            return lambda a, c, i: attention.sparse_mla(a, c, i, scale, sh.d_v)
        return lambda a, c, i: kernels.sparse_mla(a, c, i, scale, sh.d_v, impl=which, **kw)

    def fwd_bwd(which, **kw):
        f = mla(which, **kw)
        return jax.jit(jax.grad(lambda a, c, i: f(a, c, i)[0].astype(jnp.float32).sum(), argnums=(0, 1)))

    def fwd_row(which=impl, name="sparse_mla fwd", heads=None, **kw):
        """heads: the first `heads` of q only (what one device of a tensor-sharded step sees), its own reference."""
        qh = q if heads is None else q[:, :, :heads]
        tag = "" if heads is None else f"@{heads}"
        fwd_ms, out = timed(jax.jit(mla(which, **kw)), qh, kv, sel, warmup=w, iters=it)
        if "ref_fwd" + tag not in state:
            state["ref_fwd" + tag] = timed(jax.jit(mla("reference")), qh, kv, sel, warmup=w, iters=it)[0]
        if which == impl and not kw and heads is None:
            state["fwd"] = fwd_ms
        c = slice(0, min(t, args.check_rows))  # against the fp32 reference on the first queries (once per length)
        if "ref32_fwd" + tag not in state:
            state["ref32_fwd" + tag] = jax.jit(mla("reference"))(qh[:, c].astype(jnp.float32),
                                                                 kv.astype(jnp.float32), sel[:, c])
        ref32 = state["ref32_fwd" + tag]
        check = (f"out rel {rel(out[0][:, c], ref32[0]):.1e}, lse rel {rel(out[1][:, c], ref32[1]):.1e} "
                 f"(bf16 in; fp32 reference, {c.stop} queries)")
        flops = fwd_flops * (qh.shape[2] / sh.heads)
        return Row(name, length, fwd_ms, flops / fwd_ms / 1e9, "TFLOP/s", state["ref_fwd" + tag], check=check)

    def bwd_row(bwd, name=None, **kw):
        both_ms, _ = timed(fwd_bwd(impl, bwd=bwd, **kw), q, kv, sel, warmup=w, iters=it)
        if "ref_bwd" not in state:
            ref_both, _ = timed(fwd_bwd("reference"), q, kv, sel, warmup=w, iters=it)
            state["ref_bwd"] = ref_both - state["ref_fwd"]
        bwd_ms = max(both_ms - state["fwd"], 1e-6)
        # the bf16 reference accumulates dkv in bf16 (~T*k/L adds per row): check against fp32 autodiff instead, on
        # the first queries (both sides on the same subset)
        c = slice(0, min(t, args.check_rows))
        dq, dkv = fwd_bwd(impl, bwd=bwd, **kw)(q[:, c], kv, sel[:, c])
        if "ref32_bwd" not in state:  # the fp32 reference's gradients, once per length
            state["ref32_bwd"] = fwd_bwd("reference")(q[:, c].astype(jnp.float32), kv.astype(jnp.float32), sel[:, c])
        rdq, rdkv = state["ref32_bwd"]
        check = (f"dq rel {rel(dq, rdq):.1e}, dkv rel {rel(dkv, rdkv):.1e} (fp32 reference, {c.stop} queries); "
                 f"fwd+bwd {both_ms:.3f} ms")
        if name is None:
            mosaic = "".join(f", {label} mosaic_gpu" for key, label in (("pds", "P/dS"), ("dqkv", "dq/dkv")) if key in kw)
            name = "sparse_mla bwd" + ("" if bwd == "recompute" else f" ({bwd}{mosaic})")
            state[("bwd", bwd, kw.get("pds", "triton"), kw.get("dqkv", "triton"))] = bwd_ms
        return Row(name, length, bwd_ms, bwd_flops / bwd_ms / 1e9, "TFLOP/s", state["ref_bwd"], check=check)

    guarded("sparse_mla fwd", fwd_row)
    if impl in (None, "pallas_gpu") and jax.default_backend() == "gpu" and (sh.d_qk, sh.d_v) == (576, 512):
        # issue 31 item 2: the Mosaic GPU forward (two warpgroups, cp.async gather, wgmma N = 32 / 256), same inputs
        guarded("sparse_mla fwd (mosaic_gpu)", functools.partial(fwd_row, "mosaic_gpu", "sparse_mla fwd (mosaic_gpu)"))
        # ... its ping-pong form (a key block per warpgroup, S on wgmma N = 64, blocks refilled in two parts)
        guarded("sparse_mla fwd (mosaic_gpu pingpong)", functools.partial(
            fwd_row, "mosaic_gpu", "sparse_mla fwd (mosaic_gpu pingpong)", fwd="mosaic_gpu_pingpong"))
        if sh.heads > 32:  # 32 heads a device (tensor:4 of 128): Triton's tiles vs the keys-as-M Mosaic GPU form
            guarded("sparse_mla fwd (32 heads)", functools.partial(fwd_row, impl, "sparse_mla fwd (32 heads)", 32))
            guarded("sparse_mla fwd (mosaic_gpu, 32 heads)",
                    functools.partial(fwd_row, "mosaic_gpu", "sparse_mla fwd (mosaic_gpu, 32 heads)", 32))
    if "fwd" in state:
        guarded("sparse_mla bwd", functools.partial(bwd_row, "recompute"))
        guarded("sparse_mla bwd (stored)", functools.partial(bwd_row, "stored"))
        guarded("sparse_mla bwd (atomic)", functools.partial(bwd_row, "atomic"))
        if impl in (None, "pallas_gpu") and jax.default_backend() == "gpu" and (sh.d_qk, sh.d_v) == (576, 512):
            # issue 31 item 3: P and dS by the Mosaic GPU kernel (`sparse_mla_pds_mgpu`), the rest as "stored"
            guarded("sparse_mla bwd (stored, P/dS mosaic_gpu)",
                    functools.partial(bwd_row, "stored", pds="mosaic_gpu"))
            # ... and dq / dkv by the Mosaic GPU kernel (`sparse_mla_dqkv_mgpu`), then both Mosaic GPU kernels
            guarded("sparse_mla bwd (stored, dq/dkv mosaic_gpu)",
                    functools.partial(bwd_row, "stored", dqkv="mosaic_gpu"))
            guarded("sparse_mla bwd (stored, P/dS mosaic_gpu, dq/dkv mosaic_gpu)",
                    functools.partial(bwd_row, "stored", pds="mosaic_gpu", dqkv="mosaic_gpu"))

    # ---- the GPU backward cut into its kernels, each timed alone over all 4096 queries at once (no token chunks):
    # where its time goes. Rate: the stage's MMA FLOP (all k slots counted) or, for the segment sum, GB/s of partials;
    # the check column adds the share of the whole backward and the GB/s of the traffic it cannot avoid (`Stage`).
    def stage_rows(bwd, pds="triton", dqkv="triton", heads=None):
        """heads: the first `heads` of q (one device of a tensor-sharded step): its P / dS and dq / dkv stages."""
        qh = q if heads is None else q[:, :, :heads]
        do = jax.random.normal(ks[6], (1, t, qh.shape[2], sh.d_v), jnp.bfloat16)
        stages = sparse_mla_module.backward_stages(qh, kv, sel, scale, sh.d_v, do, impl=impl or "pallas_gpu",
                                                    bwd=bwd, pds=pds, pds_only=pds != "triton",  # the rest: Triton's
                                                    dqkv=dqkv)
        if dqkv != "triton":  # the dq / dkv stage alone (the P / dS and segment sum rows are the stored ones)
            stages = [st for st in stages if st.name.startswith("dq/dkv")]
        if heads is not None:  # the segment sum does not depend on the heads
            stages = [st for st in stages if st.name.startswith(("P/dS", "dq/dkv"))]
        whole = None if heads is not None else state.get(("bwd", bwd, pds, dqkv))
        rows = []
        for st in stages:
            ms, _ = timed(st.fn, *st.args, warmup=w, iters=it)
            rate, unit = (st.flops / ms / 1e9, "TFLOP/s") if st.flops else (st.bytes / ms / 1e6, "GB/s")
            share = "" if whole is None else f"{ms / whole:.0%} of the `{bwd}` backward row's time; "
            share += f"moves >= {st.bytes / 1e9:.3g} GB: {st.bytes / ms / 1e6:.0f} GB/s"
            tag = "" if heads is None else f", {heads} heads"
            rows.append(Row(f"sparse_mla bwd ({bwd}) stage: {st.name}{tag}", length, ms, rate, unit, None,
                            check=share))
        return rows

    if impl in (None, "pallas_gpu", "interpret") and jax.default_backend() != "tpu":
        cases = [("stored", "triton", "triton"), ("atomic", "triton", "triton")]
        if impl in (None, "pallas_gpu") and jax.default_backend() == "gpu" and (sh.d_qk, sh.d_v) == (576, 512):
            cases += [("stored", "mosaic_gpu", "triton"), ("stored", "triton", "mosaic_gpu")]
            if sh.heads > 32:  # the stages at 32 heads a device: Triton's tiles vs the keys-as-M Mosaic GPU forms
                cases += [("stored", "triton", "triton", 32), ("stored", "mosaic_gpu", "triton", 32),
                          ("stored", "triton", "mosaic_gpu", 32)]
        for bwd, pds, dqkv, *heads in cases:
            guarded_rows(f"sparse_mla bwd ({bwd}) stages" + ("" if pds == "triton" else f" (P/dS {pds})")
                         + ("" if dqkv == "triton" else f" (dq/dkv {dqkv})") + "".join(f" ({h} heads)" for h in heads),
                         functools.partial(stage_rows, bwd, pds, dqkv, *heads))

    # ---- tiles (issue 31 items 2 and 3): every candidate of the sweep file (tools/gpu_compile --sweep: those that
    # compile for sm_90a without spills or mma.sync) timed: the Triton forward whole, the stored backward's P / dS and
    # dq / dkv each as its own stage, then the whole stored and atomic backwards at the fastest of each, beside the
    # defaults' rows
    def sweep_file():
        with open(args.tile_sweep) as f:
            return json.load(f)

    def fwd_tile_rows():
        rows = []
        for cand in sweep_file()["fwd"]:
            if cand["fits"]:
                label = ", ".join(f"{k} {v}" for k, v in cand["tiles"].items())
                r = fwd_row(impl, f"sparse_mla fwd tiles: [{label}]", **cand["tiles"])
                r.check = (f"sm_90a: {cand['registers']} registers, {cand['smem']:,} B shared memory; "
                           f"{state['fwd'] / r.kernel_ms:.2f}x the default tiles' row; {r.check}")
                rows.append(r)
        if not rows:
            raise ValueError(f"{args.tile_sweep}: no fitting forward candidate")
        return rows

    def tile_rows():
        sweep = sweep_file()
        do = jax.random.normal(ks[6], (1, t, sh.heads, sh.d_v), jnp.bfloat16)
        rows, best = [], {}
        for kernel, stage in (("pds", 0), ("dqkv", 1)):
            for cand in sweep[kernel]:
                if not cand["fits"]:
                    continue
                tiles = kernels.StoredTiles(**cand["tiles"])
                st = sparse_mla_module.backward_stages(q, kv, sel, scale, sh.d_v, do, impl=impl or "pallas_gpu",
                                                        bwd="stored", pds_only=kernel == "pds",
                                                        stored_tiles=tiles)[stage]
                ms, _ = timed(st.fn, *st.args, warmup=w, iters=it)
                label = ", ".join(f"{k.split('_', 1)[1]} {v}" for k, v in cand["tiles"].items())
                rows.append(Row(f"sparse_mla bwd (stored) tiles: {st.name} [{label}]", length, ms,
                                st.flops / ms / 1e9, "TFLOP/s", None,
                                check=f"sm_90a: {cand['registers']} registers, {cand['smem']:,} B shared memory"))
                if ms < best.get(kernel, (math.inf,))[0]:
                    best[kernel] = (ms, cand["tiles"])
        if set(best) != {"pds", "dqkv"}:
            raise ValueError(f"{args.tile_sweep}: no fitting candidate for {sorted({'pds', 'dqkv'} - set(best))}")
        tuned = kernels.StoredTiles(**best["pds"][1], **best["dqkv"][1])
        for bwd in ("stored", "atomic"):
            r = bwd_row(bwd, name=f"sparse_mla bwd ({bwd}, fastest tiles)", stored_tiles=tuned)
            default = state.get(("bwd", bwd, "triton", "triton"))
            r.check = (f"{tuned.label()}; " + ("" if default is None else f"{default / r.kernel_ms:.2f}x the "
                                                                           "default tiles' row; ") + r.check)
            rows.append(r)
        return rows

    if args.tile_sweep and "fwd" in state and impl in (None, "pallas_gpu", "interpret"):
        guarded_rows("sparse_mla fwd tiles", fwd_tile_rows)
        guarded_rows("sparse_mla bwd (stored) tiles", tile_rows)

    # ---- DSA layer (indexer_topk + sparse MLA fwd on its selection) vs dense causal MQA attention
    def layer_row():
        layer = jax.jit(lambda a, b, c, qq, cc, qx, sg: kernels.sparse_mla(
            qq, cc, kernels.indexer_topk(a, b, c, qx, sg[:, :t], sg, sh.topk, fp8=True,
                                         q_chunk=sh.q_chunk, impl=impl), scale, sh.d_v, impl=impl)[0])
        ms, _ = timed(layer, qi, ki, wi, q, kv, q_index, seg, warmup=w, iters=it)
        dense = jax.jit(lambda a, c, qi_, sg: attention.dense_mqa(a, c, qi_, qi_ * 0, sg, scale, sh.d_v, q_chunk=64)[0])
        dense_ms, _ = timed(dense, q[:, sl], kv, q_index[:, sl], seg, warmup=w, iters=it)
        return Row("DSA layer fwd", length, ms, (flops + fwd_flops) / ms / 1e9, "TFLOP/s", dense_ms * t / ref_rows,
                   ref_rows < t)

    guarded("DSA layer fwd", layer_row)


def table(rows: list[Row]) -> str:
    lines = ["| op | L | kernel ms | rate | XLA ref ms | speed-up | kernel vs reference |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = "-" if r.rate is None else f"{r.rate:.1f} {r.unit}"
        ref = "-" if r.xla_ms is None else ("~" if r.xla_scaled else "") + f"{r.xla_ms:.3f}"
        sp = "-" if r.speedup() is None else f"{r.speedup():.2f}x"
        lines.append(f"| {r.op} | {r.length} | {r.kernel_ms:.3f} | {rate} | {ref} | {sp} | {r.check} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8192,32768,131072", help="comma-separated key lengths L")
    p.add_argument("--impl", default=None, help="kernel impl (default: by platform)")
    p.add_argument("--ops", default="", help="regex: only the rows whose op name matches (e.g. '^sparse_mla'; the "
                   "backward rows need the 'sparse_mla fwd' row)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ref-rows", type=int, default=256, help="queries for the memory-bound XLA references")
    p.add_argument("--check-rows", type=int, default=512, help="queries checked against the fp32 reference")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, one iteration, impl=interpret (or --impl=interpret_tpu for the TPU kernels)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    p.add_argument("--tile_sweep", default="", help="a sweep file of tools/gpu_compile --sweep (e.g. "
                   "bench/tile_sweep_h100.json): time the sparse MLA forward and the stored backward's kernels at each "
                   "candidate tile that fits (rows 'sparse_mla fwd tiles: ...', 'sparse_mla bwd (stored) tiles: ...'), "
                   "then the whole backwards at the fastest")
    args = p.parse_args(argv)
    sh = Shapes()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.smoke:
        sh, lengths = SMOKE, [40]
        args.impl = args.impl if args.impl in ("interpret", "interpret_tpu") else "interpret"
        args.warmup, args.iters, args.ref_rows, args.check_rows = 0, 1, 4, 4
    device = jax.devices()[0]
    header = (f"device: {getattr(device, 'device_kind', device.platform)}; jax {jax.__version__}; "
              f"impl {args.impl or 'auto'}; {datetime.date.today().isoformat()}; shapes {dataclasses.asdict(sh)}")
    print(header)
    rows = []

    def write(final=False):
        if not args.out:
            return
        md = header + "\n\n" + table(rows) + ("" if final else "\n\n(incomplete: the run was still going)")
        for suffix, text in ((".json", json.dumps({"header": header, "rows": [dataclasses.asdict(r) for r in rows]},
                                                   indent=1)), (".md", md + "\n")):
            tmp = args.out + suffix + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, args.out + suffix)

    def emit(r):
        print(f"  {r.op:18s} L={r.length:7d} kernel {r.kernel_ms:9.3f} ms  "
              f"{'' if r.rate is None else f'{r.rate:8.1f} {r.unit}'}  "
              f"xla {'-' if r.xla_ms is None else f'{r.xla_ms:9.3f} ms'}  {r.check}", flush=True)
        rows.append(r)
        write()

    for i, length in enumerate(lengths):
        bench_length(length, sh, args, jax.random.key(i), emit)
    print("\n" + header + "\n\n" + table(rows))
    write(final=True)
    return rows


if __name__ == "__main__":
    main()
