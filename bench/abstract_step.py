"""One full train step of a recipe (e.g. configs/warmup_671b.py) traced, lowered and optionally compiled for the
recipe's whole mesh without its devices; prints the memory per device and the Pallas kernels in the program.

    python bench/abstract_step.py --config=warmup_671b                 # lower against an AbstractMesh (any venv)
    .venv-cuda/bin/python bench/abstract_step.py --config=warmup_671b --compile [--layers=2] [--microbatches=N]
        [--breakdown=20]
        # compile for a deviceless H100 topology of the mesh's size (tools/gpu_compile's target config);
        # XLA_FLAGS=--xla_gpu_enable_cub_radix_sort=false is set (CUB sort needs a live GPU to compile)
    .venv-tpu/bin/python bench/abstract_step.py --config=sparse_small --compile --platform=tpu --topology=v5p:2x2x2
        [--mesh=fsdp:4,tensor:2] [--attention=kernel] [--require_kernels]
        # the same for a deviceless TPU slice (libtpu from jax[tpu]; the topology's chip count = the mesh's size)

--attention overrides config.attention ("kernel": the Pallas kernels, which the step resolves for the target
chip, not the CPU host: dsv32_jax.kernels._dispatch.target_device); --mesh overrides config.mesh. With --compile
the compiled program's Pallas kernels are counted (`dsv32_jax.kernels.inspect.compiled_kernels`: Mosaic TPU custom
calls, Triton and Mosaic GPU calls); --require_kernels exits 1 when there are none (a kernel step silently compiled
to the references).
Checks the batch against the mesh first (train.config.check_batch_mesh). Reports the parameter + optimizer-state
bytes per device from the sharding rules (exact), and with --compile XLA's memory analysis per device (arguments,
outputs, temp: activations and everything else the step allocates) and how many times the SPMD partitioner had to
replicate a tensor it could not reshard ("involuntary full rematerialization": a sharding gap to fix).
--layers=N builds the recipe's model with N layers (first dense, the rest MoE) for quick iterations;
--microbatches=N overrides config.microbatches. --breakdown=N dumps the compiled step (XLA_FLAGS=--xla_dump_to) and
lists what is live at XLA's memory peak per device (its live-range dump), grouped by shape and the JAX operation
each buffer came from (op_name): the N largest groups.
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


VALUE = re.compile(r" value: <\d+ (\S+) @\S+> \(size=(\d+),offset=\d+\): (\S+)")
PEAK = re.compile(r"^\s+(\S+?)(\{[\d,]*\})?: (\d+) bytes \(cumulative")


def peak_breakdown(dump_dir: str, top: int) -> list[str]:
    """What is live at the compiled step's memory peak (XLA's live-range dump: arguments, outputs and temp
    buffers), grouped by (shape, JAX operation): the `top` largest groups, one line each with the count, GiB and
    the most frequent op_name of the HLO instruction (fusions: in the fused computation)."""
    [ranges] = glob.glob(os.path.join(dump_dir, "*lm_train_step*after_optimizations-live-range.txt"))
    stem = ranges[: -len("-live-range.txt")]
    hlo = open(stem + ".txt").read()
    shapes = {}
    for line in open(stem + "-buffer-assignment.txt"):
        if m := VALUE.match(line):
            shapes.setdefault(m.group(1), m.group(3).split("{")[0])
    text = open(ranges).read()
    start = text.index("(peak):")
    live = [m.groups() for m in map(PEAK.match, text[start:].splitlines()[1:]) if m]
    computations = {m.group(1): m.start() for m in re.finditer(r"^%?(\S+) [(].*[{]$", hlo, re.M)}

    def op_name(name):
        m = re.search(rf"^\s*(?:ROOT )?%{re.escape(name)} = .*$", hlo, re.M)
        if not m:
            return "?"
        line = m.group(0)
        if (called := re.search(r"calls=%(\S+?)[,}\s]", line)) and called.group(1) in computations:
            begin = computations[called.group(1)]
            line = hlo[begin:hlo.find("\n}", begin)]
        names = collections.Counter(re.findall(r'op_name="([^"]+)"', line))
        return names.most_common(1)[0][0].removeprefix("jit(lm_train_step)/") if names else "?"

    groups = collections.defaultdict(lambda: [0, 0])
    for name, _, size in live:
        g = groups[(shapes.get(name, "?"), op_name(name) if "param" not in name else "(argument)")]
        g[0] += 1
        g[1] += int(size)
    total = sum(g[1] for g in groups.values())
    lines = [f"peak {text[text.index('Live ranges at'):start].split()[-1]}: {total / 2**30:.2f} GiB live in "
             f"{len(live)} buffers; the largest groups (count x shape, GiB, JAX operation):"]
    for (shape, op), (count, size) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {count:4d} x {shape:28s} {size / 2**30:8.2f}  {op}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="warmup_671b", help="experiment name under configs/")
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the recipe's)")
    p.add_argument("--compile", action="store_true", help="compile for a deviceless H100 topology (.venv-cuda)")
    p.add_argument("--microbatches", type=int, default=0, help="override config.microbatches (0: the recipe's)")
    p.add_argument("--scan_layers", choices=("recipe", "on", "off"), default="recipe",
                   help="override config.scan_layers (blocks of one structure as one lax.scan)")
    p.add_argument("--platform", choices=("gpu", "tpu"), default="gpu", help="with --compile: the chip")
    p.add_argument("--topology", default="", help="with --platform=tpu: e.g. v5p:2x2x2, v6e:2x4 (chips = mesh size)")
    p.add_argument("--mesh", default="", help="override config.mesh")
    p.add_argument("--attention", default="", help="override config.attention (sparse | kernel | dense)")
    p.add_argument("--batch", type=int, default=0, help="override config.data.batch_size")
    p.add_argument("--seq_len", type=int, default=0, help="override config.data.seq_len")
    p.add_argument("--remat", default="", help="override config.remat (none | full | dots | dots_no_batch)")
    p.add_argument("--token_chunk", type=int, default=-1, help="override config.loss.token_chunk (0: off)")
    p.add_argument("--kl_key_grad", default="", help="override config.kl_key_grad (dense | segment_sum | scatter)")
    p.add_argument("--mla_bwd", default="", help="override config.mla_bwd (recompute | stored | atomic)")
    p.add_argument("--mla_fwd", default="", help="override config.mla_fwd (triton | mosaic_gpu | mosaic_gpu_pingpong)")
    p.add_argument("--mla_pds", default="", help="override config.mla_pds (triton | mosaic_gpu)")
    p.add_argument("--mla_dqkv", default="", help="override config.mla_dqkv (triton | mosaic_gpu)")
    p.add_argument("--save_hlo", default="", help="with --compile: write the compiled step's HLO text there")
    p.add_argument("--require_kernels", action="store_true",
                   help="with --compile: exit 1 if the compiled step holds no Pallas kernel")
    p.add_argument("--breakdown", type=int, default=0,
                   help="with --compile: the N largest groups of buffers live at the memory peak")
    a = p.parse_args(argv)
    if a.breakdown and not a.compile:
        p.error("--breakdown needs --compile (it reads the compiled step's buffer assignment)")
    if a.platform == "tpu" and not a.topology:
        p.error("--platform=tpu needs --topology (e.g. v5p:2x2x2)")
    dump_dir = tempfile.mkdtemp(prefix="abstract_step_") if a.breakdown else None
    if a.compile:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # libtpu's one-process-per-host lock is for real chips; deviceless compiles may run side by side
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        flags = os.environ.get("XLA_FLAGS", "")
        if "cub_radix_sort" not in flags:
            flags += " --xla_gpu_enable_cub_radix_sort=false"
        if dump_dir:
            flags += f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=lm_train_step"
        os.environ["XLA_FLAGS"] = flags.strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh, AxisType, Mesh

    from dsv32_jax.model import sharding as shd
    from dsv32_jax.train import steps
    from dsv32_jax.train.config import base_config, check_batch_mesh
    from dsv32_jax.train.optimizer import learning_rate_schedule
    from dsv32_jax.train.trainer import Trainer

    c = base_config(a.config)
    if a.layers:
        c.model_overrides = {"num_hidden_layers": a.layers, "first_k_dense_replace": min(1, a.layers)}
    if a.microbatches:
        c.microbatches = a.microbatches
    if a.scan_layers != "recipe":
        c.scan_layers = a.scan_layers == "on"
    if a.mesh:
        c.mesh = a.mesh
    if a.attention:
        c.attention = a.attention
    if a.batch:
        c.data.batch_size = a.batch
    if a.seq_len:
        c.data.seq_len = a.seq_len
    if a.remat:
        c.remat = a.remat
    if a.token_chunk >= 0:
        c.loss.token_chunk = a.token_chunk
    if a.kl_key_grad:
        c.kl_key_grad = a.kl_key_grad
    if a.mla_bwd:
        c.mla_bwd = a.mla_bwd
    if a.mla_fwd:
        c.mla_fwd = a.mla_fwd
    if a.mla_pds:
        c.mla_pds = a.mla_pds
    if a.mla_dqkv:
        c.mla_dqkv = a.mla_dqkv
    sizes = shd.parse_mesh_spec(c.mesh)
    n = math.prod(sizes.values())
    check_batch_mesh(c, num_devices=n)
    t0 = time.perf_counter()
    trainer = Trainer(c, os.path.join("/tmp", "abstract_step"), allocate=False)
    graphdef, state = trainer.abstract_state()
    per_device = shd.per_device_bytes(state, sizes)
    print(f"{a.config} ({trainer.stage}, attention={c.attention}): mesh {c.mesh} ({n} devices), batch {c.data.batch_size} x {c.data.seq_len} "
          f"({c.microbatches} microbatches), "
          f"{trainer.cfg.num_hidden_layers} layers{' (scanned)' if c.scan_layers else ''}; parameters + optimizer state per device: {per_device / 2**30:.2f} "
          "GiB", flush=True)
    if a.compile and a.platform == "tpu":
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(platform="tpu", topology_name=a.topology)
        if len(topo.devices) != n:
            raise SystemExit(f"--topology={a.topology} has {len(topo.devices)} devices, the mesh {c.mesh} needs {n}")
        mesh = Mesh(np.asarray(topo.devices).reshape([sizes[x] for x in shd.MESH_AXES]), shd.MESH_AXES)
    elif a.compile:
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
                               lr_schedule=learning_rate_schedule(c.optimizer), microbatches=c.microbatches)
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
    from dsv32_jax.kernels.inspect import compiled_kernels
    text = compiled.as_text()
    if a.save_hlo:
        from dsv32_jax.checkpoint.io_utils import write_text_atomic
        write_text_atomic(a.save_hlo, text)
    kernels = compiled_kernels(text)
    print(f"Pallas kernels in the compiled step ({a.platform}, {mesh.devices.flat[0].device_kind}): "
          f"{sum(kernels.values())} {dict(kernels)}", flush=True)
    if dump_dir:
        print(f"memory peak per device (XLA dump in {dump_dir}):")
        print("\n".join(peak_breakdown(dump_dir, a.breakdown)), flush=True)
    if a.require_kernels and not kernels:
        print(f"FAILED: attention={c.attention} but the compiled step holds no Pallas kernel", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
