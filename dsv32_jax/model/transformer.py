"""The DeepSeek-V3.2 transformer: embedding, pre-norm decoder blocks (MLA + DSA, dense MLP or MoE), final norm,
untied LM head, and the multi-token-prediction (MTP) module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv32_jax.model.config import ModelConfig
from dsv32_jax.model.layers import Dense, RMSNorm, normal_param, take_rows
from dsv32_jax.model.mla import MLA, Positions
from dsv32_jax.model.moe import MLP, MoE
from dsv32_jax.model.options import RunOptions
from dsv32_jax.model.rope import rope_angles, yarn_inv_freq
from dsv32_jax.model.sharding import constrain

ACTIVATION_AXES = ("batch", "seq", "embed")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.attn = MLA(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        if cfg.is_moe_layer(layer):
            self.ffn = MoE(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        else:
            self.ffn = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                           std=cfg.initializer_range)
        self.is_moe = cfg.is_moe_layer(layer)

    def __call__(self, h, pos: Positions, opts: RunOptions, replay_ids=None, cache=None):
        """h [B, T, D] -> (h, aux): attention aux (topk, indexer losses, cache) and MoE aux (routing, router_prob)."""
        attn_out, aux = self.attn(self.attn_norm(h), pos, opts, cache)
        h = h + attn_out
        if self.is_moe:
            ffn_out, moe_aux = self.ffn(self.ffn_norm(h), replay_ids)
            aux.update(moe_aux)
        else:
            ffn_out = self.ffn(self.ffn_norm(h))
            aux["routing"] = None
        return h + ffn_out, aux


class MTPLayer(nnx.Module):
    """h' = eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)]) (embedding half first), one decoder block, shared_head.norm;
    the main model's embedding and LM head are shared."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.eh_proj = Dense(2 * cfg.hidden_size, cfg.hidden_size, (None, "embed"), rngs=rngs, dtype=dtype,
                             param_dtype=param_dtype, std=cfg.initializer_range)
        self.block = DecoderLayer(cfg, layer, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)


def _check_cache_room(index, num_tokens: int, length: int) -> None:
    """Slots [index, index + T) must lie in the cache: past its end dynamic_update_slice clamps the write (the new
    tokens overwrite the last slots) and the logits come out silently wrong. Checked when index is concrete (a
    traced index, e.g. inside the sampler's loop, is the caller's to bound)."""
    try:
        start = int(index)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    if start < 0 or start + num_tokens > length:
        raise ValueError(f"decode: {num_tokens} tokens at cache slot {start} need slots [{start}, {start + num_tokens}) "
                         f"of a cache of {length} (init_cache(batch, length) with a larger length)")


class Transformer(nnx.Module):
    """DeepSeek-V3.2 causal LM.

    `model(tokens)` -> float32 logits [B, T, V]. With `return_aux=True` -> (logits, aux) where aux holds, per
    layer (keys 0..L-1, and L+j for MTP depth j as in the checkpoint): `topk` (indexer selections
    [B, T, min(index_topk, S)] for S keys), `routing` (expert ids [B, T, num_experts_per_tok]; None for a dense
    layer), `router_prob` (MoE layers), `indexer_kl` / `indexer_captured` (with RunOptions.indexer_loss); and
    `mtp_logits` (list of [B, T, V]; entry j predicts token t+2+j) and `hidden` (final normed state).

    The batch is an axis of the model's own: `jax.vmap` over a model with MoE layers fails in `lax.ragged_dot`
    (no batching rule for per-row group sizes); pass the rows as the batch dimension instead.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 options: RunOptions | None = None):
        cfg = config
        self.config = cfg
        if options is not None and not isinstance(options, RunOptions):  # (a dict failed at the first call)
            raise ValueError(f"Transformer: options must be a RunOptions, got {type(options).__name__} "
                             "(e.g. RunOptions(**options))")
        self.options = options or RunOptions()
        self.dtype = dtype
        self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype,
                                  cfg.initializer_range)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), rngs=rngs, dtype=jnp.float32,
                             param_dtype=param_dtype, std=cfg.initializer_range)
        self.mtp = nnx.List([MTPLayer(cfg, cfg.num_hidden_layers + i, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                             for i in range(cfg.num_nextn_predict_layers)])

    def positions(self, tokens, positions=None, segment_ids=None, start: int | jnp.ndarray = 0,
                  kv_segment=None) -> Positions:
        """Bookkeeping for tokens [B, T] occupying key slots [start, start + T): RoPE tables from `positions`
        (default: the slot index), segments (default: one document), and the keys' segments (default: the
        tokens' own, i.e. no cache)."""
        b, t = tokens.shape
        for name, x in (("positions", positions), ("segment_ids", segment_ids)):
            if x is not None and tuple(np.shape(x)) != (b, t):
                raise ValueError(f"{name} must have the tokens' shape [B, T] = {(b, t)}, got {tuple(np.shape(x))}")
        index = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = index if positions is None else positions.astype(jnp.int32)
        segments = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        cos, sin = rope_angles(positions, yarn_inv_freq(self.config), self.config.rope_attention_factor)
        return Positions(cos=cos, sin=sin, q_index=index, q_segment=segments,
                         kv_segment=segments if kv_segment is None else kv_segment)

    def embed_tokens(self, tokens):
        # the table's model dim is stored split over fsdp, which also splits the tokens' rows: gathered first (in
        # the compute dtype), else GSPMD replicates the whole [B, T, D] lookup to reshard it
        table = constrain(self.embed[...].astype(self.dtype), ("vocab", None))
        # the rows come out with the model dim whole: XLA's SPMD partitioner (jax 0.12.1) miscompiled this gather of a
        # vocab-split table into rows split over two other axes (P(None, "seq", "fsdp"): one row on a
        # fsdp:2,tensor:2,seq:2 mesh, as in generation), embeddings off by 0.4 (a pure-JAX repro: tests/test_sharding)
        return constrain(take_rows(table, tokens, table.shape[0]), ("batch", "seq", None))

    def logits(self, h):
        return jnp.dot(h.astype(jnp.float32), self.lm_head.kernel[...].astype(jnp.float32))

    def __call__(self, tokens, positions=None, segment_ids=None, routing=None, return_aux: bool = False,
                 mtp: bool = True, head: bool = True):
        """tokens int [B, T]; positions [B, T] (RoPE positions, default 0..T-1); segment_ids [B, T] (packed
        documents: attention and the indexer never cross a segment boundary); routing: {layer: ids [B, T, k]}
        to replay recorded expert choices. With return_aux, aux["mtp_logits"] holds the MTP heads' logits unless
        mtp=False (RL and evaluation do not use them: the MTP layers are then not run at all).
        head=False (with return_aux) skips the LM head: returns (final normed hidden [B, T, D], aux) with
        aux["mtp_hidden"] (the MTP heads' normed states) instead of logits, for a loss that applies the head
        chunk by chunk (`train.losses.chunked_token_nll`: no [B, T, V] buffer at long context)."""
        _check_tokens(tokens, self.config.vocab_size)
        _check_routing(routing, self.config, tokens.shape)
        pos = self.positions(tokens, positions, segment_ids)
        h, aux = self.backbone(self.embed_tokens(tokens), pos, routing)
        if not head:
            if not return_aux:
                raise ValueError("Transformer(head=False) needs return_aux=True")
            aux["hidden"] = h
            aux["mtp_hidden"] = self.mtp_hidden(tokens, h, pos, routing, aux) if mtp else []
            return h, aux
        logits = self.logits(h)
        if not return_aux:
            return logits
        aux["hidden"] = h
        aux["mtp_logits"] = self.mtp_logits(tokens, h, pos, routing, aux) if mtp else []
        return logits, aux

    def backbone(self, h, pos: Positions, routing=None, cache=None):
        """Input embeddings [B, T, D] -> final normed hidden state, aux {topk, routing, ...} per layer.

        With options.remat != "none" (and no decode cache) every block is a `jax.checkpoint` with that policy."""
        routing = routing or {}
        aux = {}
        h = constrain(h, ACTIVATION_AXES)
        if cache is None and self.options.scan_layers:
            for start, stop in layer_runs(self.layers):
                h, run_aux = _scan_blocks(list(self.layers)[start:stop], h, pos, self.options,
                                          [routing.get(i) for i in range(start, stop)], first=start)
                for j, i in enumerate(range(start, stop)):
                    _collect(aux, i, jax.tree.map(lambda x: x[j], run_aux))  # noqa: B023
            return self.norm(h), aux
        call = _block_call(self.options.remat) if cache is None else _call_layer
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache["layers"][i]
            h, layer_aux = call(layer, h, pos, self.options, routing.get(i), layer_cache)
            h = constrain(h, ACTIVATION_AXES)
            _collect(aux, i, layer_aux)
        return self.norm(h), aux

    def init_cache(self, batch: int, length: int) -> dict:
        """An empty decode cache for `length` slots: per-layer latents (see MLA.init_cache) and the slots' segment
        ids (-1 = empty)."""
        return {"segment": jnp.full((batch, length), -1, jnp.int32),
                "layers": [layer.attn.init_cache(batch, length, self.options) for layer in self.layers]}

    def decode(self, tokens, cache: dict, index, positions, segment_ids, routing=None):
        """Incremental forward: tokens [B, T] occupy cache slots [index, index + T) (the same slots in every row:
        prompts are left-padded), attend to every visible earlier slot, and are appended to the cache.

        positions [B, T] are RoPE positions, segment_ids [B, T] (0 for padding). Prefill = decode on an empty
        cache with index 0. Returns (logits [B, T, V] float32, new cache, aux per layer: topk, routing)."""
        _check_tokens(tokens, self.config.vocab_size)
        _check_routing(routing, self.config, tokens.shape)
        if segment_ids is None:
            raise ValueError("decode: segment_ids [B, T] are required (the slots' documents; 0 marks padding)")
        _check_cache_layout(cache, tokens.shape[0], self.options)
        _check_cache_room(index, tokens.shape[1], cache["segment"].shape[1])
        seg_cache = jax.lax.dynamic_update_slice_in_dim(cache["segment"], segment_ids.astype(jnp.int32), index, axis=1)
        pos = self.positions(tokens, positions, segment_ids, start=index, kv_segment=seg_cache)
        h, aux = self.backbone(self.embed_tokens(tokens), pos, routing, cache)
        new_cache = {"segment": seg_cache, "layers": [aux["cache"][i] for i in range(len(self.layers))]}
        del aux["cache"]
        return self.logits(h), new_cache, aux

    def mtp_logits(self, tokens, h, pos: Positions, routing, aux) -> list:
        """MTP depth j predicts token t+2+j from h_t and Emb(t_{t+1+j}); positions past the end see token 0."""
        return [self.logits(x) for x in self.mtp_hidden(tokens, h, pos, routing, aux)]

    def mtp_hidden(self, tokens, h, pos: Positions, routing, aux) -> list:
        """The MTP heads' normed states (what `mtp_logits` projects with the shared head), one per depth. Depth j's
        input at t is Emb(t_{t+1+j}), token 0 where t + 1 + j is past the row's end or in another document (segment)
        than t: a packed row's document sees what it sees alone (the MTP layer's indexer KL at a document's last
        tokens read the next document's first ones)."""
        routing = routing or {}
        out = []
        next_tokens, next_seg = tokens, pos.q_segment

        def shift(x):
            return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)

        for j, mtp in enumerate(self.mtp):
            next_tokens, next_seg = shift(next_tokens), shift(next_seg)
            inputs = jnp.where(next_seg == pos.q_segment, next_tokens, 0)
            x = jnp.concatenate([mtp.enorm(self.embed_tokens(inputs)), mtp.hnorm(h)], axis=-1)
            key = self.config.num_hidden_layers + j  # the MTP layer's index in the checkpoint
            h, layer_aux = _block_call(self.options.remat)(mtp.block, mtp.eh_proj(x), pos, self.options,
                                                           routing.get(key), None)
            _collect(aux, key, layer_aux)
            out.append(mtp.norm(h))
        return out


def _call_layer(layer, h, pos, opts, replay_ids, cache):
    return layer(h, pos, opts, replay_ids, cache)


REMAT_POLICY_FNS = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _block_call(policy: str):
    """layer(h, pos, opts, replay_ids, cache) -> (h, aux), rematerialized with the named policy ("none": as is)."""
    if policy == "none":
        return _call_layer

    def call(layer, h, pos, opts, replay_ids, cache):
        del cache  # training forward only (decode passes its cache to _call_layer)
        graphdef, state = nnx.split(layer)  # a pure function of the block's state: the block mutates nothing

        def pure(state, h, pos, replay_ids):
            return nnx.merge(graphdef, state)(h, pos, opts, replay_ids, None)

        return jax.checkpoint(pure, policy=REMAT_POLICY_FNS[policy])(state, h, pos, replay_ids)

    return call


def layer_runs(layers) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive blocks with one structure (graph definition): DeepSeek-V3's dense blocks,
    then its MoE blocks."""
    runs, prev = [], None
    for i, layer in enumerate(layers):
        graphdef = nnx.graphdef(layer)
        if runs and graphdef == prev:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
        prev = graphdef
    return runs


def _scan_blocks(layers, h, pos, opts, replay, first: int):
    """Blocks of one structure as a lax.scan over their stacked states (each step rematerialized with opts.remat);
    returns (h, aux stacked along a leading layer axis)."""
    graphdef = nnx.graphdef(layers[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in layers])
    if any(r is None for r in replay) and not all(r is None for r in replay):
        missing = [first + j for j, r in enumerate(replay) if r is None]
        raise ValueError(f"routing replay: layers {missing} have no recorded routing but other layers of their "
                         f"scanned run [{first}, {first + len(layers)}) do (scan_layers needs all or none)")
    ids = None if replay[0] is None else jnp.stack(replay)

    def body(h, xs):
        state, replay_ids = xs
        out, aux = nnx.merge(graphdef, state)(h, pos, opts, replay_ids, None)
        return constrain(out, ACTIVATION_AXES), aux

    if opts.remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICY_FNS[opts.remat])
    return jax.lax.scan(body, h, (stacked, ids))


def _collect(aux: dict, key, layer_aux: dict) -> None:
    """aux[name][layer] = value, for each per-layer output."""
    for name, value in layer_aux.items():
        aux.setdefault(name, {})[key] = value


def _concrete(x) -> bool:
    return isinstance(x, np.ndarray | jax.Array) and not isinstance(x, jax.core.Tracer)


def _check_routing(routing, cfg: ModelConfig, bt: tuple[int, int]) -> None:
    """Recorded expert ids to replay ({layer: ids [B, T, num_experts_per_tok]}, None for a layer without them):
    a key of a dense layer was ignored, a wrong width silently reshaped (ids of 1 or 3 experts per token), and an
    id outside [0, n_routed_experts) gave NaN logits or another expert's weight."""
    if not routing:
        return
    want = (*bt, cfg.num_experts_per_tok)
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    for key, ids in routing.items():
        if ids is None:
            continue
        if isinstance(key, bool) or not isinstance(key, int | np.integer) or not 0 <= key < layers \
                or not cfg.is_moe_layer(int(key)):
            moe = [i for i in range(layers) if cfg.is_moe_layer(i)]
            raise ValueError(f"routing[{key!r}]: not an MoE layer of this model (its MoE layers: {moe})")
        if tuple(np.shape(ids)) != want or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
            raise ValueError(f"routing[{key}]: expert ids must be integers of shape [B, T, num_experts_per_tok] = "
                             f"{want}, got {jnp.result_type(ids)} {tuple(np.shape(ids))}")
        if _concrete(ids) and np.size(ids):
            concrete = np.asarray(ids)
            lo, hi = int(concrete.min()), int(concrete.max())
            if lo < 0 or hi >= cfg.n_routed_experts:
                raise ValueError(f"routing[{key}]: expert ids must be in [0, n_routed_experts={cfg.n_routed_experts}), "
                                 f"got range [{lo}, {hi}]")


def _check_cache_layout(cache: dict, batch: int, opts: RunOptions) -> None:
    """A decode cache built for another batch or under other FP8 options failed inside the layers (a reshape, a
    KeyError 'c_kv_scale', a float8 type promotion) without naming the cache."""
    rows = cache["segment"].shape[0]
    if rows != batch:
        raise ValueError(f"decode: the cache holds {rows} rows and tokens {batch}: call init_cache({batch}, ...)")
    layer = cache["layers"][0] if cache["layers"] else {}
    for option, key in (("fp8_kv", "c_kv_scale"), ("indexer_fp8", "idx_k_scale")):
        built = key in layer
        if built != bool(getattr(opts, option)):
            raise ValueError(f"decode: the cache was built with {option}={built} and model.options has "
                             f"{option}={getattr(opts, option)}: call init_cache again under these options")


def _check_tokens(tokens, vocab_size: int) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq] integers, got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    if tokens.shape[1] == 0:
        raise ValueError(f"tokens must hold at least one position, got shape {tokens.shape}")
    if _concrete(tokens) and tokens.size:
        concrete = np.asarray(tokens)  # numpy: no tracing even when the array is closed over inside a jit
        lo, hi = int(concrete.min()), int(concrete.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"token ids must be in [0, vocab_size={vocab_size}), got range [{lo}, {hi}]")
