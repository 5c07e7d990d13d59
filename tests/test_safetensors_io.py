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
