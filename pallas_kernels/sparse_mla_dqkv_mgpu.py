"""The stored sparse MLA backward's second kernel on Hopper in Pallas Mosaic GPU (issue 31, item 3;
`kernels.sparse_mla(bwd="stored", dqkv="mosaic_gpu")`, `RunOptions.mla_dqkv`): one 64-column slice of a token's dq
and of its dkv partial rows, from the stored P and scale * dS, on wgmma.

Semantics (what `pallas_kernels.sparse_mla._dqkv_kernel` computes with bwd="stored"): q [N, H, 576] bf16, do [N, H,
576] bf16 (dO zero-padded over the 64 rope columns: they get no P^T dO term), kv [M, 576] bf16, idx [N, K] int32
(-1 = invalid), p and ds [N, H, K] bf16 (P and scale * dS; zero on invalid slots) ->
  dq   [N, H, 576] bf16 = ds kv[idx]                  (summed over the K slots)
  part [N, K, 576] part_dtype = ds^T q + p^T do      (summed over the H heads; reduced into dkv by the segment sum;
                                                      bf16, what the Triton kernel writes for a bf16 cache, or f32)
H 32, 64 or 128, K a multiple of 128.

Structure: grid (N, 9) (the slice axis last: CUDA's x, the fastest, so the 9 slices of a token run together and
share its P, dS and gathered rows in L2). The token's q and dO slices ([H, 64] each) arrive by TMA and stay in
shared memory. Two warpgroups take alternate 64-slot blocks, each with its own buffers (nothing orders them: each
gathers synchronously, so one loads while the other multiplies only as the warp schedulers interleave them): P and
dS blocks [H, 64] by TMA, the block's 64 selected rows' slice [64, 64] gathered by 16-byte `cp.async` (4 per
thread; invalid slots copy 0 bytes, which zero-fills), then
  part block [64 slots, 64] = dS^T q + P^T dO    (wgmma, A transposed from shared memory: M = slots, K = heads)
  dq [H, 64] += dS k                             (wgmma, B N-major: K = slots; accumulated in registers)
and the part block leaves by TMA from a staging tile. At the end warpgroup 1 hands its dq to warpgroup 0 through
shared memory, which adds and stores. All tiles are (8, 64) with the 128-byte swizzle (a slice row is 128 bytes).
32 heads (one device's share of 128 at tensor:4; the wrapper pads 32 or fewer to 32): dq's product has the heads
as wgmma's M, below its 64, so it runs transposed, dq^T [64 columns, 32 heads] += k^T dS^T (A = the gathered rows'
slice read transposed, B = dS^T), stored through a transposed view of the [32, 64] staging tile; and dS^T q +
P^T dO has K = 32 heads, which wgmma accepts only with the 64-byte swizzle, so every tile is (8, 32) there (the
gather's destination chunks by `gather_mgpu.chunk_position` with that swizzle). 65,592 B, 82 registers, no spills.
Interpret mode runs the gather as a Pallas row loop (the interpreter cannot run `inline_mgpu`) and accumulates dq
into a fresh accumulator each block; on the chip dq accumulates in place.
Why Mosaic GPU beside `_dqkv_kernel` (Triton, the same work): wgmma N = 64 for every product (Triton's mixes
m64n32k16), dS^T read transposed straight from shared memory, and the partial rows leave by TMA; what it costs on a
chip is owed (bench/gpu_owed.sh 0: `sparse_mla bwd (stored, dq/dkv mosaic_gpu)` and its stage row).
Compiled for sm_90a (tools/gpu_compile, case sparse_mla_dqkv_mgpu[prod,L=8192], under jax 0.12 and 0.11.2):
163,896 B of shared memory, 213 registers, no spills, HGMMA.64x64x16 and LDGSTS.128 in the SASS, no mma.sync. Not
yet run on a chip (`tests/test_kernels.py::test_sparse_mla_dqkv_mgpu_on_chip`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv32_jax.kernels._dispatch import mosaic_gpu_interpret_params
from dsv32_jax.kernels import gather_mgpu
from dsv32_jax.kernels import sparse_mla_mgpu as fwd
from dsv32_jax.kernels import sparse_mla_pds_mgpu as pds

BK = 64  # slots per block
W = 64  # columns per slice
DQK = fwd.DQK
TILE = (8, 64)
SWIZZLE = 128
COPIES = BK * W // gather_mgpu.CHUNK // fwd.WARPGROUP  # cp.async per thread and block: 4
_DETECT_RACES = False


def check_shapes(q, do, kv, idx, p, ds) -> str | None:
    """Why this kernel cannot serve these inputs (None: it can)."""
    if q.ndim != 3 or kv.ndim != 2 or idx.ndim != 2:
        return "expects q [N, H, D], kv [M, D], idx [N, K]"
    n, h, d = q.shape
    if d != DQK or kv.shape[1] != DQK:
        return f"needs Dqk = {DQK}"
    if h not in (32, 64, 128):
        return "needs 32, 64 or 128 heads"
    k = idx.shape[1]
    if idx.shape[0] != n or k % (2 * BK) or k == 0:
        return f"needs K a positive multiple of {2 * BK} and one index row per token"
    if do.shape != q.shape or p.shape != (n, h, k) or ds.shape != (n, h, k):
        return "needs do like q and p, ds [N, H, K]"
    if any(x.dtype != jnp.bfloat16 for x in (q, do, kv, p, ds)) or idx.dtype != jnp.int32:
        return "needs bf16 q, do, kv, p, ds and int32 indices"
    return None


def _issue_slice(ctx, kv_cols, idx_blk, dst_smem, *, swizzle=SWIZZLE):
    """inline_mgpu body (lane semantics): the warpgroup's block of 64 selected rows' 64-column slice, dst row r <-
    kv_cols[idx_blk[r]] (kv_cols: a column view of kv, its offset in the pointer, rows DQK apart), zeros where
    idx_blk[r] < 0; 16-byte cp.async, consecutive threads on consecutive chunks of a row (coalesced)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    del ctx
    I = gather_mgpu._I
    i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
    per_row = W // gather_mgpu.CHUNK  # 8
    tid = I(arith.remui(mu.thread_idx(), arith.constant(i32, fwd.WARPGROUP)))
    dst_base = mu.memref_ptr(dst_smem)
    src_base = llvm.addrspacecast(llvm.PointerType.get(1), mu.memref_ptr(kv_cols))
    zero = arith.constant(i32, 0)
    for it in range(COPIES):
        flat = tid + it * fwd.WARPGROUP
        r, j = flat // per_row, flat % per_row
        row = memref.load(idx_blk, [arith.index_cast(ir.IndexType.get(), r.v)])
        valid = arith.cmpi(arith.CmpIPredicate.sge, row, zero)
        elem = arith.addi(arith.muli(arith.extui(i64, arith.select(valid, row, zero)), arith.constant(i64, DQK)),
                          arith.extui(i64, (j * gather_mgpu.CHUNK).v))
        src = llvm.getelementptr(src_base.type, src_base, [arith.muli(elem, arith.constant(i64, 2))],
                                 [-2147483648], i8, llvm.GEPNoWrapFlags.none)
        chunk = gather_mgpu.chunk_position(r, j, W * 2 // swizzle, swizzle)  # (8, swizzle / 2) tiles
        dst = llvm.getelementptr(dst_base.type, dst_base, [(chunk * 16).v], [-2147483648], i8,
                                 llvm.GEPNoWrapFlags.none)
        nvvm.cp_async_shared_global(dst, src, 16, nvvm.LoadCacheModifierKind.CG,
                                    cp_size=arith.select(valid, arith.constant(i32, 16), zero))


class _ChipGather:
    def __init__(self, tiles, swizzle=SWIZZLE):
        plgpu = fwd._plgpu()
        self._issue = plgpu.inline_mgpu(arg_types=gather_mgpu.gather_arg_types(plgpu, tiles))(
            functools.partial(_issue_slice, swizzle=swizzle))
        self._commit = plgpu.inline_mgpu()(fwd._commit)
        self._wait = plgpu.inline_mgpu()(pds._wait_none_pending)

    def __call__(self, kv_cols, idx_blk, dst):
        self._issue(kv_cols, idx_blk, dst)
        self._commit()
        self._wait()


class _InterpretGather:
    def __call__(self, kv_cols, idx_blk, dst):
        import jax.experimental.pallas as pl

        def row(r, c):
            i = idx_blk[r]
            v = kv_cols[pl.ds(jnp.maximum(i, 0), 1), :]
            dst[pl.ds(r, 1), :] = jnp.where(i >= 0, v, jnp.zeros_like(v))
            return c
        jax.lax.fori_loop(0, BK, row, 0)
        fwd._plgpu().commit_smem()


def _kernel(q_gmem, do_gmem, kv_gmem, idx_gmem, p_gmem, ds_gmem, dq_gmem, part_gmem,
            q_smem, do_smem, k_smem, p_smem, ds_smem, stage, dq_smem, bars, dq_ready, *, nblk, gather, in_place):
    import jax.experimental.pallas as pl
    plgpu = fwd._plgpu()
    t = jax.lax.axis_index("t")
    c = jax.lax.axis_index("c")
    w = jax.lax.axis_index("wg")
    h = q_smem.shape[0]
    keys_as_m = h < 64  # 32 heads: dq^T [64 columns, 32 heads] += k^T dS^T (wgmma M = columns, N = heads)
    dq_shape = (W, h) if keys_as_m else (h, W)
    cols = pl.ds(c * W, W)
    kv_cols = kv_gmem.at[:, cols]
    idx_tok = idx_gmem.at[t]

    @pl.when(w == 0)
    def _():
        plgpu.copy_gmem_to_smem(q_gmem.at[t, :, cols], q_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(do_gmem.at[t, :, cols], do_smem, bars.at[1])
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])
    p_w, ds_w, k_w, stage_w = p_smem.at[w], ds_smem.at[w], k_smem.at[w], stage.at[w]
    p_bar, ds_bar = bars.at[2 + w], bars.at[4 + w]

    def step(i, dq):
        blk = pl.ds((2 * i + w) * BK, BK)
        plgpu.copy_gmem_to_smem(p_gmem.at[t, :, blk], p_w, p_bar)
        plgpu.copy_gmem_to_smem(ds_gmem.at[t, :, blk], ds_w, ds_bar)
        gather(kv_cols, idx_tok.at[blk], k_w)
        plgpu.barrier_wait(p_bar)
        plgpu.barrier_wait(ds_bar)

        def dkv(acc):
            plgpu.wgmma(acc, ds_w.transpose((1, 0)), q_smem)
            plgpu.wgmma(acc, p_w.transpose((1, 0)), do_smem)
            return acc[...]
        part = pl.run_scoped(dkv, plgpu.ACC((BK, W), jnp.float32))
        a, b = (k_w.transpose((1, 0)), ds_w.transpose((1, 0))) if keys_as_m else (ds_w, k_w)
        if in_place:
            def dq_mma(acc):
                plgpu.wgmma(acc, a, b)
            dq = pl.run_state(dq_mma)(plgpu.ACC.init(dq))
        else:
            def dq_mma(acc):
                plgpu.wgmma(acc, a, b)
                return acc[...]
            dq = dq + pl.run_scoped(dq_mma, plgpu.ACC(dq_shape, jnp.float32))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's store has read the staging tile
        stage_w[...] = part.astype(stage_w.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage_w, part_gmem.at[t, blk, cols])
        return dq

    zero = plgpu.layout_cast(jnp.zeros(dq_shape, jnp.float32), plgpu.Layout.WGMMA)
    dq = jax.lax.fori_loop(0, nblk // 2, step, zero)

    @pl.when(w == 1)
    def _():
        dq_smem[...] = dq
        plgpu.commit_smem()
        plgpu.barrier_arrive(dq_ready)

    @pl.when(w == 0)
    def _():
        plgpu.barrier_wait(dq_ready)
        total = (dq + plgpu.load(dq_smem, layout=plgpu.Layout.WGMMA)).astype(jnp.bfloat16)
        # this warpgroup's P buffer [h, 64] is free (its last MMAs have completed); dq^T through a transposed view
        (p_w.transpose((1, 0)) if keys_as_m else p_w)[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(p_w, dq_gmem.at[t, :, cols])
    plgpu.wait_smem_to_gmem(0)


def sparse_mla_dqkv(q, do, kv, idx, p, ds, *, part_dtype=jnp.bfloat16, interpret: bool = False):
    """(dq [N, H, 576] bf16, part [N, K, 576] part_dtype (bf16 or f32)). See the module docstring."""
    why = check_shapes(q, do, kv, idx, p, ds)
    if why is not None:
        raise ValueError(f"sparse_mla_dqkv_mgpu.sparse_mla_dqkv: q {q.shape} {q.dtype}, do {do.shape} {do.dtype}, "
                         f"kv {kv.shape} {kv.dtype}, idx {idx.shape} {idx.dtype}, p {p.shape} {p.dtype}, "
                         f"ds {ds.shape} {ds.dtype}: {why}")
    part_dtype = jnp.dtype(part_dtype)
    if part_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"sparse_mla_dqkv_mgpu.sparse_mla_dqkv: part_dtype {part_dtype} must be bfloat16 or float32")
    plgpu = fwd._plgpu()
    n, h, _ = q.shape
    k = idx.shape[1]
    # 32 heads: the 64-byte swizzle ((8, 32) tiles), as wgmma's K = 32 heads of dS^T q needs
    swizzle = SWIZZLE if h >= 64 else fwd.SWIZZLE
    tiles = (plgpu.TilingTransform(TILE if swizzle == SWIZZLE else fwd.TILE), plgpu.SwizzleTransform(swizzle))
    SM = plgpu.SMEM
    scratch = [
        SM((h, W), jnp.bfloat16, transforms=tiles),  # q slice
        SM((h, W), jnp.bfloat16, transforms=tiles),  # dO slice
        SM((2, BK, W), jnp.bfloat16, transforms=tiles),  # the gathered rows' slice, per warpgroup
        SM((2, h, BK), jnp.bfloat16, transforms=tiles),  # P block, per warpgroup (warpgroup 0's: dq's staging)
        SM((2, h, BK), jnp.bfloat16, transforms=tiles),  # dS block, per warpgroup
        SM((2, BK, W), part_dtype, transforms=tiles if part_dtype == jnp.bfloat16 else ()),  # part staging
        SM((W, h) if h < 64 else (h, W), jnp.float32),  # warpgroup 1's dq (dq^T at 32 heads), to warpgroup 0
        plgpu.Barrier(num_barriers=6),  # q, dO, P (per warpgroup), dS (per warpgroup)
        plgpu.Barrier(num_arrivals=1),  # dq_ready
    ]
    gather = _InterpretGather() if interpret else _ChipGather(tiles, swizzle)
    body = functools.partial(_kernel, nblk=k // BK, gather=gather, in_place=not interpret)
    out_type = (jax.ShapeDtypeStruct((n, h, DQK), jnp.bfloat16), jax.ShapeDtypeStruct((n, k, DQK), part_dtype))
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(n, DQK // W), grid_names=("t", "c"),
                        num_threads=2, thread_name="wg", kernel_name="sparse_mla_dqkv_mgpu",
                        interpret=mosaic_gpu_interpret_params("sparse_mla_dqkv_mgpu", 2, _DETECT_RACES)
                        if interpret else None,
                        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0))(q, do, kv, idx, p, ds)


def sparse_mla_dqkv_reference(q, do, kv, idx, p, ds):
    """The plain-JAX contract in float32: (dq, part)."""
    valid = idx >= 0
    rows = jnp.where(valid[..., None], kv[jnp.maximum(idx, 0)].astype(jnp.float32), 0.0)  # [N, K, 576]
    ds32, p32 = ds.astype(jnp.float32), p.astype(jnp.float32)
    dq = jnp.einsum("nhk,nkd->nhd", ds32, rows)
    part = jnp.einsum("nhk,nhd->nkd", ds32, q.astype(jnp.float32)) + jnp.einsum("nhk,nhd->nkd", p32,
                                                                                do.astype(jnp.float32))
    return dq, part
