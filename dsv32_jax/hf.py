"""HF checkpoint layout <-> Flax parameter tree. One table (`tensor_specs`) drives loading and export.

HF stores Linear weights [out, in]; our kernels are [in, out]. Routed experts are separate HF tensors
(`mlp.experts.{e}.gate_proj.weight`) stacked per layer here ([E, D, I]) for the dropless MoE. The MTP
module is checkpoint layer `num_hidden_layers + j`; its `embed_tokens` / `shared_head.head` are copies of
the main embedding / LM head (aliases: shared here, written back as copies on export).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv32_jax.config import ModelConfig
from dsv32_jax.safetensors_io import CheckpointError, HFCheckpoint

SCALE_SUFFIX = "_scale_inv"


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


def tensor_specs(cfg: ModelConfig, include_mtp: bool = True) -> list[TensorSpec]:
    """Every parameter of `Transformer(cfg)` with its HF tensor(s); MTP layers when include_mtp."""
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
                yield name[: -len(".weight")] + ".weight" + SCALE_SUFFIX, tuple(-(-n // 128) for n in spec.hf_shape), "F32"
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
        from dsv32_jax.convert import dequant_fp8  # lazy: convert imports this module

        scale = ckpt.get(scale_name)
        try:
            return dequant_fp8(np.asarray(arr), np.asarray(scale, np.float32))
        except ValueError as e:
            raise CheckpointError(f"{ckpt.where(scale_name)}: tensor '{scale_name}': {e}") from None
    if not kind.startswith(("F", "BF")):
        raise CheckpointError(f"{where} has dtype {kind}, expected a floating-point tensor")
    return np.asarray(arr, np.float32)


def _is_mtp_name(name: str, num_hidden_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_hidden_layers


def checkpoint_has_mtp(ckpt: HFCheckpoint, cfg: ModelConfig) -> bool:
    return cfg.num_nextn_predict_layers > 0 and f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight" in ckpt


def load_hf_state(ckpt: HFCheckpoint, cfg: ModelConfig, state: nnx.State, include_mtp: bool) -> nnx.State:
    """Fills an (abstract) parameter state of `Transformer(cfg)` from the checkpoint; strict about the inventory."""
    pure = nnx.to_pure_dict(state)
    specs = tensor_specs(cfg, include_mtp)
    consumed = set()
    for spec in specs:
        consumed.update(spec.hf_names)
        consumed.update(n + SCALE_SUFFIX for n in spec.hf_names)
        if spec.alias:
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
                        if n not in consumed and (include_mtp or not _is_mtp_name(n, cfg.num_hidden_layers)))
    if unexpected:
        raise CheckpointError(f"{ckpt.directory}: {len(unexpected)} unexpected tensors for this config, e.g. "
                              f"'{unexpected[0]}' in {ckpt.where(unexpected[0])}; does config.json match the weights?")
    nnx.replace_by_pure_dict(state, pure)
    return state


def resolve_mtp(cfg: ModelConfig, has_mtp: bool, include_mtp: bool | None, missing_error: str):
    """(config to build, whether to load the MTP layer): None loads it iff present; True requires it."""
    if include_mtp and not has_mtp:
        raise CheckpointError(missing_error)
    include_mtp = has_mtp if include_mtp is None else include_mtp
    return (cfg if include_mtp else cfg.replace(num_nextn_predict_layers=0)), include_mtp


def abstract_model(cfg: ModelConfig, dtype, param_dtype, options):
    """(graphdef, abstract state) of Transformer(cfg) without allocating parameters."""
    from dsv32_jax.model import Transformer

    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                        param_dtype=param_dtype or dtype, options=options)))


def from_pretrained(path: str | os.PathLike, dtype=jnp.bfloat16, *, param_dtype=None, options=None,
                    include_mtp: bool | None = None, mesh=None, rules=None, step: int | None = None):
    """Loads a checkpoint directory into a ready `Transformer`: an HF-layout safetensors checkpoint (config.json +
    shards), a dsv32-jax orbax checkpoint (written by `python -m dsv32_jax.convert hf-to-orbax`; detected by its
    `dsv32_meta.json`, loaded layer by layer, FP8 leaves dequantized), or a training workdir (`python -m
    dsv32_jax.train.main --workdir=W`; detected by `W/checkpoints/`): the parameters of its latest finished checkpoint, or
    of `step`, with the model config recorded in that checkpoint.

    dtype: compute dtype (and parameter dtype unless param_dtype is given); router, correction bias and indexer
    weights_proj stay float32. include_mtp: None loads the MTP layer iff the checkpoint has it. mesh: a
    `jax.sharding.Mesh` or a spec like 'fsdp:2,tensor:4' to shard the parameters by their logical axes
    (`rules`: logical axis -> mesh axes, default `dsv32_jax.sharding.DEFAULT_RULES`).
    """
    from dsv32_jax import orbax_io
    from dsv32_jax import sharding as shd

    path = os.fspath(path)
    if orbax_io.is_orbax_checkpoint(path) or orbax_io.is_training_workdir(path):
        return orbax_io.load_orbax_model(path, dtype, param_dtype=param_dtype, options=options,
                                         include_mtp=include_mtp, mesh=mesh, rules=rules, step=step)
    if step is not None:
        raise ValueError(f"{path}: step={step} applies to training workdirs only (this is an HF checkpoint)")
    cfg = ModelConfig.from_hf(path)
    ckpt = HFCheckpoint(path)
    cfg, include_mtp = resolve_mtp(cfg, checkpoint_has_mtp(ckpt, cfg), include_mtp,
                                   f"{path}: include_mtp=True but the checkpoint has no MTP layer "
                                   f"(model.layers.{cfg.num_hidden_layers}.eh_proj.weight)")
    graphdef, state = abstract_model(cfg, dtype, param_dtype, options)
    state = load_hf_state(ckpt, cfg, state, include_mtp)
    if mesh is not None:
        state = orbax_io.shard_state(state, shd.make_mesh(mesh) if isinstance(mesh, str) else mesh, rules)
    return nnx.merge(graphdef, state)
