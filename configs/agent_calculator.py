"""CPU agentic post-training on the calculator environment: the lookup demo's pipeline (configs/agent_lookup.py:
span recall stage, cold start, GRPO over multi-turn trajectories) on two-operation expressions of 1-2 digit numbers
("compute (39-3)-7": calc "39-3" -> 36, calc "36-7" -> 29, answer 29; two tool turns, the second call substitutes
the first result). Status (BENCHMARKS.md, "Agentic post-training"): after 800 recall and 300 cold-start steps the
greedy success on 32 held-out tasks is 0/32 (sampled 0-9%); the learning demo for this environment is still owed.

    python -m dsv32_jax.train.main --config=configs/agent_calculator.py --workdir=runs/agent/calculator
"""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "agent"
    c.model = "tiny"
    c.model_overrides = {"vocab_size": 1536, "rope_type": "default", "qk_rope_head_dim": 16, "index_topk": 256,
                         "first_k_dense_replace": 3}
    c.steps = 40
    c.optimizer.lr = 3e-3
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 10
    c.agent.envs = "calculator"
    c.agent.env_kwargs = {"calculator": {"words_fraction": 0.0, "max_digits": 2, "min_ops": 2, "max_ops": 2}}
    c.agent.codec = "bpe"
    c.agent.tools_prompt = "compact"
    c.agent.capacity = 512
    c.agent.max_new_tokens = 40
    c.agent.max_turns = 4
    c.agent.tasks_per_step = 8
    c.agent.group_size = 8
    c.agent.recall_steps = 800
    c.agent.recall_batch = 64
    c.agent.recall_kinds = "span"
    c.agent.recall_induction_len = 8
    c.agent.recall_span_items = 2
    c.agent.recall_span_gap = 8
    c.agent.recall_mix = 0.25
    c.agent.indexer_weight = 0.0  # index_topk covers the episode: nothing to select
    c.agent.cold_start_steps = 300
    c.agent.cold_start_batch = 16
    c.agent.recall_chars = "0123456789+-*/()"  # what calculator calls copy: digits and operators
    c.agent.rl_lr = 3e-4
    c.agent.eval_every = 10
    c.agent.eval_episodes = 16
    c.checkpoint.every = 10
    c.log_every = 1
    return c
