"""Gathered sparse MLA for TPU (Pallas Mosaic TPU): forward, fused backward and the head-summed probabilities.

Called by `kernels.sparse_mla` (which owns the semantics, the custom VJP, the flattened-token layout with
global indices and the chunking of the backward); this module holds the TPU kernels, the row layout they gather
and the dkv reduction of their partial rows. Input layout from the wrapper: qf [N, Hp, Dp], kvf [NS, Dp] with
Dp = dv_p + dt_p (value dims first, zero-padded; see `layout`), idx [N, 1, Kp] int32 global rows (-1 = invalid,
so are rows >= NS), Hp a multiple of 8.

The gathered rows are 32-bit words (why: Mosaic tiles a bf16 array as (8, 128)(2, 1), two rows interleaved per
32-bit word, so a DMA of ONE bf16 row -- `buf.at[slot, pl.ds(r, 1)]` -- is an unaligned slice of a tile and does
not compile: "Offsets along tiled dimensions must be aligned to tiles" on v5p and v6e; a row of 32-bit words is
one sublane of (8, 128) tiles and compiles). The row's columns are split into P "planes" of W columns:
  * bf16 kv (production): P = 2. Plane 0 holds the first half of the value dims and the first half of the rope
    dims, plane 1 the second halves: plane p = [v[p*dv_p/2 : (p+1)*dv_p/2], t[p*dt_p/2 : (p+1)*dt_p/2]], so
    W = dv_p/2 + dt_p/2 (dv_p a multiple of 256 so that each plane's value part is whole 128-lane vregs, dt_p
    even). The wrapper packs word w of a row as plane0[w] | plane1[w] << 16 (one XLA pass over the cache,
    NS * Dqk * 2 bytes); the kernel DMAs rows of W int32 words into an int32 VMEM buffer and unpacks them in
    VMEM by a shift (plane 0) or a mask (plane 1) that puts the bf16 in the high half of an f32 word, a bitcast
    and an f32 -> bf16 convert (exact). q, dO and the
    outputs use the same plane order ([.., P, Hp, W] blocks; planes concatenated = the value dims in order),
    so S = sum_p q_p k_p^T and O_p = P V_p need no permutation inside the kernel; dq and dkv are
    re-interleaved by the wrapper (after the segment sum: [NS, Dp], not per partial row).
  * 32-bit kv (float32): P = 1, W = Dp, the rows as they are. Other 16-bit dtypes (float16) run on a float32
    copy of q and kv (2x the gather bytes; exact, the MXU then works in f32).
Cost per selected row (production, Dqk = 576 = 512 + 64): ONE DMA of W = 288 words = 1,152 B (the Dqk * 2 bytes of
the row, nothing padded; before: one 1,280 B bf16 DMA that did not compile; an f32 copy of kv would move 2,304 B;
aligned 16-row groups 16x the bytes). XLA stores the packed copy in (8, 128) tiles, so a row's 288 words lie in
three 128-lane tile rows (the last holds 32 valid lanes: the HBM copy is 1.33x the cache's bytes); whether the DMA
engine then moves 1,152 B or the 1,536 B of the three tile rows is not visible in a compile. The unpack is a shift
or a mask and an f32 -> bf16 convert per half-word on a [BI, W] block, against the block's [Hp, Dqk] x [Dqk, BI] and
[Hp, BI] x [BI, d_v] MXU work. Other layouts that were tried: a bf16 row as a [1, Dp] tile of a [NS, 1, Dp] array
also compiles, but XLA then copies kv into a 2-row-padded tiled layout (T(2,128)(2,1)) for the kernel and the VMEM
buffer pads each row the same way.

Compiled without a TPU (`make test-tpu-compile` / `tools/tpu_compile`, libtpu 0.0.50.1; never run on a TPU):
forward, probs and backward compile for v5p and v6e at the production shapes (H 128, Dqk 576, k 2048, S 8K and
32K, 4096 queries) and the tiny ones. Scoped VMEM per kernel at production: forward 1.6 MiB, probs 0.9 MiB,
backward 2.0 MiB (of 64 MiB on v5p). Vector-register spills (stores / loads in the final bundles): forward 17 / 17
on v5p, 1 / 1 on v6e; backward 63 / 67 on v5p, 16 / 16 on v6e (its [Hp, BI] f32 P, dP, dS live together with
the planes of K; not reduced yet).

Design (TPU has no gather from HBM into the MXU's operands, so rows are fetched by DMA):
  * grid (token, slot block): the token axis is "parallel" (megacore split), the slot-block axis "arbitrary"
    (an online-softmax / dq reduction). q [P, Hp, W] and dO stay in VMEM for all slot blocks of a token (their
    block index does not change, so the pipeline fetches them once per token).
  * the token's slot indices arrive twice: all of them per token in SMEM (scalars, the DMA row addresses, also
    those of the next block) and per slot block in VMEM (a vector, the block's validity mask).
  * rows are gathered one DMA per selected row (kv[row] -> buf[slot, r]) into a double buffer: block j + 1 is in
    flight while block j is computed; invalid slots issue no DMA, and a block with no valid slot (the tail of an
    early query's -1 slots in a causal prefill) skips its MXU work. The buffer is zeroed when a token starts, so
    an invalid slot reads finite data (P is 0 there; 0 * NaN from uninitialised VMEM would poison P V).
  * forward: S = q K^T [Hp, BI] on the MXU (f32 accumulation), online softmax in f32 scratch, O += P V with P in
    the value dtype; out and lse (natural log) written at the last slot block.
  * backward (one fused kernel; VMEM is large enough that the GPU's split into dq and dkv programs, made for
    register pressure, is unnecessary): per (token, slot block) P is recomputed from lse, dP = dO V^T,
    dS = P (dP - Delta); dq += dS K accumulates in scratch, and the block's dkv partial rows
    scale dS^T q + P^T dO [BI, Dp] are written once each (no atomics), then reduced by `reduce_partials` (a
    sort-free segment sum). S and dP are computed once per pair (2752 MMA FLOP per pair-head, not the GPU
    path's 3264).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsv32_jax.kernels._dispatch import round_up, tpu_interpret_params

HI_MASK = -65536  # 0xFFFF0000 as int32: the high bf16 of a packed word, in place as an f32


@dataclasses.dataclass(frozen=True)
class Layout:
    planes: int  # P: 2 = bf16 column pairs packed into int32 words, 1 = 32-bit rows as they are
    width: int  # W: words per gathered row = columns per plane
    v_width: int  # value columns per plane (a multiple of 128)
    dtype: object  # the compute dtype of the gathered rows (bf16 or f32)


def padded_dims(d_v: int, d_tail: int, kv_dtype) -> tuple[int, int]:
    """(dv_p, dt_p) of the TPU path: the value dims padded so that each plane's value part is whole 128-lane
    vregs; the rope dims padded to a multiple of the plane count (nothing else: they are part of W only)."""
    p = 2 if jnp.dtype(kv_dtype) == jnp.bfloat16 else 1
    return round_up(d_v, 128 * p), round_up(d_tail, p)


def layout(cfg, kv_dtype) -> Layout:
    p = 2 if jnp.dtype(kv_dtype) == jnp.bfloat16 else 1
    assert cfg.dv_p % (128 * p) == 0 and cfg.dt_p % p == 0, (cfg.dv_p, cfg.dt_p, p)
    dtype = jnp.bfloat16 if p == 2 else jnp.float32
    return Layout(planes=p, width=(cfg.dv_p + cfg.dt_p) // p, v_width=cfg.dv_p // p, dtype=dtype)


def _as_supported(*xs):
    """bf16 and 32-bit floats as they are; other dtypes (float16) as float32 (the kernels gather 32-bit words)."""
    return [x if x.dtype in (jnp.bfloat16, jnp.float32) else x.astype(jnp.float32) for x in xs]


def to_planes(x, cfg, lay: Layout):
    """[..., dv_p + dt_p] -> [..., P, W]: plane p = (value part p, rope part p)."""
    p = lay.planes
    v = x[..., :cfg.dv_p].reshape(*x.shape[:-1], p, cfg.dv_p // p)
    t = x[..., cfg.dv_p:].reshape(*x.shape[:-1], p, cfg.dt_p // p)
    return jnp.concatenate([v, t], axis=-1)


def from_planes(x, cfg, lay: Layout):
    """[..., P, W] -> [..., dv_p + dt_p] (the inverse of `to_planes`)."""
    lead = x.shape[:-2]
    v = x[..., :lay.v_width].reshape(*lead, cfg.dv_p)
    t = x[..., lay.v_width:].reshape(*lead, cfg.dt_p)
    return jnp.concatenate([v, t], axis=-1)


def pack_rows(kvf, cfg, lay: Layout):
    """kv [NS, Dp] -> the gathered rows [NS, W] of 32-bit words (bf16: plane 0 in the low halves)."""
    if lay.planes == 1:
        return kvf
    bits = jax.lax.bitcast_convert_type(to_planes(kvf, cfg, lay), jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(bits[:, 0] | (bits[:, 1] << 16), jnp.int32)


def _unpack(words, lay: Layout):
    """A block of gathered rows [BI, W] -> its P planes [BI, W] in the compute dtype."""
    if lay.planes == 1:
        return [words]
    lo = jax.lax.bitcast_convert_type(jax.lax.shift_left(words, 16), jnp.float32)
    hi = jax.lax.bitcast_convert_type(words & HI_MASK, jnp.float32)
    return [lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)]


def _q_planes(x, cfg, lay: Layout):
    """[N, Hp, Dp] -> [N, P, Hp, W]."""
    return jnp.swapaxes(to_planes(x, cfg, lay), 1, 2)


def _v_planes(x, lay: Layout):
    """[N, Hp, dv_p] (value columns) -> [N, P, Hp, v_width]."""
    n, hp, _ = x.shape
    return jnp.swapaxes(x.reshape(n, hp, lay.planes, lay.v_width), 1, 2)


# ------------------------------------------------------------------------------------------ the pipeline
def _call(cfg, kernel, **kwargs):
    interpret = tpu_interpret_params() if cfg.backend == "interpret_tpu" else False
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, **kwargs)


def _block_copies(idx_smem, kv_hbm, buf, sem, j, cfg, action: str):
    """Starts (action "start") or waits for ("wait") the row copies of slot block j into buffer slot j % 2, one
    per valid slot (kv[row] -> buf[j % 2, r], W 32-bit words); returns how many of the block's slots are valid."""
    slot = j % 2

    def body(r, n_valid):
        row = idx_smem[0, j * cfg.block_i + r]
        ok = (row >= 0) & (row < cfg.num_keys)

        @pl.when(ok)
        def _():
            copy = pltpu.make_async_copy(kv_hbm.at[pl.ds(row, 1)], buf.at[slot, pl.ds(r, 1)], sem.at[slot])
            getattr(copy, action)()
        return n_valid + ok.astype(jnp.int32)

    return jax.lax.fori_loop(0, cfg.block_i, body, jnp.int32(0))


def _pipeline(idx_smem, kv_hbm, buf, sem, cfg):
    """Double-buffered gather: returns (the buffer slot holding the current block's rows, its valid slots)."""
    j, nb = pl.program_id(1), pl.num_programs(1)

    @pl.when(j == 0)
    def _():
        buf[...] = jnp.zeros(buf.shape, buf.dtype)
        _block_copies(idx_smem, kv_hbm, buf, sem, j, cfg, "start")

    @pl.when(j + 1 < nb)
    def _():
        _block_copies(idx_smem, kv_hbm, buf, sem, j + 1, cfg, "start")

    n_valid = _block_copies(idx_smem, kv_hbm, buf, sem, j, cfg, "wait")
    return j % 2, n_valid


def _valid(idx_vmem, cfg):
    ids = idx_vmem[...]  # [1, BI]: the current slot block's indices
    return (ids >= 0) & (ids < cfg.num_keys)


def _nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _logits(q_ref, k, cfg):
    """scale * q K^T [Hp, BI] summed over the planes."""
    s = _nt(q_ref[0], k[0])
    for p in range(1, len(k)):
        s = s + _nt(q_ref[p], k[p])
    return s * cfg.scale


def _probs(q_ref, k, valid, lse, cfg):
    """P [Hp, BI] from the final lse [Hp, 1] (0 on invalid slots and empty rows)."""
    s = _logits(q_ref, k, cfg)
    ok = valid & (lse > -jnp.inf)
    return jnp.where(ok, jnp.exp(s - jnp.where(ok, lse, 0.0)), 0.0)


def _gather_scratch(rows, cfg):
    return [pltpu.VMEM((2, cfg.block_i, rows.shape[1]), rows.dtype), pltpu.SemaphoreType.DMA((2,))]


def _specs(idx, lay: Layout, hp, bi):
    kp = idx.shape[2]
    return [pl.BlockSpec((None, 1, kp), lambda t, j: (t, 0, 0), memory_space=pltpu.SMEM),
            pl.BlockSpec((None, 1, bi), lambda t, j: (t, 0, j)),
            pl.BlockSpec((None, lay.planes, hp, lay.width), lambda t, j: (t, 0, 0, 0)),
            pl.BlockSpec(memory_space=pltpu.HBM)]


def _per_token(hp):
    """BlockSpec factory: a token's [Hp, width] block, the same for all its slot blocks."""
    return lambda width: pl.BlockSpec((None, hp, width), lambda t, j: (t, 0, 0))


def _per_token_planes(lay: Layout, hp):
    """BlockSpec factory: a token's [P, Hp, width] block, the same for all its slot blocks."""
    return lambda width: pl.BlockSpec((None, lay.planes, hp, width), lambda t, j: (t, 0, 0, 0))


# ----------------------------------------------------------------------------------------------- forward
def _fwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, o_ref, lse_ref, buf, sem, acc, m_sc, l_sc, *, cfg, lay):
    j, nb = pl.program_id(1), pl.num_programs(1)

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, acc.dtype)
        m_sc[...] = jnp.full(m_sc.shape, -1e30, m_sc.dtype)
        l_sc[...] = jnp.zeros(l_sc.shape, l_sc.dtype)

    slot, n_valid = _pipeline(idx_smem, kv_hbm, buf, sem, cfg)

    @pl.when(n_valid > 0)
    def _():
        k = _unpack(buf[slot], lay)
        s = jnp.where(_valid(idx_vmem, cfg), _logits(q_ref, k, cfg), -jnp.inf)  # [Hp, BI]
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        pv = p.astype(lay.dtype)
        for i in range(lay.planes):
            acc[i] = acc[i] * alpha + jnp.dot(pv, k[i][:, :lay.v_width], preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == nb - 1)
    def _():
        l = l_sc[...]
        nonempty = l > 0
        inv = 1.0 / jnp.where(nonempty, l, 1.0)
        for i in range(lay.planes):
            o_ref[i] = (acc[i] * inv).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(nonempty, m_sc[...] + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)


def forward(qf, kvf, idx, cfg):
    """-> out [N, Hp, dv_p] (q dtype), lse [N, Hp, 1] f32."""
    out_dtype = qf.dtype
    qf, kvf = _as_supported(qf, kvf)
    lay = layout(cfg, kvf.dtype)
    n, hp, _ = qf.shape
    rows = pack_rows(kvf, cfg, lay)
    planes = _per_token_planes(lay, hp)
    out, lse = _call(
        cfg, functools.partial(_fwd_kernel, cfg=cfg, lay=lay),
        grid=(n, idx.shape[2] // cfg.block_i),
        in_specs=_specs(idx, lay, hp, cfg.block_i),
        out_specs=[planes(lay.v_width), _per_token(hp)(1)],
        out_shape=[jax.ShapeDtypeStruct((n, lay.planes, hp, lay.v_width), qf.dtype),
                   jax.ShapeDtypeStruct((n, hp, 1), jnp.float32)],
        scratch_shapes=[*_gather_scratch(rows, cfg), pltpu.VMEM((lay.planes, hp, lay.v_width), jnp.float32),
                        pltpu.VMEM((hp, 1), jnp.float32), pltpu.VMEM((hp, 1), jnp.float32)],
    )(idx, idx, _q_planes(qf, cfg, lay), rows)
    return jnp.swapaxes(out, 1, 2).reshape(n, hp, cfg.dv_p).astype(out_dtype), lse


# ------------------------------------------------------------------------------------- head-summed probs
def _probs_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, lse_ref, p_ref, buf, sem, *, cfg, lay):
    slot, n_valid = _pipeline(idx_smem, kv_hbm, buf, sem, cfg)
    p_ref[...] = jnp.zeros(p_ref.shape, p_ref.dtype)

    @pl.when(n_valid > 0)
    def _():
        p = _probs(q_ref, _unpack(buf[slot], lay), _valid(idx_vmem, cfg), lse_ref[...], cfg)
        p_ref[...] = jnp.sum(p, axis=0, keepdims=True)


def head_summed_probs(qf, kvf, idx, lse, cfg):
    """-> [N, 1, Kp] f32: P summed over heads (padded heads carry lse = -inf and add nothing)."""
    qf, kvf = _as_supported(qf, kvf)
    lay = layout(cfg, kvf.dtype)
    n, hp, _ = qf.shape
    kp, bi = idx.shape[2], cfg.block_i
    rows = pack_rows(kvf, cfg, lay)
    return _call(
        cfg, functools.partial(_probs_kernel, cfg=cfg, lay=lay),
        grid=(n, kp // bi),
        in_specs=[*_specs(idx, lay, hp, cfg.block_i), _per_token(hp)(1)],
        out_specs=pl.BlockSpec((None, 1, bi), lambda t, j: (t, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n, 1, kp), jnp.float32),
        scratch_shapes=_gather_scratch(rows, cfg),
    )(idx, idx, _q_planes(qf, cfg, lay), rows, lse)


# ---------------------------------------------------------------------------------------------- backward
def _bwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, do_ref, lse_ref, delta_ref, dq_ref, part_ref, buf, sem, dq_acc,
                *, cfg, lay):
    j, nb = pl.program_id(1), pl.num_programs(1)

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros(dq_acc.shape, dq_acc.dtype)

    slot, n_valid = _pipeline(idx_smem, kv_hbm, buf, sem, cfg)

    @pl.when(n_valid == 0)
    def _():
        part_ref[...] = jnp.zeros(part_ref.shape, part_ref.dtype)

    @pl.when(n_valid > 0)
    def _():
        k = _unpack(buf[slot], lay)
        vw = lay.v_width
        p = _probs(q_ref, k, _valid(idx_vmem, cfg), lse_ref[...], cfg)  # [Hp, BI]
        dp = _nt(do_ref[0], k[0][:, :vw])
        for i in range(1, lay.planes):
            dp = dp + _nt(do_ref[i], k[i][:, :vw])
        ds = p * (dp - delta_ref[...])  # gradient w.r.t. the natural-log logits
        ds_k = ds.astype(lay.dtype)
        ds_q = (ds * cfg.scale).astype(q_ref.dtype)
        p_do = p.astype(do_ref.dtype)
        for i in range(lay.planes):
            dq_acc[i] += jnp.dot(ds_k, k[i], preferred_element_type=jnp.float32)
            part = _tn(ds_q, q_ref[i])  # [BI, W]
            part_ref[i] = part.astype(part_ref.dtype)
            part_ref[i, :, :vw] = (part[:, :vw] + _tn(p_do, do_ref[i])).astype(part_ref.dtype)

    @pl.when(j == nb - 1)
    def _():
        for i in range(lay.planes):
            dq_ref[i] = (dq_acc[i] * cfg.scale).astype(dq_ref.dtype)


def backward(qf, kvf, idx, do, lse, delta, cfg, part_dtype):
    """-> dq [N, Hp, Dp] (q dtype), dkv [NS, Dp] f32 (the segment sum of this call's partial rows)."""
    dq_dtype = qf.dtype
    qf, kvf, do = _as_supported(qf, kvf, do)
    if kvf.dtype == jnp.float32:  # float32 rows (also a float16 cache's float32 copy): float32 partials
        part_dtype = jnp.float32
    lay = layout(cfg, kvf.dtype)
    n, hp, _ = qf.shape
    kp, bi = idx.shape[2], cfg.block_i
    rows = pack_rows(kvf, cfg, lay)
    planes = _per_token_planes(lay, hp)
    heads = _per_token(hp)
    dq, parts = _call(
        cfg, functools.partial(_bwd_kernel, cfg=cfg, lay=lay),
        grid=(n, kp // bi),
        in_specs=[*_specs(idx, lay, hp, cfg.block_i), planes(lay.v_width), heads(1), heads(1)],
        out_specs=[planes(lay.width), pl.BlockSpec((None, lay.planes, bi, lay.width), lambda t, j: (t, 0, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, lay.planes, hp, lay.width), qf.dtype),
                   jax.ShapeDtypeStruct((n, lay.planes, kp, lay.width), part_dtype)],
        scratch_shapes=[*_gather_scratch(rows, cfg), pltpu.VMEM((lay.planes, hp, lay.width), jnp.float32)],
    )(idx, idx, _q_planes(qf, cfg, lay), rows, _v_planes(do.astype(qf.dtype), lay), lse, delta)
    dq = from_planes(jnp.swapaxes(dq, 1, 2), cfg, lay).astype(dq_dtype)
    return dq, reduce_partials(parts, idx[:, 0], cfg, lay)


def reduce_partials(parts, idx, cfg, lay: Layout):
    """Segment sum of the partial rows parts [N, P, Kp, W] (row (t, p, slot) is plane p of cache row idx[t, slot])
    into dkv [NS, Dp] f32, sort-free (XLA's scatter-add). The planes are separate segments (plane p of row r is
    segment p * (NS + 1) + r), so the partials are summed in the layout the kernel wrote them (no transpose of the
    [N, P, Kp, W] buffer) and only the [NS, Dp] sum is re-interleaved. Invalid slots go to the dump segment
    NS of each plane, which is dropped."""
    n, p, kp, w = parts.shape
    dump = cfg.num_keys + 1
    ids = jnp.where((idx >= 0) & (idx < cfg.num_keys), idx, cfg.num_keys)  # [N, Kp]
    ids = ids[:, None, :] + dump * jnp.arange(p, dtype=jnp.int32)[None, :, None]
    sums = jax.ops.segment_sum(parts.reshape(-1, w).astype(jnp.float32), ids.reshape(-1), num_segments=p * dump)
    sums = sums.reshape(p, dump, w)[:, :cfg.num_keys]
    return from_planes(jnp.swapaxes(sums, 0, 1), cfg, lay)
