"""Training objectives as small pure functions: causal LM (SFT) cross-entropy with masked labels, DPO, ORPO and
GRPO (group-relative advantages and the clipped-surrogate policy loss with an optional k3 KL penalty).

Conventions shared with the hub models' ``loss_fn`` and ``nxdt.data``:

* **Labels are already shifted by the data pipeline**: ``labels[b, t]`` is the token that should follow
  ``input_ids[b, t]``, so ``logits[b, t]`` is scored against ``labels[b, t]`` with no shifting here.
* Positions labelled ``ignore_index`` (-100) — SFT prompt tokens, padding — contribute nothing.
* Everything is computed in fp32 whatever the logits' dtype. These functions take full-vocabulary logits;
  a vocabulary-sharded (tensor-parallel) head needs its own distributed log-softmax for
  :func:`token_log_probs` (its ``cross_entropy`` already covers :func:`causal_lm_loss`).

Preference objectives take per-sequence log-probabilities (from :func:`sequence_log_probs`) so that the
reference model's values can be precomputed once and fed in as plain tensors.

Imports only torch (the model-hub layer rule of docs/architecture.md §2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "token_log_probs",
    "sequence_log_probs",
    "causal_lm_loss",
    "dpo_loss",
    "DPOLoss",
    "f_divergence_scores",
    "orpo_loss",
    "odds_ratio_terms",
    "log1mexp",
    "DPO_LOSS_TYPES",
    "DPO_BATCH_SORTED_LOSS_TYPES",
    "F_DIVERGENCES",
    "F_DIVERGENCE_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "SCALE_REWARDS",
    "nanstd",
    "grpo_advantages",
    "grpo_loss",
]


def _check_shapes(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: logits must be "
            f"labels' shape + [vocab] (labels are already shifted: labels[t] follows input_ids[t])"
        )


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token log-probability of the label: ``out[b, t] = log softmax(logits[b, t])[labels[b, t]]``.

    Formula: log p(y_t | x_<=t) = z_{t, y_t} − log Σ_v exp(z_{t, v}), in fp32. Labels are aligned with the
    logits (already shifted). Positions whose label is ``ignore_index`` get 0 (not a probability of anything),
    so sums over a row are sums over the scored tokens only. Shape: ``labels.shape``.
    """
    _check_shapes(logits, labels)
    mask = labels != ignore_index
    safe = torch.where(mask, labels, torch.zeros_like(labels))  # any valid index; masked out below
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, logp, torch.zeros_like(logp))


def sequence_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of label log-probabilities over the non-masked tokens, and how many tokens that is.

    Formula: log π(y | x) = Σ_{t: labels[t] ≠ ignore} log p(labels[t] | x_<=t) (the sequence log-likelihood of
    the response given the prompt, prompt tokens being masked). Returns ``(sums, counts)``, both
    ``labels.shape[:-1]`` (``counts`` in the sums' dtype); the length-normalised (mean per-token) log-prob
    ORPO uses is ``sums / counts``.
    """
    mask = labels != ignore_index
    return token_log_probs(logits, labels, ignore_index).sum(-1), mask.sum(-1).to(torch.float32)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean next-token cross-entropy over the non-masked tokens of the whole batch (the SFT loss).

    Formula: L = −(1/N) Σ_{(b,t): labels[b,t] ≠ ignore} log softmax(logits[b,t])[labels[b,t]], N the number of
    such tokens (a token mean over the batch, not a mean of per-sequence means — as ``F.cross_entropy`` with
    ``ignore_index`` and the hub models' ``loss_fn``, which this equals when nothing is masked). Labels are
    already shifted. A batch with every label masked gives 0 (with zero gradient) rather than NaN.
    """
    logp = token_log_probs(logits, labels, ignore_index)
    count = (labels != ignore_index).sum()
    return -logp.sum() / count.clamp(min=1).to(logp.dtype)


# TRL's DPOConfig.loss_type values (trl/trainer/dpo_trainer.py, ``_compute_loss``), each a mean over pairs of a loss per
# pair, but "sft": a token mean over the chosen responses. Not here: TRL's "aot" and "aot_unpaired", which sort the log
# ratios over the batch, so a pair's loss depends on which pairs share its micro-batch (refused by name).
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "sft",
)
DPO_BATCH_SORTED_LOSS_TYPES = ("aot", "aot_unpaired")
# TRL's f-DPO regularisers (Wang et al. 2023), and the losses built on the chosen − rejected score that admit them
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """The preference metrics TRL reports (batch means, detached): rewards of the chosen and rejected answers,
    how often the chosen one wins, and the mean margin."""
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }


def f_divergence_scores(log_ratios: torch.Tensor, f_divergence_type: str, alpha: float) -> torch.Tensor:
    """f'(u) of the policy-to-reference ratio u = π/π_ref, from log u (f-DPO, Wang et al. 2023; TRL's forms):
    reverse KL log u (standard DPO), forward KL 1 − 1/u, Jensen–Shannon log 2 + log σ(log u), α-divergence
    (u^(α−1) − 1)/(α − 1) with the exponent clamped at 80 (α = 1 is reverse KL's limit)."""
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return log_ratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-log_ratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratios)
    if f_divergence_type == "alpha_divergence":
        return torch.expm1(((alpha - 1.0) * log_ratios).clamp(max=80.0)) / (alpha - 1.0)
    raise ValueError(f"dpo.f_divergence_type={f_divergence_type!r}: use one of {', '.join(F_DIVERGENCES)}")


@dataclass(frozen=True)
class DPOLoss:
    """Direct Preference Optimization's loss (Rafailov et al. 2023) and TRL's variants of it, as TRL's DPOTrainer
    computes them; ``beta`` is NxDT's ``dpo.kl_beta``. With log-ratios c = log π(y_c|x) − log π_ref(y_c|x), r likewise
    for the rejected answer, their f-divergence scores s_c, s_r (:func:`f_divergence_scores`; reverse KL: s = the log
    ratio) and Δ = s_c − s_r, each pair's loss by ``loss_type``:

    * ``sigmoid``  −log σ(βΔ) (the paper's eq. 7)
    * ``hinge``    max(0, 1 − βΔ) (SLiC, Zhao et al. 2023)
    * ``ipo``      (s_c/|y_c| − s_r/|y_r| − 1/(2β))² (Azar et al. 2023, eq. 17; TRL normalises by the response
      lengths, as the IPO authors confirmed)
    * ``sigmoid_norm`` −log σ(β(s_c/|y_c| − s_r/|y_r|))
    * ``robust``   (−(1 − ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε), ε = ``label_smoothing`` (Chowdhury et al. 2024)
    * ``exo_pair`` σ(βΔ)(log σ(βΔ) − log(1 − ε)) + σ(−βΔ)(log σ(−βΔ) − log ε) (EXO, Ji et al. 2024, eq. 16)
    * ``nca_pair`` −log σ(βc) − ½ log σ(−βc) − ½ log σ(−βr) (NCA, Chen et al. 2024)
    * ``bco_pair`` −log σ(βc) − log σ(−βr)
    * ``sppo_hard`` (c − 1/(2β))² + (r + 1/(2β))² (SPPO, Wu et al. 2024, hard labels)
    * ``apo_zero`` 1 − σ(βc) + σ(βr);  ``apo_down`` σ(βc) + 1 − σ(β(c − r)) (APO, D'Oosterlinck et al. 2024)
    * ``discopop`` (1 − m)·(−log σ(βΔ)) + m·exp(−βΔ), m = σ(βΔ/τ), τ = ``discopop_tau`` (Chris Lu et al. 2024)

    and ``sft``, not a per-pair loss: the chosen responses' token-mean negative log-likelihood −Σ log π(y_c|x) / Σ |y_c|.
    Several types add up weighted by ``loss_weights`` (default 1 each): TRL's combinations, e.g. MPO's
    ``[sigmoid, bco_pair, sft]``. Everything in fp32."""

    beta: float
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05

    def __post_init__(self) -> None:
        # the settings' full checks, with their config keys, run before launch (nxdt.config.validate)
        unknown = [name for name in self.loss_type if name not in DPO_LOSS_TYPES]
        if unknown or not self.loss_type:
            raise ValueError(f"dpo.loss_type {list(self.loss_type)}: each must be one of {', '.join(DPO_LOSS_TYPES)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"dpo.loss_weights {list(self.loss_weights)}: give one weight per loss_type {list(self.loss_type)}")
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ValueError(f"dpo.f_divergence_type={self.f_divergence_type!r}: use one of {', '.join(F_DIVERGENCES)}")

    @property
    def weighted(self) -> list[tuple[str, float]]:
        """(loss type, its weight) in ``loss_type``'s order."""
        return list(zip(self.loss_type, self.loss_weights or (1.0,) * len(self.loss_type)))

    @property
    def sft_weight(self) -> float:
        """The weight of the ``sft`` term (0 without one)."""
        return sum(weight for name, weight in self.weighted if name == "sft")

    def pair_losses(
        self,
        policy_chosen_logps: torch.Tensor,
        policy_rejected_logps: torch.Tensor,
        ref_chosen_logps: torch.Tensor,
        ref_rejected_logps: torch.Tensor,
        chosen_tokens: torch.Tensor | None = None,
        rejected_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Every pair's weighted sum of the per-pair losses [B] (the ``sft`` term left out: :meth:`__call__` adds it)
        from the summed response log-probabilities [B] and, for ``ipo`` and ``sigmoid_norm``, the response token
        counts [B]; and TRL's reward metrics (β × the log ratios, whatever the loss)."""
        chosen = policy_chosen_logps.float() - ref_chosen_logps.float()
        rejected = policy_rejected_logps.float() - ref_rejected_logps.float()
        chosen_scores = f_divergence_scores(chosen, self.f_divergence_type, self.f_alpha_divergence_coef)
        rejected_scores = f_divergence_scores(rejected, self.f_divergence_type, self.f_alpha_divergence_coef)
        beta, eps = self.beta, self.label_smoothing
        z = beta * (chosen_scores - rejected_scores)
        total = torch.zeros_like(chosen)
        for loss_type, weight in self.weighted:
            if loss_type in ("ipo", "sigmoid_norm"):
                if chosen_tokens is None or rejected_tokens is None:
                    raise ValueError(f"dpo.loss_type {loss_type} needs each response's token count")
                normalised = chosen_scores / chosen_tokens.float().clamp(min=1) - rejected_scores / rejected_tokens.float().clamp(
                    min=1
                )
            if loss_type == "sigmoid":
                losses = -F.logsigmoid(z)
            elif loss_type == "hinge":
                losses = torch.relu(1 - z)
            elif loss_type == "ipo":
                losses = (normalised - 1 / (2 * beta)) ** 2
            elif loss_type == "sigmoid_norm":
                losses = -F.logsigmoid(beta * normalised)
            elif loss_type == "robust":
                losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
            elif loss_type == "exo_pair":
                losses = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
                    F.logsigmoid(-z) - math.log(eps)
                )
            elif loss_type == "nca_pair":
                losses = -F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen) - 0.5 * F.logsigmoid(-beta * rejected)
            elif loss_type == "bco_pair":
                losses = -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
            elif loss_type == "sppo_hard":
                losses = (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
            elif loss_type == "apo_zero":
                losses = 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
            elif loss_type == "apo_down":
                losses = torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * (chosen - rejected))
            elif loss_type == "discopop":
                mix = torch.sigmoid(z / self.discopop_tau)
                losses = -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
            else:  # sft: a token mean, not per pair
                continue
            total = total + weight * losses
        return total, reward_metrics(beta * chosen, beta * rejected)

    def __call__(self, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of a batch of B pairs from :meth:`pair_losses`'s inputs (the per-pair losses' mean, plus the
        weighted ``sft`` token mean) and the metrics (detached means over the pairs)."""
        losses, metrics = self.pair_losses(*inputs)  # type: ignore[arg-type]
        loss = losses.mean()
        if self.sft_weight:
            chosen, chosen_tokens = inputs[0], inputs[4] if len(inputs) > 4 else None
            if chosen is None or chosen_tokens is None:
                raise ValueError("dpo.loss_type sft needs each chosen response's token count")
            loss = loss - self.sft_weight * chosen.float().sum() / chosen_tokens.float().sum().clamp(min=1)
        return loss, metrics


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct Preference Optimization (Rafailov et al. 2023, "Direct Preference Optimization: Your Language
    Model is Secretly a Reward Model", eq. 7), ``loss_type="sigmoid"``:

        L = −mean_pairs log σ( β [ (log π(y_c|x) − log π_ref(y_c|x)) − (log π(y_r|x) − log π_ref(y_r|x)) ] )

    Inputs are per-pair *summed* sequence log-probs (:func:`sequence_log_probs`), shape [B]; ``beta`` is
    NxDT's ``dpo.kl_beta``. Returns ``(loss, metrics)``; metrics (detached, means over the B pairs), as TRL
    names them:

    * ``rewards/chosen``   = β (log π(y_c|x) − log π_ref(y_c|x))
    * ``rewards/rejected`` = β (log π(y_r|x) − log π_ref(y_r|x))
    * ``rewards/accuracies`` = fraction of pairs with rewards/chosen > rewards/rejected
    * ``rewards/margins``  = rewards/chosen − rewards/rejected

    Other ``loss_type`` values that need no token counts (TRL's hinge, robust, …): :class:`DPOLoss`, which also
    takes the counts ``ipo``, ``sigmoid_norm`` and ``sft`` need, several types at once, and the f-divergences.
    """
    return DPOLoss(beta, (loss_type,))(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, stable at both ends (Mächler 2012): log(−expm1(x)) for x > −log 2, else
    log1p(−exp(x)). x = 0 (probability 1) is nudged to the smallest negative number so the result is
    finite (≈ −87 in fp32) instead of −inf."""
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    near_zero = x > -0.6931471805599453
    # each branch gets only inputs where it is finite, so torch.where's backward sees no inf·0 = NaN
    safe = torch.full_like(x, -1.0)
    return torch.where(
        near_zero,
        torch.log(-torch.expm1(torch.where(near_zero, x, safe))),
        torch.log1p(-torch.exp(torch.where(near_zero, safe, x))),
    )


def odds_ratio_terms(
    chosen_logps_mean: torch.Tensor, rejected_logps_mean: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO's odds-ratio part, pair by pair: ``−β · log σ(log odds(y_c|x) − log odds(y_r|x))`` [B] (see
    :func:`orpo_loss`), and its metrics (detached means over the B pairs, TRL's names, without ``nll_loss``)."""
    chosen, rejected = chosen_logps_mean.float(), rejected_logps_mean.float()
    log_odds = (chosen - log1mexp(chosen)) - (rejected - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    metrics = {
        **reward_metrics(beta * chosen, beta * rejected),
        "log_odds_ratio": ratio.detach().mean(),
        "log_odds_chosen": log_odds.detach().mean(),
    }
    return -beta * ratio, metrics


def orpo_loss(
    chosen_logps_mean: torch.Tensor, rejected_logps_mean: torch.Tensor, chosen_nll: torch.Tensor, beta: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Odds Ratio Preference Optimization (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
    Reference Model", eqs. 4–7), with β the paper's λ (NxDT's ``orpo.beta``, TRL's ``beta``):

        odds(y|x) = P(y|x) / (1 − P(y|x)),  log P(y|x) = (1/|y|) Σ_t log p(y_t | x, y_<t)
        L_OR  = −log σ( log odds(y_c|x) − log odds(y_r|x) )
        L     = L_SFT + β · mean_pairs L_OR

    ``chosen_logps_mean`` / ``rejected_logps_mean`` [B] are the **length-normalised** sequence log-probs —
    the mean per-token log-prob over each response's non-masked tokens (``sums / counts`` of
    :func:`sequence_log_probs`), as in the paper and TRL — so P(y|x) is a geometric-mean token probability.
    ``chosen_nll`` is L_SFT, computed by the caller: TRL's ORPOTrainer (``concatenated_forward``) takes the token-mean
    cross-entropy over the chosen sequences' prompt **and** response tokens of the whole batch (what
    ``nxdt.lightning.objective`` computes over the global batch). log odds is computed stably as
    ``logp − log1mexp(logp)``.

    Returns ``(loss, metrics)``; metrics (detached, means over pairs): ``rewards/chosen`` = β·log P(y_c|x),
    ``rewards/rejected`` = β·log P(y_r|x), ``rewards/accuracies``, ``rewards/margins`` (as TRL's ORPO), plus
    ``log_odds_ratio`` (mean log σ(·)), ``log_odds_chosen`` (mean log-odds difference) and ``nll_loss``.
    """
    losses, metrics = odds_ratio_terms(chosen_logps_mean, rejected_logps_mean, beta)
    loss = chosen_nll.float() + losses.mean()
    return loss, {**metrics, "nll_loss": chosen_nll.detach().float()}


# --- GRPO (Shao et al. 2024, DeepSeekMath §4.1), with TRL's GRPOTrainer semantics and names ------------------------

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGE_STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (n − 1), as TRL's ``trainer.utils.nanstd``."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * count / (count - 1)
    std = variance.sqrt()
    return std if keepdim or dim is None else std.squeeze(dim)


def grpo_advantages(
    rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-relative advantages of N completions (rows grouped ``num_generations`` at a time, one group per prompt)
    from the rewards of F reward functions, TRL's ``sum_then_normalize`` (``GRPOTrainer._generate_and_score_
    completions``):

        r_i = Σ_f w_f · rewards_per_func[i, f]   (NaN — the function did not score i — counts as 0; all-NaN rows NaN)
        A_i = (r_i − mean_group(r)) / (std + 1e-4)

    where std is the group's (``scale_rewards="group"``), the whole batch's (``"batch"``), or no division at all
    (``"none"``, Dr. GRPO); stds are Bessel-corrected and NaN-aware. Unscorable rows get advantage 0. Returns
    ``(advantages [N], rewards [N], std [N])`` (std: the one used, or the group's under ``"none"``, for logging)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"grpo.scale_rewards={scale_rewards!r}: use one of {', '.join(SCALE_REWARDS)}")
    rewards_per_func = rewards_per_func.float()
    if rewards_per_func.shape[0] % num_generations:
        raise ValueError(f"{rewards_per_func.shape[0]} completions are not whole groups of num_generations={num_generations}")
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.float().unsqueeze(0)).nansum(dim=1)
    rewards = rewards.masked_fill(unscorable, float("nan"))
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + ADVANTAGE_STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), rewards, std


def grpo_loss(
    per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_processes: int = 1,
    row_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO policy loss of a batch of completions, as TRL's ``GRPOTrainer._compute_loss`` computes it (token-level
    importance sampling, no entropy mask, no vLLM correction; one gradient-accumulation step per generation):

        ρ_t  = exp(log π(o_t) − log π_old(o_t))       (π_old = the detached policy: ρ = 1, gradient of ρ·A)
        l_t  = −min(ρ_t A, clip(ρ_t, 1 − ε, 1 + ε_high) A)  + β · (exp(ref_t − logp_t) − (ref_t − logp_t) − 1)

    the last term being the k3 estimator of KL(π ‖ π_ref) (Schulman 2020), present only when ``beta`` != 0 (then
    ``ref_per_token_logps`` is required). Aggregation by ``loss_type``: ``grpo`` — mean over each completion's
    tokens, then over completions; ``bnpo`` — mean over the batch's tokens; ``dr_grpo`` — sum / (B ·
    ``max_completion_length``); ``dapo`` — sum / (``num_items_in_batch`` / ``num_processes``), where
    ``num_items_in_batch`` is the number of completion tokens over all data-parallel ranks (default: this batch's),
    so that averaging the ranks' gradients gives the global token mean.

    ``per_token_logps`` [B, T] (any T: only ``mask`` — 1 on completion tokens — says which count), ``advantages``
    [B]. ``row_tokens`` [B]: each completion's token count when ``mask`` covers only some of its positions (a context-
    parallel rank's part of the sequence: the loss is then that part's share of the whole, which the ranks add up);
    default ``mask.sum(-1)``. Returns ``(loss, metrics)``, metrics detached masked means over this batch's tokens (TRL's names): ``kl``
    (when beta != 0), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo.loss_type={loss_type!r} is not supported: use one of {', '.join(GRPO_LOSS_TYPES)}")
    if beta != 0.0 and ref_per_token_logps is None:
        raise ValueError("grpo_loss: beta != 0 needs ref_per_token_logps (the reference model's log-probs)")
    epsilon_low = epsilon
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    logps = per_token_logps.float()
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_per_token_logps is None else old_per_token_logps.float()
    adv = advantages.float().unsqueeze(1)
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    metrics: dict[str, torch.Tensor] = {}
    tokens = mask.sum().clamp(min=1.0)
    if beta != 0.0:
        assert ref_per_token_logps is not None
        delta = ref_per_token_logps.float() - logps
        per_token_kl = torch.exp(delta) - delta - 1
        per_token_loss = per_token_loss + beta * per_token_kl
        metrics["kl"] = ((per_token_kl * mask).sum() / tokens).detach()
    if loss_type == "grpo":
        counts = mask.sum(-1) if row_tokens is None else row_tokens.to(logps.dtype)
        loss = ((per_token_loss * mask).sum(-1) / counts.clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / tokens
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("grpo_loss: loss_type dr_grpo needs max_completion_length")
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    else:  # dapo
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=logps.dtype)
        loss = (per_token_loss * mask).sum() / (items.clamp(min=1.0) / num_processes)
    low = ((coef_1 < 1 - epsilon_low) & (adv < 0)).to(logps.dtype)
    high = ((coef_1 > 1 + epsilon_high) & (adv > 0)).to(logps.dtype)
    region = torch.maximum(low, high)
    for name, clipped in (("low", low), ("high", high), ("region", region)):
        metrics[f"clip_ratio/{name}_mean"] = ((clipped * mask).sum() / tokens).detach()
    return loss, metrics
