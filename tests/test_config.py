import json

import numpy as np

import pytest
from flax import nnx

from dsv32_jax import ConfigError, ModelConfig, Transformer, load_preset
from dsv32_jax.model.config import preset_path

PRESETS = ["tiny", "small", "deepseek_v32_671b"]


def official_raw():
    with open(preset_path("deepseek_v32_671b")) as f:
        return json.load(f)


def test_671b_preset_has_official_values():
    cfg = load_preset("deepseek_v32_671b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (7168, 61, 128)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (256, 8, 8, 4)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)
    assert cfg.first_k_dense_replace == 3 and cfg.routed_scaling_factor == 2.5
    assert cfg.rope_type == "yarn" and cfg.rope_factor == 40 and cfg.rope_original_max_position_embeddings == 4096
    assert cfg.quantization_config["weight_block_size"] == [128, 128]


def test_rope_parameters_as_transformers5_writes_them():
    raw = official_raw()
    rope = raw.pop("rope_scaling")
    raw["rope_parameters"] = {"rope_type": rope["type"], "rope_theta": 10000.0,
                              **{k: v for k, v in rope.items() if k != "type"}}
    raw.pop("rope_theta", None)
    assert ModelConfig.from_hf(raw) == load_preset("deepseek_v32_671b")


@pytest.mark.parametrize("name", PRESETS)
def test_to_hf_round_trip(name, tmp_path):
    cfg = load_preset(name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_hf()))
    again = ModelConfig.from_hf(str(tmp_path))
    assert again == cfg
    assert again.quantization_config == cfg.quantization_config


@pytest.mark.parametrize("name", PRESETS)
def test_presets_build_abstractly(name):
    cfg = load_preset(name)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    assert len(model.layers) == cfg.num_hidden_layers
    assert len(model.mtp) == cfg.num_nextn_predict_layers


def test_tiny_preset_exercises_every_feature():
    cfg = load_preset("tiny")
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert cfg.first_k_dense_replace >= 1 and len(moe_layers) >= 2
    assert cfg.n_group >= 2 and cfg.index_topk < 64


@pytest.mark.parametrize("field,value,needle", [
    ("scoring_func", "softmax", "scoring_func"),
    ("n_routed_experts", 10, "divisible by n_group"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("index_topk", 0, "index_topk"),
    ("topk_group", 9, "topk_group"),
    ("num_attention_heads", 0, "num_attention_heads"),
    ("hidden_act", "gelu", "hidden_act"),
    # types checked by name (a null or a float failed later, in a forward, or with a message naming no field)
    ("rms_norm_eps", None, r"field 'rms_norm_eps' must be a finite number, got None"),
    ("routed_scaling_factor", None, r"field 'routed_scaling_factor' must be a finite number, got None"),
    ("n_routed_experts", None, r"field 'n_routed_experts' must be an integer, got None"),
    ("n_group", 4.0, r"field 'n_group' must be an integer, got 4.0"),
    ("norm_topk_prob", "yes", r"field 'norm_topk_prob' must be true or false"),
    ("rope_theta", None, r"field 'rope_scaling' \(or 'rope_theta'\) holds a value that is not a number"),
    ("attention_bias", True, r"field 'attention_bias' must be false"),
])
def test_validation_names_the_field(field, value, needle):
    raw = official_raw()
    raw[field] = value
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf(raw)


def test_rope_scaling_without_a_type_is_refused():
    """A rope_scaling object with YaRN's fields but no "type" was read as plain RoPE: YaRN and the m^2 softmax
    factor silently dropped (the 671B softmax scale 0.0722 instead of 0.1352)."""
    raw = official_raw()
    raw["rope_scaling"] = {k: v for k, v in raw["rope_scaling"].items() if k not in ("type", "rope_type")}
    with pytest.raises(ConfigError, match=r"field 'rope_scaling' has no 'type'"):
        ModelConfig.from_hf(raw)
    raw["rope_scaling"]["factor"] = "x"
    raw["rope_scaling"]["type"] = "yarn"
    with pytest.raises(ConfigError, match=r"field 'rope_scaling' .* not a number"):
        ModelConfig.from_hf(raw)


def test_error_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    raw = official_raw()
    raw["scoring_func"] = "softmax"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=str(path)):
        ModelConfig.from_hf(str(path))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(str(path))
    path.write_text("[1]")  # (raw.get raised AttributeError)
    with pytest.raises(ConfigError, match=rf"{path}: not a JSON object \(a JSON list"):
        ModelConfig.from_hf(str(path))
    path.write_bytes(b"\xff\xfe\x00garbage")  # (the UnicodeDecodeError did not name the file)
    with pytest.raises(ConfigError, match=rf"{path}: cannot be read as a JSON text file \('utf-8' codec"):
        ModelConfig.from_hf(str(path))
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_hf(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="available presets"):
        load_preset("nope")


def test_mlp_layer_types_must_agree():
    raw = official_raw()
    raw["mlp_layer_types"] = ["dense"] * 3 + ["sparse"] * 58
    assert ModelConfig.from_hf(raw).first_k_dense_replace == 3
    raw["mlp_layer_types"] = ["dense"] * 4 + ["sparse"] * 57
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        ModelConfig.from_hf(raw)


def test_batch_and_mesh_are_validated_at_config_time():
    from dsv32_jax.train.config import base_config, check_batch_mesh

    for name, devices in (("warmup_671b", 2048), ("sparse_671b", 2048)):
        c = base_config(name)
        sizes = check_batch_mesh(c, num_devices=devices)
        assert np.prod(list(sizes.values())) == devices, (name, sizes)
    c = base_config("warmup_671b")
    c.mesh = "data:4,fsdp:32,expert:16"  # the former recipe: 2048 batch shards for 16 sequences
    with pytest.raises(ValueError, match=r"config.data.batch_size=16 .*config.mesh='data:4,fsdp:32,expert:16' "
                                         r"\(data:4 x fsdp:32 x expert:16 = 2048 shards\)"):
        check_batch_mesh(c, num_devices=2048)
    c.mesh = "fsdp:16,seq:3"
    with pytest.raises(ValueError, match=r"config.data.seq_len=131072 cannot be split over seq:3"):
        check_batch_mesh(c, num_devices=48)
    c.mesh = "fsdp:-1"
    c.data.batch_size = 6
    with pytest.raises(ValueError, match=r"batch_size=6 .* fsdp:4 .* = 4 shards"):
        check_batch_mesh(c, num_devices=4)
    # the held-out batches take the same sharding: they failed at the first evaluation (jit's IndivisibleError)
    c = base_config("sparse_tiny")
    c.mesh, c.data.batch_size, c.data.seq_len, c.eval.every = "fsdp:2,seq:2", 4, 32, 10
    check_batch_mesh(c, num_devices=4)
    for field, value, needle in (("batch_size", 5, r"data:1 x fsdp:2 x expert:1 .*\(= 2 shards\): use a multiple of 2, or 0 \(the "
                                                   r"training data's 4\)"),
                                 ("seq_len", 31, r"seq:2 .*\(= 2 shards\): use a multiple of 2, or 0 \(the training "
                                                 r"data's 32\)")):
        c.eval[field] = value
        with pytest.raises(ValueError, match=rf"config.eval.{field}={value} cannot be split over {needle}"):
            check_batch_mesh(c, num_devices=4)
        c.eval.every = 0  # no evaluation: not checked
        check_batch_mesh(c, num_devices=4)
        c.eval.every, c.eval[field] = 10, 0


def test_trainer_checks_batch_and_mesh_before_building_anything(tmp_path):
    from dsv32_jax.train.config import base_config
    from dsv32_jax.train.trainer import Trainer

    c = base_config("dense_tiny")
    c.mesh, c.data.batch_size = "fsdp:2", 3  # checked before the mesh is made (1 CPU device here)
    with pytest.raises(ValueError, match=r"config.data.batch_size=3 .*config.mesh='fsdp:2'"):
        Trainer(c, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def _training_config(stage, **fields):
    from dsv32_jax.train.config import default_config
    from tests.test_train import override

    return override(default_config(), stage=stage, **fields)


@pytest.mark.parametrize("stage,field,value,needle", [
    ("sparse", "steps", -5, r"config\.steps must be an integer >= 0"),
    ("sparse", "mesh", "fsdp2", r"config\.mesh='fsdp2': bad entry 'fsdp2'"),
    ("sparse", "attention", "sprase", r"config\.attention must be one of .*got 'sprase'"),
    ("sparse", "log_every", -1, r"config\.log_every must be an integer >= 0"),
    ("sparse", "profile.start", 0, r"config\.profile\.start must be an integer >= 1"),
    ("sparse", "profile.steps", -1, r"config\.profile\.steps must be an integer >= 0"),
    ("sparse", "dtype", "bfloat61", r"config\.dtype must be a floating-point dtype name"),
    ("sparse", "param_dtype", "int32", r"config\.param_dtype must be a floating-point dtype name"),
    ("sparse", "optimizer.master_dtype", "fp32", r"config\.optimizer\.master_dtype must be a floating-point"),
    ("sparse", "model_overrides", {"index_top_k": 8}, r"config\.model_overrides\.index_top_k: not a model config "
                                                      r"field \(did you mean 'index_topk'\?\)"),
    ("sparse", "loss.mtp_weight", -1.0, r"config\.loss\.mtp_weight must be a finite number >= 0"),
    ("sparse", "loss.indexer_weight", float("nan"), r"config\.loss\.indexer_weight must be a finite number"),
    ("sparse", "loss.token_chunk", -4, r"config\.loss\.token_chunk must be an integer >= 0"),
    ("sparse", "checkpoint.every", 0, r"config\.checkpoint\.every must be an integer >= 1"),
    ("sparse", "eval.batches", 0, r"config\.eval\.batches must be an integer >= 1"),
    ("sparse", "eval.every", -1, r"config\.eval\.every must be an integer >= 0"),
    ("sparse", "eval.batch_size", -1, r"config\.eval\.batch_size must be an integer >= 0"),
    ("sparse", "eval.seed", -1, r"config\.eval\.seed must be an integer >= 0, got -1"),  # (named data.seed)
    ("sparse", "eval.seed", 2**32, r"config\.eval\.seed must be an integer in \[0, 2\*\*32\)"),
    ("grpo", "grpo.eps", -0.2, r"config\.grpo\.eps must be a finite number > 0"),
    ("grpo", "grpo.delta", -1.0, r"config\.grpo\.delta must be a finite number >= 0"),
    ("grpo", "grpo.kl_weight", -0.1, r"config\.grpo\.kl_weight must be a finite number >= 0"),
    ("grpo", "grpo.tasks", ",", r"config\.grpo\.tasks must be one or more comma-separated tasks"),
    ("grpo", "grpo.top_p", 0.0, r"config\.grpo\.top_p must be a finite number > 0"),
    ("grpo", "grpo.temperature", float("inf"), r"config\.grpo\.temperature must be a finite number > 0"),
    ("grpo", "grpo.temperature", 1e-37, r"config\.grpo\.temperature must be >= 1e-06, got 1e-37"),
    ("agent", "agent.max_turns", 0, r"config\.agent\.max_turns must be an integer >= 1"),
    ("agent", "agent.top_p", 1.5, r"config\.agent\.top_p must be in \(0, 1\]"),
    ("grpo", "grpo.prompts_per_step", 0, r"config\.grpo\.prompts_per_step must be an integer >= 1"),
    ("grpo", "grpo.indexer_weight", -1.0, r"config\.grpo\.indexer_weight must be a finite number >= 0"),
    ("agent", "agent.tasks_per_step", 0, r"config\.agent\.tasks_per_step must be an integer >= 1"),
    ("agent", "agent.indexer_weight", -1.0, r"config\.agent\.indexer_weight must be a finite number >= 0"),
    ("agent", "agent.tools_prompt", "bad", r"config\.agent\.tools_prompt must be 'full' or 'compact', got 'bad'"),
    # (red-team audit: these four ran, the evaluation at every step, the reward's sign flipped, the penalty off)
    ("grpo", "grpo.eval_every", -1, r"config\.grpo\.eval_every must be an integer >= 0, got -1"),
    ("agent", "agent.eval_every", -1, r"config\.agent\.eval_every must be an integer >= 0, got -1"),
    ("grpo", "grpo.language_weight", -1.0, r"config\.grpo\.language_weight must be a finite number >= 0"),
    ("grpo", "grpo.grm_weight", -0.5, r"config\.grpo\.grm_weight must be a finite number >= 0"),
    ("grpo", "grpo.length_target", -5, r"config\.grpo\.length_target must be an integer >= -1, got -5"),
])
def test_training_config_checks_name_the_field(stage, field, value, needle):
    """Each of these was accepted (a negative weight or clip range silently inverts its loss; eval.batches 0
    logged a fake eval_loss of 0) or failed deep inside jax / numpy / the first evaluation step without naming it
    (prompts_per_step / tasks_per_step 0: a zero-size reduction in the first rollout)."""
    from dsv32_jax.train.config import check_config

    check_config(_training_config(stage))  # the defaults pass
    with pytest.raises(ValueError, match=needle):
        check_config(_training_config(stage, **{field: value}))


@pytest.mark.parametrize("stage", ["grpo", "agent"])
def test_a_temperature_of_exactly_the_named_minimum_is_accepted(stage):
    """The refusal says ">= 1e-06": 1e-06 itself is a temperature the stages take."""
    from dsv32_jax.train.config import check_config

    check_config(_training_config(stage, **{f"{stage}.temperature": 1e-6}))


@pytest.mark.parametrize("stage", ["grpo", "agent"])
def test_post_training_stages_refuse_microbatches_and_name_the_lm_fields_they_ignore(stage, caplog):
    """The GRPO and agent stages read neither config.microbatches nor the data / loss / eval sections, and dropped
    them silently (a microbatches=4 run went out of memory on its whole batch). Now microbatches > 1 is refused by
    name, and the LM-only fields a config sets are logged as ignored, each named; the shipped GRPO / agent configs
    set none of them (no warning). The LM stages accept the same fields."""
    from dsv32_jax.train.config import base_config, check_config, check_post_training_fields

    check_config(_training_config("sparse", microbatches=2, **{"data.seq_len": 64}))
    with pytest.raises(ValueError, match=rf"config\.microbatches=2: .* config\.{stage}\.minibatches"):
        check_config(_training_config(stage, microbatches=2))
    c = _training_config(stage, **{"data.seq_len": 64, "data.paths": ("a.jsonl",), "loss.mtp_weight": 0.3,
                                   "eval.every": 5, "data.shuffle": True})
    with caplog.at_level("WARNING", logger="absl"):
        assert check_post_training_fields(c) == ["data.paths", "data.seq_len", "loss.mtp_weight", "eval.every"]
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"config.data.paths, config.data.seq_len: not read by the {stage} stage" in said, said
    assert "config.loss.mtp_weight" in said and "config.eval.every" in said and "shuffle" not in said
    for name in ("grpo_tiny", "grpo_small", "agent_tiny", "agent_lookup", "agent_trip", "agent_calculator"):
        assert check_post_training_fields(base_config(name)) == [], name


def test_eval_sources_are_checked_before_the_first_step():
    """A file data source without config.eval.paths failed at the first evaluation (step 50 of dense_tiny), after
    training."""
    from dsv32_jax.train.config import check_config

    c = _training_config("dense", **{"eval.every": 10, "data.source": "jsonl", "data.paths": ("a.jsonl",)})
    with pytest.raises(ValueError, match=r"config\.eval\.paths: held-out files are needed"):
        check_config(c)
    c.eval.every = 0
    check_config(c)


@pytest.mark.parametrize("field,value,needle", [
    ("lr", -0.1, r"config\.optimizer\.lr must be >= 0"),
    ("lr", float("nan"), r"config\.optimizer\.lr must be a finite number"),
    ("grad_clip", -1.0, r"config\.optimizer\.grad_clip must be >= 0"),
    ("eps", 0.0, r"config\.optimizer\.eps must be > 0"),
    ("weight_decay", -5.0, r"config\.optimizer\.weight_decay must be >= 0"),
    ("b1", 1.5, r"config\.optimizer\.b1 must be in \[0, 1\)"),
    ("final_lr_fraction", 5.0, r"config\.optimizer\.final_lr_fraction must be in \[0, 1\]"),
    ("decay_steps", 1, r"need warmup_steps <= decay_steps"),
    ("warmup_steps", -1, r"config\.optimizer\.warmup_steps must be an integer >= 0"),
])
def test_optimizer_settings_that_invert_or_break_the_update_are_refused(field, value, needle):
    """A negative lr, grad_clip, eps or weight_decay each turned AdamW's step into ascent; lr nan trained NaNs and
    checkpointed them; decay_steps < warmup_steps was silently replaced. The indexer group's override is named."""
    from dsv32_jax.train.config import default_config
    from dsv32_jax.train.optimizer import make_tx

    opt = default_config().optimizer
    make_tx(opt)
    opt[field] = value
    with pytest.raises(ValueError, match=needle):
        make_tx(opt)
    opt = default_config().optimizer
    opt.indexer[field] = value
    with pytest.raises(ValueError, match=r"config\.optimizer\.indexer \(its own fields over config\.optimizer's"):
        make_tx(opt)
