"""A task with a verifiable reward for GRPO (``+recipe=grpo``): short sums such as ``"17+5="`` whose answer is exact.

Records are ``{"prompt": "17+5=", "answer": "22"}`` (the shipped set: ``nxdt/data/samples/arithmetic.jsonl`` =
``make_arithmetic_records(256, seed=0)``). The reward functions have TRL's signature ``f(prompts, completions,
**kwargs) -> list[float]``; the records' other columns (``answer``) arrive as keyword lists, one value per completion:

A completion is a string, or for conversational prompts (a ``prompt`` that is a message list) TRL's
``[{"role": "assistant", "content": text}]``, whose content is scored.

* :func:`exact_answer` — 1.0 when the completion, stripped of whitespace, is the answer, else 0.0;
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


def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's (last) message."""
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


def exact_answer(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float]:
    """1.0 where a completion (whitespace stripped) equals its record's answer, else 0.0."""
    return [1.0 if completion_text(c).strip() == a else 0.0 for c, a in zip(completions, answer)]


def digits_only(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """The share of each completion's characters that are digits (0.0 for an empty completion)."""
    texts = [completion_text(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]
