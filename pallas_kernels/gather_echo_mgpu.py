"""What the Mosaic GPU sparse MLA kernels' gathers leave in shared memory, copied back out (issue 31's chip triage).

The riskiest code of the kernels never run on a chip is their gather: 16-byte `cp.async` per thread, emitted in
`plgpu.inline_mgpu` with hand-computed addresses into tiled, swizzled shared memory. Interpret mode replaces it by a
Pallas row loop, so no CPU test runs it. An echo kernel issues one form's gather exactly as its kernel does (the
same inline body, buffer shapes and transforms, commit and wait), then stores the buffers to global memory by TMA,
which undoes the tiling and the swizzle: what comes back is the key rows as the kernel's MMAs would read them. On a
chip, `bench/mgpu_triage.py` (target `echo`) compares them with kv[idx] 16-byte chunk by chunk and says where a
misplaced chunk landed, which separates a gather bug from an MMA or softmax bug in one run.

Forms (each mirrors a kernel's gather; kv [M, 576] bf16, idx [N, K] int32, -1 = invalid, K a multiple of 64, of 128
for the ping-pong and slice forms):
  split     `sparse_mla_mgpu._kernel` and the P / dS kernel's `_kernel`: two warpgroups, rows [32 w, 32 w + 32)
            of a [64, 576] block each (`_issue_rows`), (8, 32) tiles, 64-byte swizzle, + the additive mask
  block     the keys-as-M forms' `_kernel_t` (forward and P / dS): one warpgroup, all 64 rows (`_issue_block`)
  pingpong  `_kernel_pp`: warpgroup w the whole block 2 i + w, an early part (its value half) and a late part (the
            other half and the rope columns) into [64, 512] and [64, 64] buffers (`_issue_part`), + the mask
  slice     `sparse_mla_dqkv_mgpu._kernel`: a CTA per 64-column slice, warpgroup w block 2 i + w's [64, 64] slice
            (`_issue_slice`), 128-byte swizzle; `slice32`: its 32-head form's (8, 32) tiles and 64-byte swizzle
Returns (rows [N, K, 576] bf16, mask [N, K] float32: 0 or -inf, the kernels' additive mask; zeros for the slice
forms, which have none). Compiled for sm_90a by `tools/gpu_compile` (cases `gather_echo[...]`); interpret mode runs
the kernels' interpret gathers (a check of this harness, not of the chip path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv32_jax.kernels._dispatch import mosaic_gpu_interpret_params
from dsv32_jax.kernels import sparse_mla_dqkv_mgpu as dm
from dsv32_jax.kernels import sparse_mla_mgpu as fwd

FORMS = ("split", "block", "pingpong", "slice", "slice32")
BK, DQK, DV = fwd.BK, fwd.DQK, fwd.DV


def _tiles(tile, swizzle):
    plgpu = fwd._plgpu()
    return (plgpu.TilingTransform(tile), plgpu.SwizzleTransform(swizzle))


def _block_body(gather, whole: bool):
    """split (two warpgroups, 32 rows each, meeting at an mbarrier) or block (one warpgroup, all 64 rows)."""
    import jax.experimental.pallas as pl
    plgpu = fwd._plgpu()

    def body(kv_gmem, idx_gmem, rows_gmem, mask_gmem, buf, mask, *done):
        t, b = jax.lax.axis_index("t"), jax.lax.axis_index("b")
        w = 0 if whole else jax.lax.axis_index("wg")
        blk = pl.ds(b * BK, BK)
        gather.issue(w, kv_gmem, idx_gmem.at[t].at[blk], buf, mask)
        gather.commit()
        gather.commit()  # an empty group: the kernels' wait leaves the newest group in flight
        gather.wait()  # (fenced for the async proxy, the warpgroup synchronized)

        def store():
            plgpu.copy_smem_to_gmem(buf, rows_gmem.at[t, blk])
            plgpu.copy_smem_to_gmem(mask, mask_gmem.at[t, blk])
            plgpu.wait_smem_to_gmem(0)
        if whole:
            store()
        else:
            plgpu.barrier_arrive(done[0])
            plgpu.barrier_wait(done[0])  # both halves of the block
            pl.when(w == 0)(store)
    return body


def _pingpong_body(gather):
    import jax.experimental.pallas as pl
    plgpu = fwd._plgpu()

    def body(kv_gmem, idx_gmem, rows_gmem, mask_gmem, nope, rope, mask):
        t, i, w = (jax.lax.axis_index(a) for a in ("t", "b", "wg"))
        blk = pl.ds((2 * i + w) * BK, BK)
        for late in (False, True):  # as `_kernel_pp` issues a block: early part, then late part
            gather.issue(w, late, kv_gmem, idx_gmem.at[t].at[blk], nope.at[w], rope.at[w], mask.at[w])
            gather.commit()
        gather.wait(0)
        plgpu.copy_smem_to_gmem(nope.at[w], rows_gmem.at[t, blk, pl.ds(0, DV)])
        plgpu.copy_smem_to_gmem(rope.at[w], rows_gmem.at[t, blk, pl.ds(DV, DQK - DV)])
        plgpu.copy_smem_to_gmem(mask.at[w], mask_gmem.at[t, blk])
        plgpu.wait_smem_to_gmem(0)
    return body


def _slice_body(gather, nblk):
    import jax.experimental.pallas as pl
    plgpu = fwd._plgpu()

    def body(kv_gmem, idx_gmem, rows_gmem, mask_gmem, buf):  # no mask: mask_gmem is left unwritten
        t, c, w = (jax.lax.axis_index(a) for a in ("t", "b", "wg"))
        cols = pl.ds(c * dm.W, dm.W)

        def step(i, carry):
            blk = pl.ds((2 * i + w) * BK, BK)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store has read the buffer
            gather(kv_gmem.at[:, cols], idx_gmem.at[t].at[blk], buf.at[w])  # issue, commit, wait (as `_kernel`)
            plgpu.copy_smem_to_gmem(buf.at[w], rows_gmem.at[t, blk, cols])
            return carry
        jax.lax.fori_loop(0, nblk // 2, step, 0)
        plgpu.wait_smem_to_gmem(0)
    return body


def gather_echo(kv, idx, *, form: str, interpret: bool = False):
    """(rows [N, K, 576] bf16, mask [N, K] f32) as `form`'s gather leaves them in shared memory. See the module
    docstring."""
    if form not in FORMS:
        raise ValueError(f"gather_echo_mgpu.gather_echo: form={form!r} must be one of {FORMS}")
    n, k = idx.shape
    step = 2 * BK if form in ("pingpong", "slice", "slice32") else BK  # a block a warpgroup: pairs of blocks
    if kv.ndim != 2 or kv.shape[1] != DQK or kv.dtype != jnp.bfloat16 or idx.dtype != jnp.int32 or k % step or not k:
        raise ValueError(f"gather_echo_mgpu.gather_echo: kv {kv.shape} {kv.dtype}, idx {idx.shape} {idx.dtype}: needs "
                         f"kv [M, {DQK}] bf16 and int32 idx [N, K], K a positive multiple of {step}")
    plgpu = fwd._plgpu()
    SM = plgpu.SMEM
    nblk = k // BK
    t64 = _tiles(fwd.TILE, fwd.SWIZZLE)
    if form in ("split", "block"):
        whole = form == "block"
        scratch = [SM((BK, DQK), jnp.bfloat16, transforms=t64), SM((BK,), jnp.float32)]
        scratch += [] if whole else [plgpu.Barrier(num_arrivals=2)]
        gather = (fwd._InterpretGather(full_block=whole) if interpret else fwd._ChipGather(t64, full_block=whole))
        body, grid, warpgroups = _block_body(gather, whole), (n, nblk), 1 if whole else 2
    elif form == "pingpong":
        scratch = [SM((2, BK, DV), jnp.bfloat16, transforms=t64), SM((2, BK, DQK - DV), jnp.bfloat16, transforms=t64),
                   SM((2, BK), jnp.float32)]
        gather = fwd._InterpretGatherPP() if interpret else fwd._ChipGatherPP(t64)
        body, grid, warpgroups = _pingpong_body(gather), (n, nblk // 2), 2
    else:
        swizzle = dm.SWIZZLE if form == "slice" else fwd.SWIZZLE
        tiles = _tiles(dm.TILE if form == "slice" else fwd.TILE, swizzle)
        scratch = [SM((2, BK, dm.W), jnp.bfloat16, transforms=tiles)]
        gather = dm._InterpretGather() if interpret else dm._ChipGather(tiles, swizzle)
        body, grid, warpgroups = _slice_body(gather, nblk), (n, DQK // dm.W), 2
    name = f"gather_echo_{form}"
    threads = dict(num_threads=warpgroups, thread_name="wg") if warpgroups > 1 else {}
    out_type = (jax.ShapeDtypeStruct((n, k, DQK), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.float32))
    rows, mask = plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=("t", "b"),
                              kernel_name=name, **threads,
                              interpret=mosaic_gpu_interpret_params(name, warpgroups, False) if interpret else None,
                              compiler_params=plgpu.CompilerParams())(kv, idx)
    if form.startswith("slice"):  # no mask in these kernels; the output was never written
        mask = jnp.zeros_like(mask)
    return rows, mask


def gather_echo_reference(kv, idx):
    """(kv[idx] with zero rows for idx < 0, the additive mask 0 / -inf)."""
    valid = idx >= 0
    rows = jnp.where(valid[..., None], kv[jnp.maximum(idx, 0)], jnp.zeros((), kv.dtype))
    return rows, jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32)
