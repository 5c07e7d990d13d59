"""DeepSeek-V3 FFNs: dense SwiGLU MLP, and the MoE with sigmoid router, auxiliary-loss-free correction bias
(selection only), group-limited top-k, shared expert, and dropless routed experts via `jax.lax.ragged_dot`.

The router returns the chosen expert ids, and accepts recorded ids to replay them ("keep routing", GRPO):
the gate weights are then recomputed from the live scores for the given ids, so the router still learns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv32_jax.config import ModelConfig
from dsv32_jax.layers import Dense, normal_param


class ExpertBias(nnx.Variable):
    """e_score_correction_bias: updated by the load-balancing rule, never by gradients (not an nnx.Param)."""


def route(logits: jnp.ndarray, bias: jnp.ndarray, cfg: ModelConfig, replay_ids: jnp.ndarray | None = None):
    """Router of DeepSeek-V3 ("noaux_tc"). logits [N, E] -> (weights [N, k] f32, ids [N, k] int32).

    sigmoid scores; score + bias picks the groups (sum of each group's top-2) and then the top-k experts;
    weights are the unbiased scores of the chosen experts, normalized, times routed_scaling_factor.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    if replay_ids is None:
        choice = scores + bias.astype(jnp.float32)
        n, e = choice.shape
        if cfg.n_group > 1:
            grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            keep = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
            choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)
        _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    else:
        ids = replay_ids
    ids = ids.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * cfg.routed_scaling_factor, ids


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the product is formed in float32."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype, param_dtype, std: float):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, std=std)
        self.gate_proj = Dense(d_model, d_ff, ("embed", "mlp"), **kw)
        self.up_proj = Dense(d_model, d_ff, ("embed", "mlp"), **kw)
        self.down_proj = Dense(d_ff, d_model, ("mlp", "embed"), **kw)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        h = jax.nn.silu(self.gate_proj(x).astype(jnp.float32)) * self.up_proj(x).astype(jnp.float32)
        return self.down_proj(h.astype(x.dtype))


class Experts(nnx.Module):
    """Routed experts, weights stacked per layer: w_gate/w_up [E, D, I], w_down [E, I, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        std = cfg.initializer_range
        self.w_gate = normal_param(rngs, (e, d, i), ("expert", "embed", "moe_mlp"), param_dtype, std)
        self.w_up = normal_param(rngs, (e, d, i), ("expert", "embed", "moe_mlp"), param_dtype, std)
        self.w_down = normal_param(rngs, (e, i, d), ("expert", "moe_mlp", "embed"), param_dtype, std)
        self.dtype = dtype

    def __call__(self, x: jnp.ndarray, ids: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
        """Dropless: x [N, D], ids/weights [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x), float32 [N, D]."""
        n, k = ids.shape
        num_experts = self.w_gate.shape[0]
        flat_ids = ids.reshape(-1)
        order = jnp.argsort(flat_ids, stable=True)
        group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
        xs = x.astype(self.dtype)[order // k]

        def gmm(lhs, w):
            return jax.lax.ragged_dot(lhs, w[...].astype(self.dtype), group_sizes, preferred_element_type=jnp.float32)

        h = jax.nn.silu(gmm(xs, self.w_gate)) * gmm(xs, self.w_up)
        ys = gmm(h.astype(self.dtype), self.w_down)
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)
        return jnp.einsum("nkd,nk->nd", y, weights.astype(jnp.float32))


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.router = normal_param(rngs, (cfg.hidden_size, cfg.n_routed_experts), ("embed", None), jnp.float32,
                                   cfg.initializer_range)
        self.bias = ExpertBias(jnp.zeros((cfg.n_routed_experts,), jnp.float32), axes=(None,))
        self.experts = Experts(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared = MLP(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size, rngs=rngs, dtype=dtype,
                          param_dtype=param_dtype, std=cfg.initializer_range) if cfg.n_shared_experts else None
        self.cfg = cfg

    def __call__(self, x: jnp.ndarray, replay_ids: jnp.ndarray | None = None):
        """x [B, T, D] -> (y [B, T, D], aux); replay_ids [B, T, k] replays a recorded routing.

        aux: "routing" expert ids [B, T, k]; "router_prob" [B, T, E] the normalized affinities s / sum(s) that the
        sequence-wise balance loss averages (DeepSeek-V3 eq. 17-20)."""
        b, t, d = x.shape
        xf = x.reshape(b * t, d)
        logits = jnp.dot(xf.astype(jnp.float32), self.router[...].astype(jnp.float32))
        replay = None if replay_ids is None else replay_ids.reshape(b * t, -1)
        weights, ids = route(logits, self.bias[...], self.cfg, replay)
        y = self.experts(xf, ids, weights)
        if self.shared is not None:
            y = y + self.shared(xf).astype(jnp.float32)
        scores = jax.nn.sigmoid(logits)
        aux = {"routing": ids.reshape(b, t, -1),
               "router_prob": (scores / jnp.sum(scores, axis=-1, keepdims=True)).reshape(b, t, -1)}
        return y.astype(x.dtype).reshape(b, t, d), aux
