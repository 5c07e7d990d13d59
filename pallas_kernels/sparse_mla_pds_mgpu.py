"""The stored sparse MLA backward's first kernel on Hopper in Pallas Mosaic GPU (issue 31, item 3): P and scale * dS
of one (token, 64 heads) per CTA, computed once, on `wgmma m64n32k16`, with the selected rows gathered by 16-byte
`cp.async` as in the forward (`sparse_mla_mgpu`).

Semantics (what `pallas_kernels.sparse_mla._pds_kernel` computes): q [N, H, 576] bf16, do [N, H, 512] bf16,
kv [M, 576] bf16 (value = first 512 columns), idx [N, K] int32 (-1 = invalid), lse [N, H] f32 (natural log, -inf
for a row with no valid slot), delta [N, H] f32 (rowsum(O dO) - dlse) ->
  P  [N, H, K] bf16 = exp(scale q kv[idx]^T - lse)            (0 on invalid slots and on rows with lse -inf)
  dS [N, H, K] bf16 = scale * P * (dO kv[idx][:, :512]^T - delta)
H 32 or a multiple of 64, K a multiple of 64.

Structure: grid (N, H / 64), the head groups of a token adjacent in launch order (L2 shares its rows). q [64, 576]
and dO [64, 512] arrive by TMA and stay in shared memory ((8, 32) tiles, 64-byte swizzle, as the forward's). Two
warpgroups, independent after the prologue: warpgroup w gathers rows [32 w, 32 w + 32) of each 64-key block
(`sparse_mla_mgpu.copy_plan`; invalid slots zero-fill and get a -inf additive mask), computes S_w = q kv_w^T (K =
576) and dP_w = dO kv_w[:, :512]^T (K = 512) on `wgmma m64n32k16`, then issues the gather of its rows of the next
block (the rows are free once both MMAs have completed), and meanwhile forms P_w and dS_w [64, 32] in registers and
stores them by TMA from its own staging tiles. There is no cross-warpgroup exchange: the final lse is known, so
there is no running max. Shared memory: q 72 KiB + dO 64 KiB + one 64 x 576 key block 72 KiB + staging 16 KiB
(+ 1 KiB of rows): the key block is single-buffered (two would need 286 KiB), so a warpgroup's gather overlaps its
softmax / dS math and stores, not its MMAs. The 64-entry mask is double-buffered: the gather's mask entries are
plain stores by the thread that copies the row, which may run ahead of another warp's load of the previous
block's mask (a race inside one warpgroup, which interpret mode cannot see: it runs a warpgroup as one thread).
32 heads (one device's share of 128 at tensor:4; the wrapper pads 32 or fewer to 32): `_kernel_t`, the keys as
wgmma's M as in the forward's `_kernel_t`. One warpgroup per (token, 32 heads): S^T = K q^T and dP^T = V dO^T
[64 keys, 32 heads] on `wgmma m64n32k16`, P^T and scale dS^T in registers (lse and delta are per head, broadcast
along the keys: no reduction), stored through transposed views of [32, 64] staging tiles that leave by TMA into
the same [N, H, K] outputs; key blocks double-buffered (q 36 KiB + dO 32 KiB + 2 x 72 KiB + staging 8 KiB:
227,360 B, 249 registers, no spills).
Interpret mode runs the same kernels with `sparse_mla_mgpu`'s Pallas row-loop gather (the interpreter cannot run
`inline_mgpu`). Not yet run on a chip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv32_jax.kernels._dispatch import mosaic_gpu_interpret_params
from dsv32_jax.kernels import sparse_mla_mgpu as fwd
from dsv32_jax.kernels.sparse_mla_mgpu import BK, DQK, DV, H_BLK, H_T, KW, LOG2E, SWIZZLE, TILE

_DETECT_RACES = False  # tests switch the interpreter's happens-before race detector on


def check_shapes(q, do, kv, idx) -> str | None:
    """Why this kernel cannot serve these inputs (None: it can)."""
    why = fwd.check_shapes(q, kv, idx)
    if why is not None:
        return why
    if do.shape != (*q.shape[:2], DV) or do.dtype != jnp.bfloat16:
        return f"needs dO [N, H, {DV}] bf16"
    return None


def _wait_none_pending(ctx):
    """This thread's copies have all landed; fence them for wgmma and synchronize the warpgroup."""
    from jax._src.lib.mlir.dialects import nvvm
    from jax.experimental.mosaic.gpu import utils as mu
    del ctx
    nvvm.cp_async_wait_group(0)
    mu.commit_shared()


class _ChipGather(fwd._ChipGather):
    def __init__(self, tiles):
        super().__init__(tiles)
        self._wait = fwd._plgpu().inline_mgpu()(_wait_none_pending)  # one buffer: wait for every group


def _issue_token_loads(srcs, t, heads, dsts, bars):
    """The token's q, dO, lse and delta rows of these heads by TMA, on barriers 0-3."""
    plgpu = fwd._plgpu()
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        plgpu.copy_gmem_to_smem(src.at[t, heads], dst, bars.at[i])


def _token_rows(rows_smem, bars, layout):
    """After `_issue_token_loads`' four barriers: (lse in base 2, inf for a row with no valid slot, so that
    exp2(x - inf) = 0 for every slot; delta) in `layout`."""
    plgpu = fwd._plgpu()
    for i in range(4):
        plgpu.barrier_wait(bars.at[i])
    lse2 = plgpu.load(rows_smem.at[0], layout=layout) * LOG2E
    return jnp.where(lse2 == -jnp.inf, jnp.inf, lse2), plgpu.load(rows_smem.at[1], layout=layout)


def _kernel(q_gmem, do_gmem, kv_gmem, idx_gmem, lse_gmem, delta_gmem, p_gmem, ds_gmem,
            q_smem, do_smem, kv_smem, stage, rows_smem, bars, *, scale, nblk, gather):
    import jax.experimental.pallas as pl
    plgpu = fwd._plgpu()
    g = jax.lax.axis_index("g")
    t = jax.lax.axis_index("t")
    w = jax.lax.axis_index("wg")
    heads = pl.ds(g * H_BLK, H_BLK)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    idx_tok = idx_gmem.at[t]

    def idx_block(b):
        return idx_tok.at[pl.ds(b * BK, BK)]

    pl.when(w == 0)(lambda: _issue_token_loads((q_gmem, do_gmem, lse_gmem, delta_gmem), t, heads,
                                                (q_smem, do_smem, rows_smem.at[0], rows_smem.at[1]), bars))
    gather.issue(w, kv_gmem, idx_block(0), kv_smem, rows_smem.at[2])  # block b's mask: row 2 + b % 2
    gather.commit()
    lse2, delta = _token_rows(rows_smem, bars, row_layout)
    kv_w = kv_smem.at[pl.ds(w * KW, KW)]
    p_stage, ds_stage = stage.at[w, 0], stage.at[w, 1]

    def step(b, carry):
        gather.wait()  # this warpgroup's rows of block b (and their mask) are in shared memory
        slot = jax.lax.rem(b, 2)

        def mma(acc_s, acc_dp):
            plgpu.wgmma(acc_s, q_smem, kv_w.transpose((1, 0)))
            plgpu.wgmma(acc_dp, do_smem, kv_w.at[:, pl.ds(0, DV)].transpose((1, 0)))
            return acc_s[...], acc_dp[...]
        s, dp = pl.run_scoped(mma, plgpu.ACC((H_BLK, KW), jnp.float32), plgpu.ACC((H_BLK, KW), jnp.float32))
        mask = plgpu.load(rows_smem.at[2 + slot, pl.ds(w * KW, KW)], layout=plgpu.Layout.WGMMA.reduce(0))

        # Both MMAs have completed (their results were read), so every warp of this warpgroup has issued them and
        # the rows are free. This takes one warp's wgmma.wait_group as covering the whole warpgroup's reads of the
        # shared B operand (CUTLASS's SM90 pipelines make the same assumption: one thread per consumer warpgroup
        # releases a stage after warpgroup_wait). If the chip test shows wrong P / dS from block 2 on, put a
        # warpgroup barrier (mu.warpgroup_barrier) in front of this issue. The mask is double-buffered: a warp's
        # gather writes mask entries that another warp of the warpgroup may not have loaded yet; block b - 1's mask
        # row is free because every warp has issued block b's MMAs, after its load of block b - 1's mask.
        @pl.when(b + 1 < nblk)
        def _():
            gather.issue(w, kv_gmem, idx_block(b + 1), kv_smem, rows_smem.at[3 - slot])
        gather.commit()

        s2 = s * (scale * LOG2E) + jax.lax.broadcast_in_dim(mask, s.shape, [1])
        p = jnp.exp2(s2 - jax.lax.broadcast_in_dim(lse2, s.shape, [0]))
        ds = p * (dp - jax.lax.broadcast_in_dim(delta, s.shape, [0])) * scale
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's stores have read the staging tiles
        p_stage[...] = p.astype(jnp.bfloat16)
        ds_stage[...] = ds.astype(jnp.bfloat16)
        plgpu.commit_smem()
        cols = pl.ds(b * BK + w * KW, KW)
        plgpu.copy_smem_to_gmem(p_stage, p_gmem.at[t, heads, cols])
        plgpu.copy_smem_to_gmem(ds_stage, ds_gmem.at[t, heads, cols])
        return carry

    jax.lax.fori_loop(0, nblk, step, 0)
    plgpu.wait_smem_to_gmem(0)


def _kernel_t(q_gmem, do_gmem, kv_gmem, idx_gmem, lse_gmem, delta_gmem, p_gmem, ds_gmem,
              q_smem, do_smem, kv_smem, stage, rows_smem, mask_smem, bars, *, scale, nblk, gather):
    """The keys-as-M form for 32 heads per CTA (one warpgroup; `sparse_mla_mgpu._kernel_t`'s layout): per 64-key
    block S^T = K q^T and dP^T = V dO^T [64 keys, 32 heads] on `wgmma m64n32k16`, P^T and scale dS^T in registers
    (lse and delta broadcast along the keys: no reduction), stored through transposed views of [32, 64] staging
    tiles that leave by TMA into P / dS [N, H, K]. Key blocks double-buffered: block b + 1's gather is issued
    before block b's MMAs."""
    import jax.experimental.pallas as pl
    plgpu = fwd._plgpu()
    g = jax.lax.axis_index("g")
    t = jax.lax.axis_index("t")
    heads = pl.ds(g * H_T, H_T)
    head_layout = plgpu.Layout.WGMMA.reduce(0)
    key_layout = plgpu.Layout.WGMMA.reduce(1)
    idx_tok = idx_gmem.at[t]

    def idx_block(b):
        return idx_tok.at[pl.ds(b * BK, BK)]

    _issue_token_loads((q_gmem, do_gmem, lse_gmem, delta_gmem), t, heads,
                       (q_smem, do_smem, rows_smem.at[0], rows_smem.at[1]), bars)
    gather.issue(0, kv_gmem, idx_block(0), kv_smem.at[0], mask_smem.at[0])
    gather.commit()
    lse2, delta = _token_rows(rows_smem, bars, head_layout)

    def step(b, carry):
        slot = jax.lax.rem(b, 2)

        @pl.when(b + 1 < nblk)
        def _():  # the other buffer held block b - 1, whose MMAs this warpgroup has completed
            gather.issue(0, kv_gmem, idx_block(b + 1), kv_smem.at[1 - slot], mask_smem.at[1 - slot])
        gather.commit()
        gather.wait()  # block b (and its mask) is in shared memory
        kv = kv_smem.at[slot]

        def mma(acc_s, acc_dp):
            plgpu.wgmma(acc_s, kv, q_smem.transpose((1, 0)))
            plgpu.wgmma(acc_dp, kv.at[:, pl.ds(0, DV)], do_smem.transpose((1, 0)))
            return acc_s[...], acc_dp[...]
        s, dp = pl.run_scoped(mma, plgpu.ACC((BK, H_T), jnp.float32), plgpu.ACC((BK, H_T), jnp.float32))
        mask = plgpu.load(mask_smem.at[slot], layout=key_layout)
        s2 = s * (scale * LOG2E) + jax.lax.broadcast_in_dim(mask, s.shape, [0])
        p = jnp.exp2(s2 - jax.lax.broadcast_in_dim(lse2, s.shape, [1]))
        ds = p * (dp - jax.lax.broadcast_in_dim(delta, s.shape, [1])) * scale
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's stores have read the staging tiles
        stage.at[0].transpose((1, 0))[...] = p.astype(jnp.bfloat16)
        stage.at[1].transpose((1, 0))[...] = ds.astype(jnp.bfloat16)
        plgpu.commit_smem()
        cols = pl.ds(b * BK, BK)
        plgpu.copy_smem_to_gmem(stage.at[0], p_gmem.at[t, heads, cols])
        plgpu.copy_smem_to_gmem(stage.at[1], ds_gmem.at[t, heads, cols])
        return carry

    jax.lax.fori_loop(0, nblk, step, 0)
    plgpu.wait_smem_to_gmem(0)


def _pds_t(q, do, kv, idx, lse, delta, *, scale: float, interpret: bool):
    """`_kernel_t` over 32 heads: (P, scale * dS) [N, 32, K] bf16."""
    plgpu = fwd._plgpu()
    n, h, _ = q.shape
    k = idx.shape[1]
    tiles = (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(SWIZZLE))
    SM = plgpu.SMEM
    scratch = [
        SM((H_T, DQK), jnp.bfloat16, transforms=tiles),  # q
        SM((H_T, DV), jnp.bfloat16, transforms=tiles),  # dO
        SM((2, BK, DQK), jnp.bfloat16, transforms=tiles),  # key blocks, double-buffered
        SM((2, H_T, BK), jnp.bfloat16, transforms=tiles),  # staging: P, dS ([heads, keys], written transposed)
        SM((2, H_T), jnp.float32),  # lse, delta
        SM((2, BK), jnp.float32),  # the key blocks' additive masks
        plgpu.Barrier(num_barriers=4),  # q, dO, lse, delta
    ]
    gather = fwd._InterpretGather(full_block=True) if interpret else fwd._ChipGather(tiles, full_block=True)
    body = functools.partial(_kernel_t, scale=float(scale), nblk=k // BK, gather=gather)
    out_type = (jax.ShapeDtypeStruct((n, h, k), jnp.bfloat16),) * 2
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(n, h // H_T), grid_names=("t", "g"),
                        kernel_name="sparse_mla_pds_mgpu_h32",
                        interpret=mosaic_gpu_interpret_params("sparse_mla_pds_mgpu_h32", 1, _DETECT_RACES)
                        if interpret else None,
                        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0))(
        q, do, kv, idx, lse.astype(jnp.float32), delta.astype(jnp.float32))


def sparse_mla_pds(q, do, kv, idx, lse, delta, *, scale: float, interpret: bool = False):
    """(P, scale * dS) [N, H, K] bf16 of the stored backward. See the module docstring."""
    why = check_shapes(q, do, kv, idx)
    if why is not None:
        raise ValueError(f"sparse_mla_pds_mgpu.sparse_mla_pds: q {q.shape} {q.dtype}, do {do.shape} {do.dtype}, "
                         f"kv {kv.shape} {kv.dtype}, idx {idx.shape} {idx.dtype}: {why}")
    n, h, _ = q.shape
    if h == H_T:
        return _pds_t(q, do, kv, idx, lse, delta, scale=scale, interpret=interpret)
    plgpu = fwd._plgpu()
    k = idx.shape[1]
    tiles = (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(SWIZZLE))
    SM = plgpu.SMEM
    scratch = [
        SM((H_BLK, DQK), jnp.bfloat16, transforms=tiles),  # q
        SM((H_BLK, DV), jnp.bfloat16, transforms=tiles),  # dO
        SM((BK, DQK), jnp.bfloat16, transforms=tiles),  # the key block (warpgroup w: rows 32 w ...)
        SM((2, 2, H_BLK, KW), jnp.bfloat16, transforms=tiles),  # staging: [warpgroup, P / dS]
        SM((4, H_BLK), jnp.float32),  # rows 0: lse, 1: delta, 2-3: the key blocks' additive masks (b % 2)
        plgpu.Barrier(num_barriers=4),  # q, dO, lse, delta
    ]
    gather = fwd._InterpretGather() if interpret else _ChipGather(tiles)
    body = functools.partial(_kernel, scale=float(scale), nblk=k // BK, gather=gather)
    out_type = (jax.ShapeDtypeStruct((n, h, k), jnp.bfloat16),) * 2
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(n, h // H_BLK), grid_names=("t", "g"),
                        num_threads=2, thread_name="wg", kernel_name="sparse_mla_pds_mgpu",
                        interpret=mosaic_gpu_interpret_params("sparse_mla_pds_mgpu", 2, _DETECT_RACES)
                        if interpret else None,
                        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0))(
        q, do, kv, idx, lse.astype(jnp.float32), delta.astype(jnp.float32))


def sparse_mla_pds_reference(q, do, kv, idx, lse, delta, *, scale: float):
    """The plain-JAX contract in float32."""
    valid = idx >= 0
    rows = jnp.where(valid[..., None], kv[jnp.maximum(idx, 0)].astype(jnp.float32), 0.0)  # [N, K, 576]
    s = jnp.einsum("nhd,nkd->nhk", q.astype(jnp.float32), rows) * scale
    ok = valid[:, None, :] & (lse > -jnp.inf)[..., None]
    p = jnp.where(ok, jnp.exp(s - jnp.where(ok, lse[..., None], 0.0)), 0.0)
    dp = jnp.einsum("nhd,nkd->nhk", do.astype(jnp.float32), rows[..., :DV])
    return p, scale * p * (dp - delta[..., None])
