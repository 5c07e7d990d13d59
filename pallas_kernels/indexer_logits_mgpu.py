"""FP8 lightning-indexer logits on Hopper tensor cores: the Mosaic GPU (`plgpu`) kernel behind `indexer_logits`.

Same contract as `indexer_logits.indexer_logits_reference` (DeepGEMM `fp8_mqa_logits` semantics):

    I[t, s] = k_scale[s] * sum_h w'[t, h] * ReLU(q_fp8[t, h] . k_fp8[s])    for s in [start_t, end_t), else -inf

Why a second GPU kernel: the Triton backend of Pallas feeds e4m3 operands to `mma.sync.m16n8k16` after widening them
to f16 (the FP8 tensor-core path is never taken). Mosaic GPU emits `wgmma.mma_async ... .e4m3.e4m3` directly, the
Hopper FP8 instruction (1979 vs 989 dense TF/s on an H100 SXM).

Kernel: grid (query block of BQ tokens, key block of BK keys), one warpgroup per program.
  * TMA copies: the BK x D e4m3 key block and its scales, the BQ x H x D e4m3 queries, their head weights and key
    ranges, all into shared memory (128-byte swizzle on the D = 128 e4m3 rows: both operands K-major, which is what
    FP8 wgmma requires).
  * per query row r: acc [BK, H] = K_blk . Q_r^T on the tensor cores (`m64nHk32` e4m3 wgmma into an fp32
    accumulator; Hopper is reported to keep ~14 bits of each aligned group of 32 products, as in DeepGEMM; unconfirmed here),
    then in registers ReLU, times w'[r, :] broadcast along the keys, the sum over heads (a row reduction of the
    WGMMA layout), times the key scale, and the range mask.
  * key blocks entirely outside [min start, max end) of the program's rows skip the tensor cores and write -inf
    (causal block skipping: a causal prefill computes about half of the blocks).
  * the BQ x BK fp32 tile goes back through shared memory with one TMA store.
Shapes are padded in the wrapper: heads to a multiple of 8 (zero weights), D to a multiple of 128 (zero codes: exact),
queries to BQ, keys to BK (zero scales, and outside every range).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsv32_jax.kernels._dispatch import round_up

E4M3 = jnp.float8_e4m3fn
SWIZZLE = 128  # bytes: one 128-dim e4m3 row
MAX_HEADS = 256  # wgmma N limit


def plgpu():
    from jax.experimental.pallas import mosaic_gpu
    return mosaic_gpu


def check_shapes(q_fp8, k_fp8, block_q: int, block_k: int) -> str | None:
    """Why the kernel cannot serve these shapes (None when it can)."""
    h = q_fp8.shape[2]
    if q_fp8.dtype != E4M3 or k_fp8.dtype != E4M3:
        return f"needs float8_e4m3fn q and k, got {q_fp8.dtype} / {k_fp8.dtype}"
    if round_up(h, 8) > MAX_HEADS:
        return f"{h} indexer heads > {MAX_HEADS} (wgmma N limit)"
    if block_k % 64 or block_k <= 0:
        return f"block_k={block_k} must be a positive multiple of 64 (wgmma M)"
    if block_q < 4 or block_q & (block_q - 1):
        return f"block_q={block_q} must be a power of two >= 4 (16-byte TMA rows of the key ranges)"
    return None


def _kernel(q_gmem, k_gmem, ks_gmem, w_gmem, st_gmem, en_gmem, o_gmem,
            q_smem, k_smem, ks_smem, w_smem, st_smem, en_smem, o_smem, barriers, *,
            block_q: int, block_k: int, q_blocks_per_batch: int):
    mgpu = plgpu()
    qb = jax.lax.axis_index("q")
    kb = jax.lax.axis_index("k")
    b = qb // q_blocks_per_batch
    rows = pl.ds(qb * block_q, block_q)
    keys = pl.ds(kb * block_k, block_k)
    copies = ((st_gmem.at[rows], st_smem), (en_gmem.at[rows], en_smem), (w_gmem.at[rows], w_smem),
              (q_gmem.at[rows], q_smem), (k_gmem.at[b, keys], k_smem), (ks_gmem.at[b, keys], ks_smem))
    for i, (src, dst) in enumerate(copies):
        mgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
    mgpu.barrier_wait(barriers.at[0])
    mgpu.barrier_wait(barriers.at[1])
    starts = [st_smem[r] for r in range(block_q)]
    ends = [en_smem[r] for r in range(block_q)]
    nonempty = [e > s for s, e in zip(starts, ends)]  # empty rows (padding, no visible key) widen nothing
    lo = functools.reduce(jnp.minimum, [jnp.where(n, s, jnp.iinfo(jnp.int32).max) for n, s in zip(nonempty, starts)])
    hi = functools.reduce(jnp.maximum, [jnp.where(n, e, 0) for n, e in zip(nonempty, ends)])
    first_key = kb * block_k
    active = (first_key < hi) & (first_key + block_k > lo)
    row_layout = mgpu.Layout.WGMMA.reduce(1)
    for i in range(2, len(copies)):
        mgpu.barrier_wait(barriers.at[i])

    @pl.when(active)
    def _compute():
        k_scale = mgpu.load(ks_smem, layout=row_layout)
        cols = first_key + mgpu.broadcasted_iota(jnp.int32, (block_k,), 0, layout=row_layout)
        for r in range(block_q):
            def mma(acc_ref, r=r):
                mgpu.wgmma(acc_ref, k_smem, q_smem.at[r].transpose((1, 0)))
                return acc_ref[...]
            dots = pl.run_scoped(mma, mgpu.ACC((block_k, q_smem.shape[1]), jnp.float32))  # [BK, H]
            w = mgpu.load(w_smem.at[r], layout=mgpu.Layout.WGMMA.reduce(0))
            row = jnp.sum(jnp.maximum(dots, 0.0) * w[None, :], axis=1) * k_scale
            o_smem[r] = jnp.where((cols >= starts[r]) & (cols < ends[r]), row, -jnp.inf)

    @pl.when(jnp.logical_not(active))
    def _skip():
        neg_inf = mgpu.layout_cast(jnp.full((block_k,), -jnp.inf, jnp.float32), row_layout)
        for r in range(block_q):
            o_smem[r] = neg_inf

    mgpu.commit_smem()
    mgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, keys])
    mgpu.wait_smem_to_gmem(0)


def indexer_logits_mgpu(q_fp8, k_fp8, k_scale, weights, starts, ends, *, block_q: int = 8, block_k: int = 128,
                        interpret: bool = False):
    """q_fp8 [B, T, H, D] e4m3, k_fp8 [B, S, D] e4m3, k_scale [B, S], weights [B, T, H], starts/ends [B, T] (already
    clipped to [0, S]) -> logits [B, T, S] fp32. Callers check `check_shapes` first."""
    mgpu = plgpu()
    b, t, h, d = q_fp8.shape
    s = k_fp8.shape[1]
    hp, dp = round_up(h, 8), round_up(d, SWIZZLE)
    tp, sp = round_up(t, block_q), round_up(s, block_k)
    q = jnp.pad(q_fp8, ((0, 0), (0, tp - t), (0, hp - h), (0, dp - d))).reshape(b * tp, hp, dp)
    k = jnp.pad(k_fp8, ((0, 0), (0, sp - s), (0, dp - d)))
    ks = jnp.pad(k_scale.astype(jnp.float32), ((0, 0), (0, sp - s)))
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, tp - t), (0, hp - h))).reshape(b * tp, hp)
    st = jnp.pad(starts.astype(jnp.int32), ((0, 0), (0, tp - t))).reshape(b * tp)
    en = jnp.pad(ends.astype(jnp.int32), ((0, 0), (0, tp - t))).reshape(b * tp)  # padded rows: empty range
    fp8_tiles = (mgpu.TilingTransform((8, SWIZZLE)), mgpu.SwizzleTransform(SWIZZLE))
    smem = mgpu.SMEM
    scratch = [
        smem((block_q, hp, dp), E4M3, transforms=fp8_tiles),
        smem((block_k, dp), E4M3, transforms=fp8_tiles),
        smem((block_k,), jnp.float32),
        smem((block_q, hp), jnp.float32),
        smem((block_q,), jnp.int32),
        smem((block_q,), jnp.int32),
        smem((block_q, block_k), jnp.float32),
        mgpu.Barrier(num_barriers=6),
    ]
    call = mgpu.kernel(
        functools.partial(_kernel, block_q=block_q, block_k=block_k, q_blocks_per_batch=tp // block_q),
        out_type=jax.ShapeDtypeStruct((b * tp, sp), jnp.float32),
        scratch_types=scratch,
        grid=(b * tp // block_q, sp // block_k),
        grid_names=("q", "k"),
        interpret=mgpu.InterpretGPUParams() if interpret else None,
        compiler_params=mgpu.CompilerParams(),
    )
    out = call(q, k, ks, w, st, en)
    return out.reshape(b, tp, sp)[:, :t, :s]
