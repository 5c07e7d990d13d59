"""CPU: GRPO on sum of two digits mod 10 (100 prompts; chance 1/32 per token at init) with the tiny MoE + DSA
model from random init. Differs from grpo_tiny in what this harder task needs: 32 prompts x 16 completions per step
(more groups with at least one correct answer) and lr 2e-3 with a cosine decay to 2e-4 over the 300 steps
(greedy accuracy 0.93 at step 300, >= 0.9 from step 240; measured 2026-11-22, BENCHMARKS.md "GRPO")."""
from train.config import default_config


def get_config():
    c = default_config()
    c.stage = "grpo"
    c.model = "tiny"
    c.model_overrides = {"vocab_size": 32, "index_topk": 6, "initializer_range": 0.05}
    c.steps = 300
    c.optimizer.lr = 2e-3
    c.optimizer.schedule = "cosine"
    c.optimizer.decay_steps = 300
    c.optimizer.final_lr_fraction = 0.1
    c.optimizer.warmup_steps = 5
    c.optimizer.weight_decay = 0.0
    c.grpo.tasks = "sum"
    c.grpo.group_size = 16
    c.grpo.prompts_per_step = 32
    c.grpo.kl_weight = 0.001
    c.grpo.top_p = 0.95
    c.grpo.eval_every = 10
    c.checkpoint.every = 50
    c.log_every = 10
    return c
