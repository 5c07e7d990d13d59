"""Agentic GRPO: multi-turn rollouts in tool environments, cold-start SFT on the environments' demonstrations, GRPO
over whole trajectories with DeepSeek-V3.2's four stabilizers, task mixing with per-domain KL weights, and the
eq. (4) indexer KL kept on during RL.

One step: `tasks_per_step` (environment, seed) tasks drawn from the mix, each run `group_size` times by
`dsv32_jax.posttrain.agent.rollout.BatchedRollout` (every row's episode through the chat encoding, tools on the host, all
rows' completions sampled together over one decode cache, recording log-probs, kept sets and routing of every
model token); reward = the environment's verifier; A = R - group mean; then `epochs` x `minibatches` updates of
`train/steps.py:grpo_trajectory_train_step` on the trajectories' layouts (loss on model tokens only: tool results
and prompts are context). pi_ref is the model after cold start. `cold_start_steps` > 0 first trains on the oracle
demonstrations (`env.demonstration(seed)` as chat-encoded trajectories, loss on the assistant's tokens).

Config: `config.agent` (train/config.py). Entry point: stage "agent" of `python -m dsv32_jax.train.main`.
`config.agent.envs` names registered environments or import paths ("my_pkg.my_env:MyEnv", docs/environments.md).
Before any work the learner checks the configuration: every environment resolves, its texts are encodable by the
codec, its first prompt plus `max_new_tokens` fits `capacity`, and the model's vocabulary holds the codec's (a larger,
padded one is masked when sampling: `SamplingConfig.vocab_size`); each error names the config fields.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from dsv32_jax.posttrain import chat
from dsv32_jax.model import sharding as shd
from dsv32_jax.posttrain.agent.episode import OraclePolicy, chat_tools, check_env_text, recovery_demonstration, run_episode
from dsv32_jax.posttrain.agent.recall import INDUCTION_CHARS, recall_examples
from dsv32_jax.posttrain.agent.rollout import BatchedRollout
from dsv32_jax.posttrain.envs import Env, env_factory, make_env
from dsv32_jax.posttrain.sampler import PIECE_BUCKET, SamplingConfig, bucketed
from dsv32_jax.train import checkpointing, losses, steps
from dsv32_jax.train.config import check_config
from dsv32_jax.train.grpo import (check_group_size, check_minibatches, minibatch_updates, sampling_config,
                                  warn_nucleus_capped)
from dsv32_jax.train.grpo_loss import group_advantages
from dsv32_jax.train.loop import check_finite, run_loop, saved_note
from dsv32_jax.train.optimizer import make_tx, trainable_filter
from dsv32_jax.train.trainer import build_policy, resumed_model_config

# step 0's recall stage / cold start progress (AgentLearner.prepare), until the first RL checkpoint
SFT_CHECKPOINTS_DIR = "sft_checkpoints"
TOOL_KEYS = ("tool_calls", "tool_errors", "tool_crashes", "tool_timeouts")
CONSOLE_KEYS = ("reward_mean", "success", "eval_success", "turns", "kl", "opsm_masked_fraction",
                "logprob_mismatch_max", "indexer_kl", "sft_loss", "grad_norm")


def legacy_perturb(config) -> None:
    """`config.agent.init_perturb`, the old name of `config.init_perturb` (BENCHMARKS.md's agent sweeps use it):
    moved there, with a warning, so that one place perturbs a fresh model (trainer.fresh_model; the same
    parameters, bit for bit, as the agent learner's own perturbation gave, which also perturbed a model loaded
    through init_from). Both set to different values is an error naming the two."""
    old = float(config.agent.get("init_perturb", 0.0))
    if not old:
        return
    new = float(config.get("init_perturb", 0.0))
    if new and new != old:
        raise ValueError(f"config.agent.init_perturb={old} and config.init_perturb={new}: set only "
                         "config.init_perturb (config.agent.init_perturb is its old name)")
    logging.warning("config.agent.init_perturb=%g is config.init_perturb's old name: set config.init_perturb", old)
    config.init_perturb = old


def make_codec(name: str) -> chat.Codec:
    if name == "tiny":
        return chat.TinyCodec.printable()
    if name == "bpe":
        return chat.load_tokenizer()
    raise ValueError(f"config.agent.codec must be 'tiny' or 'bpe', got {name!r}")


def env_specs(value) -> list[str]:
    """`config.agent.envs`: a comma-separated string or a list of registered names and import paths."""
    items = value.split(",") if isinstance(value, str) else list(value)
    specs = [str(e).strip() for e in items if str(e).strip()]
    if not specs:
        raise ValueError(f"config.agent.envs: no environment in {value!r}")
    return specs


def layout_width(slots: int, capacity: int) -> int:
    """The trajectory step's width for a rollout that used `slots` cache slots (<= capacity): bucketed (fewer
    recompiles), never wider than the capacity's multiple of 64 (a bucket past it cost activation memory for
    nothing: capacity 4100 gave up to 4608; review)."""
    return min(bucketed(slots, 64), -(-capacity // 64) * 64)


def sft_batch(trajectories, width: int, bucket: int = 0, rows_multiple: int = 1) -> dict:
    """Chat-encoded trajectories -> an LM batch: predict token t+1 from t where t+1 is an assistant token.
    `bucket` > 0: the batch is only as wide as the longest trajectory rounded up to its bucket (`bucketed`).
    `rows_multiple`: empty rows (segment 0, no loss: the token-averaged losses ignore them) are added up to a
    multiple of it (the mesh's batch shards: the example count of a step need not divide them)."""
    b = -(-len(trajectories) // rows_multiple) * rows_multiple
    if bucket:
        width = min(width, bucketed(max(len(ids) for ids, _ in trajectories), bucket))
    out = {k: np.zeros((b, width), np.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    out["loss_mask"] = np.zeros((b, width), np.float32)
    for i, (ids, mask) in enumerate(trajectories):
        n = len(ids)
        if n > width:
            raise ValueError(f"config.agent.capacity={width}: a demonstration has {n} tokens")
        out["tokens"][i, :n], out["segment_ids"][i, :n], out["positions"][i, :n] = ids, 1, np.arange(n)
        out["targets"][i, :n - 1] = ids[1:]
        out["loss_mask"][i, :n - 1] = mask[1:]
    return out


def sft_step(state, batch, *, graphdef, indexer_weight: float):
    """Cold-start SFT: next-token loss on the assistant's tokens (+ the eq. 4 indexer KL)."""
    model, optimizer = nnx.merge(graphdef, state)
    model.options = model.options.replace(indexer_loss="sparse" if indexer_weight else None)

    def loss_fn(model):
        logits, aux = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                            return_aux=True, mtp=False)
        lm = losses.lm_loss(logits, batch)
        kl, _ = losses.indexer_kl(aux, (batch["segment_ids"] > 0).astype(jnp.float32))
        loss = lm + indexer_weight * kl
        return loss, {"sft_loss": lm, "indexer_kl": kl, "loss": loss}

    grads, metrics = nnx.grad(loss_fn, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)(model)
    optimizer.update(model, grads)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return nnx.state((model, optimizer)), metrics


def _format_error(t) -> bool:
    """The episode ended on a malformed completion (chat.parse_completion's "format: ..." errors)."""
    return str(t.info.get("error", "")).startswith("format")


def _context_full(t) -> bool:
    """The episode ended because its context or the shared rollout cache had no room (run_episode's "context full":
    reward 0 whatever the model would have done; agent.capacity too small for the tasks' turns)."""
    return str(t.info.get("error", "")).startswith("context full")


def _reward_error(t) -> bool:
    """The verifier's result was no usable reward (Env.step's info "reward_error": not a finite number, outside [0, 1],
    past score_timeout): a broken verifier, not the model."""
    return "reward_error" in t.info


# A field a version added, with the value that reproduces what the versions before it did (where that is not the
# default): a stored fingerprint that lacks it was written under this value.
LEGACY = {"optimizer": {"weight_decay_mask": "all"}}


def fingerprint_diff(there: dict, here: dict) -> list[str]:
    """What differs between two step-0 fingerprints (AgentLearner._sft_fingerprint), one line a field. A field of
    config.optimizer / config.agent the stored one lacks and this one holds at the value the older version ran
    with (LEGACY's, else the default) is no difference: a checkpoint written before this version added the field
    could not have set it (it was refused as another configuration, and the run could not continue under the new
    version). optimizer.weight_decay_mask is no difference where both runs have weight_decay 0."""
    from dsv32_jax.train.config import default_config

    defaults = json.loads(json.dumps({sec: default_config()[sec].to_dict() for sec in ("optimizer", "agent")},
                                     default=str))
    for sec, fields in LEGACY.items():
        defaults[sec].update(fields)
    diff = []
    for sec in sorted(set(there) | set(here)):
        x, y = there.get(sec), here.get(sec)
        if isinstance(x, dict) and isinstance(y, dict):
            name = "model field {}" if sec == "model" else f"config.{sec}.{{}}"
            new = {k for k in set(y) - set(x) if k in defaults.get(sec, {}) and y[k] == defaults[sec][k]}
            if sec == "optimizer" and not x.get("weight_decay", 0.0) and not y.get("weight_decay", 0.0):
                new.add("weight_decay_mask")  # (no decay: the mask decides nothing)
            diff += [f"{name.format(k)} {x.get(k)!r} there, {y.get(k)!r} here" for k in sorted(set(x) | set(y))
                     if k not in new and x.get(k) != y.get(k)]
        elif x != y:
            diff.append(f"config.{sec} {x!r} there, {y!r} here")
    return diff


def model_tokens(t) -> int:
    """The tokens the model generated in an episode (every completion it keeps; the length penalty's count)."""
    return sum(c.length for c in t.completions)


def model_text(t) -> str:
    """The model's reasoning and answers of an episode, one per line (what language_consistency reads)."""
    parts = []
    for m in t.history:
        if isinstance(m, chat.Assistant):
            parts += [x for x in (m.reasoning, m.content) if x]
    return "\n".join(parts)


def _log_progress(phase: str, i: int, total: int, history: list[float], every: int = 50) -> None:
    """An INFO line every `every` SFT steps of step 0's recall stage / cold start (minutes without a bar step)."""
    if (i + 1) % every == 0 or i + 1 == total:
        logging.info("%s %d/%d: loss %.4f (mean of the last %d: %.4f)", phase, i + 1, total, history[-1],
                     min(every, len(history)), float(np.mean(history[-every:])))


def constant_rate(optimizer, lr: float):
    """config.optimizer at constant `lr` from its first update (None when lr is 0: the optimizer as configured)."""
    if not lr:
        return None
    opt = ml_collections.ConfigDict(optimizer.to_dict())
    opt.lr, opt.schedule, opt.warmup_steps = float(lr), "constant", 0
    return opt


def anneal_optimizer(config):
    """The optimizer settings of the cold start's last `agent.anneal_steps` SFT updates (None: as configured).
    "constant": at agent.anneal_lr. "cosine": config.optimizer.lr decayed to anneal_lr over the anneal, which starts
    at update recall_steps + cold_start_steps - anneal_steps of the optimizer's count (it runs through the recall
    stage and the cold start)."""
    a = config.agent
    if a.anneal_schedule == "constant" or not a.anneal_lr:
        return constant_rate(config.optimizer, a.anneal_lr)
    start = a.recall_steps + a.cold_start_steps - a.anneal_steps
    opt = ml_collections.ConfigDict(config.optimizer.to_dict())
    opt.schedule, opt.warmup_steps, opt.hold_steps = "cosine", 0, start
    opt.decay_steps, opt.final_lr_fraction = start + a.anneal_steps, float(a.anneal_lr) / opt.lr
    return opt


class AgentLearner:
    _prepared = None  # step 0's metrics once prepare() is done
    _warned_full = False  # the context_full warning was logged
    _warned_reward = False  # the reward_errors warning was logged
    _warned_nucleus = False  # the nucleus_capped warning was logged
    _last_trajs: tuple = ()  # the last rollout's trajectories (the warning quotes one)
    _sft_checked: dict = {}  # the last SFT update's total loss and gradient norm (prepare stops on a non-finite one)

    def __init__(self, config, workdir: str):
        check_config(config)
        self.config, self.workdir, self.a = config, workdir, config.agent
        a = self.a
        self.codec = make_codec(a.codec)
        self.envs = env_specs(a.envs)
        self.env_kwargs, kwargs_key, names = {}, {}, set()
        for spec in self.envs:
            try:
                factory = env_factory(spec)
            except (ValueError, TypeError) as e:
                raise ValueError(f"config.agent.envs: {e}") from e
            # env_kwargs by the entry of envs, or by the environment class's name (import paths hold dots)
            name = getattr(factory, "name", "")
            names.add(name)
            kwargs_key[spec] = spec if spec in a.env_kwargs else name
            self.env_kwargs[spec] = dict(a.env_kwargs.get(kwargs_key[spec], {}))
        unknown = sorted(set(a.env_kwargs) - set(self.envs) - names)
        if unknown:  # (a misspelled environment's kwargs were dropped silently; a config may name more environments)
            logging.warning("config.agent.env_kwargs: %s is neither an entry of config.agent.envs (%s) nor one's "
                            "name; its kwargs apply to nothing", ", ".join(unknown), ", ".join(self.envs))
        self.cfg, self.resume = resumed_model_config(config, workdir, "agent")
        if self.cfg.vocab_size < self.codec.vocab_size:
            raise ValueError(f"config.model={config.model!r} has vocab_size {self.cfg.vocab_size} "
                             f"(config.model_overrides.vocab_size), fewer ids than config.agent.codec={a.codec!r} "
                             f"({self.codec.vocab_size}): the model cannot emit every token of the chat format")
        # a larger (padded) model vocabulary: ids beyond the codec's are never sampled
        mask = self.codec.vocab_size if self.cfg.vocab_size > self.codec.vocab_size else 0
        if a.drop_thinking not in chat.DROP_MODES:
            raise ValueError(f"config.agent.drop_thinking must be one of {', '.join(chat.DROP_MODES)}, "
                             f"got {a.drop_thinking!r}")
        self._envs = {}  # (also the reward terms' instances)
        for spec in self.envs:
            try:
                self._envs[spec] = self.make_env(spec)
            except (TypeError, ValueError) as e:  # (a keyword the constructor does not take, or a bad value)
                where = (f"config.agent.env_kwargs.{kwargs_key[spec]}" if self.env_kwargs[spec]
                         else f"config.agent.envs ({spec})")
                raise ValueError(f"{where}: {e}") from e
        self.domains = {spec: env.domain for spec, env in self._envs.items()}
        if a.get("language_weight", 0.0):
            langs = [s for s, e in self._envs.items() if type(e).language_consistency is not Env.language_consistency]
            if not langs:
                raise ValueError(f"config.agent.language_weight={a.language_weight}: no environment of "
                                 f"config.agent.envs ({', '.join(self.envs)}) has a language to check (an Env "
                                 "subclass implements language_consistency(instance, text); the built-in ones do not)")
        self.check_first_prompts()
        unknown = sorted(set(a.kl_weights) - set(self.domains.values()))
        if unknown:  # a misspelled domain silently took config.agent.kl_weight (a config may name more domains)
            logging.warning("config.agent.kl_weights: %s is the domain of no environment of config.agent.envs (the "
                            "domains: %s); it applies to nothing", ", ".join(unknown),
                            ", ".join(sorted(set(self.domains.values()))))
        self.beta = {name: float(a.kl_weights.get(self.domains[name], a.kl_weight)) for name in self.envs}
        self.sampling = sampling_config("agent", max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                        top_k=a.top_k, top_p=a.top_p, max_candidates=a.max_candidates,
                                        eos_id=self.codec.eos_id, pad_id=self.codec.pad_id, vocab_size=mask)
        self.greedy = SamplingConfig(max_new_tokens=a.max_new_tokens, greedy=True, eos_id=self.codec.eos_id,
                                     pad_id=self.codec.pad_id, vocab_size=mask)
        self.mesh = shd.make_mesh(config.mesh or "fsdp:-1")
        check_group_size(a.group_size, "config.agent.group_size")
        check_minibatches("config.agent: tasks_per_step", a.tasks_per_step * a.group_size, a.minibatches, self.mesh,
                          config.mesh, "config.agent.minibatches")
        self.batch_sharding = steps.leading_batch_sharding(self.mesh)
        dtype, pdtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        legacy_perturb(config)
        model = build_policy(config, self.cfg, dtype, pdtype, resuming=self.resume is not None, mesh=self.mesh)
        self.cfg = model.config  # what the checkpoints record (init_from's: e.g. without an MTP layer)
        # the policy is the main head: the MTP layers get no gradient (nor the indexer at weight 0)
        self.trainable = trainable_filter("agent", mtp=False, indexer=bool(float(a.indexer_weight)))
        optimizer = nnx.Optimizer(model, make_tx(config.optimizer, pdtype), wrt=self.trainable)
        self.graphdef, state = nnx.split((model, optimizer))
        # GRPO (agent.rl_lr) and the end of the cold start (agent.anneal_lr) may run at their own constant learning
        # rates: the same optimizer state, other static graphs
        for field in ("rl_lr", "anneal_lr"):
            if a[field] < 0:
                raise ValueError(f"config.agent.{field} must be >= 0 (0: config.optimizer.lr), got {a[field]}")
        if a.eval_samples < 0:
            raise ValueError(f"config.agent.eval_samples must be >= 0 (0: greedy evaluation only), got {a.eval_samples}")
        if not 0 <= a.anneal_steps <= a.cold_start_steps:
            raise ValueError(f"config.agent.anneal_steps must be in [0, cold_start_steps={a.cold_start_steps}], "
                             f"got {a.anneal_steps}")

        if a.anneal_schedule not in ("constant", "cosine"):
            raise ValueError(f"config.agent.anneal_schedule must be 'constant' or 'cosine', got {a.anneal_schedule!r}")

        def graphdef_at(opt):
            if opt is None:
                return self.graphdef
            return nnx.split((model, nnx.Optimizer(model, make_tx(opt, pdtype), wrt=self.trainable)))[0]

        self.rl_graphdef = graphdef_at(constant_rate(config.optimizer, a.rl_lr))
        self.model_graphdef = nnx.split(model)[0]
        self.shardings = shd.state_shardings(state, self.mesh)
        self.state = jax.device_put(state, self.shardings)
        self.ref = None  # pi_ref: the policy after cold start (set at the first RL step)
        self.step = 0
        t, w = self.sampling.temperature, float(a.indexer_weight)
        # the updated state keeps the rule table's layout (XLA's propagation moved some leaves elsewhere: a
        # recompile at the next step, and another layout in the checkpoint); metrics replicated
        keep_layout = (self.shardings, None)
        self._train = jax.jit(functools.partial(steps.grpo_trajectory_train_step, graphdef=self.rl_graphdef,
                                                temperature=t, eps=a.eps, delta=a.delta, indexer_weight=w),
                              out_shardings=keep_layout, donate_argnums=0)
        self._reference = jax.jit(functools.partial(steps.trajectory_reference_logprobs,
                                                    graphdef=self.model_graphdef, temperature=t))
        self._diagnostics = jax.jit(functools.partial(steps.trajectory_diagnostics, graphdef=self.model_graphdef,
                                                      temperature=t))
        self._sft = jax.jit(functools.partial(sft_step, graphdef=self.graphdef, indexer_weight=w),
                            out_shardings=keep_layout, donate_argnums=0)
        self._sft_anneal = jax.jit(functools.partial(sft_step, graphdef=graphdef_at(anneal_optimizer(config)),
                                                     indexer_weight=w), out_shardings=keep_layout,
                                   donate_argnums=0) if a.anneal_steps else self._sft

    def _model(self):
        return nnx.merge(self.graphdef, self.state)[0]

    def make_env(self, spec: str):
        return make_env(spec, **self.env_kwargs[spec])

    def check_first_prompts(self, seeds=(0, 10**6, 10**7), sample: int = 32) -> None:
        """Before any work: every environment's texts are encodable by the codec and its first prompt plus
        `max_new_tokens` fits `capacity` as the rollout's sampler lays it out (the prompt padded to its bucket,
        `sampler.bucketed`), at the first seed of the RL, cold-start and evaluation ranges and at `sample` RL seeds
        (prompt lengths vary by task: checking three seeds let a capacity through that half of the tasks overran).
        A longer task that still overruns ends "context full" (the `context_full` metric)."""
        a = self.a
        ctx = int(self.cfg.max_position_embeddings)
        caps = self.capacities()
        for field, cap in caps:  # (the rollout's sampler refuses it, but only after the step-0 SFT)
            if cap > ctx:
                raise ValueError(f"{field}={cap} exceeds the model's context of {ctx} positions "
                                 "(max_position_embeddings of the model config)")
        bucket = PIECE_BUCKET  # the rollout's MultiTurnSampler pads each piece to it
        rl = [int(x) for x in np.random.default_rng(12345).integers(0, 10**6, sample)]
        for spec in self.envs:
            env = self.make_env(spec)
            longest = (0, None)
            for seed in list(seeds) + rl:
                obs = env.reset(seed)
                try:
                    check_env_text(env, obs, self.codec, seed)
                except ValueError as e:
                    raise ValueError(f"config.agent.envs / config.agent.codec={a.codec!r}: {e}") from None
                n = len(chat.encode_tokens([chat.System(obs.system), chat.User(obs.task)], self.codec,
                                           tools=chat_tools(env), thinking=a.thinking, drop_thinking=a.drop_thinking,
                                           tools_prompt=a.tools_prompt)[0])
                longest = max(longest, (n, seed))
            n, seed = longest
            need = bucketed(n, bucket) + a.max_new_tokens
            for field, cap in caps:
                if need > cap:
                    raise ValueError(f"{field}={cap} is too small: the longest first prompt of "
                                     f"environment {spec!r} at {len(seeds) + sample} seeds (seed {seed}) has {n} tokens "
                                     f"with config.agent.codec={a.codec!r} and config.agent.tools_prompt="
                                     f"{a.tools_prompt!r}; padded to the sampler's bucket "
                                     f"({need - a.max_new_tokens}) plus config.agent.max_new_tokens={a.max_new_tokens} "
                                     f"it needs {need}; raise it to at least that (more for longer tasks and later turns)")

    def capacities(self) -> list[tuple[str, int]]:
        """(config field, decode-cache size) of the training rollouts and of every extra greedy evaluation."""
        return [("config.agent.capacity", int(self.a.capacity))] + [
            (f"config.agent.eval_capacities[{i}]", int(c)) for i, c in enumerate(self.a.get("eval_capacities", ()))]

    def _episode_kwargs(self, capacity: int | None = None):
        return dict(max_turns=self.a.max_turns, max_new_tokens=self.a.max_new_tokens,
                    context_budget=self.a.capacity if capacity is None else capacity, thinking=self.a.thinking,
                    tools_prompt=self.a.tools_prompt, drop_thinking=self.a.drop_thinking)

    # --------------------------------------------------------------- cold start
    def demonstrations(self, seeds) -> list[tuple[list[int], list[int]]]:
        """(ids, loss_mask) of oracle episodes, cycling over the environment mix; `config.agent.recovery_fraction`
        of them first make a near-miss call and recover from its error (episode.recovery_demonstration). On several
        processes each runs its block of the episodes (sharding.process_map): an environment is called once per
        episode."""
        per_seed = shd.process_map("the cold start's oracle episodes", lambda x: self._demonstration(*x),
                                   enumerate(seeds))
        return [example for examples in per_seed for example in examples]

    def _demonstration(self, i: int, seed: int) -> list[tuple[list[int], list[int]]]:
        name = self.envs[i % len(self.envs)]
        env = self.make_env(name)
        kw = dict(self._episode_kwargs(), max_new_tokens=self.a.capacity, max_turns=16)  # not sampled
        rng = random.Random(seed)
        if self.a.recovery_fraction and rng.random() < self.a.recovery_fraction:
            t = recovery_demonstration(env, seed, self.codec, rng, **kw)  # None: no near miss for this task
            if t is not None:
                return [(g.ids, g.loss_mask) for g in t.segments]
        t = run_episode(env, seed, OraclePolicy(env, self.codec, seed, self.a.thinking), self.codec, **kw)
        if not t.success:
            raise RuntimeError(f"oracle episode of {name} seed {seed} failed: {t.info}")
        # every segment: one per turn under drop_thinking="every_turn" (each turn re-renders the history)
        return [(g.ids, g.loss_mask) for g in t.segments]

    def recall_data(self, step: int, count: int) -> list[tuple[list[int], list[int]]]:
        """`count` copying conversations (dsv32_jax/posttrain/agent/recall.py) for SFT step `step` (seeded by it)."""
        kinds = [k.strip() for k in self.a.recall_kinds.split(",") if k.strip()]
        return recall_examples(self.config.seed * 1_000_003 + step, count, self.codec, kinds, thinking=self.a.thinking,
                               induction_len=self.a.recall_induction_len, span_items=self.a.recall_span_items,
                               span_gap=self.a.recall_span_gap, chars=self.a.recall_chars or INDUCTION_CHARS)

    def _sft_update(self, examples, anneal: bool = False) -> float:
        batch = sft_batch(examples, self.a.capacity, bucket=64, rows_multiple=steps.batch_devices(self.mesh))
        with shd.use_mesh(self.mesh):
            step = self._sft_anneal if anneal else self._sft
            self.state, m = step(self.state, jax.device_put(batch, self.batch_sharding))
        m = jax.device_get(m)  # (one transfer; prepare checks the total loss and the gradient norm too)
        self._sft_checked = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}
        return float(m["sft_loss"])

    def recall_stage(self, steps_: int, batch_size: int, start: int = 0, after=None) -> list[float]:
        """SFT steps `start` .. `start + steps_ - 1` on synthetic copying conversations (loss on the answers).
        `after(s, loss) -> bool` runs after step s; True ends the stage there (a stop signal)."""
        history = []
        for s in range(start, start + steps_):
            history.append(self._sft_update(self.recall_data(s, batch_size)))
            _log_progress("recall", s - start, steps_, history)
            if after is not None and after(s, history[-1]):
                break
        return history

    def cold_start(self, steps_: int, batch_size: int, start: int = 0, after=None) -> list[float]:
        """SFT steps `start` .. `start + steps_ - 1` on fresh oracle demonstrations (seeds disjoint from RL's:
        10^6 + ...); `config.agent.recall_mix` of each batch are copying conversations instead. The last
        `config.agent.anneal_steps` of the `cold_start_steps` run at `config.agent.anneal_lr`. `after` as in
        recall_stage."""
        history = []
        n_recall = int(round(self.a.recall_mix * batch_size))
        for s in range(start, start + steps_):
            seeds = [10**6 + s * batch_size + i for i in range(batch_size - n_recall)]
            examples = self.demonstrations(seeds)
            if n_recall:
                examples += self.recall_data(10**6 + s, n_recall)
            history.append(self._sft_update(examples, anneal=s >= self.a.cold_start_steps - self.a.anneal_steps))
            _log_progress("cold start", s - start, steps_, history)
            if after is not None and after(s, history[-1]):
                break
        return history

    # ------------------------------------------------------- before step 1
    def prepare(self, stop=None) -> None:
        """Step 0's work before the first rollout: greedy evaluation at the start (`start_*` metrics), the recall
        stage, the cold start, evaluation after them (`pre_*`); the metrics join step 1's row. It can take hours
        (`make agent-demo`: ~30 CPU minutes), so its progress is checkpointed in W/sft_checkpoints every
        `config.agent.sft_checkpoint_every` SFT updates and when `stop` (checkpointing.StopSignal) is requested,
        which ends it early; a run in a workdir holding such a checkpoint (and no RL one) continues from it, with
        the configuration that wrote it (checkpointing.ResumeError otherwise). No-op after step 0 or once done."""
        a = self.a
        total = a.recall_steps + a.cold_start_steps
        if self.step or self._prepared is not None or not total:
            return
        every = int(a.sft_checkpoint_every)
        with self._sft_manager() as mngr:
            done, meta = self._restore_sft(mngr)
            metrics = dict(meta.get("metrics", {}))
            if done == 0:
                metrics.update({f"start_{k}": v for k, v in self.evaluate().items()})  # the chance level

            stopped = [False]

            def after(loss_key: str, time_key: str, offset: int):
                t = [time.perf_counter()]

                def fn(s, loss):  # after SFT update `s` of a stage that starts at update `offset`
                    n = offset + s + 1  # SFT updates done
                    now = time.perf_counter()
                    where = os.path.join(self.workdir, SFT_CHECKPOINTS_DIR)  # (the total loss and grad norm too:)
                    check_finite({loss_key: loss, **self._sft_checked}, f"SFT update {n} of step 0",
                                 lambda: saved_note(checkpointing.saved_steps(mngr), where, "SFT update"))
                    metrics[loss_key], metrics[time_key] = loss, metrics.get(time_key, 0.0) + now - t[0]
                    t[0] = now
                    stopped[0] = stop is not None and stop.requested
                    if stopped[0] or (every and n % every == 0) or n == total:
                        self._save_sft(mngr, n, metrics)
                    return stopped[0]
                return fn

            if done < a.recall_steps:
                done += len(self.recall_stage(a.recall_steps - done, a.recall_batch, start=done,
                                              after=after("recall_loss", "recall_s", 0)))
            if a.recall_steps <= done < total and not stopped[0]:
                s0 = done - a.recall_steps
                done += len(self.cold_start(a.cold_start_steps - s0, a.cold_start_batch, start=s0,
                                            after=after("sft_loss", "cold_start_s", a.recall_steps)))
            mngr.wait_until_finished()
        if done < total:  # stopped: the checkpoint above holds the progress
            logging.info("stopped by a signal after %d of %d SFT updates (saved in %s)", done, total,
                         os.path.join(self.workdir, SFT_CHECKPOINTS_DIR))
            return
        metrics.update({f"pre_{k}": v for k, v in self.evaluate().items()})
        self._prepared = metrics

    def _sft_fingerprint(self) -> dict:
        """What a continued step 0 must share with the run that saved it: the seed, the model, the optimizer and
        config.agent (JSON values; not sft_checkpoint_every nor eval_capacities, which change no update)."""
        agent = {k: v for k, v in self.a.to_dict().items() if k not in ("sft_checkpoint_every", "eval_capacities")}
        return json.loads(json.dumps({"seed": self.config.seed, "model": self.cfg.to_hf(),
                                      "optimizer": self.config.optimizer.to_dict(), "agent": agent}, default=str))

    def _sft_manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(os.path.abspath(os.path.join(self.workdir, SFT_CHECKPOINTS_DIR)),
                                     options=ocp.CheckpointManagerOptions(
                                         max_to_keep=1, enable_async_checkpointing=self.config.checkpoint.use_async))

    def _save_sft(self, mngr, n: int, metrics: dict) -> None:
        checkpointing.save(mngr, n, arrays={"params": self.state[0], "opt": self.state[1]}, force=True,
                           json={"meta": {"sft_updates": n, "stage": "agent", "metrics": metrics,
                                          "config": self._sft_fingerprint()}})

    def _restore_sft(self, mngr) -> tuple[int, dict]:
        """(SFT updates done, meta) of the workdir's step-0 checkpoint; (0, {}) without one. Raises
        checkpointing.ResumeError naming what differs when another configuration wrote it."""
        n = mngr.latest_step()
        if n is None:
            return 0, {}
        where = os.path.join(self.workdir, SFT_CHECKPOINTS_DIR)
        meta = mngr.restore(n, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        diff = fingerprint_diff(meta.get("config", {}), self._sft_fingerprint())
        if diff:
            raise checkpointing.ResumeError(
                f"{where}: its step-0 checkpoint ({n} SFT updates of the recall stage / cold start) was written with "
                f"another configuration ({'; '.join(diff[:6])}{f'; {len(diff) - 6} more' if len(diff) > 6 else ''}"
                f"): continue it with the config that wrote it, or delete {where} to start step 0 again")
        checkpointing.restore(mngr, n, arrays={"params": (self.state[0], self.shardings[0]),
                                               "opt": (self.state[1], self.shardings[1])})
        logging.info("continuing step 0 from %s: %d of %d SFT updates done", where, n,
                     self.a.recall_steps + self.a.cold_start_steps)
        return n, meta

    # ------------------------------------------------------------------ rollout
    def tasks(self, step: int):
        rng = np.random.default_rng([self.config.seed, step])
        picks = [(self.envs[int(rng.integers(len(self.envs)))], int(rng.integers(10**6)))
                 for _ in range(self.a.tasks_per_step)]
        rows = [picks[i] for i in np.repeat(np.arange(len(picks)), self.a.group_size)]
        return rows, np.repeat(np.arange(len(picks)), self.a.group_size)

    def run(self, rows, cfg: SamplingConfig, key_seed: int, capacity: int | None = None):
        """The episodes of `rows` over one decode cache of `capacity` slots (None: config.agent.capacity), which is
        also the episodes' context budget."""
        envs = [self.make_env(name) for name, _ in rows]
        cap = self.a.capacity if capacity is None else capacity
        with shd.use_mesh(self.mesh):
            return BatchedRollout(self._model(), self.codec, cfg, cap, seed=key_seed).run(
                envs, [s for _, s in rows], **self._episode_kwargs(cap))

    def rollout(self, step: int):
        rows, group_ids = self.tasks(step)
        trajs, rec = self.run(rows, self.sampling, key_seed=self.config.seed * 100_003 + step)
        self._last_trajs = trajs
        rewards = np.array([t.reward for t in trajs], np.float32)
        terms = self.reward_terms(trajs, rows)
        total = rewards + sum(terms.values(), np.zeros_like(rewards))
        shd.check_same_on_processes("the agent's rewards (verifiers, reward terms)", total)
        adv = group_advantages(total, group_ids)
        width = layout_width(rec["tokens"].shape[1], int(self.a.capacity))
        padw = lambda x: np.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        batch = {"tokens": padw(rec["tokens"]), "positions": padw(rec["positions"]), "segments": padw(rec["segments"]),
                 "gen": padw(rec["generated"]), "logp_old": padw(rec["logprobs"]), "kept_ids": padw(rec["kept_ids"]),
                 "kept_mask": padw(rec["kept_mask"]), "routing": {k: padw(v) for k, v in rec["routing"].items()},
                 "adv": adv, "beta": np.asarray([self.beta[name] for name, _ in rows], np.float32)}
        stats = {"reward_mean": float(rewards.mean()), **{k: float(v.mean()) for k, v in terms.items()},
                 **({"reward_total": float(total.mean())} if terms else {}),
                 "success": float(np.mean([t.success for t in trajs])),
                 "turns": float(np.mean([t.turns for t in trajs])),
                 "format_errors": float(np.mean([_format_error(t) for t in trajs])),
                 "context_full": float(np.mean([_context_full(t) for t in trajs])),
                 "reward_errors": float(np.mean([_reward_error(t) for t in trajs])),
                 "model_tokens": float(batch["gen"].sum() / len(trajs)),
                 **{k: float(np.mean([getattr(t, k) for t in trajs])) for k in TOOL_KEYS}}
        return batch, stats

    def reward_terms(self, trajs, rows) -> dict[str, np.ndarray]:
        """The paper's reward terms beside the verifier's outcome (section 3.1: "rule-based outcome reward, length
        penalty, and language consistency reward" for agent tasks), per episode, each only when configured:
        length_penalty = -agent.length_penalty per model token beyond agent.length_target (>= 0) in the episode;
        language_reward = agent.language_weight x the environment's language_consistency(instance, model_text)
        (0 for an environment without one; a value that is no number in [0, 1], or none within the environment's
        score_timeout, is data: 0, noted in reward_error; an exception is the environment's bug: a RuntimeError naming
        it and the episode). On several processes each episode's hook is called once, by one process (process_map)."""
        a, out = self.a, {}
        target = int(a.get("length_target", -1))
        if target >= 0:
            out["length_penalty"] = np.array([-float(a.length_penalty) * max(0, model_tokens(t) - target)
                                              for t in trajs], np.float32)
        weight = float(a.get("language_weight", 0.0))
        if weight:
            def judge(i):  # (value, reward_error or None) of episode i; raises with its environment and seed named
                t, (spec, seed) = trajs[i], rows[i]
                env = self._envs[spec]
                try:
                    return env._language(t.instance, model_text(t))  # (the episode's own instance)
                except Exception as e:
                    raise RuntimeError(f"{type(env).__name__}.language_consistency() raised for the episode of row {i} "
                                       f"({spec}, seed {seed}): {type(e).__name__}: {e}") from e

            # once per episode: each process judges its block of the episodes and receives the others' values
            judged = shd.process_map("the agent's language reward (language_consistency)", judge, range(len(trajs)))
            for t, (_, error) in zip(trajs, judged):
                if error is not None:
                    t.info["reward_error"] = error
            values = [weight * v for v, _ in judged]
            out["language_reward"] = np.array(values, np.float32)
        return out

    def update(self, batch) -> dict:
        with shd.use_mesh(self.mesh):
            if self.ref is None:
                self.ref = jax.tree.map(jnp.copy, self.state[0])
            batch = jax.device_put(batch, self.batch_sharding)
            batch["logp_ref"] = self._reference(self.ref, batch)
            diag = self._diagnostics(self.state[0], batch)
            self.state, out = minibatch_updates(self._train, self.state, batch, epochs=self.a.epochs,
                                                minibatches=self.a.minibatches, sharding=self.batch_sharding,
                                                rng=np.random.default_rng([self.config.seed, self.step, 1]))
        out.update({k: float(v) for k, v in jax.device_get(diag).items()})
        return out

    def evaluate(self) -> dict:
        """Greedy success and mean verifier reward (partial credit: trip's fraction of checks) per environment on
        fixed held-out seeds (10^7 + i), and what the episodes cost: the
        tokens their contexts took in the decode cache (every segment: a re-rendered history is prefilled again)
        and the model's own tokens; with `config.agent.eval_samples`, also the sampled policy's (evaluate_sampled);
        with `config.agent.eval_capacities`, the greedy episodes again at each of those decode-cache sizes and context
        budgets (keys tagged `_cap{N}`)."""
        out = {}
        caps = [(f"_cap{c}", c) for _, c in self.capacities()[1:]]
        for name in self.envs:
            rows = [(name, 10**7 + i) for i in range(self.a.eval_episodes)]
            for tag, cap in [("", None)] + caps:
                trajs, _ = self.run(rows, self.greedy, key_seed=0, capacity=cap)
                out[f"eval_success{tag}/{name}"] = float(np.mean([t.success for t in trajs]))
                out[f"eval_reward{tag}/{name}"] = float(np.mean([t.reward for t in trajs]))
                out[f"eval_context_full{tag}/{name}"] = float(np.mean([_context_full(t) for t in trajs]))
                out[f"eval_context_tokens{tag}/{name}"] = float(np.mean([sum(len(g.ids) for g in t.segments)
                                                                         for t in trajs]))
                out[f"eval_model_tokens{tag}/{name}"] = float(np.mean([sum(map(sum, (g.loss_mask for g in t.segments)))
                                                                       for t in trajs]))
                out[f"eval_segments{tag}/{name}"] = float(np.mean([len(t.segments) for t in trajs]))
            if self.a.eval_samples:
                out.update(self.evaluate_sampled(name, rows))
        for k in ("success", "reward") + (("sampled_success", "sampled_reward") if self.a.eval_samples else ()) + tuple(
                f"success{tag}" for tag, _ in caps):
            out[f"eval_{k}"] = float(np.mean([out[f"eval_{k}/{n}"] for n in self.envs]))
        return out

    def evaluate_sampled(self, name: str, rows) -> dict:
        """`eval_samples` episodes of each held-out task with the training sampler, in batches of one
        GRPO step's rows, with the same random keys at every evaluation (the comparison across steps is paired)."""
        rows = [r for r in rows for _ in range(self.a.eval_samples)]
        chunk = self.a.tasks_per_step * self.a.group_size
        trajs = []
        for c in range(0, len(rows), chunk):
            trajs += self.run(rows[c:c + chunk], self.sampling, key_seed=10**6 + c)[0]
        return {f"eval_sampled_success/{name}": float(np.mean([t.success for t in trajs])),
                f"eval_sampled_reward/{name}": float(np.mean([t.reward for t in trajs])),
                f"eval_sampled_format_errors/{name}": float(np.mean([_format_error(t) for t in trajs]))}

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self, mngr, step: int, force: bool = False) -> bool:
        arrays = {"params": self.state[0], "opt": self.state[1]}
        if self.ref is not None:
            arrays["ref"] = self.ref
        return checkpointing.save(mngr, step, arrays=arrays,
                                  json={"meta": {"step": step, "stage": "agent", "model_config": self.cfg.to_hf()}},
                                  force=force)

    def restore_checkpoint(self, mngr, step: int) -> None:
        self.ref = jax.tree.map(jnp.copy, self.state[0])
        r = checkpointing.restore(mngr, step, arrays={"params": (self.state[0], self.shardings[0]),
                                                      "opt": (self.state[1], self.shardings[1]),
                                                      "ref": (self.ref, self.shardings[0])}, json=("meta",))
        self.step = int(r["meta"]["step"])

    # ------------------------------------------------------------------- loop
    def run_step(self) -> dict:
        t0 = time.perf_counter()
        metrics = {}
        if self.step == 0:
            self.prepare()  # (run_loop has called it already)
            metrics.update(self._prepared or {})
        batch, stats = self.rollout(self.step)
        if stats.get("context_full") and not self._warned_full:
            self._warned_full = True
            logging.warning("step %d: %.0f%% of the rollouts ended \"context full\" (reward 0 whatever the model did):"
                            " config.agent.capacity=%d is too small for these tasks' turns (metric context_full)",
                            self.step + 1, 100 * stats["context_full"], self.a.capacity)
        if stats.get("reward_errors") and not self._warned_reward:
            self._warned_reward = True
            bad = next((t.info["reward_error"] for t in self._last_trajs if _reward_error(t)), "")
            logging.warning("step %d: %.0f%% of the rollouts got no usable reward from their verifier (metric "
                            "reward_errors), e.g. %s", self.step + 1, 100 * stats["reward_errors"], bad)
        t1 = time.perf_counter()
        metrics.update(self.update(batch))
        self.step += 1
        warn_nucleus_capped(self, "agent", metrics)
        metrics.update(stats, rollout_s=t1 - t0, train_s=time.perf_counter() - t1)
        if (self.a.eval_every and self.step % self.a.eval_every == 0) or self.step == self.config.steps:
            metrics.update(self.evaluate())
        metrics["step_s"] = time.perf_counter() - t0  # the whole step: step 0's recall stage and cold start included
        return metrics

    def fit(self) -> list[dict]:
        history = run_loop(self, workdir=self.workdir, config=self.config, keys=CONSOLE_KEYS, desc="agent",
                           show=lambda metrics: "eval_success" in metrics)
        if self.step and jax.process_index() == 0:  # an RL checkpoint holds step 0's result now
            shutil.rmtree(os.path.join(self.workdir, SFT_CHECKPOINTS_DIR), ignore_errors=True)
        return history


def run_agent(config, workdir: str):
    learner = AgentLearner(config, workdir)
    return finish_agent(learner, learner.fit())


def finish_agent(learner, history: list[dict]) -> list[dict]:
    print(f"done: {learner.step} agentic GRPO steps in {learner.workdir}", flush=True)
    return history
