"""Sharded training loop for the dense warm-up (eq. 3) and sparse continued pre-training (eq. 4) stages.

The train step is a pure function of (state, batch) jitted with explicit shardings; state = nnx.State of
(model, optimizer). Only the stage's trainable parameters get gradients and optimizer state. Checkpoints
(orbax, async) hold params, optimizer state (with the step), the data iterator position and the RNG.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding

import dsv32_jax
from dsv32_jax import orbax_io
from dsv32_jax import RunOptions, Transformer, load_preset
from dsv32_jax import sharding as shd
from dsv32_jax.train import losses
from dsv32_jax.train.metrics import MetricsWriter
from dsv32_jax.train.optimizer import learning_rate_schedule, make_tx, trainable_filter

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "TPU v5p": 459.0, "TPU v5e": 197.0,
               "TPU v6": 918.0}
BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


def run_options(config) -> RunOptions:
    stage = config.stage
    common = dict(attn_chunk=config.attn_chunk, index_chunk=config.index_chunk)
    if stage == "dense":
        return RunOptions(dsa=False, attention="dense", **common)
    if stage == "warmup":
        return RunOptions(dsa=False, attention="dense", indexer_loss="dense", **common)
    return RunOptions(attention=config.attention, indexer_loss="sparse", **common)


def model_config(config) -> dsv32_jax.ModelConfig:
    """The architecture to build: the one recorded in `config.init_from` (a training workdir's checkpoint meta, or an
    HF / converted checkpoint's config.json), else the preset `config.model`; `config.model_overrides` on top."""
    init = config.init_from
    if init and orbax_io.is_training_workdir(init):
        cfg = orbax_io.training_checkpoint(init).cfg
    elif init and os.path.exists(os.path.join(init, "config.json")):
        cfg = dsv32_jax.ModelConfig.from_hf(init)
    else:
        cfg = load_preset(config.model)
    return cfg.replace(**dict(config.model_overrides)) if config.model_overrides else cfg


def flops_per_token(cfg: dsv32_jax.ModelConfig, seq_len: int, sparse: bool) -> float:
    """Training FLOPs per token (6 x active matmul params + attention), the usual MFU convention."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    attn = d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim + d * cfg.kv_latent_dim
    attn += cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d
    indexer = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * (cfg.index_head_dim + cfg.index_n_heads)
    dense_ffn = 3 * d * cfg.intermediate_size
    moe_ffn = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + d * cfg.n_routed_experts
    per_layer = [attn + indexer + (moe_ffn if cfg.is_moe_layer(i) else dense_ffn) for i in range(cfg.num_hidden_layers)]
    matmul = sum(per_layer) + d * cfg.vocab_size
    keys = min(cfg.index_topk, seq_len) if sparse else seq_len / 2
    attention = cfg.num_hidden_layers * 2 * h * keys * (cfg.kv_latent_dim + cfg.kv_lora_rank)
    index_scores = cfg.num_hidden_layers * 2 * cfg.index_n_heads * cfg.index_head_dim * seq_len / 2
    return 6 * matmul + 3 * (attention + index_scores)


@dataclasses.dataclass
class TrainState:
    graphdef: object
    state: nnx.State  # nnx state of (model, optimizer)
    shardings: nnx.State


class Trainer:
    def __init__(self, config, workdir: str, *, allocate: bool = True):
        """allocate=False builds only the abstract state (shapes, no mesh, no compilation): any config, any size."""
        self.config = config
        self.workdir = workdir
        self.stage = config.stage
        self.filter = trainable_filter(self.stage)
        self.cfg = model_config(config)
        self.dtype = jnp.dtype(config.dtype)
        self.param_dtype = jnp.dtype(config.param_dtype)
        self.options = run_options(config)
        self.tx = make_tx(config.optimizer)
        self.rng = jax.random.key_data(jax.random.key(config.seed))
        self._stop = False
        if not allocate:
            return
        self.mesh = shd.make_mesh(config.mesh or "fsdp:-1")
        self.batch_sharding = NamedSharding(self.mesh, shd.logical_to_spec(("batch", "seq"), mesh_shape=self.mesh.shape))
        self.ts = self._init_state()  # may adopt the checkpoint's config (self.cfg)
        self.flops_per_token = flops_per_token(self.cfg, config.data.seq_len, self.stage == "sparse")
        self._step_fn = self._compile_step()

    # ------------------------------------------------------------------ state
    def _build(self, model=None):
        if model is None:
            model = Transformer(self.cfg, rngs=nnx.Rngs(self.config.seed), dtype=self.dtype,
                                param_dtype=self.param_dtype, options=self.options)
        model.options = self.options
        return model, nnx.Optimizer(model, self.tx, wrt=self.filter)

    def abstract_state(self) -> tuple[object, nnx.State]:
        """(graphdef, abstract state of (model, optimizer)) without allocating anything (works for 671B)."""
        return nnx.split(nnx.eval_shape(self._build))

    def _init_state(self) -> TrainState:
        init = self.config.init_from
        model = None
        if init:
            model = self._load_model(init)
            self.cfg = model.config  # e.g. a checkpoint without the MTP layer
        graphdef, state = self.abstract_state()
        shardings = shd.state_shardings(state, self.mesh)
        if model is None:
            state = jax.jit(lambda: nnx.split(self._build())[1], out_shardings=shardings)()
        else:
            state = jax.device_put(nnx.split(self._build(model))[1], shardings)
        return TrainState(graphdef, state, shardings)

    def _load_model(self, init: str) -> Transformer:
        """Parameters from an HF / converted checkpoint or a training workdir (its latest finished checkpoint, with
        the model config recorded there), through the one loader, `dsv32_jax.from_pretrained`."""
        loaded = dsv32_jax.from_pretrained(init, dtype=self.dtype, param_dtype=self.param_dtype)
        # this run's config (overrides such as index_topk apply), with the MTP layer iff the checkpoint has one
        cfg = self.cfg.replace(num_nextn_predict_layers=loaded.config.num_nextn_predict_layers)
        graphdef, abstract = nnx.split(nnx.eval_shape(
            lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=self.dtype, param_dtype=self.param_dtype)))
        state = nnx.state(loaded)
        want = dict(nnx.traversals.flatten_mapping(jax.tree.map(jnp.shape, nnx.to_pure_dict(abstract))))
        have = dict(nnx.traversals.flatten_mapping(jax.tree.map(jnp.shape, nnx.to_pure_dict(state))))
        for path in sorted(set(want) | set(have), key=str):
            if want.get(path) != have.get(path):
                raise ValueError(f"config.init_from={init}: parameter {'/'.join(map(str, path))} has shape "
                                 f"{have.get(path)} there but {want.get(path)} in this run's model "
                                 "(config.model / config.model_overrides change the architecture)")
        logging.info("initialized parameters from %s", init)
        return nnx.merge(graphdef, state)

    # ------------------------------------------------------------------- step
    def _compile_step(self):
        graphdef, config, filt = self.ts.graphdef, self.config, self.filter
        cfg = self.cfg
        loss_cfg = config.loss
        stage = self.stage

        def loss_fn(model, batch):
            logits, aux = model(batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                                return_aux=True)
            token_mask = (batch["segment_ids"] > 0).astype(jnp.float32)
            lm = losses.lm_loss(logits, batch)
            kl, metrics = losses.indexer_kl(aux, token_mask)
            metrics.update(lm_loss=lm, indexer_kl=kl)
            if stage == "warmup":
                loss = kl
            else:
                loss = lm
                if stage == "sparse":
                    loss = loss + loss_cfg.indexer_weight * kl
                if loss_cfg.mtp_weight and aux["mtp_logits"]:
                    mtp = losses.mtp_loss(aux["mtp_logits"], batch)
                    metrics["mtp_loss"] = mtp
                    loss = loss + loss_cfg.mtp_weight * mtp
                if loss_cfg.balance_weight and cfg.has_moe:
                    bal = losses.balance_loss(aux, token_mask, cfg.n_routed_experts, cfg.num_experts_per_tok)
                    metrics["balance_loss"] = bal
                    loss = loss + loss_cfg.balance_weight * bal
            captured = [v for k, v in metrics.items() if k.startswith("captured_mass/")]
            if captured:
                metrics["captured_mass"] = jnp.mean(jnp.stack(captured))
            metrics["loss"] = loss
            return loss, (metrics, {k: aux[k] for k in ("routing",) if k in aux}, token_mask)

        def step(state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            grad_fn = nnx.grad(loss_fn, argnums=nnx.DiffState(0, filt), has_aux=True)
            grads, (metrics, aux, token_mask) = grad_fn(model, batch)
            optimizer.update(model, grads)
            if loss_cfg.bias_update_speed and stage != "warmup":
                for key, ids in aux["routing"].items():
                    if ids is not None:
                        n = cfg.num_hidden_layers
                        ffn = (model.layers[key] if key < n else model.mtp[key - n].block).ffn
                        ffn.bias[...] = losses.bias_update(ffn.bias[...], ids, token_mask, loss_cfg.bias_update_speed)
            metrics["grad_norm"] = optax.global_norm(grads)
            metrics["lr"] = self._lr(optimizer.step[...])
            return nnx.state((model, optimizer)), metrics

        batch_sh = {k: self.batch_sharding for k in BATCH_KEYS}
        return jax.jit(step, in_shardings=(self.ts.shardings, batch_sh), out_shardings=(self.ts.shardings, None),
                       donate_argnums=0)

    def _lr(self, count):
        return learning_rate_schedule(self.config.optimizer)(jnp.maximum(count - 1, 0))

    def device_batch(self, batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(batch[k]))
                for k in BATCH_KEYS}

    def train_step(self, batch: dict) -> dict:
        with shd.use_mesh(self.mesh):
            self.ts.state, metrics = self._step_fn(self.ts.state, self.device_batch(batch))
        return metrics

    @property
    def model(self) -> Transformer:
        return nnx.merge(self.ts.graphdef, self.ts.state)[0]

    @property
    def step(self) -> int:
        return int(nnx.merge(self.ts.graphdef, self.ts.state)[1].step[...])

    # ------------------------------------------------------------ checkpoints
    def checkpoint_manager(self) -> ocp.CheckpointManager:
        c = self.config.checkpoint
        options = ocp.CheckpointManagerOptions(save_interval_steps=c.every, max_to_keep=c.keep,
                                               enable_async_checkpointing=c.use_async)
        return ocp.CheckpointManager(os.path.abspath(os.path.join(self.workdir, "checkpoints")), options=options)

    def _pure(self):
        return nnx.to_pure_dict(self.ts.state[0]), nnx.to_pure_dict(self.ts.state[1])

    def save(self, mngr, step: int, data_state, force: bool = False) -> bool:
        params, opt = self._pure()
        meta = {"step": step, "stage": self.stage, "rng": np.asarray(self.rng).tolist(),
                "model_config": self.cfg.to_hf()}
        return mngr.save(step, force=force, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt=ocp.args.StandardSave(opt),
            data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))

    def restore(self, mngr, step: int):
        def target(tree, shardings):
            return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

        params_t = target(nnx.to_pure_dict(self.ts.state[0]), nnx.to_pure_dict(self.ts.shardings[0]))
        opt_t = target(nnx.to_pure_dict(self.ts.state[1]), nnx.to_pure_dict(self.ts.shardings[1]))
        r = mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(params_t), opt=ocp.args.StandardRestore(opt_t),
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        nnx.replace_by_pure_dict(self.ts.state[0], r["params"])
        nnx.replace_by_pure_dict(self.ts.state[1], r["opt"])
        self.rng = np.asarray(r["meta"]["rng"], np.uint32)
        return r["data"]

    # ------------------------------------------------------------------- loop
    def _request_stop(self, signum, _frame):
        logging.warning("signal %d: saving a checkpoint and stopping after this step", signum)
        self._stop = True

    def peak_flops(self) -> float | None:
        if self.config.peak_tflops:
            return self.config.peak_tflops * 1e12
        kind = jax.devices()[0].device_kind
        for name, tf in PEAK_TFLOPS.items():
            if name in kind:
                return tf * 1e12
        return None

    def fit(self, data_iter) -> list[dict]:
        """Runs until config.steps (resuming from the workdir's latest checkpoint); returns the logged metrics."""
        config = self.config
        writer = MetricsWriter(self.workdir, config.steps, enabled=jax.process_index() == 0)
        old_handler = signal.signal(signal.SIGTERM, self._request_stop)
        history = []
        with self.checkpoint_manager() as mngr:
            latest = mngr.latest_step()
            if latest is not None:
                data_iter.set_state(self.restore(mngr, latest))
                logging.info("resumed from %s step %d", mngr.directory, latest)
            step = self.step
            tokens_per_step = config.data.batch_size * config.data.seq_len
            peak = self.peak_flops()
            while step < config.steps and not self._stop:
                batch = next(data_iter)
                t0 = time.perf_counter()
                metrics = jax.device_get(self.train_step(batch))
                dt = time.perf_counter() - t0
                step += 1
                metrics.update(step_time_s=dt, tokens_per_s=tokens_per_step / dt)
                if peak:
                    metrics["mfu"] = self.flops_per_token * metrics["tokens_per_s"] / jax.device_count() / peak
                writer.write(step, metrics)
                history.append({"step": step, **{k: float(v) for k, v in metrics.items()}})
                if step % config.log_every == 0 or step == config.steps or step == 1:
                    writer.console(step, metrics)
                self.save(mngr, step, data_iter.get_state(), force=self._stop or step == config.steps)
            mngr.wait_until_finished()
        signal.signal(signal.SIGTERM, old_handler)
        writer.close()
        return history


def write_summary(workdir: str, history: list[dict]) -> None:
    if not history or jax.process_index() != 0:
        return
    keys = [k for k in history[-1] if k != "step"]
    summary = {"steps": history[-1]["step"], "first": {k: history[0].get(k) for k in keys},
               "last": {k: history[-1].get(k) for k in keys}}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
