"""GPU: GRPO for the small model (dsv32_jax/presets/small.json) on the built-in tasks, from a sparse-stage workdir
or checkpoint (--config.init_from=...). Sampling with top-p (keep sampling mask active), Pallas sparse MLA."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "grpo"
    c.model = "small"
    c.dtype = "bfloat16"
    c.attention = "kernel"
    c.steps = 500
    c.optimizer.lr = 1e-5
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 10
    c.grpo.tasks = "map,sum,rev,copy"
    c.grpo.group_size = 16
    c.grpo.prompts_per_step = 32
    c.grpo.max_new_tokens = 16
    c.grpo.top_p = 0.95
    c.grpo.max_candidates = 64
    c.grpo.kl_weight = 0.01
    c.grpo.kl_weights = {"map": 0.0}
    c.grpo.length_target = 4
    c.checkpoint.every = 50
    return c
