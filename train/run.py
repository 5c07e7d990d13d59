"""Runs one configured stage (dense / warmup / sparse / grpo) in a workdir."""

from __future__ import annotations

import os

import jax

from dsv32_jax.train import data as data_lib
from dsv32_jax.train.trainer import Trainer, write_summary


# The stage whose workdir each stage starts from in the paper's recipe (and in the CPU demo, `make train`).
PREVIOUS_STAGE = {"warmup": "dense", "sparse": "warmup", "grpo": "sparse"}


class InitFromMissing(FileNotFoundError):
    """config.init_from names a path that does not exist."""


def check_init_from(config) -> None:
    """A clear error for a missing `config.init_from`, naming the stage to run first."""
    init = config.init_from
    if not init or os.path.exists(init):
        return
    msg = f"config.init_from={init!r} does not exist (stage {config.stage!r} starts from a checkpoint there)."
    prev = PREVIOUS_STAGE.get(config.stage)
    if prev:
        msg += (f" Run the {prev} stage first, e.g. `python -m dsv32_jax.train.main --config=configs/{prev}_tiny.py "
                f"--workdir={init}` (or `make train` for the whole CPU demo),")
    else:
        msg += " Point it at an HF or converted checkpoint or a training workdir,"
    msg += " or pass --config.init_from='' to start from a random initialization."
    raise InitFromMissing(msg)


def run(config, workdir: str):
    check_init_from(config)
    os.makedirs(workdir, exist_ok=True)
    if config.stage == "grpo":
        from dsv32_jax.train.grpo import run_grpo
        return run_grpo(config, workdir)
    trainer = Trainer(config, workdir)
    data_cfg = data_lib.DataConfig(**config.data.to_dict())
    it = data_lib.make_iterator(data_cfg, vocab_size=trainer.cfg.vocab_size, process_index=jax.process_index(),
                                process_count=jax.process_count())
    history = trainer.fit(it)
    write_summary(workdir, history)
    print(f"done: {trainer.step} steps of stage {config.stage} in {workdir}", flush=True)
    return history
