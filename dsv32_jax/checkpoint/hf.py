"""HF checkpoint layout <-> Flax parameter tree. One table (`tensor_specs`) drives loading and export.

HF stores Linear weights [out, in]; our kernels are [in, out]. Routed experts are separate HF tensors
(`mlp.experts.{e}.gate_proj.weight`) stacked per layer here ([E, D, I]) for the dropless MoE. The MTP
module is checkpoint layer `num_hidden_layers + j`; its `embed_tokens` / `shared_head.head` are copies of
the main embedding / LM head (aliases: shared here, written back as copies on export).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv32_jax.model.config import ModelConfig
from dsv32_jax.model.fp8 import SCALE_SUFFIX, WEIGHT_BLOCK
from dsv32_jax.checkpoint.fp8_weights import dequant_fp8
from dsv32_jax.checkpoint.safetensors_io import CheckpointError, HFCheckpoint, check_alias, check_finite, check_scale_values



@dataclasses.dataclass(frozen=True)
class TensorSpec:
    path: tuple  # path of the parameter in the nnx state, e.g. ("layers", 3, "attn", "q_a_proj", "kernel")
    hf_names: tuple[str, ...]  # one HF tensor, or one per expert (stacked along axis 0)
    hf_shape: tuple[int, ...]  # shape of each HF tensor
    transpose: bool = False  # HF [out, in] -> kernel [in, out]
    quantized: bool = False  # F8_E4M3 with 128x128 weight_scale_inv blocks in the official checkpoint
    alias: bool = False  # an extra HF copy of a shared parameter (MTP embed / head)
    hf_dtype: str = "BF16"  # dtype in the official checkpoint (non-quantized tensors)


def _linear(path, name, d_in, d_out, quantized=True, hf_dtype="BF16"):
    return TensorSpec(tuple(path) + ("kernel",), (name,), (d_out, d_in), transpose=True, quantized=quantized,
                      hf_dtype=hf_dtype)


def _vector(path, name, dim, hf_dtype="BF16"):
    return TensorSpec(tuple(path), (name,), (dim,), hf_dtype=hf_dtype)


def _mlp_specs(path, prefix, d_model, d_ff):
    return [
        _linear(path + ("gate_proj",), f"{prefix}.gate_proj.weight", d_model, d_ff),
        _linear(path + ("up_proj",), f"{prefix}.up_proj.weight", d_model, d_ff),
        _linear(path + ("down_proj",), f"{prefix}.down_proj.weight", d_ff, d_model),
    ]


def _block_specs(cfg: ModelConfig, path: tuple, layer: int) -> list[TensorSpec]:
    p = f"model.layers.{layer}"
    a = path + ("attn",)
    d, h = cfg.hidden_size, cfg.num_attention_heads
    specs = [
        _vector(path + ("attn_norm", "scale"), f"{p}.input_layernorm.weight", d),
        _vector(path + ("ffn_norm", "scale"), f"{p}.post_attention_layernorm.weight", d),
        _linear(a + ("q_a_proj",), f"{p}.self_attn.q_a_proj.weight", d, cfg.q_lora_rank),
        _vector(a + ("q_a_norm", "scale"), f"{p}.self_attn.q_a_layernorm.weight", cfg.q_lora_rank),
        _linear(a + ("q_b_proj",), f"{p}.self_attn.q_b_proj.weight", cfg.q_lora_rank, h * cfg.qk_head_dim),
        _linear(a + ("kv_a_proj",), f"{p}.self_attn.kv_a_proj_with_mqa.weight", d, cfg.kv_latent_dim),
        _vector(a + ("kv_a_norm", "scale"), f"{p}.self_attn.kv_a_layernorm.weight", cfg.kv_lora_rank),
        _linear(a + ("kv_b_proj",), f"{p}.self_attn.kv_b_proj.weight", cfg.kv_lora_rank,
                h * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
        _linear(a + ("o_proj",), f"{p}.self_attn.o_proj.weight", h * cfg.v_head_dim, d),
        _linear(a + ("indexer", "wq_b"), f"{p}.self_attn.indexer.wq_b.weight", cfg.q_lora_rank,
                cfg.index_n_heads * cfg.index_head_dim),
        _linear(a + ("indexer", "wk"), f"{p}.self_attn.indexer.wk.weight", d, cfg.index_head_dim),
        _vector(a + ("indexer", "k_norm", "scale"), f"{p}.self_attn.indexer.k_norm.weight", cfg.index_head_dim),
        _vector(a + ("indexer", "k_norm", "bias"), f"{p}.self_attn.indexer.k_norm.bias", cfg.index_head_dim),
        _linear(a + ("indexer", "weights_proj"), f"{p}.self_attn.indexer.weights_proj.weight", d, cfg.index_n_heads,
                quantized=False),
    ]
    f = path + ("ffn",)
    if not cfg.is_moe_layer(layer):
        return specs + _mlp_specs(f, f"{p}.mlp", d, cfg.intermediate_size)
    e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    experts = [f"{p}.mlp.experts.{j}" for j in range(e)]
    specs += [
        TensorSpec(f + ("router",), (f"{p}.mlp.gate.weight",), (e, d), transpose=True),
        _vector(f + ("bias",), f"{p}.mlp.gate.e_score_correction_bias", e, hf_dtype="F32"),
        TensorSpec(f + ("experts", "w_gate"), tuple(f"{x}.gate_proj.weight" for x in experts), (i, d), True, True),
        TensorSpec(f + ("experts", "w_up"), tuple(f"{x}.up_proj.weight" for x in experts), (i, d), True, True),
        TensorSpec(f + ("experts", "w_down"), tuple(f"{x}.down_proj.weight" for x in experts), (d, i), True, True),
    ]
    if cfg.n_shared_experts:
        specs += _mlp_specs(f + ("shared",), f"{p}.mlp.shared_experts", d, cfg.n_shared_experts * i)
    return specs


def is_indexer_spec(spec: "TensorSpec") -> bool:
    return "indexer" in spec.path


def tensor_specs(cfg: ModelConfig, include_mtp: bool = True, include_indexer: bool = True) -> list[TensorSpec]:
    """Every parameter of `Transformer(cfg)` with its HF tensor(s); MTP layers when include_mtp; the lightning
    indexers' unless include_indexer is False (a DeepSeek-V3 checkpoint has none: they start fresh)."""
    if not include_indexer:
        return [s for s in tensor_specs(cfg, include_mtp) if not is_indexer_spec(s)]
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [
        TensorSpec(("embed",), ("model.embed_tokens.weight",), (v, d)),
        _vector(("norm", "scale"), "model.norm.weight", d),
        TensorSpec(("lm_head", "kernel"), ("lm_head.weight",), (v, d), transpose=True),
    ]
    for layer in range(cfg.num_hidden_layers):
        specs += _block_specs(cfg, ("layers", layer), layer)
    for j in range(cfg.num_nextn_predict_layers if include_mtp else 0):
        layer = cfg.num_hidden_layers + j
        p, path = f"model.layers.{layer}", ("mtp", j)
        specs += [
            _vector(path + ("enorm", "scale"), f"{p}.enorm.weight", d),
            _vector(path + ("hnorm", "scale"), f"{p}.hnorm.weight", d),
            _linear(path + ("eh_proj",), f"{p}.eh_proj.weight", 2 * d, d, quantized=False),
            _vector(path + ("norm", "scale"), f"{p}.shared_head.norm.weight", d),
            TensorSpec(("embed",), (f"{p}.embed_tokens.weight",), (v, d), alias=True),
            TensorSpec(("lm_head", "kernel"), (f"{p}.shared_head.head.weight",), (v, d), transpose=True, alias=True),
        ]
        specs += _block_specs(cfg, path + ("block",), layer)
    return specs


def hf_inventory(cfg: ModelConfig, include_mtp: bool = True, fp8: bool = True) -> Iterator[tuple[str, tuple, str]]:
    """(name, shape, dtype) of every tensor of the official on-disk layout, weight_scale_inv included when fp8."""
    for spec in tensor_specs(cfg, include_mtp):
        for name in spec.hf_names:
            if spec.quantized and fp8:
                yield name, spec.hf_shape, "F8_E4M3"
                yield name[: -len(".weight")] + ".weight" + SCALE_SUFFIX, tuple(-(-n // WEIGHT_BLOCK) for n in spec.hf_shape), "F32"
            else:
                yield name, spec.hf_shape, spec.hf_dtype


def read_hf_tensor(ckpt: HFCheckpoint, name: str, shape: tuple) -> np.ndarray:
    """One HF tensor as float32 numpy, FP8 dequantized with its weight_scale_inv, shape-checked."""
    if name not in ckpt:
        raise CheckpointError(f"{ckpt.directory}: missing tensor '{name}' (expected shape {list(shape)})")
    arr = ckpt.get(name)
    where = f"{ckpt.where(name)}: tensor '{name}'"
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"{where} has shape {list(arr.shape)}, expected {list(shape)} from config.json")
    kind = ckpt.location[name].dtype_name(name)
    if kind == "F8_E4M3":
        scale_name = name + SCALE_SUFFIX
        if scale_name not in ckpt:
            raise CheckpointError(f"{where} is F8_E4M3 but its scale '{scale_name}' is missing")

        scale = np.asarray(ckpt.get(scale_name), np.float32)
        check_scale_values(ckpt, scale_name, scale)
        try:
            out = dequant_fp8(np.asarray(arr), np.asarray(scale, np.float32))
        except ValueError as e:
            raise CheckpointError(f"{ckpt.where(scale_name)}: tensor '{scale_name}': {e}") from None
    elif not kind.startswith(("F", "BF")):
        raise CheckpointError(f"{where} has dtype {kind}, expected a floating-point tensor")
    else:
        out = np.asarray(arr, np.float32)
    check_finite(np.all(np.isfinite(out)), ckpt, name)
    return out


def _is_mtp_name(name: str, num_hidden_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_hidden_layers


def checkpoint_has_mtp(ckpt: HFCheckpoint, cfg: ModelConfig) -> bool:
    return cfg.num_nextn_predict_layers > 0 and f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in ckpt


def load_hf_state(ckpt: HFCheckpoint, cfg: ModelConfig, state: nnx.State, include_mtp: bool,
                  include_indexer: bool = True) -> nnx.State:
    """Fills a parameter state of `Transformer(cfg)` from the checkpoint; strict about the inventory. Without
    include_indexer the indexer parameters are left as they are in `state` (a fresh initialization)."""
    pure = nnx.to_pure_dict(state)
    specs = tensor_specs(cfg, include_mtp, include_indexer)
    main_names = {s.path: s.hf_names[0] for s in specs if not s.alias}
    consumed = set()
    for spec in specs:
        consumed.update(spec.hf_names)
        consumed.update(n + SCALE_SUFFIX for n in spec.hf_names)
        if spec.alias:  # MTP copy of the embedding / LM head: must equal the main tensor, which is loaded
            check_alias(ckpt, spec.hf_names[0], main_names[spec.path])
            continue
        parts = [read_hf_tensor(ckpt, name, spec.hf_shape) for name in spec.hf_names]
        parts = [p.T if spec.transpose else p for p in parts]
        value = np.stack(parts) if len(spec.hf_names) > 1 else parts[0]
        node = pure
        for key in spec.path[:-1]:
            node = node[key]
        target = node[spec.path[-1]]
        node[spec.path[-1]] = jnp.asarray(value, dtype=target.dtype)
    unexpected = sorted(n for n in ckpt.names()
                        if n not in consumed and (include_mtp or not _is_mtp_name(n, cfg.num_hidden_layers))
                        and (include_indexer or ".self_attn.indexer." not in n))
    if unexpected:
        raise CheckpointError(f"{ckpt.directory}: {len(unexpected)} unexpected tensors for this config, e.g. "
                              f"'{unexpected[0]}' in {ckpt.where(unexpected[0])}; does config.json match the weights?")
    nnx.replace_by_pure_dict(state, pure)
    return state
