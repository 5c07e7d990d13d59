"""The GRPO objective of DeepSeek-V3.2 (paper section 3.1, eq. 5-9), as pure functions.

  A_i      = R_i - mean_group(R)                                   (group-relative advantage, no std division)
  r_t      = pi_theta / pi_old                                      (pi_old: the sampler's recorded log-probs)
  pg_t     = -min(r_t A_i, clip(r_t, 1 - eps, 1 + eps) A_i)
  KL_t     = r_t * (pi_ref / pi_theta - log(pi_ref / pi_theta) - 1)  (eq. 7: unbiased, r_t attached to the gradient)
  M_i      = 0 iff A_i < 0 and mean_t log(pi_old / pi_theta) > delta  (eq. 9: off-policy sequence masking)
  loss     = mean_i [ 1/|o_i| sum_t (pg_t M_i + beta_i KL_t) ]      (eq. 5: token mean per sequence, then mean)
Log-ratios are clamped before every exp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """A_i = R_i - mean of R over i's group."""
    rewards = np.asarray(rewards, np.float64)
    out = np.empty_like(rewards)
    for g in np.unique(group_ids):
        sel = group_ids == g
        out[sel] = rewards[sel] - rewards[sel].mean()
    return out.astype(np.float32)


def check_groups(group_ids: np.ndarray, prompts: np.ndarray, group_size: int) -> None:
    """Every group holds exactly `group_size` completions of one and the same prompt (a wrong group id silently
    turns GRPO into something else)."""
    for g in np.unique(group_ids):
        rows = prompts[group_ids == g]
        if len(rows) != group_size:
            raise ValueError(f"group {g} has {len(rows)} completions, expected {group_size}")
        if not (rows == rows[0]).all():
            raise ValueError(f"group {g} mixes different prompts")


def processed_logprobs(logits, tokens, kept_ids, kept_mask, temperature: float):
    """log pi(token) under the sampler's processed distribution: logits / T restricted to the recorded kept set
    (keep sampling mask) and renormalized; the full softmax when sampling was not truncated (K = 0).

    Returns (logp [B, T], entropy of that distribution [B, T], kept mass under the untruncated softmax [B, T])."""
    scaled = logits.astype(jnp.float32) / temperature
    full = jax.nn.log_softmax(scaled, axis=-1)
    if kept_ids.shape[-1] == 0:
        logp = jnp.take_along_axis(full, tokens[..., None], -1)[..., 0]
        return logp, -jnp.sum(jnp.exp(full) * full, -1), jnp.ones(logp.shape, jnp.float32)
    keep = kept_mask | (kept_ids == tokens[..., None])  # the sampled token is always in its kept set
    # slots the sampler never wrote (after an early stop: kept set empty, token = pad_id) keep their first candidate,
    # so their (masked-out) log-prob and its gradient are finite: an empty set gave nan, and mask x nan is nan
    keep = keep | (~jnp.any(keep, -1, keepdims=True) & (jnp.arange(keep.shape[-1]) == 0))
    cand = jnp.where(keep, jnp.take_along_axis(scaled, kept_ids, -1), -jnp.inf)
    logq = jax.nn.log_softmax(cand, axis=-1)
    pick = jnp.argmax(kept_ids == tokens[..., None], -1)
    logp = jnp.take_along_axis(logq, pick[..., None], -1)[..., 0]
    entropy = -jnp.sum(jnp.where(keep, jnp.exp(logq) * logq, 0.0), -1)
    mass = jnp.sum(jnp.where(keep, jnp.exp(jnp.take_along_axis(full, kept_ids, -1)), 0.0), -1)
    return logp, entropy, mass


def opsm_mask(logp, logp_old, adv, mask, delta: float):
    """Eq. (9): keep a sequence unless its advantage is negative AND its mean log(pi_old / pi_theta) > delta."""
    n = jnp.maximum(jnp.sum(mask, -1), 1.0)
    divergence = jnp.sum(mask * (logp_old - jax.lax.stop_gradient(logp)), -1) / n
    return jnp.where((adv < 0) & (divergence > delta), 0.0, 1.0), divergence


def unbiased_kl(logp, logp_old, logp_ref):
    """Eq. (7), per token: (pi_theta / pi_old) * k3(pi_ref / pi_theta), the ratio attached to the gradient;
    k3 = e^x - x - 1 as expm1(x) - x (near the reference, |x| ~ 1e-3, float32 exp(x) - x - 1 is rounding)."""
    ratio = jnp.exp(jnp.clip(logp - logp_old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    log_rr = jnp.clip(logp_ref - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return ratio * (jnp.expm1(log_rr) - log_rr)


def grpo_loss(logp, logp_old, logp_ref, adv, mask, beta, *, eps: float = 0.2, delta: float = 0.5):
    """logp / logp_old / logp_ref / mask: [B, T]; adv, beta: [B]. Returns (loss, metrics)."""
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(jnp.clip(logp - logp_old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    a = adv[:, None]
    unclipped, clipped = ratio * a, jnp.clip(ratio, 1.0 - eps, 1.0 + eps) * a
    pg = -jnp.minimum(unclipped, clipped)
    keep, divergence = opsm_mask(logp, logp_old, adv, mask, delta)
    kl = unbiased_kl(logp, logp_old, logp_ref)
    per_token = pg * keep[:, None] + beta[:, None] * kl
    n = jnp.maximum(jnp.sum(mask, -1), 1.0)
    loss = jnp.mean(jnp.sum(mask * per_token, -1) / n)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    metrics = {
        "pg_loss": jnp.mean(jnp.sum(mask * pg * keep[:, None], -1) / n),
        "kl": jnp.sum(mask * kl) / tokens,
        "clip_fraction": jnp.sum(mask * (clipped < unclipped)) / tokens,
        "opsm_masked_fraction": jnp.mean(1.0 - keep),
        "ratio_mean": jnp.sum(mask * ratio) / tokens,
        "opsm_divergence": jnp.mean(divergence),
    }
    return loss, metrics
