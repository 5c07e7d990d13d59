"""Validation of an HF checkpoint against a model config: every tensor present with the expected shape and dtype,
FP8 weights with well-formed block scales, no stray tensors, MTP copies exact. One validator for every path that
reads HF checkpoints: `dsv32_jax.from_pretrained` and `python -m dsv32_jax.checkpoint.convert hf-to-orbax` (values are checked
finite by `safetensors_io.check_finite` as each tensor is read). Errors name the file and the tensor.

Layer: above hf (tensor specs), below orbax_io / loading / convert.
"""

from __future__ import annotations

import os


from dsv32_jax.model.config import ModelConfig
from dsv32_jax.model.fp8 import SCALE_SUFFIX
from dsv32_jax.checkpoint.fp8_weights import BLOCK
from dsv32_jax.checkpoint.hf import TensorSpec, tensor_specs
from dsv32_jax.checkpoint.safetensors_io import INDEX_FILE, CheckpointError, HFCheckpoint

FLOAT_KINDS = ("BF16", "F32", "F16", "F64")


def _kernel_shape(spec: TensorSpec) -> tuple:
    shape = tuple(spec.hf_shape[::-1]) if spec.transpose else tuple(spec.hf_shape)
    return ((len(spec.hf_names),) + shape) if len(spec.hf_names) > 1 else shape


def _mtp_layer(name: str, cfg: ModelConfig) -> int | None:
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        layer = int(parts[2])
        if cfg.num_hidden_layers <= layer < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
            return layer
    return None


def check_hf_checkpoint(ckpt: HFCheckpoint, cfg: ModelConfig, include_mtp: bool,
                        include_indexer: bool = True) -> dict[str, str]:
    """Validates the inventory against the config from the headers alone; returns {tensor name: dtype}.

    Raises CheckpointError naming the file and tensor for: missing / unexpected tensors, wrong shapes, dtypes that
    are not allowed (FP8 only where the official checkpoint quantizes, floats elsewhere), FP8 weights without a
    scale or with a scale of the wrong shape or dtype, and scales next to weights that are not FP8.
    """
    where_cfg = os.path.join(ckpt.directory, "config.json")
    index = os.path.join(ckpt.directory, INDEX_FILE)
    listing = index if os.path.exists(index) else ckpt.directory
    specs = tensor_specs(cfg, include_mtp, include_indexer)
    dtypes: dict[str, str] = {}
    consumed: set[str] = set()

    def kind_of(name):
        return ckpt.location[name].dtype_name(name)

    for spec in specs:
        for name in spec.hf_names:
            consumed.add(name)
            if name not in ckpt:
                hint = ""
                if _mtp_layer(name, cfg) is not None:
                    hint = " (the MTP layer was requested with include_mtp but the checkpoint does not have it)"
                raise CheckpointError(f"{listing}: missing tensor '{name}' (expected shape {list(spec.hf_shape)} from "
                                      f"{where_cfg}){hint}")
            file = ckpt.where(name)
            shape, kind = ckpt.location[name].shape(name), kind_of(name)
            if shape != tuple(spec.hf_shape):
                raise CheckpointError(f"{file}: tensor '{name}' has shape {list(shape)}, expected "
                                      f"{list(spec.hf_shape)} from {where_cfg}; does config.json match the weights?")
            allowed = (("F8_E4M3",) if spec.quantized else ()) + FLOAT_KINDS
            if kind not in allowed:
                what = "F8_E4M3 (+ weight_scale_inv) or a float dtype" if spec.quantized else \
                    "a float dtype (BF16/F32/F16; this tensor is never FP8-quantized)"
                raise CheckpointError(f"{file}: tensor '{name}' has dtype {kind}, expected {what}")
            scale = name + SCALE_SUFFIX
            if kind == "F8_E4M3":
                consumed.add(scale)
                blocks = tuple(-(-n // BLOCK) for n in spec.hf_shape)
                if scale not in ckpt:
                    raise CheckpointError(f"{file}: tensor '{name}' is F8_E4M3 but its scale '{scale}' is missing "
                                          f"(expected F32 {list(blocks)})")
                sfile, sshape, skind = ckpt.where(scale), ckpt.location[scale].shape(scale), kind_of(scale)
                if sshape != blocks:
                    raise CheckpointError(f"{sfile}: scale '{scale}' has shape {list(sshape)}, expected {list(blocks)} "
                                          f"for {BLOCK}x{BLOCK} blocks of '{name}' {list(spec.hf_shape)}")
                if skind not in FLOAT_KINDS:
                    raise CheckpointError(f"{sfile}: scale '{scale}' has dtype {skind}, expected F32")
            elif scale in ckpt:
                raise CheckpointError(f"{ckpt.where(scale)}: scale '{scale}' belongs to '{name}', which is {kind}, "
                                      "not F8_E4M3 (mismatched scale)")
            dtypes.setdefault(name, kind)
    unexpected, skipped_layers = [], set()
    for name in ckpt.names():
        if name in consumed or (not include_indexer and ".self_attn.indexer." in name):  # fresh indexers
            continue
        layer = _mtp_layer(name, cfg)
        if not include_mtp and layer is not None:
            skipped_layers.add(layer)
            continue
        unexpected.append(name)
    for layer in sorted(skipped_layers):
        marker = f"model.layers.{layer}.eh_proj.weight"
        if marker not in ckpt:
            example = next(n for n in ckpt.names() if n.startswith(f"model.layers.{layer}."))
            raise CheckpointError(f"{ckpt.where(example)}: tensor '{example}' belongs to layer {layer}, which "
                                  f"{where_cfg} makes the MTP layer, but the checkpoint has no '{marker}'; "
                                  f"num_hidden_layers={cfg.num_hidden_layers} does not match the weights")
    if unexpected:
        unexpected.sort()
        raise CheckpointError(f"{ckpt.where(unexpected[0])}: unexpected tensor '{unexpected[0]}' "
                              f"({len(unexpected)} unexpected in total) for the config in {where_cfg}; "
                              "does config.json match the weights?")
    return dtypes
