"""Built-in verifiable tasks and composable rewards for GRPO (plain Python callables, run on the host).

Vocabulary (32 ids, the tiny GRPO model's): 0 pad, 1 EOS, 2-11 digits 0-9, 12 '+', 13 '=', 14-17 task markers
(map, sum, rev, copy), 18-31 letters a-n (a second "language" for the language-consistency reward).
Tasks: map a digit (d -> (3d + 1) mod 10), sum of two digits mod 10, reverse / copy three symbols (partial
credit per position). Answers are read up to EOS.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

PAD, EOS = 0, 1
DIGITS = tuple(range(2, 12))
PLUS, EQ = 12, 13
MARKERS = {"map": 14, "sum": 15, "rev": 16, "copy": 17}
LETTERS = tuple(range(18, 32))
VOCAB_SIZE = 32
_NAMES = {PAD: "<pad>", EOS: "<eos>", PLUS: "+", EQ: "=", **{t: str(i) for i, t in enumerate(DIGITS)},
          **{t: f"<{k}>" for k, t in MARKERS.items()}, **{t: chr(ord("a") + i) for i, t in enumerate(LETTERS)}}


def detokenize(tokens: Sequence[int]) -> str:
    return " ".join(_NAMES.get(int(t), f"<{int(t)}>") for t in tokens)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt / response pair handed to reward functions."""
    kind: str  # task name: the "domain" (per-domain KL weights key on it)
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    response: tuple[int, ...]  # generated tokens up to (excluding) EOS
    finished: bool  # EOS was produced
    language: str  # "digits" or "letters": the prompt's language


Reward = Callable[[Sample], float]


def make_prompt(kind: str, rng: np.random.Generator, letters: bool = False):
    """-> (prompt tokens, answer tokens, language)."""
    alphabet = LETTERS[:10] if letters else DIGITS
    if kind == "map":
        d = int(rng.integers(10))
        return (MARKERS["map"], DIGITS[d], EQ), (DIGITS[(3 * d + 1) % 10],), "digits"
    if kind == "sum":
        a, b = (int(x) for x in rng.integers(10, size=2))
        return (MARKERS["sum"], DIGITS[a], PLUS, DIGITS[b], EQ), (DIGITS[(a + b) % 10],), "digits"
    if kind in ("rev", "copy"):
        xs = tuple(alphabet[int(i)] for i in rng.integers(len(alphabet), size=3))
        ans = xs[::-1] if kind == "rev" else xs
        return (MARKERS[kind],) + xs + (EQ,), ans, "letters" if letters else "digits"
    raise ValueError(f"unknown task {kind!r}; expected one of {sorted(MARKERS)}")


def eval_prompts(kind: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """The full (small) input space of a task, or a fixed sample of it, for greedy evaluation."""
    if kind == "map":
        return [((MARKERS["map"], DIGITS[d], EQ), (DIGITS[(3 * d + 1) % 10],), "digits") for d in range(10)]
    if kind == "sum":
        return [((MARKERS["sum"], DIGITS[a], PLUS, DIGITS[b], EQ), (DIGITS[(a + b) % 10],), "digits")
                for a in range(10) for b in range(10)]
    rng = np.random.default_rng(1234)
    return [make_prompt(kind, rng) for _ in range(64)]


# ----------------------------------------------------------------------------------------------- rewards
def outcome_reward(sample: Sample) -> float:
    """Rule-based verifier: exact answer for single-token tasks; fraction of correct positions (partial credit)
    for sequence tasks. Tokens after the answer are ignored here (the length penalty handles them)."""
    got = sample.response[: len(sample.answer)]
    if len(sample.answer) == 1:
        return float(got == sample.answer)
    return sum(a == b for a, b in zip(got, sample.answer)) / len(sample.answer)


def is_correct(sample: Sample) -> bool:
    return sample.response[: len(sample.answer)] == sample.answer


def length_penalty(target: int, per_token: float = 0.1, unfinished: float = 0.5) -> Reward:
    """-per_token for every response token beyond `target` (EOS excluded), and -unfinished without an EOS."""
    def reward(sample: Sample) -> float:
        return -per_token * max(0, len(sample.response) - target) - (0.0 if sample.finished else unfinished)
    return reward


def language_consistency(sample: Sample) -> float:
    """Fraction of response tokens in the prompt's language (DeepSeek-R1's language-consistency reward)."""
    if not sample.response:
        return 0.0
    lang = set(LETTERS if sample.language == "letters" else DIGITS)
    return sum(t in lang for t in sample.response) / len(sample.response)


def weighted(*terms: tuple[float, Reward]) -> Reward:
    """sum_i w_i * r_i(sample): how rewards are composed per task."""
    def reward(sample: Sample) -> float:
        return float(sum(w * r(sample) for w, r in terms))
    return reward


class GenerativeRewardModel:
    """Rubric-based generative reward model (the paper's reward for general tasks): a judge reads the prompt, the
    response and the prompt's rubric, and writes one verdict line per rubric item ("<item>: yes|no"); the reward
    is the fraction of items judged "yes". `judge` is any text -> text callable (an LLM in production)."""

    def __init__(self, judge: Callable[[str], str], rubric: Callable[[Sample], list[str]]):
        self.judge, self.rubric = judge, rubric

    def __call__(self, sample: Sample) -> float:
        items = self.rubric(sample)
        query = (f"Prompt: {detokenize(sample.prompt)}\nResponse: {detokenize(sample.response)}"
                 f"{' <eos>' if sample.finished else ''}\nRubric:\n" + "\n".join(f"- {i}" for i in items))
        verdicts = dict(re.findall(r"^\s*(.+?)\s*:\s*(yes|no)\s*$", self.judge(query), flags=re.M | re.I))
        missing = [i for i in items if i not in verdicts]
        if missing:
            raise ValueError(f"judge gave no verdict for rubric item(s) {missing}")
        return sum(verdicts[i].lower() == "yes" for i in items) / len(items)


def rule_based_judge(query: str) -> str:
    """A real (small, deterministic) judge used as the generative reward model's stand-in: it parses the query
    text and checks each rubric item it knows."""
    prompt = re.search(r"^Prompt: (.*)$", query, re.M).group(1).split()
    response = re.search(r"^Response: (.*)$", query, re.M).group(1).split()
    items = re.findall(r"^- (.*)$", query, re.M)
    ended = bool(response) and response[-1] == "<eos>"
    body = response[:-1] if ended else response
    lines = []
    for item in items:
        if item == "ends the answer with <eos>":
            ok = ended
        elif item == "answers in at most 2 tokens":
            ok = len(body) <= 2
        elif item.startswith("answer is "):
            ok = body[:1] == [item[len("answer is "):]]
        elif item == "uses only the prompt's symbols":
            ok = bool(body) and set(body) <= set(prompt)
        else:
            raise ValueError(f"rule_based_judge: unknown rubric item {item!r}")
        lines.append(f"{item}: {'yes' if ok else 'no'}")
    return "\n".join(lines)


def default_rubric(sample: Sample) -> list[str]:
    rubric = ["ends the answer with <eos>", "answers in at most 2 tokens"]
    if len(sample.answer) == 1:
        rubric.append(f"answer is {detokenize(sample.answer)}")
    return rubric


def make_reward(kind: str, length_target: int | None = None, language_weight: float = 0.0,
                grm_weight: float = 0.0) -> Reward:
    """The reward of one task domain: outcome (+ length penalty) (+ language consistency) (+ rubric GRM)."""
    terms: list[tuple[float, Reward]] = [(1.0, outcome_reward)]
    if length_target is not None:
        terms.append((1.0, length_penalty(length_target)))
    if language_weight:
        terms.append((language_weight, language_consistency))
    if grm_weight:
        terms.append((grm_weight, GenerativeRewardModel(rule_based_judge, default_rubric)))
    return weighted(*terms)


def to_sample(kind: str, prompt, answer, language: str, generated: Sequence[int]) -> Sample:
    generated = [int(t) for t in generated]
    finished = EOS in generated
    response = tuple(generated[: generated.index(EOS)] if finished else generated)
    return Sample(kind, tuple(prompt), tuple(answer), response, finished, language)
