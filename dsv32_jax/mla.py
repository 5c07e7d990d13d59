"""Multi-head Latent Attention with DeepSeek Sparse Attention.

MHA mode decompresses per-head keys/values through W_UK / W_UV; absorbed MQA mode folds W_UK into the
query and attends over one shared [c_kv ; k_pe] latent row per token (reference_spec.md section 4). DSA runs
on MQA mode: the indexer picks k rows per query and `attention.sparse_mla` gathers only those.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsv32_jax import attention
from dsv32_jax.config import ModelConfig
from dsv32_jax.fp8 import fake_quant
from dsv32_jax.indexer import Indexer, indexer_topk
from dsv32_jax.layers import Dense, RMSNorm
from dsv32_jax.options import RunOptions
from dsv32_jax.rope import apply_rope_interleaved


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

    def latents(self, x: jnp.ndarray, pos: Positions, opts: RunOptions):
        """Projections shared by both modes: c_q, q_nope, rope'd q_pe, c_kv, rope'd k_pe."""
        cfg = self.cfg
        b, t, _ = x.shape
        c_q = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(c_q).reshape(b, t, cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        q_pe = apply_rope_interleaved(q_pe, pos.cos[:, :, None], pos.sin[:, :, None])
        kv = self.kv_a_proj(x)
        c_kv = self.kv_a_norm(kv[..., : cfg.kv_lora_rank])
        if opts.fp8_kv:
            block = 128 if cfg.kv_lora_rank % 128 == 0 else cfg.kv_lora_rank
            c_kv = fake_quant(c_kv, block=block)
        k_pe = apply_rope_interleaved(kv[..., cfg.kv_lora_rank:], pos.cos, pos.sin)
        return c_q, q_nope, q_pe, c_kv, k_pe

    def select(self, x, c_q, pos: Positions, opts: RunOptions) -> jnp.ndarray:
        """Indexer top-k [B, T, k]. Its inputs are detached: the indexer learns only from its own KL loss."""
        q, k, w = self.indexer.project(jax.lax.stop_gradient(x), jax.lax.stop_gradient(c_q), pos.cos, pos.sin)
        return indexer_topk(q, k, w, pos.q_index, pos.q_segment, pos.kv_segment, self.cfg.index_topk,
                            fp8=opts.indexer_fp8, q_chunk=opts.index_chunk)

    def kv_up(self):
        """W_UK [kv_lora, H, nope] and W_UV [kv_lora, H, v] views of kv_b_proj."""
        cfg = self.cfg
        w = self.kv_b_proj.kernel[...].astype(self.dtype)
        w = w.reshape(cfg.kv_lora_rank, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        return w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]

    def __call__(self, x: jnp.ndarray, pos: Positions, opts: RunOptions):
        """x [B, T, D] -> (out [B, T, D], top-k indices [B, T, k] or None when DSA is off)."""
        cfg = self.cfg
        b, t, _ = x.shape
        c_q, q_nope, q_pe, c_kv, k_pe = self.latents(x, pos, opts)
        topk_idx = self.select(x, c_q, pos, opts) if opts.dsa else None
        w_uk, w_uv = self.kv_up()
        scale = cfg.softmax_scale
        vis = (pos.q_index, pos.q_segment, pos.kv_segment)

        if opts.mla_mode == "mha":
            kv = jnp.einsum("bsc,chd->bshd", c_kv, jnp.concatenate([w_uk, w_uv], axis=-1))
            k = jnp.concatenate(
                [kv[..., : cfg.qk_nope_head_dim],
                 jnp.broadcast_to(k_pe[:, :, None], (*k_pe.shape[:2], cfg.num_attention_heads, cfg.qk_rope_head_dim))],
                axis=-1)
            o, _ = attention.dense_mha(jnp.concatenate([q_nope, q_pe], -1), k, kv[..., cfg.qk_nope_head_dim:], *vis,
                                       scale, topk_idx=topk_idx, q_chunk=opts.attn_chunk)
        else:
            q_lat = jnp.concatenate([jnp.einsum("bthd,chd->bthc", q_nope, w_uk), q_pe], axis=-1)
            kv_lat = jnp.concatenate([c_kv, k_pe], axis=-1)
            if not opts.dsa or opts.attention == "dense":
                o_lat, _ = attention.dense_mqa(q_lat, kv_lat, *vis, scale, cfg.kv_lora_rank, topk_idx=topk_idx,
                                               q_chunk=opts.attn_chunk)
            elif opts.attention == "sparse":
                o_lat, _ = attention.sparse_mla(q_lat, kv_lat, topk_idx, scale, cfg.kv_lora_rank, q_chunk=opts.attn_chunk)
            else:
                from pallas_kernels import sparse_mla as kernel_sparse_mla
                o_lat, _ = kernel_sparse_mla(q_lat, kv_lat, topk_idx, scale, cfg.kv_lora_rank)
            o = jnp.einsum("bthc,chd->bthd", o_lat, w_uv)
        return self.o_proj(o.reshape(b, t, cfg.num_attention_heads * cfg.v_head_dim)), topk_idx
