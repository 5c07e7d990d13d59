"""Optimizers and the trainable-parameter filter of each stage.

The lightning indexer and the main model are optimized separately (the paper trains the indexer with its own
objective and detached inputs): `make_tx` partitions the trainable parameters into "indexer" and "main", each with
its own global-norm clip and AdamW (config.optimizer, with config.optimizer.indexer overriding any field for the
indexer). With config.optimizer.master_dtype = "float32", parameters stored in a narrower dtype (bf16) are updated
through fp32 master copies held in the optimizer state (`with_master_weights`), and AdamW's moments are fp32 too.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

GROUPS = ("main", "indexer")
GROUP_FIELDS = ("lr", "schedule", "warmup_steps", "hold_steps", "decay_steps", "final_lr_fraction", "b1", "b2",
                "eps", "weight_decay", "grad_clip")
_FIELD_DEFAULTS = {"hold_steps": 0}  # fields a config written before they existed may lack

STAGES = ("dense", "warmup", "sparse", "grpo", "agent")
DECAY_MASKS = ("matrices", "all")
NO_DECAY = ("scale", "bias")  # the parameter names weight_decay_mask="matrices" leaves undecayed (norms, biases)


def in_indexer(path, _value) -> bool:
    return "indexer" in (str(p) for p in path)


def in_mtp(path, _value) -> bool:
    return "mtp" in (str(p) for p in path)


def trainable_filter(stage: str, *, mtp: bool = True, indexer: bool = True):
    """dense: everything but the indexer (unused); warmup: the indexer only (eq. 3, the rest frozen);
    sparse / grpo / agent: every parameter (the indexer is fed detached inputs and learns only from its KL).
    mtp=False (loss.mtp_weight = 0; GRPO, whose policy is the main head) leaves the MTP layers out, indexer=False
    (its loss weight 0) the indexer: a parameter no loss reaches stays out of the optimizer, so AdamW's weight
    decay does not shrink it and its moments take no memory."""
    if stage not in STAGES:
        raise ValueError(f"config.stage must be one of {STAGES}, got {stage!r}")
    if stage == "warmup":
        return nnx.All(nnx.Param, in_indexer)
    frozen = [f for f, keep in ((in_indexer, indexer and stage != "dense"), (in_mtp, mtp)) if not keep]
    return nnx.All(nnx.Param, *(nnx.Not(f) for f in frozen)) if frozen else nnx.Param


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warm-up from 0 to cfg.lr over cfg.warmup_steps, then constant (schedule='constant') or cosine decay
    to cfg.lr * cfg.final_lr_fraction at step cfg.decay_steps (schedule='cosine'; constant afterwards). With
    cfg.hold_steps > 0 the cosine starts there instead (warm-up, constant until hold_steps, then the decay: the
    warmup-stable-decay shape)."""
    warmup = max(int(cfg.warmup_steps), 0)
    hold = int(cfg.get("hold_steps", 0) or 0)
    if cfg.schedule == "constant":
        # linear_schedule holds its end value after the transition: warm-up then constant
        return optax.linear_schedule(0.0, cfg.lr, warmup) if warmup else optax.constant_schedule(cfg.lr)
    if cfg.schedule == "cosine" and hold > 0:
        if hold < warmup or cfg.decay_steps <= hold:
            raise ValueError(f"config.optimizer: need warmup_steps <= hold_steps < decay_steps, got {warmup}, "
                             f"{hold}, {cfg.decay_steps}")
        flat = optax.linear_schedule(0.0, cfg.lr, warmup) if warmup else optax.constant_schedule(cfg.lr)
        decay = optax.cosine_decay_schedule(cfg.lr, int(cfg.decay_steps) - hold, alpha=cfg.final_lr_fraction)
        return optax.join_schedules([flat, decay], [hold])
    if cfg.schedule == "cosine":
        if warmup == 0:
            return optax.cosine_decay_schedule(cfg.lr, max(int(cfg.decay_steps), 1), alpha=cfg.final_lr_fraction)
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(int(cfg.decay_steps), warmup + 1),
                                                  end_value=cfg.lr * cfg.final_lr_fraction)
    raise ValueError(f"config.optimizer.schedule must be 'constant' or 'cosine', got {cfg.schedule!r}")


def group_config(cfg, group: str):
    """The optimizer settings of one parameter group: config.optimizer, with the non-None fields of
    config.optimizer.indexer on top for the indexer."""
    if group not in GROUPS:
        raise ValueError(f"optimizer group must be one of {GROUPS}, got {group!r}")
    out = {f: cfg.get(f, _FIELD_DEFAULTS.get(f)) if f in _FIELD_DEFAULTS else cfg[f] for f in GROUP_FIELDS}
    if group == "indexer" and "indexer" in cfg:
        for key, value in cfg.indexer.items():
            if key not in GROUP_FIELDS:
                raise ValueError(f"config.optimizer.indexer.{key}: unknown field (one of {', '.join(GROUP_FIELDS)})")
            if value is not None:
                out[key] = value
    return _Fields(out)


class _Fields(dict):
    __getattr__ = dict.__getitem__


def _is_indexer_path(path) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) == "indexer" for k in path)


def param_groups(params):
    """The group label ("indexer" or "main") of every leaf of a parameter tree (an nnx.State or a pure dict)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "indexer" if _is_indexer_path(path) else "main", params)


def _leaf_name(path) -> str:
    """The parameter's own name: the last key of its path (an nnx.Variable's trailing `.value` skipped)."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    while names and names[-1] == "value":
        names.pop()
    return names[-1] if names else ""


def decay_mask(params):
    """True on the leaves weight_decay_mask="matrices" decays: every parameter of 2 or more dimensions that is no
    norm scale or bias (`NO_DECAY`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _leaf_name(path) not in NO_DECAY and jnp.ndim(x) >= 2, params)


def group_norms(grads) -> dict[str, jax.Array]:
    """Global L2 norm of each group's gradients (zero for a group without parameters)."""
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    out = {}
    for group in GROUPS:
        sq = [jnp.sum(jnp.square(x.astype(jnp.float32))) for path, x in leaves
              if (group == "indexer") == _is_indexer_path(path)]
        out[group] = jnp.sqrt(sum(sq)) if sq else jnp.zeros((), jnp.float32)
    return out


def check_group(g) -> None:
    """Range checks of one group's settings (config.optimizer.<field>; make_tx names the indexer group's): a
    negative lr, grad_clip, eps or weight_decay each turns AdamW's step into ascent, and a NaN lr trains NaNs."""
    def bad(field, want):
        raise ValueError(f"config.optimizer.{field} must be {want}, got {g[field]!r}")

    for field in ("lr", "grad_clip", "weight_decay", "eps", "b1", "b2", "final_lr_fraction"):
        if isinstance(g[field], bool) or not isinstance(g[field], (int, float)) or not math.isfinite(g[field]):
            bad(field, "a finite number")
    if g.lr < 0:
        bad("lr", ">= 0")
    if g.grad_clip < 0:
        bad("grad_clip", ">= 0 (0: no clipping)")
    if g.weight_decay < 0:
        bad("weight_decay", ">= 0")
    if g.eps <= 0:
        bad("eps", "> 0")
    for field in ("b1", "b2"):
        if not 0 <= g[field] < 1:
            bad(field, "in [0, 1)")
    if not 0 <= g.final_lr_fraction <= 1:
        bad("final_lr_fraction", "in [0, 1] (the cosine's end as a fraction of lr)")
    for field in ("warmup_steps", "hold_steps", "decay_steps"):
        if isinstance(g[field], bool) or not isinstance(g[field], int) or g[field] < 0:
            bad(field, "an integer >= 0")
    if g.schedule == "cosine" and g.warmup_steps and g.decay_steps < g.warmup_steps:
        raise ValueError(f"config.optimizer: the cosine decays until decay_steps={g.decay_steps}, before the warm-up "
                         f"ends (warmup_steps={g.warmup_steps}): need warmup_steps <= decay_steps")


def _group_tx(g, mask: str = "matrices") -> optax.GradientTransformation:
    check_group(g)
    # (no mask without decay: the optimizer state keeps the structure checkpoints written before the mask have)
    return optax.chain(
        optax.clip_by_global_norm(g.grad_clip) if g.grad_clip else optax.identity(),
        optax.adamw(learning_rate_schedule(g), b1=g.b1, b2=g.b2, eps=g.eps, weight_decay=g.weight_decay,
                    mask=decay_mask if mask == "matrices" and g.weight_decay else None),
    )


class MasterState(NamedTuple):
    master: Any  # master copies of the parameters (master dtype)
    inner: Any  # the wrapped optimizer's state, over the master copies


def with_master_weights(inner: optax.GradientTransformation, dtype=jnp.float32) -> optax.GradientTransformation:
    """Runs `inner` on master copies of the parameters in `dtype`: gradients are cast up, the master copies are
    updated exactly, and the returned updates move each (narrower) parameter to its master copy rounded to the
    parameter's dtype. Without it, a bf16 parameter cannot take updates below half its ulp (2^-9 relative): at
    the paper's learning rates most AdamW steps round away."""
    dtype = jnp.dtype(dtype)

    def init(params):
        # a copy even where p is already in `dtype` (the router, the indexer's weights_proj: always float32): an
        # alias of the parameter's buffer made a donating step (GRPO, agent) fail, "donate the same buffer twice"
        master = jax.tree.map(lambda p: jnp.array(p, dtype, copy=True), params)
        return MasterState(master, inner.init(master))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("with_master_weights needs the parameters in update()")
        grads = jax.tree.map(lambda g: jnp.asarray(g, dtype), updates)
        step, inner_state = inner.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, step)
        # p + (master - p) in the master dtype, rounded once to p's dtype by optax.apply_updates
        deltas = jax.tree.map(lambda m, p: m - jnp.asarray(p, dtype), master, params)
        return deltas, MasterState(master, inner_state)

    return optax.GradientTransformation(init, update)


def make_tx(cfg, param_dtype=None) -> optax.GradientTransformation:
    """AdamW with global-norm clipping, separately for the indexer and the main model (`group_config`); wrapped
    in fp32 master weights when cfg.master_dtype is set and wider than param_dtype. cfg.weight_decay_mask (both
    groups): "matrices" (default) decays the weight matrices and the embedding, "all" every trained parameter."""
    mask = cfg.get("weight_decay_mask", "matrices")
    if mask not in DECAY_MASKS:
        raise ValueError(f"config.optimizer.weight_decay_mask must be one of {DECAY_MASKS}, got {mask!r}")
    txs = {}
    for g in GROUPS:
        settings = group_config(cfg, g)
        try:
            txs[g] = _group_tx(settings, mask)
        except ValueError as e:
            if g == "main":
                raise
            inherited = {k: settings[k] for k in ("schedule", "warmup_steps", "hold_steps", "decay_steps")
                         if k in settings}
            raise ValueError(f"config.optimizer.{g} (its own fields over config.optimizer's, here {inherited}): "
                             f"{e}") from None
    tx = optax.multi_transform(txs, param_groups)
    master = cfg.get("master_dtype", "")
    if master and param_dtype is not None and jnp.dtype(param_dtype).itemsize < jnp.dtype(master).itemsize:
        tx = with_master_weights(tx, master)
    return tx
