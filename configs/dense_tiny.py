"""CPU demo, stage 0: LM pre-training of the tiny model with dense attention (the "dense checkpoint" that the
paper's DSA adaptation starts from). Built-in corpus, byte tokens."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "dense"
    c.model = "tiny"
    c.steps = 300
    c.optimizer.lr = 3e-3
    c.optimizer.decay_steps = 300
    c.data.seq_len = 128
    c.data.batch_size = 8
    c.checkpoint.every = 100
    c.log_every = 25
    c.eval.every = 50  # held-out loss (metric eval_loss; train/eval.py)
    return c
