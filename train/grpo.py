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
import orbax.checkpoint as ocp
from flax import nnx

import dsv32_jax
from dsv32_jax import RunOptions, Transformer
from dsv32_jax import sharding as shd
from dsv32_jax.sampler import SamplingConfig, generate, sequence_layout
from dsv32_jax.train import rl_tasks
from dsv32_jax.train.grpo_loss import check_groups, group_advantages, grpo_loss, processed_logprobs
from dsv32_jax.train.metrics import MetricsWriter
from dsv32_jax.train.optimizer import make_tx
from dsv32_jax.train.trainer import model_config


def _forward_logprobs(model, batch, temperature, replay: bool):
    p = batch["prompts"].shape[1]
    logits, aux = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segments"],
                        routing=batch["routing"] if replay else None, return_aux=True)
    logp, entropy, mass = processed_logprobs(logits[:, p - 1:-1], batch["gen"], batch["kept_ids"],
                                             batch["kept_mask"], temperature)
    return logp, entropy, mass, aux


class GRPOLearner:
    def __init__(self, config, workdir: str):
        self.config, self.workdir = config, workdir
        g = config.grpo
        self.g = g
        self.tasks = [t.strip() for t in g.tasks.split(",") if t.strip()]
        self.cfg = model_config(config)
        if self.cfg.vocab_size < rl_tasks.VOCAB_SIZE:
            raise ValueError(f"config.model: vocab_size {self.cfg.vocab_size} < the task vocabulary "
                             f"({rl_tasks.VOCAB_SIZE})")
        self.sampling = SamplingConfig(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
                                       top_p=g.top_p, max_candidates=g.max_candidates, eos_id=rl_tasks.EOS,
                                       pad_id=rl_tasks.PAD)
        self.greedy = SamplingConfig(max_new_tokens=g.max_new_tokens, greedy=True, eos_id=rl_tasks.EOS)
        self.rewards = {k: rl_tasks.make_reward(k, g.length_target if g.length_target >= 0 else None,
                                                g.language_weight, g.grm_weight) for k in self.tasks}
        self.beta = {k: float(g.kl_weights.get(k, g.kl_weight)) for k in self.tasks}
        self.prompt_width = max(len(rl_tasks.make_prompt(k, np.random.default_rng(0))[0]) for k in self.tasks)
        self.mesh = shd.make_mesh(config.mesh or "fsdp:-1")
        dtype, pdtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        options = RunOptions(attention=config.attention, attn_chunk=config.attn_chunk, index_chunk=config.index_chunk)
        if config.init_from:
            model = dsv32_jax.from_pretrained(config.init_from, dtype=dtype, param_dtype=pdtype, options=options)
        else:
            model = Transformer(self.cfg, rngs=nnx.Rngs(config.seed), dtype=dtype, param_dtype=pdtype, options=options)
        optimizer = nnx.Optimizer(model, make_tx(config.optimizer), wrt=nnx.Param)
        self.graphdef, state = nnx.split((model, optimizer))
        self.model_graphdef = nnx.split(model)[0]
        self.shardings = shd.state_shardings(state, self.mesh)
        self.state = jax.device_put(state, self.shardings)
        self.ref = jax.tree.map(jnp.copy, self.state[0])  # pi_ref: frozen copy of the initial policy
        self.step = 0
        self._train_step = jax.jit(self._make_train_step(), donate_argnums=0)
        self._reference = jax.jit(self._make_reference())
        self._diagnose = jax.jit(self._make_diagnostics())

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
            picks.append((kind, rl_tasks.make_prompt(kind, rng)))
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
        gen = np.asarray(r.tokens)
        samples = [rl_tasks.to_sample(kind, pr, ans, lang, gen[i]) for i, (pr, ans, lang, kind) in enumerate(rows)]
        rewards = np.array([self.rewards[s.kind](s) for s in samples], np.float32)
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

    # -------------------------------------------------------------- compiled
    def _make_reference(self):
        graphdef, temperature = self.model_graphdef, self.sampling.temperature

        def reference(ref_state, batch):
            return _forward_logprobs(nnx.merge(graphdef, ref_state), batch, temperature, replay=False)[0]
        return reference

    def _make_diagnostics(self):
        """At pi_old (before any update): sampler-vs-trainer log-prob mismatch and routing agreement."""
        graphdef, temperature = self.model_graphdef, self.sampling.temperature

        def diagnostics(model_state, batch):
            model = nnx.merge(graphdef, model_state)
            logp, _, _, _ = _forward_logprobs(model, batch, temperature, replay=True)
            _, _, _, native = _forward_logprobs(model, batch, temperature, replay=False)
            m = batch["mask"]
            diff = jnp.abs(logp - batch["logp_old"]) * m
            valid = batch["segments"] > 0
            agree = [jnp.sum(jnp.all(jnp.sort(native["routing"][k], -1) == jnp.sort(ids, -1), -1) * valid)
                     / jnp.maximum(jnp.sum(valid), 1) for k, ids in batch["routing"].items()]
            return {"logprob_mismatch_mean": jnp.sum(diff) / jnp.maximum(jnp.sum(m), 1.0),
                    "logprob_mismatch_max": jnp.max(diff),
                    "routing_agreement": jnp.mean(jnp.stack(agree)) if agree else jnp.ones(())}
        return diagnostics

    def _make_train_step(self):
        graphdef, g, temperature = self.graphdef, self.g, self.sampling.temperature

        def step(state, batch):
            model, optimizer = nnx.merge(graphdef, state)

            def loss_fn(model):
                logp, entropy, mass, _ = _forward_logprobs(model, batch, temperature, replay=True)
                loss, metrics = grpo_loss(logp, batch["logp_old"], batch["logp_ref"], batch["adv"], batch["mask"],
                                          batch["beta"], eps=g.eps, delta=g.delta)
                m = batch["mask"]
                metrics.update(loss=loss, entropy=jnp.sum(entropy * m) / jnp.maximum(jnp.sum(m), 1.0),
                               kept_mass=jnp.sum(mass * m) / jnp.maximum(jnp.sum(m), 1.0))
                return loss, metrics

            grads, metrics = nnx.grad(loss_fn, has_aux=True)(model)
            optimizer.update(model, grads)
            metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(grads)))
            return nnx.state((model, optimizer)), metrics
        return step

    # ------------------------------------------------------------------ update
    def update(self, batch) -> dict:
        with shd.use_mesh(self.mesh):
            batch["logp_ref"] = self._reference(self.ref, batch)
            diag = self._diagnose(self.state[0], batch)
            n = batch["adv"].shape[0]
            mb = n // self.g.minibatches
            rng = np.random.default_rng([self.config.seed, self.step, 1])
            history = []
            for _ in range(self.g.epochs):
                order = rng.permutation(n)
                for j in range(self.g.minibatches):
                    idx = jnp.asarray(order[j * mb:(j + 1) * mb])
                    sub = jax.tree.map(lambda x: x[idx], batch)
                    self.state, metrics = self._train_step(self.state, sub)
                    history.append(metrics)
        out = {k: float(np.mean([jax.device_get(h[k]) for h in history])) for k in history[0]}
        out.update({k: float(v) for k, v in jax.device_get(diag).items()})
        return out

    def evaluate(self) -> dict:
        out = {}
        for kind in self.tasks:
            items = [(kind, x) for x in rl_tasks.eval_prompts(kind)]
            rows, prompts, lengths = self._prompt_batch(items)
            with shd.use_mesh(self.mesh):
                r = generate(self._model(), prompts, lengths, jax.random.key(0), self.greedy)
            gen = np.asarray(r.tokens)
            samples = [rl_tasks.to_sample(kind, pr, ans, lang, gen[i]) for i, (pr, ans, lang, kind) in enumerate(rows)]
            out[f"eval_accuracy/{kind}"] = float(np.mean([rl_tasks.is_correct(s) for s in samples]))
            out[f"eval_length/{kind}"] = float(np.mean([len(s.response) for s in samples]))
        out["eval_accuracy"] = float(np.mean([out[f"eval_accuracy/{k}"] for k in self.tasks]))
        out["eval_length"] = float(np.mean([out[f"eval_length/{k}"] for k in self.tasks]))
        return out

    # -------------------------------------------------------------- checkpoints
    def _manager(self):
        c = self.config.checkpoint
        return ocp.CheckpointManager(os.path.abspath(os.path.join(self.workdir, "checkpoints")),
                                     options=ocp.CheckpointManagerOptions(save_interval_steps=c.every,
                                                                          max_to_keep=c.keep,
                                                                          enable_async_checkpointing=c.use_async))

    def _save(self, mngr, force=False):
        mngr.save(self.step, force=force, args=ocp.args.Composite(
            params=ocp.args.StandardSave(nnx.to_pure_dict(self.state[0])),
            opt=ocp.args.StandardSave(nnx.to_pure_dict(self.state[1])),
            ref=ocp.args.StandardSave(nnx.to_pure_dict(self.ref)),
            meta=ocp.args.JsonSave({"step": self.step, "model_config": self.cfg.to_hf()})))

    def _restore(self, mngr, step):
        def target(tree, sh):
            return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                nnx.to_pure_dict(tree), nnx.to_pure_dict(sh))

        r = mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target(self.state[0], self.shardings[0])),
            opt=ocp.args.StandardRestore(target(self.state[1], self.shardings[1])),
            ref=ocp.args.StandardRestore(target(self.ref, self.shardings[0])), meta=ocp.args.JsonRestore()))
        nnx.replace_by_pure_dict(self.state[0], r["params"])
        nnx.replace_by_pure_dict(self.state[1], r["opt"])
        nnx.replace_by_pure_dict(self.ref, r["ref"])
        self.step = int(r["meta"]["step"])

    # ------------------------------------------------------------------- loop
    def fit(self) -> list[dict]:
        config = self.config
        writer = MetricsWriter(self.workdir, config.steps, enabled=jax.process_index() == 0)
        history = []
        keys = ("reward_mean", "accuracy", "eval_accuracy", "response_length", "kl", "clip_fraction",
                "opsm_masked_fraction", "logprob_mismatch_max", "routing_agreement", "kept_mass", "entropy")
        with self._manager() as mngr:
            if mngr.latest_step() is not None:
                self._restore(mngr, mngr.latest_step())
            while self.step < config.steps:
                t0 = time.perf_counter()
                batch, stats = self.rollout(self.step)
                t1 = time.perf_counter()
                metrics = self.update(batch)
                self.step += 1
                metrics.update(stats, rollout_s=t1 - t0, train_s=time.perf_counter() - t1)
                if self.step % self.g.eval_every == 0 or self.step == config.steps:
                    metrics.update(self.evaluate())
                writer.write(self.step, metrics)
                history.append({"step": self.step, **metrics})
                if self.step % config.log_every == 0 or self.step == 1 or "eval_accuracy" in metrics:
                    writer.console(self.step, metrics, keys=keys)
                self._save(mngr, force=self.step == config.steps)
            mngr.wait_until_finished()
        writer.close()
        return history


def run_grpo(config, workdir: str):
    learner = GRPOLearner(config, workdir)
    history = learner.fit()
    if jax.process_index() == 0 and history:
        from dsv32_jax.train.plot import find_runs, plot
        try:
            plot(find_runs([workdir]), os.path.join(workdir, "curves.png"))
            where = f"curves in {os.path.join(workdir, 'curves.png')}"
        except ImportError:  # optional extra [plot]
            where = "no curves (matplotlib missing); metrics in metrics.jsonl"
        print(f"done: {learner.step} GRPO steps in {workdir}; {where}", flush=True)
    return history
