"""Default experiment config. Experiment files under configs/ call `default_config()` (or `base_config(name)`, to
start from another experiment file) and override what differs."""

from __future__ import annotations

import importlib.util
import os

import ml_collections

import dsv32_jax.configs

CONFIGS_DIR = os.path.dirname(os.path.abspath(dsv32_jax.configs.__file__))  # configs/ (dsv32_jax.configs when installed)


def base_config(name: str) -> ml_collections.ConfigDict:
    """The config of the experiment file configs/<name>.py (found next to this package, whatever the cwd)."""
    path = os.path.join(CONFIGS_DIR, f"{name}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"base_config: no experiment file {path}")
    spec = importlib.util.spec_from_file_location(f"_dsv32_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # "dense" (LM pre-training with dense attention), "warmup" (eq. 3: indexer only), "sparse" (eq. 4 + LM)
    c.stage = "sparse"
    c.model = "tiny"  # preset under dsv32_jax/presets/ or a config.json path
    c.model_overrides = ml_collections.ConfigDict()  # e.g. {"index_topk": 16}
    # Start from: "" (random init with `seed`), an HF / converted-orbax checkpoint dir, or a training workdir
    # (its latest checkpoint's parameters).
    c.init_from = ""
    # Lightning indexers of init_from: "auto" (fresh for an HF deepseek_v3 checkpoint such as DeepSeek-V3.1-Terminus,
    # which has none; loaded otherwise), "load", or "fresh" (initialized from `seed`, everything else loaded).
    c.init_indexer = "auto"
    c.dtype = "float32"
    c.param_dtype = "float32"
    c.seed = 0
    # > 0: a fresh model's parameters x -> x * (1 + init_perturb * N(0, 1)) (trainer.perturb_params; the same noise
    # at every seed): a run as another CPU's float rounding would make it, for checking a result over more than one
    # run (tools/train_sweep.sh). Ignored when the parameters come from init_from or a checkpoint.
    c.init_perturb = 0.0
    c.steps = 100
    # Gradient accumulation: each step's global batch (data.batch_size) runs as this many microbatches, one forward
    # + backward at a time (train/steps.py:accumulate_grads), then ONE optimizer update: the same step as the
    # un-split batch (losses averaged over the whole batch) with 1/microbatches of its activations. Each microbatch
    # keeps data.batch_size / microbatches rows split over the batch mesh axes.
    c.microbatches = 1
    c.attention = "sparse"  # "sparse" | "kernel" | "dense" (DSA attention implementation)
    # The indexer's selection in production form (RunOptions.indexer_fp8): Hadamard-rotated e4m3 queries and keys with
    # per-token scales, the FP8 indexer kernel with attention="kernel". False: exact float32 scores (in XLA). The
    # indexer's KL (eq. 3 / eq. 4) always scores exactly; only which keys are selected changes.
    c.indexer_fp8 = False
    # eq. 4's key gradient (RunOptions.kl_key_grad): "dense" | "segment_sum" | "scatter" (autodiff, 2.6x slower step)
    c.kl_key_grad = "dense"
    # The sparse MLA kernel's GPU backward (RunOptions.mla_bwd, attention="kernel"): "stored" (1.36-1.38x faster on
    # an H200) | "recompute" | "atomic" (stored, dkv added in place by fp32 atomics; not yet timed on a chip)
    c.mla_bwd = "stored"
    # Its GPU forward (RunOptions.mla_fwd): "triton" | "mosaic_gpu" | "mosaic_gpu_pingpong" (issue 31's Hopper kernel,
    # and its form with a key block per warpgroup; not yet timed on a chip)
    c.mla_fwd = "triton"
    # The stored backward's P / dS kernel (RunOptions.mla_pds): "triton" | "mosaic_gpu" (not yet timed on a chip)
    c.mla_pds = "triton"
    # ... and its dq / dkv kernel (RunOptions.mla_dqkv): "triton" | "mosaic_gpu" (with mla_bwd "stored"; not yet timed)
    c.mla_dqkv = "triton"
    c.attn_chunk = 64
    c.index_chunk = 128
    # Per-block rematerialization (RunOptions.remat): "none" | "full" | "dots" | "dots_no_batch". Query chunks of
    # the attention / indexer references are always rematerialized (bench/memory.py measures both).
    c.remat = "none"
    # Decoder blocks of one structure as one lax.scan over stacked parameters (RunOptions.scan_layers): the same
    # step, compiled once per block structure instead of once per layer (the 671B recipes: compile host memory).
    c.scan_layers = False
    c.mesh = ""  # e.g. "fsdp:2,tensor:2,expert:2"; "" = all devices on fsdp
    c.peak_tflops = 0.0  # per device, for the MFU estimate (0 = look up the device kind)

    c.data = ml_collections.ConfigDict(dict(
        source="builtin", paths=(), text_field="text", tokenizer="byte", seq_len=128, batch_size=8, seed=0,
        shuffle=True, num_epochs=None, add_eos=True, worker_count=0, shards=0,
        special_tokens="text",  # special-token strings in documents: "text" (as written) or "parse" (special ids)
        shuffle_window=512,  # with shuffle: rows shuffled together (window x seq_len tokens held and packed at once)
        skip_bad_records=False))  # True: a record the source refuses is skipped with a warning, not a stopped run
    c.data.num_epochs = ml_collections.config_dict.placeholder(int)

    # master_dtype: parameters stored narrower (param_dtype bf16) are updated through master copies in this dtype
    # held in the optimizer state ("" = update in param_dtype).
    c.optimizer = ml_collections.ConfigDict(dict(
        lr=1e-3, schedule="cosine", warmup_steps=10, hold_steps=0, decay_steps=100, final_lr_fraction=0.1, b1=0.9,
        b2=0.95, eps=1e-8, weight_decay=0.0, grad_clip=1.0, master_dtype="float32"))
    # weight decay reaches the weight matrices and the embedding ("matrices": the norms' scales and biases are not
    # decayed) or every trained parameter ("all")
    c.optimizer.weight_decay_mask = "matrices"
    # The lightning indexer's own optimizer (train/optimizer.py): a separate AdamW and global-norm clip over the
    # indexer's parameters; each field left None takes config.optimizer's value.
    c.optimizer.indexer = ml_collections.ConfigDict({
        "lr": ml_collections.config_dict.placeholder(float),
        "schedule": ml_collections.config_dict.placeholder(str),
        "warmup_steps": ml_collections.config_dict.placeholder(int),
        "hold_steps": ml_collections.config_dict.placeholder(int),
        "decay_steps": ml_collections.config_dict.placeholder(int),
        "final_lr_fraction": ml_collections.config_dict.placeholder(float),
        "b1": ml_collections.config_dict.placeholder(float),
        "b2": ml_collections.config_dict.placeholder(float),
        "eps": ml_collections.config_dict.placeholder(float),
        "weight_decay": ml_collections.config_dict.placeholder(float),
        "grad_clip": ml_collections.config_dict.placeholder(float)})

    c.loss = ml_collections.ConfigDict(dict(
        indexer_weight=1.0,  # sparse stage: weight of the eq. (4) KL (the indexer's only signal)
        mtp_weight=0.0,  # MTP loss weight (DeepSeek-V3 used 0.3 then 0.1)
        balance_weight=0.0,  # sequence-wise balance loss alpha (DeepSeek-V3: 1e-4)
        bias_update_speed=0.0,  # auxiliary-loss-free bias update gamma (DeepSeek-V3: 1e-3)
        # positions per chunk of the LM / MTP heads' cross-entropy, 0 = whole sequences: a chunk holds [chunk, V]
        # float32 logits instead of [T, V] (the small config at 128K: 63 GiB per [T, V] buffer); same loss
        token_chunk=0))

    # GRPO (stage "grpo"): built-in verifiable tasks, group sampling, the four DeepSeek-V3.2 stabilizers
    c.grpo = ml_collections.ConfigDict(dict(
        tasks="map,sum",  # comma-separated: map, sum, rev, copy
        group_size=8, prompts_per_step=16, epochs=2, minibatches=2,
        eps=0.2, delta=0.5,  # clip range; OPSM threshold on mean log(pi_old / pi_theta)
        kl_weight=0.0, kl_weights=ml_collections.ConfigDict(),  # beta (per task domain overrides, 0 allowed)
        max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0, max_candidates=32,
        length_target=-1,  # >= 0: length penalty beyond this many tokens (and for not emitting EOS)
        language_weight=0.0, grm_weight=0.0, eval_every=10,  # greedy evaluation every N steps and at the end (0: end)
        letters=0.0,  # fraction of rev / copy prompts in letters (the second language of language_weight)
        indexer_weight=1.0))  # the eq. (4) indexer KL during RL (detached inputs: the policy gradient is unchanged)

    # Agentic GRPO (stage "agent", train/agent_grpo.py): multi-turn rollouts in tool environments
    # (dsv32_jax/posttrain/envs),
    # cold-start SFT on their demonstrations, GRPO over trajectories; kl_weights: per environment domain
    # ("search", "code", "general"), default kl_weight; env_kwargs: per environment (its entry of envs).
    # envs: a comma-separated string or a list of registered names and import paths ("my_pkg.my_env:MyEnv";
    # docs/environments.md). codec: "tiny" (characters, 113 ids) or "bpe" (the shipped 1536-id BPE); a model
    # vocabulary larger than the codec's is masked when sampling, a smaller one is refused.
    c.agent = ml_collections.ConfigDict(dict(
        envs=ml_collections.FieldReference("lookup,calculator", field_type=object), codec="tiny", tasks_per_step=4,
        group_size=4, max_turns=4, max_new_tokens=64, capacity=2048, temperature=1.0, top_k=0, top_p=1.0,
        max_candidates=32, eps=0.2, delta=0.5, kl_weight=0.0, kl_weights=ml_collections.ConfigDict(),
        indexer_weight=1.0, epochs=1, minibatches=1, eval_every=10, eval_episodes=8, cold_start_steps=0,
        cold_start_batch=8, thinking=False, tools_prompt="full",
        # thinking retention (chat.encode): "after_user" (V3.2: reasoning dropped only before the last user
        # message), "every_turn" (R1: every earlier turn's reasoning dropped), "never"; rollouts, demonstrations and
        # evaluation alike
        drop_thinking="after_user",
        rl_lr=0.0,  # > 0: the GRPO steps' learning rate (config.optimizer.lr stays the recall / cold-start SFT's)
        # the last `anneal_steps` cold-start steps anneal to `anneal_lr` (0: config.optimizer.lr): SFT at a constant
        # high rate ends noisy, a low-rate tail settles it. `anneal_schedule`: "constant" (the tail at anneal_lr) or
        # "cosine" (from config.optimizer.lr down to anneal_lr over the tail: warmup-stable-decay)
        anneal_steps=0, anneal_lr=0.0, anneal_schedule="constant",
        # fraction of cold-start demonstrations that first make a near-miss call, get the tool's error and call again
        # (loss masked on the wrong call: the model learns to recover, not to err)
        recovery_fraction=0.0,
        # > 0: every evaluation also samples `eval_samples` episodes of each held-out task at `temperature` (the
        # policy GRPO optimizes; the paper's pass@1 averaged over samples): eval_sampled_reward / _success
        eval_samples=0,
        # every greedy evaluation also runs at each of these decode-cache sizes (and context budgets) beside
        # `capacity`: eval_success_cap{N}/{env}, eval_context_full_cap{N}/... (what a smaller context does to a
        # policy trained at `capacity`: e.g. thinking retention vs dropping under a tight budget)
        eval_capacities=(),
        init_perturb=0.0,  # the old name of config.init_perturb (moved there, with a warning: agent_grpo.legacy_perturb)
        env_kwargs=ml_collections.ConfigDict(),
        # recall stage before the cold start (dsv32_jax/posttrain/agent/recall.py: synthetic copying conversations, the tiny
        # model's stand-in for pre-training): `recall_steps` SFT steps of `recall_batch` examples of `recall_kinds`;
        # `recall_mix`: the fraction of every cold-start batch that stays copying data
        # ("induction": raw repeats of `recall_induction_len` single-character tokens, loss on all of the copy;
        # "span": up to `recall_span_items` marked spans (strings of 1-`recall_induction_len` characters, encoded by
        # the codec), each copied after its marker, with 0-`recall_span_gap` filler tokens before every marker)
        recall_steps=0, recall_batch=32, recall_kinds="repeat,recall,quote", recall_mix=0.0,
        recall_induction_len=24, recall_span_items=4, recall_span_gap=24,
        recall_chars="",  # the characters the raw kinds copy ("": recall.INDUCTION_CHARS, lookup's keys and values)
        # step 0's recall stage / cold start saves its progress every this many SFT updates (0: only at its end and
        # on a stop signal) in W/sft_checkpoints; a run killed during it continues from there
        sft_checkpoint_every=100,
        # the paper's reward terms beside the verifier's (train/agent_grpo.py reward_terms): length_target >= 0
        # subtracts length_penalty per model token beyond it in an episode; language_weight > 0 adds that times the
        # environment's language_consistency (an Env hook; the built-in environments have none)
        length_target=-1, length_penalty=0.001, language_weight=0.0))
    # Held-out evaluation (train/eval.py) every `every` steps and at the last step (0: off): metric eval_loss, the
    # next-token loss on `batches` fixed batches of the held-out split (built-in data: data.split='heldout'; other
    # sources: `paths`), with dense attention in the dense stage and DSA top-k attention otherwise. batch_size /
    # seq_len 0: the training data's.
    c.eval = ml_collections.ConfigDict(dict(every=0, batches=4, batch_size=0, seq_len=0, seed=0, paths=()))
    c.checkpoint = ml_collections.ConfigDict(dict(every=50, keep=3, use_async=True))
    c.log_every = 10
    # A jax.profiler trace of `steps` consecutive steps from step number `start` (1-based; steps 0: off) into `dir`
    # ("": <workdir>/profile), every stage alike: TensorBoard's profile plugin reads it (tensorboard --logdir=DIR),
    # Perfetto its plugins/profile/<run>/<host>.trace.json.gz. Step 1 of a run holds the compile: start at 2 or later.
    c.profile = ml_collections.ConfigDict(dict(start=2, steps=0, dir=""))
    # A config file or override sets only the fields above (a misspelled one, `c.optimizer.lrr = 5.0`, was a field
    # nothing read: the run went on with the default); the free-form dicts take any key.
    c.lock()
    for free in FREE_FORM:
        c[free].unlock()
    return c


# config fields that hold free-form dicts (keys chosen by the user, not by default_config)
FREE_FORM = ("model_overrides", "grpo.kl_weights", "agent.kl_weights", "agent.env_kwargs")


def check_batch_mesh(config, num_devices: int | None = None) -> dict[str, int]:
    """Validates config.data.batch_size / seq_len / config.microbatches against config.mesh before anything is
    built: the global batch is split over the batch mesh axes (data x fsdp x expert) and must divide evenly, and so
    must each of its config.microbatches microbatches; the sequence over the seq axis.
    Returns the mesh sizes. Raises ValueError naming both the batch and the mesh."""
    import jax

    from dsv32_jax.model import sharding as shd

    spec = config.mesh or "fsdp:-1"
    sizes = shd.parse_mesh_spec(spec)
    n = jax.device_count() if num_devices is None else num_devices
    auto = [a for a, v in sizes.items() if v == -1]
    if auto:
        known = 1
        for a, v in sizes.items():
            known *= 1 if v == -1 else v
        sizes[auto[0]] = max(n // known, 1)
    batch_axes = shd.DEFAULT_RULES["batch"]
    shards = 1
    for a in batch_axes:
        shards *= sizes[a]
    batch = config.data.batch_size
    split = " x ".join(f"{a}:{sizes[a]}" for a in batch_axes)
    if batch % shards:
        raise ValueError(
            f"config.data.batch_size={batch} cannot be split over the batch axes of config.mesh={spec!r} "
            f"({split} = {shards} shards): use a batch size that is a multiple of {shards}, or a mesh whose batch "
            f"axes multiply to a divisor of {batch} (put the other devices on tensor or seq)")
    micro = config.get("microbatches", 1)
    if not isinstance(micro, int) or micro < 1 or (batch // shards) % micro:
        raise ValueError(
            f"config.microbatches={micro!r} must be a positive integer that divides the {batch // shards} rows per "
            f"shard of config.data.batch_size={batch} over the batch axes of config.mesh={spec!r} ({split} = {shards} "
            "shards): every microbatch is split over the same shards (batch_size = a multiple of microbatches x "
            f"{shards})")
    seq_shards = sizes.get("seq", 1)
    if config.data.seq_len % seq_shards:
        raise ValueError(f"config.data.seq_len={config.data.seq_len} cannot be split over seq:{seq_shards} of "
                         f"config.mesh={spec!r}")
    ev = config.get("eval")
    if ev is not None and ev.get("every") and config.get("stage") in ("dense", "warmup", "sparse"):
        # the held-out batches take the same sharding (they failed at the first evaluation, in jit's IndivisibleError)
        for field, value, default, parts, axes in (("batch_size", ev.get("batch_size"), batch, shards, split),
                                                   ("seq_len", ev.get("seq_len"), config.data.seq_len, seq_shards,
                                                    f"seq:{seq_shards}")):
            if value and value % parts:
                raise ValueError(f"config.eval.{field}={value} cannot be split over {axes} of config.mesh={spec!r} "
                                 f"(= {parts} shards): use a multiple of {parts}, or 0 (the training data's {default})")
    return sizes


# The stage whose workdir each stage usually starts from (configs/<previous>_<size>.py).
PREVIOUS_STAGE = {"sparse": "warmup", "warmup": "dense"}
STAGE_NAMES = {"dense": "dense pre-training", "warmup": "dense warm-up", "sparse": "sparse training", "grpo": "GRPO",
               "agent": "agentic GRPO"}


class InitFromError(FileNotFoundError):
    """config.init_from names a path that does not exist (the message says what to run first)."""


def _previous_config(config, config_name: str | None) -> str | None:
    """configs/<previous stage>_<suffix>.py for this experiment (suffix from the config's name, else its model)."""
    prev = PREVIOUS_STAGE.get(config.stage)
    if prev is None:
        return None
    suffixes = []
    if config_name and config_name.startswith(f"{config.stage}_"):
        suffixes.append(config_name[len(config.stage) + 1:])
    suffixes.append(str(config.model))
    for suffix in suffixes:
        if os.path.isfile(os.path.join(CONFIGS_DIR, f"{prev}_{suffix}.py")):
            return f"configs/{prev}_{suffix}.py"
    return None


def check_init_from(config, config_name: str | None = None) -> None:
    """Raises InitFromError when config.init_from is set but missing, naming the path and what to run first."""
    init = config.init_from
    if init and os.path.exists(init) and not os.path.isdir(init):  # (its first read called it "not valid JSON")
        raise InitFromError(f"config.init_from={init!r}: a file, not a directory: give an HF checkpoint directory, a "
                            "converted orbax checkpoint or a training workdir")
    if not init or os.path.exists(init):
        return
    stage = config.stage
    msg = (f"config.init_from={init!r}: no such file or directory ({os.path.abspath(init)}). "
           f"The {STAGE_NAMES.get(stage, stage)} stage (config.stage={stage!r}) starts from ")
    prev = PREVIOUS_STAGE.get(stage)
    if prev is not None:
        previous = _previous_config(config, config_name)
        msg += f"the {STAGE_NAMES[prev]} stage's workdir: run that stage first, e.g.\n    " + (
            f"python -m dsv32_jax.train.main --config={previous} --workdir={init}" if previous else
            f"python -m dsv32_jax.train.main --config=<a config with stage={prev!r}> --workdir={init}")
    else:
        msg += ("an HF checkpoint directory, a converted orbax checkpoint (python -m dsv32_jax.checkpoint.convert hf-to-orbax) "
                "or a training workdir: create it first or fix the path")
    msg += "\nor pass --config.init_from='' to start from random initialization (config.seed)."
    raise InitFromError(msg)


def check_model_overrides(overrides) -> None:
    """Every key of config.model_overrides is a ModelConfig field (a misspelled key was a TypeError from deep in
    the model's constructor, naming neither the field nor the config)."""
    import dataclasses
    import difflib

    from dsv32_jax.model.config import ModelConfig

    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    for key in overrides:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            raise ValueError(f"config.model_overrides.{key}: not a model config field"
                             + (f" (did you mean {close[0]!r}?)" if close else "")
                             + "; the fields are those of config.json / dsv32_jax.ModelConfig")


def check_config(config) -> None:
    """Type and range checks of the fields a stage reads, before anything is built; each error names its field.
    (The stage, model, mesh, data, optimizer and sampling settings are checked where they are parsed.)"""
    import math

    import jax.numpy as jnp

    from dsv32_jax.posttrain.sampler import MIN_TEMPERATURE

    def get(field):
        node = config
        for part in field.split("."):
            node = node[part]
        return node

    def fail(field, want):
        raise ValueError(f"config.{field} must be {want}, got {get(field)!r}")

    def integer(field, lo):
        v = get(field)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            fail(field, f"an integer >= {lo}")

    def number(field, lo=0.0, *, above=False):
        v = get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or (above and v == lo):
            fail(field, f"a finite number {'>' if above else '>='} {lo}")

    from dsv32_jax.model import sharding as shd

    sizes = shd.parse_mesh_spec(config.get("mesh", "") or "fsdp:-1", flag=f"config.mesh={config.get('mesh', '')!r}")
    if sum(v == -1 for v in sizes.values()) > 1:
        fail("mesh", "at most one axis of size -1")
    from dsv32_jax.model.options import RunOptions

    try:  # the model's run options, under the names the config gives them
        RunOptions(**{f: config[f] for f in ("attention", "attn_chunk", "index_chunk", "remat", "kl_key_grad",
                                             "mla_bwd", "mla_fwd", "mla_pds", "mla_dqkv") if f in config})
    except ValueError as e:
        raise ValueError(str(e).replace("RunOptions.", "config.")) from None
    integer("steps", 0)  # (0: build and checkpoint nothing, e.g. to evaluate)
    if "init_perturb" in config:
        number("init_perturb")
    integer("log_every", 0)
    if "profile" in config:
        integer("profile.start", 1)
        integer("profile.steps", 0)
    for field in ("dtype", "param_dtype", "optimizer.master_dtype"):
        if field == "optimizer.master_dtype" and not config.optimizer.get("master_dtype", ""):
            continue
        try:
            ok = jnp.issubdtype(jnp.dtype(get(field)), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            fail(field, "a floating-point dtype name (float32, bfloat16)")
    check_model_overrides(dict(config.get("model_overrides") or {}))
    for field in ("indexer_weight", "mtp_weight", "balance_weight", "bias_update_speed"):
        if field in config.loss:
            number(f"loss.{field}")
    if "token_chunk" in config.loss:
        integer("loss.token_chunk", 0)
    from dsv32_jax.train.checkpointing import check_checkpoint_config

    check_checkpoint_config(config.checkpoint)
    if "eval" in config:
        integer("eval.every", 0)
        integer("eval.batches", 1)
        integer("eval.batch_size", 0)
        integer("eval.seq_len", 0)
        if "seed" in config.eval:  # (eval_data_config hands it to DataConfig, whose error named data.seed)
            integer("eval.seed", 0)
            if config.eval.seed >= 2**32:
                fail("eval.seed", "an integer in [0, 2**32)")
        if config.eval.seq_len == 1:
            fail("eval.seq_len", "0 (the data's) or >= 2")
        if config.eval.every and config.stage in ("dense", "warmup", "sparse"):
            from dsv32_jax.train.eval import eval_data_config

            eval_data_config(config.data.to_dict(), config.eval)  # its sources and paths, named
    for section in ("grpo", "agent"):
        if config.stage != section or section not in config:
            continue
        number(f"{section}.eps", above=True)
        number(f"{section}.delta")
        number(f"{section}.kl_weight")
        for key, value in dict(get(f"{section}.kl_weights") or {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"config.{section}.kl_weights.{key} must be a finite number >= 0, got {value!r}")
        number(f"{section}.temperature", above=True)
        if get(f"{section}.temperature") < MIN_TEMPERATURE:  # logits / T overflow float32 below it (NaN log-probs)
            fail(f"{section}.temperature", f">= {MIN_TEMPERATURE}")
        number(f"{section}.top_p", above=True)
        if get(f"{section}.top_p") > 1:
            fail(f"{section}.top_p", "in (0, 1]")
        integer(f"{section}.epochs", 1)
        integer(f"{section}.max_new_tokens", 1)
        integer(f"{section}.eval_every", 0)  # (-1 evaluated at every step: step % -1 == 0)
        if "indexer_weight" in config[section]:  # (a negative weight would push the indexer away from its target)
            number(f"{section}.indexer_weight")
    if config.stage == "grpo":
        if not [t for t in str(config.grpo.tasks).split(",") if t.strip()]:
            fail("grpo.tasks", "one or more comma-separated tasks (map, sum, rev, copy)")
        integer("grpo.prompts_per_step", 1)
        integer("grpo.length_target", -1)  # (-5 was "off", as -1 is, silently)
        number("grpo.language_weight")  # (a negative weight rewards switching languages)
        number("grpo.grm_weight")
    if config.stage == "agent":
        integer("agent.tasks_per_step", 1)
        from typing import get_args

        from dsv32_jax.posttrain.chat.tokens import ToolsPrompt

        if config.agent.tools_prompt not in get_args(ToolsPrompt):
            fail("agent.tools_prompt", " or ".join(map(repr, get_args(ToolsPrompt))))
        integer("agent.max_turns", 1)
        integer("agent.length_target", -1)
        number("agent.length_penalty")
        number("agent.language_weight")
        integer("agent.eval_episodes", 0)
        if "init_perturb" in config.agent:
            number("agent.init_perturb")
        caps = config.agent.get("eval_capacities", ())
        if isinstance(caps, (str, bytes)) or not isinstance(caps, (tuple, list)) or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in caps):
            fail("agent.eval_capacities", "a tuple of integers >= 1, e.g. (384,)")
        integer("agent.cold_start_steps", 0)
        integer("agent.sft_checkpoint_every", 0)
        integer("agent.recall_steps", 0)
    if config.stage in ("grpo", "agent"):
        check_post_training_fields(config)


# The sections only the LM stages (dense, warmup, sparse) read, and what the GRPO / agent stage uses instead.
LM_STAGE_FIELDS = {"data": {"grpo": "its prompts are config.grpo.tasks", "agent": "its tasks are config.agent.envs"},
                   "loss": {s: f"its losses are set in config.{s} (e.g. config.{s}.indexer_weight)"
                            for s in ("grpo", "agent")},
                   "eval": {s: f"it evaluates by sampling every config.{s}.eval_every steps" for s in ("grpo", "agent")}}


def check_post_training_fields(config) -> list[str]:
    """The GRPO and agent stages read neither `microbatches` nor the data, loss or eval sections. `microbatches` > 1
    is refused (it would have been dropped silently: the whole batch in one pass); a data / loss / eval field that
    differs from the default is logged as a warning naming it (a config file shared with an LM stage may set them).
    Returns the fields warned about."""
    from absl import logging

    stage = config.stage
    if config.get("microbatches", 1) != 1:
        raise ValueError(f"config.microbatches={config.microbatches!r}: gradient accumulation is for the LM stages; "
                         f"the {stage} stage splits its rollouts into optimizer steps by config.{stage}.minibatches")
    defaults, ignored = default_config(), []
    for section in LM_STAGE_FIELDS:
        if section in config:
            base = dict(_flat(defaults[section].to_dict(), section))
            ignored += [f for f, v in _flat(config[section].to_dict(), section) if base.get(f, _MISSING) != v]
    for section in dict.fromkeys(f.split(".")[0] for f in ignored):
        fields = ", ".join(f"config.{f}" for f in ignored if f.split(".")[0] == section)
        logging.warning("%s: not read by the %s stage (%s); ignored", fields, stage, LM_STAGE_FIELDS[section][stage])
    return ignored


_MISSING = object()


def _flat(tree: dict, prefix: str):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}.{key}")
        else:
            yield f"{prefix}.{key}", value
