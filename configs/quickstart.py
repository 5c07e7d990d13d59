"""The no-flag run (`python -m dsv32_jax.train.main`): the default config (train/config.py's default_config():
tiny MoE + DSA model, sparse stage, built-in corpus, byte tokens) from random initialization, a few CPU steps.
It needs no earlier stage; the paper's full recipe is `make train` (configs/{dense,warmup,sparse}_tiny.py)."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.init_from = ""
    c.steps = 20
    c.optimizer.warmup_steps = 5
    c.optimizer.decay_steps = 20
    c.data.seq_len = 64
    c.data.batch_size = 4
    c.checkpoint.every = 10
    c.log_every = 5
    return c
