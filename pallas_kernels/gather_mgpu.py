"""The gathering producer of a Hopper sparse MLA forward (issue 31, item 2), as a building block: selected key rows
copied by index from global memory into the tiled, 128-byte-swizzled shared-memory layout that `plgpu.wgmma` reads,
with per-thread 16-byte `cp.async`, then one QK^T block on wgmma (N = 64 keys).

Why below Pallas: Mosaic GPU (jax 0.12) refuses a one-row register copy and a one-row TMA into a buffer tiled
(8, 64) (the slice must cover whole 8-row tiles), and its TMA gather is Blackwell-only. So the copies are emitted in
`plgpu.inline_mgpu` (lane semantics: each of the 128 threads of a warpgroup issues rows * D / 8 / 128 copies,
consecutive threads on consecutive 16-byte chunks of a row, so the global reads coalesce), followed by
`cp.async.wait_group 0` and `fence.proxy.async.shared::cta` (cp.async writes through the generic proxy, wgmma reads
through the async proxy) and a barrier among the copying threads.

Layout of a [R, D] bf16 shared-memory ref with transforms (TilingTransform((8, 64)), SwizzleTransform(128)): the
tiling makes it [R / 8, D / 64, 8, 64] row-major (tile (rt, ct) of 8 rows x 128 bytes at tile index rt * D / 64 + ct;
jax/_src/pallas/mosaic_gpu/core.py, TilingTransform.transform_type), and the 128-byte swizzle XORs the 16-byte
chunk index within a 128-byte line with the line index mod 8 (jax/experimental/mosaic/gpu/fragmented_array.py, the
swizzled transfers; the same as the TMA's 128-byte swizzle on a 1 KiB-aligned base: address bits [4, 7) ^= bits
[7, 10)). `chunk_position` is that map; the kernel and the CPU test run the same function.

Two forms: `gather_qk` (one warpgroup gathers, fences, then issues the wgmma) and `gather_qk_ws` (warp-specialized:
warpgroup 0 gathers and arrives on an mbarrier, warpgroup 1 loads q by TMA, waits, runs the wgmma: the producer /
consumer split of FlashMLA's sparse prefill). Invalid slots (index < 0) copy 0 bytes with a 16-byte destination, which
zero-fills the row. Indices >= N are not checked (as in the other kernels, the selection's contract).

Status: compiled for sm_90a without a GPU (tools/gpu_compile: `cp.async.cg.shared.global` x36, `wgmma m64n64k16`
x36, LDGSTS.E.BYPASS.128 and HGMMA.64x64x16 in the SASS, 58 registers, no spills); not yet run on a chip (the check
is `tests/test_kernels.py::test_gather_producer_on_chip`, owed by `bench/gpu_owed.sh 0`). Mosaic GPU's interpret mode
cannot run `inline_mgpu`; `gather_qk_reference` is the plain-JAX contract.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

TILE = (8, 64)  # rows x bf16 columns of one swizzle tile: 8 lines of 128 bytes
SWIZZLE = 128
CHUNK = 8  # bf16 per 16-byte copy
WARPGROUP = 128


def read_only_ref(plgpu):
    """`plgpu.RefType` of an `inline_mgpu` ref argument the inline body only reads (a gather's kv rows and indices).
    jax 0.12.1 counts every inline_mgpu ref argument as written unless `RefType(write=False)`, and refuses a kernel
    that writes one of its inputs ("writes to input refs[1] ... which was passed as an array"); jax 0.11.2's RefType
    has no `write` field and tracks no writes."""
    try:
        return plgpu.RefType(write=False)
    except TypeError:
        return plgpu.RefType()


def gather_arg_types(plgpu, *dst_transforms):
    """arg_types of a gather's inline body (kv, idx, *destinations): the two sources read only, the destinations
    (shared memory buffers with `dst_transforms[i]`, () for an untiled one) written."""
    return (read_only_ref(plgpu), read_only_ref(plgpu), *(plgpu.RefType(t) for t in dst_transforms))


def chunk_position(r, j, col_tiles, swizzle=SWIZZLE):
    """The 16-byte chunk (from the buffer's base) holding logical row r, columns [8 j, 8 j + 8) of a [R, W *
    col_tiles] bf16 buffer tiled (8, W) and swizzled by `swizzle` bytes, W = swizzle / 2 (one swizzle line per tile
    row: 128 -> (8, 64) tiles, 64 -> (8, 32)). The swizzle XORs the chunk index within a line with the line's index
    bits above the chunk bits (128: line & 7; 64: (line >> 1) & 3; the TMA's swizzle on an aligned base). Works on
    Python ints and on `_I` (MLIR i32)."""
    per_line = swizzle // 16  # chunks per line: 8 or 4
    shift = {8: 0, 4: 1}[per_line]
    line = ((r >> 3) * col_tiles + (j >> (3 - shift))) * 8 + (r & 7)
    return line * per_line + ((j & (per_line - 1)) ^ ((r & 7) >> shift))


def gather_qk_reference(q, kv, idx):
    """q [H, D], kv [N, D], idx [K] int32 -> [H, K] float32 = q @ kv[idx]^T, slots with idx < 0 zero."""
    rows = jnp.where((idx >= 0)[:, None], kv[jnp.clip(idx, 0)], 0).astype(jnp.float32)
    return q.astype(jnp.float32) @ rows.T


class _I:
    """An MLIR i32 value with the integer operators `chunk_position` uses (so the kernel runs the tested formula)."""

    def __init__(self, v):
        self.v = v

    @staticmethod
    def _c(x):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith
        return x.v if isinstance(x, _I) else arith.constant(ir.IntegerType.get_signless(32), x)

    def _op(self, other, name, reverse=False):
        from jax._src.lib.mlir.dialects import arith
        a, b = self._c(self), self._c(other)
        return _I(getattr(arith, name)(*((b, a) if reverse else (a, b))))

    def __add__(self, o): return self._op(o, "addi")
    def __radd__(self, o): return self._op(o, "addi", True)
    def __mul__(self, o): return self._op(o, "muli")
    def __rmul__(self, o): return self._op(o, "muli", True)
    def __rshift__(self, o): return self._op(o, "shrui")
    def __floordiv__(self, o): return self._op(o, "divui")
    def __mod__(self, o): return self._op(o, "remui")
    def __and__(self, o): return self._op(o, "andi")
    def __xor__(self, o): return self._op(o, "xori")


def _gather_rows(ctx, kv_gmem, idx_ref, dst_smem, *, rows: int, d: int, sync_warpgroup: bool):
    """inline_mgpu body: dst (logical [rows, d], tiled + swizzled) row r <- kv[idx[r]], zeros where idx[r] < 0."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    del ctx
    i32, i64, i8 = (ir.IntegerType.get_signless(n) for n in (32, 64, 8))
    chunks_per_row, col_tiles = d // CHUNK, d // TILE[1]
    tid = _I(arith.remui(mu.thread_idx(), arith.constant(i32, WARPGROUP)))
    dst_base = mu.memref_ptr(dst_smem)
    src_base = llvm.addrspacecast(llvm.PointerType.get(1), mu.memref_ptr(kv_gmem))
    zero = arith.constant(i32, 0)
    for it in range(rows * chunks_per_row // WARPGROUP):
        flat = tid + it * WARPGROUP
        r = _I(arith.divui(flat.v, _I._c(chunks_per_row)))
        j = _I(arith.remui(flat.v, _I._c(chunks_per_row)))
        dst = llvm.getelementptr(dst_base.type, dst_base, [(chunk_position(r, j, col_tiles) * 16).v],
                                 [-2147483648], i8, llvm.GEPNoWrapFlags.none)
        row = memref.load(idx_ref, [arith.index_cast(ir.IndexType.get(), r.v)])
        valid = arith.cmpi(arith.CmpIPredicate.sge, row, zero)
        elem = arith.addi(arith.muli(arith.extui(i64, arith.select(valid, row, zero)), arith.constant(i64, d)),
                          arith.extui(i64, (j * CHUNK).v))
        src = llvm.getelementptr(src_base.type, src_base, [arith.muli(elem, arith.constant(i64, 2))],
                                 [-2147483648], i8, llvm.GEPNoWrapFlags.none)
        nvvm.cp_async_shared_global(dst, src, 16, nvvm.LoadCacheModifierKind.CG,
                                    cp_size=arith.select(valid, arith.constant(i32, 16), zero))
    nvvm.cp_async_commit_group()
    nvvm.cp_async_wait_group(0)
    if sync_warpgroup:  # fence.proxy.async.shared::cta + this warpgroup's barrier
        mu.commit_shared()
    else:  # each thread fences its own copies; the caller arrives on an mbarrier the consumer waits on
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)


def _check(q, kv, idx):
    h, d = q.shape
    if h != 64 or idx.shape != (64,) or d % TILE[1] or kv.ndim != 2 or kv.shape[1] != d:
        raise ValueError(f"gather_qk: q [64, D], kv [N, D], idx [64] with D a multiple of 64; got q {q.shape}, "
                         f"kv {kv.shape}, idx {idx.shape}")
    if q.dtype != jnp.bfloat16 or kv.dtype != jnp.bfloat16 or idx.dtype != jnp.int32:
        raise ValueError(f"gather_qk: bf16 q / kv and int32 idx; got {q.dtype}, {kv.dtype}, {idx.dtype}")
    return h, d


def _scratch(h, d, bk, plgpu):
    tiles = (plgpu.TilingTransform(TILE), plgpu.SwizzleTransform(SWIZZLE))
    return tiles, [plgpu.SMEM((h, d), jnp.bfloat16, transforms=tiles),
                   plgpu.SMEM((bk, d), jnp.bfloat16, transforms=tiles),
                   plgpu.SMEM((h, bk), jnp.float32), plgpu.SMEM((bk,), jnp.int32), plgpu.Barrier(num_barriers=2)]


def _qk_and_store(q_smem, kv_smem, o_smem, o_gmem):
    """o = q kv^T on wgmma ([64, 64] f32 accumulator, N = 64 keys), through shared memory to o_gmem by TMA."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, kv_smem.transpose((1, 0)))
        return acc_ref[...]

    o_smem[...] = pl.run_scoped(compute, plgpu.ACC(o_smem.shape, jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)


def gather_qk(q, kv, idx):
    """q [64, D] bf16, kv [N, D] bf16, idx [64] int32 -> [64, 64] float32 = q @ kv[idx]^T (slots < 0: zero), one
    warpgroup: indices by TMA into shared memory, the gather, then the wgmma."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    h, d = _check(q, kv, idx)
    bk = idx.shape[0]
    tiles, scratch = _scratch(h, d, bk, plgpu)
    gather = plgpu.inline_mgpu(arg_types=gather_arg_types(plgpu, tiles))(
        functools.partial(_gather_rows, rows=bk, d=d, sync_warpgroup=True))

    def body(q_gmem, kv_gmem, idx_gmem, o_gmem, q_smem, kv_smem, o_smem, idx_smem, bars):
        plgpu.copy_gmem_to_smem(q_gmem, q_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(idx_gmem, idx_smem, bars.at[1])
        plgpu.barrier_wait(bars.at[1])
        gather(kv_gmem, idx_smem, kv_smem)
        plgpu.barrier_wait(bars.at[0])
        _qk_and_store(q_smem, kv_smem, o_smem, o_gmem)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((h, bk), jnp.float32), scratch_types=scratch,
                        compiler_params=plgpu.CompilerParams())(q, kv, idx)


def gather_qk_ws(q, kv, idx):
    """`gather_qk` warp-specialized: warpgroup 0 (the producer) gathers, fences and arrives (128 arrivals) on an
    mbarrier; warpgroup 1 (the consumer) loads q by TMA, waits on it, and runs the wgmma and the store."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    h, d = _check(q, kv, idx)
    bk = idx.shape[0]
    tiles, scratch = _scratch(h, d, bk, plgpu)
    gather = plgpu.inline_mgpu(arg_types=gather_arg_types(plgpu, tiles))(
        functools.partial(_gather_rows, rows=bk, d=d, sync_warpgroup=False))

    def body(q_gmem, kv_gmem, idx_gmem, o_gmem, q_smem, kv_smem, o_smem, idx_smem, bars, kv_ready):
        wg = jax.lax.axis_index("wg")

        @pl.when(wg == 0)
        def _producer():
            plgpu.copy_gmem_to_smem(idx_gmem, idx_smem, bars.at[1])
            plgpu.barrier_wait(bars.at[1])
            gather(kv_gmem, idx_smem, kv_smem)
            plgpu.barrier_arrive(kv_ready)

        @pl.when(wg == 1)
        def _consumer():
            plgpu.copy_gmem_to_smem(q_gmem, q_smem, bars.at[0])
            plgpu.barrier_wait(bars.at[0])
            plgpu.barrier_wait(kv_ready)
            _qk_and_store(q_smem, kv_smem, o_smem, o_gmem)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((h, bk), jnp.float32),
                        scratch_types=scratch + [plgpu.Barrier()], num_threads=2, thread_name="wg",
                        compiler_params=plgpu.CompilerParams())(q, kv, idx)
