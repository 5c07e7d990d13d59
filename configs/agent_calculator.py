"""CPU agentic post-training on the calculator environment: the lookup demo's pipeline (configs/agent_lookup.py:
span recall stage, cold start, GRPO over multi-turn trajectories) on two-operation expressions of 1-2 digit numbers
("compute (39-3)-7": calc "39-3" -> 36, calc "36-7" -> 29, answer 29; two tool turns, the second call substitutes
the first result). The lookup demo's config with the environment, its turns and the recall stage's characters
changed (the cold start with its annealed tail included). Status (BENCHMARKS.md, "Agentic post-training"): not
learned yet. Two operations: 3/32 greedy after 800 recall and 300 cold-start steps, 3/32 after 100 more at the
anneal rate. One operation (`min_ops=max_ops=1`): 0.69-0.72 after the annealed cold start, unchanged by 20 GRPO
steps; the failures copy the second operand from the wrong place.

    python -m dsv32_jax.train.main --config=configs/agent_calculator.py --workdir=runs/agent/calculator
"""
import importlib.util
import os

_path = os.path.join(os.path.dirname(__file__), "agent_lookup.py")
_spec = importlib.util.spec_from_file_location("agent_lookup", _path)
agent_lookup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent_lookup)


def get_config():
    c = agent_lookup.get_config()
    c.agent.envs = "calculator"
    c.agent.env_kwargs = {"calculator": {"words_fraction": 0.0, "max_digits": 2, "min_ops": 2, "max_ops": 2}}
    c.agent.max_turns = 4
    c.agent.recall_chars = "0123456789+-*/()"  # what calculator calls copy: digits and operators
    return c
