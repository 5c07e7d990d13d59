"""Agent episodes over the tool environments: a model-agnostic multi-turn runner (episode.py), the report's context
management strategies (context.py) and success-vs-context-budget evaluation (evaluate.py). Pure Python."""

from __future__ import annotations

from dsv32_jax.posttrain.agent.context import STRATEGIES, extractive_summary, format_call, manage, over_budget
from dsv32_jax.posttrain.agent.episode import (Completion, GuessPolicy, OraclePolicy, Policy, RandomPolicy, ScriptedPolicy,
                                     Segment, Trajectory, near_miss, recovery_demonstration, run_episode)

__all__ = ["STRATEGIES", "Completion", "GuessPolicy", "OraclePolicy", "Policy", "RandomPolicy", "ScriptedPolicy",
           "Segment", "Trajectory", "extractive_summary", "format_call", "manage", "near_miss", "over_budget",
           "recovery_demonstration", "run_episode"]
