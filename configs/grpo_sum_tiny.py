"""CPU: GRPO on sum of two digits mod 10 (100 prompts; chance 1/32 per token at init) with the tiny MoE + DSA
model from random init. Differs from grpo_tiny in what this harder task needs: 32 prompts x 16 completions per step
(more groups with at least one correct answer) and lr 2e-3 with a cosine decay to 2e-4 over the 300 steps
(greedy accuracy 0.93 at step 300, >= 0.9 from step 240; measured 2026-11-22, BENCHMARKS.md "GRPO"). Where a run
levels off depends on the draw: the same seed reached max 0.87 on 2026-11-27 (BUILD.md), and the accuracy at step
100 over five seeds was 0.57-0.87 (tests/test_grpo.py runs these first 100 steps)."""
from dsv32_jax.train.config import base_config


def get_config():
    c = base_config("grpo_tiny")
    c.steps = 300
    c.grpo.tasks = "sum"
    c.grpo.group_size = 16
    c.grpo.prompts_per_step = 32
    c.optimizer.lr = 2e-3
    c.optimizer.schedule = "cosine"
    c.optimizer.decay_steps = 300
    c.optimizer.final_lr_fraction = 0.1
    return c
