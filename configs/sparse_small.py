"""GPU, small model: sparse continued pre-training (eq. 4) with the Pallas sparse MLA kernel, from a warm-up
workdir (--config.init_from=runs/warmup_small)."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "sparse"
    c.model = "small"
    c.init_from = "runs/warmup_small"
    c.dtype = "bfloat16"
    c.attention = "kernel"
    # The step measured on an H200 (BENCHMARKS.md, 2026-11-28: 4 layers, 2.37x the dense stage's step at 64K): the
    # production FP8 selection, eq. 4's key gradient by segment sum, the stored sparse MLA backward (the default).
    c.indexer_fp8 = True
    c.kl_key_grad = "segment_sum"
    c.steps = 5000
    c.optimizer.lr = 7.3e-6 * 10  # small model, shorter run: a 10x higher constant rate than the 671B recipe
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 50
    c.loss.mtp_weight = 0.1
    c.loss.bias_update_speed = 1e-3
    c.loss.balance_weight = 1e-4
    c.data.seq_len = 8192
    c.data.batch_size = 4
    c.attn_chunk = 256
    c.index_chunk = 256
    c.checkpoint.every = 500
    c.log_every = 10
    return c
