"""The losses of the training objectives, as :class:`Objective` values ``CausalLMModule`` trains with; which one a run
uses is the objective registry's choice (``nxdt.lightning.registry``: one spec per objective, chosen from
``model_alignment_strategy``).

Pretraining and SFT (``model_alignment_strategy.sft``) minimise the same thing: the next-token cross-entropy over
the positions that have a label (SFT masks prompt tokens and padding with -100), averaged over **every labelled
token of the global batch** — not a mean of per-micro-batch means, which would weight a token by how full its
micro-batch is and so depend on micro_batch_size and the data-parallel degree. Each micro-batch's token-mean loss
(the model's ``loss_fn``, which also covers the vocabulary-parallel head under TP) is scaled by
:func:`token_weights`; the existing mean over micro-batches and data-parallel ranks then yields the global token
mean, identical for any layout. With every position labelled (pretraining on text) every weight is exactly 1.

DPO and ORPO train on preference pairs (``pairs``: each sample a chosen and a rejected sequence, laid out by
:func:`~nxdt.data.preferences.pair_rows` so a pair's loss is computed in one micro-batch on one rank). DPO's loss (but
its ``sft`` loss type), and ORPO's odds-ratio term, are means over pairs, every micro-batch holding ``micro_batch_size``
pairs, so the plain mean over micro-batches and data-parallel ranks is the global mean (no token weights). DPO's
``sft`` type is a token mean over the global batch's chosen responses, scaled as ORPO's NLL below. ORPO's NLL term is, as in TRL's
ORPOTrainer (``concatenated_forward``: one ``CrossEntropyLoss`` over the chosen sequences, prompt and response), a
token mean: over every chosen token of the **global** batch — what TRL computes when a step is one batch, and
independent of micro_batch_size and data parallelism (a per-micro-batch mean, TRL's under gradient accumulation, is
not). Each micro-batch's NLL sum is scaled by ``nll_scale`` (micro-batches × DP ranks / the global count). DPO reads
the reference model's per-sequence log-probabilities from the micro-batch (``ref_logps`` [pairs, 2], precomputed once
before training: ``CausalLMModule.precompute_reference``). Each preference loss records the sums of its metrics (TRL's
names, and the pair count last) in ``micro_batch["metric_sums"]``, which the module sums over the global batch.

A mixture-of-experts policy with a non-zero ``router_aux_loss_coef`` adds, as TRL's DPOTrainer (and its ORPOTrainer)
do, that weight times the load-balancing loss of the micro-batch's forward — chosen and rejected rows together, over
their real tokens (:func:`router_aux_weight`; ``aux_loss(padding_masked=True)``) — to each micro-batch's loss, in
training and validation (TRL's eval loss has it too); under context parallelism the routing statistics add up over the
CP ranks (``LoadBalancing.sequence_group``), and under pipeline parallelism the stages' real-token statistics travel
with the activations. It is logged unweighted as ``aux_loss`` (TRL's name; no value for a dense model).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch

from nxdt.data.preferences import sequence_labels, split_chosen_rejected
from nxdt.models.objectives import DPOLoss, odds_ratio_terms
from nxdt.parallel.context_parallel import sequence_total

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
    # ... computed per micro-batch by a frozen copy of the starting weights (DPO's precompute_ref_log_probs: false),
    # not precomputed once before training
    online_reference: bool = False
    metrics: tuple[str, ...] = ()  # what micro_batch["metric_sums"] holds (then the pair count)
    # pairs: (rows' pair_scores, pair_counts, ref_logps or None) → PairTerms; validation reuses it
    pair_loss: Callable[..., "PairTerms"] | None = None
    # the metric of a token-mean NLL term (ORPO with nll_mean=tokens, DPO with sft): each micro-batch then needs
    # ``nll_scale``, from the global batch's count of that term's tokens (``token_count`` of each micro-batch)
    token_metric: str | None = None
    token_count: Callable[[dict[str, torch.Tensor]], int] | None = None
    # a MoE model's load-balancing term over real tokens only (TRL's: transformers' loss with the attention mask), where
    # pretraining and SFT count every row as NxD does; a pipeline needs to know before the last stage's loss runs
    aux_real_tokens: bool = False

    def __post_init__(self) -> None:
        if (self.token_metric is None) != (self.token_count is None):
            raise ValueError(f"objective {self.name}: a token-mean term needs both its metric and its token count")


CAUSAL_LM = Objective("causal_lm", causal_lm_loss)

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
AUX_METRIC = "aux_loss"  # a MoE policy's load-balancing loss, unweighted (TRL's name); no value for a dense model
ORPO_METRICS = REWARD_METRICS + ("log_odds_ratio", "log_odds_chosen", "nll_loss", AUX_METRIC)


def sequence_log_prob_sums(model: Any, logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log π(y|x) of every row: the sum of its labelled tokens' log-probabilities (prompt and padding are -100);
    the model's ``token_log_probs`` handles a vocabulary-sharded head (tensor parallelism), :func:`sequence_total` a
    sequence split over context parallelism."""
    return sequence_total(model, model.token_log_probs(logits, micro_batch["labels"]).sum(-1))


def router_aux_weight(model: Any) -> float:
    """The weight of a mixture-of-experts model's load-balancing loss in TRL's preference and GRPO losses: its
    ``router_aux_loss_coef`` (0 for a dense model: no term)."""
    return float(getattr(model, "router_aux_loss_coef", 0.0) or 0.0)


def router_aux(model: Any) -> torch.Tensor | None:
    """The model's last forward's load-balancing loss over real tokens, unweighted (TRL's logged ``aux_loss``); None
    where no term is added (a dense model, or a zero weight)."""
    return model.aux_loss(padding_masked=True) if router_aux_weight(model) else None


def pair_scores(model: Any, logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[2, rows]: every row's summed log-probability over its response tokens (row 0: log π(y|x), the labelled tokens)
    and over its whole sequence (row 1: prompt and response, the NLL of ORPO), from one log-softmax."""
    full = sequence_labels(micro_batch)
    logp = model.token_log_probs(logits, full)  # 0 where full is -100
    response = micro_batch["labels"] != IGNORE_INDEX
    return sequence_total(model, torch.stack([torch.where(response, logp, torch.zeros_like(logp)).sum(-1), logp.sum(-1)]))


def pair_scores_and_aux(model: Any, logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Validation's [4, rows]: :func:`pair_scores` and, in every column of row 2, the micro-batch's weighted
    load-balancing term (:func:`router_aux_weight` · :func:`router_aux`; 0 for a dense model), of row 3 the term unweighted (the
    ``aux_loss`` metric; NaN for a dense model: no column)."""
    scores = pair_scores(model, logits, micro_batch)
    raw = router_aux(model)
    weighted = scores.new_zeros(()) if raw is None else router_aux_weight(model) * raw.detach().to(scores.dtype)
    unweighted = scores.new_full((), math.nan) if raw is None else raw.detach().to(scores.dtype)
    return torch.cat([scores, torch.stack([weighted, unweighted]).reshape(2, 1).expand(2, scores.shape[1])])


def pair_counts(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[2, rows]: each row's response tokens and whole-sequence tokens (the counts of :func:`pair_scores`)."""
    return torch.stack([(micro_batch["labels"] != IGNORE_INDEX).sum(-1), (sequence_labels(micro_batch) != IGNORE_INDEX).sum(-1)])


def chosen_sequence_tokens(micro_batch: dict[str, torch.Tensor]) -> int:
    """Tokens of a laid-out micro-batch's chosen sequences (prompt and response): the denominator of ORPO's NLL."""
    return int(split_chosen_rejected(pair_counts(micro_batch)[1])[0].sum())


def chosen_response_tokens(micro_batch: dict[str, torch.Tensor]) -> int:
    """Response tokens of a laid-out micro-batch's chosen rows: the denominator of DPO's sft loss type."""
    return int(split_chosen_rejected(pair_counts(micro_batch)[0])[0].sum())


class PairTerms(NamedTuple):
    """A preference loss on some pairs, split by how it averages: ``pair_mean`` (0-d) is the mean over the pairs of the
    per-pair part (DPO's whole loss; ORPO's odds-ratio term); ``nll_sum`` / ``nll_tokens`` (0-d) the summed NLL and
    token count of a token-mean part (ORPO's L_SFT over the chosen sequences; 0 / 0 for DPO), which is divided by the
    tokens of the whole global batch, not of the micro-batch. ``metrics``: per-pair means, by TRL's names."""

    pair_mean: torch.Tensor
    nll_sum: torch.Tensor
    nll_tokens: torch.Tensor
    metrics: dict[str, torch.Tensor]


NLL_METRIC = "nll_loss"  # ORPO's NLL term; under nll_mean=tokens a token mean, not a mean over pairs
SFT_METRIC = "sft_loss"  # DPO's sft loss type, weighted: a token mean over the chosen responses
ORPO_NLL_MEANS = ("tokens", "sequences")


def _record(micro_batch: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], names: tuple[str, ...], pairs: int) -> None:
    """The micro-batch's metric sums (means × pairs) and its pair count, for the global-batch means."""
    means = torch.stack([metrics[n].detach().double().reshape(()) for n in names])
    micro_batch["metric_sums"] = torch.cat([means * pairs, means.new_tensor([float(pairs)])])


def dpo_pair_loss(dpo: DPOLoss, sums: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None) -> PairTerms:
    """DPO (Rafailov et al. 2023) or TRL's variants of it (:class:`~nxdt.models.objectives.DPOLoss`) of pairs from their
    rows' summed response log-probabilities (``sums[0]``: chosen rows, then rejected rows), response token counts
    (``counts[0]``: ipo and sigmoid_norm normalise by them) and the reference's ``ref`` [pairs, 2]. The ``sft`` type's
    weighted NLL of the chosen responses is the token-mean term (its sum and tokens: a mean over the global batch)."""
    if ref is None:
        raise ValueError("DPO needs the reference log-probabilities of every pair (precompute_ref_log_probs)")
    (chosen, rejected), (chosen_tokens, rejected_tokens) = split_chosen_rejected(sums[0]), split_chosen_rejected(counts[0])
    losses, metrics = dpo.pair_losses(chosen, rejected, ref[:, 0], ref[:, 1], chosen_tokens, rejected_tokens)
    if dpo.sft_weight:
        return PairTerms(losses.mean(), -dpo.sft_weight * chosen.sum(), chosen_tokens.sum().to(chosen.dtype), metrics)
    zero = torch.zeros((), dtype=torch.float64, device=chosen.device)
    return PairTerms(losses.mean(), zero, zero, metrics)


def orpo_pair_loss(beta: float, nll_mean: str, sums: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None) -> PairTerms:
    """ORPO (Hong et al. 2024) of pairs: β · the odds-ratio term of the length-normalised response log-probabilities
    (``sums[0] / counts[0]``), a mean over pairs, plus the chosen answers' NLL. ``nll_mean="tokens"`` (TRL's
    ORPOTrainer): the NLL of the chosen sequences, prompt and response (``sums[1]``, ``counts[1]``), a token mean (over
    the global batch: ``PairTerms.nll_sum``); ``"sequences"`` (NxD Training's base_orpo.py): minus the mean over pairs of
    each chosen response's mean token log-probability. No reference model."""
    (chosen_sum, rejected_sum), (chosen_count, rejected_count) = split_chosen_rejected(sums[0]), split_chosen_rejected(counts[0])
    chosen_mean = chosen_sum / chosen_count.clamp(min=1)
    losses, metrics = odds_ratio_terms(chosen_mean, rejected_sum / rejected_count.clamp(min=1), beta)
    if nll_mean == "sequences":
        nll = -chosen_mean.float().mean()
        zero = torch.zeros((), dtype=torch.float64, device=nll.device)
        return PairTerms(losses.mean() + nll, zero, zero, {**metrics, NLL_METRIC: nll.detach()})
    nll_sum, nll_tokens = -split_chosen_rejected(sums[1])[0].sum(), split_chosen_rejected(counts[1])[0].sum()
    return PairTerms(losses.mean(), nll_sum, nll_tokens.to(nll_sum.dtype), metrics)


PairLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], PairTerms]


def pair_objective_loss(
    pair_loss: PairLoss,
    names: tuple[str, ...],
    token_metric: str | None,
    model: Any,
    logits: torch.Tensor,
    micro_batch: dict[str, torch.Tensor],
) -> torch.Tensor:
    """A preference objective on one micro-batch of pairs (training): the per-pair part's mean plus the token-mean part
    scaled by ``micro_batch["nll_scale"]`` (micro-batches × data-parallel ranks / the global batch's chosen tokens, set
    by ``CausalLMModule``), so the mean over micro-batches and ranks is the token mean over the whole global batch
    whatever micro_batch_size; records the metric sums (``nll_loss``: this micro-batch's share, likewise)."""
    sums = pair_scores(model, logits, micro_batch)
    counts = sequence_total(model, pair_counts(micro_batch).to(logits.dtype))  # whole sequences' under CP
    terms = pair_loss(sums, counts, micro_batch.get("ref_logps"))
    loss, metrics = terms.pair_mean, dict(terms.metrics)
    aux = router_aux(model)  # a MoE policy's load-balancing term, as TRL adds it and logs it
    if aux is not None:
        loss = loss + router_aux_weight(model) * aux
    metrics[AUX_METRIC] = sums.new_full((), math.nan) if aux is None else aux.detach()
    if token_metric is not None:
        if "nll_scale" not in micro_batch:
            raise ValueError("a token-mean loss term needs micro_batch['nll_scale'] (CausalLMModule sets it per global batch)")
        nll = terms.nll_sum * micro_batch["nll_scale"].to(terms.nll_sum.dtype)
        loss, metrics[token_metric] = loss + nll, nll
    _record(micro_batch, metrics, names, sums.shape[1] // 2)
    return loss


def pair_sums(
    pair_loss: PairLoss,
    names: tuple[str, ...],
    token_metric: str | None,
    scores: torch.Tensor,
    micro_batch: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Validation: (per-pair part · pairs, each pair metric · pairs, NLL sum, NLL tokens, pairs) of one laid-out
    micro-batch from its rows' :func:`pair_scores` ``scores`` [2, 2b] (forward only; [3, 2b] from
    :func:`pair_scores_and_aux`: the micro-batch's load-balancing term joins the per-pair part), in float64; summed over the set,
    :func:`pair_means` makes the means. A padding pair (:class:`~nxdt.data.sampler.PadRows`: no label; a real pair has at
    least one response token in each row) is left out, so the last value counts every real pair once."""
    counts = pair_counts(micro_batch).to(torch.float64)
    real = split_chosen_rejected(counts[0])[0] > 0
    out = torch.zeros(len(names) + 4, dtype=torch.float64)
    nan = scores.new_full((), math.nan, dtype=torch.float64)
    pairs = int(real.sum())
    if pairs:
        rows = torch.cat([real, real])
        ref = micro_batch.get("ref_logps")
        terms = pair_loss(scores.double()[:2, rows], counts[:, rows], None if ref is None else ref[real])
        zero = scores.new_zeros((), dtype=torch.float64)  # on the scores' device (a GPU's)
        aux = scores.double()[2, 0] if scores.shape[0] > 2 else zero
        extra = {AUX_METRIC: scores.double()[3, 0] if scores.shape[0] > 3 else nan, **terms.metrics}
        per_pair = [terms.pair_mean + aux] + [extra[n] if n != token_metric else zero for n in names]
        out[: len(names) + 1] = torch.stack([v.detach().double().reshape(()) for v in per_pair]) * pairs
        out[-3:] = torch.stack([terms.nll_sum.detach().double(), terms.nll_tokens.double(), zero + pairs])
    return out


def pair_means(names: tuple[str, ...], token_metric: str | None, sums: Sequence[float]) -> dict[str, float]:
    """``val_loss`` and ``val_<metric>`` from :func:`pair_sums` summed over a whole set: the per-pair part's mean over
    pairs plus the NLL's token mean (ORPO, nll_mean=tokens), each pair metric's mean over pairs, ``token_metric`` the
    token mean."""
    pair_part, metric_sums, (nll_sum, nll_tokens, pairs) = sums[0], sums[1:-3], sums[-3:]
    nll = nll_sum / nll_tokens if nll_tokens else 0.0
    out = {"val_loss": pair_part / pairs + nll if pairs else math.nan}
    for name, value in zip(names, metric_sums):
        if name == AUX_METRIC and math.isnan(value):  # a dense model: no load-balancing loss, an empty column
            continue
        out[f"val_{name}"] = nll if name == token_metric else (value / pairs if pairs else math.nan)
    return out


def dpo_loss_of(dpo: Any) -> DPOLoss:
    """The DPO loss ``model_alignment_strategy.dpo`` describes (``kl_beta``, ``loss_type`` — one name or a list —,
    ``loss_weights``, ``label_smoothing``, ``f_divergence_type``, ``f_alpha_divergence_coef``, ``discopop_tau``)."""
    names = (dpo.loss_type,) if isinstance(dpo.loss_type, str) else tuple(str(n) for n in dpo.loss_type)
    weights = getattr(dpo, "loss_weights", None)  # the keys after loss_type may be absent from a block built by hand
    return DPOLoss(
        beta=float(dpo.kl_beta),
        loss_type=names,
        loss_weights=None if weights is None else tuple(float(w) for w in weights),
        label_smoothing=float(getattr(dpo, "label_smoothing", 0.0)),
        f_divergence_type=str(getattr(dpo, "f_divergence_type", "reverse_kl")),
        f_alpha_divergence_coef=float(getattr(dpo, "f_alpha_divergence_coef", 0.5)),
        discopop_tau=float(getattr(dpo, "discopop_tau", 0.05)),
    )


def dpo_objective(dpo: Any) -> Objective:
    """DPO's loss from ``model_alignment_strategy.dpo`` (:func:`dpo_loss_of`); the registry's DPO spec builds it. With
    an ``sft`` loss type its term is a token mean over the global batch's chosen responses, logged as ``sft_loss``
    (weighted as it enters the loss)."""
    loss = dpo_loss_of(dpo)
    token_metric = SFT_METRIC if loss.sft_weight else None
    metrics = REWARD_METRICS + ((SFT_METRIC,) if token_metric else ()) + (AUX_METRIC,)
    pair_loss: PairLoss = functools.partial(dpo_pair_loss, loss)
    return Objective(
        "dpo",
        functools.partial(pair_objective_loss, pair_loss, metrics, token_metric),
        token_weighted=False,
        pairs=True,
        reference=True,
        online_reference=not getattr(dpo, "precompute_ref_log_probs", True),
        metrics=metrics,
        pair_loss=pair_loss,
        token_metric=token_metric,
        token_count=chosen_response_tokens if token_metric else None,
        aux_real_tokens=True,
    )


def orpo_objective(orpo: Any) -> Objective:
    """ORPO's loss from ``model_alignment_strategy.orpo`` (``beta``, ``nll_mean``); the registry's ORPO spec builds it."""
    nll_mean = orpo.nll_mean
    if nll_mean not in ORPO_NLL_MEANS:
        raise ValueError(f"model_alignment_strategy.orpo.nll_mean={nll_mean!r}: use one of {', '.join(ORPO_NLL_MEANS)}")
    token_metric = NLL_METRIC if nll_mean == "tokens" else None
    pair_loss: PairLoss = functools.partial(orpo_pair_loss, float(orpo.beta), nll_mean)
    return Objective(
        "orpo",
        functools.partial(pair_objective_loss, pair_loss, ORPO_METRICS, token_metric),
        token_weighted=False,
        pairs=True,
        metrics=ORPO_METRICS,
        pair_loss=pair_loss,
        token_metric=token_metric,
        token_count=chosen_sequence_tokens if token_metric else None,
        aux_real_tokens=True,
    )
