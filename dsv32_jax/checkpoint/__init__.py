"""Checkpoints: the 128x128 FP8 block codec, safetensors reading and streaming writing, HF tensor names, the one
validator, the orbax format, `from_pretrained` and the `dsv32-convert` CLI. Each module imports only the ones before
it in `fp8_weights -> safetensors_io -> io_utils -> hf -> validate -> orbax_io -> loading -> convert`, and the model."""
