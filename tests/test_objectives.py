"""models/objectives.py against independent references: explicit loops over log_softmax, the hub models' own
loss_fn, and the published DPO / ORPO formulas evaluated with plain ``math`` from the same numbers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nxdt.models.llama import LlamaForCausalLM
from nxdt.models.objectives import causal_lm_loss, dpo_loss, log1mexp, orpo_loss, sequence_log_probs, token_log_probs


def _logits_labels(seed=0, b=3, s=7, v=11, mask_frac=0.4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, v, (b, s), generator=g)
    masked = torch.rand(b, s, generator=g) < mask_frac
    masked[:, -1] = False  # every row keeps a label
    return logits, labels.masked_fill(masked, -100)


def _hand_log_prob(row_logits, label):
    """log softmax by hand: z_y - log sum_v exp z_v, in Python floats."""
    zs = [float(z) for z in row_logits]
    m = max(zs)
    return zs[label] - (m + math.log(sum(math.exp(z - m) for z in zs)))


def test_token_and_sequence_log_probs_match_a_loop():
    logits, labels = _logits_labels()
    got = token_log_probs(logits, labels)
    sums, counts = sequence_log_probs(logits, labels)
    for b in range(labels.shape[0]):
        total, n = 0.0, 0
        for t in range(labels.shape[1]):
            y = int(labels[b, t])
            want = 0.0 if y == -100 else _hand_log_prob(logits[b, t], y)
            assert float(got[b, t]) == pytest.approx(want, abs=1e-6)
            if y != -100:
                total, n = total + want, n + 1
        assert float(sums[b]) == pytest.approx(total, abs=1e-5)
        assert float(counts[b]) == n


def test_labels_are_not_shifted_again():
    """labels[t] is scored against logits[t] (the data pipeline already shifted them)."""
    logits = torch.full((1, 2, 4), -10.0)
    logits[0, 0, 3] = 10.0
    logits[0, 1, 1] = 10.0
    assert float(causal_lm_loss(logits, torch.tensor([[3, 1]]))) < 1e-6
    assert float(causal_lm_loss(logits, torch.tensor([[1, 3]]))) > 10


def test_causal_lm_loss_is_the_masked_token_mean_cross_entropy():
    logits, labels = _logits_labels(seed=1)
    terms = [
        -_hand_log_prob(logits[b, t], int(labels[b, t]))
        for b in range(labels.shape[0])
        for t in range(labels.shape[1])
        if int(labels[b, t]) != -100
    ]
    assert float(causal_lm_loss(logits, labels)) == pytest.approx(sum(terms) / len(terms), abs=1e-6)
    assert float(causal_lm_loss(logits, labels)) == pytest.approx(
        float(F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)), abs=1e-6
    )


def test_causal_lm_loss_equals_the_models_loss_fn_when_nothing_is_masked():
    logits, labels = _logits_labels(seed=2, mask_frac=0.0)
    logits = logits.float()
    assert torch.allclose(causal_lm_loss(logits, labels), LlamaForCausalLM.loss_fn(logits, labels), atol=1e-6)
    logits16 = logits.to(torch.bfloat16)  # fp32 inside, whatever comes in
    assert torch.allclose(causal_lm_loss(logits16, labels), LlamaForCausalLM.loss_fn(logits16, labels), atol=1e-6)


def test_all_masked_batch_gives_zero_not_nan():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    loss = causal_lm_loss(logits, torch.full((2, 3), -100))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="already shifted"):
        causal_lm_loss(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))


NUMBERS = dict(
    pc=[-12.0, -30.5, -7.25, -3.0], pr=[-14.0, -29.0, -9.5, -2.0], rc=[-13.0, -31.0, -7.0, -2.5], rr=[-13.5, -28.0, -9.0, -2.25]
)


def _dpo_reference(beta):
    """Rafailov et al. 2023 eq. 7 with math, pair by pair."""
    losses, rc, rr = [], [], []
    for pc, pr, ref_c, ref_r in zip(NUMBERS["pc"], NUMBERS["pr"], NUMBERS["rc"], NUMBERS["rr"]):
        z = beta * ((pc - ref_c) - (pr - ref_r))
        losses.append(-math.log(1 / (1 + math.exp(-z))))
        rc.append(beta * (pc - ref_c))
        rr.append(beta * (pr - ref_r))
    n = len(losses)
    return (
        sum(losses) / n,
        sum(rc) / n,
        sum(rr) / n,
        sum(c > r for c, r in zip(rc, rr)) / n,
        sum(c - r for c, r in zip(rc, rr)) / n,
    )


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_dpo_loss_is_the_published_formula(beta):
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in NUMBERS.items()}
    loss, metrics = dpo_loss(t["pc"], t["pr"], t["rc"], t["rr"], beta)
    want, chosen, rejected, accuracy, margin = _dpo_reference(beta)
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(metrics["rewards/chosen"]) == pytest.approx(chosen, rel=1e-6)
    assert float(metrics["rewards/rejected"]) == pytest.approx(rejected, rel=1e-6)
    assert float(metrics["rewards/accuracies"]) == pytest.approx(accuracy)
    assert float(metrics["rewards/margins"]) == pytest.approx(margin, rel=1e-6, abs=1e-9)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc = torch.tensor(NUMBERS["pc"], requires_grad=True)
    pr = torch.tensor(NUMBERS["pr"], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor(NUMBERS["rc"]), torch.tensor(NUMBERS["rr"]), beta=0.1)
    loss.backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # descent raises log π(chosen), lowers log π(rejected)
    # the gradient is -β σ(-z)/B on chosen: check against the formula
    z = 0.1 * ((pc - torch.tensor(NUMBERS["rc"])) - (pr - torch.tensor(NUMBERS["rr"]))).detach()
    assert torch.allclose(pc.grad, -0.1 * torch.sigmoid(-z) / 4, atol=1e-7)
    # equal policy and reference: loss log 2, zero rewards
    same = torch.tensor(NUMBERS["rc"])
    loss, metrics = dpo_loss(same, same, same, same, beta=0.3)
    assert float(loss) == pytest.approx(math.log(2)) and float(metrics["rewards/margins"]) == 0


def test_dpo_loss_refuses_an_unknown_type_and_asks_for_the_token_counts_a_normalised_type_needs():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="each must be one of sigmoid, hinge"):
        dpo_loss(x, x, x, x, 0.1, loss_type="hinj")
    with pytest.raises(ValueError, match="ipo needs each response's token count"):
        dpo_loss(x, x, x, x, 0.1, loss_type="ipo")


def _orpo_reference(chosen_mean, rejected_mean, nll, beta):
    """Hong et al. 2024: odds = p / (1 - p), p = exp(mean token log-prob); L = nll - beta * mean log σ(Δ log odds)."""
    ratios = []
    for c, r in zip(chosen_mean, rejected_mean):
        pc, pr = math.exp(c), math.exp(r)
        log_odds = math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))
        ratios.append(math.log(1 / (1 + math.exp(-log_odds))))
    return nll - beta * sum(ratios) / len(ratios), sum(ratios) / len(ratios)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_loss_is_the_published_formula(beta):
    chosen_mean = [-0.4, -1.2, -2.5, -0.05]
    rejected_mean = [-0.9, -1.1, -3.0, -0.3]
    nll = 0.87
    loss, metrics = orpo_loss(
        torch.tensor(chosen_mean, dtype=torch.float64), torch.tensor(rejected_mean, dtype=torch.float64), torch.tensor(nll), beta
    )
    want, ratio = _orpo_reference(chosen_mean, rejected_mean, nll, beta)
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(metrics["log_odds_ratio"]) == pytest.approx(ratio, rel=1e-6)
    assert float(metrics["rewards/chosen"]) == pytest.approx(beta * sum(chosen_mean) / 4, rel=1e-6)
    assert float(metrics["rewards/accuracies"]) == pytest.approx(0.75)
    assert float(metrics["nll_loss"]) == pytest.approx(nll)


def test_orpo_from_sequence_log_probs_is_length_normalised():
    """The inputs are sums / counts of sequence_log_probs: the mean per-token log-prob of each response."""
    logits, labels = _logits_labels(seed=3, b=4)
    sums, counts = sequence_log_probs(logits, labels)
    means = sums / counts
    chosen_nll = causal_lm_loss(logits[:2], labels[:2])
    loss, _ = orpo_loss(means[:2], means[2:], chosen_nll, beta=0.2)
    want, _ = _orpo_reference(means[:2].tolist(), means[2:].tolist(), float(chosen_nll), 0.2)
    assert float(loss) == pytest.approx(want, rel=1e-6)


def test_orpo_gradient_direction_and_stability():
    c = torch.tensor([-0.5, -1e-9, -40.0], requires_grad=True)  # near p = 1 and p ≈ 0: finite anyway
    r = torch.tensor([-0.7, -0.2, -45.0], requires_grad=True)
    loss, _ = orpo_loss(c, r, torch.tensor(0.0), beta=1.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(c.grad).all() and torch.isfinite(r.grad).all()
    assert (c.grad < 0).all() and (r.grad > 0).all()


def test_log1mexp_is_stable():
    x = torch.tensor([-1e-10, -1e-3, -0.5, -0.7, -5.0, -50.0, 0.0], dtype=torch.float64)
    want = [math.log(-math.expm1(v)) if v < 0 else None for v in x.tolist()]
    got = log1mexp(x).tolist()
    for g, w in zip(got[:-1], want[:-1]):
        assert g == pytest.approx(w, rel=1e-12)
    assert math.isfinite(got[-1])
