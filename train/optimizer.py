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
    """Linear warm-up to cfg.lr, then constant or cosine decay to cfg.lr * cfg.final_lr_fraction over cfg.steps."""
    warmup = max(int(cfg.warmup_steps), 0)
    if cfg.schedule == "constant":
        decay = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.lr, max(int(cfg.decay_steps) - warmup, 1), alpha=cfg.final_lr_fraction)
    else:
        raise ValueError(f"config.optimizer.schedule must be 'constant' or 'cosine', got {cfg.schedule!r}")
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), decay], [warmup])


def make_tx(cfg) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip else optax.identity(),
        optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )
