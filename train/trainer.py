"""Sharded training of the LM stages: dense pre-training, the dense warm-up (eq. 3) and sparse continued
pre-training (eq. 4).

The train step is train/steps.py's lm_train_step, a pure function of (state, batch) jitted with explicit shardings;
state = nnx.State of (model, optimizer). Only the stage's trainable parameters get gradients and optimizer state.
The loop is train/loop.py's (shared with GRPO). Checkpoints (train/checkpointing.py; orbax, async) hold params,
optimizer state (with the step), the data iterator position and the RNG.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

import dsv32_jax
from dsv32_jax.checkpoint import orbax_io
from dsv32_jax.checkpoint.io_utils import write_text_atomic
from dsv32_jax.checkpoint.safetensors_io import CheckpointError
from dsv32_jax import RunOptions, Transformer, load_preset
from dsv32_jax.model import sharding as shd
from dsv32_jax.train import checkpointing, steps
from dsv32_jax.train import data as data_lib
from dsv32_jax.train.config import check_batch_mesh, check_config, check_init_from, check_model_overrides
from dsv32_jax.train.loop import DataError, DataExhausted, run_loop
from dsv32_jax.train.data.tokenizers import tokenizer_record
from dsv32_jax.train.metrics import LM_KEYS, read_steps
from dsv32_jax.train.optimizer import group_config, learning_rate_schedule, make_tx, trainable_filter

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "TPU v5p": 459.0, "TPU v5e": 197.0,
               "TPU v6": 918.0}
BATCH_KEYS = steps.LM_BATCH_KEYS


def run_options(config) -> RunOptions:
    """The model's RunOptions for `config`'s stage, from the config's run-option fields (remat, scan_layers, chunks,
    indexer_fp8, kl_key_grad, the kernel choices); every stage reads all of them. The GRPO and agent stages set
    `indexer_loss` per step (their losses decide it), so their options leave it unset."""
    stage = config.stage
    common = dict(attn_chunk=config.attn_chunk, index_chunk=config.index_chunk, remat=config.get("remat", "none"),
                  scan_layers=config.get("scan_layers", False), indexer_fp8=config.get("indexer_fp8", False),
                  kl_key_grad=config.get("kl_key_grad", "dense"), mla_bwd=config.get("mla_bwd", "stored"),
                  mla_fwd=config.get("mla_fwd", "triton"), mla_pds=config.get("mla_pds", "triton"),
                  mla_dqkv=config.get("mla_dqkv", "triton"))
    if stage == "dense":
        return RunOptions(dsa=False, attention="dense", **common)
    if stage == "warmup":
        # dense attention (eq. 3 needs the dense distribution); with attention="kernel" the captured-mass metric's
        # top-k is the kernels' selection (indexer_topk: the one the sparse stage runs)
        attention = "kernel" if config.attention == "kernel" else "dense"
        return RunOptions(dsa=False, attention=attention, indexer_loss="dense", **common)
    if stage in ("grpo", "agent"):
        return RunOptions(attention=config.attention, **common)
    return RunOptions(attention=config.attention, indexer_loss="sparse", **common)


def warn_untrained_indexers(config, init: str) -> str | None:
    """The sparse, GRPO and agent stages select with the indexers from their first step; started from indexers that
    never trained (config.init_indexer='fresh', an HF checkpoint without them, a dense-stage workdir) the selection
    is random until a KL trains them. The paper warms them up first (eq. 3, stage 'warmup'): say so, once. Returns
    why, or None."""
    from dsv32_jax.checkpoint.loading import untrained_indexers

    why = "config.init_indexer='fresh'" if config.get("init_indexer", "auto") == "fresh" else untrained_indexers(init)
    if why:
        logging.warning("the %s stage starts from lightning indexers that were never trained (%s): its top-k "
                        "selection is random until the KL trains them; the paper's recipe runs the dense warm-up "
                        "first (config.stage='warmup', configs/warmup_*.py) and starts from its workdir",
                        config.stage, why)
    return why


def perturb_params(model, rel: float, seed: int = 0, flag: str = "config.init_perturb") -> None:
    """In place: every floating parameter x -> x * (1 + rel * N(0, 1)), the noise drawn from `seed` (not from
    config.seed: the same perturbation at every seed). `config.init_perturb` (every stage, on a fresh model: its
    old name `config.agent.init_perturb` is moved there) applies it to the initial parameters: a run perturbed
    by 1e-6 diverges from the unperturbed one as a run on another CPU (other float rounding, e.g. AVX2 vs AVX-512)
    does, so a result that holds only for the exact bits shows up as fragile. `flag` names the option in errors."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    narrow = sorted({str(x.dtype) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4})
    if narrow and abs(rel) < 2.0 ** -9:  # below half a bf16 ulp: x * (1 + rel N) rounds back to x
        raise ValueError(f"{flag}={rel}: too small to move a {', '.join(narrow)} parameter (its rounding is 2^-9 "
                         "relative); use >= 2^-9 or a float32 model (param_dtype)")
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [(x.astype(jnp.float32) * (1 + rel * jax.random.normal(k, x.shape, jnp.float32))).astype(x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) else x for x, k in zip(leaves, keys)]  # rounded once
    nnx.update(model, jax.tree.unflatten(treedef, out))


def fresh_model(config, cfg, dtype, param_dtype, options=None) -> Transformer:
    """A randomly initialized `cfg` from config.seed, perturbed by config.init_perturb when it is set."""
    model = Transformer(cfg, rngs=nnx.Rngs(config.seed), dtype=dtype, param_dtype=param_dtype, options=options)
    rel = float(config.get("init_perturb", 0.0))
    if rel:
        perturb_params(model, rel)
    return model


def load_init(config, init: str, cfg, dtype, param_dtype, *, mesh=None, options=None, warn: bool) -> Transformer:
    """`init`'s (config.init_from's) parameters (an HF / converted checkpoint or a training workdir: its latest finished
    checkpoint, with the model config recorded there) through the one loader, `dsv32_jax.from_pretrained`, with
    config.init_indexer, config.seed and config.model_overrides, onto `mesh` (an orbax checkpoint or workdir is
    restored straight into the shardings, each process reading only the slices its devices hold), in a model of
    this run's `cfg` (with the MTP layer iff the checkpoint has one) and `options`. A parameter whose shape differs
    from `cfg`'s is refused by name; `warn`: log when the loaded indexers never trained (a stage that selects with
    them)."""
    overrides = dict(config.model_overrides) or None
    try:
        loaded = dsv32_jax.from_pretrained(init, dtype=dtype, param_dtype=param_dtype, mesh=mesh, options=options,
                                           init_indexer=config.get("init_indexer", "auto"), seed=config.seed,
                                           overrides=overrides)
    except CheckpointError as e:
        if not overrides:
            raise
        raise CheckpointError(f"config.init_from={init}: {e}; config.model_overrides={overrides} change the "
                              "architecture recorded there") from None
    # this run's config (overrides such as index_topk apply), with the MTP layer iff the checkpoint has one
    cfg = cfg.replace(num_nextn_predict_layers=loaded.config.num_nextn_predict_layers)
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, options=options)))
    state = nnx.state(loaded)
    want = dict(nnx.traversals.flatten_mapping(jax.tree.map(jnp.shape, nnx.to_pure_dict(abstract))))
    have = dict(nnx.traversals.flatten_mapping(jax.tree.map(jnp.shape, nnx.to_pure_dict(state))))
    for path in sorted(set(want) | set(have), key=str):
        if want.get(path) != have.get(path):
            raise ValueError(f"config.init_from={init}: parameter {'/'.join(map(str, path))} has shape "
                             f"{have.get(path)} there but {want.get(path)} in this run's model "
                             "(config.model / config.model_overrides change the architecture)")
    logging.info("initialized parameters from %s", init)
    if warn:
        warn_untrained_indexers(config, init)
    return nnx.merge(graphdef, state)


def build_policy(config, cfg, dtype, param_dtype, *, resuming: bool, mesh=None) -> Transformer:
    """The GRPO and agent stages' starting model, with `run_options(config)`: `config.init_from` through `load_init`
    onto `mesh` (warning when DSA starts from untrained indexers), else a fresh `cfg` from config.seed. Resuming, a
    fresh `cfg` too: the checkpoint's arrays replace its. A fresh model is perturbed by config.init_perturb when it
    is set."""
    options = run_options(config)
    if config.init_from and not resuming:
        return load_init(config, config.init_from, cfg, dtype, param_dtype, mesh=mesh, options=options,
                         warn=options.dsa)
    return fresh_model(config, cfg, dtype, param_dtype, options)


def model_config(config) -> dsv32_jax.ModelConfig:
    """The architecture to build: the one recorded in `config.init_from` (a training workdir's checkpoint meta, or an
    HF / converted checkpoint's config.json), else the preset `config.model`; `config.model_overrides` on top."""
    init = config.init_from
    if init and orbax_io.is_training_workdir(init):
        cfg = orbax_io.training_checkpoint(init).cfg
    elif init and os.path.exists(os.path.join(init, "config.json")):
        cfg = dsv32_jax.ModelConfig.from_hf(init)
    else:
        return _with_overrides(load_preset(config.model), config)
    try:
        preset = _with_overrides(load_preset(config.model), config)
    except (OSError, ValueError):
        preset = None
    shape = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "moe_intermediate_size", "n_routed_experts", "q_lora_rank", "kv_lora_rank")
    if preset is not None and any(getattr(preset, f) != getattr(cfg, f) for f in shape):
        logging.warning("config.model=%r is not the architecture of config.init_from=%s; the model is built as "
                        "init_from records it (config.model_overrides on top)", config.model, init)
    return _with_overrides(cfg, config)


def data_shard(batch_sharding, batch_size: int, seq_len: int, mesh_spec: str, field: str) -> tuple[int, int]:
    """(i, n): the block of the global batch this process's devices own (shd.process_row_block), the shard its
    data pipeline reads (make_iterator's process_index / process_count). A mesh that gives a process rows that are
    no such block is refused, naming it."""
    try:
        return shd.process_row_block(batch_sharding, (batch_size, seq_len))
    except ValueError as e:
        raise ValueError(f"config.mesh={mesh_spec or 'fsdp:-1'!r} over {jax.process_count()} processes with "
                         f"{field}.batch_size={batch_size}: {e}; order the mesh so that each process's devices own "
                         "one block of rows (the batch axes data, fsdp, expert outside the ones within a process)") from None


def resumed_model_config(config, workdir: str, stage: str, data=None):
    """(the model config to build, the resume point or None) of a run in `workdir`. A workdir with a checkpoint
    resumes from it: the model is the one recorded there, init_from is not read again (it may be gone by now), and
    the stage, the model this config describes (when init_from can still be read; the MTP layer follows
    init_from's) and `data` (config.data) must be those of the run that wrote it (checkpointing.check_resume)."""
    point = checkpointing.resume_point(workdir)
    if point is None:
        return model_config(config), None
    init = config.init_from
    readable = not init or os.path.exists(init)
    checkpointing.check_resume(point, stage=stage, model_cfg=model_config(config) if readable else None, data=data,
                               ignore_model=("num_nextn_predict_layers",) if init else ())
    return point.cfg, point


def _with_overrides(cfg, config):
    overrides = dict(config.model_overrides or {})
    check_model_overrides(overrides)
    return cfg.replace(**overrides) if overrides else cfg


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


def check_context(config, cfg) -> None:
    """data.seq_len and eval.seq_len within the model's context (max_position_embeddings): a document that fills a
    row reaches RoPE positions past it, which the model config says it does not have."""
    ctx = int(cfg.max_position_embeddings)
    for field in ("data.seq_len", "eval.seq_len"):
        section, name = field.split(".")
        value = int(config[section].get(name, 0) or 0) if section in config else 0
        if value > ctx:
            raise ValueError(f"config.{field}={value} exceeds the model's context of {ctx} positions "
                             f"(max_position_embeddings of the model config): lower config.{field} or raise the "
                             "context with config.model_overrides")


class Trainer:
    def __init__(self, config, workdir: str, *, allocate: bool = True):
        """allocate=False builds only the abstract state (shapes, no mesh, no compilation): any config, any size."""
        check_config(config)
        self.config = config
        self.workdir = workdir
        self.stage = config.stage
        self.filter = trainable_filter(self.stage, mtp=bool(config.loss.get("mtp_weight", 0.0)),
                                       indexer=bool(config.loss.get("indexer_weight", 1.0)))
        self.resume = None
        if allocate:
            self.cfg, self.resume = resumed_model_config(config, workdir, self.stage, data=config.data)
        else:
            self.cfg = model_config(config)
        self.dtype = jnp.dtype(config.dtype)
        self.param_dtype = jnp.dtype(config.param_dtype)
        self.options = run_options(config)
        self.tx = make_tx(config.optimizer, self.param_dtype)
        self.rng = jax.random.key_data(jax.random.key(config.seed))
        if not allocate:
            return
        if self.resume is None:
            check_init_from(config)
        check_batch_mesh(config)
        self.mesh = shd.make_mesh(config.mesh or "fsdp:-1")
        self.batch_sharding = steps.lm_batch_sharding(self.mesh)
        self.data_shard = data_shard(self.batch_sharding, config.data.batch_size, config.data.seq_len, config.mesh,
                                     "config.data")
        check_context(config, self.cfg)  # (before anything is built; again for init_from's config below)
        self.ts = self._init_state()  # may adopt the checkpoint's config (self.cfg)
        check_context(config, self.cfg)
        self.flops_per_token = flops_per_token(self.cfg, config.data.seq_len, self.stage == "sparse")
        self._step_fn = self._compile_step()

    # ------------------------------------------------------------------ state
    def _build(self, model=None):
        if model is None:
            model = fresh_model(self.config, self.cfg, self.dtype, self.param_dtype, self.options)
        model.options = self.options
        return model, nnx.Optimizer(model, self.tx, wrt=self.filter)

    def abstract_state(self) -> tuple[object, nnx.State]:
        """(graphdef, abstract state of (model, optimizer)) without allocating anything (works for 671B)."""
        return nnx.split(nnx.eval_shape(self._build))

    def _init_state(self) -> TrainState:
        init = self.config.init_from
        model = None
        if init and self.resume is None:  # (resuming: the checkpoint's arrays replace these)
            model = self._load_model(init)
            self.cfg = model.config  # e.g. a checkpoint without the MTP layer
        graphdef, state = self.abstract_state()
        shardings = shd.state_shardings(state, self.mesh)
        if model is None:
            state = jax.jit(lambda: nnx.split(self._build())[1], out_shardings=shardings)()
        else:  # the loaded parameters are already sharded; the optimizer state is created in place, sharded
            model_def, params = nnx.split(model)
            state = jax.jit(lambda p: nnx.split(self._build(nnx.merge(model_def, p)))[1],
                            out_shardings=shardings)(params)
        return TrainState(graphdef, state, shardings)

    def _load_model(self, init: str) -> Transformer:
        """`init` (config.init_from) through `load_init` onto this run's mesh; the sparse stage warns when its
        indexers never trained (the warm-up was skipped)."""
        return load_init(self.config, init, self.cfg, self.dtype, self.param_dtype, mesh=self.mesh,
                         warn=self.stage == "sparse")

    # ------------------------------------------------------------------- step
    def _compile_step(self):
        return steps.compile_lm_step(
            self.ts.shardings, self.batch_sharding, graphdef=self.ts.graphdef, stage=self.stage,
            trainable=self.filter, weights=steps.LossWeights.from_config(self.config.loss), model_cfg=self.cfg,
            lr_schedule=learning_rate_schedule(self.config.optimizer),
            indexer_lr_schedule=learning_rate_schedule(group_config(self.config.optimizer, "indexer")),
            microbatches=self.config.get("microbatches", 1))

    def device_batch(self, batch: dict) -> dict:
        """This process's rows (block `data_shard` of the data pipeline) -> global arrays of config.data.batch_size
        rows (a shape that disagrees raises instead of silently making a smaller batch)."""
        rows = self.config.data.batch_size
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(batch[k]),
                                                          (rows,) + np.shape(batch[k])[1:]) for k in BATCH_KEYS}

    def train_step(self, batch: dict) -> dict:
        with shd.use_mesh(self.mesh):
            self.ts.state, metrics = self._step_fn(self.ts.state, self.device_batch(batch))
        return metrics

    @property
    def model(self) -> Transformer:
        return nnx.merge(self.ts.graphdef, self.ts.state)[0]

    @property
    def step(self) -> int:
        return int(self.ts.state[1]["step"][...])  # the optimizer's step counter, read without merging the state

    # ------------------------------------------------------------ checkpoints
    def checkpoint_manager(self) -> ocp.CheckpointManager:
        return checkpointing.manager(self.workdir, self.config.checkpoint)

    def save(self, mngr, step: int, data_state, force: bool = False) -> bool:
        meta = {"step": step, "stage": self.stage, "rng": np.asarray(self.rng).tolist(),
                "model_config": self.cfg.to_hf(), "tokenizer": tokenizer_record(self.config.data.tokenizer),
                "data_config": checkpointing.data_fingerprint(self.config.data)}
        return checkpointing.save(mngr, step, arrays={"params": self.ts.state[0], "opt": self.ts.state[1]},
                                  json={"data": data_state, "meta": meta}, force=force)

    def restore(self, mngr, step: int):
        r = checkpointing.restore(mngr, step, arrays={"params": (self.ts.state[0], self.ts.shardings[0]),
                                                      "opt": (self.ts.state[1], self.ts.shardings[1])},
                                  json=("data", "meta"))
        self.rng = np.asarray(r["meta"]["rng"], np.uint32)
        return r["data"]

    # ------------------------------------------------------------------- loop
    def peak_flops(self) -> float | None:
        if self.config.peak_tflops:
            return self.config.peak_tflops * 1e12
        kind = jax.devices()[0].device_kind
        for name, tf in PEAK_TFLOPS.items():
            if name in kind:
                return tf * 1e12
        return None

    def restore_checkpoint(self, mngr, step: int) -> None:
        state = dict(self.restore(mngr, step))
        saved = state.pop(DATA_STATE_KEY, None)  # (absent in checkpoints written before it was recorded)
        workers = self.config.data.get("worker_count", 0)
        if saved is not None and saved.get("worker_count") != workers:
            raise checkpointing.ResumeError(f"checkpoint step {step}: its data state was saved with data.worker_count="
                             f"{saved.get('worker_count')} and this run has {workers}; the iterator state's format "
                             "depends on it (the rows do not): resume with the checkpoint's data.worker_count")
        try:
            self._data_iter.set_state(state)
        except ValueError as e:  # (the pipeline's own check: another number of shards)
            raise checkpointing.ResumeError(f"checkpoint step {step}: {e}") from None
        except (KeyError, TypeError, IndexError) as e:
            raise checkpointing.ResumeError(
                f"checkpoint step {step}: its data state does not fit this run's data pipeline ({e!r}); resume with "
                "the data config the checkpoint was written with (data.worker_count, data.shards)") from None

    def save_checkpoint(self, mngr, step: int, force: bool) -> bool:
        if not force and not mngr.should_save(step):
            return False
        data_state = self._data_iter.get_state()
        if jax.process_count() > 1:  # each process holds its own shards' positions: the checkpoint keeps them all
            data_state = data_lib.merge_states(checkpointing.allgather_json(data_state))
        data_state = {**data_state, DATA_STATE_KEY: {"worker_count": self.config.data.get("worker_count", 0)}}
        return self.save(mngr, step, data_state, force=force)

    def run_step(self) -> dict:
        t_data = time.perf_counter()
        try:
            batch = next(self._data_iter)
        except StopIteration:
            raise DataExhausted(f"the training data ran out after data.num_epochs={self.config.data.num_epochs} "
                                "epoch(s)") from None
        except (KeyError, ValueError, UnicodeError) as e:  # a record the pipeline refused (it names file and line)
            raise DataError(f"training data: {e}") from e
        except RuntimeError as e:  # a grain worker process that died (the OOM killer): the last step is saved
            raise DataError(f"training data: the data pipeline failed: {e}") from e
        t0 = time.perf_counter()
        metrics = jax.device_get(self.train_step(batch))
        dt = time.perf_counter() - t0
        # data_wait_s: how long the step waited for its batch (the pipeline packs ahead in a thread: ~0 unless
        # reading / tokenizing is slower than the step; step_time_s and tokens_per_s leave it out)
        metrics.update(step_time_s=dt, tokens_per_s=self._tokens_per_step / dt, data_wait_s=t0 - t_data)
        if self._peak:
            metrics["mfu"] = self.flops_per_token * metrics["tokens_per_s"] / jax.device_count() / self._peak
        every = self.config.eval.every if "eval" in self.config else 0
        if every:
            step = self.step
            if step % every == 0 or step == self.config.steps:
                metrics["eval_loss"] = self.evaluate()["loss"]
        return metrics

    def evaluator(self):
        """The held-out Evaluator of this run (built once): dense attention for the dense stage, DSA otherwise, with
        the run's selection (indexer_fp8: the FP8 scores it trains with, not the exact ones) and, with
        config.attention="kernel", the run's kernels (the indexer_topk and sparse MLA forward it trains with)."""
        if getattr(self, "_evaluator", None) is None:
            from dsv32_jax.train import eval as eval_lib

            cfg = eval_lib.eval_data_config(self.config.data.to_dict(), self.config.eval)
            shard = data_shard(self.batch_sharding, cfg.batch_size, cfg.seq_len, self.config.mesh, "config.eval")
            batches = eval_lib.eval_batches(cfg, self.cfg.vocab_size, self.config.eval.batches, shard=shard)
            model_graphdef = nnx.split(self.model)[0]
            self._evaluator = eval_lib.Evaluator.create(
                batches, graphdef=model_graphdef,
                options=self._eval_options(eval_lib.ATTENTIONS),
                model_shardings=self.ts.shardings[0], batch_sharding=self.batch_sharding, rows=cfg.batch_size)
        return self._evaluator

    def _eval_options(self, attentions: dict) -> RunOptions:
        o = self.options
        if self.stage == "dense":
            return attentions["dense"].replace(attn_chunk=o.attn_chunk, index_chunk=o.index_chunk)
        kernel = self.config.get("attention", "sparse") == "kernel"
        return attentions["dsa"].replace(attention="kernel" if kernel else "sparse", attn_chunk=o.attn_chunk,
                                         index_chunk=o.index_chunk, indexer_fp8=o.indexer_fp8, mla_fwd=o.mla_fwd)

    def evaluate(self) -> dict:
        """Held-out loss of the current parameters ({"loss", "tokens"})."""
        with shd.use_mesh(self.mesh):
            return self.evaluator()(self.ts.state[0])

    def fit(self, data_iter) -> list[dict]:
        """Runs until config.steps (resuming from the workdir's latest checkpoint); returns the logged metrics."""
        self._data_iter = data_iter
        self._tokens_per_step = self.config.data.batch_size * self.config.data.seq_len
        self._peak = self.peak_flops()
        return run_loop(self, workdir=self.workdir, config=self.config, keys=LM_KEYS, desc=self.stage)


DATA_STATE_KEY = "dsv32_data"  # beside the iterator's state in a checkpoint's data item: the pipeline it fits


def write_summary(workdir: str, history: list[dict]) -> None:
    """summary.json: the run's step count and its first and last steps' metrics, from metrics.jsonl (the whole
    run: `history` holds only the steps this process ran, so a resumed run's "first" was its first resumed step)."""
    if not history or jax.process_index() != 0:
        return
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.isfile(path):
        history = [r for r in read_steps(path) if r["step"] <= history[-1]["step"]] or history
    keys = [k for k in history[-1] if k != "step"]
    summary = {"steps": history[-1]["step"], "first": {k: history[0].get(k) for k in keys},
               "last": {k: history[-1].get(k) for k in keys}}
    write_text_atomic(os.path.join(workdir, "summary.json"), json.dumps(summary, indent=1))
