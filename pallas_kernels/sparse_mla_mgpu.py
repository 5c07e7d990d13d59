"""Sparse MLA forward on Hopper in Pallas Mosaic GPU (issue 31, item 2): 64 heads x 64-key blocks per CTA, two
warpgroups, wide wgmma, each warpgroup gathering its half of the next key block with 16-byte `cp.async` while the
current block is computed.

Semantics: `dsv32_jax.model.attention.sparse_mla` on flattened tokens with global indices (what
`pallas_kernels.sparse_mla` hands its kernels): q [N, H, 576] bf16, kv [M, 576] bf16 (value = first 512 columns),
idx [N, K] int32 (rows of kv; -1 = invalid slot, the wrapper maps every out-of-range slot to -1) ->
out [N, H, 512] bf16 = softmax(scale q kv[idx]^T) kv[idx][:, :512], lse [N, H] f32 (natural log; a row with no valid
slot gives out 0 and lse -inf). H a multiple of 64, K a multiple of 64.

Structure (FlashMLA's SM90 sparse prefill without its producer warpgroup and register rebalancing: jax 0.12's
compile path drops `setmaxnreg`, and under jax 0.11.2, which keeps it, a 384-thread kernel still spills at 168
registers; see BENCHMARKS.md "Issue 31 item 2"):
  * grid (N, H / 64): Mosaic GPU launches the last grid axis as CUDA's x, the fastest (the compile table shows
    2 x 4096), so the two head groups of a token run together and meet its gathered rows in L2. q's [64, 576] tile
    arrives by TMA and stays in shared memory.
  * two warpgroups. Warpgroup w gathers rows [32 w, 32 w + 32) of each 64-key block (`cp.async`, 16 bytes per
    copy, into the (8, 32)-tiled, 64-byte-swizzled layout wgmma reads: `copy_plan` / `gather_mgpu.chunk_position`;
    invalid slots copy 0 bytes, which zero-fills, and write -inf into the block's additive softmax mask) and
    computes S_w = q kv_w^T for its 32 keys on `wgmma m64n32k16` (K = 576). The two exchange row maxima through
    shared memory (mbarrier m_full), so both hold the same running max and rescale; each writes its bf16 P_w
    [64, 32] to shared memory, and after mbarrier p_full each computes its 256 output columns
    O_w += P_0 kv[0:32, cols_w] + P_1 kv[32:64, cols_w] on `wgmma m64n256k16` (a [64, 256] f32 accumulator, 128
    registers a thread, accumulated in place). Row sums are kept per warpgroup and added at the end.
  * why 64-byte swizzle and N = 32: Mosaic GPU's wgmma takes one swizzle for both operands and K in multiples of
    swizzle / 2 bytes, and a store into a 32-column half of a 128-byte tile is refused, so the two P halves are
    separate [64, 32] operands and PV runs as two K = 32 steps. Per m64n32k16 the tensor core reads 3 KiB of shared
    memory for 65,536 FLOP (24 of its 32 cycles at 128 B per cycle), where the Triton forward's m64n16k16 reads
    2.5 KiB for half the FLOP (more cycles of reads than of math).
  * key blocks are double-buffered (2 x 72 KiB beside q's 72 KiB and P's 8 KiB: 231,464 B of the 232,448): the
    gather of block b + 1 is issued before block b's S, so its copies are in flight during block b's softmax and
    PV; mbarrier kv_free (both warpgroups past block b - 1's PV) guards the buffer it overwrites and the P tile.
  * registers: 213, no spills (sm_90a, ptxas of CUDA 13). q's wgmma descriptors are formed inside the key loop
    (q is addressed through an index that is always 0 but loop-variant, `slot (slot - 1)`): hoisted, the 36 64-bit
    descriptors stay live across the loop and spill (255 registers, 344 B).
  * the output tile reuses q's shared memory (`RefUnion`; q is dead after the last S) and leaves by TMA.
The ping-pong form (`form="pingpong"`, `kernels.sparse_mla(fwd="mosaic_gpu_pingpong")`; `_kernel_pp`), FlashMLA's
split of the work: each warpgroup takes a whole 64-key block (blocks 2 i and 2 i + 1 of step i; an odd block count
is padded with an invalid block), S_w = q kv_w^T on `wgmma m64n64k16` (N = 64: a 2 KiB q tile and a 2 KiB key tile
per 131,072 FLOP, against 3 KiB per 65,536 above), the two exchange row maxima, and warpgroup w computes its 256
output columns from both blocks, O_w += P_w kv_w[:, cols_w] + P_o kv_o[:, cols_w] (`m64n256k16`, K = 64 keys, both
P tiles through shared memory). Shared memory: q 72 KiB + two [64, 512] value blocks + two [64, 64] rope tiles,
each of which becomes its block's P tile once S is done (223,272 B with the rest): no room for a second pair of
key blocks, so each block is refilled in two `cp.async` groups as its readers finish: the early part (value columns
cols_w, read only by w) while w runs its PV of the other block, the late part (the other half and the rope / P
tile) once the other warpgroup's PV of this block is done (mbarrier late_free); the next S reads the early part
first. 212 registers, no spills (sm_90a; every shared-memory operand addressed through a loop-variant zero, as q
above: hoisted, the descriptors spill 300 B at 255 registers). Not run on a chip; which form is faster there is
owed (`bench/gpu_owed.sh 0`: the row `sparse_mla fwd (mosaic_gpu pingpong)` beside `(mosaic_gpu)`).
32 heads (what one device sees of 128 at tensor:4; the wrapper pads 32 or fewer to 32): `_kernel_t`, the keys as
the wgmma M dimension. One warpgroup per (token, 32 heads): S^T = K q^T [64 keys, 32 heads] (`wgmma m64n32k16`,
the same operands as S above with the roles swapped), the softmax over keys as column reductions across the
warpgroup's 4 warps (the cross-warp step through Mosaic GPU's reduction scratch, which is why it is one warpgroup:
the scratch is shared by all warpgroups of a CTA), P^T bf16 to shared memory, O^T [512, 32] += V^T P^T as two
[256, 32] accumulators (A = the key block's value columns read transposed from shared memory; 128 registers a
thread), key blocks double-buffered by the same cp.async gather (36 copies a thread a block). O^T is stored
through a transposed view of O's [32, 256] tiles in shared memory, which leave by TMA into out. 192,520 B of shared
memory (one CTA per SM), 223 registers, no spills. Against padding 32 heads to 64: half the MMA work and q memory
for the same gathered bytes; at 32 heads a 72 KiB block carries 4.5 MFLOP of MMA (expected to be bound by the
gather; not measured on a chip).
Interpret mode (`interpret=True`, what CPU tests run): the same kernel with the gather written as a Pallas row loop
(Mosaic GPU's interpreter cannot run `inline_mgpu`) and PV accumulated into a fresh accumulator (it has no rule for
`pl.run_state` over a wgmma accumulator); on the chip the gather is `cp.async` and PV accumulates in place. The
chip path is compiled for sm_90a in `make test-gpu-compile`; it has not run on a chip yet
(`tests/test_kernels.py::test_sparse_mla_mgpu_on_chip`, owed by `bench/gpu_owed.sh 0`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dsv32_jax.kernels._dispatch import mosaic_gpu_interpret_params
from dsv32_jax.kernels import gather_mgpu
from dsv32_jax.kernels.gather_mgpu import gather_arg_types

H_BLK = 64  # heads per CTA (wgmma M)
H_T = 32  # heads per CTA of the keys-as-M form (`_kernel_t`: wgmma N = heads), what 32 or fewer heads run
REDUCTION_SCRATCH = 2048  # bytes: `_kernel_t`'s column max / sum cross the warpgroup's 4 warps through it
BK = 64  # keys per block
KW = BK // 2  # keys per warpgroup
DQK, DV = 576, 512
HALF = DV // 2  # output columns per warpgroup
LOG2E = math.log2(math.e)
WARPGROUP = 128
SWIZZLE = 64  # bytes: the key block's and P's layout, (8, 32) tiles; wgmma needs one swizzle for A and B and
# K a multiple of swizzle / 2, so 64 (not 128) lets PV run as two K = 32 halves, one per warpgroup's P
TILE = (8, SWIZZLE // 2)
FORMS = ("split", "pingpong")  # the 64-head forms of `sparse_mla_fwd`
_DETECT_RACES = False  # tests switch the interpreter's happens-before race detector on


def check_shapes(q, kv, idx) -> str | None:
    """Why this kernel cannot serve these inputs (None: it can)."""
    if q.ndim != 3 or kv.ndim != 2 or idx.ndim != 2:
        return "expects q [N, H, D], kv [M, D], idx [N, K]"
    n, h, d = q.shape
    if d != DQK or kv.shape[1] != DQK:
        return f"needs Dqk = {DQK} (512 value + 64 rope)"
    if h % H_BLK and h != H_T:
        return f"needs the head count to be {H_T} or a multiple of {H_BLK}"
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

PER_ROW = WARPGROUP // KW  # threads per gathered row: 4, one per 16-byte chunk of a 64-byte swizzle line
COPIES = DQK // 8 // PER_ROW  # cp.async per thread and block: 18
COPY_STRIDE = TILE[0] * SWIZZLE // 16  # chunks between a thread's consecutive copies: one (8, 32) tile (32)


def copy_plan(tid, row0):
    """Thread tid (0..127) of the warpgroup gathering rows [row0, row0 + 32): (its row r, its first chunk j0, the
    destination chunk of its first copy). Copy `it` (< COPIES) of the thread is chunk j0 + PER_ROW it of row r, at
    destination chunk + COPY_STRIDE it: the same column of the next (8, 32) tile, where `chunk_position` puts it
    (the CPU test checks that and that every chunk is copied once). One index load per thread, and both addresses
    affine in `it` with constant steps (immediate offsets in the SASS, nothing held live across the key loop).
    Works on Python ints and on `gather_mgpu._I`."""
    r, j0 = row0 + tid // PER_ROW, tid % PER_ROW
    return r, j0, gather_mgpu.chunk_position(r, j0, DQK // TILE[1], SWIZZLE)


def _issue_rows(ctx, kv_gmem, idx_gmem, dst_smem, mask_smem):
    """inline_mgpu body (lane semantics): this warpgroup's 32 rows of a [64, 576] key block, dst row r <- kv[idx[r]]
    (16-byte cp.async per thread and chunk, 0 bytes for idx < 0: zero-fill), and mask_smem[r] <- 0 or -inf (the
    softmax's additive mask: idx[r] >= 0 or not), by `copy_plan`; committed as one cp.async group by the caller.
    idx_gmem: the block's 64 indices (a global-memory view)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mu

    del ctx
    i32 = ir.IntegerType.get_signless(32)
    thread = mu.thread_idx()
    w = arith.divui(thread, arith.constant(i32, WARPGROUP))
    tid = gather_mgpu._I(arith.remui(thread, arith.constant(i32, WARPGROUP)))
    _copy_rows(tid, gather_mgpu._I(arith.muli(w, arith.constant(i32, KW))), kv_gmem, idx_gmem, dst_smem, mask_smem)


def _issue_block(ctx, kv_gmem, idx_gmem, dst_smem, mask_smem):
    """inline_mgpu body of the keys-as-M forward (one warpgroup): all 64 rows of the block, as `_issue_rows` with
    the 32-row plan run for rows [0, 32) and [32, 64) (36 cp.async per thread)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mu

    del ctx
    i32 = ir.IntegerType.get_signless(32)
    tid = gather_mgpu._I(arith.remui(mu.thread_idx(), arith.constant(i32, WARPGROUP)))
    for row0 in range(0, BK, KW):
        _copy_rows(tid, row0, kv_gmem, idx_gmem, dst_smem, mask_smem)


def _copy_rows(tid, row0, kv_gmem, idx_gmem, dst_smem, mask_smem):
    """Thread tid's share (`copy_plan`) of rows [row0, row0 + 32): its COPIES cp.async and its row's mask entry."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
    idx_t = ir.IndexType.get()
    zero = arith.constant(i32, 0)
    dst_base = mu.memref_ptr(dst_smem)
    src_base = llvm.addrspacecast(llvm.PointerType.get(1), mu.memref_ptr(kv_gmem))
    r, j0, dst_chunk = copy_plan(tid, row0)
    r_ix = arith.index_cast(idx_t, r.v)
    row = memref.load(idx_gmem, [r_ix])
    valid = arith.cmpi(arith.CmpIPredicate.sge, row, zero)
    f32 = ir.F32Type.get()  # the row's mask entry (its PER_ROW threads write the same value)
    memref.store(arith.select(valid, arith.constant(f32, 0.0), arith.constant(f32, float("-inf"))), mask_smem, [r_ix])
    size = arith.select(valid, arith.constant(i32, 16), zero)
    src_row = llvm.getelementptr(src_base.type, src_base, [arith.muli(arith.addi(arith.muli(
        arith.extui(i64, arith.select(valid, row, zero)), arith.constant(i64, DQK)),
        arith.extui(i64, (j0 * gather_mgpu.CHUNK).v)), arith.constant(i64, 2))], [-2147483648], i8,
        llvm.GEPNoWrapFlags.none)
    dst0 = llvm.getelementptr(dst_base.type, dst_base, [(dst_chunk * 16).v], [-2147483648], i8,
                              llvm.GEPNoWrapFlags.none)
    for it in range(COPIES):
        dst = llvm.getelementptr(dst_base.type, dst0, [], [it * COPY_STRIDE * 16], i8, llvm.GEPNoWrapFlags.none)
        src = llvm.getelementptr(src_base.type, src_row, [], [it * PER_ROW * 16], i8, llvm.GEPNoWrapFlags.none)
        nvvm.cp_async_shared_global(dst, src, 16, nvvm.LoadCacheModifierKind.CG, cp_size=size)


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
    def __init__(self, tiles, full_block: bool = False):
        plgpu = _plgpu()
        self._issue = plgpu.inline_mgpu(arg_types=gather_arg_types(plgpu, tiles, ()))(
            _issue_block if full_block else _issue_rows)
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

    def __init__(self, full_block: bool = False):
        self._rows = BK if full_block else KW

    def issue(self, w, kv_gmem, idx_blk_gmem, kv_buf, mask_buf):
        import jax.experimental.pallas as pl
        row0 = 0 if self._rows == BK else w * KW

        def row(r, c):
            i = idx_blk_gmem[row0 + r]
            mask_buf[row0 + r] = jnp.where(i >= 0, 0.0, -jnp.inf).astype(jnp.float32)
            v = kv_gmem[pl.ds(jnp.maximum(i, 0), 1), :]
            kv_buf[pl.ds(row0 + r, 1), :] = jnp.where(i >= 0, v, jnp.zeros_like(v))
            return c
        jax.lax.fori_loop(0, self._rows, row, 0)

    def commit(self):
        pass

    def wait(self):
        _plgpu().commit_smem()


# ---- the ping-pong form's gather: each warpgroup its own whole key block, in two parts ------------------------

NOPE_TILES = DV // TILE[1]  # column tiles of a key block's value / nope part [64, 512]: 16
ROPE = DQK - DV  # 64 rope columns, kept in their own [64, 64] buffer (it doubles as the block's P tile)
HALF_COPIES = HALF // 8 // PER_ROW  # cp.async per thread and 32 rows for 256 columns: 8
ROPE_COPIES = ROPE // 8 // PER_ROW  # ... for the 64 rope columns: 2


def pp_copy_plan(tid, row0, half):
    """The ping-pong form's gather (`_issue_part`), thread tid (0..127) of the warpgroup, rows [row0, row0 + 32), for
    the value columns [256 half, 256 half + 256) (half 0 or 1; buffer [64, 512] tiled (8, 32)) or, with half None,
    the rope columns (buffer [64, 64]): (row r, first chunk j0, source chunk s0 and destination chunk d0 of the first
    copy, number of copies n). Copy k < n reads chunk s0 + PER_ROW k of row r and writes chunk d0 + COPY_STRIDE k of
    the buffer: the same column of the next (8, 32) tile. Works on Python ints and on `gather_mgpu._I` (half too):
    the kernel runs this formula, and the CPU test checks that the destinations are where `chunk_position` puts
    them and that the parts cover each chunk once."""
    r, j0 = row0 + tid // PER_ROW, tid % PER_ROW
    if half is None:
        return r, j0, j0 + DV // 8, gather_mgpu.chunk_position(r, j0, ROPE // TILE[1], SWIZZLE), ROPE_COPIES
    return (r, j0, j0 + PER_ROW * HALF_COPIES * half,
            gather_mgpu.chunk_position(r, j0, NOPE_TILES, SWIZZLE) + COPY_STRIDE * HALF_COPIES * half, HALF_COPIES)


def _issue_part(kv_gmem, idx_gmem, nope_smem, rope_smem, mask_smem, *, late):
    """inline_mgpu body (lane semantics) of the ping-pong form: part of this warpgroup's [64, 576] key block,
    dst row r <- kv[idx[r]] by 16-byte cp.async (0 bytes for idx < 0: zero-fill). Warpgroup w's early part is the
    value columns only it reads (its own half of the output: [256 w, 256 w + 256)) and writes the block's additive
    mask; the late part is the other half and the rope columns (read by the other warpgroup's PV, and the rope
    buffer is the block's P tile). Each thread serves rows r and r + 32 (`pp_copy_plan`)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    i32, i64, i8, f32 = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                         ir.IntegerType.get_signless(8), ir.F32Type.get())
    idx_t = ir.IndexType.get()
    zero = arith.constant(i32, 0)
    thread = mu.thread_idx()
    w = arith.divui(thread, arith.constant(i32, WARPGROUP))
    half = gather_mgpu._I(arith.subi(arith.constant(i32, 1), w) if late else w)
    tid = gather_mgpu._I(arith.remui(thread, arith.constant(i32, WARPGROUP)))
    src_base = llvm.addrspacecast(llvm.PointerType.get(1), mu.memref_ptr(kv_gmem))

    def gep(base, dyn=None, const=0):  # base + a dynamic or a constant byte offset
        if dyn is not None:
            return llvm.getelementptr(base.type, base, [dyn], [-2147483648], i8, llvm.GEPNoWrapFlags.none)
        return llvm.getelementptr(base.type, base, [], [const], i8, llvm.GEPNoWrapFlags.none) if const else base

    for row0 in range(0, BK, KW):
        parts = [(half, nope_smem)] + ([(None, rope_smem)] if late else [])
        for part_half, dst_smem in parts:
            r, _, s0, d0, n = pp_copy_plan(tid, row0, part_half)
            r_ix = arith.index_cast(idx_t, r.v)
            row = memref.load(idx_gmem, [r_ix])
            valid = arith.cmpi(arith.CmpIPredicate.sge, row, zero)
            if not late:  # the row's mask entry (its PER_ROW threads write the same value)
                memref.store(arith.select(valid, arith.constant(f32, 0.0), arith.constant(f32, float("-inf"))),
                             mask_smem, [r_ix])
            size = arith.select(valid, arith.constant(i32, 16), zero)
            src = gep(src_base, arith.addi(
                arith.muli(arith.extui(i64, arith.select(valid, row, zero)), arith.constant(i64, DQK * 2)),
                arith.extui(i64, (s0 * 16).v)))
            dst = gep(mu.memref_ptr(dst_smem), (d0 * 16).v)
            for k in range(n):
                nvvm.cp_async_shared_global(gep(dst, const=k * COPY_STRIDE * 16), gep(src, const=k * PER_ROW * 16),
                                            16, nvvm.LoadCacheModifierKind.CG, cp_size=size)


def _issue_early(ctx, kv_gmem, idx_gmem, nope_smem, rope_smem, mask_smem):
    del ctx
    _issue_part(kv_gmem, idx_gmem, nope_smem, rope_smem, mask_smem, late=False)


def _issue_late(ctx, kv_gmem, idx_gmem, nope_smem, rope_smem, mask_smem):
    del ctx
    _issue_part(kv_gmem, idx_gmem, nope_smem, rope_smem, mask_smem, late=True)


def _wait_all(ctx):
    """This thread's copies have all landed; fenced for wgmma, the warpgroup synchronized (`_wait_one_pending`)."""
    from jax._src.lib.mlir.dialects import nvvm
    from jax.experimental.mosaic.gpu import utils as mu
    del ctx
    nvvm.cp_async_wait_group(0)
    mu.commit_shared()


class _ChipGatherPP:
    def __init__(self, tiles):
        plgpu = _plgpu()
        types = gather_arg_types(plgpu, tiles, tiles, ())
        self._early = plgpu.inline_mgpu(arg_types=types)(_issue_early)
        self._late = plgpu.inline_mgpu(arg_types=types)(_issue_late)
        self._commit = plgpu.inline_mgpu()(_commit)
        self._wait = {1: plgpu.inline_mgpu()(_wait_one_pending), 0: plgpu.inline_mgpu()(_wait_all)}

    def issue(self, w, late, kv_gmem, idx_blk_gmem, nope, rope, mask):
        del w  # the inline body reads its warpgroup from the thread index
        (self._late if late else self._early)(kv_gmem, idx_blk_gmem, nope, rope, mask)

    def commit(self):
        self._commit()

    def wait(self, pending):
        self._wait[pending]()


class _InterpretGatherPP:
    """The same contract as a Pallas-level row loop (synchronous copies)."""

    def issue(self, w, late, kv_gmem, idx_blk_gmem, nope, rope, mask):
        import jax.experimental.pallas as pl
        cols = pl.ds((1 - w if late else w) * HALF, HALF)

        def row(r, c):
            i = idx_blk_gmem[r]
            if not late:
                mask[r] = jnp.where(i >= 0, 0.0, -jnp.inf).astype(jnp.float32)
            src = pl.ds(jnp.maximum(i, 0), 1)
            v = kv_gmem[src, cols]
            nope[pl.ds(r, 1), cols] = jnp.where(i >= 0, v, jnp.zeros_like(v))
            if late:
                v = kv_gmem[src, pl.ds(DV, ROPE)]
                rope[pl.ds(r, 1), :] = jnp.where(i >= 0, v, jnp.zeros_like(v))
            return c
        jax.lax.fori_loop(0, BK, row, 0)

    def commit(self):
        pass

    def wait(self, pending):
        del pending
        _plgpu().commit_smem()


# ---- the kernel ------------------------------------------------------------------------------------------------

def _kernel(q_gmem, kv_gmem, idx_gmem, out_gmem, lse_gmem, qo, kv_smem, p_smem, stat_smem, bars,
            m_full, p_full, kv_free, *, scale, nblk, gather, in_place):
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    q3, o_smem = qo
    q_smem = q3.at[0]
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

            # q's tile through an index that is always 0 but loop-variant to LLVM (slot (slot - 1), slot in {0, 1}):
            # its 36 wgmma descriptors are then formed in the loop, not hoisted and held live (spilled) across it
            q_b = q3.at[slot * (slot - 1)]

            def qk(acc):
                plgpu.wgmma(acc, q_b, kv_w.transpose((1, 0)))
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
        _store_out(w, o, m, l, o_smem, stat_smem, m_full, out_gmem.at[t, heads], lse_gmem.at[t, heads])

    consumer(wg)


def _store_out(w, o, m, l, o_smem, stat_smem, m_full, out_rows, lse_rows):
    """The 64-head forms' epilogue, warpgroup w with its [64, 256] output columns o, the common row maxima m and its
    row-sum part l: the two parts added through stat_smem rows 2-3 (mbarrier m_full), O / l in bf16 through the
    output tile (over q's memory: the caller guarantees both warpgroups are past their last S), lse by warpgroup 0;
    both leave by TMA into out_rows [64, 512] / lse_rows [64]."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    row_layout = plgpu.Layout.WGMMA.reduce(1)
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
    plgpu.copy_smem_to_gmem(o_smem.at[w], out_rows.at[:, pl.ds(w * HALF, HALF)])

    @pl.when(w == 0)
    def _():
        plgpu.copy_smem_to_gmem(stat_smem.at[0], lse_rows)
    plgpu.wait_smem_to_gmem(0)


def _kernel_t(q_gmem, kv_gmem, idx_gmem, out_gmem, lse_gmem, qo, kv_smem, p_smem, mask_smem, stat_smem, bars, *,
              scale, nblk, gather, in_place):
    """The keys-as-M form for 32 heads per CTA (one warpgroup): S^T = K q^T [64 keys, 32 heads] on `wgmma m64n32k16`
    (A = the gathered key block, B = q^T: the operands of `_kernel`'s S with the roles swapped), the softmax over
    keys as column reductions (across the warpgroup's 4 warps, through the reduction scratch), P^T [64, 32] bf16 to
    shared memory, and O^T [512, 32] += V^T P^T as two [256, 32] accumulators (A = the key block's value columns read
    transposed from shared memory, B = P^T). Key blocks double-buffered: block b + 1's gather is issued before
    block b's S (its buffer held block b - 1, whose PV this warpgroup has finished). O^T is stored through a
    transposed view of O's [32, 256] tiles, which leave by TMA."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    q3, o_smem = qo
    g = jax.lax.axis_index("g")
    t = jax.lax.axis_index("t")
    heads = pl.ds(g * H_T, H_T)
    head_layout = plgpu.Layout.WGMMA.reduce(0)  # a vector over S^T's columns (heads)
    key_layout = plgpu.Layout.WGMMA.reduce(1)  # a vector over its rows (keys)
    idx_tok = idx_gmem.at[t]

    def idx_block(b):
        return idx_tok.at[pl.ds(b * BK, BK)]

    plgpu.copy_gmem_to_smem(q_gmem.at[t, heads], q3.at[0], bars.at[0])
    gather.issue(0, kv_gmem, idx_block(0), kv_smem.at[0], mask_smem.at[0])
    gather.commit()
    plgpu.barrier_wait(bars.at[0])

    def step(b, carry):
        o_lo, o_hi, m, l = carry
        slot = jax.lax.rem(b, 2)

        @pl.when(b + 1 < nblk)
        def _():
            gather.issue(0, kv_gmem, idx_block(b + 1), kv_smem.at[1 - slot], mask_smem.at[1 - slot])
        gather.commit()
        gather.wait()  # block b is in shared memory
        kv = kv_smem.at[slot]
        q_b = q3.at[slot * (slot - 1)]  # always 0, loop-variant: q's descriptors are formed in the loop (`_kernel`)

        def qk(acc):
            plgpu.wgmma(acc, kv, q_b.transpose((1, 0)))
            return acc[...]
        s = pl.run_scoped(qk, plgpu.ACC((BK, H_T), jnp.float32))
        mask = plgpu.load(mask_smem.at[slot], layout=key_layout)
        s2 = s * (scale * LOG2E) + jax.lax.broadcast_in_dim(mask, s.shape, [0])
        m_new = jnp.maximum(m, s2.max(axis=0))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s2 - jax.lax.broadcast_in_dim(base, s2.shape, [1]))
        alpha = jnp.exp2(m - base)
        l = l * alpha + p.sum(axis=0)
        p_smem[...] = p.astype(jnp.bfloat16)
        plgpu.commit_smem()
        o_lo = o_lo * jax.lax.broadcast_in_dim(alpha, o_lo.shape, [1])
        o_hi = o_hi * jax.lax.broadcast_in_dim(alpha, o_hi.shape, [1])
        outs = []
        for half, o in enumerate((o_lo, o_hi)):
            v_t = kv.at[:, pl.ds(half * HALF, HALF)].transpose((1, 0))  # [256 value columns, 64 keys]
            if in_place:
                def pv(acc, v_t=v_t):
                    plgpu.wgmma(acc, v_t, p_smem)
                outs.append(pl.run_state(pv)(plgpu.ACC.init(o)))
            else:
                def pv(acc, v_t=v_t):
                    plgpu.wgmma(acc, v_t, p_smem)
                    return acc[...]
                outs.append(o + pl.run_scoped(pv, plgpu.ACC((HALF, H_T), jnp.float32)))
        return outs[0], outs[1], m_new, l

    zero = plgpu.layout_cast(jnp.zeros((HALF, H_T), jnp.float32), plgpu.Layout.WGMMA)
    init = (zero, zero, plgpu.layout_cast(jnp.full((H_T,), -jnp.inf, jnp.float32), head_layout),
            plgpu.layout_cast(jnp.zeros((H_T,), jnp.float32), head_layout))
    o_lo, o_hi, m, l = jax.lax.fori_loop(0, nblk, step, init)

    safe = jnp.where(l > 0, l, 1.0)  # q's memory becomes the output tiles: q is dead after the last S
    for half, o in enumerate((o_lo, o_hi)):
        # O^T [256, 32] stored through a transposed view: the tile in shared memory is O's [32, 256]
        o_smem.at[half].transpose((1, 0))[...] = (o / jax.lax.broadcast_in_dim(safe, o.shape, [1])).astype(
            jnp.bfloat16)
    base = jnp.where(m == -jnp.inf, 0.0, m)
    stat_smem[...] = jnp.where(l > 0, (base + jnp.log2(safe)) / LOG2E, -jnp.inf)
    plgpu.commit_smem()
    for half in range(2):
        plgpu.copy_smem_to_gmem(o_smem.at[half], out_gmem.at[t, heads, pl.ds(half * HALF, HALF)])
    plgpu.copy_smem_to_gmem(stat_smem, lse_gmem.at[t, heads])
    plgpu.wait_smem_to_gmem(0)


def _kernel_pp(q_gmem, kv_gmem, idx_gmem, out_gmem, lse_gmem, qo, nope_smem, rope_p, mask_smem, stat_smem, bars,
               m_full, p_full, late_free, *, scale, nit, gather, in_place):
    """The ping-pong form (64 heads a CTA, two warpgroups): per step warpgroup w takes the whole key block 2 i + w,
    S_w = q kv_w^T on `wgmma m64n64k16` (N = the block's 64 keys), the two exchange row maxima, and each computes
    its 256 output columns from both blocks: O_w += P_w kv_w[:, cols_w] + P_o kv_o[:, cols_w] (o = 1 - w; N = 256).
    The rope buffer of block w is its P tile once S_w is done (q + two 64 x 512 value blocks + two 64 x 64 rope / P
    tiles: 221,184 B). Refills, in two cp.async groups a block: the early part (value columns cols_w, which only w
    reads) is issued as soon as w's own PV is done, during its PV of the other block; the late part (the other
    half and the rope / P tile) once the other warpgroup's PV of this block is done (mbarrier late_free[w]); the
    next S reads the early part first."""
    import jax.experimental.pallas as pl
    plgpu = _plgpu()
    q3, o_smem = qo
    g = jax.lax.axis_index("g")
    t = jax.lax.axis_index("t")
    w = jax.lax.axis_index("wg")
    o_ = 1 - w
    heads = pl.ds(g * H_BLK, H_BLK)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    idx_tok = idx_gmem.at[t]
    own, oth = pl.ds(w * HALF, HALF), pl.ds(o_ * HALF, HALF)

    def issue(b, late):
        gather.issue(w, late, kv_gmem, idx_tok.at[pl.ds(b * BK, BK)], nope_smem.at[w], rope_p.at[w],
                     mask_smem.at[w])
        gather.commit()

    @pl.when(w == 0)
    def _():
        plgpu.copy_gmem_to_smem(q_gmem.at[t, heads], q3.at[0], bars.at[0])
    issue(w, False)
    issue(w, True)
    plgpu.barrier_wait(bars.at[0])

    def step(i, carry):
        o, m, l = carry
        # every shared-memory operand through an index offset z that is always 0 but loop-variant (as q in
        # `_kernel`): the wgmma descriptors are formed in the loop, not hoisted and held live (spilled) across it
        par = jax.lax.rem(i, 2)
        z = par * (par - 1)
        q_b = q3.at[z]
        wz, oz = w + z, o_ + z
        kv = nope_smem.at[wz]

        def qk(acc):
            gather.wait(1)  # the early part: value columns cols_w
            plgpu.wgmma(acc, q_b.at[:, own], kv.at[:, own].transpose((1, 0)))
            gather.wait(0)  # the late part
            plgpu.wgmma(acc, q_b.at[:, oth], kv.at[:, oth].transpose((1, 0)))
            plgpu.wgmma(acc, q_b.at[:, pl.ds(DV, ROPE)], rope_p.at[wz].transpose((1, 0)))
            return acc[...]
        s = pl.run_scoped(qk, plgpu.ACC((H_BLK, BK), jnp.float32))
        mask = plgpu.load(mask_smem.at[w], layout=plgpu.Layout.WGMMA.reduce(0))
        s2 = s * (scale * LOG2E) + jax.lax.broadcast_in_dim(mask, s.shape, [1])
        stat_smem.at[w][...] = s2.max(axis=1)
        plgpu.barrier_arrive(m_full)
        plgpu.barrier_wait(m_full)
        m_new = jnp.maximum(m, jnp.maximum(plgpu.load(stat_smem.at[w], layout=row_layout),
                                           plgpu.load(stat_smem.at[o_], layout=row_layout)))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s2 - jax.lax.broadcast_in_dim(base, s2.shape, [0]))
        alpha = jnp.exp2(m - base)
        l = l * alpha + p.sum(axis=1)
        rope_p.at[w][...] = p.astype(jnp.bfloat16)  # S_w is done: block w's rope buffer becomes its P tile
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_full)
        plgpu.barrier_wait(p_full)  # both P tiles are in shared memory (and both S are done)
        o = o * jax.lax.broadcast_in_dim(alpha, o.shape, [0])

        def pv(o, blk):
            if in_place:
                def body(acc):
                    plgpu.wgmma(acc, rope_p.at[blk], nope_smem.at[blk, :, own])
                return pl.run_state(body)(plgpu.ACC.init(o))

            def body(acc):
                plgpu.wgmma(acc, rope_p.at[blk], nope_smem.at[blk, :, own])
                return acc[...]
            return o + pl.run_scoped(body, plgpu.ACC((H_BLK, HALF), jnp.float32))

        o = pv(o, wz)  # this block's columns cols_w are now free: refill them

        @pl.when(i + 1 < nit)
        def _():
            issue(2 * (i + 1) + w, False)
        o = pv(o, oz)
        plgpu.barrier_arrive(late_free.at[o_])  # done with the other block's late part and its P tile
        plgpu.barrier_wait(late_free.at[w])

        @pl.when(i + 1 < nit)
        def _():
            issue(2 * (i + 1) + w, True)
        return o, m_new, l

    zero = plgpu.layout_cast(jnp.zeros((H_BLK, HALF), jnp.float32), plgpu.Layout.WGMMA)
    init = (zero, plgpu.layout_cast(jnp.full((H_BLK,), -jnp.inf, jnp.float32), row_layout),
            plgpu.layout_cast(jnp.zeros((H_BLK,), jnp.float32), row_layout))
    o, m, l = jax.lax.fori_loop(0, nit, step, init)

    # both warpgroups are past their last S (p_full): q's memory becomes the output tile
    _store_out(w, o, m, l, o_smem, stat_smem, m_full, out_gmem.at[t, heads], lse_gmem.at[t, heads])


def _q_out_union(plgpu, rows: int, q_tiles, out_tiles):
    """Shared memory for q [rows, 576], then (after the last S) the output's two [rows, 256] tiles."""
    SM = plgpu.SMEM
    return plgpu.RefUnion(SM((1, rows, DQK), jnp.bfloat16, transforms=q_tiles),
                          SM((2, rows, HALF), jnp.bfloat16, transforms=out_tiles))


def _launch(body, scratch, q, kv, idx, *, rows: int, name: str, warpgroups: int, reduction_bytes: int,
            interpret: bool):
    """One CTA per (token, `rows` heads) running `body` on `warpgroups` warpgroups: (out [N, H, 512] bf16,
    lse [N, H] f32)."""
    plgpu = _plgpu()
    n, h, _ = q.shape
    out_type = (jax.ShapeDtypeStruct((n, h, DV), jnp.bfloat16), jax.ShapeDtypeStruct((n, h), jnp.float32))
    threads = dict(num_threads=warpgroups, thread_name="wg") if warpgroups > 1 else {}
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(n, h // rows), grid_names=("t", "g"),
                        kernel_name=name, **threads,
                        interpret=mosaic_gpu_interpret_params(name, warpgroups, _DETECT_RACES) if interpret else None,
                        compiler_params=plgpu.CompilerParams(approx_math=True,
                                                             reduction_scratch_bytes=reduction_bytes))(q, kv, idx)


def _fwd_pp(q, kv, idx, *, scale: float, interpret: bool):
    """`_kernel_pp` over q [N, 64 g, 576] (key blocks padded with -1 to an even count)."""
    plgpu = _plgpu()
    if (idx.shape[1] // BK) % 2:
        idx = jnp.pad(idx, ((0, 0), (0, BK)), constant_values=-1)
    tiles = (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(SWIZZLE))
    o_tiles = (plgpu.TilingTransform(gather_mgpu.TILE), plgpu.SwizzleTransform(gather_mgpu.SWIZZLE))
    SM = plgpu.SMEM
    scratch = [
        _q_out_union(plgpu, H_BLK, tiles, o_tiles),
        SM((2, BK, DV), jnp.bfloat16, transforms=tiles),  # the two blocks' value (nope) columns
        SM((2, BK, ROPE), jnp.bfloat16, transforms=tiles),  # their rope columns, then their P tiles [64, 64]
        SM((2, BK), jnp.float32),  # the blocks' additive key masks
        SM((4, H_BLK), jnp.float32),  # rows 0-1: the blocks' row maxima (then lse), 2-3: row sums
        plgpu.Barrier(num_barriers=1),  # q
        plgpu.Barrier(num_arrivals=2),  # m_full
        plgpu.Barrier(num_arrivals=2),  # p_full
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # late_free[w]: the other warpgroup is done with block w
    ]
    gather = _InterpretGatherPP() if interpret else _ChipGatherPP(tiles)
    body = functools.partial(_kernel_pp, scale=float(scale), nit=idx.shape[1] // (2 * BK), gather=gather,
                             in_place=not interpret)
    return _launch(body, scratch, q, kv, idx, rows=H_BLK, name="sparse_mla_fwd_mgpu_pp", warpgroups=2,
                   reduction_bytes=0, interpret=interpret)


def _fwd_t(q, kv, idx, *, scale: float, interpret: bool):
    """`_kernel_t` over q [N, 32 g, 576]: (out [N, H, 512] bf16, lse [N, H] f32)."""
    plgpu = _plgpu()
    tiles = (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(SWIZZLE))
    SM = plgpu.SMEM
    scratch = [
        _q_out_union(plgpu, H_T, tiles, tiles),  # q, then O's two [32, 256] tiles
        SM((2, BK, DQK), jnp.bfloat16, transforms=tiles),  # key blocks, double-buffered
        SM((BK, H_T), jnp.bfloat16, transforms=tiles),  # P^T
        SM((2, BK), jnp.float32),  # the key blocks' additive masks
        SM((H_T,), jnp.float32),  # lse
        plgpu.Barrier(num_barriers=1),  # q
    ]
    gather = _InterpretGather(full_block=True) if interpret else _ChipGather(tiles, full_block=True)
    body = functools.partial(_kernel_t, scale=float(scale), nblk=idx.shape[1] // BK, gather=gather,
                             in_place=not interpret)
    return _launch(body, scratch, q, kv, idx, rows=H_T, name="sparse_mla_fwd_mgpu_h32", warpgroups=1,
                   reduction_bytes=REDUCTION_SCRATCH, interpret=interpret)


def sparse_mla_fwd(q, kv, idx, *, scale: float, interpret: bool = False, form: str = "split"):
    """q [N, H, 576] bf16, kv [M, 576] bf16, idx [N, K] int32 (global rows, -1 invalid) -> (out [N, H, 512] bf16,
    lse [N, H] f32). See the module docstring. form (H a multiple of 64): "split" (`_kernel`: the warpgroups split
    each key block, S on N = 32, key blocks double-buffered) or "pingpong" (`_kernel_pp`: a block each, S on
    N = 64, refilled in two parts)."""
    if form not in FORMS:
        raise ValueError(f"sparse_mla_mgpu.sparse_mla_fwd: form={form!r} must be one of {FORMS}")
    why = check_shapes(q, kv, idx)
    if why is not None:
        raise ValueError(f"sparse_mla_mgpu.sparse_mla_fwd: q {q.shape} {q.dtype}, kv {kv.shape} {kv.dtype}, "
                         f"idx {idx.shape} {idx.dtype}: {why}")
    h = q.shape[1]
    if h == H_T:
        return _fwd_t(q, kv, idx, scale=scale, interpret=interpret)
    if form == "pingpong":
        return _fwd_pp(q, kv, idx, scale=scale, interpret=interpret)
    plgpu = _plgpu()
    nblk = idx.shape[1] // BK
    tiles = (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(SWIZZLE))
    o_tiles = (plgpu.TilingTransform(gather_mgpu.TILE), plgpu.SwizzleTransform(gather_mgpu.SWIZZLE))
    SM = plgpu.SMEM
    scratch = [
        _q_out_union(plgpu, H_BLK, tiles, o_tiles),
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
    return _launch(body, scratch, q, kv, idx, rows=H_BLK, name="sparse_mla_fwd_mgpu", warpgroups=2,
                   reduction_bytes=0, interpret=interpret)


def sparse_mla_fwd_reference(q, kv, idx, *, scale: float):
    """The plain-JAX contract (float32 math): `attention.sparse_mla` on one flattened batch."""
    from dsv32_jax.model import attention
    out, lse = attention.sparse_mla(q[None], kv[None], idx[None], scale, DV)
    return out[0], lse[0]
