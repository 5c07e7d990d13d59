"""GRPO post-training loop with DeepSeek-V3.2's four stabilizers (train/grpo_loss.py has the objective).

One step: sample G completions per prompt with the jitted sampler (current params = pi_old; it records
processed log-probs, kept sets and expert ids), score them with the task's reward callables on the host,
A = R - group mean, then `epochs` x `minibatches` updates whose forward replays the recorded routing (keep
routing) and restricts pi_theta to the recorded kept set (keep sampling mask). pi_ref is a frozen copy of the
initial parameters, evaluated with its own routing on the same kept set (so KL compares distributions over
the same support). Checkpoints hold params, optimizer state, the reference and the step (prompts and sampling
keys are functions of (seed, step)), so a resumed run continues exactly.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from dsv32_jax.model import sharding as shd
from dsv32_jax.posttrain.sampler import SamplingConfig, generate, sequence_layout
from dsv32_jax.train import checkpointing, rl_tasks, steps
from dsv32_jax.train.config import check_config, check_init_from
from dsv32_jax.train.grpo_loss import check_groups, group_advantages
from dsv32_jax.train.loop import run_loop
from dsv32_jax.train.optimizer import make_tx, trainable_filter
from dsv32_jax.train.trainer import build_policy, resumed_model_config

CONSOLE_KEYS = ("reward_mean", "accuracy", "eval_accuracy", "response_length", "kl", "clip_fraction",
                "opsm_masked_fraction", "logprob_mismatch_max", "routing_agreement", "kept_mass", "entropy",
                "grad_norm")


def minibatch_updates(train, state, batch: dict, *, epochs: int, minibatches: int, sharding, rng):
    """`epochs` passes over `batch` (rows shuffled by `rng`), `minibatches` updates each: state <- train(state,
    minibatch). Returns the state and the metrics averaged over the updates."""
    n = batch["adv"].shape[0]
    mb = n // minibatches
    if minibatches < 1 or mb * minibatches != n:  # (the learners check their configs: check_minibatches)
        raise ValueError(f"{n} rows do not split into {minibatches} equal minibatches")
    history = []
    for _ in range(epochs):
        order = rng.permutation(n)
        for j in range(minibatches):
            idx = jnp.asarray(order[j * mb:(j + 1) * mb])
            state, metrics = train(state, jax.device_put(jax.tree.map(lambda x: x[idx], batch), sharding))
            history.append(metrics)
    return state, {k: float(np.mean([jax.device_get(h[k]) for h in history])) for k in history[0]}


def check_group_size(group_size: int, field: str) -> None:
    """GRPO's advantage is a reward minus its group's mean: a group of one has advantage 0 always (no policy
    gradient, only the KL term would train)."""
    if group_size < 2:
        raise ValueError(f"{field} must be >= 2 (the advantage is a reward minus its group's mean), got {group_size}")


def sampling_config(section: str, **kwargs) -> SamplingConfig:
    """``SamplingConfig(**kwargs)`` whose errors name the config field the value came from (``config.grpo.top_k``,
    not ``SamplingConfig.top_k``): the fields the stages' sections share with SamplingConfig by name."""
    try:
        return SamplingConfig(**kwargs)
    except ValueError as e:
        msg = str(e)
        for field in ("top_k", "top_p", "temperature", "max_candidates", "max_new_tokens"):
            msg = msg.replace(f"SamplingConfig.{field}", f"config.{section}.{field}")
        raise ValueError(msg) from None


def nucleus_capped(section: str, sampling: SamplingConfig, kept_mass: float) -> str | None:
    """A warning's text when the step's kept sets held clearly less probability mass than top_p asks for (metric
    kept_mass below top_p - 0.05) because the nucleus is taken among the `max_candidates` most likely tokens only (a
    bounded candidate set, never a full-vocabulary sort): on a flat distribution, early in training, top_p then acts
    as top_k = max_candidates. None when top_p is off or top_k is the tighter cut (its kept set may hold less by
    design)."""
    if sampling.greedy or sampling.top_p >= 1.0 or 0 < sampling.top_k < sampling.max_candidates:
        return None
    if not kept_mass < sampling.top_p - 0.05:
        return None
    return (f"the sampled tokens' kept sets held {kept_mass:.2f} of the probability mass (metric kept_mass), not "
            f"config.{section}.top_p={sampling.top_p:g}: the nucleus is cut inside the config.{section}.max_candidates="
            f"{sampling.max_candidates} most likely tokens, which held less; raise max_candidates to sample from the "
            "nucleus top_p asks for")


def warn_nucleus_capped(learner, section: str, metrics: dict) -> None:
    """Logs nucleus_capped's warning for the step just taken (`learner.step`), once per learner."""
    capped = "kept_mass" in metrics and nucleus_capped(section, learner.sampling, metrics["kept_mass"])
    if capped and not learner._warned_nucleus:
        learner._warned_nucleus = True
        logging.warning("step %d: %s", learner.step, capped)


def check_minibatches(what: str, rows: int, minibatches: int, mesh, mesh_spec, field: str) -> None:
    """A step's `rows` must split into `minibatches` equal minibatches (no row sampled and scored but never trained
    on) whose size the mesh's batch axes divide."""
    split = steps.batch_devices(mesh)
    if minibatches < 1 or rows % minibatches or (rows // minibatches) % split:
        raise ValueError(f"{what} x group_size = {rows} rows must split into {field}={minibatches} equal minibatches "
                         f"whose size the mesh's batch axes ({split} ways, config.mesh={mesh_spec!r}) divide")


class GRPOLearner:
    _warned_nucleus = False  # the nucleus_capped warning was logged

    def __init__(self, config, workdir: str):
        check_config(config)
        self.config, self.workdir = config, workdir
        g = config.grpo
        self.g = g
        self.tasks = [t.strip() for t in g.tasks.split(",") if t.strip()]
        self.cfg, self.resume = resumed_model_config(config, workdir, "grpo")
        if self.cfg.vocab_size < rl_tasks.VOCAB_SIZE:
            raise ValueError(f"config.model: vocab_size {self.cfg.vocab_size} < the task vocabulary "
                             f"({rl_tasks.VOCAB_SIZE})")
        self.sampling = sampling_config("grpo", max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                        top_k=g.top_k, top_p=g.top_p, max_candidates=g.max_candidates,
                                        eos_id=rl_tasks.EOS, pad_id=rl_tasks.PAD)
        self.greedy = SamplingConfig(max_new_tokens=g.max_new_tokens, greedy=True, eos_id=rl_tasks.EOS)
        self.rewards = {k: rl_tasks.make_reward(k, g.length_target if g.length_target >= 0 else None,
                                                g.language_weight, g.grm_weight) for k in self.tasks}
        unknown = sorted(set(g.kl_weights) - set(rl_tasks.MARKERS))
        if unknown:  # (a misspelled task silently took config.grpo.kl_weight)
            raise ValueError(f"config.grpo.kl_weights.{unknown[0]}: not a task (one of "
                             f"{', '.join(sorted(rl_tasks.MARKERS))})")
        self.beta = {k: float(g.kl_weights.get(k, g.kl_weight)) for k in self.tasks}
        self.letters = float(g.get("letters", 0.0))
        if not 0.0 <= self.letters <= 1.0:
            raise ValueError(f"config.grpo.letters must be in [0, 1], got {self.letters}")
        self.prompt_width = max(len(rl_tasks.make_prompt(k, np.random.default_rng(0))[0]) for k in self.tasks)
        ctx = int(self.cfg.max_position_embeddings)
        if self.prompt_width + g.max_new_tokens > ctx:  # (generate refused it at the first rollout, a traceback)
            raise ValueError(f"config.grpo.max_new_tokens={g.max_new_tokens} plus the tasks' prompt width "
                             f"({self.prompt_width} tokens) exceeds the model's context of {ctx} positions "
                             "(max_position_embeddings of the model config)")
        if self.resume is None:
            check_init_from(config)
        self.mesh = shd.make_mesh(config.mesh or "fsdp:-1")
        check_group_size(g.group_size, "config.grpo.group_size")
        check_minibatches("config.grpo: prompts_per_step", g.prompts_per_step * g.group_size, g.minibatches,
                          self.mesh, config.mesh, "config.grpo.minibatches")
        self.batch_sharding = steps.leading_batch_sharding(self.mesh)
        dtype, pdtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        model = build_policy(config, self.cfg, dtype, pdtype, resuming=self.resume is not None, mesh=self.mesh)
        self.cfg = model.config  # what the checkpoints record (init_from's: e.g. without an MTP layer)
        # the policy is the main head: the MTP layers get no gradient (nor the indexer at weight 0)
        self.trainable = trainable_filter("grpo", mtp=False, indexer=bool(float(g.get("indexer_weight", 1.0))))
        optimizer = nnx.Optimizer(model, make_tx(config.optimizer, pdtype), wrt=self.trainable)
        self.graphdef, state = nnx.split((model, optimizer))
        self.model_graphdef = nnx.split(model)[0]
        self.shardings = shd.state_shardings(state, self.mesh)
        self.state = jax.device_put(state, self.shardings)
        # pi_ref: frozen copy of the initial policy
        self.ref = jax.device_put(jax.tree.map(jnp.copy, self.state[0]), self.shardings[0])
        self.step = 0
        self.steps = steps.compile_grpo_steps(
            graphdef=self.graphdef, model_graphdef=self.model_graphdef, state_shardings=self.shardings,
            batch_sharding=self.batch_sharding, temperature=self.sampling.temperature, eps=g.eps, delta=g.delta,
            indexer_weight=float(g.get("indexer_weight", 1.0)))

    # ------------------------------------------------------------------ batches
    def _prompt_batch(self, prompts_and_answers):
        p = self.prompt_width
        rows = [(pr, ans, lang, kind) for kind, (pr, ans, lang) in prompts_and_answers]
        prompts = np.zeros((len(rows), p), np.int32)
        for i, (pr, *_rest) in enumerate(rows):
            prompts[i, p - len(pr):] = pr
        lengths = np.array([len(r[0]) for r in rows], np.int32)
        return rows, prompts, lengths

    def sample_prompts(self, step: int):
        """prompts_per_step prompts (deterministic in (seed, step)), each repeated group_size times."""
        rng = np.random.default_rng([self.config.seed, step])
        picks = []
        for _ in range(self.g.prompts_per_step):
            kind = self.tasks[int(rng.integers(len(self.tasks)))]
            letters = bool(self.letters and kind in ("rev", "copy") and rng.random() < self.letters)
            picks.append((kind, rl_tasks.make_prompt(kind, rng, letters=letters)))
        group_ids = np.repeat(np.arange(len(picks)), self.g.group_size)
        return [picks[i] for i in group_ids], group_ids

    def _model(self):
        return nnx.merge(self.graphdef, self.state)[0]

    def rollout(self, step: int):
        items, group_ids = self.sample_prompts(step)
        rows, prompts, lengths = self._prompt_batch(items)
        check_groups(group_ids, prompts, self.g.group_size)
        key = jax.random.fold_in(jax.random.key(self.config.seed), step)
        with shd.use_mesh(self.mesh):
            r = generate(self._model(), prompts, lengths, key, self.sampling)
        gen = shd.host_value(r.tokens)  # (every row, on every process: each decodes the whole batch)
        samples = [rl_tasks.to_sample(kind, pr, ans, lang, gen[i]) for i, (pr, ans, lang, kind) in enumerate(rows)]
        # each process scores its block of the samples (a generative reward model's judge is called once per
        # sample, not once per process) and every process gets every reward
        rewards = np.array(shd.process_map("the GRPO rewards", lambda s: self.rewards[s.kind](s), samples),
                           np.float32)
        adv = group_advantages(rewards, group_ids)
        seg, pos = sequence_layout(lengths, self.prompt_width, r)
        batch = {"prompts": jnp.asarray(prompts), "tokens": jnp.concatenate([jnp.asarray(prompts), r.tokens], 1),
                 "positions": pos, "segments": seg, "routing": r.routing, "gen": r.tokens, "kept_ids": r.kept_ids,
                 "kept_mask": r.kept_mask, "logp_old": r.logprobs, "mask": r.mask.astype(jnp.float32),
                 "adv": jnp.asarray(adv), "beta": jnp.asarray([self.beta[s.kind] for s in samples], jnp.float32)}
        stats = {"reward_mean": rewards.mean(), "reward_std": rewards.std(),
                 "accuracy": np.mean([rl_tasks.is_correct(s) for s in samples]),
                 "response_length": np.mean([len(s.response) for s in samples]),
                 "finished_fraction": np.mean([s.finished for s in samples]),
                 "zero_variance_groups": np.mean([np.ptp(rewards[group_ids == gi]) == 0 for gi in np.unique(group_ids)])}
        return batch, stats

    # ------------------------------------------------------------------ update
    def update(self, batch) -> dict:
        with shd.use_mesh(self.mesh):
            batch = jax.device_put(batch, self.batch_sharding)
            batch["logp_ref"] = self.steps.reference(self.ref, batch)
            diag = self.steps.diagnostics(self.state[0], batch)
            self.state, out = minibatch_updates(self.steps.train, self.state, batch, epochs=self.g.epochs,
                                                minibatches=self.g.minibatches, sharding=self.batch_sharding,
                                                rng=np.random.default_rng([self.config.seed, self.step, 1]))
        out.update({k: float(v) for k, v in jax.device_get(diag).items()})
        return out

    def evaluate(self) -> dict:
        out = {}
        for kind in self.tasks:
            items = [(kind, x) for x in rl_tasks.eval_prompts(kind)]
            rows, prompts, lengths = self._prompt_batch(items)
            with shd.use_mesh(self.mesh):
                r = generate(self._model(), prompts, lengths, jax.random.key(0), self.greedy)
            gen = shd.host_value(r.tokens)
            samples = [rl_tasks.to_sample(kind, pr, ans, lang, gen[i]) for i, (pr, ans, lang, kind) in enumerate(rows)]
            out[f"eval_accuracy/{kind}"] = float(np.mean([rl_tasks.is_correct(s) for s in samples]))
            out[f"eval_length/{kind}"] = float(np.mean([len(s.response) for s in samples]))
        out["eval_accuracy"] = float(np.mean([out[f"eval_accuracy/{k}"] for k in self.tasks]))
        out["eval_length"] = float(np.mean([out[f"eval_length/{k}"] for k in self.tasks]))
        return out

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self, mngr, step: int, force: bool = False) -> bool:
        return checkpointing.save(mngr, step, arrays={"params": self.state[0], "opt": self.state[1], "ref": self.ref},
                                  json={"meta": {"step": step, "stage": "grpo", "model_config": self.cfg.to_hf()}},
                                  force=force)

    def restore_checkpoint(self, mngr, step: int) -> None:
        r = checkpointing.restore(mngr, step, arrays={"params": (self.state[0], self.shardings[0]),
                                                      "opt": (self.state[1], self.shardings[1]),
                                                      "ref": (self.ref, self.shardings[0])}, json=("meta",))
        self.step = int(r["meta"]["step"])

    # ------------------------------------------------------------------- loop
    def run_step(self) -> dict:
        """Rollout, update, and (every grpo.eval_every steps and at the end) greedy evaluation."""
        t0 = time.perf_counter()
        batch, stats = self.rollout(self.step)
        t1 = time.perf_counter()
        metrics = self.update(batch)
        self.step += 1
        warn_nucleus_capped(self, "grpo", metrics)
        metrics.update(stats, rollout_s=t1 - t0, train_s=time.perf_counter() - t1)
        if (self.g.eval_every and self.step % self.g.eval_every == 0) or self.step == self.config.steps:
            metrics.update(self.evaluate())
        return metrics

    def fit(self) -> list[dict]:
        """Runs until config.steps (resuming from the workdir's latest checkpoint); returns the logged metrics."""
        return run_loop(self, workdir=self.workdir, config=self.config, keys=CONSOLE_KEYS, desc="grpo",
                        show=lambda metrics: "eval_accuracy" in metrics)


def run_grpo(config, workdir: str):
    learner = GRPOLearner(config, workdir)
    return finish_grpo(learner, workdir, learner.fit())


def finish_grpo(learner, workdir: str, history: list[dict]) -> list[dict]:
    """The run's curves (process 0) and its closing line, after `fit`."""
    if jax.process_index() == 0 and history:
        from dsv32_jax.train.plot import find_runs, plot
        try:
            plot(find_runs([workdir]), os.path.join(workdir, "curves.png"))
            where = f"curves in {os.path.join(workdir, 'curves.png')}"
        except ImportError:  # optional extra [plot]
            where = "no curves (matplotlib missing); metrics in metrics.jsonl"
        print(f"done: {learner.step} GRPO steps in {workdir}; {where}", flush=True)
    return history
