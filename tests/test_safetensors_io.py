"""safetensors I/O: small files through `safetensors.numpy.save_file` (write_safetensors), read back by our reader
(which, unlike safetensors.safe_open, returns F8_E4M3 as numpy), bit-exact for every dtype a checkpoint holds."""

import json
import os
import struct

import ml_dtypes
import numpy as np

from dsv32_jax.checkpoint.safetensors_io import HFCheckpoint, write_safetensors


def test_write_then_read_round_trips_bf16_fp8_f32_bitwise(tmp_path, rng):
    tensors = {
        "w.bf16": rng.standard_normal((3, 130)).astype(ml_dtypes.bfloat16),
        "w.fp8": (rng.standard_normal((129, 4)) * 100).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn),
        "w.f32": rng.standard_normal((5,)).astype(np.float32),
        "w.scale_inv": np.abs(rng.standard_normal((2, 1))).astype(np.float32),
    }
    path = tmp_path / "model.safetensors"
    write_safetensors(str(path), tensors, metadata={"source": "test"})
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temporary left behind
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    assert header["__metadata__"] == {"format": "pt", "source": "test"}
    assert {n: header[n]["dtype"] for n in tensors} == {"w.bf16": "BF16", "w.fp8": "F8_E4M3", "w.f32": "F32",
                                                          "w.scale_inv": "F32"}
    ckpt = HFCheckpoint(str(tmp_path))
    for name, want in tensors.items():
        got = np.asarray(ckpt.get(name))
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)


def _raw_safetensors(path, header, data=b"\0" * 8):
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)
    return str(path)


def test_malformed_headers_and_indexes_fail_naming_file_and_tensor(tmp_path):
    """A header that parses as JSON but not as safetensors is refused before any data is read, naming the file and
    the tensor (a negative begin offset used to memory-map the header itself as the tensor's bytes)."""
    import pytest

    from dsv32_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile

    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    cases = {
        "list": ([ok], r"a JSON list, not an object"),
        "entry": ({"w": "F32"}, r"tensor 'w' is a JSON str, not an object"),
        "no_offsets": ({"w": {"dtype": "F32", "shape": [2]}}, r"tensor 'w' has no 'data_offsets'"),
        "three": ({"w": {**ok, "data_offsets": [0, 8, 9]}}, r"tensor 'w' has data_offsets \[0, 8, 9\]"),
        "negative": ({"w": {**ok, "shape": [0], "data_offsets": [-8, 0]}}, r"tensor 'w' has data_offsets \[-8, 0\]"),
        "backwards": ({"w": {**ok, "data_offsets": [8, 0]}}, r"tensor 'w' has data_offsets \[8, 0\]"),
        "shape": ({"w": {**ok, "shape": [-2, -1]}}, r"tensor 'w' has shape \[-2, -1\]"),
        "float_shape": ({"w": {**ok, "shape": [2.0]}}, r"tensor 'w' has shape \[2.0\]"),
    }
    for label, (header, match) in cases.items():
        path = _raw_safetensors(tmp_path / f"{label}.safetensors", header)
        with pytest.raises(CheckpointError, match=rf"{label}\.safetensors: .*{match}"):
            SafetensorsFile(path)
    np.testing.assert_array_equal(SafetensorsFile(_raw_safetensors(tmp_path / "fine.safetensors", {"w": ok})).get("w"),
                                  np.zeros(2, np.float32))

    bad_index = tmp_path / "index"
    bad_index.mkdir()
    _raw_safetensors(bad_index / "a.safetensors", {"w": ok})
    (bad_index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a.safetensors"]}))
    with pytest.raises(CheckpointError, match=r"index\.json: not a valid safetensors index \(weight_map must map"):
        HFCheckpoint(str(bad_index))

    dup = tmp_path / "dup"
    dup.mkdir()
    _raw_safetensors(dup / "part1.safetensors", {"w": ok})
    _raw_safetensors(dup / "part2.safetensors", {"w": ok})
    with pytest.raises(CheckpointError, match=r"tensor 'w' is in two shards, .*part1\.safetensors and .*part2"):
        HFCheckpoint(str(dup))
