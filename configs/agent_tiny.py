"""CPU demo of agentic post-training (train/agent_grpo.py): a tiny DSA + MoE model, the key-value lookup and
calculator tool environments, the shipped BPE chat tokenizer; cold-start SFT on the environments' demonstrations,
then GRPO over multi-turn trajectories (non-thinking mode)."""
from dsv32_jax.train.config import default_config


def get_config():
    c = default_config()
    c.stage = "agent"
    c.model = "tiny"
    c.model_overrides = {"vocab_size": 1536, "index_topk": 32}
    c.steps = 30
    c.optimizer.lr = 2e-3
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 10
    c.agent.envs = "lookup"
    c.agent.codec = "bpe"
    c.agent.capacity = 1024
    c.agent.max_new_tokens = 48
    c.agent.max_turns = 4
    c.agent.tasks_per_step = 4
    c.agent.group_size = 4
    c.agent.cold_start_steps = 200
    c.agent.cold_start_batch = 8
    c.agent.eval_every = 10
    c.agent.eval_episodes = 16
    c.checkpoint.every = 10
    c.log_every = 1
    return c
