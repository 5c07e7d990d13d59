"""Training entry point: `python -m dsv32_jax.train.main --config=configs/<experiment>.py --workdir=W [--config.x=y ...]`.

Multi-host: pass --coordinator_address, --num_processes and --process_id (or set them through the
environment that `jax.distributed.initialize()` understands, with --distributed)."""

from __future__ import annotations

import logging as pylogging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from dsv32_jax.train.config import CONFIGS_DIR

# With no --config: the first stage of the CPU demo (needs no earlier checkpoint; built-in data, tiny model).
_DEFAULT_CONFIG = os.path.join(CONFIGS_DIR, "dense_tiny.py")
config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "experiment config file (configs/*.py)")
flags.DEFINE_string("workdir", "", "checkpoints, metrics.jsonl, TensorBoard events (default runs/<config name>)")
flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() (auto-detected cluster environment)")
flags.DEFINE_string("coordinator_address", "", "host:port of process 0 for multi-host runs")
flags.DEFINE_integer("num_processes", 1, "number of processes in a multi-host run")
flags.DEFINE_integer("process_id", 0, "this process's index in a multi-host run")
FLAGS = flags.FLAGS


class QuietLibraries(pylogging.Filter):
    """Drops INFO-level records that libraries log through absl (orbax logs every file it writes); warnings and
    errors pass, and so does everything logged by this package."""

    QUIET = tuple(f"{os.sep}{name}{os.sep}" for name in ("orbax", "jax", "jaxlib", "grain", "etils", "flax"))

    def filter(self, record: pylogging.LogRecord) -> bool:
        return record.levelno >= pylogging.WARNING or not any(q in record.pathname for q in self.QUIET)


def main(argv):
    del argv
    import jax

    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.INFO)  # our progress and resume / init messages
        logging.get_absl_handler().addFilter(QuietLibraries())

    if FLAGS.coordinator_address or FLAGS.num_processes > 1:
        jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    elif FLAGS.distributed:
        jax.distributed.initialize()
    from dsv32_jax.config import ConfigError
    from dsv32_jax.train.run import InitFromMissing, run

    config = FLAGS.config
    name = os.path.splitext(os.path.basename(config_flags.get_config_filename(FLAGS["config"])))[0]
    workdir = FLAGS.workdir or os.path.join("runs", name)
    print(f"config {name} (stage {config.stage}) -> workdir {workdir} on {jax.device_count()} device(s)", flush=True)
    try:
        run(config, workdir)
    except (InitFromMissing, ConfigError) as e:  # a usage problem: the message says what to do, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def cli() -> None:
    """Console script `dsv32-train` (same flags as `python -m dsv32_jax.train.main`)."""
    sys.modules["__main__"].__doc__ = __doc__  # what absl's --help prints (the console-script wrapper has none)
    app.run(main)


if __name__ == "__main__":
    cli()
