"""Model configuration: every architecture field of DeepSeek-V3.2, read from and written to HF config.json."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any

_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "presets")  # package data


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool (an int subclass): what an integer field or argument takes."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class ConfigError(ValueError):
    """A config field is missing, malformed or inconsistent; the message names the field and the source."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DeepSeek-V3.2 model. Field names follow HF `config.json` (model_type deepseek_v32)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    # DSA lightning indexer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_rope_interleave: bool = False
    # MTP
    num_nextn_predict_layers: int = 1
    # norms, RoPE / YaRN
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "yarn"
    rope_factor: float = 40.0
    rope_original_max_position_embeddings: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = 1.0
    rope_mscale_all_dim: float | None = 1.0
    max_position_embeddings: int = 163840
    # misc
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    initializer_range: float = 0.02
    torch_dtype: str = "bfloat16"
    quantization_config: dict | None = dataclasses.field(default=None, hash=False, compare=False)

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Width of one cached MQA key row: [c_kv (kv_lora_rank) ; k_pe (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-1/2, times mscale^2 under YaRN (0.13523378 for the 671B config)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type == "yarn" and self.rope_mscale_all_dim:
            m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """Magnitude factor on cos/sin (HF's YaRN attention_factor; 1.0 for every DeepSeek config)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.rope_mscale and self.rope_mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.rope_mscale) / yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_factor)

    # --------------------------------------------------------------- validation
    def validate(self, source: str = "ModelConfig") -> None:
        def fail(field, msg):
            raise ConfigError(f"{source}: field '{field}' {msg}")

        for f in dataclasses.fields(self):  # types first: a null or a string fails here, by name
            value, kinds = getattr(self, f.name), _FIELD_KINDS.get(str(f.type))
            if kinds is not None and not any(_is_kind(value, k) for k in kinds):
                fail(f.name, f"must be {' or '.join(_KIND_NAMES[k] for k in kinds)}, got {value!r}")
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "index_n_heads", "index_head_dim", "moe_layer_freq", "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(name, f"must be a positive integer, got {value!r}")
        if self.scoring_func != "sigmoid":
            fail("scoring_func", f"must be 'sigmoid' (DeepSeek-V3/V3.2 router), got {self.scoring_func!r}")
        if self.topk_method != "noaux_tc":
            fail("topk_method", f"must be 'noaux_tc', got {self.topk_method!r}")
        if self.hidden_act != "silu":
            fail("hidden_act", f"must be 'silu', got {self.hidden_act!r}")
        if self.rope_type not in ("yarn", "default"):
            fail("rope_scaling.type", f"must be 'yarn' or absent (default RoPE), got {self.rope_type!r}")
        if self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", f"must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            fail("index_head_dim", f"({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim})")
        if not isinstance(self.index_topk, int) or self.index_topk < 1:
            fail("index_topk", f"must be an integer >= 1, got {self.index_topk!r}")
        if self.num_nextn_predict_layers < 0:
            fail("num_nextn_predict_layers", f"must be >= 0, got {self.num_nextn_predict_layers}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            fail("first_k_dense_replace", f"must be in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.has_moe:
            for name in ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size"):
                if getattr(self, name) < 1:
                    fail(name, f"must be >= 1 when the model has MoE layers, got {getattr(self, name)}")
            if self.n_routed_experts % self.n_group:
                fail("n_routed_experts", f"({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
            if self.topk_group > self.n_group:
                fail("topk_group", f"({self.topk_group}) must be <= n_group ({self.n_group})")
            per_group = self.n_routed_experts // self.n_group
            if per_group < 2 and self.n_group > 1:
                fail("n_group", f"leaves {per_group} expert per group; group scores sum the top-2 of each group")
            if self.num_experts_per_tok > self.topk_group * per_group:
                fail("num_experts_per_tok", f"({self.num_experts_per_tok}) exceeds the experts in topk_group groups "
                     f"({self.topk_group}x{per_group})")
        if self.tie_word_embeddings:
            fail("tie_word_embeddings", "must be false: DeepSeek-V3.2 has an untied lm_head")
        if self.attention_bias:
            fail("attention_bias", "must be false: DeepSeek-V3.2's attention projections have no bias")
        if not self.rms_norm_eps > 0:
            fail("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        if self.n_shared_experts < 0:  # (a negative count failed in MLIR: "invalid tensor dimension size")
            fail("n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        if not 0 < self.rope_theta < math.inf:  # (0 or less: a math domain error in the RoPE tables)
            fail("rope_theta", f"must be a finite number > 0, got {self.rope_theta}")
        if self.rope_type == "yarn":  # (as HF transformers' yarn checks: factor 0 gave NaN logits, silently)
            if not 1 <= self.rope_factor < math.inf:
                fail("rope_scaling.factor", f"must be a finite number >= 1 for yarn, got {self.rope_factor}")
            for name, key in (("rope_beta_fast", "beta_fast"), ("rope_beta_slow", "beta_slow")):
                if not 0 < getattr(self, name) < math.inf:
                    fail(f"rope_scaling.{key}", f"must be a finite number > 0, got {getattr(self, name)}")
            if self.rope_original_max_position_embeddings < 1:
                fail("rope_scaling.original_max_position_embeddings",
                     f"must be >= 1, got {self.rope_original_max_position_embeddings}")

    @property
    def has_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    # ----------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> "ModelConfig":
        """Builds a config from an HF config.json (file, checkpoint directory, or dict).

        Accepts `rope_scaling` as on the hub and `rope_parameters` as transformers 5 writes it.
        """
        if isinstance(path_or_dict, dict):
            raw, source = dict(path_or_dict), "config dict"
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            source = path
            try:
                with open(path) as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"{source}: no such file (expected an HF config.json)") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{source}: not valid JSON ({e})") from None
            except (UnicodeDecodeError, OSError) as e:  # (not UTF-8 text; a directory or unreadable file)
                raise ConfigError(f"{source}: cannot be read as a JSON text file ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: not a JSON object (a JSON {type(raw).__name__}; expected an HF config.json)")
        model_type = raw.get("model_type", "deepseek_v32")
        if model_type not in ("deepseek_v32", "deepseek_v3"):
            raise ConfigError(f"{source}: field 'model_type' is {model_type!r}; expected 'deepseek_v32' or 'deepseek_v3'")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in fields}
        try:
            kwargs.update(_rope_fields(raw, source))
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{source}: field 'rope_scaling' (or 'rope_theta') holds a value that is not a number "
                              f"({e})") from None
        if "n_routed_experts" not in raw and "num_experts" in raw:
            kwargs["n_routed_experts"] = raw["num_experts"]
        if "torch_dtype" not in raw and isinstance(raw.get("dtype"), str):  # (transformers 5 renamed it "dtype")
            kwargs["torch_dtype"] = raw["dtype"]
        if raw.get("q_lora_rank", 1) is None:
            raise ConfigError(f"{source}: field 'q_lora_rank' is null; DeepSeek-V3.2 requires a query LoRA (the indexer reads it)")
        try:
            cfg = cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(str(e).replace("ModelConfig", source, 1)) from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None
        layer_types = raw.get("mlp_layer_types")
        if layer_types is not None:
            ours = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)]
            if list(layer_types) != ours:
                raise ConfigError(f"{source}: field 'mlp_layer_types' {layer_types} disagrees with "
                                  f"first_k_dense_replace={cfg.first_k_dense_replace} / moe_layer_freq={cfg.moe_layer_freq}")
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """HF config.json dict (hub layout: `rope_scaling`), readable by transformers and by `from_hf`."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV32ForCausalLM"],
            "model_type": "deepseek_v32",
        }
        rope_keys = {f.name for f in dataclasses.fields(self) if f.name.startswith("rope_") and f.name != "rope_theta"}
        for f in dataclasses.fields(self):
            if f.name in rope_keys or (f.name == "quantization_config" and self.quantization_config is None):
                continue
            out[f.name] = getattr(self, f.name)
        out["num_key_value_heads"] = self.num_attention_heads
        if self.rope_type == "yarn":
            out["rope_scaling"] = {
                "type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.rope_original_max_position_embeddings,
                "beta_fast": self.rope_beta_fast,
                "beta_slow": self.rope_beta_slow,
                "mscale": self.rope_mscale,
                "mscale_all_dim": self.rope_mscale_all_dim,
            }
        else:
            out["rope_scaling"] = None
        return out

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# the annotation of each field -> the kinds of value it takes (validate's type check)
_FIELD_KINDS = {"int": ("int",), "float": ("float",), "bool": ("bool",), "str": ("str",),
                "float | None": ("float", "none"), "int | None": ("int", "none")}
_KIND_NAMES = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string",
               "none": "null"}


def _is_kind(value, kind: str) -> bool:
    if kind == "none":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, str)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_fields(raw: dict, source: str) -> dict[str, Any]:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    out: dict[str, Any] = {}
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object, got {type(rope).__name__}")
    rope = rope or {}
    if "rope_theta" in rope:
        out["rope_theta"] = float(rope["rope_theta"])
    elif "rope_theta" in raw:
        out["rope_theta"] = float(raw["rope_theta"])
    if rope and "rope_type" not in rope and "type" not in rope and set(rope) - {"rope_theta"}:
        raise ConfigError(f"{source}: field 'rope_scaling' has no 'type' (e.g. \"type\": \"yarn\"): read as plain "
                          f"RoPE, its {sorted(set(rope) - {'rope_theta'})} would be dropped")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out["rope_type"] = rope_type
    if rope_type == "yarn":
        if "factor" not in rope or "original_max_position_embeddings" not in rope:
            raise ConfigError(f"{source}: field 'rope_scaling' of type yarn needs 'factor' and "
                              "'original_max_position_embeddings'")
        out["rope_factor"] = float(rope["factor"])
        out["rope_original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
        out["rope_beta_fast"] = float(rope.get("beta_fast", 32.0))
        out["rope_beta_slow"] = float(rope.get("beta_slow", 1.0))
        out["rope_mscale"] = rope.get("mscale")
        out["rope_mscale_all_dim"] = rope.get("mscale_all_dim")
    return out


def preset_path(name: str) -> str:
    return os.path.join(_CONFIG_DIR, f"{name}.json")


def load_preset(name: str) -> ModelConfig:
    """A model preset shipped under dsv32_jax/presets/ ('tiny', 'small', 'deepseek_v32_671b') or a config.json path."""
    path = name if (os.sep in name or name.endswith(".json")) else preset_path(name)
    if not os.path.exists(path):
        available = sorted(p[:-5] for p in os.listdir(_CONFIG_DIR) if p.endswith(".json"))
        raise ConfigError(f"model preset {name!r} not found at {path}; available presets: {available}")
    return ModelConfig.from_hf(path)
