"""Training objectives: next-token LM loss, MTP loss, the indexer KL of eq. (3)/(4) (per-layer values come from
the model's aux), DeepSeek-V3's sequence-wise balance loss and its auxiliary-loss-free bias update."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(x: jnp.ndarray, mask: jnp.ndarray, total=None) -> jnp.ndarray:
    """sum(x * mask) / max(sum(mask), 1); with `total` (a count over the whole step's batch, `batch_totals`) this
    microbatch's share of the whole batch's mean instead: the shares add up to the un-split mean."""
    return jnp.sum(x * mask) / (jnp.maximum(jnp.sum(mask), 1.0) if total is None else total)


def batch_totals(batch, mtp_depths: int) -> dict:
    """The denominators of a step's averages over its WHOLE batch (before any split into microbatches): real
    tokens (indexer KL, captured mass), LM-loss tokens, each MTP depth's tokens, sequences (rows with a real token:
    the balance loss)."""
    def count(mask):
        return jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)

    return {"tokens": count(batch["segment_ids"] > 0), "lm": count(batch["loss_mask"]),
            "mtp": [count(mtp_targets(batch, d)[1]) for d in range(mtp_depths)],
            "sequences": count(jnp.any(batch["segment_ids"] > 0, axis=1))}


def token_nll(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """-log p(target) per position, float32 [B, T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def lm_loss(logits, batch, total=None) -> jnp.ndarray:
    return masked_mean(token_nll(logits, batch["targets"]), batch["loss_mask"], total)


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


def chunked_token_nll(hidden: jnp.ndarray, kernel: jnp.ndarray, targets: jnp.ndarray, chunk: int) -> jnp.ndarray:
    """`token_nll(hidden @ kernel, targets)` [B, T] without the [B, T, V] logits: the head and the log-softmax run
    on `chunk` positions at a time (lax.map; each chunk's logits recomputed in the backward, jax.checkpoint), so at
    most [B, chunk, V] float32 is live (the small config at 128K tokens: 63 GiB per [T, V] buffer otherwise). Chunk
    j holds positions j, j + n, j + 2n, ... (n = the number of chunks): with tokens split over a mesh axis in
    contiguous blocks every chunk spans every block. Same values as the unchunked loss up to float32 rounding."""
    b, t, d = hidden.shape
    n = -(-t // chunk)
    pad = (-t) % n
    size = (t + pad) // n
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, size, n, d).transpose(2, 0, 1, 3)
    ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, size, n).transpose(2, 0, 1)
    # the head in float32 outside the map: its gradient sums over the chunks in the map's carry, which takes the
    # closed-over operand's dtype (a bf16 head cast inside: 4.3e-2 off over 256 chunks; audit, 2026-12-07)
    kernel32 = kernel.astype(jnp.float32)

    @jax.checkpoint
    def one(args):
        h_c, t_c = args
        logits = jnp.dot(h_c.astype(jnp.float32), kernel32)
        return token_nll(logits, t_c)

    nll = jax.lax.map(one, (hs, ts))  # [n, B, size]
    return nll.transpose(1, 2, 0).reshape(b, size * n)[:, :t]


def mtp_loss(mtp_logits: list, batch, totals=None) -> jnp.ndarray:
    """Mean over depths of the masked token mean; totals: per depth, `batch_totals(...)["mtp"]`. Each depth's entry:
    its logits [B, T, V], or a function targets -> per-position NLL (a chunked head, `chunked_token_nll`)."""
    if not mtp_logits:
        return jnp.zeros((), jnp.float32)
    losses = []
    for depth, logits in enumerate(mtp_logits):
        targets, mask = mtp_targets(batch, depth)
        nll = logits(targets) if callable(logits) else token_nll(logits, targets)  # callable: a chunked head
        losses.append(masked_mean(nll, mask, None if totals is None else totals[depth]))
    return jnp.mean(jnp.stack(losses))


def indexer_kl(aux, token_mask, total=None) -> tuple[jnp.ndarray, dict]:
    """Mean over layers of the token-averaged indexer KL; also per-layer values (and captured mass if present)."""
    per_layer = {k: masked_mean(v, token_mask, total) for k, v in aux.get("indexer_kl", {}).items()}
    metrics = {f"indexer_kl/{k}": v for k, v in per_layer.items()}
    for k, v in aux.get("indexer_captured", {}).items():
        metrics[f"captured_mass/{k}"] = masked_mean(v, token_mask, total)
    if not per_layer:
        return jnp.zeros((), jnp.float32), metrics
    return jnp.mean(jnp.stack(list(per_layer.values()))), metrics


def expert_counts(ids: jnp.ndarray, token_mask: jnp.ndarray, num_experts: int) -> jnp.ndarray:
    """Tokens routed to each expert per sequence: ids [B, T, k], token_mask [B, T] -> [B, E] float32."""
    one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32).sum(axis=2)  # [B, T, E]
    return jnp.sum(one_hot * token_mask[..., None], axis=1)


def balance_loss(aux, token_mask, num_experts: int, top_k: int, num_sequences=None) -> jnp.ndarray:
    """Sequence-wise balance loss (DeepSeek-V3 eq. 17-20): sum_i f_i P_i per sequence, averaged over sequences
    (num_sequences: the whole batch's, for a microbatch's share) and MoE layers; f_i = E / (K T) * count_i,
    P_i = mean_t s'_{i,t}. A row without real tokens (all padding: the last partial batch of a finite stream) is
    not a sequence."""
    if num_sequences is None:
        num_sequences = jnp.maximum(jnp.sum(jnp.any(token_mask > 0, axis=1).astype(jnp.float32)), 1.0)
    losses = []
    n_tokens = jnp.maximum(jnp.sum(token_mask, axis=1, keepdims=True), 1.0)  # [B, 1]
    for key, ids in aux.get("routing", {}).items():
        if ids is None:
            continue
        f = num_experts / top_k * expert_counts(ids, token_mask, num_experts) / n_tokens
        p = jnp.sum(aux["router_prob"][key] * token_mask[..., None], axis=1) / n_tokens
        losses.append(jnp.sum(f * p) / num_sequences)
    return jnp.mean(jnp.stack(losses)) if losses else jnp.zeros((), jnp.float32)


def expert_load(ids: jnp.ndarray, token_mask, num_experts: int) -> jnp.ndarray:
    """Tokens routed to each expert over the batch: [E] float32 (adds up over microbatches)."""
    return jnp.sum(expert_counts(ids, token_mask, num_experts), axis=0)


def bias_update(bias: jnp.ndarray, load: jnp.ndarray, speed: float) -> jnp.ndarray:
    """Auxiliary-loss-free balancing: raise the bias of under-loaded experts by `speed`, lower over-loaded ones;
    load [E] = `expert_load` over the step's whole batch."""
    return bias + speed * jnp.sign(jnp.mean(load) - load)
