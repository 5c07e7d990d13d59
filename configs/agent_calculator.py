"""CPU agentic post-training on the calculator environment: the lookup demo's pipeline (configs/agent_lookup.py:
span recall stage, cold start with its annealed tail, GRPO over multi-turn trajectories) on one-operation
expressions of one-digit numbers, quoted ('compute "7*8"': calc "7*8" -> 56, answer 56). Quoted, the BPE splits
the expression exactly as in the tool call; unquoted, the space merges into the first digit (" 2" "5" in the task,
"2" "5" in the call) in about half the tasks. The lookup demo's config with the environment, its turns and the
recall stage's characters (digits and operators) changed.

Status (BENCHMARKS.md, "Agentic post-training"): greedy success on 32 held-out tasks 0.00 before training, 1.00
after the cold start and after 10 GRPO steps (seed 0, 35 CPU minutes on 2 cores). With numbers of up to two digits
(`max_digits` 2) the same pipeline reaches 0.75: the tiny model swaps the two digits of the second operand
("25-73" -> calc "25-37") or miscopies the tool's result, and 20 GRPO steps at 5e-4 did not lift it (0.69-0.75).
Two operations ("compute (39-3)-7", `min_ops=max_ops=2`, two tool turns): 3/32 (unquoted).

    python -m dsv32_jax.train.main --config=configs/agent_calculator.py --workdir=runs/agent/calculator
"""
from dsv32_jax.configs import agent_lookup


def get_config():
    c = agent_lookup.get_config()
    c.agent.envs = "calculator"
    c.agent.env_kwargs = {"calculator": {"words_fraction": 0.0, "max_digits": 1, "min_ops": 1, "max_ops": 1,
                                         "quote": True}}
    c.agent.max_turns = 3
    c.agent.recall_chars = "0123456789+-*/()"  # what calculator calls copy: digits and operators
    return c
