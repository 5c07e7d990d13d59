"""CPU demo: GRPO on built-in verifiable tasks (map a digit, sum of two digits mod 10) with the tiny MoE + DSA
model (random init, 32-token task vocabulary). Curves in <workdir>/curves.png."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "grpo"
    c.model = "tiny"
    # index_topk 6: every prompt token is visible to the first answer token, the selection is active after it
    c.model_overrides = {"vocab_size": 32, "index_topk": 6, "initializer_range": 0.05}
    c.steps = 300
    c.optimizer.lr = 1e-3
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 5
    c.optimizer.weight_decay = 0.0
    c.grpo.tasks = "map,sum"
    c.grpo.kl_weight = 0.001
    c.grpo.top_p = 0.95
    c.grpo.eval_every = 10
    c.checkpoint.every = 50
    c.log_every = 10
    return c
