"""CPU demo, stage 1 (dense warm-up, eq. 3): only the indexer trains, to match the head-summed dense attention
of the frozen model from configs/dense_tiny.py."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "warmup"
    c.model = "tiny"
    c.init_from = "runs/demo/dense"
    c.steps = 150
    c.optimizer.lr = 1e-3  # the paper's warm-up learning rate
    c.optimizer.warmup_steps = 5
    c.optimizer.schedule = "constant"
    c.data.seq_len = 128
    c.data.batch_size = 8
    c.data.seed = 1
    c.checkpoint.every = 50
    c.log_every = 25
    c.eval.every = 50  # held-out loss (metric eval_loss; train/eval.py)
    return c
