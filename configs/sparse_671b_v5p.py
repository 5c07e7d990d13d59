"""The paper's sparse training stage (configs/sparse_671b.py) on a TPU v5p slice of 2048 chips (v5p-4096, topology
16x16x8; 95 GiB of HBM per chip): the same mesh fsdp:32,tensor:4,seq:16, batch, microbatches and schedule, with the
Mosaic TPU kernels (attention="kernel": the indexer's top-k and the sparse MLA forward / backward, each per device
inside the attention's shard_map). On TPU the routed experts run as `lax.ragged_dot` (the MoE's CUDA-only blocked
path is not used). Fits: the full 61-layer step compiled for the slice needs 5.58 GiB of arguments + 45.25 GiB temp
= 50.8 GiB per chip (21 Mosaic kernels in the program). Compiled without a TPU on a CPU host:
    .venv-tpu/bin/python bench/abstract_step.py --config=sparse_671b_v5p --compile --platform=tpu \\
        --topology=v5p:16x16x8 --require_kernels [--layers=2]
(BENCHMARKS.md, "Kernels in the sharded steps")."""
from dsv32_jax.configs.sparse_671b import get_config as _sparse_671b


def get_config():
    c = _sparse_671b()
    c.attention = "kernel"
    return c
