"""FP8 lightning-indexer logits, eq. (1), with DeepGEMM `fp8_mqa_logits` semantics (reference_spec.md 5.2, 5.5):

    I[t, s] = k_scale[s] * sum_h w'[t, h] * ReLU(q_fp8[t, h] . k_fp8[s])    for s in [start_t, end_t), else -inf

with the q scales and all constants folded into w' (`dsv32_jax.model.indexer.quantize_indexer`).

Kernel (Pallas, Triton backend): one program per (batch, block of BQ query tokens); q (BQ x H x D e4m3) and w'
stay resident while the program walks the key axis in blocks of BK rows (DeepGEMM's q-resident layout, the K
working set streams from L2): per query row one FP8 MMA [BK, D] x [D, H] with fp32 accumulation, then ReLU, the
weighted head sum and the k scale (applied after the head sum) on the CUDA cores. Key blocks outside
[min start, max end) of the program's rows are not computed, only filled with -inf (causal block skipping).

TPU kernel (Mosaic): grid (batch, query block of BQ rows, key block of BK keys). One MXU matmul per program,
[BQ * H, D] x [D, BK] (the e4m3 codes widened to bf16, which is exact; v5e/v5p MXUs have no FP8), then ReLU, the
head-weighted sum ([BQ, H, 1] weights broadcast along the key lanes), the k scale and the range mask. The
per-query-block key range [min start, max end) is scalar-prefetched: key blocks outside it are filled with -inf
without touching the MXU, and their index map is clamped into the range, so the pipeline does not even fetch
their keys from HBM (a causal prefill reads about half of K).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from dsv32_jax.model.indexer import check_query_keys, index_scores_fp8
from dsv32_jax.kernels import indexer_logits_mgpu as mgpu_kernel
from dsv32_jax.kernels._dispatch import target_device, next_pow2, resolve_impl, round_up, tpu_interpret_params
from dsv32_jax.kernels._vmap import ROWS, fold_vmap


def _ranges(starts, ends, b, t, s):
    out = []
    for name, x, default in (("starts", starts, 0), ("ends", ends, s)):
        if x is None:
            out.append(jnp.full((b, t), default, jnp.int32))
            continue
        x = jnp.asarray(x)
        try:  # (a [B, 1] range read past its end: the interpreted kernel looped on garbage bounds)
            x = jnp.broadcast_to(x, (b, t))
        except ValueError:
            raise ValueError(f"indexer_logits: {name} of shape {x.shape} must broadcast to (B, T) = {(b, t)}") from None
        out.append(jnp.clip(x.astype(jnp.int32), 0, s))
    return tuple(out)


def check_shapes(q_fp8, k_fp8, k_scale, weights) -> None:
    """The arguments' shapes against q_fp8's [B, T, H, D]: the kernels read by them, and a mismatch came back as
    NaN (interpret mode's padding) or, on a chip, whatever memory held."""
    b, t, h, _, _ = check_query_keys("indexer_logits", "q_fp8", "k_fp8", q_fp8, k_fp8)
    if k_scale.shape != k_fp8.shape[:2]:
        raise ValueError(f"indexer_logits: k_scale must be [B, S] = {k_fp8.shape[:2]}, got shape {k_scale.shape}")
    if weights.shape != (b, t, h):
        raise ValueError(f"indexer_logits: weights must be [B, T, H] = {(b, t, h)}, got shape {weights.shape}")


def indexer_logits_reference(q_fp8, k_fp8, k_scale, weights, starts=None, ends=None, out_dtype=jnp.float32):
    b, t, _, _ = q_fp8.shape
    s = k_fp8.shape[1]
    starts, ends = _ranges(starts, ends, b, t, s)
    col = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    inside = (col >= starts[..., None]) & (col < ends[..., None])
    logits = index_scores_fp8(q_fp8, k_fp8, k_scale, weights.astype(jnp.float32))
    return jnp.where(inside, logits, -jnp.inf).astype(out_dtype)


def _kernel(q_ref, k_ref, ks_ref, w_ref, st_ref, en_ref, o_ref, *, block_q, block_k, num_keys, mma_dtype):
    n_blocks = pl.cdiv(num_keys, block_k)
    starts = [st_ref[r] for r in range(block_q)]
    ends = [en_ref[r] for r in range(block_q)]
    lo = functools.reduce(jnp.minimum, starts)
    hi = functools.reduce(jnp.maximum, ends)
    first = jnp.where(hi > lo, lo // block_k, 0)
    last = jnp.where(hi > lo, pl.cdiv(hi, block_k), 0)
    neg_inf = jnp.full((1, block_k), -jnp.inf, o_ref.dtype)

    def fill(j, carry):
        cols = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        for r in range(block_q):
            pltriton.store(o_ref.at[pl.ds(r, 1), pl.ds(j * block_k, block_k)], neg_inf, mask=cols[None] < num_keys)
        return carry

    def compute(j, carry):
        cols = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        in_range = cols < num_keys
        k = pltriton.load(k_ref.at[pl.ds(j * block_k, block_k), :], mask=in_range[:, None], other=0.0)
        k_scale = pltriton.load(ks_ref.at[pl.ds(j * block_k, block_k)], mask=in_range, other=0.0)
        for r in range(block_q):
            dots = jax.lax.dot_general(k.astype(mma_dtype), q_ref[r].astype(mma_dtype), (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)  # [BK, H]
            row = jnp.sum(jnp.maximum(dots, 0.0) * w_ref[r][None, :], axis=1) * k_scale
            row = jnp.where((cols >= starts[r]) & (cols < ends[r]), row, -jnp.inf)
            pltriton.store(o_ref.at[pl.ds(r, 1), pl.ds(j * block_k, block_k)], row[None].astype(o_ref.dtype),
                           mask=in_range[None])
        return carry

    zero = jnp.int32(0)  # a loop-carried value (a Python literal carry does not lower on jax 0.11 Triton)
    jax.lax.fori_loop(0, first, fill, zero)
    jax.lax.fori_loop(first, last, compute, zero)
    jax.lax.fori_loop(last, n_blocks, fill, zero)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_q", "block_k", "backend", "num_warps",
                                             "num_stages"))
def _indexer_logits_pallas(q_fp8, k_fp8, k_scale, weights, starts, ends, *, out_dtype, block_q, block_k, backend,
                           num_warps, num_stages):
    b, t, h, d = q_fp8.shape
    s = k_fp8.shape[1]
    hp, dp, tp = next_pow2(h, 16), next_pow2(d, 32), round_up(t, block_q)
    block_k = min(block_k, next_pow2(s, 16))
    q = jnp.pad(q_fp8, ((0, 0), (0, tp - t), (0, hp - h), (0, dp - d)))
    k = jnp.pad(k_fp8, ((0, 0), (0, 0), (0, dp - d)))
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, tp - t), (0, hp - h)))
    starts, ends = (jnp.pad(a, ((0, 0), (0, tp - t))) for a in _ranges(starts, ends, b, t, s))
    extra = {}
    if backend == "pallas_gpu":
        extra["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    # FP8 MMA on the GPU; interpret mode widens the e4m3 codes to bf16 (exact) for the host dot.
    mma_dtype = q.dtype if backend == "pallas_gpu" else jnp.bfloat16
    rows = pl.BlockSpec((None, block_q), lambda bi, i: (bi, i))
    out = pl.pallas_call(
        functools.partial(_kernel, block_q=block_q, block_k=block_k, num_keys=s, mma_dtype=mma_dtype),
        grid=(b, tp // block_q),
        in_specs=[pl.BlockSpec((None, block_q, hp, dp), lambda bi, i: (bi, i, 0, 0)),
                  pl.BlockSpec((None, s, dp), lambda bi, i: (bi, 0, 0)),
                  pl.BlockSpec((None, s), lambda bi, i: (bi, 0)),
                  pl.BlockSpec((None, block_q, hp), lambda bi, i: (bi, i, 0)), rows, rows],
        out_specs=pl.BlockSpec((None, block_q, s), lambda bi, i: (bi, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, tp, s), out_dtype),
        interpret=backend == "interpret",
        **extra,
    )(q, k, k_scale.astype(jnp.float32), w, starts, ends)
    return out[:, :t]


def _tpu_kernel(lo_ref, hi_ref, q_ref, k_ref, ks_ref, w_ref, st_ref, en_ref, o_ref, *, block_k):
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[b, i], hi_ref[b, i]
    overlaps = (hi > lo) & (j * block_k < hi) & ((j + 1) * block_k > lo)

    @pl.when(overlaps)
    def _():
        bq, h, d = q_ref.shape
        q = q_ref[...].astype(jnp.bfloat16).reshape(bq * h, d)
        dots = jax.lax.dot_general(q, k_ref[...].astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [BQ * H, BK]
        weighted = jnp.maximum(dots, 0.0).reshape(bq, h, block_k) * w_ref[...]
        row = jnp.sum(weighted, axis=1) * ks_ref[...]  # [BQ, BK]
        cols = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (bq, block_k), 1)
        row = jnp.where((cols >= st_ref[...]) & (cols < en_ref[...]), row, -jnp.inf)
        o_ref[...] = row.astype(o_ref.dtype)

    @pl.when(jnp.logical_not(overlaps))
    def _():
        o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_q", "block_k", "backend"))
def _indexer_logits_tpu(q_fp8, k_fp8, k_scale, weights, starts, ends, *, out_dtype, block_q, block_k, backend):
    b, t, h, d = q_fp8.shape
    s = k_fp8.shape[1]
    hp, dp, tp = round_up(h, 8), round_up(d, 128), round_up(t, block_q)
    block_k = min(block_k, round_up(s, 128))
    sp = round_up(s, block_k)
    nq, nk = tp // block_q, sp // block_k
    q = jnp.pad(q_fp8, ((0, 0), (0, tp - t), (0, hp - h), (0, dp - d)))
    k = jnp.pad(k_fp8, ((0, 0), (0, sp - s), (0, dp - d)))
    ks = jnp.pad(k_scale.astype(jnp.float32), ((0, 0), (0, sp - s)))[:, None, :]
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, tp - t), (0, hp - h)))[..., None]
    starts, ends = _ranges(starts, ends, b, t, s)
    # padded query rows get the empty range [s, s): they neither widen a block's key range nor see a key
    starts, ends = (jnp.pad(a, ((0, 0), (0, tp - t)), constant_values=s) for a in (starts, ends))
    empty = ends <= starts
    lo = jnp.min(jnp.where(empty, sp, starts).reshape(b, nq, block_q), axis=-1)
    hi = jnp.max(jnp.where(empty, 0, ends).reshape(b, nq, block_q), axis=-1)

    def key_block(bi, i, j, lo_ref, hi_ref):  # clamped into the block's key range: skipped blocks fetch nothing
        first = jnp.minimum(lo_ref[bi, i] // block_k, nk - 1)  # lo = sp for a block of empty rows
        last = jnp.maximum(pl.cdiv(hi_ref[bi, i], block_k) - 1, first)
        return jnp.clip(j, first, last)

    rows = pl.BlockSpec((None, block_q, 1), lambda bi, i, j, *_: (bi, i, 0))

    def call(lo, hi, q, *rest):  # (a function of the batch rows: under jax.vmap the mapped axis joins them, _vmap)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(q.shape[0], nq, nk),
            in_specs=[pl.BlockSpec((None, block_q, hp, dp), lambda bi, i, j, *_: (bi, i, 0, 0)),
                      pl.BlockSpec((None, block_k, dp), lambda bi, i, j, *r: (bi, key_block(bi, i, j, *r), 0)),
                      pl.BlockSpec((None, 1, block_k), lambda bi, i, j, *r: (bi, 0, key_block(bi, i, j, *r))),
                      pl.BlockSpec((None, block_q, hp, 1), lambda bi, i, j, *_: (bi, i, 0, 0)), rows, rows],
            out_specs=pl.BlockSpec((None, block_q, block_k), lambda bi, i, j, *_: (bi, i, j)))
        return pl.pallas_call(
            functools.partial(_tpu_kernel, block_k=block_k),
            grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct((q.shape[0], tp, sp), out_dtype),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
            interpret=tpu_interpret_params() if backend == "interpret_tpu" else False,
        )(lo, hi, q, *rest)

    out = fold_vmap(lambda fold: call, (ROWS,) * 8)(lo, hi, q, k, ks, w, starts[..., None], ends[..., None])
    return out[:, :t, :s]


MOSAIC_BACKENDS = ("mosaic_gpu", "interpret_mosaic_gpu")


def _gpu_compute_capability() -> float | None:
    """Compute capability of the device this trace targets (`_dispatch.target_device`: the active mesh's, then
    jax.default_device, which deviceless AOT sets, then the first device)."""
    dev = target_device()
    cc = getattr(dev, "compute_capability", None)
    return float(cc) if cc is not None else None


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_q", "block_k", "k_steps", "interpret"))
def _indexer_logits_mosaic(q_fp8, k_fp8, k_scale, weights, starts, ends, *, out_dtype, block_q, block_k, k_steps,
                           interpret):
    b, t, _, _ = q_fp8.shape
    starts, ends = _ranges(starts, ends, b, t, k_fp8.shape[1])
    out = mgpu_kernel.indexer_logits_mgpu(q_fp8, k_fp8, k_scale, weights, starts, ends, block_q=block_q,
                                          block_k=block_k, k_steps=k_steps, interpret=interpret)
    return out.astype(out_dtype)


def indexer_logits(q_fp8, k_fp8, k_scale, weights, *, starts=None, ends=None, out_dtype=jnp.float32,
                   impl: str | None = None, block_q: int | None = None, block_k: int | None = None,
                   num_warps: int = 4,
                   num_stages: int = 3, k_steps: int | None = None):
    """Indexer logits [B, T, S] (out_dtype f32 or bf16) from q_fp8 [B, T, H, D] e4m3, k_fp8 [B, S, D] e4m3,
    k_scale [B, S] f32 and folded weights w' [B, T, H] f32; key s is scored for query t iff starts[b, t] <= s <
    ends[b, t] (defaults: all keys; causal = starts 0, ends q_index + 1), -inf elsewhere.

    Backends: mosaic_gpu and interpret_mosaic_gpu (`indexer_logits_mgpu`: FP8 wgmma on Hopper; block_q query rows
    x block_k keys, default 8 x 128, block_k a multiple of 64; an explicit request it cannot serve raises);
    pallas_gpu picks that kernel on compute capability >= 9.0 when the shapes allow, else the Triton kernel;
    pallas_gpu and interpret (Triton kernel; block_q query rows x block_k keys, default 2 x 128),
    pallas_tpu and interpret_tpu (Mosaic kernel; block_q rows x block_k keys with block_q a multiple of 8, default
    8 x 512, block_k a multiple of 128); CPU runs the reference (`dsv32_jax.model.indexer.index_scores_fp8`).
    k_steps (Mosaic GPU only; issue 31 item 4): None, one key block per program (the default, timed on an H200);
    n >= 1, chunks of n key blocks per program, the queries loaded once and the key blocks that meet the rows' ranges
    streamed through a double-buffered TMA pipeline (blocks outside every range neither loaded nor multiplied); not
    yet timed on a chip. Ignored by the other backends.
    """
    if k_steps is not None and k_steps < 1:
        raise ValueError(f"indexer_logits: k_steps={k_steps} must be >= 1 (or None)")
    check_shapes(q_fp8, k_fp8, k_scale, weights)
    if out_dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"indexer_logits: out_dtype must be float32 or bfloat16, got {out_dtype}")
    impl = resolve_impl(impl, ("pallas_gpu", "interpret", "pallas_tpu", "interpret_tpu", *MOSAIC_BACKENDS),
                        op="indexer_logits", shapes={"q_fp8": q_fp8, "k_fp8": k_fp8, "k_scale": k_scale,
                                                     "weights": weights},
                        unsupported=lambda i: mgpu_kernel.check_shapes(q_fp8, k_fp8, block_q or 8, block_k or 128)
                        if i in MOSAIC_BACKENDS else None)
    if impl == "reference":
        return indexer_logits_reference(q_fp8, k_fp8, k_scale, weights, starts, ends, out_dtype)
    for name, codes in (("q_fp8", q_fp8), ("k_fp8", k_fp8)):  # the kernels widen codes to bf16: exact for e4m3 only
        if codes.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"indexer_logits: impl={impl!r} takes e4m3 codes (float8_e4m3fn); {name} is "
                             f"{codes.dtype} (quantize with hadamard_quant, or use impl='reference')")
    if impl == "pallas_gpu" and (_gpu_compute_capability() or 0) >= 9.0 and mgpu_kernel.check_shapes(
            q_fp8, k_fp8, block_q or 8, block_k or 128) is None:
        impl = "mosaic_gpu"
    if impl in MOSAIC_BACKENDS:  # resolve_impl checked the shapes (mgpu_kernel.check_shapes)
        block_q, block_k = block_q or 8, block_k or 128
        return _indexer_logits_mosaic(q_fp8, k_fp8, k_scale, weights, starts, ends, out_dtype=out_dtype,
                                      block_q=block_q, block_k=block_k, k_steps=k_steps,
                                      interpret=impl == "interpret_mosaic_gpu")
    if impl in ("pallas_tpu", "interpret_tpu"):
        block_q, block_k = block_q or 8, block_k or 512
        if block_q % 8 or block_k % 128:
            raise ValueError(f"indexer_logits: on TPU block_q must be a multiple of 8 and block_k of 128 "
                             f"(got {block_q}, {block_k})")
        return _indexer_logits_tpu(q_fp8, k_fp8, k_scale, weights, starts, ends, out_dtype=out_dtype,
                                   block_q=block_q, block_k=block_k, backend=impl)
    block_q, block_k = block_q or 2, block_k or 128
    return _indexer_logits_pallas(q_fp8, k_fp8, k_scale, weights, starts, ends, out_dtype=out_dtype,
                                  block_q=block_q, block_k=block_k, backend=impl, num_warps=num_warps,
                                  num_stages=num_stages)
