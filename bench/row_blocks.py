"""Which rows of the global batch each host loads, for a recipe on a multi-host TPU slice, without any device: the
topology of `--topology` (libtpu's deviceless description: its chips and the host each chip sits on), the recipe's
mesh over it, and `shd.process_row_block` per host: the data shard each host's pipeline reads (trainer.data_shard).
Fails when a host's rows are no block of the batch.

    .venv-tpu/bin/python bench/row_blocks.py --config=sparse_671b_v5p --topology=v5p:16x16x8
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="an experiment file of configs/ (its mesh and data.batch_size)")
    p.add_argument("--topology", required=True, help="a TPU topology, e.g. v5p:16x16x8 (chips = the mesh's size)")
    a = p.parse_args(argv)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    from dsv32_jax.model import sharding as shd
    from dsv32_jax.train import steps
    from dsv32_jax.train.config import base_config

    c = base_config(a.config)
    devices = topologies.get_topology_desc(platform="tpu", topology_name=a.topology).devices
    sharding = steps.lm_batch_sharding(shd.make_mesh(c.mesh, devices=devices))
    hosts = sorted({d.process_index for d in devices})
    try:
        blocks = {h: shd.process_row_block(sharding, (c.data.batch_size, c.data.seq_len), h) for h in hosts}
    except ValueError as e:
        print(f"FAILED: {a.config} mesh {c.mesh} on {a.topology}: {e}")
        return 1
    n = next(iter(blocks.values()))[1]
    sharing = collections.Counter(i for i, _ in blocks.values())
    print(f"{a.config}: mesh {c.mesh} on {a.topology} ({len(devices)} chips, {len(hosts)} hosts): batch "
          f"{c.data.batch_size} in {n} row blocks of {c.data.batch_size // n} rows, each loaded by "
          f"{'/'.join(map(str, sorted(set(sharing.values()))))} hosts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
