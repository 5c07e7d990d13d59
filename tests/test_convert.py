"""Checkpoint conversion (issue #3): inventory, synthetic checkpoints, HF <-> orbax round trips, logits through the
orbax path, every bad input, atomicity, the CLI and the sharded path."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES, child_xla_flags, rel_err
from test_convert_helpers import (INDEX, ROOT, compare_checkpoints, copy_checkpoint, edit_checkpoint, leftovers,
                                  make_synthetic_checkpoint, numpy_dequantized_copy, shard_of)

import dsv32_jax
from dsv32_jax import CheckpointError, ConfigError, load_preset
from dsv32_jax.checkpoint import fp8_weights, orbax_io
from dsv32_jax.checkpoint.convert import OutputExistsError, hf_to_orbax, orbax_to_hf
from dsv32_jax.checkpoint.fp8_weights import dequant_fp8, quantize_fp8
from dsv32_jax.checkpoint.safetensors_io import ShardedSafetensorsWriter
from dsv32_jax.checkpoint.hf import hf_inventory, tensor_specs
from dsv32_jax.checkpoint.safetensors_io import HFCheckpoint

TINY = load_preset("tiny")
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SHARD = 200_000  # bytes: the tiny synthetic checkpoint gets 3 shards
TOKENS = np.random.default_rng(7).integers(0, TINY.vocab_size, (2, 12)).astype(np.int32)


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="session")
def synth_fp8(work):
    path = str(work / "synth_fp8")
    make_synthetic_checkpoint(path, TINY, seed=0, shard_size_bytes=SHARD, k_norm_dtype="F32")
    return path


@pytest.fixture(scope="session")
def synth_bf16(work):
    path = str(work / "synth_bf16")
    make_synthetic_checkpoint(path, TINY, seed=1, fp8=False, shard_size_bytes=SHARD, k_norm_dtype="F32")
    return path


@pytest.fixture(scope="session")
def reference_logits(work, synth_fp8):
    """Logits of the numpy-dequantized float32 checkpoint through the HF loading path."""
    ref = str(work / "numpy_dequantized")
    numpy_dequantized_copy(synth_fp8, ref)
    model = dsv32_jax.from_pretrained(ref, dtype=jnp.float32, include_mtp=True)
    logits, aux = model(jnp.asarray(TOKENS), return_aux=True)
    return np.asarray(logits), np.asarray(aux["mtp_logits"][0]), ref


@pytest.fixture(scope="session")
def orbax_fp8(work, synth_fp8):
    out = str(work / "orbax_float8")
    hf_to_orbax(synth_fp8, out, dtype="float8", include_mtp=True, progress=False)
    return out


@pytest.fixture
def bad(tmp_path, synth_fp8):
    """A private copy of the FP8 synthetic checkpoint to damage."""
    return copy_checkpoint(synth_fp8, str(tmp_path / "bad"))


# ------------------------------------------------------------------------------------------------ inventory
def test_671b_inventory_matches_official_without_allocating():
    cfg = load_preset("deepseek_v32_671b")
    tracemalloc.start()
    inv = list(hf_inventory(cfg, include_mtp=True, fp8=True))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20  # names and shapes only, no weights
    assert len(inv) == 92425
    names = [n for n, _, _ in inv]
    assert len(set(names)) == len(names)
    assert len(inv) - 7 * 62 == 91991  # V3's inventory + 7 indexer tensors x 62 layers
    shapes = {n: (s, k) for n, s, k in inv}
    p = "model.layers.5."
    table = {  # reference_spec section 8: name -> (weight shape, scale shape)
        "self_attn.q_a_proj": ((1536, 7168), (12, 56)),
        "self_attn.q_b_proj": ((24576, 1536), (192, 12)),
        "self_attn.kv_a_proj_with_mqa": ((576, 7168), (5, 56)),
        "self_attn.kv_b_proj": ((32768, 512), (256, 4)),
        "self_attn.o_proj": ((7168, 16384), (56, 128)),
        "self_attn.indexer.wq_b": ((8192, 1536), (64, 12)),
        "self_attn.indexer.wk": ((128, 7168), (1, 56)),
        "mlp.shared_experts.gate_proj": ((2048, 7168), (16, 56)),
        "mlp.shared_experts.down_proj": ((7168, 2048), (56, 16)),
        "mlp.experts.255.up_proj": ((2048, 7168), (16, 56)),
        "mlp.experts.0.down_proj": ((7168, 2048), (56, 16)),
    }
    for short, (w, s) in table.items():
        assert shapes[p + short + ".weight"] == (w, "F8_E4M3"), short
        assert shapes[p + short + ".weight_scale_inv"] == (s, "F32"), short
    assert shapes["model.layers.0.mlp.gate_proj.weight_scale_inv"] == ((144, 56), "F32")
    assert shapes["model.layers.0.mlp.down_proj.weight_scale_inv"] == ((56, 144), "F32")
    assert shapes[p + "mlp.gate.weight"] == ((256, 7168), "BF16")
    assert shapes[p + "mlp.gate.e_score_correction_bias"] == ((256,), "F32")
    assert shapes[p + "self_attn.indexer.weights_proj.weight"] == ((64, 7168), "BF16")
    mtp = {n for n in names if n.startswith("model.layers.61.")}
    for short in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight", "shared_head.norm.weight",
                  "shared_head.head.weight", "self_attn.indexer.wk.weight_scale_inv", "mlp.experts.255.down_proj.weight"):
        assert "model.layers.61." + short in mtp
    assert shapes["model.layers.61.eh_proj.weight"] == ((7168, 14336), "BF16")
    assert not any(n.startswith("model.layers.62.") for n in names)
    n_fp8 = sum(k == "F8_E4M3" for _, _, k in inv)
    assert n_fp8 == sum(n.endswith("_scale_inv") for n in names)


def test_mapping_covers_every_model_variable():
    from flax import nnx

    from dsv32_jax.model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(0)))
    leaves = {tuple(p) for p, _ in orbax_io.flatten_pure(nnx.to_pure_dict(nnx.state(model)))}
    specs = tensor_specs(TINY, include_mtp=True)
    assert leaves == {s.path for s in specs if not s.alias}
    names = [n for s in specs for n in s.hf_names]
    assert len(names) == len(set(names))


# ------------------------------------------------------------------------------------------ synthetic layout
def test_synthetic_checkpoint_layout(synth_fp8, tmp_path):
    files = sorted(os.listdir(synth_fp8))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == 3 and all(re.fullmatch(r"model-0000[1-3]-of-00003\.safetensors", f) for f in shards)
    index = json.load(open(os.path.join(synth_fp8, INDEX)))
    ckpt = HFCheckpoint(synth_fp8)
    assert index["metadata"]["total_size"] == sum(ckpt.location[n].nbytes(n) for n in ckpt.names())
    inv = {n: (tuple(s), k) for n, s, k in hf_inventory(TINY, include_mtp=True, fp8=True)}
    assert set(ckpt.names()) == set(inv)
    for name in ckpt.names():
        kind = ckpt.location[name].dtype_name(name)
        if ".indexer.k_norm." in name:
            assert kind == "F32"
        else:
            assert (ckpt.location[name].shape(name), kind) == inv[name], name
    scales = np.concatenate([np.asarray(ckpt.get(n)).ravel() for n in ckpt.names() if n.endswith("_scale_inv")])
    mantissa, _ = np.frexp(scales)
    assert np.all(mantissa != 0.5) and scales.min() > 0  # never a power of two
    codes = np.asarray(ckpt.get("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")).astype(np.float32)
    assert np.abs(codes).max() == 448 and np.isfinite(codes).all()
    # MTP layer (checkpoint layer 3 of the tiny config) with exact copies of embed / head
    for short in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert f"model.layers.3.{short}" in ckpt
    np.testing.assert_array_equal(np.asarray(ckpt.get("model.layers.3.embed_tokens.weight")).view(np.uint16),
                                  np.asarray(ckpt.get("model.embed_tokens.weight")).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(ckpt.get("model.layers.3.shared_head.head.weight")).view(np.uint16),
                                  np.asarray(ckpt.get("lm_head.weight")).view(np.uint16))
    cfg = json.load(open(os.path.join(synth_fp8, "config.json")))
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    # deterministic by seed
    again = str(tmp_path / "again")
    make_synthetic_checkpoint(again, TINY, seed=0, shard_size_bytes=SHARD, k_norm_dtype="F32")
    assert compare_checkpoints(synth_fp8, again) == []
    other = str(tmp_path / "other")
    make_synthetic_checkpoint(other, TINY, seed=5, shard_size_bytes=SHARD, k_norm_dtype="BF16")
    assert len(compare_checkpoints(synth_fp8, other)) > 200
    assert HFCheckpoint(other).location["model.layers.1.self_attn.indexer.k_norm.bias"].dtype_name(
        "model.layers.1.self_attn.indexer.k_norm.bias") == "BF16"


def test_written_shards_are_readable_by_the_safetensors_library(synth_bf16):
    from safetensors import safe_open

    ckpt = HFCheckpoint(synth_bf16)
    seen = 0
    for shard in sorted(set(json.load(open(os.path.join(synth_bf16, INDEX)))["weight_map"].values())):
        with safe_open(os.path.join(synth_bf16, shard), "numpy") as f:
            for name in f.keys():
                ours = np.asarray(ckpt.get(name))
                theirs = f.get_tensor(name)
                assert theirs.shape == ours.shape
                np.testing.assert_array_equal(theirs.astype(np.float32), ours.astype(np.float32))
                seen += 1
    assert seen == len(ckpt.names())


@pytest.mark.parametrize("backend", ["numpy", "jax", "jax_strips"])
def test_fp8_block_codec_ragged_shapes(rng, monkeypatch, backend):
    monkeypatch.setattr(fp8_weights, "JAX_MIN_ELEMENTS", 1 << 40 if backend == "numpy" else 0)
    if backend == "jax_strips":  # 128-column strips, the last one ragged
        monkeypatch.setattr(fp8_weights, "CHUNK_ELEMENTS", 128 * 200)
    w = rng.standard_normal((3, 200, 300)).astype(np.float32) * rng.uniform(0.01, 10, (3, 1, 1)).astype(np.float32)
    codes, scale = quantize_fp8(w)
    assert codes.dtype == FP8 and codes.shape == w.shape and scale.shape == (3, 2, 3)
    expanded = np.repeat(np.repeat(scale, 128, axis=1), 128, axis=2)[:, :200, :300]
    amax = np.abs(np.pad(w, ((0, 0), (0, 56), (0, 84)))).reshape(3, 2, 128, 3, 128).max(axis=(2, 4))
    np.testing.assert_array_equal(scale, amax / np.float32(448))  # exactly amax / 448 in float32
    np.testing.assert_array_equal(codes.view(np.uint8),
                                  np.clip(w / expanded, -448, 448).astype(FP8).view(np.uint8))
    back = dequant_fp8(codes, scale)
    np.testing.assert_array_equal(back, codes.astype(np.float32) * expanded)
    back_t = dequant_fp8(codes, scale, ml_dtypes.bfloat16, transpose=True)
    np.testing.assert_array_equal(back_t, np.swapaxes(back, 1, 2).astype(ml_dtypes.bfloat16))
    codes_t, scale_t = quantize_fp8(np.swapaxes(w, 1, 2), transpose=True)
    np.testing.assert_array_equal(codes_t.view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(scale_t, scale)
    assert np.all(np.abs(back - w) <= 2.0**-4 * np.abs(w) + 2.0**-10 * expanded)
    with pytest.raises(ValueError, match=r"expected \[3, 2, 3\]"):
        dequant_fp8(codes, scale[:, :1])


# -------------------------------------------------------------------------------- logits through the orbax path
@pytest.mark.parametrize("dtype", ["float32", "float8", "bfloat16"])
def test_synthetic_fp8_logits_match_numpy_dequantized_path(work, synth_fp8, reference_logits, dtype):
    out = str(work / f"logits_{dtype}")
    hf_to_orbax(synth_fp8, out, dtype=dtype, include_mtp=True, progress=False)
    model = dsv32_jax.from_pretrained(out, dtype=jnp.float32)
    assert len(model.mtp) == 1
    logits, aux = model(jnp.asarray(TOKENS), return_aux=True)
    ref, ref_mtp, _ = reference_logits
    err, err_mtp = rel_err(logits, ref), rel_err(aux["mtp_logits"][0], ref_mtp)
    print(f"{dtype}: rel err logits {err:.2e}, MTP logits {err_mtp:.2e}")
    if dtype == "bfloat16":  # bf16 weights (rounded once from the exact dequantized values)
        assert err < 2e-2 and err_mtp < 2e-2
        # ... which is exactly the numpy-dequantized checkpoint run in bf16
        ours = dsv32_jax.from_pretrained(out, dtype=jnp.bfloat16)(jnp.asarray(TOKENS))
        ref_bf16 = dsv32_jax.from_pretrained(reference_logits[2], dtype=jnp.bfloat16)(jnp.asarray(TOKENS))
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref_bf16))
    else:  # float32 dequantized at conversion or at load: the same float32 products as numpy
        assert err <= 1e-6 and err_mtp <= 1e-6


def test_orbax_checkpoint_layout(orbax_fp8):
    meta = json.load(open(os.path.join(orbax_fp8, orbax_io.META_FILE)))
    assert meta["format"] == orbax_io.FORMAT_NAME and meta["fp8"] and meta["include_mtp"]
    assert meta["groups"] == ["globals", "layers.0", "layers.1", "layers.2", "mtp.0"]
    assert meta["hf_dtypes"]["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    reader = orbax_io.ParamsReader(orbax_fp8)
    assert reader.dtype(("layers", 1, "ffn", "experts", "w_gate")) == FP8
    assert reader.shape(("layers", 1, "ffn", "experts", "w_gate")) == (8, 64, 32)
    assert reader.shape(("layers", 1, "ffn", "experts", "w_gate_scale_inv")) == (8, 1, 1)
    assert reader.dtype(("layers", 1, "ffn", "bias")) == np.float32
    assert reader.dtype(("layers", 1, "ffn", "router")) == np.float32
    assert reader.dtype(("layers", 0, "attn", "indexer", "k_norm", "scale")) == np.float32  # F32 in the source
    assert reader.dtype(("layers", 0, "attn_norm", "scale")) == ml_dtypes.bfloat16
    assert reader.dtype(("mtp", 0, "eh_proj", "kernel")) == ml_dtypes.bfloat16
    # orbax alone restores the whole tree
    from orbax.checkpoint import v1 as ocp

    tree = ocp.load(os.path.join(orbax_fp8, orbax_io.PARAMS_DIR))
    assert tree["layers"]["2"]["ffn"]["experts"]["w_down"].shape == (8, 32, 64)
    assert set(tree) == {"embed", "layers", "lm_head", "mtp", "norm"}


def test_orbax_without_mtp_and_include_mtp_semantics(work, synth_fp8, reference_logits):
    out = str(work / "no_mtp")
    hf_to_orbax(synth_fp8, out, dtype="float32", include_mtp=False, progress=False)
    model = dsv32_jax.from_pretrained(out, dtype=jnp.float32)
    assert len(model.mtp) == 0
    assert rel_err(model(jnp.asarray(TOKENS)), reference_logits[0]) <= 1e-6
    with pytest.raises(CheckpointError, match="include_mtp"):
        dsv32_jax.from_pretrained(out, include_mtp=True)


def test_a_converted_checkpoint_loads_from_a_relative_path(orbax_fp8, monkeypatch):
    """orbax reads metadata only from absolute paths; given `ckpt/orbax` it read back nothing and loading failed with
    an AttributeError (found by running docs/checkpoints.md). Mutation: drop the abspath in ParamsReader."""
    monkeypatch.chdir(os.path.dirname(orbax_fp8))
    rel = os.path.basename(orbax_fp8)
    reader = orbax_io.ParamsReader(rel)
    assert reader.shape(("layers", 1, "ffn", "experts", "w_gate")) == (8, 64, 32)
    (bias,) = reader.load([("layers", 1, "ffn", "bias")]).values()
    assert bias.shape == (8,) and np.all(np.isfinite(bias))


def test_hf_fixture_through_orbax_loads_identical_parameters(tmp_path):
    """Every parameter loaded from the orbax copy is bitwise the one `from_pretrained` loads from the HF fixture
    (whose logits test_hf_parity checks against HF transformers); the logits themselves: the slow test below."""
    from flax import nnx

    src = os.path.join(FIXTURES, "hf_moe_bias")
    hf_to_orbax(src, str(tmp_path / "o"), dtype="float32", progress=False)
    a = nnx.to_pure_dict(nnx.state(dsv32_jax.from_pretrained(src, dtype=jnp.float32)))
    b = nnx.to_pure_dict(nnx.state(dsv32_jax.from_pretrained(str(tmp_path / "o"), dtype=jnp.float32)))
    flat_a, flat_b = dict(orbax_io.flatten_pure(a)), dict(orbax_io.flatten_pure(b))
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        assert flat_a[k].dtype == flat_b[k].dtype, k
        np.testing.assert_array_equal(np.asarray(flat_a[k]), np.asarray(flat_b[k]), err_msg=str(k))


@pytest.mark.parametrize("case", ["hf_short", pytest.param("hf_long", marks=pytest.mark.heavy), "hf_moe_bias"])
def test_hf_golden_fixtures_through_orbax(tmp_path, case):
    """(FP8-quantizing these fixtures is no test: they are built so that small weight changes flip the indexer's
    and the router's choices.)"""
    src = os.path.join(FIXTURES, case)
    out = str(tmp_path / "orbax")
    hf_to_orbax(src, out, dtype="float32", progress=False)
    model = dsv32_jax.from_pretrained(out, dtype=jnp.float32)
    gold = np.load(os.path.join(src, "golden.npz"))
    err = rel_err(model(jnp.asarray(gold["tokens"])), gold["logits"])
    print(f"{case} via orbax: rel err vs HF golden {err:.2e}")
    assert err <= 1e-4


# ------------------------------------------------------------------------------------------------ round trips
def test_round_trip_fixture_f32_bit_exact(tmp_path):
    src = os.path.join(FIXTURES, "hf_moe_bias")
    hf_to_orbax(src, str(tmp_path / "o"), dtype="float32", progress=False)
    orbax_to_hf(str(tmp_path / "o"), str(tmp_path / "hf"), progress=False)
    assert compare_checkpoints(src, str(tmp_path / "hf")) == []
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert dsv32_jax.ModelConfig.from_hf(cfg) == dsv32_jax.ModelConfig.from_hf(src)
    # the source's dtype (transformers 5 writes "dtype"): the export said bfloat16 over F32 tensors, so HF's
    # torch_dtype="auto" loaded it down-cast
    assert json.load(open(os.path.join(src, "config.json")))["dtype"] == cfg["torch_dtype"] == "float32"


def test_export_refuses_non_finite_weights_and_writes_nothing(tmp_path, monkeypatch):
    """orbax-to-hf wrote a diverged run's NaN weights (exit 0) that hf-to-orbax and from_pretrained then refused
    (red-team audit): it refuses them, naming the parameter and its HF tensor, and leaves no output."""
    from dsv32_jax.checkpoint import convert as convert_mod

    src = os.path.join(FIXTURES, "hf_moe_bias")
    hf_to_orbax(src, str(tmp_path / "o"), dtype="float32", progress=False)
    open_params = convert_mod.orbax_io.open_params

    def poisoned(*a, **k):
        source = open_params(*a, **k)
        load = source.reader.load

        def load_nan(paths):
            got = load(paths)
            return {k: (np.where(np.arange(v.size).reshape(v.shape) == 1, np.nan, v).astype(v.dtype)
                        if "q_a_proj" in k else v) for k, v in got.items()}

        monkeypatch.setattr(source.reader, "load", load_nan)
        return source

    monkeypatch.setattr(convert_mod.orbax_io, "open_params", poisoned)
    with pytest.raises(CheckpointError, match=r"o: parameter layers\.0\.attn\.q_a_proj\.kernel \(HF "
                                              r"model\.layers\.0\.self_attn\.q_a_proj\.weight\) contains NaN or Inf "
                                              r"values: nothing was exported"):
        orbax_to_hf(str(tmp_path / "o"), str(tmp_path / "hf"), progress=False)
    assert leftovers(str(tmp_path / "hf")) == []


def test_export_refuses_an_infinite_weight_or_fp8_scale(tmp_path, monkeypatch, orbax_fp8):
    """The non-finite refusal covers Inf as well as NaN, and an FP8 weight's block scales as well as the weight
    (an Inf scale dequantizes to Inf weights). Mutants guarded: a NaN-only check (isnan), and the scales not
    checked (the test above poisons a float32 weight with NaN only)."""
    from dsv32_jax.checkpoint import convert as convert_mod

    src = os.path.join(FIXTURES, "hf_moe_bias")
    hf_to_orbax(src, str(tmp_path / "o32"), dtype="float32", progress=False)
    open_params = convert_mod.orbax_io.open_params

    def poison(hit):
        def opened(*a, **k):
            source = open_params(*a, **k)
            load = source.reader.load

            def load_inf(paths):
                return {k: (np.where(np.arange(v.size).reshape(v.shape) == 0, np.inf, v).astype(v.dtype) if hit(k)
                            else v) for k, v in load(paths).items()}

            monkeypatch.setattr(source.reader, "load", load_inf)
            return source
        monkeypatch.setattr(convert_mod.orbax_io, "open_params", opened)

    poison(lambda k: "q_a_proj" in k and k[-1] == "kernel")
    with pytest.raises(CheckpointError, match=r"parameter layers\.0\.attn\.q_a_proj\.kernel \(HF "
                                              r"model\.layers\.0\.self_attn\.q_a_proj\.weight\) contains NaN or Inf"):
        orbax_to_hf(str(tmp_path / "o32"), str(tmp_path / "hf32"), progress=False)
    assert leftovers(str(tmp_path / "hf32")) == []
    poison(lambda k: "kv_a_proj" in k and k[-1] == "kernel" + orbax_io.SCALE_SUFFIX)
    with pytest.raises(CheckpointError, match=r"parameter layers\.0\.attn\.kv_a_proj\.kernel \(its FP8 scales\) "
                                              r"\(HF model\.layers\.0\.self_attn\.kv_a_proj_with_mqa\.weight\) "
                                              r"contains NaN or Inf"):
        orbax_to_hf(orbax_fp8, str(tmp_path / "hf8"), fp8=True, progress=False)
    assert leftovers(str(tmp_path / "hf8")) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_bf16_checkpoint_bit_exact(tmp_path, synth_bf16, dtype):
    """BF16 weights with F32 k_norm and F32 correction bias, MTP included; the export restores the source dtypes."""
    hf_to_orbax(synth_bf16, str(tmp_path / "o"), dtype=dtype, include_mtp=True, progress=False)
    orbax_to_hf(str(tmp_path / "o"), str(tmp_path / "hf"), shard_size_gb=SHARD / 1e9, progress=False)
    assert compare_checkpoints(synth_bf16, str(tmp_path / "hf")) == []
    shards = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    assert len(shards) == 4 and all(re.fullmatch(r"model-0000\d-of-00004\.safetensors", f) for f in shards)
    index = json.load(open(tmp_path / "hf" / INDEX))
    assert index["weight_map"] == json.load(open(os.path.join(synth_bf16, INDEX)))["weight_map"]  # same shard plan
    assert index["metadata"]["total_size"] == sum(os.path.getsize(tmp_path / "hf" / f) for f in shards) - sum(
        8 + int.from_bytes(open(tmp_path / "hf" / f, "rb").read(8), "little") for f in shards)
    assert "quantization_config" not in json.load(open(tmp_path / "hf" / "config.json"))


def test_round_trip_fp8_via_float8_bit_exact(tmp_path, synth_fp8, orbax_fp8):
    orbax_to_hf(orbax_fp8, str(tmp_path / "hf"), fp8=True, shard_size_gb=SHARD / 1e9, progress=False)
    assert compare_checkpoints(synth_fp8, str(tmp_path / "hf")) == []
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]


def _fp8_round_trip_errors(src_dir, back_dir, intermediate_rel):
    """Checks every re-quantized weight against the original (dequantized) values; returns (max err / block
    amax, fraction of identical codes)."""
    a, b = HFCheckpoint(src_dir), HFCheckpoint(back_dir)
    worst, same, total = 0.0, 0, 0
    for name in b.names():
        if b.location[name].dtype_name(name) != "F8_E4M3":
            continue
        s2 = np.asarray(b.get(name + "_scale_inv"))
        w2 = dequant_fp8(np.asarray(b.get(name)), s2)
        if a.location[name].dtype_name(name) == "F8_E4M3":
            w = dequant_fp8(np.asarray(a.get(name)), np.asarray(a.get(name + "_scale_inv")))
            same += int(np.sum(np.asarray(a.get(name)).view(np.uint8) == np.asarray(b.get(name)).view(np.uint8)))
        else:
            w = np.asarray(a.get(name), np.float32)
        total += w.size
        s_exp = np.repeat(np.repeat(s2, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
        bound = (2.0**-4 + intermediate_rel) * np.abs(w) * (1 + intermediate_rel) + 2.0**-10 * s_exp
        assert np.all(np.abs(w2 - w) <= bound), name
        worst = max(worst, float(np.max(np.abs(w2 - w) / (s_exp * 448))))
    return worst, same / max(total, 1)


def test_round_trip_fp8_requantized_within_fp8_error(tmp_path, synth_fp8):
    hf_to_orbax(synth_fp8, str(tmp_path / "o"), dtype="bfloat16", include_mtp=True, progress=False)
    orbax_to_hf(str(tmp_path / "o"), str(tmp_path / "hf"), fp8=True, progress=False)
    assert set(HFCheckpoint(str(tmp_path / "hf")).names()) == set(HFCheckpoint(synth_fp8).names())
    worst, same = _fp8_round_trip_errors(synth_fp8, str(tmp_path / "hf"), 2.0**-9)
    print(f"FP8 -> bf16 -> FP8: max |dW| / block amax = {worst:.2e}, identical codes {same:.4f}")
    assert worst <= 2.0**-4
    # non-FP8 source with ragged dims (fixture, F32) quantized on export
    src = os.path.join(FIXTURES, "hf_short")
    hf_to_orbax(src, str(tmp_path / "fo"), dtype="float32", progress=False)
    orbax_to_hf(str(tmp_path / "fo"), str(tmp_path / "fhf"), fp8=True, progress=False)
    worst, _ = _fp8_round_trip_errors(src, str(tmp_path / "fhf"), 0.0)
    assert worst <= 2.0**-4


def test_round_trip_fp8_via_float32_reproduces_codes(tmp_path, synth_fp8):
    hf_to_orbax(synth_fp8, str(tmp_path / "o"), dtype="float32", include_mtp=True, progress=False)
    orbax_to_hf(str(tmp_path / "o"), str(tmp_path / "hf"), fp8=True, progress=False)
    worst, same = _fp8_round_trip_errors(synth_fp8, str(tmp_path / "hf"), 0.0)
    print(f"FP8 -> f32 -> FP8: max |dW| / block amax = {worst:.2e}, identical codes {same:.6f}")
    assert same > 0.999 and worst <= 2.0**-4


def test_jax_and_numpy_kernels_agree_bitwise(tmp_path, synth_fp8, monkeypatch):
    """The same conversions with every tensor through the jitted JAX kernels and through numpy: dequantize,
    cast + transpose (import), block amax + codes (export --fp8)."""
    for backend, limit in (("np", 1 << 40), ("jax", 0)):
        monkeypatch.setattr(fp8_weights, "JAX_MIN_ELEMENTS", limit)
        hf_to_orbax(synth_fp8, str(tmp_path / f"{backend}_b"), dtype="bfloat16", progress=False)
        orbax_to_hf(str(tmp_path / f"{backend}_b"), str(tmp_path / f"{backend}_hf8"), fp8=True, progress=False)
    for a, b in (("np_b", "jax_b"),):
        ra, rb = orbax_io.ParamsReader(str(tmp_path / a)), orbax_io.ParamsReader(str(tmp_path / b))
        assert ra.leaves.keys() == rb.leaves.keys()
        la, lb = ra.load(list(ra.leaves)), rb.load(list(rb.leaves))
        for k in la:
            assert la[k].dtype == lb[k].dtype and np.array_equal(la[k].view(np.uint8), lb[k].view(np.uint8)), k
    assert compare_checkpoints(str(tmp_path / "np_hf8"), str(tmp_path / "jax_hf8")) == []


def test_bf16_checkpoint_to_float8(tmp_path, synth_bf16):
    """--dtype=float8 from a BF16 source quantizes at import; loading dequantizes."""
    hf_to_orbax(synth_bf16, str(tmp_path / "o"), dtype="float8", progress=False)
    reader = orbax_io.ParamsReader(str(tmp_path / "o"))
    assert reader.dtype(("layers", 0, "attn", "q_a_proj", "kernel")) == FP8
    m8 = dsv32_jax.from_pretrained(str(tmp_path / "o"), dtype=jnp.float32)
    m = dsv32_jax.from_pretrained(synth_bf16, dtype=jnp.float32, include_mtp=False)
    w, w8 = np.asarray(m.layers[0].attn.q_a_proj.kernel[...]), np.asarray(m8.layers[0].attn.q_a_proj.kernel[...])
    assert np.max(np.abs(w8 - w)) <= 2.0**-4 * np.max(np.abs(w)) and not np.array_equal(w, w8)


# ------------------------------------------------------------------------------------------------- bad inputs
def _convert_fails(src, tmp_path, match, exc=CheckpointError, **kw):
    out = str(tmp_path / "out")
    with pytest.raises(exc, match=match) as info:
        hf_to_orbax(src, out, progress=False, **kw)
    assert leftovers(out) == []  # nothing written, nothing half-written
    if exc is CheckpointError and set(kw) <= {"include_mtp"}:  # one validator: from_pretrained refuses it alike
        with pytest.raises(exc, match=match):
            dsv32_jax.from_pretrained(src, dtype=jnp.float32, include_mtp=kw.get("include_mtp"))
    return str(info.value)


Q = "model.layers.1.self_attn.q_a_proj.weight"


def test_bad_missing_tensor(bad, tmp_path):
    edit_checkpoint(bad, lambda t: (t.pop(Q), t.pop(Q + "_scale_inv")))
    msg = _convert_fails(bad, tmp_path, re.escape(f"missing tensor '{Q}'"))
    assert INDEX in msg and "expected shape [32, 64]" in msg


def test_bad_unexpected_tensor(bad, tmp_path):
    name = "model.layers.1.self_attn.extra_proj.weight"
    edit_checkpoint(bad, lambda t: t.__setitem__(name, np.zeros((4, 4), ml_dtypes.bfloat16)))
    msg = _convert_fails(bad, tmp_path, re.escape(f"unexpected tensor '{name}'"))
    assert "model-00003-of-00003.safetensors" in msg


def test_bad_wrong_shape(bad, tmp_path):
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    edit_checkpoint(bad, lambda t: t.__setitem__(name, t[name][:, :16]))
    msg = _convert_fails(bad, tmp_path, re.escape(f"tensor '{name}' has shape [64, 16], expected [64, 32]"))
    assert shard_of(bad, name) in msg and "config.json" in msg


def test_bad_wrong_dtype(bad, tmp_path):
    name = "model.layers.0.input_layernorm.weight"
    edit_checkpoint(bad, lambda t: t.__setitem__(name, t[name].astype(np.int32)))
    msg = _convert_fails(bad, tmp_path, re.escape(f"tensor '{name}' has dtype I32, expected a float dtype"))
    assert shard_of(bad, name) in msg


def test_bad_fp8_where_not_quantized(bad, tmp_path):
    name = "model.layers.1.mlp.gate.weight"
    edit_checkpoint(bad, lambda t: t.__setitem__(name, t[name].astype(FP8)))
    _convert_fails(bad, tmp_path, re.escape(f"tensor '{name}' has dtype F8_E4M3") + ".*never FP8")


def test_bad_missing_scale(bad, tmp_path):
    edit_checkpoint(bad, lambda t: t.pop(Q + "_scale_inv"))
    msg = _convert_fails(bad, tmp_path, re.escape(f"tensor '{Q}' is F8_E4M3 but its scale '{Q}_scale_inv' is missing"))
    assert shard_of(bad, Q) in msg


def test_bad_scale_shape(bad, tmp_path):
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    edit_checkpoint(bad, lambda t: t.__setitem__(name, np.ones((2, 1), np.float32)))
    msg = _convert_fails(bad, tmp_path, re.escape(f"scale '{name}' has shape [2, 1], expected [1, 1]"))
    assert shard_of(bad, name) in msg


def test_bad_scale_dtype(bad, tmp_path):
    """A block scale must be a float tensor (F32 in the official checkpoint); an integer one (e.g. ue8m0 exponents
    stored as U8/I32) would be read as plain integer multipliers and corrupt the weights silently."""
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    edit_checkpoint(bad, lambda t: t.__setitem__(name, np.ones((1, 1), np.int32)))
    msg = _convert_fails(bad, tmp_path, re.escape(f"scale '{name}' has dtype I32, expected F32"))
    assert shard_of(bad, name) in msg


def test_bad_scale_values(bad, tmp_path):
    name = "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"
    edit_checkpoint(bad, lambda t: t.__setitem__(name, np.full((1, 1), np.nan, np.float32)))
    _convert_fails(bad, tmp_path, re.escape(f"scale '{name}' has an invalid value"))


def test_bad_scale_for_unquantized_weight(tmp_path, synth_bf16):
    src = copy_checkpoint(synth_bf16, str(tmp_path / "src"))
    edit_checkpoint(src, lambda t: t.__setitem__(Q + "_scale_inv", np.ones((1, 1), np.float32)))
    _convert_fails(src, tmp_path, re.escape(f"scale '{Q}_scale_inv' belongs to '{Q}', which is BF16"))


def test_bad_nan_weight(tmp_path, synth_bf16):
    src = copy_checkpoint(synth_bf16, str(tmp_path / "src"))
    name = "model.layers.2.self_attn.o_proj.weight"

    def poison(t):
        t[name] = t[name].copy()
        t[name][3, 4] = np.inf
    edit_checkpoint(src, poison)
    _convert_fails(src, tmp_path, re.escape(f"tensor '{name}' contains NaN or Inf"))


def test_bad_nan_in_a_vector(tmp_path, synth_bf16):
    """1-D tensors (norm weights, biases) go through their own cast branch of convert_tensor; a NaN there must be
    refused like one in a matrix (a dropped finiteness flag let it into the orbax checkpoint)."""
    src = copy_checkpoint(synth_bf16, str(tmp_path / "src"))
    name = "model.layers.1.post_attention_layernorm.weight"

    def poison(t):
        t[name] = t[name].copy()
        t[name][5] = np.nan
    edit_checkpoint(src, poison)
    _convert_fails(src, tmp_path, re.escape(f"tensor '{name}' contains NaN or Inf"))


def test_bad_mtp_copy_differs(bad, tmp_path):
    name = "model.layers.3.embed_tokens.weight"

    def tweak(t):
        t[name] = t[name].copy()
        t[name][17, 3] += 1
    edit_checkpoint(bad, tweak)
    _convert_fails(bad, tmp_path, re.escape(f"tensor '{name}' should be an exact copy of 'model.embed_tokens.weight'")
                   + ".*rows 0", include_mtp=True)


def test_bad_truncated_shard(bad, tmp_path):
    path = os.path.join(bad, "model-00002-of-00003.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    _convert_fails(bad, tmp_path, re.escape(path) + ": truncated: tensor '")


def test_bad_corrupt_header(bad, tmp_path):
    path = os.path.join(bad, "model-00001-of-00003.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{")
    _convert_fails(bad, tmp_path, re.escape(path) + ": corrupt safetensors header")


def test_bad_index_points_at_missing_file(bad, tmp_path):
    index = json.load(open(os.path.join(bad, INDEX)))
    index["weight_map"][Q] = "model-00009-of-00009.safetensors"
    json.dump(index, open(os.path.join(bad, INDEX), "w"))
    msg = _convert_fails(bad, tmp_path, "points at shard 'model-00009-of-00009.safetensors', which does not exist")
    assert INDEX in msg


@pytest.mark.parametrize("change, match", [
    (dict(hidden_size=96), r"tensor 'model\.embed_tokens\.weight' has shape \[256, 64\], expected \[256, 96\]"),
    (dict(n_routed_experts=4, n_group=2, topk_group=1),
     r"tensor 'model\.layers\.1\.mlp\.gate\.weight' has shape \[8, 64\], expected \[4, 64\]"),
    (dict(num_hidden_layers=2), r"model\.layers\.2\..*num_hidden_layers=2 does not match"),
    (dict(first_k_dense_replace=2), r"missing tensor 'model\.layers\.1\.mlp\.gate_proj\.weight'"),
])
def test_bad_config_does_not_match_tensors(bad, tmp_path, change, match):
    path = os.path.join(bad, "config.json")
    cfg = json.load(open(path))
    cfg.update(change)
    json.dump(cfg, open(path, "w"))
    msg = _convert_fails(bad, tmp_path, match)
    assert "config.json" in msg


def test_bad_include_mtp_without_mtp_layer(tmp_path):
    _convert_fails(os.path.join(FIXTURES, "hf_short"), tmp_path,
                   r"missing tensor 'model\.layers\.3\.enorm\.weight'.*include_mtp", include_mtp=True)


def test_output_exists_refused_unless_overwrite(tmp_path, synth_bf16):
    out = str(tmp_path / "out")
    hf_to_orbax(synth_bf16, out, dtype="float32", progress=False)
    before = os.path.getmtime(os.path.join(out, orbax_io.META_FILE))
    with pytest.raises(OutputExistsError, match="already exists and holds an orbax checkpoint.*--overwrite"):
        hf_to_orbax(synth_bf16, out, dtype="bfloat16", progress=False)
    assert json.load(open(os.path.join(out, orbax_io.META_FILE)))["dtype"] == "float32"
    hf_to_orbax(synth_bf16, out, dtype="bfloat16", overwrite=True, progress=False)
    assert json.load(open(os.path.join(out, orbax_io.META_FILE)))["dtype"] == "bfloat16"
    assert os.path.getmtime(os.path.join(out, orbax_io.META_FILE)) >= before
    assert leftovers(out) == ["out"]
    hf_dir = str(tmp_path / "hf")
    orbax_to_hf(out, hf_dir, progress=False)
    with pytest.raises(OutputExistsError, match="holds an HF checkpoint"):
        orbax_to_hf(out, hf_dir, progress=False)
    orbax_to_hf(out, hf_dir, progress=False, fp8=True, overwrite=True)
    with pytest.raises(OutputExistsError, match="must not be, contain, or lie inside the input"):
        hf_to_orbax(synth_bf16, synth_bf16, overwrite=True, progress=False)
    os.makedirs(tmp_path / "empty")
    hf_to_orbax(synth_bf16, str(tmp_path / "empty"), progress=False)  # an empty directory is fine


def test_bad_orbax_checkpoints(tmp_path, orbax_fp8):
    ck = str(tmp_path / "ck")
    shutil.copytree(orbax_fp8, ck)
    cfg = json.load(open(os.path.join(ck, "config.json")))
    cfg["moe_intermediate_size"] = 48
    json.dump(cfg, open(os.path.join(ck, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"params: parameter 'layers/1/ffn/experts/w_down' has shape \[8, 32, 64\], "
                                              r"expected \[8, 48, 64\] from config.json"):
        dsv32_jax.from_pretrained(ck)
    with pytest.raises(CheckpointError, match="experts/w_(gate|down)"):
        orbax_to_hf(ck, str(tmp_path / "hf"), progress=False)
    meta_path = os.path.join(ck, orbax_io.META_FILE)
    meta = json.load(open(meta_path))
    json.dump({**meta, "hf_dtypes": [1]}, open(meta_path, "w"))  # (an AttributeError deep in the export plan)
    with pytest.raises(CheckpointError, match=re.escape(f"{meta_path}: field 'hf_dtypes' is [1], expected an object")):
        orbax_to_hf(ck, str(tmp_path / "hf"), progress=False)
    os.remove(os.path.join(ck, orbax_io.META_FILE))
    with pytest.raises((CheckpointError, ConfigError)):  # no marker: treated as HF dir, which has no safetensors
        dsv32_jax.from_pretrained(ck)
    with pytest.raises(CheckpointError, match=re.escape(f"{ck}: not a dsv32-jax orbax checkpoint (dsv32_meta.json")):
        orbax_to_hf(ck, str(tmp_path / "hf"), progress=False)


# ------------------------------------------------------------------------------------------------- atomicity
def test_interrupted_import_leaves_no_complete_directory(tmp_path, synth_fp8, monkeypatch):
    calls = []
    real = orbax_io.ParamsWriter.write

    def flaky(self, group, subtree):
        calls.append(group)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated interruption")
        return real(self, group, subtree)

    monkeypatch.setattr(orbax_io.ParamsWriter, "write", flaky)
    out = str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        hf_to_orbax(synth_fp8, out, dtype="bfloat16", progress=False)
    assert calls == ["globals", "layers.0", "layers.1"]
    assert leftovers(out) == []
    assert not orbax_io.is_orbax_checkpoint(out)


def test_interrupted_export_leaves_no_complete_directory(tmp_path, orbax_fp8, monkeypatch):
    real = ShardedSafetensorsWriter.add
    count = []

    def flaky(self, name, array):
        count.append(name)
        if len(count) == 100:
            raise OSError("disk full (simulated)")
        return real(self, name, array)

    monkeypatch.setattr(ShardedSafetensorsWriter, "add", flaky)
    out = str(tmp_path / "hf")
    with pytest.raises(OSError, match="simulated"):
        orbax_to_hf(orbax_fp8, out, fp8=True, shard_size_gb=SHARD / 1e9, progress=False)
    assert leftovers(out) == []


# ------------------------------------------------------------------------------------------------------- CLI
def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dsv32_jax.checkpoint.convert", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.heavy  # >= 20 s on 2 AMD EPYC cores (2026-12-01): out of make test's 15 minutes
def test_cli_round_trip(tmp_path, synth_fp8):
    """hf -> orbax -> hf through the CLI; the tokenizer files travel with the weights (a served export needs them)."""
    o, hf = str(tmp_path / "o"), str(tmp_path / "hf")
    src = copy_checkpoint(synth_fp8, str(tmp_path / "src"))
    tokenizer = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
                 "tokenizer_config.json": '{"bos_token": "<s>"}'}
    for name, text in tokenizer.items():
        with open(os.path.join(src, name), "w") as f:
            f.write(text)
    r = _cli("hf-to-orbax", f"--hf_dir={src}", f"--out={o}", "--dtype=float8", "--include_mtp")
    assert r.returncode == 0, r.stderr
    assert "B/s" in r.stderr and "267/267 tensors" in r.stderr
    assert "hf-to-orbax: wrote" in r.stdout
    r = _cli("orbax-to-hf", f"--ckpt={o}", f"--out={hf}", "--fp8", f"--shard_size_gb={SHARD / 1e9}", "--noprogress")
    assert r.returncode == 0, r.stderr
    assert compare_checkpoints(synth_fp8, hf) == []
    for name, text in tokenizer.items():
        with open(os.path.join(hf, name)) as f:
            assert f.read() == text, name
    r = _cli("orbax-to-hf", f"--ckpt={o}", f"--out={hf}")
    assert r.returncode == 1 and "--overwrite" in r.stderr and "Traceback" not in r.stderr
    r = _cli("convert-everything", f"--out={o}")
    assert r.returncode != 0 and "hf-to-orbax or orbax-to-hf" in r.stderr
    # a flag of the other command was ignored silently (hf-to-orbax --fp8 wrote bfloat16)
    r = _cli("hf-to-orbax", f"--hf_dir={src}", f"--out={tmp_path / 'x'}", "--fp8")
    assert r.returncode != 0 and "--fp8: not a flag of hf-to-orbax (FP8 import: --dtype=float8)" in r.stderr
    r = _cli("orbax-to-hf", f"--ckpt={o}", f"--out={tmp_path / 'y'}", "--mesh=fsdp:64", "--include_mtp")
    assert r.returncode != 0 and "--include_mtp, --mesh: not a flag of orbax-to-hf" in r.stderr
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


# -------------------------------------------------------------------------------------------------- sharding
SHARDED_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import dsv32_jax
from dsv32_jax.checkpoint import orbax_io
from dsv32_jax.checkpoint.convert import hf_to_orbax
src, out = sys.argv[1:3]
assert len(jax.devices()) == 8
hf_to_orbax(src, out, dtype="float8", include_mtp=True, mesh="fsdp:2,tensor:4", progress=False)
meta = json.load(open(out + "/dsv32_meta.json"))
model = dsv32_jax.from_pretrained(out, dtype=jnp.float32, mesh="fsdp:2,tensor:4")
plain = dsv32_jax.from_pretrained(out, dtype=jnp.float32)
sharded = dict(orbax_io.flatten_pure(nnx.to_pure_dict(nnx.state(model))))
single = dict(orbax_io.flatten_pure(nnx.to_pure_dict(nnx.state(plain))))
assert sharded.keys() == single.keys()
same = all(np.array_equal(np.asarray(sharded[k]), np.asarray(single[k])) for k in single)
from_hf = dsv32_jax.from_pretrained(src, dtype=jnp.float32, mesh="fsdp:2,tensor:4", include_mtp=True)
hf_flat = dict(orbax_io.flatten_pure(nnx.to_pure_dict(nnx.state(from_hf))))
same_hf = all(np.array_equal(np.asarray(hf_flat[k]), np.asarray(single[k])) for k in single)
same_hf_sharding = all(hf_flat[k].sharding == sharded[k].sharding for k in single)
spec = lambda x: [a for a in x.sharding.spec]
print(json.dumps({"meta_mesh": meta["mesh"], "same": same, "same_hf": same_hf, "same_hf_sharding": same_hf_sharding,
                  "specs": {
  "embed": spec(model.embed[...]),
  "w_gate": spec(model.layers[1].ffn.experts.w_gate[...]),
  "q_b": spec(model.layers[0].attn.q_b_proj.kernel[...]),
  "mtp_w_down": spec(model.mtp[0].block.ffn.experts.w_down[...]),
  "n_shards": len(model.layers[1].ffn.experts.w_gate[...].addressable_shards)}}))
"""


def test_sharded_conversion_and_load_on_8_cpu_devices(tmp_path, synth_fp8):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_SCRIPT)
    env = {**os.environ, "XLA_FLAGS": child_xla_flags("--xla_force_host_platform_device_count=8"), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, str(script), synth_fp8, str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["meta_mesh"] == {"fsdp": 2, "tensor": 4}
    assert res["same"] and res["same_hf"] and res["same_hf_sharding"]  # HF-dir loading shards the same way
    assert res["specs"]["embed"] == ["tensor", "fsdp"]
    assert res["specs"]["w_gate"] == [None, "fsdp", "tensor"]  # the mesh has no 'expert' axis
    assert res["specs"]["mtp_w_down"] == [None, "tensor", "fsdp"]
    assert res["specs"]["q_b"] == ["fsdp", "tensor"]
    assert res["specs"]["n_shards"] == 8


def test_cli_out_under_a_regular_file_is_a_one_line_error(tmp_path):
    """--out=<a regular file>/x gave a FileExistsError traceback from atomic_output_dir (main caught no OSError;
    audit F10): both commands now print `error: --out=...: <strerror>` with exit code 1, before converting."""
    o = str(tmp_path / "o")
    hf_to_orbax(os.path.join(FIXTURES, "hf_short"), o, dtype="float32", progress=False)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for args in (["hf-to-orbax", f"--hf_dir={os.path.join(FIXTURES, 'hf_short')}"], ["orbax-to-hf", f"--ckpt={o}"]):
        out = str(afile / "sub" / "x")
        r = _cli(*args, f"--out={out}", "--noprogress")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert r.stderr.strip() == f"error: --out={out}: Not a directory: {afile}", r.stderr
    assert sorted(os.listdir(tmp_path)) == ["afile", "o"]


def test_atomic_output_dir_removes_its_temporary_when_the_final_rename_fails(tmp_path, monkeypatch):
    from dsv32_jax.checkpoint import io_utils

    out = str(tmp_path / "out")
    real = os.rename

    def failing(src, dst):
        if dst == out and ".tmp-" in src:  # the finished output cannot be renamed into place
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(io_utils.os, "rename", failing)
    with pytest.raises(io_utils.OutputPathError, match=r"out: No space left on device"):
        with io_utils.atomic_output_dir(out) as tmp:
            open(os.path.join(tmp, "f"), "w").close()
    assert leftovers(out) == []
    os.makedirs(out)  # an existing output (--overwrite) stays in place when its replacement cannot be renamed
    open(os.path.join(out, "old"), "w").close()
    with pytest.raises(io_utils.OutputPathError):
        with io_utils.atomic_output_dir(out, overwrite=True) as tmp:
            open(os.path.join(tmp, "new"), "w").close()
    assert leftovers(out) == ["out"] and os.listdir(out) == ["old"]
