"""Decoding for the hub's causal LMs: ``generate(model, prompts, max_new_tokens, ...)`` (greedy or sampled, with a
KV cache) and ``greedy_generate(model, prompts, max_new_tokens, eos_id)``.

Plain torch, for evaluating and for GRPO's rollouts on small models. Prompts of different lengths share one batch
by **left padding**: each row's real tokens are right-aligned, ``position_ids`` count 0, 1, … from a row's first
real token (so a prompt gets exactly the positions it would get alone), and ``segment_ids`` are 1 on real tokens
and 0 on padding — the hub models' block-causal attention then keeps real tokens from ever seeing a pad
(``block_causal_mask``), so a padded row computes the same logits as the prompt alone. A row leaves the batch once
it has produced ``eos_id``.

**KV cache** (``use_cache=True``, the default): the prompt batch runs once (prefill) and fills a
:class:`~nxdt.models.attention.KVCache`; each later step runs only the newest token of every row, attending over the
cached keys/values — a step costs one token's forward instead of the whole prefix's. ``use_cache=False`` re-runs the
whole prefix every step (the reference the cached path is tested against: equal tokens, logits within fp32
rounding).

**Choosing the next token** follows transformers' ``generate`` (``generation/logits_process.py``): greedy arg-max
when ``do_sample`` is false; otherwise the logits are divided by ``temperature``, cut to the ``top_k`` largest
(``TopKLogitsWarper``), then to the smallest set whose probability reaches ``top_p`` (``TopPLogitsWarper``: tokens
whose ascending cumulative probability is <= 1 - top_p are dropped, the most likely one always kept), and a token
is drawn with ``torch.multinomial`` from ``generator`` (a seeded ``torch.Generator`` makes it reproducible).

Works with any model of the hub's signature ``model(input_ids, position_ids=, segment_ids=, kv_cache=) -> logits``
[B, S, vocab] (Llama, Mixtral, GPT). Call it on a model in eval mode (dropout would make "greedy" random).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from nxdt.models.attention import KVCache

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


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (transformers' names and defaults): arg-max unless ``do_sample``."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut

    def check(self) -> "Sampling":
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use do_sample=False for greedy decoding)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        return self


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Logits [n, vocab] after temperature, top-k and top-p (dropped tokens at -inf), in fp32."""
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[..., -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The chosen token [n] for each row of last-position logits [n, vocab]."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    probs = torch.softmax(warp(logits, sampling), dim=-1)
    if generator is not None and generator.device != probs.device:  # a CPU generator with a GPU model: draw where it is
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    keep_going: Callable[[bool], bool] | None = None,
) -> list[list[int]]:
    """The continuation of each prompt, new tokens only: at most ``max_new_tokens``, ending with ``eos_id`` if it was
    produced (nothing is generated after it). ``prompt_ids``: token id lists (any lengths, each non-empty) or a
    2-D tensor (equal lengths). Sampling options as transformers' (module docstring).

    ``keep_going(mine)``: for processes whose forwards are collectives over the processes decoding other prompts
    (FSDP gathers every unit's parameters in each forward): called after every step with whether this process still
    has rows decoding, it returns whether any process has; every process then runs the same number of forwards —
    one whose rows are all finished runs a one-token idle forward per step (its output unused, no random draw), so
    its completions are exactly what decoding alone gives."""
    sampling = Sampling(do_sample, temperature, top_k, top_p).check()
    rows = [list(map(int, p)) for p in prompt_ids]
    if not rows:
        return []
    if any(not r for r in rows):
        raise ValueError("generate: every prompt needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 0")
    device = next(model.parameters()).device
    outputs: list[list[int]] = [[] for _ in rows]
    active = list(range(len(rows)))  # prompts still generating, in the cache's row order
    cache = KVCache() if use_cache else None
    batch = left_pad(rows, device)
    for _ in range(max_new_tokens):
        if not active:  # finished here, not everywhere (keep_going): the same forward as the others, output unused
            idle = left_pad([[PAD_ID]], device)
            model(idle["input_ids"], position_ids=idle["position_ids"], segment_ids=idle["segment_ids"])
            if keep_going is not None and keep_going(False):
                continue
            break
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], segment_ids=batch["segment_ids"], kv_cache=cache)
        chosen = next_tokens(logits[:, -1, :], sampling, generator)
        for i, token in zip(active, chosen.tolist()):
            outputs[i].append(token)
        going = [j for j, i in enumerate(active) if eos_id is None or outputs[i][-1] != eos_id]
        active = [active[j] for j in going]
        more = bool(active) if keep_going is None else keep_going(bool(active))
        if not more:
            break
        if not active:
            continue
        if cache is None:
            batch = left_pad([rows[i] + outputs[i] for i in active], device)
            continue
        keep = torch.tensor(going, device=device)
        cache.keep(keep)
        batch = {  # the one new token per row: one past the row's last position, a real token (segment 1)
            "input_ids": chosen[keep][:, None],
            "position_ids": batch["position_ids"][keep, -1:] + 1,
            "segment_ids": torch.ones((len(active), 1), dtype=torch.long, device=device),
        }
    return outputs


def greedy_generate(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    eos_id: int | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """The greedily decoded continuation of each prompt: at every step the arg-max token of the last position
    (:func:`generate` with ``do_sample=False``)."""
    return generate(model, prompt_ids, max_new_tokens, eos_id=eos_id, use_cache=use_cache)


def completion_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """One training batch of prompt + completion rows (GRPO's scoring pass): prompts left-padded to the longest
    prompt, completions right-padded after them, so every completion starts at the same column. ``input_ids``,
    ``position_ids``, ``segment_ids`` as :func:`left_pad` (a row's real tokens at positions 0, 1, …, segment 1;
    pads on either side segment 0, position 0), and ``labels`` already shifted (``labels[t]`` = the token at t+1
    where that is a completion token, else -100): the model's per-token log-probs of the labels are then the
    completion's log-probs, and ``labels != -100`` its mask."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    width_p = max(len(p) for p in prompts)
    width = width_p + max(1, max(len(c) for c in completions))
    shape = (len(prompts), width)
    ids = torch.full(shape, PAD_ID, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    segments = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if not prompt:
            raise ValueError("completion_batch: every prompt needs at least one token")
        start, end = width_p - len(prompt), width_p + len(completion)
        ids[i, start:end] = torch.as_tensor([*prompt, *completion], dtype=torch.long)
        positions[i, start:end] = torch.arange(end - start)
        segments[i, start:end] = 1
        labels[i, width_p - 1 : end - 1] = ids[i, width_p:end]
    out = {"input_ids": ids, "position_ids": positions, "segment_ids": segments, "labels": labels}
    return {k: v.to(device) for k, v in out.items()}
