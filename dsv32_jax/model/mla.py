"""Multi-head Latent Attention with DeepSeek Sparse Attention.

MHA mode decompresses per-head keys/values through W_UK / W_UV; absorbed MQA mode folds W_UK into the
query and attends over one shared [c_kv ; k_pe] latent row per token (reference_spec.md section 4). DSA runs
on MQA mode: the indexer picks k rows per query and `attention.sparse_mla` gathers only those.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv32_jax.model import attention
from dsv32_jax.model.config import ModelConfig
from dsv32_jax.model.fp8 import act_dequant, act_quant, fake_quant
from dsv32_jax.model.indexer import Indexer, indexer_topk, quantize_keys
from dsv32_jax.model.indexer_loss import dense_indexer_kl, sparse_indexer_kl
from dsv32_jax.model.layers import Dense, RMSNorm
from dsv32_jax.model.options import RunOptions
from dsv32_jax.model.rope import apply_rope_interleaved
from dsv32_jax.model.sharding import BATCH_AXES, SEQ_AXIS, TENSOR_AXIS, current_mesh, dividing_run


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
            attend = functools.partial(mqa_attend, cfg=cfg, opts=opts)
            q_side, kv_side = (q_lat, q_i, w_i, pos.q_index, pos.q_segment), (kv_lat, k_i, pos.kv_segment, k_scale)
            mesh = current_mesh()
            if opts.attention == "kernel" and mesh is not None and mesh.size > 1:
                o_lat, core_aux = kernel_parallel(attend, mesh, q_side, kv_side, split_tokens=cache is None)
            elif (cache is None and mesh is not None and mesh.shape.get(SEQ_AXIS, 1) > 1
                  and t % mesh.shape[SEQ_AXIS] == 0 and kv_lat.shape[1] % mesh.shape[SEQ_AXIS] == 0):
                # (tokens that "seq" does not divide run unsplit below, as kernel_parallel and the MoE fall back)
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
            elif opts.indexer_loss == "sparse":
                aux["indexer_kl"] = reference_sparse_kl(q_lat, kv_lat, aux["topk"], q_i, k_i, w_i, cfg, opts)
            kv = jnp.einsum("bsc,chd->bshd", c_kv, jnp.concatenate([w_uk, w_uv], axis=-1))
            k = jnp.concatenate(
                [kv[..., : cfg.qk_nope_head_dim],
                 jnp.broadcast_to(k_pe[:, :, None], (*k_pe.shape[:2], cfg.num_attention_heads, cfg.qk_rope_head_dim))],
                axis=-1)
            o, _ = attention.dense_mha(jnp.concatenate([q_nope, q_pe], -1), k, kv[..., cfg.qk_nope_head_dim:], *vis,
                                       scale, topk_idx=aux["topk"], q_chunk=opts.attn_chunk)
        return self.o_proj(o.reshape(b, t, cfg.num_attention_heads * cfg.v_head_dim)), aux


@dataclasses.dataclass(frozen=True)
class HeadShards:
    """How the attention heads are split inside a fully manual shard_map (`kernel_parallel`). axis: the manual mesh
    axis over which the heads (attention and indexer) are split, None when every head is local; size: its size;
    tokens: whether the work that needs every head -- the indexer's selection (eq. 1 sums over the indexer heads),
    the eq. 3 teacher (a mean over the attention heads) and both KLs -- is split over the tokens across that axis
    (when the local token count divides) instead of repeated on each of its devices. With axis None every method is
    the identity, so the single-device code path is the same code."""

    axis: str | None = None
    size: int = 1
    tokens: bool = False

    def all_heads(self, x):
        """[b, t, h_local, ...] -> [b, t', H, ...]: every head, for this device's tokens t' (all-to-all), or for
        every token (all-gather) when the tokens are not split."""
        if self.axis is None:
            return x
        if self.tokens:
            return jax.lax.all_to_all(x, self.axis, split_axis=1, concat_axis=2, tiled=True)
        return jax.lax.all_gather(x, self.axis, axis=2, tiled=True)

    def my_tokens(self, x):
        """[b, t, ...] (the same on every device of the axis) -> this device's tokens [b, t', ...]."""
        if not self.tokens:
            return x
        n = x.shape[1] // self.size
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.axis) * n, n, axis=1)

    def all_tokens(self, x):
        """[b, t', ...] -> [b, t, ...] (all-gather over the axis)."""
        return jax.lax.all_gather(x, self.axis, axis=1, tiled=True) if self.tokens else x

    def chunk(self, n: int | None) -> int | None:
        """Query-chunk size for the work that runs on every head: a device handles 1 / size of the tokens with size
        times the heads, so chunks of n / size queries keep the per-chunk intermediates ([chunk, heads, keys] of
        the eq. 3 teacher and of the indexer scores) as large as the head-split computation's."""
        return n if n is None or not self.tokens else max(1, n // self.size)

    def head_sum(self, x):
        """Sums over this device's heads [b, t, ...] -> sums over every head for this device's tokens [b, t', ...]
        (reduce-scatter; a psum when the tokens are not split)."""
        if self.axis is None:
            return x
        if self.tokens:
            return jax.lax.psum_scatter(x, self.axis, scatter_dimension=1, tiled=True)
        return jax.lax.psum(x, self.axis)


def mqa_attend(q_lat, q_i, w_i, q_index, q_segment, kv_lat, k_i, kv_segment, k_scale=None, *, cfg: ModelConfig,
               opts: RunOptions, heads: HeadShards = HeadShards()):
    """DSA in absorbed MQA mode for queries [B, T] against keys [B, S]: the indexer's top-k selection (eq. 1), the
    indexer objective (eq. 3 dense / eq. 4 sparse) and attention (dense_mqa, or eq. 2 on the selected rows).
    q_lat [B, T, H, Dqk], q_i [B, T, H_I, D], w_i [B, T, H_I], q_index / q_segment [B, T]; kv_lat [B, S, Dqk],
    k_i [B, S, D], kv_segment [B, S], k_scale [B, S] (cached FP8 indexer keys) or None. Returns (o_lat
    [B, T, H, kv_lora_rank], aux: topk, indexer_kl, ...).
    Queries only meet keys through q_index / segments, so a slice of the queries against all keys gives that
    slice of the result: what `seq_parallel` and `kernel_parallel` rely on. `heads` says how the heads are split
    when this runs inside `kernel_parallel` (every step that crosses heads goes through it)."""
    vis = (q_index, q_segment, kv_segment)
    scale = cfg.softmax_scale
    aux = {"topk": None}
    kernel = opts.attention == "kernel"
    # the indexer's work runs on every indexer head for this device's tokens (all of them outside kernel_parallel)
    need_index = opts.dsa or opts.indexer_loss is not None
    if need_index:
        qi_s, wi_s = heads.all_heads(q_i), heads.all_heads(w_i)
        qix_s, qseg_s = heads.my_tokens(q_index), heads.my_tokens(q_segment)
    sel_s = None
    if opts.dsa or (kernel and opts.indexer_loss == "dense"):
        # with kernels the warm-up's captured-mass metric (eq. 3 stage, no DSA yet) uses the kernels' selection,
        # i.e. the one the sparse stage will run (FP8 with indexer_fp8)
        select = indexer_topk
        if kernel:
            from dsv32_jax.kernels import indexer_topk as select
        sel_s = jax.lax.stop_gradient(select(qi_s, k_i, wi_s, qix_s, qseg_s, kv_segment, cfg.index_topk,
                                             fp8=opts.indexer_fp8, q_chunk=heads.chunk(opts.index_chunk),
                                             k_scale=k_scale))
        if opts.dsa:
            aux["topk"] = heads.all_tokens(sel_s)
    if opts.indexer_loss == "dense":
        kl, captured = dense_indexer_kl(heads.all_heads(jax.lax.stop_gradient(q_lat)), kv_lat, scale, qi_s, k_i,
                                        wi_s, qix_s, qseg_s, kv_segment, cfg.index_topk,
                                        q_chunk=heads.chunk(opts.attn_chunk), selection=sel_s if kernel else None)
        aux["indexer_kl"], aux["indexer_captured"] = heads.all_tokens(kl), heads.all_tokens(captured)
    if not opts.dsa or opts.attention == "dense":
        o_lat, _ = attention.dense_mqa(q_lat, kv_lat, *vis, scale, cfg.kv_lora_rank, topk_idx=aux["topk"],
                                       q_chunk=opts.attn_chunk)
        if opts.indexer_loss == "sparse":  # (never inside kernel_parallel: no head or token split here)
            aux["indexer_kl"] = reference_sparse_kl(q_lat, kv_lat, aux["topk"], q_i, k_i, w_i, cfg, opts)
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
        from dsv32_jax.kernels import sparse_mla
        sparse = functools.partial(sparse_mla, bwd=opts.mla_bwd, fwd=opts.mla_fwd, pds=opts.mla_pds,
                                   dqkv=opts.mla_dqkv, q_chunk=opts.attn_chunk)  # (q_chunk: its reference's)
    if opts.indexer_loss == "sparse":
        o_lat, _, head_probs = sparse(q_lat, kv_lat, aux["topk"], scale, cfg.kv_lora_rank, return_probs=True)
        kl = sparse_indexer_kl(heads.head_sum(head_probs), sel_s, qi_s, k_i, wi_s,
                               q_chunk=heads.chunk(opts.attn_chunk), key_grad=opts.kl_key_grad)
        aux["indexer_kl"] = heads.all_tokens(kl)
    else:
        o_lat, _ = sparse(q_lat, kv_lat, aux["topk"], scale, cfg.kv_lora_rank)
    return o_lat, aux


def reference_sparse_kl(q_lat, kv_lat, topk, q_i, k_i, w_i, cfg, opts: RunOptions):
    """Eq. 4's KL where the attention itself is not the gathered one (attention="dense", its masked dense
    reference, or mla_mode="mha"): the target is the head-summed attention over the selected slots, computed from
    the detached latents by the gathered reference (the masked dense attention's probabilities on those slots, the
    same distribution), so the indexer gets the same training signal as with attention="sparse"."""
    _, _, head_probs = attention.sparse_mla(jax.lax.stop_gradient(q_lat), jax.lax.stop_gradient(kv_lat), topk,
                                            cfg.softmax_scale, cfg.kv_lora_rank, q_chunk=opts.attn_chunk,
                                            return_probs=True)
    return sparse_indexer_kl(head_probs, topk, q_i, k_i, w_i, q_chunk=opts.attn_chunk, key_grad=opts.kl_key_grad)


def seq_parallel(attend, mesh, q_side: tuple, kv_side: tuple):
    """Sequence (context) parallelism over the mesh axis "seq": each device keeps its slice of the queries (dim 1
    of every q_side array) and all-gathers the keys' side (the 576-d latent rows, the indexer keys and their
    segment ids: O(L) bytes, the only communication; its transpose in the backward is a reduce-scatter), then runs
    `attend` on local queries against all keys. The batch axes that split the rows (their longest leading run whose
    product divides them, as `sharding.array_spec` splits the activations) are manual too (rows are independent),
    so the all-gather stays within each device's own sequences (left automatic, GSPMD gathered every sequence of
    the batch); the heads' axis stays automatic."""
    batch = dividing_run(BATCH_AXES, q_side[0].shape[0], mesh.shape)
    spec = P(batch or None, SEQ_AXIS)
    # (an AbstractMesh has no devices: bench/abstract_step.py lowers it for a GPU or TPU)
    cpu = isinstance(mesh, jax.sharding.Mesh) and mesh.devices.flat[0].platform == "cpu"

    def gather(a):
        # XLA:CPU (jax 0.12.1) aborts the process ("Invalid binary instruction opcode copy") on a reduce-scatter or
        # psum of a type narrower than 32 bits inside a shard_map that leaves axes automatic: the bf16 gather's
        # transpose in the backward was one. On a CPU the gather runs in float32 (exact both ways); on GPU and TPU
        # in the arrays' own type (half the bytes).
        wide = cpu and jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize < 4
        out = jax.lax.all_gather(a.astype(jnp.float32) if wide else a, SEQ_AXIS, axis=1, tiled=True)
        return out.astype(a.dtype) if wide else out

    def local(q_side, kv_side):
        return attend(*q_side, *jax.tree.map(gather, kv_side))

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec, axis_names={SEQ_AXIS, *batch},
                         check_vma=False)(q_side, kv_side)


def kernel_parallel(attend, mesh, q_side: tuple, kv_side: tuple, *, split_tokens: bool):
    """`attend` (mqa_attend with attention="kernel") in one shard_map whose manual axes are the whole mesh: Pallas
    kernels cannot be partitioned by GSPMD (Mosaic refuses, a Triton call would be replicated), so every kernel
    call sees only this device's block. Per device: its rows (over the longest leading run of the batch axes whose
    product divides them, as `sharding.array_spec` splits the activations: B = 2 on data:2,fsdp:2 splits over
    data, fsdp holds copies), its tokens over "seq" (split_tokens, training and prefill: the key side is
    all-gathered, as in `seq_parallel`; a decode step's keys are the cache), and its heads over "tensor" (when the
    attention and indexer head counts divide). What crosses heads is explicit (`HeadShards`): the indexer's
    selection and both KLs run on every head for 1 / tensor of the tokens (all-to-all in, all-gather of the [t, k]
    selection out), the head-summed probabilities of eq. 4 are reduce-scattered. A mesh axis that splits nothing holds identical copies."""
    q_lat, q_i = q_side[0], q_side[1]
    rows, t, n_heads = q_lat.shape[:3]
    s = kv_side[0].shape[1]
    batch = dividing_run(BATCH_AXES, rows, mesh.shape)
    n_seq = mesh.shape.get(SEQ_AXIS, 1)
    seq = SEQ_AXIS if split_tokens and n_seq > 1 and t % n_seq == 0 and s % n_seq == 0 else None
    tp = mesh.shape.get(TENSOR_AXIS, 1)
    head_axis = TENSOR_AXIS if tp > 1 and n_heads % tp == 0 and (q_i is None or q_i.shape[2] % tp == 0) else None
    t_local = t // n_seq if seq else t
    heads = HeadShards(head_axis, tp if head_axis else 1, tokens=head_axis is not None and t_local % tp == 0)
    b_spec = batch or None
    rows_tokens = P(b_spec, seq)
    with_heads = P(b_spec, seq, head_axis)
    q_specs = (with_heads, with_heads, with_heads, rows_tokens, rows_tokens)
    kv_specs = (rows_tokens,) * len(kv_side)

    def local(q_side, kv_side):
        if seq is not None:
            kv_side = jax.tree.map(lambda a: jax.lax.all_gather(a, SEQ_AXIS, axis=1, tiled=True), kv_side)
        o_lat, aux = attend(*q_side, *kv_side, heads=heads)
        return o_lat, aux["topk"], aux.get("indexer_kl"), aux.get("indexer_captured")

    o_lat, topk, kl, captured = jax.shard_map(
        local, mesh=mesh, in_specs=(q_specs, kv_specs), out_specs=(with_heads, rows_tokens, rows_tokens, rows_tokens),
        axis_names=set(mesh.axis_names), check_vma=False)(q_side, kv_side)
    aux = {"topk": topk}
    if kl is not None:
        aux["indexer_kl"] = kl
    if captured is not None:
        aux["indexer_captured"] = captured
    return o_lat, aux
