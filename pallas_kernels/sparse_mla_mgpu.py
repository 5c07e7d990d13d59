"""Sparse MLA forward on Hopper in Pallas Mosaic GPU (issue 31, item 2): 64 heads x 64-key blocks per CTA, two
warpgroups, wide wgmma, each warpgroup gathering its half of the next key block with 16-byte `cp.async` while the
current block is computed.

Semantics: `dsv32_jax.model.attention.sparse_mla` on flattened tokens with global indices (what
`pallas_kernels.sparse_mla` hands its kernels): q [N, H, 576] bf16, kv [M, 576] bf16 (value = first 512 columns),
idx [N, K] int32 (rows of kv; -1 = invalid slot, the wrapper maps every out-of-range slot to -1) ->
out [N, H, 512] bf16 = softmax(scale q kv[idx]^T) kv[idx][:, :512], lse [N, H] f32 (natural log; a row with no valid
slot gives out 0 and lse -inf). H a multiple of 64, K a multiple of 64.

Structure (FlashMLA's SM90 sparse prefill, without its register rebalancing; see BENCHMARKS.md "Issue 31 item 2"):
  * grid (H / 64, N), the head-group axis first so the two head groups of a token run together and meet its gathered
    rows in L2; q's [64, 576] tile arrives by TMA and stays in shared memory.
  * two warpgroups. Warpgroup w gathers rows [32 w, 32 w + 32) of each 64-key block (`cp.async` into the
    (8, 64)-tiled, 128-byte-swizzled layout wgmma reads, `gather_mgpu.chunk_position`; invalid slots copy 0 bytes,
    which zero-fills) and computes S_w = q kv_w^T for those 32 keys on `wgmma m64n32k16`. The two exchange row
    maxima through shared memory (one mbarrier), so both hold the same running max m and rescale alpha; each writes
    its bf16 P_w into its half of a [64, 64] P tile, and after a second mbarrier each computes its 256 output
    columns O_w += P kv[:, 256 w : 256 w + 256] on `wgmma m64n256k16` (a [64, 256] f32 accumulator, 128 registers a
    thread). Row sums are kept per warpgroup and added at the end.
  * key blocks are double-buffered (2 x 72 KiB, beside q's 72 KiB and the 8 KiB P tile): the gather of block b + 1
    is issued before block b's S, so its copies are in flight during block b's softmax and PV; a third mbarrier
    (both warpgroups done with block b - 1's PV) frees the buffer it overwrites.
  * the output tile reuses q's shared memory (`RefUnion`; q is dead after the last S) and leaves by TMA.
Interpret mode (`interpret=True`, what CPU tests run): the same kernel with the gather written as a Pallas row loop
(Mosaic GPU's interpreter cannot run `inline_mgpu`) and PV accumulated into a fresh accumulator (it has no rule for
`pl.run_state` over a wgmma accumulator); on the chip the gather is `cp.async` and PV accumulates in place.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dsv32_jax.kernels import gather_mgpu

H_BLK = 64  # heads per CTA (wgmma M)
BK = 64  # keys per block
KW = BK // 2  # keys per warpgroup
DQK, DV = 576, 512
HALF = DV // 2  # output columns per warpgroup
LOG2E = math.log2(math.e)
WARPGROUP = 128
SWIZZLE = 64  # bytes: the key block's and P's layout, (8, 32) tiles; wgmma needs one swizzle for A and B and
# K a multiple of swizzle / 2, so 64 (not 128) lets PV run as two K = 32 halves, one per warpgroup's P
TILE = (8, SWIZZLE // 2)
_DETECT_RACES = False  # tests switch the interpreter's happens-before race detector on


def check_shapes(q, kv, idx) -> str | None:
    """Why this kernel cannot serve these inputs (None: it can)."""
    if q.ndim != 3 or kv.ndim != 2 or idx.ndim != 2:
        return "expects q [N, H, D], kv [M, D], idx [N, K]"
    n, h, d = q.shape
    if d != DQK or kv.shape[1] != DQK:
        return f"needs Dqk = {DQK} (512 value + 64 rope)"
    if h % H_BLK:
        return f"needs the head count to be a multiple of {H_BLK}"
    if idx.shape[0] != n or idx.shape[1] % BK or idx.shape[1] == 0:
        return f"needs K a positive multiple of {BK} and one index row per token"
    if q.dtype != jnp.bfloat16 or kv.dtype != jnp.bfloat16:
        return "needs bf16 q and kv"
    if idx.dtype != jnp.int32:
        return "needs int32 indices"
    return None


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


# ---- the gather: chip (inline_mgpu cp.async) and interpret (Pallas row loop) forms, one interface ----------------

def _issue_rows(ctx, kv_gmem, idx_gmem, dst_smem, mask_smem):
    """inline_mgpu body (lane semantics): this warpgroup's 32 rows of a [64, 576] key block, dst row r <- kv[idx[r]]
    (16-byte cp.async per thread and chunk, 0 bytes for idx < 0: zero-fill), and mask_smem[r] <- 0 or -inf (the
    softmax's additive mask: idx[r] >= 0 or not); one
    cp.async group committed. idx_gmem: the block's 64 indices (a global-memory view)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    del ctx
    I = gather_mgpu._I
    i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
    idx_t = ir.IndexType.get()
    cpr, col_tiles = DQK // gather_mgpu.CHUNK, DQK // TILE[1]
    thread = mu.thread_idx()
    w = arith.divui(thread, arith.constant(i32, WARPGROUP))
    tid = I(arith.remui(thread, arith.constant(i32, WARPGROUP)))
    row0 = I(arith.muli(w, arith.constant(i32, KW)))
    zero = arith.constant(i32, 0)
    # the block's indices of this warpgroup's rows into shared memory (4 threads per row write the same value)
    own = row0 + (tid & (KW - 1))
    own_ix = arith.index_cast(idx_t, own.v)
    f32 = ir.F32Type.get()
    own_valid = arith.cmpi(arith.CmpIPredicate.sge, memref.load(idx_gmem, [own_ix]), arith.constant(i32, 0))
    memref.store(arith.select(own_valid, arith.constant(f32, 0.0), arith.constant(f32, float("-inf"))), mask_smem,
                 [own_ix])
    dst_base = mu.memref_ptr(dst_smem)
    src_base = llvm.addrspacecast(llvm.PointerType.get(1), mu.memref_ptr(kv_gmem))
    for it in range(KW * cpr // WARPGROUP):
        flat = tid + it * WARPGROUP
        r = row0 + I(arith.divui(flat.v, I._c(cpr)))
        j = I(arith.remui(flat.v, I._c(cpr)))
        dst = llvm.getelementptr(dst_base.type, dst_base, [(gather_mgpu.chunk_position(r, j, col_tiles, SWIZZLE) * 16).v],
                                 [-2147483648], i8, llvm.GEPNoWrapFlags.none)
        row = memref.load(idx_gmem, [arith.index_cast(idx_t, r.v)])
        valid = arith.cmpi(arith.CmpIPredicate.sge, row, zero)
        elem = arith.addi(arith.muli(arith.extui(i64, arith.select(valid, row, zero)), arith.constant(i64, DQK)),
                          arith.extui(i64, (j * gather_mgpu.CHUNK).v))
        src = llvm.getelementptr(src_base.type, src_base, [arith.muli(elem, arith.constant(i64, 2))],
                                 [-2147483648], i8, llvm.GEPNoWrapFlags.none)
        nvvm.cp_async_shared_global(dst, src, 16, nvvm.LoadCacheModifierKind.CG,
                                    cp_size=arith.select(valid, arith.constant(i32, 16), zero))


def _commit(ctx):
    from jax._src.lib.mlir.dialects import nvvm
    del ctx
    nvvm.cp_async_commit_group()


def _wait_one_pending(ctx):
    """This thread's copies of all but the newest group have landed; fence them for the async proxy (wgmma) and
    synchronize the warpgroup (its threads copied each other's rows)."""
    from jax._src.lib.mlir.dialects import nvvm
    from jax.experimental.mosaic.gpu import utils as mu
    del ctx
    nvvm.cp_async_wait_group(1)
    mu.commit_shared()


class _ChipGather:
    def __init__(self, tiles):
        plgpu = _plgpu()
        self._issue = plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(tiles),
                                                   plgpu.RefType()))(_issue_rows)
        self._commit = plgpu.inline_mgpu()(_commit)
        self._wait = plgpu.inline_mgpu()(_wait_one_pending)

    def issue(self, w, kv_gmem, idx_blk_gmem, kv_buf, mask_buf):
        del w  # the inline body reads its warpgroup from the thread index
        self._issue(kv_gmem, idx_blk_gmem, kv_buf, mask_buf)

    def commit(self):
        self._commit()

    def wait(self):
        self._wait()


class _InterpretGather:
    """The same contract as a Pallas-level row loop (synchronous copies)."""

    def issue(self, w, kv_gmem, idx_blk_gmem, kv_buf, mask_buf):
        import jax.experimental.pallas as pl

        def row(r, c):
            i = idx_blk_gmem[w * KW + r]
            mask_buf[w * KW + r] = jnp.where(i >= 0, 0.0, -jnp.inf).astype(jnp.float32)
            v = kv_gmem[pl.ds(jnp.maximum(i, 0), 1), :]
            kv_buf[pl.ds(w * KW + r, 1), :] = jnp.where(i >= 0, v, jnp.zeros_like(v))
            return c
        jax.lax.fori_loop(0, KW, row, 0)

    def commit(self):
        pass

    def wait(self):
        _plgpu().commit_smem()


# ---- the kernel ------------------------------------------------------------------------------------------------

def _kernel(q_gmem, kv_gmem, idx_gmem, out_gmem, lse_gmem, qo, kv_smem, p_smem, stat_smem, bars,
            m_full, p_full, kv_free, *, scale, nblk, gather, in_place):
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    q_smem, o_smem = qo
    g = jax.lax.axis_index("g")
    t = jax.lax.axis_index("t")
    wg = jax.lax.axis_index("wg")
    heads = pl.ds(g * H_BLK, H_BLK)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    idx_tok = idx_gmem.at[t]

    def idx_block(b):
        return idx_tok.at[pl.ds(b * BK, BK)]

    def consumer(w):
        """Warpgroup w: keys [32 w, 32 w + 32) of each block for S, output columns [256 w, 256 w + 256)."""
        @pl.when(w == 0)
        def _():
            plgpu.copy_gmem_to_smem(q_gmem.at[t, heads], q_smem, bars.at[0])
        gather.issue(w, kv_gmem, idx_block(0), kv_smem.at[0], stat_smem.at[4])
        gather.commit()
        plgpu.barrier_wait(bars.at[0])

        def step(b, carry):
            o, m, l = carry
            slot = jax.lax.rem(b, 2)
            nslot = 1 - slot

            @pl.when(b >= 1)
            def _():  # both warpgroups are past block b - 1's PV: its buffer (slot of b + 1) and P are free
                plgpu.barrier_wait(kv_free.at[nslot])

            @pl.when(b + 1 < nblk)
            def _():
                gather.issue(w, kv_gmem, idx_block(b + 1), kv_smem.at[nslot], stat_smem.at[4 + nslot])
            gather.commit()
            gather.wait()  # this warpgroup's rows of block b are in shared memory

            kv = kv_smem.at[slot]
            kv_w = kv.at[pl.ds(w * KW, KW)]

            def qk(acc):
                plgpu.wgmma(acc, q_smem, plgpu.transpose_ref(kv_w, (1, 0)))
                return acc[...]
            s = pl.run_scoped(qk, plgpu.ACC((H_BLK, KW), jnp.float32))
            mask = plgpu.load(stat_smem.at[4 + slot, pl.ds(w * KW, KW)], layout=plgpu.Layout.WGMMA.reduce(0))
            s2 = s * (scale * LOG2E) + jax.lax.broadcast_in_dim(mask, s.shape, [1])
            stat_smem.at[w][...] = s2.max(axis=1)
            plgpu.barrier_arrive(m_full)
            plgpu.barrier_wait(m_full)
            m_other = plgpu.load(stat_smem.at[1 - w], layout=row_layout)
            m_new = jnp.maximum(m, jnp.maximum(plgpu.load(stat_smem.at[w], layout=row_layout), m_other))
            base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2(s2 - jax.lax.broadcast_in_dim(base, s2.shape, [0]))
            alpha = jnp.exp2(m - base)
            l = l * alpha + p.sum(axis=1)
            p_smem.at[w][...] = p.astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_full)
            plgpu.barrier_wait(p_full)  # both halves of P, and both halves of the key block, are in shared memory

            o = o * jax.lax.broadcast_in_dim(alpha, o.shape, [0])
            cols = pl.ds(w * HALF, HALF)
            if in_place:
                def pv(acc):
                    for h in range(2):
                        plgpu.wgmma(acc, p_smem.at[h], kv.at[pl.ds(h * KW, KW), cols])
                o = pl.run_state(pv)(plgpu.ACC.init(o))
            else:
                def pv(acc):
                    for h in range(2):
                        plgpu.wgmma(acc, p_smem.at[h], kv.at[pl.ds(h * KW, KW), cols])
                    return acc[...]
                o = o + pl.run_scoped(pv, plgpu.ACC((H_BLK, HALF), jnp.float32))
            plgpu.barrier_arrive(kv_free.at[slot])
            return o, m_new, l

        zero = plgpu.layout_cast(jnp.zeros((H_BLK, HALF), jnp.float32), plgpu.Layout.WGMMA)
        init = (zero, plgpu.layout_cast(jnp.full((H_BLK,), -jnp.inf, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.zeros((H_BLK,), jnp.float32), row_layout))
        o, m, l = jax.lax.fori_loop(0, nblk, step, init)

        # both warpgroups past their last S (q's memory becomes the output tile); add the two row-sum halves
        plgpu.barrier_wait(kv_free.at[(nblk - 1) % 2])
        stat_smem.at[2 + w][...] = l
        plgpu.barrier_arrive(m_full)
        plgpu.barrier_wait(m_full)
        l = l + plgpu.load(stat_smem.at[3 - w], layout=row_layout)
        safe = jnp.where(l > 0, l, 1.0)
        o_smem.at[w][...] = (o / jax.lax.broadcast_in_dim(safe, o.shape, [0])).astype(jnp.bfloat16)

        @pl.when(w == 0)
        def _():
            base = jnp.where(m == -jnp.inf, 0.0, m)
            stat_smem.at[0][...] = jnp.where(l > 0, (base + jnp.log2(safe)) / LOG2E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[w], out_gmem.at[t, heads, pl.ds(w * HALF, HALF)])

        @pl.when(w == 0)
        def _():
            plgpu.copy_smem_to_gmem(stat_smem.at[0], lse_gmem.at[t, heads])
        plgpu.wait_smem_to_gmem(0)

    consumer(wg)


def sparse_mla_fwd(q, kv, idx, *, scale: float, interpret: bool = False):
    """q [N, H, 576] bf16, kv [M, 576] bf16, idx [N, K] int32 (global rows, -1 invalid) -> (out [N, H, 512] bf16,
    lse [N, H] f32). See the module docstring."""
    why = check_shapes(q, kv, idx)
    if why is not None:
        raise ValueError(f"sparse_mla_mgpu.sparse_mla_fwd: q {q.shape} {q.dtype}, kv {kv.shape} {kv.dtype}, "
                         f"idx {idx.shape} {idx.dtype}: {why}")
    plgpu = _plgpu()
    n, h, _ = q.shape
    nblk = idx.shape[1] // BK
    tiles = (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(SWIZZLE))
    o_tiles = (plgpu.TilingTransform(gather_mgpu.TILE), plgpu.SwizzleTransform(gather_mgpu.SWIZZLE))
    SM = plgpu.SMEM
    scratch = [
        plgpu.RefUnion(SM((H_BLK, DQK), jnp.bfloat16, transforms=tiles),
                       SM((2, H_BLK, HALF), jnp.bfloat16, transforms=o_tiles)),  # q, then the output tile
        SM((2, BK, DQK), jnp.bfloat16, transforms=tiles),  # key blocks, double-buffered
        SM((2, H_BLK, KW), jnp.bfloat16, transforms=tiles),  # P, one [64, 32] half per warpgroup
        SM((6, H_BLK), jnp.float32),  # rows 0-1: the halves' row maxima (then lse), 2-3: row sums, 4-5: key masks
        plgpu.Barrier(num_barriers=1),  # q
        plgpu.Barrier(num_arrivals=2),  # m_full
        plgpu.Barrier(num_arrivals=2),  # p_full
        plgpu.Barrier(num_arrivals=2, num_barriers=2),  # kv_free
    ]
    gather = _InterpretGather() if interpret else _ChipGather(tiles)
    body = functools.partial(_kernel, scale=float(scale), nblk=nblk, gather=gather, in_place=not interpret)
    out_type = (jax.ShapeDtypeStruct((n, h, DV), jnp.bfloat16), jax.ShapeDtypeStruct((n, h), jnp.float32))
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(h // H_BLK, n), grid_names=("g", "t"),
                        num_threads=2, thread_name="wg",
                        interpret=plgpu.InterpretGPUParams(detect_races=_DETECT_RACES) if interpret else None,
                        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0))(q, kv, idx)


def sparse_mla_fwd_reference(q, kv, idx, *, scale: float):
    """The plain-JAX contract (float32 math): `attention.sparse_mla` on one flattened batch."""
    from dsv32_jax.model import attention
    out, lse = attention.sparse_mla(q[None], kv[None], idx[None], scale, DV)
    return out[0], lse[0]
