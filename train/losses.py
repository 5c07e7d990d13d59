"""Training objectives: next-token LM loss, MTP loss, the indexer KL of eq. (3)/(4) (per-layer values come from
the model's aux), DeepSeek-V3's sequence-wise balance loss and its auxiliary-loss-free bias update."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_nll(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """-log p(target) per position, float32 [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def lm_loss(logits, batch) -> jnp.ndarray:
    return masked_mean(token_nll(logits, batch["targets"]), batch["loss_mask"])


def _shift_left(x):
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def mtp_targets(batch, depth: int):
    """Targets and mask for MTP depth `depth`: token t+2+depth, valid when every step t..t+depth+1 stays in the
    same document (loss_mask[t] already means "t+1 is the next token of t's document")."""
    targets, mask = batch["targets"], batch["loss_mask"]
    step_mask = mask
    for _ in range(depth + 1):
        targets = _shift_left(targets)
        step_mask = _shift_left(step_mask)
        mask = mask * step_mask
    return targets, mask


def mtp_loss(mtp_logits: list, batch) -> jnp.ndarray:
    if not mtp_logits:
        return jnp.zeros((), jnp.float32)
    losses = []
    for depth, logits in enumerate(mtp_logits):
        targets, mask = mtp_targets(batch, depth)
        losses.append(masked_mean(token_nll(logits, targets), mask))
    return jnp.mean(jnp.stack(losses))


def indexer_kl(aux, token_mask) -> tuple[jnp.ndarray, dict]:
    """Mean over layers of the token-averaged indexer KL; also per-layer values (and captured mass if present)."""
    per_layer = {k: masked_mean(v, token_mask) for k, v in aux.get("indexer_kl", {}).items()}
    metrics = {f"indexer_kl/{k}": v for k, v in per_layer.items()}
    for k, v in aux.get("indexer_captured", {}).items():
        metrics[f"captured_mass/{k}"] = masked_mean(v, token_mask)
    if not per_layer:
        return jnp.zeros((), jnp.float32), metrics
    return jnp.mean(jnp.stack(list(per_layer.values()))), metrics


def expert_counts(ids: jnp.ndarray, token_mask: jnp.ndarray, num_experts: int) -> jnp.ndarray:
    """Tokens routed to each expert per sequence: ids [B, T, k], token_mask [B, T] -> [B, E] float32."""
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32).sum(axis=2)  # [B, T, E]
    return jnp.sum(one_hot * token_mask[..., None], axis=1)


def balance_loss(aux, token_mask, num_experts: int, top_k: int) -> jnp.ndarray:
    """Sequence-wise balance loss (DeepSeek-V3 eq. 17-20): sum_i f_i P_i per sequence, averaged over sequences
    and MoE layers; f_i = E / (K T) * count_i, P_i = mean_t s'_{i,t}."""
    losses = []
    n_tokens = jnp.maximum(jnp.sum(token_mask, axis=1, keepdims=True), 1.0)  # [B, 1]
    for key, ids in aux.get("routing", {}).items():
        if ids is None:
            continue
        f = num_experts / top_k * expert_counts(ids, token_mask, num_experts) / n_tokens
        p = jnp.sum(aux["router_prob"][key] * token_mask[..., None], axis=1) / n_tokens
        losses.append(jnp.mean(jnp.sum(f * p, axis=-1)))
    return jnp.mean(jnp.stack(losses)) if losses else jnp.zeros((), jnp.float32)


def bias_update(bias: jnp.ndarray, ids: jnp.ndarray, token_mask, speed: float) -> jnp.ndarray:
    """Auxiliary-loss-free balancing: raise the bias of under-loaded experts by `speed`, lower over-loaded ones."""
    load = jnp.sum(expert_counts(ids, token_mask, bias.shape[0]), axis=0)
    return bias + speed * jnp.sign(jnp.mean(load) - load)
