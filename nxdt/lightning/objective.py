"""The training objective of a run, chosen from ``model_alignment_strategy`` in one place.

Pretraining and SFT (``model_alignment_strategy.sft``) minimise the same thing: the next-token cross-entropy over
the positions that have a label (SFT masks prompt tokens and padding with -100), averaged over **every labelled
token of the global batch** — not a mean of per-micro-batch means, which would weight a token by how full its
micro-batch is and so depend on micro_batch_size and the data-parallel degree. Each micro-batch's token-mean loss
(the model's ``loss_fn``, which also covers the vocabulary-parallel head under TP) is scaled by
:func:`token_weights`; the existing mean over micro-batches and data-parallel ranks then yields the global token
mean, identical for any layout. With every position labelled (pretraining on text) every weight is exactly 1.

DPO and ORPO (preference pairs, a reference model) plug in here as further objectives; until they are wired
:func:`objective_for` refuses them (``check_trainable`` does so before any worker starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

IGNORE_INDEX = -100


def label_count(labels: torch.Tensor) -> int:
    """Positions that contribute to the loss."""
    return int((labels != IGNORE_INDEX).sum())


def token_weights(counts: Sequence[int], global_count: int, dp_size: int) -> list[float]:
    """Scale of each of this rank's ``m`` micro-batch token-mean losses so that the mean over micro-batches and
    over ``dp_size`` ranks of the scaled losses is the global token mean:
    ``w_i = count_i · m · dp_size / global_count`` (0 for a micro-batch without labels; all 1 when every
    micro-batch holds the same count). Exact integer arithmetic until the one division."""
    m = len(counts)
    if global_count <= 0:
        return [0.0] * m
    return [c * m * dp_size / global_count for c in counts]


def causal_lm_loss(model: Any, logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean next-token cross-entropy of one micro-batch (labels already shifted, -100 ignored)."""
    return model.loss_fn(logits, micro_batch["labels"])


@dataclass(frozen=True)
class Objective:
    name: str
    loss: Callable[[Any, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
    token_weighted: bool = True  # micro-batch losses scaled by token_weights


CAUSAL_LM = Objective("causal_lm", causal_lm_loss)


def objective_for(alignment: Any) -> Objective:
    """The objective for ``model_alignment_strategy`` (None or no block set: pretraining)."""
    for name in ("dpo", "orpo"):
        if alignment is not None and getattr(alignment, name, None) is not None:
            raise NotImplementedError(f"model_alignment_strategy.{name}: the {name.upper()} objective is not wired into "
                                      "training yet")
    return CAUSAL_LM
