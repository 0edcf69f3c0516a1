"""The training objective of a run, chosen from ``model_alignment_strategy`` in one place.

Pretraining and SFT (``model_alignment_strategy.sft``) minimise the same thing: the next-token cross-entropy over
the positions that have a label (SFT masks prompt tokens and padding with -100), averaged over **every labelled
token of the global batch** — not a mean of per-micro-batch means, which would weight a token by how full its
micro-batch is and so depend on micro_batch_size and the data-parallel degree. Each micro-batch's token-mean loss
(the model's ``loss_fn``, which also covers the vocabulary-parallel head under TP) is scaled by
:func:`token_weights`; the existing mean over micro-batches and data-parallel ranks then yields the global token
mean, identical for any layout. With every position labelled (pretraining on text) every weight is exactly 1.

DPO and ORPO train on preference pairs (``pairs``: each sample a chosen and a rejected sequence, laid out by
:func:`~nxdt.data.preferences.pair_rows` so a pair's loss is computed in one micro-batch on one rank). Their loss is a
mean over pairs, every micro-batch holding ``micro_batch_size`` pairs, so the plain mean over micro-batches and
data-parallel ranks is the global mean (no token weights). DPO reads the reference model's per-sequence
log-probabilities from the micro-batch (``ref_logps`` [pairs, 2], precomputed once before training:
``CausalLMModule.precompute_reference``). Each preference loss records the sums of its metrics (TRL's names, and the
pair count last) in ``micro_batch["metric_sums"]``, which the module sums over the global batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from nxdt.data.preferences import split_chosen_rejected
from nxdt.models.objectives import DPO_LOSS_TYPES, dpo_loss, orpo_loss

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
    pairs: bool = False  # samples are preference pairs (pair_rows lays out each micro-batch)
    reference: bool = False  # reads the reference model's log-probabilities (micro_batch["ref_logps"])
    metrics: tuple[str, ...] = ()  # what micro_batch["metric_sums"] holds (then the pair count)
    # pairs: (rows' summed log-probs, rows' label counts, ref_logps or None) → (loss, metrics); validation reuses it
    pair_loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None


CAUSAL_LM = Objective("causal_lm", causal_lm_loss)

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
ORPO_METRICS = REWARD_METRICS + ("log_odds_ratio", "log_odds_chosen", "nll_loss")


def sequence_log_prob_sums(model: Any, logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log π(y|x) of every row: the sum of its labelled tokens' log-probabilities (prompt and padding are -100);
    the model's ``token_log_probs`` handles a vocabulary-sharded head (tensor parallelism)."""
    return model.token_log_probs(logits, micro_batch["labels"]).sum(-1)


def _record(micro_batch: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], names: tuple[str, ...], pairs: int) -> None:
    """The micro-batch's metric sums (means × pairs) and its pair count, for the global-batch means."""
    means = torch.stack([metrics[n].detach().double().reshape(()) for n in names])
    micro_batch["metric_sums"] = torch.cat([means * pairs, torch.tensor([float(pairs)], dtype=torch.float64)])


def dpo_pair_loss(
    beta: float, loss_type: str, sums: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023) of pairs from their rows' summed log-probabilities (chosen rows, then rejected rows)
    and the reference's ``ref`` [pairs, 2]; ``counts`` (labelled tokens per row) are not needed."""
    if ref is None:
        raise ValueError("DPO needs the reference log-probabilities of every pair (precompute_ref_log_probs)")
    chosen, rejected = split_chosen_rejected(sums)
    return dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta, loss_type)


def orpo_pair_loss(
    beta: float, sums: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO (Hong et al. 2024) of pairs: the chosen rows' token-mean NLL + β · the odds-ratio term of the
    length-normalised log-probabilities (``sums / counts``); no reference model."""
    (chosen_sum, rejected_sum), (chosen_count, rejected_count) = split_chosen_rejected(sums), split_chosen_rejected(counts)
    nll = -chosen_sum.sum() / chosen_count.sum().clamp(min=1)
    return orpo_loss(chosen_sum / chosen_count.clamp(min=1), rejected_sum / rejected_count.clamp(min=1), nll, beta)


PairLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def pair_objective_loss(
    pair_loss: PairLoss, names: tuple[str, ...], model: Any, logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """A preference objective on one micro-batch of pairs (training): its rows' summed log-probabilities and label counts
    → ``pair_loss`` (with the precomputed reference log-probabilities, DPO); records the metric sums."""
    sums = sequence_log_prob_sums(model, logits, micro_batch)
    counts = (micro_batch["labels"] != IGNORE_INDEX).sum(-1).to(sums.dtype)
    loss, metrics = pair_loss(sums, counts, micro_batch.get("ref_logps"))
    _record(micro_batch, metrics, names, sums.shape[0] // 2)
    return loss


def pair_sums(
    pair_loss: PairLoss, names: tuple[str, ...], scores: torch.Tensor, micro_batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Validation: (loss · pairs, each metric · pairs, pairs) of one laid-out micro-batch from its rows' summed
    log-probabilities ``scores`` [2b] (forward only, :meth:`CausalLMModule.sequence_scores`), in float64. A padding pair
    (:class:`~nxdt.data.sampler.PadRows`: no label; a real pair has at least one response token in each row) is left
    out, so summed over the set the last value counts every real pair once."""
    counts = (micro_batch["labels"] != IGNORE_INDEX).sum(-1).to(torch.float64)
    real = split_chosen_rejected(counts)[0] > 0
    out = torch.zeros(len(names) + 2, dtype=torch.float64)
    pairs = int(real.sum())
    if pairs:
        rows = torch.cat([real, real])
        ref = micro_batch.get("ref_logps")
        loss, metrics = pair_loss(scores.double()[rows], counts[rows], None if ref is None else ref[real])
        values = torch.stack([loss.detach().double().reshape(())] + [metrics[n].detach().double().reshape(()) for n in names])
        out[:-1], out[-1] = values * pairs, pairs
    return out


def objective_for(alignment: Any) -> Objective:
    """The objective for ``model_alignment_strategy`` (None or no block set: pretraining; sft: the same token mean)."""
    dpo, orpo = (getattr(alignment, name, None) if alignment is not None else None for name in ("dpo", "orpo"))
    if dpo is not None:
        if dpo.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(
                f"model_alignment_strategy.dpo.loss_type={dpo.loss_type!r}: only {', '.join(DPO_LOSS_TYPES)} is implemented"
            )
        pair_loss: PairLoss = functools.partial(dpo_pair_loss, float(dpo.kl_beta), dpo.loss_type)
        return Objective(
            "dpo",
            functools.partial(pair_objective_loss, pair_loss, REWARD_METRICS),
            token_weighted=False,
            pairs=True,
            reference=True,
            metrics=REWARD_METRICS,
            pair_loss=pair_loss,
        )
    if orpo is not None:
        pair_loss = functools.partial(orpo_pair_loss, float(orpo.beta))
        return Objective(
            "orpo",
            functools.partial(pair_objective_loss, pair_loss, ORPO_METRICS),
            token_weighted=False,
            pairs=True,
            metrics=ORPO_METRICS,
            pair_loss=pair_loss,
        )
    return CAUSAL_LM
