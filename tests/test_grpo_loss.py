"""GRPO's loss and advantages against TRL's GRPOTrainer (trl 1.16, trl/trainer/grpo_trainer.py).

The loss runs **TRL's own** ``GRPOTrainer._compute_loss`` (called as a plain function on a namespace holding exactly
the trainer attributes it reads) on a transformers ``LlamaForCausalLM``, and nxdt's ``grpo_loss`` on the nxdt Llama
with the same weights: equal loss and equal gradients (every parameter) for loss_type grpo, dapo, bnpo and dr_grpo,
beta 0 and > 0. The per-token log-probs TRL's method asks for come from the transformers model the way
``_get_per_token_logps_and_entropies`` computes them (logits of the completion positions divided by the sampling
temperature, TRL's ``selective_log_softmax_and_entropy``), without TRL's fused-head patch of the model's forward.
The advantages follow grpo_trainer.py lines 2759-2810 (sum_then_normalize), which are inline in
``_generate_and_score_completions`` (not importable): the test restates them in float64 (``reference_advantages``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import MethodType, SimpleNamespace

import pytest
import torch

from nxdt.lightning.hf import hf_name
from nxdt.models.generate import completion_batch
from nxdt.models.llama import LlamaForCausalLM
from nxdt.models.objectives import grpo_advantages, grpo_loss
from hf_reference import TINY_LLAMA, llama_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")  # its GRPO trainer module itself (~5 CPU-s) is imported by the tests that call it


def trl_grpo():
    from trl.trainer import grpo_trainer, utils

    return grpo_trainer.GRPOTrainer, utils.selective_log_softmax_and_entropy


TINY = TINY_LLAMA
# 2 prompts × num_generations 3; prompts of one length (TRL's forward gives left pads positions too, nxdt does not,
# so only unpadded prompts are the same computation); completions of different lengths (right padding)
PROMPTS = [[5, 17, 42, 3], [7, 1, 9, 30]]
COMPLETIONS = [[8, 9, 10, 2], [11, 2], [12, 13, 14, 15, 16], [20, 21], [22, 23, 24], [25]]
NUM_GENERATIONS = 3
TEMPERATURE = 0.9
MAX_COMPLETION_LENGTH = 6


def models():
    torch.manual_seed(0)
    policy = LlamaForCausalLM(SimpleNamespace(**TINY))
    reference = LlamaForCausalLM(SimpleNamespace(**TINY))
    with torch.no_grad():
        for p, r in zip(policy.parameters(), reference.parameters()):
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
            r.copy_(p + 0.05 * torch.randn_like(p))  # a reference near the policy, as after some training
    hf = {}
    for name, model in (("policy", policy), ("reference", reference)):
        h = transformers.LlamaForCausalLM(llama_config(transformers, TINY))
        h.load_state_dict({hf_name(n): t for n, t in model.state_dict().items()}, strict=True)
        hf[name] = h.eval()  # eval: no dropout; TRL's mode switch reads `self.model.training`, given below
    return policy, reference, hf


def trl_logps(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
    """What TRL's ``_get_per_token_logps_and_entropies`` returns (log-probs of the completion tokens under the
    temperature-scaled logits, and their entropies), computed on an unpatched transformers model."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1 : -1]
    logps, entropy = trl_grpo()[1](logits, input_ids[:, -logits_to_keep:], temperature=TEMPERATURE)
    return logps, entropy, None


def trl_trainer(loss_type: str, beta: float, epsilon: float, epsilon_high: float) -> SimpleNamespace:
    """The attributes ``GRPOTrainer._compute_loss`` reads, for one process, no accumulation, token-level ratios."""
    identity = lambda t, **_: t  # noqa: E731  (one process: gather and reduce return their input)
    fake = SimpleNamespace(
        loss_type=loss_type,
        beta=beta,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        use_vllm=False,
        max_completion_length=MAX_COMPLETION_LENGTH,
        current_gradient_accumulation_steps=1,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        accelerator=SimpleNamespace(num_processes=1, reduce=identity, gather=identity, gather_for_metrics=identity),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    fake._get_per_token_logps_and_entropies = MethodType(trl_logps, fake)
    return fake


def trl_inputs(hf_reference, advantages: torch.Tensor, beta: float) -> dict:
    width = max(len(c) for c in COMPLETIONS)
    prompt_ids = torch.tensor([p for p in PROMPTS for _ in range(NUM_GENERATIONS)])
    completion_ids = torch.zeros(len(COMPLETIONS), width, dtype=torch.long)
    completion_mask = torch.zeros(len(COMPLETIONS), width, dtype=torch.long)
    for i, c in enumerate(COMPLETIONS):
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    if beta != 0.0:
        with torch.no_grad():
            ids = torch.cat([prompt_ids, completion_ids], dim=1)
            mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
            inputs["ref_per_token_logps"] = trl_logps(None, hf_reference, ids, mask, width)[0]
    return inputs


def nxdt_logps(model, batch):
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], segment_ids=batch["segment_ids"])
    return model.token_log_probs(logits / TEMPERATURE, batch["labels"])


def reference_advantages(per_func: torch.Tensor, weights: torch.Tensor, group: int, scale: str):
    """GRPO's advantages as TRL documents them (sum_then_normalize), written out here in float64: a completion's
    reward is the weighted sum of the functions that scored it (NaN when none did); its advantage is the reward minus
    its group's mean, divided by (std + 1e-4) — the group's std for scale_rewards 'group', the whole batch's for
    'batch', no division for 'none' — with NaN rewards left out of means and stds (the unbiased std over what was
    scored, TRL's nanstd) and a NaN advantage counted as 0. Returns (advantages, rewards, std per completion)."""
    nan = float("nan")

    def mean_std(values: list[float]) -> tuple[float, float]:
        xs = [v for v in values if v == v]
        mean = sum(xs) / len(xs) if xs else nan
        return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else nan

    rewards = []
    for row in per_func.tolist():
        scored = [v * w for v, w in zip(row, weights.tolist()) if v == v]
        rewards.append(sum(scored) if scored else nan)
    advantages, stds = [], []
    for at in range(0, len(rewards), group):
        mean, std = mean_std(rewards[at : at + group])
        std = mean_std(rewards)[1] if scale == "batch" else std
        for r in rewards[at : at + group]:
            a = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
            advantages.append(0.0 if a != a else a)
            stds.append(std)
    return (torch.tensor(v, dtype=torch.float64) for v in (advantages, rewards, stds))


def test_advantages_equal_trl():
    """TRL grpo_trainer.py 2759-2810 (sum_then_normalize, with TRL's nanstd) as :func:`reference_advantages` restates
    it, for each scale_rewards, with a NaN (a function that did not score a completion) and a row no function scored.
    fp32 against float64 over a handful of operations on values of order 1: atol 1e-6 is ~10 ulps of margin."""
    nan = float("nan")
    per_func = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 0.25], [nan, nan], [0.0, 1.0], [0.0, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    for scale in ("group", "batch", "none"):
        expected, rewards, std_rewards = reference_advantages(per_func, weights, NUM_GENERATIONS, scale)
        ours, our_rewards, our_std = grpo_advantages(per_func, weights, NUM_GENERATIONS, scale)
        for got, want in ((ours, expected), (our_rewards, rewards), (our_std, std_rewards)):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6, equal_nan=True)
    with pytest.raises(ValueError, match="grpo.scale_rewards='mean'"):
        grpo_advantages(per_func, weights, NUM_GENERATIONS, "mean")


@pytest.mark.parametrize(
    "loss_type, beta, off_policy",
    [
        ("grpo", 0.0, False),
        ("grpo", 0.04, False),
        ("dapo", 0.0, False),
        ("dapo", 0.04, False),
        ("bnpo", 0.04, False),
        ("dr_grpo", 0.04, False),
        # num_iterations > 1: the later steps' ratios to the log-probabilities of the policy that sampled (TRL's
        # inputs["old_per_token_logps"]), here the reference model's, ~0.05 away: ratios off 1, clipping active
        ("grpo", 0.0, True),
        ("dapo", 0.04, True),
    ],
)
def test_loss_and_gradients_equal_trls_compute_loss(loss_type, beta, off_policy):
    policy, reference, hf = models()
    advantages = torch.tensor([1.2, -0.3, -0.9, 0.7, 0.0, -0.7])
    epsilon, epsilon_high = 0.2, 0.28
    fake = trl_trainer(loss_type, beta, epsilon, epsilon_high)
    inputs = trl_inputs(hf["reference"], advantages, beta)
    if off_policy:
        width = inputs["completion_ids"].shape[1]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            inputs["old_per_token_logps"] = trl_logps(None, hf["reference"], ids, mask, width)[0]
    expected = trl_grpo()[0]._compute_loss(fake, hf["policy"], inputs)
    expected.backward()

    prompts = [p for p in PROMPTS for _ in range(NUM_GENERATIONS)]
    batch = completion_batch(prompts, COMPLETIONS)
    mask = batch["labels"] != -100
    ref = old = None
    if beta != 0.0 or off_policy:
        with torch.no_grad():
            ref = nxdt_logps(reference, batch)
        old, ref = (ref, ref if beta != 0.0 else None) if off_policy else (None, ref)
    loss, metrics = grpo_loss(
        nxdt_logps(policy, batch),
        mask,
        advantages,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        beta=beta,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        max_completion_length=MAX_COMPLETION_LENGTH,
        num_items_in_batch=mask.sum(),
    )
    loss.backward()
    # Both sides compute the same fp32 math with different kernels (transformers' attention and matmul order vs
    # nxdt's), so values agree to fp32 rounding accumulated over 2 layers: rtol 1e-5 (the bar); atol covers
    # gradient entries that are near 0 by cancellation, at 1e-6 of the largest gradient.
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    grads = {hf_name(n): p.grad for n, p in policy.named_parameters()}
    scale = max(float(p.grad.abs().max()) for p in hf["policy"].parameters())
    for name, p in hf["policy"].named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)
    metrics_trl = fake._metrics["train"]
    if beta != 0.0:
        assert metrics["kl"].item() == pytest.approx(metrics_trl["kl"][0], rel=1e-5)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[key].item() == pytest.approx(metrics_trl[key][0], abs=1e-7)
    if off_policy:
        assert metrics["clip_ratio/region_mean"].item() > 0  # the ratios moved past the clipping range


def test_beta_zero_needs_no_reference_and_bad_types_are_refused():
    logps, mask, adv = torch.zeros(2, 3, requires_grad=True), torch.ones(2, 3), torch.tensor([1.0, -1.0])
    loss, metrics = grpo_loss(logps, mask, adv, beta=0.0, loss_type="grpo")
    assert "kl" not in metrics and loss.item() == 0.0  # ratio 1, advantages summing to 0
    with pytest.raises(ValueError, match="needs ref_per_token_logps"):
        grpo_loss(logps, mask, adv, beta=0.1)
    with pytest.raises(ValueError, match="grpo.loss_type='sapo' is not supported"):
        grpo_loss(logps, mask, adv, loss_type="sapo")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_a_context_parallel_ranks_part_of_each_row_gives_its_share_of_the_loss(loss_type):
    """Under CP a rank scores only its chunks of every row: the loss of each part (its mask; each row's whole token
    count ``row_tokens``; bnpo's and dapo's batch counts the whole batch's) adds up over the parts to the whole batch's
    loss, gradients included — which the CP ranks' gradient sum (×CP, then DP×CP average) relies on. Two parts of
    float sums in a different order: rtol 1e-6."""
    torch.manual_seed(1)
    logps = (-torch.rand(4, 8)).requires_grad_(True)
    old = logps.detach() + 0.1 * torch.randn(4, 8)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [0] * 2 + [1] * 6, [1] * 3 + [0] * 5], dtype=torch.float32)
    advantages = torch.tensor([0.5, -1.0, 1.5, -0.2])
    kwargs = dict(
        old_per_token_logps=old,
        loss_type=loss_type,
        max_completion_length=8,
        num_items_in_batch=mask.sum(),
        ref_per_token_logps=old,
        beta=0.04,
    )
    whole, _ = grpo_loss(logps, mask, advantages, **kwargs)
    (want,) = torch.autograd.grad(whole, logps)
    part = torch.zeros(8, dtype=torch.bool)
    part[[0, 1, 6, 7]] = True  # CP2's load-balanced chunks of rank 0: positions 0-1 and 6-7
    total = 0
    for keep in (part, ~part):
        kw = dict(kwargs)
        kw["old_per_token_logps"] = old[:, keep]
        kw["ref_per_token_logps"] = old[:, keep]
        if loss_type == "bnpo":  # a token mean over the whole batch: nxdt passes that count (the dapo path)
            kw.update(loss_type="dapo", num_items_in_batch=mask.sum())
        loss, _ = grpo_loss(logps[:, keep], mask[:, keep], advantages, row_tokens=mask.sum(-1), **kw)
        total = total + loss
    (got,) = torch.autograd.grad(total, logps)
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
