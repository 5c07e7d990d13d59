"""Training entry point: `python -m dsv32_jax.train.main --config=configs/<experiment>.py --workdir=W [--config.x=y ...]`.

With no flags it runs configs/quickstart.py (a few steps of the tiny model from random init, built-in data) in
runs/quickstart. Multi-host: pass --coordinator_address, --num_processes and --process_id (or set them through the
environment that `jax.distributed.initialize()` understands, with --distributed)."""

from __future__ import annotations

import faulthandler
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from dsv32_jax.train.config import CONFIGS_DIR

_DEFAULT_CONFIG = os.path.join(CONFIGS_DIR, "quickstart.py")
_PARSE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, OSError, SyntaxError, ImportError)


def _refuse(e: BaseException, argv) -> None:
    """A config file or override that ml_collections refuses, in one line (exit 2) instead of a traceback."""
    print(f"error: {_unknown_field(e, argv) or _locked_field(e, argv) or _config_file_error(e, argv) or _plain(e)}",
          file=sys.stderr, flush=True)
    sys.exit(2)


def _config_path(argv) -> str:
    """The config file of the command line (--config=FILE[:args] or --config FILE), else the default one."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1].split(":")[0]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1].split(":")[0]
    return _DEFAULT_CONFIG


def _config_file_error(e: BaseException, argv) -> str | None:
    """A config file that does not load, named with its line: a syntax error, a failed import, a file without
    get_config() (a JSON or YAML file given as the config)."""
    path = _config_path(argv)
    if isinstance(e, SyntaxError):
        return f"--config={path}: line {e.lineno}: SyntaxError: {e.msg}"
    if isinstance(e, ImportError):
        return f"--config={path}: {type(e).__name__}: {e}"
    if isinstance(e, AttributeError) and "get_config" in str(e):
        return (f"--config={path}: not a Python config file defining get_config() (configs/*.py are examples"
                + ("; JSON and YAML files are not read as configs)" if not path.endswith(".py") else ")"))
    return None


def _locked_field(e: BaseException, argv) -> str | None:
    """A config file that sets a field default_config does not have (the config is locked: ml_collections'
    message lists every field of the section): the file, its line, the section and the closest field names."""
    import difflib
    import re
    import traceback

    m = re.search(r'Key "([^"]+)" does not exist and cannot be added since the config is locked', str(e))
    if not isinstance(e, AttributeError) or not m:
        return None
    key, path = m.group(1), _config_path(argv)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(path)]
    line = frames[-1] if frames else None
    where = f", line {line.lineno}" if line else ""
    # the section from the source line (`c.optimizer.lrr = 5.0` -> config.optimizer)
    chain = re.search(rf"\b([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\.{re.escape(key)}\b", line.line or "") if line else None
    parts = chain.group(1).split(".")[1:] if chain else None
    section = ".".join(["config", *parts]) if parts is not None else "the config"
    hint = ""
    if parts is not None:
        from dsv32_jax.train.config import default_config

        node = default_config()
        try:
            for p in parts:
                node = node[p]
            close = difflib.get_close_matches(key, list(node.keys()), n=3)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        except (KeyError, AttributeError, TypeError):
            pass
    return f"--config={path}{where}: {section} has no field {key!r}{hint}"


def _config_traceback(text: str, argv) -> str | None:
    """ml_collections' "Error whilst parsing config file: Traceback ..." (an exception raised inside the config
    file's get_config(), e.g. a field set to a value of the wrong type) as the file, its line and the exception."""
    import re

    if "Error whilst parsing config file:" not in text:
        return None
    tb = text.split("Error whilst parsing config file:", 1)[1]
    lines = [line.strip() for line in tb.strip().splitlines() if line.strip()]
    path = _config_path(argv)
    at = [m for m in re.finditer(r'File "([^"]+)", line (\d+)', tb)
          if os.path.abspath(m.group(1)) == os.path.abspath(path)]
    where = f", line {at[-1].group(2)}" if at else ""
    return f"--config={path}{where}: {lines[-1] if lines else tb.strip()}"


def _define_config_flag() -> None:
    """--config. Without --config on the command line, ml_collections loads the default file and applies the
    --config.* overrides of sys.argv here, at import, before absl parses anything (so before _parse_flags):
    a misspelled field in that case is refused here the same way."""
    try:
        config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "experiment config file (configs/*.py; "
                                        "default: configs/quickstart.py, a few steps from random init)")
    except _PARSE_ERRORS as e:
        _refuse(e, sys.argv)
flags.DEFINE_string("workdir", "", "checkpoints, metrics.jsonl, TensorBoard events (default runs/<config name>)")
flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() (auto-detected cluster environment)")
flags.DEFINE_string("coordinator_address", "", "host:port of process 0 for multi-host runs")
flags.DEFINE_integer("num_processes", 1, "number of processes in a multi-host run")
flags.DEFINE_integer("process_id", 0, "this process's index in a multi-host run")
FLAGS = flags.FLAGS

# Libraries that log routine progress at INFO through absl (orbax: every file it writes or renames); their records
# below WARNING are dropped from the console unless --verbosity is given.
QUIET_PACKAGES = ("orbax",)


class _QuietLibraries:
    """logging.Filter: drops records below WARNING that come from a module of QUIET_PACKAGES. Orbax logs through
    absl.logging, i.e. the Python logger "absl" (not "orbax"), so the origin is told by the record's file."""

    def __init__(self, packages=QUIET_PACKAGES):
        import importlib.util
        import logging as std_logging

        self._warning = std_logging.WARNING
        self.dirs = []
        for name in packages:
            spec = importlib.util.find_spec(name)
            for loc in (spec.submodule_search_locations or []) if spec else []:
                self.dirs.append(os.path.join(os.path.abspath(loc), ""))

    def filter(self, record) -> bool:
        return record.levelno >= self._warning or not any(record.pathname.startswith(d) for d in self.dirs)


def configure_logging() -> None:
    """INFO (our messages: resumed from ..., initialized parameters from ...) on the console; orbax's and JAX's
    routine INFO chatter stays out. --verbosity=N overrides the level and keeps every library's records."""
    import logging as std_logging

    if FLAGS["verbosity"].present:
        return
    logging.set_verbosity(logging.INFO)
    for name in QUIET_PACKAGES + ("orbax.checkpoint", "jax"):  # libraries using their own Python loggers
        std_logging.getLogger(name).setLevel(std_logging.WARNING)
    logging.get_absl_handler().addFilter(_QuietLibraries())


def multihost_flag_problem(coordinator_address: str, num_processes: int, process_id: int) -> str | None:
    """What is wrong with the multi-host flags, naming them; None when they are consistent."""
    if num_processes < 1:
        return f"--num_processes must be >= 1, got {num_processes}"
    if not 0 <= process_id < num_processes:
        return f"--process_id must be in [0, --num_processes={num_processes}), got {process_id}"
    if num_processes > 1 and not coordinator_address:
        return (f"--num_processes={num_processes} needs --coordinator_address=host:port (process 0's), or use "
                "--distributed where the cluster environment names it")
    return None


def main(argv):
    del argv
    faulthandler.enable()  # a native crash (XLA, grain threads) prints the Python stacks instead of a bare exit code
    import jax

    configure_logging()
    problem = multihost_flag_problem(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    if problem:  # (jax.distributed.initialize's own errors are tracebacks that name no flag)
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    if FLAGS.coordinator_address or FLAGS.num_processes > 1:
        jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    elif FLAGS.distributed:
        jax.distributed.initialize()
    from dsv32_jax.train.config import check_init_from
    from dsv32_jax.train.run import SETUP_ERRORS, SetupError, setup

    config = FLAGS.config
    name = os.path.splitext(os.path.basename(config_flags.get_config_filename(FLAGS["config"])))[0]
    workdir = FLAGS.workdir or os.path.join("runs", name)
    try:
        try:
            check_init_from(config, name)
        except SETUP_ERRORS as e:
            raise SetupError(str(e)) from e
        print(f"config {name} (stage {config.stage}) -> workdir {workdir} on {jax.device_count()} device(s)",
              flush=True)
        fit = setup(config, workdir)
    except SetupError as e:  # a refused configuration or input: its message, not a traceback
        if FLAGS["verbosity"].present:
            logging.exception("setup failed")
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    from dsv32_jax.train.checkpointing import ResumeError
    from dsv32_jax.train.loop import DataError, DataExhausted, NonFinite

    try:
        fit()
    except (ResumeError, DataExhausted, DataError) as e:  # the workdir's checkpoint was written by another
        # configuration or cannot be read, the data ran out before the first step, or a record was refused
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except NonFinite as e:  # the run diverged: stopped before logging or saving the step
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _plain(e: BaseException) -> str:
    """An exception's text without the quoting a KeyError adds (ml_collections' 'Did you mean ...' hint is one)."""
    import ast

    text = str(e)
    for _ in range(2):
        if text[:1] in "'\"":
            try:
                text = str(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                break
    return " ".join(text.split())


def _parse_flags(argv):
    """absl's flag parsing, with what it refuses (an unknown flag, a value of the wrong type) and a config file or
    override that ml_collections refuses (a missing file, a misspelled field) reported in one line (exit 2), not
    absl's "FATAL" (exit 1) or a traceback."""
    try:
        return FLAGS(argv)
    except flags.Error as e:  # an unknown flag, a value of the wrong type (absl's own handler: "FATAL", exit 1)
        config_error = _config_traceback(str(e), argv)
        if config_error:  # (no flag help: the config file's own code raised)
            print(f"error: {config_error}", file=sys.stderr, flush=True)
            sys.exit(2)
        print(f"error: {' '.join(str(e).split())}\nPass --helpshort or --helpfull to see help on flags.",
              file=sys.stderr, flush=True)
        sys.exit(2)
    except _PARSE_ERRORS as e:
        _refuse(e, argv)


def _unknown_field(e: BaseException, argv) -> str | None:
    """For an override of a field the config does not have (ml_collections raises a KeyError of the bare key,
    wrapped in an AttributeError): the flag, the section and the hint, e.g. "--config.optimizer.zzz=1:
    config.optimizer has no field 'zzz'" instead of "zzz"."""
    cause = e.args[0] if isinstance(e, AttributeError) and e.args and isinstance(e.args[0], KeyError) else e
    if not isinstance(cause, KeyError) or not cause.args:
        return None
    text = str(cause.args[0])
    key, _, hint = text.partition("\n")
    key = key.strip("'\"")
    for arg in argv:
        name = arg.split("=", 1)[0]
        parts = name[len("--config."):].split(".") if name.startswith("--config.") else []
        if key in parts[1:] or (parts and parts[0] == key):
            section = ".".join(["config", *parts[:parts.index(key)]])
            msg = f"{arg}: {section} has no field {key!r}" + (f" ({hint.strip()})" if hint.strip() else "")
            if "model_overrides" in parts[:parts.index(key)]:
                msg += ("; a command line can override only the keys the config file sets, so add it to the "
                        "config's c.model_overrides = {...}")
            return msg
    return None


_define_config_flag()


def cli() -> None:
    """Console script `dsv32-train` (same flags as `python -m dsv32_jax.train.main`)."""
    sys.modules["__main__"].__doc__ = __doc__  # what absl's --help prints (the console-script wrapper has none)
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
