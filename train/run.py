"""Runs one configured stage (dense / warmup / sparse / grpo / agent) in a workdir."""

from __future__ import annotations

import os
from typing import Callable

import jax

from dsv32_jax.train import data as data_lib
from dsv32_jax.train.trainer import Trainer, write_summary

# what a refused configuration or input raises while a run is being set up (ConfigError, CheckpointError,
# InitFromError and the config checks are ValueErrors; a missing file an OSError; a missing field a KeyError; a
# value of a type nothing checked a TypeError)
SETUP_ERRORS = (ValueError, KeyError, OSError, TypeError)


class SetupError(Exception):
    """The configuration or one of its inputs was refused before the first step (the cause is chained)."""


def check_data_inputs(config, data_cfg: data_lib.DataConfig) -> None:
    """The training data's and, when the run evaluates, the held-out data's inputs (files, tokenizer), checked
    before the model state is built: a missing eval file used to end the run in a traceback at its first
    evaluation, after steps and checkpoints had been written."""
    data_lib.check_inputs(data_cfg)
    if "eval" in config and config.eval.get("every"):
        from dsv32_jax.train import eval as eval_lib
        try:
            data_lib.check_inputs(eval_lib.eval_data_config(config.data.to_dict(), config.eval))
        except OSError as e:  # a missing file or tokenizer (eval_data_config's own errors name config.eval already)
            raise OSError(f"config.eval (the held-out data): {e}") from e


def setup(config, workdir: str) -> Callable[[], list[dict]]:
    """Builds the stage's learner and data (model, optimizer, mesh, data pipeline: every configuration check
    runs here) and returns the function that trains it. Raises SetupError for a refused configuration or input.
    Nothing is written here: the run creates the workdir with its first output and, if it fails before logging a
    step, removes it again (`loop.NewOutputs`)."""
    try:
        if config.stage == "agent":
            from dsv32_jax.train.agent_grpo import AgentLearner, finish_agent
            learner = AgentLearner(config, workdir)
            fit = lambda: finish_agent(learner, learner.fit())  # noqa: E731
        elif config.stage == "grpo":
            from dsv32_jax.train.grpo import GRPOLearner, finish_grpo
            learner = GRPOLearner(config, workdir)
            fit = lambda: finish_grpo(learner, workdir, learner.fit())  # noqa: E731
        else:
            data_cfg = data_lib.DataConfig(**config.data.to_dict())
            check_data_inputs(config, data_cfg)
            trainer = Trainer(config, workdir)
            if "eval" in config and config.eval.get("every"):
                try:  # the held-out batches, read now: a record without the text field, too few documents or a
                    trainer.evaluator()  # tokenizer too large ended the run at its first evaluation, after steps
                except (ValueError, KeyError, OSError) as e:
                    raise ValueError(f"config.eval (the held-out data): {e}" if "config.eval" not in str(e)
                                     else str(e)) from e
            i, n = trainer.data_shard  # the block of the batch's rows this process's devices own
            if n > 1 and data_cfg.num_epochs is not None:
                raise ValueError(f"data.num_epochs={data_cfg.num_epochs} with {n} processes reading their own rows: "
                                 "their shards run out a few batches apart, and a process that stops while the "
                                 "others step hangs them; use data.num_epochs=None and config.steps")
            it = data_lib.make_iterator(data_cfg, vocab_size=trainer.cfg.vocab_size, process_index=i, process_count=n)

            def fit():
                try:
                    history = trainer.fit(it)
                finally:  # stop grain's prefetch threads before the interpreter exits
                    it.close()
                write_summary(workdir, history)
                print(f"done: {trainer.step} steps of stage {config.stage} in {workdir}", flush=True)
                return history
    except SETUP_ERRORS as e:
        raise SetupError(str(e) or type(e).__name__) from e
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise SetupError(f"--workdir {workdir} exists and is not a directory")
    return fit


def run(config, workdir: str):
    return setup(config, workdir)()
