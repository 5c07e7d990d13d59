"""GPU, small model (dsv32_jax/presets/small.json, ~1.5B params): dense warm-up of the indexer (eq. 3).
Start from a dense checkpoint with --config.init_from=<HF dir | converted orbax dir | dense-stage workdir>."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "warmup"
    c.model = "small"
    c.dtype = "bfloat16"
    c.steps = 1000
    c.optimizer.lr = 1e-3
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 20
    c.data.seq_len = 8192
    c.data.batch_size = 4
    c.attn_chunk = 256
    c.index_chunk = 256
    c.checkpoint.every = 200
    c.log_every = 10
    return c
