"""Gathered sparse MLA for TPU (Pallas Mosaic TPU): forward, fused backward and the head-summed probabilities.

Called by `kernels.sparse_mla` (which owns the semantics, the custom VJP, the flattened-token layout with
global indices and the dkv reduction); this module only holds the TPU kernels. Layout from the wrapper:
qf [N, Hp, Dp], kvf [NS, Dp] (value dims first, dv_p and dt_p multiples of 128, so every slice is lane-aligned),
idx [N, 1, Kp] int32 global rows (-1 = invalid), Hp a multiple of 8.

Design (TPU has no gather from HBM into the MXU's operands, so rows are fetched by DMA):
  * grid (token, slot block): the token axis is "parallel" (megacore split), the slot-block axis "arbitrary"
    (an online-softmax / dq reduction). q [Hp, Dp] and dO stay in VMEM for all slot blocks of a token (their
    block index does not change, so the pipeline fetches them once per token).
  * the token's slot indices arrive twice per token: in SMEM (scalars, the DMA row addresses) and in VMEM (a
    vector, the validity mask of a block).
  * rows are gathered one DMA per selected row (kv[row] -> buf[slot, r], 2 * Dp bytes each for bf16) into a
    double buffer: block j + 1 is in flight while block j is computed; invalid slots issue no DMA, and a block
    with no valid slot (the tail of an early query's -1 slots in a causal prefill) skips its MXU work. The
    buffer is zeroed when a token starts, so an invalid slot reads finite data (P is 0 there; 0 * NaN from
    uninitialised VMEM would poison P V).
  * forward: S = q K^T [Hp, BI] on the MXU (f32 accumulation), online softmax in f32 scratch, O += P V with P in
    the value dtype; out and lse (natural log) written at the last slot block.
  * backward (one fused kernel; VMEM is large enough that the GPU's split into dq and dkv programs, made for
    register pressure, is unnecessary): per (token, slot block) P is recomputed from lse, dP = dO V^T,
    dS = P (dP - Delta); dq += dS K accumulates in scratch, and the block's dkv partial rows
    scale dS^T q + P^T dO [BI, Dp] are written once each (no atomics), to be reduced by the wrapper's sorted
    segment sum. S and dP are computed once per pair (2752 MMA FLOP per pair-head, not the GPU path's 3264).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsv32_jax.kernels._dispatch import tpu_interpret_params


def _call(cfg, kernel, **kwargs):
    interpret = tpu_interpret_params() if cfg.backend == "interpret_tpu" else False
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, **kwargs)


def _block_copies(idx_smem, kv_hbm, buf, sem, j, cfg, action: str):
    """Starts (action "start") or waits for ("wait") the row copies of slot block j into buffer slot j % 2, one
    per valid slot (kv[row] -> buf[j % 2, r]); returns how many of the block's slots are valid."""
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
    """Double-buffered gather: returns (the current slot block's rows [BI, Dp], its number of valid slots)."""
    j, nb = pl.program_id(1), pl.num_programs(1)

    @pl.when(j == 0)
    def _():
        buf[...] = jnp.zeros(buf.shape, buf.dtype)
        _block_copies(idx_smem, kv_hbm, buf, sem, j, cfg, "start")

    @pl.when(j + 1 < nb)
    def _():
        _block_copies(idx_smem, kv_hbm, buf, sem, j + 1, cfg, "start")

    n_valid = _block_copies(idx_smem, kv_hbm, buf, sem, j, cfg, "wait")
    return buf[j % 2], n_valid


def _valid(idx_vmem, cfg):
    ids = idx_vmem[:, pl.ds(pl.program_id(1) * cfg.block_i, cfg.block_i)]  # [1, BI]
    return (ids >= 0) & (ids < cfg.num_keys)


def _nt(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _probs(q, k, valid, lse, cfg):
    """P [Hp, BI] from the final lse [Hp, 1] (0 on invalid slots and empty rows)."""
    s = _nt(q, k) * cfg.scale
    ok = valid & (lse > -jnp.inf)
    return jnp.where(ok, jnp.exp(s - jnp.where(ok, lse, 0.0)), 0.0)


# ----------------------------------------------------------------------------------------------- forward
def _fwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, o_ref, lse_ref, buf, sem, acc, m_sc, l_sc, *, cfg):
    j, nb = pl.program_id(1), pl.num_programs(1)

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, acc.dtype)
        m_sc[...] = jnp.full(m_sc.shape, -1e30, m_sc.dtype)
        l_sc[...] = jnp.zeros(l_sc.shape, l_sc.dtype)

    k, n_valid = _pipeline(idx_smem, kv_hbm, buf, sem, cfg)

    @pl.when(n_valid > 0)
    def _():
        s = jnp.where(_valid(idx_vmem, cfg), _nt(q_ref[...], k) * cfg.scale, -jnp.inf)  # [Hp, BI]
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        acc[...] = acc[...] * alpha + jnp.dot(p.astype(k.dtype), k[:, :cfg.dv_p],
                                              preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == nb - 1)
    def _():
        l = l_sc[...]
        nonempty = l > 0
        o_ref[...] = (acc[...] / jnp.where(nonempty, l, 1.0)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(nonempty, m_sc[...] + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)


def _specs(idx, q_shape, cfg):
    kp = idx.shape[2]
    _, hp, dp = q_shape
    return [pl.BlockSpec((None, 1, kp), lambda t, j: (t, 0, 0), memory_space=pltpu.SMEM),
            pl.BlockSpec((None, 1, kp), lambda t, j: (t, 0, 0)),
            pl.BlockSpec((None, hp, dp), lambda t, j: (t, 0, 0)),
            pl.BlockSpec(memory_space=pltpu.HBM)]


def _per_token(hp):
    """BlockSpec factory: a token's [Hp, width] block, the same for all its slot blocks."""
    return lambda width: pl.BlockSpec((None, hp, width), lambda t, j: (t, 0, 0))


def _gather_scratch(kvf, cfg):
    return [pltpu.VMEM((2, cfg.block_i, kvf.shape[1]), kvf.dtype), pltpu.SemaphoreType.DMA((2,))]


def forward(qf, kvf, idx, cfg):
    """-> out [N, Hp, dv_p] (q dtype), lse [N, Hp, 1] f32."""
    n, hp, _ = qf.shape
    heads = _per_token(hp)
    return _call(
        cfg, functools.partial(_fwd_kernel, cfg=cfg),
        grid=(n, idx.shape[2] // cfg.block_i),
        in_specs=_specs(idx, qf.shape, cfg),
        out_specs=[heads(cfg.dv_p), heads(1)],
        out_shape=[jax.ShapeDtypeStruct((n, hp, cfg.dv_p), qf.dtype), jax.ShapeDtypeStruct((n, hp, 1), jnp.float32)],
        scratch_shapes=[*_gather_scratch(kvf, cfg), pltpu.VMEM((hp, cfg.dv_p), jnp.float32),
                        pltpu.VMEM((hp, 1), jnp.float32), pltpu.VMEM((hp, 1), jnp.float32)],
    )(idx, idx, qf, kvf)


# ------------------------------------------------------------------------------------- head-summed probs
def _probs_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, lse_ref, p_ref, buf, sem, *, cfg):
    k, n_valid = _pipeline(idx_smem, kv_hbm, buf, sem, cfg)
    p_ref[...] = jnp.zeros(p_ref.shape, p_ref.dtype)

    @pl.when(n_valid > 0)
    def _():
        p = _probs(q_ref[...], k, _valid(idx_vmem, cfg), lse_ref[...], cfg)
        p_ref[...] = jnp.sum(p, axis=0, keepdims=True)


def head_summed_probs(qf, kvf, idx, lse, cfg):
    """-> [N, 1, Kp] f32: P summed over heads (padded heads carry lse = -inf and add nothing)."""
    n, hp, _ = qf.shape
    kp, bi = idx.shape[2], cfg.block_i
    return _call(
        cfg, functools.partial(_probs_kernel, cfg=cfg),
        grid=(n, kp // bi),
        in_specs=[*_specs(idx, qf.shape, cfg), pl.BlockSpec((None, hp, 1), lambda t, j: (t, 0, 0))],
        out_specs=pl.BlockSpec((None, 1, bi), lambda t, j: (t, 0, j)),
        out_shape=jax.ShapeDtypeStruct((n, 1, kp), jnp.float32),
        scratch_shapes=_gather_scratch(kvf, cfg),
    )(idx, idx, qf, kvf, lse)


# ---------------------------------------------------------------------------------------------- backward
def _bwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, do_ref, lse_ref, delta_ref, dq_ref, part_ref, buf, sem, dq_acc,
                *, cfg):
    j, nb = pl.program_id(1), pl.num_programs(1)

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros(dq_acc.shape, dq_acc.dtype)

    k, n_valid = _pipeline(idx_smem, kv_hbm, buf, sem, cfg)

    @pl.when(n_valid == 0)
    def _():
        part_ref[...] = jnp.zeros(part_ref.shape, part_ref.dtype)

    @pl.when(n_valid > 0)
    def _():
        q, do = q_ref[...], do_ref[...]
        p = _probs(q, k, _valid(idx_vmem, cfg), lse_ref[...], cfg)  # [Hp, BI]
        ds = p * (_nt(do, k[:, :cfg.dv_p]) - delta_ref[...])  # gradient w.r.t. the natural-log logits
        dq_acc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
        part = _tn((ds * cfg.scale).astype(q.dtype), q)  # [BI, Dp]
        part_ref[...] = part.astype(part_ref.dtype)
        part_ref[:, :cfg.dv_p] = (part[:, :cfg.dv_p] + _tn(p.astype(do.dtype), do)).astype(part_ref.dtype)

    @pl.when(j == nb - 1)
    def _():
        dq_ref[...] = (dq_acc[...] * cfg.scale).astype(dq_ref.dtype)


def backward(qf, kvf, idx, do, lse, delta, cfg, part_dtype):
    """-> dq [N, Hp, Dp] (q dtype), dkv partials [N, Kp, Dp] (part_dtype; row (t, slot) belongs to idx[t, slot])."""
    n, hp, dp = qf.shape
    kp, bi = idx.shape[2], cfg.block_i
    heads = _per_token(hp)
    return _call(
        cfg, functools.partial(_bwd_kernel, cfg=cfg),
        grid=(n, kp // bi),
        in_specs=[*_specs(idx, qf.shape, cfg), heads(cfg.dv_p), heads(1), heads(1)],
        out_specs=[heads(dp), pl.BlockSpec((None, bi, dp), lambda t, j: (t, j, 0))],
        out_shape=[jax.ShapeDtypeStruct(qf.shape, qf.dtype), jax.ShapeDtypeStruct((n, kp, dp), part_dtype)],
        scratch_shapes=[*_gather_scratch(kvf, cfg), pltpu.VMEM((hp, dp), jnp.float32)],
    )(idx, idx, qf, kvf, do, lse, delta)
