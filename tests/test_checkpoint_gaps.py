"""Checkpoint code paths the tiny synthetic checkpoints never reach (found by mutation testing): every quantized
tensor of the tiny config fits in one 128x128 block, is never all zero, and never exceeds the 64 MiB strip or
flush sizes. Each test names the bug it guards; expected values come from numpy or from reference_spec.md."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from dsv32_jax.checkpoint import fp8_weights
from dsv32_jax.checkpoint.fp8_weights import dequant_fp8, quantize_fp8

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _numpy_dequant(codes, scale):
    """Independent reference: W[i, j] = float(code[i, j]) * S[i // 128, j // 128]."""
    i, j = np.indices(codes.shape)
    return codes.astype(np.float32) * scale.astype(np.float32)[i // 128, j // 128]


def _codes(rng, shape):
    return (rng.standard_normal(shape) * 100).clip(-448, 448).astype(FP8)


@pytest.mark.parametrize("backend", ["numpy", "jax_strips"])
def test_fp8_strips_narrower_than_the_chunk_stay_block_aligned(rng, monkeypatch, backend):
    """Large tensors go through the kernels in column strips; a strip width that is not a multiple of 128 (CHUNK //
    rows = 200 here) pairs columns with the wrong block scale. Mutant: drop the `// BLOCK * BLOCK` in _strips."""
    monkeypatch.setattr(fp8_weights, "JAX_MIN_ELEMENTS", 1 << 40 if backend == "numpy" else 0)
    monkeypatch.setattr(fp8_weights, "CHUNK_ELEMENTS", 200 * 200)  # tensors below are 200 x 700: several strips
    codes, scale = _codes(rng, (200, 700)), rng.uniform(0.5, 2.0, (2, 6)).astype(np.float32)
    want = _numpy_dequant(codes, scale)
    np.testing.assert_array_equal(dequant_fp8(codes, scale), want)
    np.testing.assert_array_equal(dequant_fp8(codes, scale, transpose=True), want.T)
    w = (rng.standard_normal((200, 700)) * np.repeat(rng.uniform(0.1, 10, 6), 128)[:700]).astype(np.float32)
    got_codes, got_scale = quantize_fp8(w)
    b = np.pad(np.abs(w), ((0, 56), (0, 68))).reshape(2, 128, 6, 128)
    np.testing.assert_array_equal(got_scale, b.max(axis=(1, 3)) / np.float32(448))  # amax / 448 per block
    t_codes, t_scale = quantize_fp8(w.T, transpose=True)
    np.testing.assert_array_equal(t_scale, got_scale)
    np.testing.assert_array_equal(t_codes.view(np.uint8), got_codes.view(np.uint8))


def test_fp8_all_zero_block_gets_scale_one_and_zero_codes():
    """An all-zero 128x128 block (zero-initialized or pruned weights) has amax 0: its scale must be 1.0, not 0/448 = 0,
    which makes every code 0/0 = NaN. Mutant: drop the `where(amax > 0, ..., 1.0)` in _quant_impl."""
    w = np.zeros((130, 256), np.float32)
    w[128:, 128:] = np.float32(3.5)  # one non-zero block: scale 3.5 / 448
    codes, scale = quantize_fp8(w)
    np.testing.assert_array_equal(scale, np.array([[1.0, 1.0], [1.0, 3.5 / 448]], np.float32))
    assert np.all(codes[:128].astype(np.float32) == 0) and np.all(codes[:, :128].astype(np.float32) == 0)
    np.testing.assert_array_equal(dequant_fp8(codes, scale), w)


def test_dequant_fp8_slice_crosses_block_boundaries(rng):
    """A sharded load dequantizes each device's slice with the scale of the blocks the slice covers; the tiny
    checkpoints have one block per tensor, so a slice mapped to the wrong block went unnoticed. Slices start and end
    inside blocks here; expected: the numpy dequantization of the whole array, sliced."""
    from dsv32_jax.checkpoint.loading import dequant_fp8_slice

    codes, scale = _codes(rng, (2, 300, 260)), rng.uniform(0.5, 2.0, (2, 3, 3)).astype(np.float32)
    whole = np.stack([_numpy_dequant(codes[e], scale[e]) for e in range(2)])
    for index in [(slice(1, 2), slice(100, 300), slice(0, 260)), (slice(0, 2), slice(0, 150), slice(130, 260)),
                  (slice(0, 1),)]:
        got = dequant_fp8_slice(codes[index], scale, index, codes.shape, np.float32)
        np.testing.assert_array_equal(got, whole[index], err_msg=str(index))


class _CollectingWriter:
    def __init__(self):
        self.tensors = {}

    def add(self, name, array):
        self.tensors[name] = np.asarray(array)


def test_fp8_scales_are_transposed_with_their_kernels(tmp_path, rng):
    """HF stores W [out, in] with scale [out/128, in/128]; the orbax kernel is [in, out], so a kept-FP8 import must
    transpose the block scales too (and the export transpose them back). With the tiny config every scale is [1, 1]
    and a missing transpose went unnoticed. Expected: numpy transposes of the HF tensors."""
    from dsv32_jax.checkpoint import orbax_io
    from dsv32_jax.checkpoint.convert import _export_spec, _import_spec
    from dsv32_jax.checkpoint.hf import TensorSpec
    from dsv32_jax.checkpoint.io_utils import Progress
    from dsv32_jax.checkpoint.safetensors_io import HFCheckpoint, write_safetensors

    codes, scale = _codes(rng, (300, 200)), rng.uniform(0.5, 2.0, (3, 2)).astype(np.float32)  # scale [3, 2]
    write_safetensors(str(tmp_path / "model.safetensors"), {"w.weight": codes, "w.weight_scale_inv": scale})
    spec = TensorSpec(("w", "kernel"), ("w.weight",), (300, 200), transpose=True, quantized=True)
    bar = Progress("t", 2, 0, enabled=False)
    pairs = dict(_import_spec(HFCheckpoint(str(tmp_path)), spec, True, np.dtype(ml_dtypes.bfloat16), bar))
    got_codes, got_scale = pairs[("w", "kernel")], pairs[("w", "kernel_scale_inv")]
    np.testing.assert_array_equal(got_codes.view(np.uint8), codes.T.view(np.uint8))
    np.testing.assert_array_equal(got_scale, scale.T)

    writer = _CollectingWriter()
    store = {orbax_io.str_path(spec.path): got_codes, orbax_io.scale_path(spec.path): got_scale}
    _export_spec(writer, spec, spec, store, True, None, {}, bar)
    np.testing.assert_array_equal(writer.tensors["w.weight"].view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(writer.tensors["w.weight_scale_inv"], scale)


def test_export_dtypes_follow_the_official_checkpoint():
    """reference_spec.md section 8: mlp.gate.e_score_correction_bias is F32 and the non-quantized tensors are BF16;
    an export without --fp8 writes an FP8-sourced weight as BF16 (its official dtype), and the correction bias stays
    F32 even with --dtype=bfloat16."""
    from dsv32_jax.checkpoint.convert import _export_kind
    from dsv32_jax.checkpoint.hf import tensor_specs
    from dsv32_jax.model.config import load_preset

    specs = {s.hf_names[0]: s for s in tensor_specs(load_preset("tiny"), include_mtp=False)}
    bias = specs["model.layers.1.mlp.gate.e_score_correction_bias"]
    q = specs["model.layers.1.self_attn.q_a_proj.weight"]
    assert _export_kind(bias, "bfloat16", {}) == "F32"
    assert _export_kind(q, None, {q.hf_names[0]: "F8_E4M3"}) == "BF16"
    assert _export_kind(q, None, {q.hf_names[0]: "F32"}) == "F32"


def test_hf_to_orbax_flushing_a_group_in_parts_keeps_every_parameter(tmp_path, monkeypatch):
    """hf-to-orbax writes a layer in parts once FLUSH_BYTES (64 MiB) are held; no tiny checkpoint reaches that, so
    the part-wise path ran only on real checkpoints. With a 100 KB threshold every layer is written in several parts:
    the loaded parameters must be bitwise those from_pretrained reads from the HF fixture."""
    import jax.numpy as jnp
    from conftest import FIXTURES
    from flax import nnx

    import dsv32_jax
    from dsv32_jax.checkpoint import convert, orbax_io

    monkeypatch.setattr(convert, "FLUSH_BYTES", 100_000)  # hf_short's layers hold 181 / 331 KB: 2 to 4 parts each
    parts, real = [], orbax_io.ParamsWriter.write
    monkeypatch.setattr(orbax_io.ParamsWriter, "write", lambda self, g, t: (parts.append(g), real(self, g, t))[1])
    src = os.path.join(FIXTURES, "hf_short")
    convert.hf_to_orbax(src, str(tmp_path / "o"), dtype="float32", progress=False)
    assert parts.count("layers.1") >= 3 and parts.count("layers.0") >= 2  # the part-wise path did run
    a = dict(orbax_io.flatten_pure(nnx.to_pure_dict(nnx.state(dsv32_jax.from_pretrained(src, dtype=jnp.float32)))))
    b = dict(orbax_io.flatten_pure(nnx.to_pure_dict(nnx.state(
        dsv32_jax.from_pretrained(str(tmp_path / "o"), dtype=jnp.float32)))))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=str(k))


def test_atomic_output_dir_refuses_an_output_that_contains_the_input(tmp_path):
    """--overwrite with --out naming a parent of the input would replace (delete) the directory holding the input;
    refused like an output equal to or inside the input, and the input is left untouched."""
    from dsv32_jax.checkpoint.io_utils import OutputExistsError, atomic_output_dir

    src = tmp_path / "parent" / "hf"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    for out in (tmp_path / "parent", src, src / "sub"):
        with pytest.raises(OutputExistsError, match="must not be, contain, or lie inside the input"):
            with atomic_output_dir(str(out), overwrite=True, inputs=[str(src)]):
                pass
    assert (src / "config.json").read_text() == "{}" and sorted(os.listdir(tmp_path / "parent")) == ["hf"]
