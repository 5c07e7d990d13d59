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
        "list_dtype": ({"w": {**ok, "dtype": ["F32"]}}, r"tensor 'w' has dtype \['F32'\] \(a string"),  # (unhashable)
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


# ------------------------------------------------------------------------------------ gaps (mutation testing)
def test_a_byte_range_shorter_than_the_shape_is_refused(tmp_path):
    """A header whose data_offsets span fewer bytes than shape x itemsize would memory-map the next tensor's bytes
    (or past the end) as this one: refused by name. Here F32 [2] needs 8 bytes, the range has 4."""
    import pytest

    from dsv32_jax.checkpoint.safetensors_io import CheckpointError, SafetensorsFile

    path = _raw_safetensors(tmp_path / "short.safetensors",
                            {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
                             "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})
    with pytest.raises(CheckpointError, match=r"short\.safetensors: tensor 'w' byte range 4 != 8"):
        SafetensorsFile(path)


def test_negative_block_scales_are_refused(tmp_path):
    """FP8 block scales are amax / 448 >= 0 (reference_spec: weight_scale_inv); a negative one (a corrupt shard)
    would flip the sign of a whole 128x128 block silently."""
    import pytest

    from dsv32_jax.checkpoint.safetensors_io import CheckpointError, check_scale_values

    write_safetensors(str(tmp_path / "model.safetensors"), {"w.weight_scale_inv": np.ones((2, 2), np.float32)})
    ckpt = HFCheckpoint(str(tmp_path))
    check_scale_values(ckpt, "w.weight_scale_inv", np.array([[1.0, 0.0]], np.float32))  # zero is allowed
    bad = r"scale 'w\.weight_scale_inv' has an invalid value -0\.5 at block \[1, 0\]"  # a plain float, not np.float32(...)
    with pytest.raises(CheckpointError, match=bad):
        check_scale_values(ckpt, "w.weight_scale_inv", np.array([[1.0, 2.0], [-0.5, 1.0]], np.float32))


def test_shard_plan_fills_a_shard_up_to_exactly_the_limit(tmp_path):
    """A tensor starts a new shard only when it would make the current one exceed max_shard_bytes (HF's
    `size + n > max` rule); two 100-byte tensors fill a 200-byte shard exactly. Written and read back."""
    from dsv32_jax.checkpoint.safetensors_io import ShardedSafetensorsWriter

    entries = [(n, (25,), "F32") for n in ("a", "b", "c")]  # 100 bytes each
    w = ShardedSafetensorsWriter(str(tmp_path), entries, max_shard_bytes=200)
    assert w.files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, (n, s, _) in enumerate(entries):
        w.add(n, np.full(s, i, np.float32))
    w.close()
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert index["weight_map"] == {"a": w.files[0], "b": w.files[0], "c": w.files[1]}
    assert index["metadata"]["total_size"] == 300
    ckpt = HFCheckpoint(str(tmp_path))
    for i, n in enumerate("abc"):
        np.testing.assert_array_equal(ckpt.get(n), np.full(25, i, np.float32))
