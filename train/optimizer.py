"""Optimizer and the trainable-parameter filter of each stage."""

from __future__ import annotations

import optax
from flax import nnx

STAGES = ("dense", "warmup", "sparse", "grpo")


def in_indexer(path, _value) -> bool:
    return "indexer" in (str(p) for p in path)


def trainable_filter(stage: str):
    """dense: everything but the indexer (unused); warmup: the indexer only (eq. 3, the rest frozen);
    sparse / grpo: every parameter (the indexer is fed detached inputs and learns only from its KL)."""
    if stage == "dense":
        return nnx.All(nnx.Param, nnx.Not(in_indexer))
    if stage == "warmup":
        return nnx.All(nnx.Param, in_indexer)
    if stage in ("sparse", "grpo"):
        return nnx.Param
    raise ValueError(f"config.stage must be one of {STAGES}, got {stage!r}")


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warm-up from 0 to cfg.lr over cfg.warmup_steps, then constant (schedule='constant') or cosine decay
    to cfg.lr * cfg.final_lr_fraction at step cfg.decay_steps (schedule='cosine'; constant afterwards)."""
    warmup = max(int(cfg.warmup_steps), 0)
    if cfg.schedule == "constant":
        # linear_schedule holds its end value after the transition: warm-up then constant
        return optax.linear_schedule(0.0, cfg.lr, warmup) if warmup else optax.constant_schedule(cfg.lr)
    if cfg.schedule == "cosine":
        if warmup == 0:
            return optax.cosine_decay_schedule(cfg.lr, max(int(cfg.decay_steps), 1), alpha=cfg.final_lr_fraction)
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(int(cfg.decay_steps), warmup + 1),
                                                  end_value=cfg.lr * cfg.final_lr_fraction)
    raise ValueError(f"config.optimizer.schedule must be 'constant' or 'cosine', got {cfg.schedule!r}")


def make_tx(cfg) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip else optax.identity(),
        optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )
