"""A task with a verifiable reward for GRPO (``+recipe=grpo``): short sums such as ``"17+5="`` whose answer is exact.

Records are ``{"prompt": "17+5=", "answer": "22"}`` (the shipped set: ``nxdt/data/samples/arithmetic.jsonl`` =
``make_arithmetic_records(256, seed=0)``). The reward functions have TRL's signature ``f(prompts, completions,
**kwargs) -> list[float]``; the records' other columns (``answer``) arrive as keyword lists, one value per completion:

* :func:`exact_answer` — 1.0 when the completion, stripped of spaces, is the answer, else 0.0;
* :func:`digits_only` — the share of the completion's characters that are digits (0 for an empty one): a shaped reward
  that gives a freshly initialised byte-level model a signal before it ever writes a right answer.
"""

from __future__ import annotations

import random
from typing import Any, Sequence


def make_arithmetic_records(count: int, seed: int = 0, top: int = 20) -> list[dict[str, str]]:
    """``count`` sums a+b with 0 <= a, b < ``top`` (seeded), as prompt/answer records."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randrange(top), rng.randrange(top)
        records.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return records


def exact_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 where a completion (spaces stripped) equals its record's answer, else 0.0."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def digits_only(prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float]:
    """The share of each completion's characters that are digits (0.0 for an empty completion)."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]
