"""CPU demo, stage 2 (sparse training, eq. 4): top-k sparse attention, LM loss for the main model, KL on the
selected set for the indexer (inputs detached). Starts from configs/warmup_tiny.py's workdir."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "sparse"
    c.model = "tiny"
    c.init_from = "runs/demo/warmup"
    c.steps = 150
    c.optimizer.lr = 1e-3
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 5
    c.loss.mtp_weight = 0.1
    c.loss.bias_update_speed = 1e-3
    c.data.seq_len = 128
    c.data.batch_size = 8
    c.data.seed = 2
    c.checkpoint.every = 50
    c.log_every = 25
    c.eval.every = 50  # held-out loss (metric eval_loss; train/eval.py)
    return c
