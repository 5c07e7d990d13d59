"""The compiled steps of every training stage, as module-level pure functions.

Each step is a function of (state, batch) plus keyword-only static configuration (graphdef, stage, loss weights,
schedule, ...) bound with functools.partial before jax.jit; nothing closes over a trainer object. `compile_*`
jit them with explicit in/out shardings: the (model, optimizer) state sharded by the rule table of
dsv32_jax.model.sharding, batch arrays split on their leading (batch) dimension over the batch mesh axes.

    lm_train_step            dense LM pre-training, dense warm-up (eq. 3), sparse training (eq. 4)
    grpo_train_step          one GRPO minibatch update (train/grpo_loss.py)
    grpo_reference_logprobs  log-probs of pi_ref on the sampled tokens' kept sets
    grpo_diagnostics         sampler-vs-trainer log-prob mismatch and routing agreement at pi_old
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from dsv32_jax.model import sharding as shd
from dsv32_jax.train import losses
from dsv32_jax.train.grpo_loss import grpo_loss, processed_logprobs
from dsv32_jax.train.optimizer import MasterState, group_norms

LM_BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


# ------------------------------------------------------------------------------------------------- shardings
def lm_batch_sharding(mesh) -> NamedSharding:
    """[batch, seq] arrays: batch over the batch mesh axes, sequence replicated."""
    return NamedSharding(mesh, shd.logical_to_spec(("batch", "seq"), mesh_shape=mesh.shape))


def leading_batch_sharding(mesh) -> NamedSharding:
    """Arrays of any rank split on their leading (batch) dimension only (a prefix for a whole batch tree)."""
    return NamedSharding(mesh, shd.logical_to_spec(("batch",), mesh_shape=mesh.shape))


def batch_devices(mesh) -> int:
    """How many ways the batch dimension is split on `mesh`."""
    spec = shd.logical_to_spec(("batch",), mesh_shape=mesh.shape)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


# --------------------------------------------------------------------------------------- dense / warmup / sparse
@dataclasses.dataclass(frozen=True)
class LossWeights:
    """config.loss as static step configuration."""
    indexer_weight: float = 1.0
    mtp_weight: float = 0.0
    balance_weight: float = 0.0
    bias_update_speed: float = 0.0
    # positions per chunk of the LM and MTP heads' cross-entropy (losses.chunked_token_nll); 0: the whole sequence
    token_chunk: int = 0

    @classmethod
    def from_config(cls, loss_cfg) -> "LossWeights":
        return cls(**{f.name: loss_cfg.get(f.name, f.default) for f in dataclasses.fields(cls)})


def lm_objective(model, batch, totals=None, *, stage: str, weights: LossWeights, model_cfg):
    """The stage's loss: warm-up = indexer KL (eq. 3; every indexer, the MTP layers' included); dense / sparse = LM
    loss (+ the indexer KL of eq. 4 in the sparse stage) + optional MTP and balance losses (the MTP layers run only
    with weights.mtp_weight > 0: with 0 the model's losses are those of the same weights without them). Every
    average divides by `totals` (losses.batch_totals of the step's whole batch; None: this batch's), so a
    microbatch's loss and metrics are its share of the whole batch's. Returns (loss, (metrics, routing aux, token
    mask))."""
    if totals is None:
        totals = losses.batch_totals(batch, model_cfg.num_nextn_predict_layers)
    chunk = weights.token_chunk
    # The MTP layers run where a loss reads them: the MTP loss (mtp_weight > 0) and the warm-up, which trains every
    # indexer, the MTP layer's too. With mtp_weight 0 they are left out (their parameters are frozen then): run
    # anyway, their indexer's KL joined the average (each main indexer's gradient scaled by L / (L + 1)) and their
    # router's balance loss reached the main model through the MTP block's input.
    out, aux = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                     return_aux=True, head=not chunk, mtp=stage == "warmup" or bool(weights.mtp_weight))
    token_mask = (batch["segment_ids"] > 0).astype(jnp.float32)
    if chunk:  # the heads applied chunk by chunk: no [B, T, V] logits at long context
        kernel = model.lm_head.kernel[...]
        nll = lambda h: lambda targets: losses.chunked_token_nll(h, kernel, targets, chunk)  # noqa: E731
        lm = losses.masked_mean(nll(out)(batch["targets"]), batch["loss_mask"], totals["lm"])
        aux["mtp_logits"] = [nll(h) for h in aux.pop("mtp_hidden")]
    else:
        lm = losses.lm_loss(out, batch, totals["lm"])
    kl, metrics = losses.indexer_kl(aux, token_mask, totals["tokens"])
    metrics.update(lm_loss=lm, indexer_kl=kl)
    if stage == "warmup":
        loss = kl
    else:
        loss = lm
        if stage == "sparse":
            loss = loss + weights.indexer_weight * kl
        if weights.mtp_weight and aux["mtp_logits"]:
            mtp = losses.mtp_loss(aux["mtp_logits"], batch, totals["mtp"])
            metrics["mtp_loss"] = mtp
            loss = loss + weights.mtp_weight * mtp
        if weights.balance_weight and model_cfg.has_moe:
            bal = losses.balance_loss(aux, token_mask, model_cfg.n_routed_experts, model_cfg.num_experts_per_tok,
                                      totals["sequences"])
            metrics["balance_loss"] = bal
            loss = loss + weights.balance_weight * bal
    captured = [v for k, v in metrics.items() if k.startswith("captured_mass/")]
    if captured:
        metrics["captured_mass"] = jnp.mean(jnp.stack(captured))
    metrics["loss"] = loss
    return loss, (metrics, {k: aux[k] for k in ("routing",) if k in aux}, token_mask)


def split_microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...] with microbatch i = rows i::n. The batch is split over devices in contiguous
    blocks of rows, and every block holds B/(n x shards) rows of each microbatch, so the split moves no data
    (check_batch_mesh makes B divisible by n x shards); each microbatch stays split over the batch axes."""
    def split(x):
        x = jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)
        return shd.constrain(x, (None, "batch", "seq")[:x.ndim])
    return jax.tree.map(split, batch)


def _microbatch_grads(graphdef, params, rest, batch, totals, *, objective, num_experts: int | None):
    """Gradients (w.r.t. `params`: the trainable state) of one (micro)batch's share of the loss, its metrics and
    (num_experts set) the expert loads per MoE layer [E] that the bias update needs. A pure function of arrays (the
    model is merged inside), so it runs in a lax.scan body."""
    def loss_fn(params):
        return objective(nnx.merge(graphdef, params, rest), batch, totals)

    grads, (metrics, aux, token_mask) = jax.grad(loss_fn, has_aux=True)(params)
    loads = {} if num_experts is None else {
        key: losses.expert_load(ids, token_mask, num_experts) for key, ids in aux["routing"].items() if ids is not None}
    return grads, metrics, loads


def accumulate_grads(model, batch: dict, totals: dict, microbatches: int, *, trainable, keep_f32: bool = False,
                     **kw):
    """Sum over `microbatches` microbatches (a lax.scan, one forward + backward at a time) of _microbatch_grads
    w.r.t. the `trainable` parameters: since each microbatch's loss is its share of the whole batch's (`totals`),
    the sums are the un-split step's gradients, metrics and loads up to float rounding. Accumulated in float32,
    returned in the gradients' dtype, or (keep_f32: the optimizer updates float32 master weights) as the float32
    sums, so a bf16 model's accumulated gradient reaches its master weights unrounded."""
    graphdef, params, rest = nnx.split(model, trainable, ...)
    one = functools.partial(_microbatch_grads, graphdef, params, rest, totals=totals, **kw)
    if microbatches == 1:
        return one(batch)
    micro = split_microbatches(batch, microbatches)
    shapes = jax.eval_shape(one, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32)), shapes)

    def body(acc, mb):
        return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, one(mb)), None

    acc, _ = jax.lax.scan(body, zeros, micro)
    grads, metrics, loads = jax.tree.map(lambda a, s: a.astype(s.dtype), acc, shapes)
    return (acc[0] if keep_f32 else grads), metrics, loads


def lm_train_step(state: nnx.State, batch: dict, *, graphdef, stage: str, trainable, weights: LossWeights,
                  model_cfg, lr_schedule, indexer_lr_schedule=None, microbatches: int = 1) -> tuple[nnx.State, dict]:
    """One optimizer step on `batch`; state = nnx state of (model, optimizer). Only `trainable` (the stage's
    filter) gets gradients, accumulated over `microbatches` splits of the batch (config.microbatches). Returns the
    new state and scalar metrics (grad_norm: global L2 norm before clipping; grad_norm/main, grad_norm/indexer:
    each optimizer group's, which its own clip sees; lr, lr_indexer: the learning rates this update used)."""
    model, optimizer = nnx.merge(graphdef, state)
    totals = losses.batch_totals(batch, model_cfg.num_nextn_predict_layers)
    bias_update = bool(weights.bias_update_speed) and stage != "warmup"
    grads, metrics, loads = accumulate_grads(
        model, batch, totals, microbatches, trainable=trainable,
        keep_f32=isinstance(optimizer.opt_state, MasterState),  # the moments are float32 too: no dtype change
        objective=functools.partial(lm_objective, stage=stage, weights=weights, model_cfg=model_cfg),
        num_experts=model_cfg.n_routed_experts if bias_update else None)
    optimizer.update(model, grads)
    for key, load in loads.items():
        n = model_cfg.num_hidden_layers
        ffn = (model.layers[key] if key < n else model.mtp[key - n].block).ffn
        ffn.bias[...] = losses.bias_update(ffn.bias[...], load, weights.bias_update_speed)
    metrics["grad_norm"] = optax.tree.norm(grads)
    for group, norm in group_norms(grads).items():
        metrics[f"grad_norm/{group}"] = norm
    step = jnp.maximum(optimizer.step[...] - 1, 0)
    metrics["lr"] = lr_schedule(step)
    if indexer_lr_schedule is not None:
        metrics["lr_indexer"] = indexer_lr_schedule(step)
    return nnx.state((model, optimizer)), metrics


def compile_lm_step(state_shardings, batch_sharding: NamedSharding, **static):
    """jit(lm_train_step) for one stage: `static` = lm_train_step's keyword arguments (microbatches included);
    the state is donated."""
    batch_sh = {k: batch_sharding for k in LM_BATCH_KEYS}
    return jax.jit(functools.partial(lm_train_step, **static), in_shardings=(state_shardings, batch_sh),
                   out_shardings=(state_shardings, None), donate_argnums=0)


# ---------------------------------------------------------------------------------------------------- GRPO
def forward_logprobs(model, batch, temperature: float, replay: bool):
    """Processed log-probs of the sampled tokens (restricted to the sampler's kept sets), entropy, kept mass and
    the model's aux; replay=True forces the routing that the sampler recorded (keep routing). The MTP layers are
    not run (the policy is the main head)."""
    p = batch["prompts"].shape[1]
    logits, aux = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segments"],
                        routing=batch["routing"] if replay else None, return_aux=True, mtp=False)
    logp, entropy, mass = processed_logprobs(logits[:, p - 1:-1], batch["gen"], batch["kept_ids"],
                                             batch["kept_mask"], temperature)
    return logp, entropy, mass, aux


def grpo_reference_logprobs(ref_state: nnx.State, batch: dict, *, graphdef, temperature: float) -> jax.Array:
    """log pi_ref of the sampled tokens: the frozen reference with its own routing, on the same kept sets."""
    return forward_logprobs(nnx.merge(graphdef, ref_state), batch, temperature, replay=False)[0]


def grpo_diagnostics(model_state: nnx.State, batch: dict, *, graphdef, temperature: float) -> dict:
    """At pi_old (before any update): sampler-vs-trainer log-prob mismatch and routing agreement."""
    model = nnx.merge(graphdef, model_state)
    logp, _, _, _ = forward_logprobs(model, batch, temperature, replay=True)
    _, _, _, native = forward_logprobs(model, batch, temperature, replay=False)
    m = batch["mask"]
    diff = jnp.abs(logp - batch["logp_old"]) * m
    valid = batch["segments"] > 0
    agree = [jnp.sum(jnp.all(jnp.sort(native["routing"][k], -1) == jnp.sort(ids, -1), -1) * valid)
             / jnp.maximum(jnp.sum(valid), 1) for k, ids in batch["routing"].items()]
    return {"logprob_mismatch_mean": jnp.sum(diff) / jnp.maximum(jnp.sum(m), 1.0),
            "logprob_mismatch_max": jnp.max(diff),
            "routing_agreement": jnp.mean(jnp.stack(agree)) if agree else jnp.ones(())}


def _grpo_update(state: nnx.State, batch: dict, logprobs_fn, mask, *, graphdef, temperature: float, eps: float,
                 delta: float, indexer_weight: float) -> tuple[nnx.State, dict]:
    """The GRPO update shared by single-turn and trajectory batches: logprobs_fn(model, batch, temperature,
    replay=True) -> (logp, entropy, kept mass, aux) over `mask`'s positions; the eq. (4) indexer KL on the real
    tokens when indexer_weight > 0."""
    model, optimizer = nnx.merge(graphdef, state)
    if indexer_weight:
        model.options = model.options.replace(indexer_loss="sparse")

    def loss_fn(model):
        logp, entropy, mass, aux = logprobs_fn(model, batch, temperature, replay=True)
        loss, metrics = grpo_loss(logp, batch["logp_old"], batch["logp_ref"], batch["adv"], mask, batch["beta"],
                                  eps=eps, delta=delta)
        metrics.update(entropy=jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0),
                       kept_mass=jnp.sum(mass * mask) / jnp.maximum(jnp.sum(mask), 1.0))
        if indexer_weight:
            kl, _ = losses.indexer_kl(aux, (batch["segments"] > 0).astype(jnp.float32))
            metrics["indexer_kl"] = kl
            loss = loss + indexer_weight * kl
        metrics["loss"] = loss
        return loss, metrics

    grads, metrics = nnx.grad(loss_fn, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)(model)
    optimizer.update(model, grads)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return nnx.state((model, optimizer)), metrics


def grpo_train_step(state: nnx.State, batch: dict, *, graphdef, temperature: float, eps: float,
                    delta: float, indexer_weight: float = 0.0) -> tuple[nnx.State, dict]:
    """One GRPO minibatch update of (model, optimizer) with keep routing and the keep sampling mask. With
    indexer_weight > 0 the lightning indexer keeps training during RL on the eq. (4) KL (its inputs detached, so
    the policy gradient is unchanged), averaged over the sequences' real tokens (prompt and completion)."""
    return _grpo_update(state, batch, forward_logprobs, batch["mask"], graphdef=graphdef, temperature=temperature,
                        eps=eps, delta=delta, indexer_weight=indexer_weight)


# ------------------------------------------------------------------------------------------ multi-turn trajectories
def trajectory_logprobs(model, batch, temperature: float, replay: bool):
    """Processed log-probs of every slot's token under the previous slot's logits, over a whole multi-turn
    trajectory layout (dsv32_jax.posttrain.sampler.MultiTurnSampler.layout: prompts, completions, tool results, padding);
    [B, S] with 0 at slot 0. Only slots with batch["gen"] = 1 (sampled tokens) enter the loss."""
    logits, aux = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segments"],
                        routing=batch["routing"] if replay else None, return_aux=True, mtp=False)
    gen = batch["gen"][:, 1:] > 0
    tokens, kept_ids, kept_mask = batch["tokens"][:, 1:], batch["kept_ids"][:, 1:], batch["kept_mask"][:, 1:]
    if kept_ids.shape[-1]:  # context slots have no kept set: a harmless stand-in (no NaN, not in the loss)
        tokens = jnp.where(gen, tokens, kept_ids[..., 0])
        kept_mask = kept_mask | ~gen[..., None]
    logp, entropy, mass = processed_logprobs(logits[:, :-1], tokens, kept_ids, kept_mask, temperature)
    pad = lambda x: jnp.pad(jnp.where(gen, x, 0.0), ((0, 0), (1, 0)))  # noqa: E731
    return pad(logp), pad(entropy), pad(mass), aux


def trajectory_reference_logprobs(ref_state: nnx.State, batch: dict, *, graphdef, temperature: float):
    return trajectory_logprobs(nnx.merge(graphdef, ref_state), batch, temperature, replay=False)[0]


def trajectory_diagnostics(model_state: nnx.State, batch: dict, *, graphdef, temperature: float) -> dict:
    """At pi_old: |sampler log-prob - teacher-forced log-prob| over the sampled tokens (mean, max)."""
    logp = trajectory_logprobs(nnx.merge(graphdef, model_state), batch, temperature, replay=True)[0]
    m = batch["gen"]
    diff = jnp.abs(logp - batch["logp_old"]) * m
    return {"logprob_mismatch_mean": jnp.sum(diff) / jnp.maximum(jnp.sum(m), 1.0),
            "logprob_mismatch_max": jnp.max(diff)}


def grpo_trajectory_train_step(state: nnx.State, batch: dict, *, graphdef, temperature: float, eps: float,
                               delta: float, indexer_weight: float = 0.0) -> tuple[nnx.State, dict]:
    """One GRPO update over multi-turn trajectories: the same objective and stabilizers as `grpo_train_step`
    (eq. 5-9: token mean over each trajectory's sampled tokens across all its turns, unbiased KL, off-policy
    sequence masking, keep routing, keep sampling mask); tool results and prompts are context only."""
    return _grpo_update(state, batch, trajectory_logprobs, batch["gen"], graphdef=graphdef, temperature=temperature,
                        eps=eps, delta=delta, indexer_weight=indexer_weight)


@dataclasses.dataclass(frozen=True)
class GRPOSteps:
    train: object  # (state, batch) -> (state, metrics); the state is donated
    reference: object  # (ref model state, batch) -> log pi_ref
    diagnostics: object  # (model state, batch) -> metrics


def compile_grpo_steps(*, graphdef, model_graphdef, state_shardings, batch_sharding: NamedSharding,
                       temperature: float, eps: float, delta: float, indexer_weight: float = 0.0) -> GRPOSteps:
    """The three jitted GRPO functions; `batch_sharding` applies to every batch array (leading dimension)."""
    model_sh = state_shardings[0]
    return GRPOSteps(
        train=jax.jit(functools.partial(grpo_train_step, graphdef=graphdef, temperature=temperature, eps=eps,
                                        delta=delta, indexer_weight=indexer_weight),
                      in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, None),
                      donate_argnums=0),
        reference=jax.jit(functools.partial(grpo_reference_logprobs, graphdef=model_graphdef,
                                            temperature=temperature),
                          in_shardings=(model_sh, batch_sharding), out_shardings=batch_sharding),
        diagnostics=jax.jit(functools.partial(grpo_diagnostics, graphdef=model_graphdef, temperature=temperature),
                            in_shardings=(model_sh, batch_sharding), out_shardings=None))
