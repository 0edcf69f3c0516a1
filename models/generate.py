"""Greedy decoding for the hub's causal LMs: ``greedy_generate(model, prompts, max_new_tokens, eos_id)``.

Plain torch, for evaluating small models (the SFT learning experiment, tests). There is **no KV cache**: every
step re-runs the whole prefix, so a step costs a full forward of the prompt plus what was generated — quadratic in
the output length, fine for tiny models and answers of a few tokens, not meant for serving.

Prompts of different lengths share one batch by **left padding**: each row's real tokens are right-aligned,
``position_ids`` count 0, 1, … from a row's first real token (so a prompt gets exactly the positions it would get
alone), and ``segment_ids`` are 1 on real tokens and 0 on padding — the hub models' block-causal attention then
keeps real tokens from ever seeing a pad (``block_causal_mask``), so a padded row computes the same logits as the
prompt alone. A row leaves the batch once it has produced ``eos_id``.

Works with any model of the hub's signature ``model(input_ids, position_ids=None, segment_ids=None) -> logits``
[B, S, vocab]. Call it on a model in eval mode (dropout would make "greedy" random).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

PAD_ID = 0
"""Token id written into pad positions. Any id works: pads are masked out (segment 0) and never attended to."""


def left_pad(rows: Sequence[Sequence[int]], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """``input_ids``, ``position_ids``, ``segment_ids`` [len(rows), longest] of token rows right-aligned behind
    pads (pad: id ``PAD_ID``, position 0, segment 0; real tokens: positions 0, 1, …, segment 1)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        start = width - len(row)
        ids[i, start:] = torch.as_tensor(list(row), dtype=torch.long)
        positions[i, start:] = torch.arange(len(row))
        segments[i, start:] = 1
    return {"input_ids": ids.to(device), "position_ids": positions.to(device), "segment_ids": segments.to(device)}


@torch.no_grad()
def greedy_generate(
    model: nn.Module, prompt_ids: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int, eos_id: int | None = None
) -> list[list[int]]:
    """The greedily decoded continuation of each prompt: at every step the arg-max token of the last position.

    ``prompt_ids``: token id lists (any lengths, each non-empty) or a 2-D tensor (equal lengths). Returns, per
    prompt, the new tokens only — at most ``max_new_tokens``, ending with ``eos_id`` if it was produced (nothing
    is generated after it)."""
    rows = [list(map(int, p)) for p in prompt_ids]
    if not rows:
        return []
    if any(not r for r in rows):
        raise ValueError("greedy_generate: every prompt needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"greedy_generate: max_new_tokens={max_new_tokens} must be >= 0")
    device = next(model.parameters()).device
    outputs: list[list[int]] = [[] for _ in rows]
    active = list(range(len(rows)))  # prompts still generating
    for _ in range(max_new_tokens):
        if not active:
            break
        batch = left_pad([rows[i] + outputs[i] for i in active], device)
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], segment_ids=batch["segment_ids"])
        next_ids = logits[:, -1, :].argmax(dim=-1).tolist()
        for i, token in zip(active, next_ids):
            outputs[i].append(token)
        active = [i for i in active if eos_id is None or outputs[i][-1] != eos_id]
    return outputs
