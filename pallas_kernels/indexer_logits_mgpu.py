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

from dsv32_jax.kernels._dispatch import mosaic_gpu_interpret_params
from dsv32_jax.kernels._dispatch import round_up

E4M3 = jnp.float8_e4m3fn
SWIZZLE = 128  # bytes: one 128-dim e4m3 row
MAX_HEADS = 256  # wgmma N limit
_DETECT_RACES = False  # tests switch the interpreter's happens-before race detector on


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


def _row_ranges(st_smem, en_smem, block_q: int):
    """The program's rows' [start, end) and the union [lo, hi) of the nonempty ones (lo = INT_MAX, hi = 0 if none)."""
    starts = [st_smem[r] for r in range(block_q)]
    ends = [en_smem[r] for r in range(block_q)]
    nonempty = [e > s for s, e in zip(starts, ends)]  # empty rows (padding, no visible key) widen nothing
    lo = functools.reduce(jnp.minimum, [jnp.where(n, s, jnp.iinfo(jnp.int32).max) for n, s in zip(nonempty, starts)])
    hi = functools.reduce(jnp.maximum, [jnp.where(n, e, 0) for n, e in zip(nonempty, ends)])
    return starts, ends, lo, hi


def _score_block(q_smem, k_smem, ks_smem, w_smem, o_smem, first_key, starts, ends, block_q: int, block_k: int):
    """o_smem [BQ, BK] = the logits of the program's rows against the key block at `first_key` (-inf off range)."""
    mgpu = plgpu()
    row_layout = mgpu.Layout.WGMMA.reduce(1)
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


def _fill_neg_inf(o_smem, block_q: int, block_k: int):
    mgpu = plgpu()
    neg_inf = mgpu.layout_cast(jnp.full((block_k,), -jnp.inf, jnp.float32), mgpu.Layout.WGMMA.reduce(1))
    for r in range(block_q):
        o_smem[r] = neg_inf


def _kernel(q_gmem, k_gmem, ks_gmem, w_gmem, st_gmem, en_gmem, o_gmem,
            q_smem, k_smem, ks_smem, w_smem, st_smem, en_smem, o_smem, barriers, *,
            block_q: int, block_k: int, q_blocks_per_batch: int):
    """One (query block, key block) per program (k_steps=None)."""
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
    starts, ends, lo, hi = _row_ranges(st_smem, en_smem, block_q)
    first_key = kb * block_k
    active = (first_key < hi) & (first_key + block_k > lo)
    for i in range(2, len(copies)):
        mgpu.barrier_wait(barriers.at[i])

    @pl.when(active)
    def _compute():
        _score_block(q_smem, k_smem, ks_smem, w_smem, o_smem, first_key, starts, ends, block_q, block_k)

    @pl.when(jnp.logical_not(active))
    def _skip():
        _fill_neg_inf(o_smem, block_q, block_k)

    mgpu.commit_smem()
    mgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, keys])
    mgpu.wait_smem_to_gmem(0)


def _loop_kernel(q_gmem, k_gmem, ks_gmem, w_gmem, st_gmem, en_gmem, o_gmem,
                 q_smem, w_smem, st_smem, en_smem, o2_smem, barriers, *,
                 block_q: int, block_k: int, q_blocks_per_batch: int, k_steps: int, k_blocks: int):
    """One query block against a chunk of k_steps key blocks per program: the queries (and their weights and
    ranges) are loaded once, the chunk's key blocks that meet the rows' ranges stream through a double-buffered
    TMA pipeline (`emit_pipeline` over a dynamic number of steps: blocks outside every range are neither loaded nor
    multiplied), and the other blocks of the chunk get -inf by TMA from output slot 1, filled with -inf first (the
    first step writes slot 0; the second waits for every store but the first step's before it rewrites slot 1).
    At 8 x 128 with 64 heads: 111,664 B of shared memory, two CTAs per SM (117,808 B, one, with a separate -inf
    tile and the default cross-warp reduction scratch; H100, deviceless compile)."""
    mgpu = plgpu()
    qb = jax.lax.axis_index("q")
    kc = jax.lax.axis_index("k")
    b = qb // q_blocks_per_batch
    rows = pl.ds(qb * block_q, block_q)
    copies = ((st_gmem.at[rows], st_smem), (en_gmem.at[rows], en_smem), (w_gmem.at[rows], w_smem),
              (q_gmem.at[rows], q_smem))
    for i, (src, dst) in enumerate(copies):
        mgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
    inf_smem = o2_smem.at[1]
    _fill_neg_inf(inf_smem, block_q, block_k)
    mgpu.commit_smem()
    mgpu.barrier_wait(barriers.at[0])
    mgpu.barrier_wait(barriers.at[1])
    starts, ends, lo, hi = _row_ranges(st_smem, en_smem, block_q)
    c0 = kc * k_steps
    c1 = jnp.minimum(c0 + k_steps, k_blocks)
    first = jnp.clip(lo // block_k, c0, c1)  # the chunk's blocks [first, last) meet some row's range
    last = jnp.clip((hi + block_k - 1) // block_k, first, c1)

    @pl.loop(c0, c1)
    def _outside(j):
        @pl.when((j < first) | (j >= last))
        def _():
            mgpu.copy_smem_to_gmem(inf_smem, o_gmem.at[rows, pl.ds(j * block_k, block_k)])

    mgpu.barrier_wait(barriers.at[2])
    mgpu.barrier_wait(barriers.at[3])

    def body(idx, k_smem, ks_smem):  # the output tiles leave by TMA from two slots: one being written, one in flight
        j = first + idx[0]
        o_smem = o2_smem.at[idx[0] % 2]
        mgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store that read this slot two steps ago is done
        _score_block(q_smem, k_smem, ks_smem, w_smem, o_smem, j * block_k, starts, ends, block_q, block_k)
        mgpu.commit_smem()
        mgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, pl.ds(j * block_k, block_k)])

    fp8_tiles = (mgpu.TilingTransform((8, SWIZZLE)), mgpu.SwizzleTransform(SWIZZLE))
    d = k_gmem.shape[-1]
    mgpu.emit_pipeline(
        body, grid=(last - first,), max_concurrent_steps=2,
        in_specs=[mgpu.BlockSpec((None, block_k, d), lambda j: (b, first + j, 0), transforms=fp8_tiles),
                  mgpu.BlockSpec((None, block_k), lambda j: (b, first + j))],
    )(k_gmem, ks_gmem)
    mgpu.wait_smem_to_gmem(0)


def indexer_logits_mgpu(q_fp8, k_fp8, k_scale, weights, starts, ends, *, block_q: int = 8, block_k: int = 128,
                        k_steps: int | None = None, interpret: bool = False):
    """q_fp8 [B, T, H, D] e4m3, k_fp8 [B, S, D] e4m3, k_scale [B, S], weights [B, T, H], starts/ends [B, T] (already
    clipped to [0, S]) -> logits [B, T, S] fp32. Callers check `check_shapes` first. k_steps: None, one key block
    per program (`_kernel`); n >= 1, chunks of n key blocks per program with the queries loaded once
    (`_loop_kernel`)."""
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
    q_blocks, k_blocks = b * tp // block_q, sp // block_k
    common = dict(block_q=block_q, block_k=block_k, q_blocks_per_batch=tp // block_q)
    rows = [smem((block_q, hp), jnp.float32), smem((block_q,), jnp.int32), smem((block_q,), jnp.int32)]  # w, st, en
    if k_steps is None:
        kernel, grid = functools.partial(_kernel, **common), (q_blocks, k_blocks)
        scratch = [smem((block_q, hp, dp), E4M3, transforms=fp8_tiles), smem((block_k, dp), E4M3, transforms=fp8_tiles),
                   smem((block_k,), jnp.float32), *rows, smem((block_q, block_k), jnp.float32),
                   mgpu.Barrier(num_barriers=6)]
    else:
        if k_steps < 1:
            raise ValueError(f"indexer_logits_mgpu: k_steps={k_steps} must be >= 1 (or None)")
        kernel = functools.partial(_loop_kernel, k_steps=k_steps, k_blocks=k_blocks, **common)
        grid = (q_blocks, -(-k_blocks // k_steps))
        scratch = [smem((block_q, hp, dp), E4M3, transforms=fp8_tiles), *rows, smem((2, block_q, block_k), jnp.float32),
                   mgpu.Barrier(num_barriers=4)]
    call = mgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((b * tp, sp), jnp.float32),
        scratch_types=scratch,
        grid=grid,
        grid_names=("q", "k"),
        interpret=mosaic_gpu_interpret_params("indexer_logits_mgpu", 1, _DETECT_RACES) if interpret else None,
        # the head sums reduce within warps (no cross-warp scratch): the loop kernel fits two CTAs per SM without it
        compiler_params=mgpu.CompilerParams(**({} if k_steps is None else {"reduction_scratch_bytes": 0})),
    )
    out = call(q, k, ks, w, st, en)
    return out.reshape(b, tp, sp)[:, :t, :s]
