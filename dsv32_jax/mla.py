"""Multi-head Latent Attention with DeepSeek Sparse Attention.

MHA mode decompresses per-head keys/values through W_UK / W_UV; absorbed MQA mode folds W_UK into the
query and attends over one shared [c_kv ; k_pe] latent row per token (reference_spec.md section 4). DSA runs
on MQA mode: the indexer picks k rows per query and `attention.sparse_mla` gathers only those.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv32_jax import attention
from dsv32_jax.config import ModelConfig
from dsv32_jax.fp8 import act_dequant, act_quant, fake_quant
from dsv32_jax.indexer import Indexer, indexer_topk, quantize_keys
from dsv32_jax.indexer_loss import dense_indexer_kl, sparse_indexer_kl
from dsv32_jax.layers import Dense, RMSNorm
from dsv32_jax.options import RunOptions
from dsv32_jax.rope import apply_rope_interleaved
from dsv32_jax.sharding import BATCH_AXES, SEQ_AXIS, current_mesh


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Positions:
    """Per-token bookkeeping shared by every layer: RoPE tables and the visibility inputs."""

    cos: jnp.ndarray  # [B, T, rope_dim / 2]
    sin: jnp.ndarray
    q_index: jnp.ndarray  # [B, T] index of each query among the keys (causal bound)
    q_segment: jnp.ndarray  # [B, T] document id of each query
    kv_segment: jnp.ndarray  # [B, S] document id of each key


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        std = cfg.initializer_range
        h = cfg.num_attention_heads
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=std)
        self.q_a_proj = Dense(cfg.hidden_size, cfg.q_lora_rank, ("embed", "q_lora"), **kw)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.q_b_proj = Dense(cfg.q_lora_rank, h * cfg.qk_head_dim, ("q_lora", "heads"), **kw)
        self.kv_a_proj = Dense(cfg.hidden_size, cfg.kv_latent_dim, ("embed", "kv_lora"), **kw)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.kv_b_proj = Dense(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora", "heads"), **kw)
        self.o_proj = Dense(h * cfg.v_head_dim, cfg.hidden_size, ("heads", "embed"), **kw)
        self.indexer = Indexer(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.cfg = cfg
        self.dtype = dtype

    def init_cache(self, batch: int, length: int, opts: RunOptions) -> dict:
        """Decode cache of this layer: latent c_kv (e4m3 codes + per-128 scales with fp8_kv), rope key k_pe, and the
        indexer key (Hadamard-rotated e4m3 codes + per-token scale with indexer_fp8)."""
        cfg = self.cfg
        cache = {"k_pe": jnp.zeros((batch, length, cfg.qk_rope_head_dim), self.dtype)}
        if opts.fp8_kv:
            cache["c_kv"] = jnp.zeros((batch, length, cfg.kv_lora_rank), jnp.float8_e4m3fn)
            cache["c_kv_scale"] = jnp.ones((batch, length, cfg.kv_lora_rank // self._kv_block), jnp.float32)
        else:
            cache["c_kv"] = jnp.zeros((batch, length, cfg.kv_lora_rank), self.dtype)
        if opts.indexer_fp8:
            cache["idx_k"] = jnp.zeros((batch, length, cfg.index_head_dim), jnp.float8_e4m3fn)
            cache["idx_k_scale"] = jnp.ones((batch, length), jnp.float32)
        else:
            cache["idx_k"] = jnp.zeros((batch, length, cfg.index_head_dim), self.dtype)
        return cache

    @property
    def _kv_block(self) -> int:
        return 128 if self.cfg.kv_lora_rank % 128 == 0 else self.cfg.kv_lora_rank

    def _write_cache(self, cache: dict, index, c_kv, k_pe, k_idx, opts: RunOptions):
        """Writes the new tokens at slots [index, index + T) and returns (new cache, full c_kv, full k_pe,
        full indexer keys, their scales or None)."""
        def put(buf, new):
            return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), index, axis=1)

        new = dict(cache)
        if opts.fp8_kv:
            codes, scale = act_quant(c_kv, block=self._kv_block)
            new["c_kv"], new["c_kv_scale"] = put(cache["c_kv"], codes), put(cache["c_kv_scale"], scale)
            c_kv_all = act_dequant(new["c_kv"], new["c_kv_scale"], self.dtype)
        else:
            new["c_kv"] = c_kv_all = put(cache["c_kv"], c_kv)
        new["k_pe"] = put(cache["k_pe"], k_pe)
        k_scale = None
        if opts.indexer_fp8:
            codes, scale = quantize_keys(k_idx)
            new["idx_k"], new["idx_k_scale"] = put(cache["idx_k"], codes), put(cache["idx_k_scale"], scale)
            k_scale = new["idx_k_scale"]
        else:
            new["idx_k"] = put(cache["idx_k"], k_idx)
        return new, c_kv_all, new["k_pe"], new["idx_k"], k_scale

    def latents(self, x: jnp.ndarray, pos: Positions, opts: RunOptions, quantize_kv: bool = True):
        """Projections shared by both modes: c_q, q_nope, rope'd q_pe, c_kv, rope'd k_pe."""
        cfg = self.cfg
        b, t, _ = x.shape
        c_q = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(c_q).reshape(b, t, cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        q_pe = apply_rope_interleaved(q_pe, pos.cos[:, :, None], pos.sin[:, :, None])
        kv = self.kv_a_proj(x)
        c_kv = self.kv_a_norm(kv[..., : cfg.kv_lora_rank])
        if opts.fp8_kv and quantize_kv:
            c_kv = fake_quant(c_kv, block=self._kv_block)
        k_pe = apply_rope_interleaved(kv[..., cfg.kv_lora_rank:], pos.cos, pos.sin)
        return c_q, q_nope, q_pe, c_kv, k_pe

    def indexer_inputs(self, x, c_q, pos: Positions):
        """Indexer q, k, w from detached inputs: the indexer learns only from its own KL loss (eq. 4)."""
        return self.indexer.project(jax.lax.stop_gradient(x), jax.lax.stop_gradient(c_q), pos.cos, pos.sin)

    def kv_up(self):
        """W_UK [kv_lora, H, nope] and W_UV [kv_lora, H, v] views of kv_b_proj."""
        cfg = self.cfg
        w = self.kv_b_proj.kernel[...].astype(self.dtype)
        w = w.reshape(cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        return w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]

    def __call__(self, x: jnp.ndarray, pos: Positions, opts: RunOptions, cache: dict | None = None):
        """x [B, T, D] -> (out [B, T, D], aux). aux: "topk" [B, T, k] (None when DSA is off) and, with
        opts.indexer_loss, "indexer_kl" [B, T] (and "indexer_captured" [B, T] for the dense objective).

        With a decode `cache` (from `init_cache`), the new tokens are written at slot pos.q_index[0, 0] onward and
        attend over the whole cache (pos.kv_segment describes its slots); aux["cache"] is the updated cache.

        opts.attention="kernel" runs both halves of DSA on `dsv32_jax.kernels` (impl=None: the platform's kernels
        or the DSV32_KERNEL_IMPL / set_default_impl preference): the selection with `kernels.indexer_topk`
        (Hadamard FP8 quant -> indexer logits -> radix-select top-k with opts.indexer_fp8, exact JAX scores ->
        top-k kernel without), in training/prefill and in decode (cached keys go in as e4m3 codes + k_scale), and
        attention with `kernels.sparse_mla`. The selection is not differentiated (the indexer learns from its KL)."""
        cfg = self.cfg
        b, t, _ = x.shape
        c_q, q_nope, q_pe, c_kv, k_pe = self.latents(x, pos, opts, quantize_kv=cache is None)
        vis = (pos.q_index, pos.q_segment, pos.kv_segment)
        aux = {"topk": None}
        k_scale = q_i = k_i = w_i = None
        if opts.dsa or opts.indexer_loss or cache is not None:
            q_i, k_i, w_i = self.indexer_inputs(x, c_q, pos)
        if cache is not None:
            aux["cache"], c_kv, k_pe, k_i, k_scale = self._write_cache(cache, pos.q_index[0, 0], c_kv, k_pe, k_i, opts)
        w_uk, w_uv = self.kv_up()
        scale = cfg.softmax_scale
        q_lat = jnp.concatenate([jnp.einsum("bthd,chd->bthc", q_nope, w_uk), q_pe], axis=-1)
        kv_lat = jnp.concatenate([c_kv, k_pe], axis=-1)
        if opts.mla_mode == "mqa":
            attend = functools.partial(mqa_attend, cfg=cfg, opts=opts, k_scale=k_scale)
            q_side, kv_side = (q_lat, q_i, w_i, pos.q_index, pos.q_segment), (kv_lat, k_i, pos.kv_segment)
            mesh = current_mesh()
            if cache is None and mesh is not None and mesh.shape.get(SEQ_AXIS, 1) > 1:
                o_lat, core_aux = seq_parallel(attend, mesh, q_side, kv_side)
            else:
                o_lat, core_aux = attend(*q_side, *kv_side)
            aux.update(core_aux)
            o = jnp.einsum("bthc,chd->bthd", o_lat, w_uv)
        else:  # decompressed MHA mode: the dense reference (no sequence parallelism, no kernels)
            if opts.dsa:
                aux["topk"] = jax.lax.stop_gradient(indexer_topk(q_i, k_i, w_i, *vis, cfg.index_topk,
                                                                 fp8=opts.indexer_fp8, q_chunk=opts.index_chunk,
                                                                 k_scale=k_scale))
            if opts.indexer_loss == "dense":
                aux["indexer_kl"], aux["indexer_captured"] = dense_indexer_kl(
                    q_lat, kv_lat, scale, q_i, k_i, w_i, *vis, cfg.index_topk, q_chunk=opts.attn_chunk)
            kv = jnp.einsum("bsc,chd->bshd", c_kv, jnp.concatenate([w_uk, w_uv], axis=-1))
            k = jnp.concatenate(
                [kv[..., : cfg.qk_nope_head_dim],
                 jnp.broadcast_to(k_pe[:, :, None], (*k_pe.shape[:2], cfg.num_attention_heads, cfg.qk_rope_head_dim))],
                axis=-1)
            o, _ = attention.dense_mha(jnp.concatenate([q_nope, q_pe], -1), k, kv[..., cfg.qk_nope_head_dim:], *vis,
                                       scale, topk_idx=aux["topk"], q_chunk=opts.attn_chunk)
        return self.o_proj(o.reshape(b, t, cfg.num_attention_heads * cfg.v_head_dim)), aux


def mqa_attend(q_lat, q_i, w_i, q_index, q_segment, kv_lat, k_i, kv_segment, *, cfg: ModelConfig, opts: RunOptions,
               k_scale=None):
    """DSA in absorbed MQA mode for queries [B, T] against keys [B, S]: the indexer's top-k selection (eq. 1), the
    indexer objective (eq. 3 dense / eq. 4 sparse) and attention (dense_mqa, or eq. 2 on the selected rows).
    q_lat [B, T, H, Dqk], q_i [B, T, H_I, D], w_i [B, T, H_I], q_index / q_segment [B, T]; kv_lat [B, S, Dqk],
    k_i [B, S, D], kv_segment [B, S]. Returns (o_lat [B, T, H, kv_lora_rank], aux: topk, indexer_kl, ...).
    Queries only meet keys through q_index / segments, so a slice of the queries against all keys gives that
    slice of the result: what `seq_parallel` relies on."""
    vis = (q_index, q_segment, kv_segment)
    scale = cfg.softmax_scale
    aux = {"topk": None}
    if opts.dsa:
        select = indexer_topk
        if opts.attention == "kernel":
            from dsv32_jax.kernels import indexer_topk as select
        aux["topk"] = jax.lax.stop_gradient(select(q_i, k_i, w_i, *vis, cfg.index_topk, fp8=opts.indexer_fp8,
                                                   q_chunk=opts.index_chunk, k_scale=k_scale))
    if opts.indexer_loss == "dense":
        aux["indexer_kl"], aux["indexer_captured"] = dense_indexer_kl(
            q_lat, kv_lat, scale, q_i, k_i, w_i, *vis, cfg.index_topk, q_chunk=opts.attn_chunk)
    if not opts.dsa or opts.attention == "dense":
        o_lat, _ = attention.dense_mqa(q_lat, kv_lat, *vis, scale, cfg.kv_lora_rank, topk_idx=aux["topk"],
                                       q_chunk=opts.attn_chunk)
        return o_lat, aux
    if opts.attention == "sparse" and opts.indexer_loss != "sparse" and cfg.index_topk >= kv_lat.shape[1]:
        # index_topk covers every key (S <= k: short sequences, a small decode cache): the selection is each query's
        # whole visible set (indexer_topk keeps min(k, S) keys), so eq. 2 over it is attention over the visible
        # keys, computed without gathering k rows of 576 values per query (on a 2-core CPU a trip-planning SFT step,
        # S = 576 and k = 1,024, takes 4.5x less time: BENCHMARKS.md). aux["topk"] is still the indexer's selection
        # (the sampler records it). The kernel path keeps its kernels, and eq. 4 needs the per-slot probabilities.
        o_lat, _ = attention.dense_mqa(q_lat, kv_lat, *vis, scale, cfg.kv_lora_rank, q_chunk=opts.attn_chunk)
        return o_lat, aux
    if opts.attention == "sparse":
        sparse = functools.partial(attention.sparse_mla, q_chunk=opts.attn_chunk)
    else:
        from dsv32_jax.kernels import sparse_mla as sparse
    if opts.indexer_loss == "sparse":
        o_lat, _, head_probs = sparse(q_lat, kv_lat, aux["topk"], scale, cfg.kv_lora_rank, return_probs=True)
        aux["indexer_kl"] = sparse_indexer_kl(head_probs, aux["topk"], q_i, k_i, w_i, q_chunk=opts.attn_chunk)
    else:
        o_lat, _ = sparse(q_lat, kv_lat, aux["topk"], scale, cfg.kv_lora_rank)
    return o_lat, aux


def seq_parallel(attend, mesh, q_side: tuple, kv_side: tuple):
    """Sequence (context) parallelism over the mesh axis "seq": each device keeps its slice of the queries (dim 1
    of every q_side array) and all-gathers the keys' side (the 576-d latent rows, the indexer keys and their
    segment ids: O(L) bytes, the only communication; its transpose in the backward is a reduce-scatter), then runs
    `attend` on local queries against all keys. The batch axes are manual too (rows are independent), so the
    all-gather stays within each device's own sequences (left automatic, GSPMD gathered every sequence of the
    batch); the heads' axis stays automatic."""
    rows = q_side[0].shape[0]
    batch = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
    if rows % math.prod(mesh.shape[a] for a in batch):
        batch = ()
    spec = P(batch or None, SEQ_AXIS)

    def local(q_side, kv_side):
        kv_side = jax.tree.map(lambda a: jax.lax.all_gather(a, SEQ_AXIS, axis=1, tiled=True), kv_side)
        return attend(*q_side, *kv_side)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec, axis_names={SEQ_AXIS, *batch},
                         check_vma=False)(q_side, kv_side)
