"""Runs one configured stage (dense / warmup / sparse / grpo) in a workdir."""

from __future__ import annotations

import os

import jax

from dsv32_jax.train import data as data_lib
from dsv32_jax.train.trainer import Trainer, write_summary


def run(config, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    if config.stage == "agent":
        from dsv32_jax.train.agent_grpo import run_agent
        return run_agent(config, workdir)
    if config.stage == "grpo":
        from dsv32_jax.train.grpo import run_grpo
        return run_grpo(config, workdir)
    trainer = Trainer(config, workdir)
    data_cfg = data_lib.DataConfig(**config.data.to_dict())
    it = data_lib.make_iterator(data_cfg, vocab_size=trainer.cfg.vocab_size, process_index=jax.process_index(),
                                process_count=jax.process_count())
    try:
        history = trainer.fit(it)
    finally:  # stop grain's prefetch threads before the interpreter exits
        it.close()
    write_summary(workdir, history)
    print(f"done: {trainer.step} steps of stage {config.stage} in {workdir}", flush=True)
    return history
