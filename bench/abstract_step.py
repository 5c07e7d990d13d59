"""One full train step of a recipe (e.g. configs/warmup_671b.py) traced, lowered and optionally compiled for the
recipe's whole mesh without its devices; prints the memory per device.

    python bench/abstract_step.py --config=warmup_671b                 # lower against an AbstractMesh (any venv)
    .venv-cuda/bin/python bench/abstract_step.py --config=warmup_671b --compile [--layers=2]
        # compile for a deviceless H100 topology of the mesh's size (tools/gpu_compile's target config);
        # XLA_FLAGS=--xla_gpu_enable_cub_radix_sort=false is set (CUB sort needs a live GPU to compile)

Checks the batch against the mesh first (train.config.check_batch_mesh). Reports the parameter + optimizer-state
bytes per device from the sharding rules (exact), and with --compile XLA's memory analysis per device (arguments,
outputs, temp: activations and everything else the step allocates) and how many times the SPMD partitioner had to
replicate a tensor it could not reshard ("involuntary full rematerialization": a sharding gap to fix).
--layers=N builds the recipe's model with N layers (first dense, the rest MoE) for quick iterations.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="warmup_671b", help="experiment name under configs/")
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the recipe's)")
    p.add_argument("--compile", action="store_true", help="compile for a deviceless H100 topology (.venv-cuda)")
    a = p.parse_args(argv)
    if a.compile:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "cub_radix_sort" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_cub_radix_sort=false").strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh, AxisType, Mesh

    from dsv32_jax import sharding as shd
    from dsv32_jax.train import steps
    from dsv32_jax.train.config import base_config, check_batch_mesh
    from dsv32_jax.train.optimizer import learning_rate_schedule
    from dsv32_jax.train.trainer import Trainer

    c = base_config(a.config)
    if a.layers:
        c.model_overrides = {"num_hidden_layers": a.layers, "first_k_dense_replace": min(1, a.layers)}
    sizes = shd.parse_mesh_spec(c.mesh)
    n = math.prod(sizes.values())
    check_batch_mesh(c, num_devices=n)
    t0 = time.perf_counter()
    trainer = Trainer(c, os.path.join("/tmp", "abstract_step"), allocate=False)
    graphdef, state = trainer.abstract_state()
    per_device = shd.per_device_bytes(state, sizes)
    print(f"{a.config}: mesh {c.mesh} ({n} devices), batch {c.data.batch_size} x {c.data.seq_len}, "
          f"{trainer.cfg.num_hidden_layers} layers; parameters + optimizer state per device: {per_device / 2**30:.2f} "
          "GiB", flush=True)
    if a.compile:
        from jax.experimental import topologies
        with open(os.path.join(os.path.dirname(HERE), "tools", "gpu_compile", "h100_target_config.txtpb")) as f:
            topo = topologies.get_topology_desc(platform="cuda", topology=f"1x{max(n // 8, 1)}x{min(n, 8)}",
                                                target_config=f.read())
        mesh = Mesh(np.asarray(topo.devices).reshape([sizes[x] for x in shd.MESH_AXES]), shd.MESH_AXES)
    else:
        mesh = AbstractMesh(tuple(sizes[x] for x in shd.MESH_AXES), shd.MESH_AXES,
                            axis_types=(AxisType.Auto,) * len(shd.MESH_AXES))
    st_sh = shd.state_shardings(state, mesh)
    state = shd.abstract_sharded(state, st_sh)
    bsh = steps.lm_batch_sharding(mesh)
    shape = (c.data.batch_size, c.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=bsh)
             for k in steps.LM_BATCH_KEYS}
    fn = steps.compile_lm_step(st_sh, bsh, graphdef=graphdef, stage=trainer.stage, trainable=trainer.filter,
                               weights=steps.LossWeights.from_config(c.loss), model_cfg=trainer.cfg,
                               lr_schedule=learning_rate_schedule(c.optimizer))
    with shd.use_mesh(mesh):
        if a.compile:
            with jax.default_device(mesh.devices.flat[0]):
                lowered = fn.trace(state, batch).lower()
        else:
            lowered = fn.trace(state, batch).lower(lowering_platforms=("cuda",))
    t1 = time.perf_counter()
    print(f"lowered in {t1 - t0:.1f}s ({len(lowered.as_text()) / 1e6:.1f} MB of StableHLO)", flush=True)
    if not a.compile:
        return 0
    compiled = lowered.compile()
    ma = compiled.memory_analysis()
    print(f"compiled in {time.perf_counter() - t1:.1f}s; per device: arguments {ma.argument_size_in_bytes / 2**30:.2f}"
          f" GiB, outputs {ma.output_size_in_bytes / 2**30:.2f} GiB (aliased {ma.alias_size_in_bytes / 2**30:.2f}), "
          f"temp {ma.temp_size_in_bytes / 2**30:.2f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
