"""Gathered sparse MLA (absorbed MQA mode, eq. 2): forward, backward and the head-summed probabilities (eq. 4).

Semantics are `dsv32_jax.model.attention.sparse_mla`: q [B, T, H, Dqk], kv [B, S, Dqk] (value = first d_v dims),
topk_idx [B, T, K]; slots that are -1 or >= S contribute nothing, duplicates count twice, a row with no valid slot
gives out = 0 and lse = -inf; lse is a natural log.

Kernel design (Pallas, Triton backend; kernels.md section 9):
  * layout: tokens of all batches are flattened (N = B*T) and indices made global (b*S + idx, invalid -> -1), so
    one kernel serves both an explicit batch and flattened tokens. Dqk is split into a "main" part (the d_v value
    dims, 512) and a "tail" (rope, 64) because Triton tensors must have power-of-two sizes; other sizes are
    zero-padded inside the wrapper (free for the production 512 + 64 layout).
  * forward: one program per (query token, block of BH heads); loop over the K selected slots in blocks of BI:
    gather the BI rows by index inside the kernel (masked loads, invalid -> 0), S = Q K^T on the MMA,
    invalid slots -> -inf, online softmax in base 2 (fp32), O += P V with P in the value dtype; lse is returned
    as a natural log.
  * backward: Delta = rowsum(O * dO) - dlse, then two atomic-free kernels:
      dq   -- one program per (token, head block), recompute P from lse, dP = dO V^T, dS = P (dP - Delta),
              dq += dS K (accumulated over the slot loop in registers);
      dkv  -- one program per (token, block of BI slots) that loops over ALL head blocks of the token, so the
              head sum happens in registers: partial[t, slot] = scale dS^T q + P^T dO (one fp32 accumulator
              [BI, 576]). Each partial row is written exactly once (no atomics), then reduced into [B*S, Dqk]
              by a sort-free segment sum (XLA scatter-add) over the transposed index map.
    The backward tiles (bwd_block_h heads per dq program, bwd_block_i slots per dkv program, default 32) are
    no larger than the forward's 64 x 32 because each holds a [tile, 576] fp32 accumulator.
    Trade-off: S and dP are recomputed in both kernels (3840 instead of 2752 MMA FLOP per head-slot pair at
    576 / 512, +40%) and the partials cost T*K*Dqk*4 bytes; the backward therefore walks the tokens in chunks
    that keep the partial buffer under `bwd_partial_bytes` (default 512 MiB: 113 tokens at K=2048, Dqk=576).
  * backward without recomputation (bwd="stored", issue 31 item 3): S, P, dP and dS are computed once per
    (token, head, slot), by a kernel per (token, block_h heads) on 64-row tiles (wgmma at 64 heads) that writes
    P and scale * dS in the value dtype ([T, H, K], what the recompute path rounds them to before its MMAs too);
    a second kernel per (token, column slice of `bwd_slice` of the 576) reads them with the token's q and dO
    slices, all heads at once, and produces both that slice of dq (dS K over the slots, the slice of each
    selected row gathered once) and that slice of the dkv partials (dS^T q + P^T dO over the heads: M = 64 slots,
    K = H), reduced by the same segment sum. MMA work: 2752 FLOP per head-slot pair, none repeated.
  * pds="mosaic_gpu" (with "stored" or "atomic"): P and scale * dS from the Mosaic GPU kernel of
    `sparse_mla_pds_mgpu` (two warpgroups, cp.async gather, wgmma N = 32; Dqk 576 / d_v 512, bf16) instead of
    `_pds_kernel`; the dq / dkv kernel is the same.
  * dqkv="mosaic_gpu" (with "stored"): dq and the dkv partials from the Mosaic GPU kernel of `sparse_mla_dqkv_mgpu`
    (per token and 64-column slice, two ping-pong warpgroups, cp.async gather of the rows' slice, wgmma N = 64;
    Dqk 576 / d_v 512, bf16, heads padded to 64 or 128) instead of `_dqkv_kernel`; the same segment sum.
  * bwd="atomic": the stored backward whose second kernel adds its dkv rows ([64 slots, 64 columns] per step) into
    the fp32 [B*S, Dqk] accumulator with relaxed fp32 vector atomics (`red.global.relaxed.add.v4.f32`,
    `triton_atomics`) instead of writing them: no [T, K, Dqk] partials, no segment sum, and token chunks bounded
    by the stored P / dS alone (512 tokens at H 128, K 2048 under the default `bwd_partial_bytes`). Invalid slots
    are masked off (no atomic at all); repeated keys add twice, as everywhere here. The fp32 sum's order depends
    on the schedule, so dkv is not bitwise reproducible run to run (within fp32 rounding of the stored path).
  * probabilities summed over heads (return_probs): the dkv program structure without the gradients, from the
    final lse; returned with stop_gradient (it is the target of the indexer's KL loss).
  * launch order: every GPU grid here puts the within-token axis (head block, slot block or column slice) first,
    which is the fastest-varying in launch order (Pallas Triton maps grid axis 0 to CUDA's x), so the programs
    of one token run at the same time and meet its gathered rows, q, dO, P and dS in L2 instead of re-reading
    them from HBM one token-sweep apart (before 2026-11-27 the token axis came first).
TPU (impl pallas_tpu / interpret_tpu): the Mosaic kernels of `sparse_mla_tpu` (all heads per program, slot
blocks gathered by one DMA per selected row as 32-bit words: bf16 rows are packed in pairs of columns; see that
module) behind the same custom VJP; its dq comes from the fused backward kernel and its dkv partials are reduced by
`sparse_mla_tpu.reduce_partials`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv32_jax.model import attention
from dsv32_jax.model.options import MLA_BWDS, MLA_DQKV, MLA_FWDS, MLA_PDS
from dsv32_jax.kernels import (sparse_mla_dqkv_mgpu, sparse_mla_mgpu, sparse_mla_pds_mgpu, sparse_mla_tpu,
                               triton_atomics)
from dsv32_jax.model.config import is_int
from dsv32_jax.kernels._dispatch import next_pow2, resolve_impl, round_up
from dsv32_jax.kernels._vmap import INDEX, KEYS, ROWS, fold_vmap

TPU_BACKENDS = ("pallas_tpu", "interpret_tpu")
MGPU_BACKENDS = {"mosaic_gpu": "pallas_gpu", "interpret_mosaic_gpu": "interpret"}  # forward impl -> backward's

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class StoredTiles:
    """Tiles of the stored / atomic GPU backward's two Triton kernels (`sparse_mla(..., stored_tiles=)`): the P / dS
    kernel (`_pds_kernel`, one program per (token, block_h heads)) gathers `pds_slots` selected rows per step (the N
    of its S and dP MMAs); the dq / dkv kernel (`_dqkv_kernel`, one program per (token, column slice)) takes
    `dqkv_slots` slots per step (the M of its dS^T q MMA) and `dqkv_slice` of the Dqk columns per program (clipped
    to the padded value and rope widths). Each kernel has its own warps and software-pipeline stages. All sizes are
    powers of two, slots >= 16, slices >= 16, warps 4 or 8, stages >= 1. The defaults are the tiles timed on an
    H200 (84-88 TFLOP/s); `bench/kernels.py --tile_sweep` times the alternatives that compile for sm_90a."""
    pds_slots: int = 16
    pds_warps: int = 4
    pds_stages: int = 2
    dqkv_slots: int = 64
    dqkv_slice: int = 64
    dqkv_warps: int = 8
    dqkv_stages: int = 2

    def check(self) -> "StoredTiles":
        """Self, or a ValueError naming the first bad field."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"sparse_mla: StoredTiles.{f.name}={v!r} must be an int")
            if f.name.endswith("_warps") and v not in (4, 8):
                raise ValueError(f"sparse_mla: StoredTiles.{f.name}={v} must be 4 or 8")
            if f.name.endswith("_stages") and v < 1:
                raise ValueError(f"sparse_mla: StoredTiles.{f.name}={v} must be >= 1")
            if f.name.endswith(("_slots", "_slice")) and (v < 16 or v & (v - 1)):
                raise ValueError(f"sparse_mla: StoredTiles.{f.name}={v} must be a power of two >= 16")
        return self

    def label(self) -> str:
        """A short name: 'P/dS 16 slots, 4 warps, 2 stages; dq/dkv 64 slots, slice 64, 8 warps, 2 stages'."""
        return (f"P/dS {self.pds_slots} slots, {self.pds_warps} warps, {self.pds_stages} stages; dq/dkv "
                f"{self.dqkv_slots} slots, slice {self.dqkv_slice}, {self.dqkv_warps} warps, {self.dqkv_stages} "
                "stages")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    scale: float
    d_v: int
    d_tail: int  # Dqk - d_v
    dv_p: int  # padded main width (power of two)
    dt_p: int  # padded tail width
    block_h: int
    block_i: int
    bwd_block_h: int  # heads per dq program (divides block_h)
    bwd_block_i: int  # slots per dkv program (divides block_i)
    backend: str  # "pallas_gpu" | "interpret" (Triton kernels) | "pallas_tpu" | "interpret_tpu" (Mosaic TPU kernels)
    num_warps: int
    num_stages: int
    bwd_partial_bytes: int
    num_keys: int  # B * S rows of the flattened cache
    bwd: str = "recompute"  # "recompute" | "stored" | "atomic" (GPU backward, see the module docstring)
    stored: StoredTiles = StoredTiles()  # the stored / atomic backward's tiles
    fwd: str = "triton"  # "triton" | "mosaic_gpu" (the forward of `sparse_mla_mgpu`; backward as `backend` says)
    mgpu_form: str = "split"  # that forward's 64-head form (`sparse_mla_mgpu.FORMS`)
    pds: str = "triton"  # the stored backward's P / dS kernel: "triton" (`_pds_kernel`) | "mosaic_gpu"
    dqkv: str = "triton"  # the stored backward's dq / dkv kernel: "triton" (`_dqkv_kernel`) | "mosaic_gpu"

    @property
    def tpu(self) -> bool:
        return self.backend in TPU_BACKENDS

    @property
    def bwd_slice(self) -> int:
        """dq / dkv column slice of the stored backward's second kernel (divides dv_p and dt_p)."""
        return min(self.stored.dqkv_slice, self.dv_p, self.dt_p)

    @property
    def padded(self) -> bool:
        return (self.dv_p, self.dt_p) != (self.d_v, self.d_tail)


def _call(cfg: _Cfg, kernel, **kwargs):
    extra = {}
    if cfg.backend == "pallas_gpu":
        extra["compiler_params"] = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return pl.pallas_call(kernel, interpret=cfg.backend == "interpret", **extra, **kwargs)


def _gather(kv_ref, ids, cols, cfg: _Cfg):
    """(valid [BI], kv[ids][:, cols] [BI, len(cols)]): the selected rows' columns; invalid slots load zeros."""
    valid = (ids >= 0) & (ids < cfg.num_keys)
    rows = pltriton.load(kv_ref.at[jnp.where(valid, ids, 0)[:, None], cols[None, :]], mask=valid[:, None], other=0)
    return valid, rows


def _gather_rows(kv_ref, ids, cfg: _Cfg):
    """Rows kv[ids] split into main [BI, dv_p] and tail [BI, dt_p]; invalid slots load zeros."""
    valid, k_main = _gather(kv_ref, ids, jnp.arange(cfg.dv_p, dtype=jnp.int32), cfg)
    _, k_tail = _gather(kv_ref, ids, cfg.dv_p + jnp.arange(cfg.dt_p, dtype=jnp.int32), cfg)
    return valid, k_main, k_tail


def _nt(a, b):
    """a [M, D] . b [N, D]^T -> [M, N] f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    """a [M, N]^T . b [M, D] -> [N, D] f32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _logits2(q_main, q_tail, k_main, k_tail, valid, cfg: _Cfg):
    """Base-2 logits [BH, BI]: scale * log2(e) * q.k, -inf on invalid slots."""
    s = _nt(q_main, k_main) + _nt(q_tail, k_tail)
    return jnp.where(valid[None, :], s * (cfg.scale * LOG2E), -jnp.inf)


def _load_q(q_ref, cfg: _Cfg, heads=None):
    h = slice(None) if heads is None else heads
    return q_ref[h, pl.ds(0, cfg.dv_p)], q_ref[h, pl.ds(cfg.dv_p, cfg.dt_p)]


def _warn_head_padding(kernel: str, heads: int, padded: int, per_cta: int | str = 64):
    """At trace time: a Mosaic GPU kernel (per_cta heads per CTA) about to run on zero-padded heads."""
    if padded > heads:
        warnings.warn(f"sparse_mla: the Mosaic GPU {kernel} runs {per_cta} heads per CTA; {heads} heads (per device) "
                      f"are padded to {padded}: {padded / heads:.1f}x its MMA work and q / dO / P / dS memory "
                      "(BENCHMARKS.md, 'Head padding'); the Triton kernel tiles them as they are", stacklevel=2)


# ----------------------------------------------------------------------------------------------- forward
def _fwd_kernel(q_ref, kv_ref, idx_ref, o_ref, lse_ref, *, cfg: _Cfg, n_blocks: int):
    q_main, q_tail = _load_q(q_ref, cfg)
    bh, bi = cfg.block_h, cfg.block_i

    def body(j, carry):
        acc, m, l = carry
        valid, k_main, k_tail = _gather_rows(kv_ref, idx_ref[pl.ds(j * bi, bi)], cfg)
        s = _logits2(q_main, q_tail, k_main, k_tail, valid, cfg)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _nn(p.astype(k_main.dtype), k_main)
        return acc, m_new, l

    init = (jnp.zeros((bh, cfg.dv_p), jnp.float32), jnp.full((bh,), -1e30, jnp.float32),
            jnp.zeros((bh,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
    nonempty = l > 0
    o_ref[...] = (acc / jnp.where(nonempty, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(nonempty, (m + jnp.log2(jnp.where(nonempty, l, 1.0))) * LN2, -jnp.inf)


def _forward(qf, kvf, idxf, cfg: _Cfg):
    if cfg.tpu:
        out, lse = sparse_mla_tpu.forward(qf, kvf, idxf[:, None, :], cfg)
        return out, lse[..., 0]
    if cfg.fwd == "mosaic_gpu":  # heads padded to the kernel's 64, slots (-1) to its 64-key blocks
        n, hp, _ = qf.shape
        hm = sparse_mla_mgpu.H_T if hp <= sparse_mla_mgpu.H_T else round_up(hp, sparse_mla_mgpu.H_BLK)
        km = round_up(idxf.shape[1], sparse_mla_mgpu.BK)
        _warn_head_padding("forward", hp, hm, min(hm, sparse_mla_mgpu.H_BLK))
        out, lse = sparse_mla_mgpu.sparse_mla_fwd(
            jnp.pad(qf, ((0, 0), (0, hm - hp), (0, 0))), kvf,
            jnp.pad(idxf, ((0, 0), (0, km - idxf.shape[1])), constant_values=-1),
            scale=cfg.scale, interpret=cfg.backend == "interpret", form=cfg.mgpu_form)
        return out[:, :hp], lse[:, :hp]
    n, hp, dp = qf.shape
    kp = idxf.shape[1]
    bh = cfg.block_h
    return _call(
        cfg, functools.partial(_fwd_kernel, cfg=cfg, n_blocks=kp // cfg.block_i),
        grid=(hp // bh, n),  # a token's head blocks adjacent in launch order: they share its gathered rows in L2
        in_specs=[pl.BlockSpec((None, bh, dp), lambda h, t: (t, h, 0)),
                  pl.BlockSpec(kvf.shape, lambda h, t: (0, 0)),
                  pl.BlockSpec((None, kp), lambda h, t: (t, 0))],
        out_specs=[pl.BlockSpec((None, bh, cfg.dv_p), lambda h, t: (t, h, 0)),
                   pl.BlockSpec((None, bh), lambda h, t: (t, h))],
        out_shape=[jax.ShapeDtypeStruct((n, hp, cfg.dv_p), qf.dtype), jax.ShapeDtypeStruct((n, hp), jnp.float32)],
    )(qf, kvf, idxf)


# --------------------------------------------------------------------------- per-slot programs (dkv, probs)
def _probs_block(q_main, q_tail, k_main, k_tail, valid, lse2, cfg: _Cfg):
    """P [BH, BI] from the final base-2 lse (0 on invalid slots and empty rows)."""
    s = _logits2(q_main, q_tail, k_main, k_tail, valid, cfg)
    ok = valid[None, :] & (lse2 > -jnp.inf)[:, None]
    return jnp.where(ok, jnp.exp2(s - jnp.where(ok, lse2[:, None], 0.0)), 0.0)


def _probs_kernel(q_ref, kv_ref, idx_ref, lse_ref, p_ref, *, cfg: _Cfg, n_head_blocks: int):
    valid, k_main, k_tail = _gather_rows(kv_ref, idx_ref[...], cfg)
    bh = cfg.block_h

    def body(hb, acc):
        heads = pl.ds(hb * bh, bh)
        q_main, q_tail = _load_q(q_ref, cfg, heads)
        p = _probs_block(q_main, q_tail, k_main, k_tail, valid, lse_ref[heads] * LOG2E, cfg)
        return acc + jnp.sum(p, axis=0)

    p_ref[...] = jax.lax.fori_loop(0, n_head_blocks, body, jnp.zeros((cfg.block_i,), jnp.float32))


def _per_slot_specs(qf, kvf, cfg: _Cfg):
    """in_specs of a (token, slot block) program: all heads of the token's q, the whole cache, its slot block."""
    _, hp, dp = qf.shape
    return [pl.BlockSpec((None, hp, dp), lambda j, t: (t, 0, 0)),
            pl.BlockSpec(kvf.shape, lambda j, t: (0, 0)),
            pl.BlockSpec((None, cfg.block_i), lambda j, t: (t, j))]


def _head_summed_probs(qf, kvf, idxf, lse, cfg: _Cfg):
    if cfg.tpu:
        return sparse_mla_tpu.head_summed_probs(qf, kvf, idxf[:, None, :], lse[..., None], cfg)[:, 0]
    n, hp, _ = qf.shape
    kp, bi = idxf.shape[1], cfg.block_i
    return _call(
        cfg, functools.partial(_probs_kernel, cfg=cfg, n_head_blocks=hp // cfg.block_h),
        grid=(kp // bi, n),  # a token's slot blocks adjacent in launch order: they share its q in L2
        in_specs=[*_per_slot_specs(qf, kvf, cfg), pl.BlockSpec((None, hp), lambda j, t: (t, 0))],
        out_specs=pl.BlockSpec((None, bi), lambda j, t: (t, j)),
        out_shape=jax.ShapeDtypeStruct((n, kp), jnp.float32),
    )(qf, kvf, idxf, lse)


# ---------------------------------------------------------------------------------------------- backward
def _ds_block(q_main, q_tail, do, k_main, k_tail, valid, lse2, delta, cfg: _Cfg):
    """(P, dS) [BH, BI] with dS = P (dO V^T - Delta), the gradient w.r.t. the natural-log logits."""
    p = _probs_block(q_main, q_tail, k_main, k_tail, valid, lse2, cfg)
    dp = _nt(do, k_main)
    return p, p * (dp - delta[:, None])


def _dq_kernel(q_ref, kv_ref, idx_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: _Cfg, n_blocks: int):
    q_main, q_tail = _load_q(q_ref, cfg)
    do = do_ref[...]
    lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]
    bi = cfg.block_i

    def body(j, carry):
        dq_main, dq_tail = carry
        valid, k_main, k_tail = _gather_rows(kv_ref, idx_ref[pl.ds(j * bi, bi)], cfg)
        _, ds = _ds_block(q_main, q_tail, do, k_main, k_tail, valid, lse2, delta, cfg)
        ds = ds.astype(k_main.dtype)
        return dq_main + _nn(ds, k_main), dq_tail + _nn(ds, k_tail)

    init = (jnp.zeros((cfg.block_h, cfg.dv_p), jnp.float32), jnp.zeros((cfg.block_h, cfg.dt_p), jnp.float32))
    dq_main, dq_tail = jax.lax.fori_loop(0, n_blocks, body, init)
    dq_ref[:, pl.ds(0, cfg.dv_p)] = (dq_main * cfg.scale).astype(dq_ref.dtype)
    dq_ref[:, pl.ds(cfg.dv_p, cfg.dt_p)] = (dq_tail * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, kv_ref, idx_ref, do_ref, lse_ref, delta_ref, part_ref, *, cfg: _Cfg, n_head_blocks: int):
    valid, k_main, k_tail = _gather_rows(kv_ref, idx_ref[...], cfg)
    bh, bi = cfg.block_h, cfg.block_i

    def body(hb, carry):  # main = scale dS^T q_main + P^T dO in one accumulator (registers: BI x (dv_p + dt_p))
        acc_main, acc_tail = carry
        heads = pl.ds(hb * bh, bh)
        q_main, q_tail = _load_q(q_ref, cfg, heads)
        do = do_ref[heads, :]
        p, ds = _ds_block(q_main, q_tail, do, k_main, k_tail, valid, lse_ref[heads] * LOG2E, delta_ref[heads], cfg)
        ds = (ds * cfg.scale).astype(q_main.dtype)
        acc_main = acc_main + _tn(ds, q_main) + _tn(p.astype(do.dtype), do)
        return acc_main, acc_tail + _tn(ds, q_tail)

    init = (jnp.zeros((bi, cfg.dv_p), jnp.float32), jnp.zeros((bi, cfg.dt_p), jnp.float32))
    acc_main, acc_tail = jax.lax.fori_loop(0, n_head_blocks, body, init)
    part_ref[:, pl.ds(0, cfg.dv_p)] = acc_main.astype(part_ref.dtype)
    part_ref[:, pl.ds(cfg.dv_p, cfg.dt_p)] = acc_tail.astype(part_ref.dtype)


# ------------------------------------------------------------------- backward without recomputation ("stored")
# Tiles: `StoredTiles`. The P / dS kernel at 64 heads x 576 (H100, deviceless compile): q and dO stay in shared
# memory (139 KB), so 16 gathered slots per step (two buffers) with one warpgroup: 178 KB, 138 registers, wgmma
# m64n16k16. 32 slots take 217 KB with two buffers, or 255 registers with one (tools/gpu_compile --sweep lists them).


def _pds_kernel(q_ref, kv_ref, idx_ref, do_ref, lse_ref, delta_ref, p_ref, ds_ref, *, cfg: _Cfg, n_blocks: int,
                slots: int):
    """P and scale * dS [BH, K] of one (token, head block), each computed once."""
    q_main, q_tail = _load_q(q_ref, cfg)
    do = do_ref[...]
    lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]
    bi = slots

    def body(j, carry):
        slots = pl.ds(pl.multiple_of(j * bi, bi), bi)
        valid, k_main, k_tail = _gather_rows(kv_ref, idx_ref[slots], cfg)
        p, ds = _ds_block(q_main, q_tail, do, k_main, k_tail, valid, lse2, delta, cfg)
        p_ref[:, slots] = p.astype(p_ref.dtype)
        ds_ref[:, slots] = (ds * cfg.scale).astype(ds_ref.dtype)
        return carry

    jax.lax.fori_loop(0, n_blocks, body, 0)


def _scatter_add_rows(dkv_ref, ids, valid, col0, part, cfg: _Cfg):
    """dkv[ids[r], col0 : col0 + width] += part[r] for the valid slots r (bwd="atomic"): relaxed fp32 atomics on
    the chip (`triton_atomics`: no fences), so repeated keys, in one block or across programs, all land. Interpret
    mode adds row by row through the slice form of the atomic, whose discharge rule is an exact read-add-write;
    its gather form discharges to a scatter-set that would keep only one of two repeated rows of a block."""
    width = part.shape[1]
    if cfg.backend == "interpret":
        def row(r, carry):
            @pl.when(valid[r])
            def _():
                triton_atomics.atomic_add(dkv_ref, (ids[r], pl.ds(col0, width)), part[r])
            return carry
        jax.lax.fori_loop(0, part.shape[0], row, 0)
        return
    cols = col0 + jnp.arange(width, dtype=jnp.int32)
    # the mask at the value's full shape: jax 0.11.2's lowering does not broadcast it (0.12's does)
    triton_atomics.atomic_add(dkv_ref, (jnp.where(valid, ids, 0)[:, None], cols[None, :]), part,
                              mask=jnp.broadcast_to(valid[:, None], part.shape))


def _dqkv_kernel(q_ref, kv_ref, idx_ref, do_ref, p_ref, ds_ref, *refs, cfg: _Cfg, n_blocks: int, slots: int):
    """One column slice of a token's dq (all heads) and of its dkv rows (all slots) from the stored P, dS. The dkv
    rows are written as partials ([slots, width] per block, bwd="stored") or added into the fp32 dkv accumulator
    by atomics (bwd="atomic": refs are the aliased accumulator in and out, then dq)."""
    if cfg.bwd == "atomic":
        _, dkv_ref, dq_ref = refs
    else:
        dq_ref, part_ref = refs
    width = cfg.bwd_slice
    col0 = pl.program_id(0) * width
    cols = col0 + jnp.arange(width, dtype=jnp.int32)
    q, do = q_ref[...], do_ref[...]  # [H, width]; do is zero on the rope slice

    def body(j, dq):
        blk = pl.ds(pl.multiple_of(j * slots, slots), slots)
        ids = idx_ref[blk]
        valid, k = _gather(kv_ref, ids, cols, cfg)  # [slots, width]
        ds, p = ds_ref[:, blk], p_ref[:, blk]  # [H, slots]
        part = _tn(ds, q) + _tn(p, do)
        if cfg.bwd == "atomic":
            _scatter_add_rows(dkv_ref, ids, valid, col0, part, cfg)
        else:
            part_ref[blk, :] = part.astype(part_ref.dtype)
        return dq + _nn(ds, k)

    dq = jax.lax.fori_loop(0, n_blocks, body, jnp.zeros((q.shape[0], width), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _pds_mgpu(q_c, kvf, idx_c, do_c, lse_c, delta_c, cfg: _Cfg):
    """`_pds_kernel`'s (P, scale * dS) [n, hp, kp] by the Mosaic GPU kernel (`sparse_mla_pds_mgpu`): heads padded to
    its 64, or to 32 for its keys-as-M form (lse -inf: P = dS = 0 there), slots (-1) to its 64-key blocks, both cut
    back."""
    n, hp, _ = q_c.shape
    kp = idx_c.shape[1]
    hm = sparse_mla_mgpu.H_T if hp <= sparse_mla_mgpu.H_T else round_up(hp, sparse_mla_pds_mgpu.H_BLK)
    km = round_up(kp, sparse_mla_pds_mgpu.BK)
    _warn_head_padding("P / dS kernel", hp, hm, min(hm, sparse_mla_pds_mgpu.H_BLK))
    heads = ((0, 0), (0, hm - hp))
    p, ds = sparse_mla_pds_mgpu.sparse_mla_pds(
        jnp.pad(q_c, (*heads, (0, 0))), jnp.pad(do_c, (*heads, (0, 0))), kvf,
        jnp.pad(idx_c, ((0, 0), (0, km - kp)), constant_values=-1),
        jnp.pad(lse_c, heads, constant_values=-jnp.inf), jnp.pad(delta_c, heads),
        scale=cfg.scale, interpret=cfg.backend == "interpret")
    return p[:, :hp, :kp], ds[:, :hp, :kp]


def _pds(q_c, kvf, idx_c, do_c, lse_c, delta_c, cfg: _Cfg):
    """The stored backward's first kernel: (P, scale * dS) [n, hp, kp] in the cache dtype, by `_pds_kernel` (grid
    (head block, token)) or, with pds="mosaic_gpu", by `sparse_mla_pds_mgpu`."""
    if cfg.pds == "mosaic_gpu":
        return _pds_mgpu(q_c, kvf, idx_c, do_c, lse_c, delta_c, cfg)
    n, hp, dp = q_c.shape
    kp, bh = idx_c.shape[1], cfg.block_h
    slots = _step_slots(cfg.stored.pds_slots, kp)
    row = pl.BlockSpec((None, bh), lambda h, t: (t, h))
    ps_shape = jax.ShapeDtypeStruct((n, hp, kp), kvf.dtype)
    return _call(
        dataclasses.replace(cfg, num_warps=cfg.stored.pds_warps, num_stages=cfg.stored.pds_stages),
        functools.partial(_pds_kernel, cfg=cfg, n_blocks=kp // slots, slots=slots),
        grid=(hp // bh, n),
        in_specs=[pl.BlockSpec((None, bh, dp), lambda h, t: (t, h, 0)),
                  pl.BlockSpec(kvf.shape, lambda h, t: (0, 0)),
                  pl.BlockSpec((None, kp), lambda h, t: (t, 0)),
                  pl.BlockSpec((None, bh, cfg.dv_p), lambda h, t: (t, h, 0)), row, row],
        out_specs=[pl.BlockSpec((None, bh, kp), lambda h, t: (t, h, 0))] * 2,
        out_shape=[ps_shape, ps_shape],
    )(q_c, kvf, idx_c, do_c, lse_c, delta_c)


def _dqkv_mgpu(q_c, do_p, kvf, idx_c, p, ds, part_dtype, interpret: bool):
    """`_dqkv_kernel`'s (dq, dkv partials) by the Mosaic GPU kernel (`sparse_mla_dqkv_mgpu`): heads padded to its
    32, 64 or 128 (q, dO, P, dS zero there), slots (-1; P, dS 0) to a multiple of its two 64-slot blocks, both cut
    back."""
    n, hp, _ = q_c.shape
    kp = idx_c.shape[1]
    hm = 32 if hp <= 32 else 64 if hp <= 64 else round_up(hp, 128)
    km = round_up(kp, 2 * sparse_mla_dqkv_mgpu.BK)
    _warn_head_padding("dq / dkv kernel", hp, hm, hm)
    heads, slots = ((0, 0), (0, hm - hp), (0, 0)), ((0, 0), (0, hm - hp), (0, km - kp))
    dq, parts = sparse_mla_dqkv_mgpu.sparse_mla_dqkv(
        jnp.pad(q_c, heads), jnp.pad(do_p, heads), kvf, jnp.pad(idx_c, ((0, 0), (0, km - kp)), constant_values=-1),
        jnp.pad(p, slots), jnp.pad(ds, slots), part_dtype=part_dtype, interpret=interpret)
    return dq[:, :hp], parts[:, :kp]


def _dqkv(q_c, kvf, idx_c, do_c, p, ds, cfg: _Cfg, part_dtype, dkv=None):
    """The stored backward's second kernel over the column slices: (dq, dkv partials [n, kp, Dqk]), or with
    bwd="atomic" (dq, dkv + these tokens' dkv rows), `dkv` the fp32 [num_keys, Dqk] accumulator aliased in place;
    with dqkv="mosaic_gpu" (stored only) the Mosaic GPU kernel's."""
    n, hp, dp = q_c.shape
    kp = idx_c.shape[1]
    width = cfg.bwd_slice
    do_p = jnp.pad(do_c, ((0, 0), (0, 0), (0, dp - cfg.dv_p)))  # the rope slice gets no P^T dO term
    if cfg.dqkv == "mosaic_gpu":
        dq, parts = _dqkv_mgpu(q_c, do_p, kvf, idx_c, p, ds, part_dtype, cfg.backend == "interpret")
        return dq.astype(q_c.dtype), parts
    slices = pl.BlockSpec((None, hp, width), lambda c, t: (t, 0, c))
    whole = pl.BlockSpec((None, hp, kp), lambda c, t: (t, 0, 0))
    slots = _step_slots(cfg.stored.dqkv_slots, kp)
    kernel = functools.partial(_dqkv_kernel, cfg=cfg, n_blocks=kp // slots, slots=slots)
    cfg_k = dataclasses.replace(cfg, num_warps=cfg.stored.dqkv_warps, num_stages=cfg.stored.dqkv_stages)
    in_specs = [slices, pl.BlockSpec(kvf.shape, lambda c, t: (0, 0)), pl.BlockSpec((None, kp), lambda c, t: (t, 0)),
                slices, whole, whole]
    dq_shape = jax.ShapeDtypeStruct(q_c.shape, q_c.dtype)
    if cfg.bwd == "atomic":
        acc = pl.BlockSpec(dkv.shape, lambda c, t: (0, 0))  # the whole accumulator, updated in place
        return _call(cfg_k, kernel, grid=(dp // width, n), in_specs=[*in_specs, acc], out_specs=[acc, slices],
                     out_shape=[jax.ShapeDtypeStruct(dkv.shape, dkv.dtype), dq_shape],
                     input_output_aliases={6: 0})(q_c, kvf, idx_c, do_p, p, ds, dkv)[::-1]
    return _call(
        cfg_k, kernel, grid=(dp // width, n), in_specs=in_specs,
        out_specs=[slices, pl.BlockSpec((None, kp, width), lambda c, t: (t, 0, c))],
        out_shape=[dq_shape, jax.ShapeDtypeStruct((n, kp, dp), part_dtype)],
    )(q_c, kvf, idx_c, do_p, p, ds)


def _stored_backward_chunk(q_c, kvf, idx_c, do_c, lse_c, delta_c, cfg: _Cfg, part_dtype, dkv=None):
    """(dq, dkv partials) of a token chunk: `_pds`, then `_dqkv`; with bwd="atomic", (dq, dkv + this chunk's dkv)
    with `dkv` the fp32 [num_keys, Dqk] accumulator, aliased in place. Grids put the programs of one token next to
    each other (grid axis 0 varies fastest in launch order), so they meet its gathered rows and its P / dS in L2."""
    p, ds = _pds(q_c, kvf, idx_c, do_c, lse_c, delta_c, cfg)
    return _dqkv(q_c, kvf, idx_c, do_c, p, ds, cfg, part_dtype, dkv=dkv)


def _dq(qf, kvf, idxf, do, lse, delta, cfg: _Cfg):
    n, hp, dp = qf.shape
    kp, bh = idxf.shape[1], cfg.block_h
    row = pl.BlockSpec((None, bh), lambda h, t: (t, h))
    return _call(
        cfg, functools.partial(_dq_kernel, cfg=cfg, n_blocks=kp // cfg.block_i),
        grid=(hp // bh, n),  # a token's head blocks adjacent in launch order (its gathered rows in L2)
        in_specs=[pl.BlockSpec((None, bh, dp), lambda h, t: (t, h, 0)),
                  pl.BlockSpec(kvf.shape, lambda h, t: (0, 0)),
                  pl.BlockSpec((None, kp), lambda h, t: (t, 0)),
                  pl.BlockSpec((None, bh, cfg.dv_p), lambda h, t: (t, h, 0)), row, row],
        out_specs=pl.BlockSpec((None, bh, dp), lambda h, t: (t, h, 0)),
        out_shape=jax.ShapeDtypeStruct(qf.shape, qf.dtype),
    )(qf, kvf, idxf, do, lse, delta)


def _dkv_partials(qf, kvf, idxf, do, lse, delta, cfg: _Cfg, part_dtype):
    n, hp, dp = qf.shape
    kp, bi = idxf.shape[1], cfg.block_i
    heads = pl.BlockSpec((None, hp), lambda j, t: (t, 0))
    return _call(
        cfg, functools.partial(_dkv_kernel, cfg=cfg, n_head_blocks=hp // cfg.block_h),
        grid=(kp // bi, n),  # a token's slot blocks adjacent in launch order (its q and dO in L2)
        in_specs=[*_per_slot_specs(qf, kvf, cfg), pl.BlockSpec((None, hp, cfg.dv_p), lambda j, t: (t, 0, 0)),
                  heads, heads],
        out_specs=pl.BlockSpec((None, bi, dp), lambda j, t: (t, j, 0)),
        out_shape=jax.ShapeDtypeStruct((n, kp, dp), part_dtype),
    )(qf, kvf, idxf, do, lse, delta)


def _reduce_dkv(parts, idxf, cfg: _Cfg):
    """Segment sum of the per-(token, slot) rows into the cache rows, sort-free: a scatter-add of the fp32 rows
    into [B*S (+1 dump row), Dqk] (no atomics in the attention kernels; XLA's scatter does the accumulation).
    Invalid slots go to the dump row, which is dropped. No sort: `jnp.argsort` lowers to CUB's radix sort on GPU,
    which XLA can only compile with a live GPU (and it cost a full pass over the T*K index map)."""
    ids = idxf.reshape(-1)
    ids = jnp.where((ids >= 0) & (ids < cfg.num_keys), ids, cfg.num_keys)
    rows = parts.reshape(ids.shape[0], -1).astype(jnp.float32)
    return jax.ops.segment_sum(rows, ids, num_segments=cfg.num_keys + 1)[:cfg.num_keys]


def _backward_inputs(qf, kvf, out, do, dlse):
    """(dO in the compute dtype, Delta = rowsum(O * dO) - dlse [n, hp] f32, the dkv partials' dtype)."""
    do = do.astype(qf.dtype)
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1) - dlse
    return do, delta, jnp.float32 if kvf.dtype == jnp.float32 else kvf.dtype


def _step_slots(slots: int, kp: int) -> int:
    """Slots per step of a stored-backward kernel over kp (padded by `_stored_slots`) slots: its tile, or all kp."""
    step = min(slots, kp)
    assert kp % step == 0, (slots, kp)
    return step


def _stored_slots(idxf, tiles: StoredTiles):
    """The stored / atomic backward's slots, padded (-1) to whole steps of both of its kernels."""
    kp = idxf.shape[1]
    step = max(min(s, next_pow2(kp)) for s in (tiles.pds_slots, tiles.dqkv_slots))
    return jnp.pad(idxf, ((0, 0), (0, round_up(kp, step) - kp)), constant_values=-1)


def _recompute_cfgs(cfg: _Cfg):
    """(dq kernel's, dkv partials kernel's) configs of the recomputing backward: its smaller bwd_* tiles."""
    return (dataclasses.replace(cfg, block_h=cfg.bwd_block_h),
            dataclasses.replace(cfg, block_i=cfg.bwd_block_i, block_h=cfg.bwd_block_h))


def _backward(qf, kvf, idxf, out, lse, do, dlse, cfg: _Cfg):
    n, hp, dp = qf.shape
    do, delta, part_dtype = _backward_inputs(qf, kvf, out, do, dlse)
    stored = cfg.bwd in ("stored", "atomic") and not cfg.tpu
    atomic = stored and cfg.bwd == "atomic"  # dkv rows added in place by the kernel: no partials, no segment sum
    per_token = 0  # bytes per token of the stored P and dS
    if stored:
        idxf = _stored_slots(idxf, cfg.stored)
        per_token = 2 * hp * idxf.shape[1] * jnp.dtype(kvf.dtype).itemsize
    elif not cfg.tpu:  # GPU: a dq kernel over all tokens; TPU: dq comes with the partials, chunk by chunk
        dq_cfg, dkv_cfg = _recompute_cfgs(cfg)
        dq = _dq(qf, kvf, idxf, do, lse, delta, dq_cfg)
    # Token chunks of bounded size: the dkv partials ([tokens, K, Dqk]) and, stored / atomic, P and dS.
    kp = idxf.shape[1]
    chunk = max(1, min(n, cfg.bwd_partial_bytes // ((0 if atomic else kp * dp * 4) + per_token)))
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def split(a, fill=0):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(n_chunks, chunk, *a.shape[1:])

    def step(dkv, xs):
        q_c, idx_c, do_c, lse_c, delta_c = xs
        if cfg.tpu:  # one fused kernel gives this chunk's dq and its dkv partials, reduced in its row layout
            dq_c, dkv_c = sparse_mla_tpu.backward(q_c, kvf, idx_c[:, None, :], do_c, lse_c[..., None],
                                                  delta_c[..., None], cfg, part_dtype)
            return dkv + dkv_c, dq_c
        if atomic:
            dq_c, dkv = _stored_backward_chunk(q_c, kvf, idx_c, do_c, lse_c, delta_c, cfg, part_dtype, dkv=dkv)
            return dkv, dq_c
        if stored:
            dq_c, parts = _stored_backward_chunk(q_c, kvf, idx_c, do_c, lse_c, delta_c, cfg, part_dtype)
            return dkv + _reduce_dkv(parts, idx_c, cfg), dq_c
        parts = _dkv_partials(q_c, kvf, idx_c, do_c, lse_c, delta_c, dkv_cfg, part_dtype)
        return dkv + _reduce_dkv(parts, idx_c, cfg), None

    xs = (split(qf), split(idxf, -1), split(do), split(lse, -jnp.inf), split(delta))
    dkv, dq_chunks = jax.lax.scan(step, jnp.zeros((cfg.num_keys, dp), jnp.float32), xs)
    if cfg.tpu or stored:
        dq = dq_chunks.reshape(n_chunks * chunk, hp, dp)[:n]
    return dq, dkv.astype(kvf.dtype)


def _keep_tiles(cfg: _Cfg, prefixes: tuple[str, ...]) -> _Cfg:
    """cfg with the stored tiles reset to their defaults except the fields named by `prefixes` (those a stage
    reads), so `_stage_jit` shares one compiled stage among the tile candidates that differ only elsewhere."""
    keep = {f.name: getattr(cfg.stored, f.name) for f in dataclasses.fields(StoredTiles) if f.name.startswith(prefixes)}
    return dataclasses.replace(cfg, stored=StoredTiles(**keep))


@functools.lru_cache(maxsize=None)
def _stage_jit(fn, cfg: _Cfg, **kw):
    """One jitted stage per (function, config): bench/kernels.py's tile sweep builds the stages of many candidates."""
    return jax.jit(functools.partial(fn, cfg=cfg, **kw))


def _dqkv_stage(q_c, kvf, idx_c, do_c, p, ds, dkv=None, *, cfg: _Cfg, part_dtype):
    return _dqkv(q_c, kvf, idx_c, do_c, p, ds, cfg, part_dtype, dkv=dkv)


def default_config(q, kv, topk_idx, scale: float, d_v: int, impl: str, *, bwd: str = "stored", pds: str = "triton",
                   stored_tiles: StoredTiles | None = None, dqkv: str = "triton") -> _Cfg:
    """The kernels' config of `sparse_mla(q, kv, topk_idx, scale, d_v, impl=impl, bwd=, pds=, stored_tiles=)` at
    sparse_mla's default tiles (taken from its signature); q / kv / topk_idx may be ShapeDtypeStructs. For
    `backward_stages` and tools/gpu_compile's tile sweep, which call the backward's kernels one by one."""
    _check_args(q, kv, topk_idx, scale, d_v)
    tiles = {name: p.default for name, p in inspect.signature(sparse_mla).parameters.items()}
    return _config(q, kv, topk_idx, scale, d_v, impl, *(tiles[k] for k in (
        "block_h", "block_i", "bwd_block_h", "bwd_block_i", "num_warps", "num_stages", "bwd_partial_bytes")), bwd, pds,
        stored_tiles, dqkv)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One kernel (or XLA op) of the GPU backward, to be timed alone: `fn(*args)`; `flops` its MMA work (all slots
    counted, the bench's convention); `bytes` what it must move at least through L2 / HBM (gathered rows once per
    program that gathers them, P / dS / partials written or read once, atomics as 4-byte adds), for its GB/s."""
    name: str
    fn: object
    args: tuple
    flops: float = 0.0
    bytes: float = 0.0


def backward_stages(q, kv, topk_idx, scale: float, d_v: int, do, *, impl: str = "pallas_gpu", bwd: str = "stored",
                    pds: str = "triton", pds_only: bool = False,
                    stored_tiles: StoredTiles | None = None, dqkv: str = "triton") -> list[Stage]:
    """The GPU backward of `sparse_mla(..., impl=impl, bwd=bwd, pds=pds, stored_tiles=stored_tiles)` (its default
    forward and recompute tiles) cut into its stages, each over all tokens at once (no token chunks), on the inputs
    the custom VJP would see (the forward runs here once; `do` [B, T, H, d_v] is the output's cotangent, dlse = 0):
    for bench/kernels.py's breakdown rows. The stages' outputs equal the backward's (tests/test_kernels.py checks
    their composition against the reference's gradient). pds_only (stored / atomic): the P / dS stage alone,
    without running the later stages' inputs."""
    if impl not in ("pallas_gpu", "interpret"):
        raise ValueError(f"sparse_mla.backward_stages: impl={impl!r} must be 'pallas_gpu' or 'interpret' (the Triton "
                         "backward's stages)")
    cfg = default_config(q, kv, topk_idx, scale, d_v, impl, bwd=bwd, pds=pds, stored_tiles=stored_tiles, dqkv=dqkv)
    b, t, h, _ = q.shape
    qf, kvf, idxf = _prepare(q, kv, topk_idx, cfg)
    n, hp, dp = qf.shape
    out, lse = _stage_jit(_forward, _keep_tiles(cfg, ()))(qf, kvf, idxf)
    dof, delta, part_dtype = _backward_inputs(
        qf, kvf, out, jnp.pad(do.reshape(n, h, d_v), ((0, 0), (0, hp - h), (0, cfg.dv_p - d_v))), 0.0)
    pairs = b * t * h * topk_idx.shape[-1]
    dqk = q.shape[-1]
    item = jnp.dtype(kv.dtype).itemsize
    slots = b * t * topk_idx.shape[-1]  # (token, slot) pairs
    rows = slots * dqk * item  # every token's selected rows gathered once
    ps = pairs * item  # one [T, H, k] array of P or dS
    reduce = _stage_jit(_reduce_dkv, _keep_tiles(cfg, ()))
    if bwd == "recompute":
        dq_cfg, dkv_cfg = _recompute_cfgs(cfg)
        dq_fn = jax.jit(functools.partial(_dq, cfg=dq_cfg))
        part_fn = jax.jit(functools.partial(_dkv_partials, cfg=dkv_cfg, part_dtype=part_dtype))
        base = (qf, kvf, idxf, dof, lse, delta)
        parts = part_fn(*base)
        n_dq = hp // dq_cfg.block_h  # dq programs per token, each gathering the token's rows
        part_bytes = parts.size * parts.dtype.itemsize
        return [Stage("dq (recompute)", dq_fn, base, 2 * pairs * (2 * dqk + d_v), n_dq * rows),
                Stage("dkv partials (recompute)", part_fn, base, 2 * pairs * 2 * (dqk + d_v), rows + part_bytes),
                Stage("dkv segment sum", reduce, (parts, idxf), bytes=part_bytes)]
    idxf = _stored_slots(idxf, cfg.stored)
    pds_fn = _stage_jit(_pds, _keep_tiles(cfg, ("pds_",)))
    pds_args = (qf, kvf, idxf, dof, lse, delta)
    groups = -(-h // 64)  # both P / dS kernels gather per (token, 64 heads)
    stages = [Stage(f"P/dS ({pds})", pds_fn, pds_args, 2 * pairs * (dqk + d_v), groups * rows + 2 * ps)]
    if pds_only:
        return stages
    p, ds = pds_fn(*pds_args)
    dqkv_flops = 2 * pairs * (2 * dqk + d_v)
    dqkv_fn = _stage_jit(_dqkv_stage, _keep_tiles(cfg, ("dqkv_",)), part_dtype=part_dtype)
    if bwd == "atomic":
        zeros = jnp.zeros((cfg.num_keys, dp), jnp.float32)
        return stages + [Stage("dq/dkv (atomic)", dqkv_fn, (qf, kvf, idxf, dof, p, ds, zeros), dqkv_flops,
                               rows + 2 * ps + slots * dqk * 4)]
    parts = dqkv_fn(qf, kvf, idxf, dof, p, ds)[1]
    part_bytes = parts.size * parts.dtype.itemsize
    name = "dq/dkv partials (stored)" if dqkv == "triton" else f"dq/dkv partials (stored, {dqkv})"
    return stages + [Stage(name, dqkv_fn, (qf, kvf, idxf, dof, p, ds), dqkv_flops, rows + 2 * ps + part_bytes),
                     Stage("dkv segment sum", reduce, (parts, idxf), bytes=part_bytes)]


# ------------------------------------------------------------------------------------------ custom VJP core
def _folded(fn, cfg: _Cfg, *kinds):
    """fn(*arrays, cfg=cfg) whose jax.vmap folds the mapped axis into the tokens and cache rows (`_vmap`: the
    Mosaic TPU compiler refuses the grid axis pallas_call's batching would add to the cache's HBM block); the
    folded call's cfg counts V x the cache rows."""
    return fold_vmap(lambda f: functools.partial(
        fn, cfg=cfg if f == 1 else dataclasses.replace(cfg, num_keys=cfg.num_keys * f)), kinds)


def _forward_folded(qf, kvf, idxf, cfg: _Cfg):
    return _folded(_forward, cfg, ROWS, KEYS, INDEX)(qf, kvf, idxf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _core(qf, kvf, idxf, cfg: _Cfg):
    return _forward_folded(qf, kvf, idxf, cfg)


def _core_fwd(qf, kvf, idxf, cfg: _Cfg):
    out, lse = _forward_folded(qf, kvf, idxf, cfg)
    return (out, lse), (qf, kvf, idxf, out, lse)


def _core_bwd(cfg: _Cfg, res, cts):
    qf, kvf, idxf, out, lse = res
    do, dlse = cts
    dq, dkv = _folded(_backward, cfg, ROWS, KEYS, INDEX, ROWS, ROWS, ROWS, ROWS)(
        qf, kvf, idxf, out, lse, do, jnp.where(jnp.isfinite(lse), dlse, 0.0))
    return dq, dkv, None


_core.defvjp(_core_fwd, _core_bwd)


# ------------------------------------------------------------------------------------------------ layout
def _split_pad(x, cfg: _Cfg):
    """[..., Dqk] -> [..., dv_p + dt_p]: value dims zero-padded to dv_p, rope dims to dt_p."""
    if not cfg.padded:
        return x
    pad = [(0, 0)] * (x.ndim - 1)
    return jnp.concatenate([jnp.pad(x[..., :cfg.d_v], pad + [(0, cfg.dv_p - cfg.d_v)]),
                            jnp.pad(x[..., cfg.d_v:], pad + [(0, cfg.dt_p - cfg.d_tail)])], axis=-1)


def _unsplit(x, cfg: _Cfg):
    if not cfg.padded:
        return x
    return jnp.concatenate([x[..., :cfg.d_v], x[..., cfg.dv_p:cfg.dv_p + cfg.d_tail]], axis=-1)


def _prepare(q, kv, topk_idx, cfg: _Cfg):
    b, t, h, _ = q.shape
    s, k = kv.shape[1], topk_idx.shape[-1]
    hp = round_up(h, cfg.block_h)
    kp = round_up(k, cfg.block_i)
    qf = _split_pad(q.astype(kv.dtype), cfg).reshape(b * t, h, -1)
    qf = jnp.pad(qf, ((0, 0), (0, hp - h), (0, 0)))
    kvf = _split_pad(kv, cfg).reshape(b * s, -1)
    ok = (topk_idx >= 0) & (topk_idx < s)  # in the caller's dtype: an int64 2^32 + 1 is no key 1
    idx = jnp.where(ok, topk_idx.astype(jnp.int32) + (jnp.arange(b, dtype=jnp.int32) * s)[:, None, None], -1)
    idxf = jnp.pad(idx.reshape(b * t, k), ((0, 0), (0, kp - k)), constant_values=-1)
    return qf, kvf, idxf


KV_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_args(q, kv, topk_idx, scale, d_v):
    """What every impl needs, checked before dispatch (a ValueError naming the argument): ranks (a 4-D kv ran on
    its first [.., 0, :] plane), integer indices (a float -0.5 was truncated to the valid slot 0), an integer d_v,
    a finite scale, floating q and kv (an e4m3 kv rounded q and P to e4m3: 5e-2 off; dequantize a FP8 cache
    first, as the model's decode does)."""
    if (q.ndim, kv.ndim, topk_idx.ndim) != (4, 3, 3):
        raise ValueError(f"sparse_mla: needs q [B, T, H, Dqk], kv [B, S, Dqk], topk_idx [B, T, K]; got q "
                         f"{tuple(q.shape)}, kv {tuple(kv.shape)}, topk_idx {tuple(topk_idx.shape)}")
    if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(f"sparse_mla: topk_idx must be an integer array (got {topk_idx.dtype})")
    if not is_int(d_v):
        raise ValueError(f"sparse_mla: d_v must be an integer (got {d_v!r})")
    if kv.shape[-1] != q.shape[-1] or not 0 < d_v <= q.shape[-1]:
        raise ValueError(f"sparse_mla: q {q.shape} / kv {kv.shape} need the same last dim Dqk and 0 < d_v <= Dqk "
                         f"(got d_v={d_v})")
    if topk_idx.shape[:2] != q.shape[:2] or kv.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_mla: batch/token dims of q {q.shape}, kv {kv.shape}, topk_idx {topk_idx.shape} "
                         "disagree")
    if not isinstance(scale, jax.core.Tracer) and not math.isfinite(float(scale)):
        raise ValueError(f"sparse_mla: scale must be finite (got {scale!r})")
    for name, a in (("q", q), ("kv", kv)):
        if not any(jnp.dtype(a.dtype) == jnp.dtype(d) for d in KV_DTYPES):
            raise ValueError(f"sparse_mla: {name} must be float32, bfloat16 or float16 (got {a.dtype}; a FP8 cache "
                             "is dequantized first)")


def _check_backward_options(bwd, stored_tiles) -> StoredTiles:
    """The backward's options (GPU-only, ignored elsewhere, but checked on every impl); returns the tiles."""
    stored = StoredTiles() if stored_tiles is None else stored_tiles
    if not isinstance(stored, StoredTiles):
        raise ValueError(f"sparse_mla: stored_tiles must be a sparse_mla.StoredTiles or None (got {stored!r})")
    stored.check()
    if bwd not in MLA_BWDS:
        raise ValueError(f"sparse_mla: bwd={bwd!r} must be one of {MLA_BWDS}")
    return stored


def _config(q, kv, topk_idx, scale, d_v, impl, block_h, block_i, bwd_block_h, bwd_block_i, num_warps, num_stages,
            bwd_partial_bytes, bwd="stored", pds="triton", stored_tiles=None, dqkv="triton", mgpu_form="split"):
    """The kernels' config; the caller has run `_check_args` (sparse_mla before dispatch, default_config)."""
    h, dqk = q.shape[2], q.shape[3]
    d_tail = dqk - d_v
    stored = _check_backward_options(bwd, stored_tiles)
    fwd = "triton"
    if impl in MGPU_BACKENDS:  # the Mosaic GPU forward; the Triton kernels (or their interpret runs) for the rest
        impl, fwd = MGPU_BACKENDS[impl], "mosaic_gpu"
    common = dict(scale=float(scale), d_v=d_v, d_tail=d_tail, backend=impl, num_warps=num_warps,
                  num_stages=num_stages, bwd_partial_bytes=bwd_partial_bytes, num_keys=kv.shape[0] * kv.shape[1])
    if impl in TPU_BACKENDS:  # all heads in one block; slots by 8; the row layout of sparse_mla_tpu (its docstring)
        block_i = min(128 if block_i is None else block_i, round_up(topk_idx.shape[-1], 8))
        if block_i < 8 or block_i % 8:
            raise ValueError(f"sparse_mla: block_i={block_i} must be a positive multiple of 8 on TPU (128 is best)")
        if impl == "pallas_tpu" and block_i % 128 and block_i < topk_idx.shape[-1]:
            raise ValueError(f"sparse_mla: block_i={block_i} must be a multiple of 128 or cover all "
                             f"{topk_idx.shape[-1]} slots for Mosaic (a slot block is a lane block of the indices)")
        hp = round_up(h, 8)
        dv_p, dt_p = sparse_mla_tpu.padded_dims(d_v, d_tail, kv.dtype)
        return _Cfg(dv_p=dv_p, dt_p=dt_p, block_h=hp, block_i=block_i, bwd_block_h=hp, bwd_block_i=block_i,
                    **common)
    block_h = min(block_h, next_pow2(h, 16))
    block_i = min(32 if block_i is None else block_i, next_pow2(topk_idx.shape[-1], 16))
    for name, size in (("block_h", block_h), ("block_i", block_i), ("bwd_block_h", bwd_block_h),
                       ("bwd_block_i", bwd_block_i)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"sparse_mla: {name}={size} must be a power of two >= 16")
    dv_p, dt_p = next_pow2(d_v, 16), next_pow2(max(d_tail, 1), 16)
    return _Cfg(dv_p=dv_p, dt_p=dt_p, block_h=block_h, block_i=block_i, bwd_block_h=min(bwd_block_h, block_h),
                bwd_block_i=min(bwd_block_i, block_i), bwd=bwd, fwd=fwd, pds=pds, dqkv=dqkv, stored=stored,
                mgpu_form=mgpu_form, **common)


def sparse_mla(q, kv, topk_idx, scale: float, d_v: int, *, return_probs: bool = False, impl: str | None = None,
               block_h: int = 64, block_i: int | None = None, bwd_block_h: int = 32, bwd_block_i: int = 32,
               num_warps: int = 8, num_stages: int = 2, bwd_partial_bytes: int = 1 << 29, bwd: str = "stored",
               fwd: str = "triton", pds: str = "triton", stored_tiles: StoredTiles | None = None,
               dqkv: str = "triton", q_chunk: int | None = 64):
    """Sparse MLA, eq. (2). q [B, T, H, Dqk], kv [B, S, Dqk], topk_idx [B, T, K] -> (out [B, T, H, d_v], lse
    [B, T, H] f32 natural log) and, with return_probs, probabilities summed over heads [B, T, K] f32.

    Differentiable w.r.t. q and kv (custom VJP: the atomic-free dq / dkv kernels above; lse is differentiable
    too). The head-summed probabilities carry no gradient. The kernels multiply q and kv in kv's dtype: a q wider
    than the cache (float32 q, bf16 kv) is rounded to it first (the reference multiplies in float32), and out and
    dq come back in q's dtype. Backends: pallas_gpu and interpret (Triton kernels),
    mosaic_gpu and interpret_mosaic_gpu (the Hopper forward of `sparse_mla_mgpu`, issue 31 item 2: Dqk 576, d_v 512,
    bf16 cache; backward and probabilities by the Triton kernels; opt-in: pallas_gpu keeps the Triton forward until
    the Mosaic GPU one is verified and timed on a chip), pallas_tpu and interpret_tpu (Mosaic TPU kernels,
    `sparse_mla_tpu`); CPU runs the reference
    `dsv32_jax.model.attention.sparse_mla`. A flattened-token batch is B = 1 with global indices.
    Tiles (GPU): forward BH x BI = block_h x block_i (default 64 x 32: 64 x 64 needs 221,440 B of shared memory
    (95%) and spills at 255 registers on an H100, see BENCHMARKS.md); backward dq and dkv programs hold bwd_block_h
    heads per step, dkv programs bwd_block_i slots (smaller defaults: their fp32 accumulators are [tile, 576]); all powers
    of two >= 16. TPU: all heads per program, block_i slots per gathered block (default 128, a multiple of 8);
    block_h / bwd_* / num_* and bwd are GPU-only (the TPU kernels have one fused backward). bwd: "stored" (the
    default: P and dS computed once and stored for one token chunk at a time, see the module docstring; 84-88
    TFLOP/s on an H200 at k 2048, 128 heads), "atomic" (the stored backward with dkv added in place by fp32
    atomics: no [T, k, Dqk] partials and no segment sum; opt-in until a chip times it; not bitwise reproducible) or
    "recompute" (the dq and dkv kernels above, each recomputing S and dP; 62-64 TFLOP/s in the same run).
    fwd: "triton" (the default) or "mosaic_gpu" (with impl pallas_gpu / interpret: the same as impl mosaic_gpu /
    interpret_mosaic_gpu, for `RunOptions.mla_fwd`; ignored by the TPU and reference impls; raises on inputs the
    Mosaic GPU forward cannot serve) or "mosaic_gpu_pingpong" (the same kernel module in its ping-pong form at 64
    heads per CTA: a key block per warpgroup, S on wgmma N = 64; `sparse_mla_mgpu._kernel_pp`). stored_tiles: the stored / atomic backward's Triton tiles (`StoredTiles`;
    None: its defaults). pds: the stored / atomic backward's P and dS kernel, "triton" (the default,
    `_pds_kernel`) or "mosaic_gpu" (`sparse_mla_pds_mgpu`, issue 31 item 3; opt-in until a chip times it; raises on
    inputs it cannot serve, like fwd); for `RunOptions.mla_pds`; ignored by bwd="recompute" and by the TPU and
    reference impls. dqkv: the stored backward's dq and dkv kernel, "triton" (the default, `_dqkv_kernel`) or
    "mosaic_gpu" (`sparse_mla_dqkv_mgpu`, issue 31 item 3; opt-in until a chip times it; bwd="stored" only, at most
    128 heads, bf16 q; raises on inputs it cannot serve); for `RunOptions.mla_dqkv`; ignored by the TPU and reference
    impls. The Mosaic GPU kernels run 64 heads per CTA (dq / dkv: 64 or 128): fewer heads (per device, under a
    mesh) are padded to 64, which multiplies their MMA work and q / dO / P / dS memory (4x at 16 heads; BENCHMARKS.md
    "Head padding"); all three run 32 or fewer heads in their keys-as-M forms (32 per CTA: 2x at 16 heads).
    q_chunk: the query chunk of the reference that runs where no kernel does (impl "reference"; RunOptions.attn_chunk).
    """
    def unsupported(backend, kernel="forward"):
        if backend not in MGPU_BACKENDS:
            return None
        if (q.shape[-1], d_v) != (sparse_mla_mgpu.DQK, sparse_mla_mgpu.DV) or kv.dtype != jnp.bfloat16:
            return (f"its Mosaic GPU {kernel} needs Dqk {sparse_mla_mgpu.DQK}, d_v {sparse_mla_mgpu.DV} and a bf16 "
                    f"cache (got Dqk {q.shape[-1]}, d_v {d_v}, kv {kv.dtype})")
        return None

    _check_args(q, kv, topk_idx, scale, d_v)
    if fwd not in MLA_FWDS:
        raise ValueError(f"sparse_mla: fwd={fwd!r} must be one of {MLA_FWDS}")
    _check_backward_options(bwd, stored_tiles)  # whatever impl runs: a typo fails on a CPU too
    if pds not in MLA_PDS:
        raise ValueError(f"sparse_mla: pds={pds!r} must be one of {MLA_PDS}")
    if dqkv not in MLA_DQKV:
        raise ValueError(f"sparse_mla: dqkv={dqkv!r} must be one of {MLA_DQKV}")
    impl = resolve_impl(impl, ("pallas_gpu", "interpret", "pallas_tpu", "interpret_tpu", *MGPU_BACKENDS),
                        op="sparse_mla", shapes={"q": q, "kv": kv, "topk_idx": topk_idx}, unsupported=unsupported)
    if fwd.startswith("mosaic_gpu") and impl in ("pallas_gpu", "interpret"):  # the Triton impls, with the Mosaic GPU
        impl = {triton: mgpu for mgpu, triton in MGPU_BACKENDS.items()}[impl]  # forward
        if (why := unsupported(impl)) is not None:
            raise ValueError(f"sparse_mla: fwd={fwd!r} cannot run on q {q.shape}, kv {kv.shape} {kv.dtype}: {why}")
    if pds == "mosaic_gpu" and bwd != "recompute" and impl not in ("pallas_tpu", "interpret_tpu", "reference"):
        if (why := unsupported("mosaic_gpu", "P / dS kernel")) is not None:
            raise ValueError(f"sparse_mla: pds='mosaic_gpu' cannot run on q {q.shape}, kv {kv.shape} {kv.dtype}: "
                             f"{why}")
    if dqkv == "mosaic_gpu" and impl not in ("pallas_tpu", "interpret_tpu", "reference"):
        why = unsupported("mosaic_gpu", "dq / dkv kernel")
        if why is None and bwd != "stored":
            why = f"it writes the stored backward's partials: needs bwd='stored' (got {bwd!r})"
        if why is None and (q.shape[2] > 128 or q.dtype != jnp.bfloat16):
            why = f"it needs at most 128 heads and a bf16 q (got {q.shape[2]} heads, q {q.dtype})"
        if why is not None:
            raise ValueError(f"sparse_mla: dqkv='mosaic_gpu' cannot run on q {q.shape} {q.dtype}, kv {kv.shape} "
                             f"{kv.dtype}: {why}")
    if impl == "reference" or 0 in (*q.shape, kv.shape[1], topk_idx.shape[-1]):  # no work for a kernel: the
        return attention.sparse_mla(q, kv, topk_idx, scale, d_v, return_probs=return_probs,  # reference's zeros
                                    q_chunk=q_chunk)
    if isinstance(scale, jax.core.Tracer):
        raise ValueError(f"sparse_mla: impl={impl!r} compiles scale into its kernels: it must be a Python float, "
                         "not a traced value (impl='reference' takes one)")
    cfg = _config(q, kv, topk_idx, scale, d_v, impl, block_h, block_i, bwd_block_h, bwd_block_i, num_warps,
                  num_stages, bwd_partial_bytes, bwd, pds, stored_tiles, dqkv,
                  "pingpong" if fwd == "mosaic_gpu_pingpong" else "split")
    b, t, h, _ = q.shape
    k = topk_idx.shape[-1]
    qf, kvf, idxf = _prepare(q, kv, topk_idx, cfg)
    out, lse = _core(qf, kvf, idxf, cfg)
    out = out[:, :h, :d_v].reshape(b, t, h, d_v).astype(q.dtype)
    lse_bth = lse[:, :h].reshape(b, t, h)
    if not return_probs:
        return out, lse_bth
    lse_real = jnp.where(jnp.arange(lse.shape[1]) < h, jax.lax.stop_gradient(lse), -jnp.inf)  # drop padded heads
    probs = _folded(_head_summed_probs, cfg, ROWS, KEYS, INDEX, ROWS)(*jax.lax.stop_gradient((qf, kvf)), idxf,
                                                                      lse_real)
    return out, lse_bth, probs[:, :k].reshape(b, t, k)
