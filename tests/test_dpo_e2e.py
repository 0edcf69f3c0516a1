"""The DPO and ORPO examples in NxD Training's config format (tests/nxdt_configs/hf_llama3_8B_DPO_config.yaml, _ORPO_config.yaml),
shrunk by overrides (test_sft_e2e.SHRINK: a 2-layer model, a Hugging Face tokenizer directory with a chat template, the
shipped preference records), trained through `nxdt train --config-path ... --config-name ...` on CPU. One launch per
layout, each checked several ways:

* DPO at initialisation: the reference *is* the policy, so step 1's rewards are 0 and its loss is log 2 on every layout.
  The reference log-probabilities were computed before training by each data-parallel rank for its own slice of the
  pairs and gathered by sample index; a pair fed with another pair's reference values would have rewards of order
  β·|Δ log π| ≈ 0.5·10, so this checks that every batch finds its own pairs' values, whatever the sampler's order;
* DP2 with ZeRO-1 (as the file says) × PP2 (the last stage scores the reference, forward only) gives the single
  process's losses and reward metrics (TP's vocabulary-sharded log-probabilities: tests/parallel/test_tensor_parallel.py);
* ORPO's step-1 loss on DP2 × PP2 equals the published formula (Hong et al. 2024; the NLL as TRL's ORPOTrainer takes
  it: the token mean over the global batch's chosen prompts and responses) computed here, independently, from the same
  initial weights on the same first global batch (against TRL itself and at every micro-batch size: tests/test_orpo.py).

DP2 and PP2 were two launches each; one DP2 × PP2 launch of 4 ranks checks both at half the compute (each of the two
trained the whole global batch): a wrong data-parallel reduction or token count, or a wrong pipeline hand-off or
last-stage scaling, still moves step 1's numbers.
"""

from __future__ import annotations

import math

import pytest
import warm_cli
import torch
import torch.nn.functional as F

from nxdt.data import SAMPLE_PREFERENCES
from test_sft_e2e import CONFIGS, SHRINK, _rows, _tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
# fp32 from scratch. AdamW with eps=1: for these gradients (|g| ≪ 1) its update lr·m̂/(√v̂+1) ≈ lr·m̂ is linear in the
# gradient (momentum SGD), so the layouts' fp32 reduction-order differences (~1e-7 relative) stay that small instead of
# being amplified by Adam's normalisation of near-zero gradient elements (whose sign may differ between layouts).
PARITY = [
    "precision.type=fp32",
    "model.weight_init_only=false",
    "exp_manager.resume_from_checkpoint=null",
    "model.optim.eps=1.0",
    "model.optim.lr=0.5",
    "model.optim.weight_decay=0.0",
    "model.optim.fixed_weight_decay=null",  # an NxDT hf config decays at 0.01 whatever weight_decay says: use it
    "data.dev_choose_samples=64",
    f"data.train_dir={SAMPLE_PREFERENCES}",
    # no clipping: a layout that scaled the gradient (a reduction's sum vs mean) would be clipped back to norm 1
    "trainer.gradient_clip_val=0",
]


# NxDT's files allow 2048 prompt tokens, more than SHRINK's 64-token sequences hold (refused since issue 38: no room
# left for the responses): the most the 64-token sequences allow, so no sample prompt is cut (as with 2048)
SHORT_PROMPTS = {
    "hf_llama3_8B_DPO_config": "model_alignment_strategy.dpo.max_prompt_length=63",
    "hf_llama3_8B_ORPO_config": "model_alignment_strategy.orpo.max_prompt_length=63",
}


def _train(cwd, name, *overrides):
    args = ["train", "--config-path", str(CONFIGS), "--config-name", name, *SHRINK, SHORT_PROMPTS[name], *overrides]
    result = warm_cli.run(args, cwd=cwd, timeout=230)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("dpo_data") / "tokenizer")


def _dpo(tmp, tokenizer, *layout):
    run = tmp / "run"
    result = _train(
        tmp,
        "hf_llama3_8B_DPO_config",
        *PARITY,
        "model_alignment_strategy.dpo.kl_beta=0.5",
        *layout,
        f"exp_manager.explicit_log_dir={run}",
        f"data.tokenizer.type={tokenizer}",
    )
    return _rows(run), result.stdout, run


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokenizer):
    return _dpo(tmp_path_factory.mktemp("dpo_single"), tokenizer, "trainer.devices=1")


def _at_initialisation(rows):
    """Step 1: policy = reference, so every reward is β·(log π − log π_ref) = 0 up to the fp32 rounding of two forwards
    of the same row in differently sized batches (|Δ log π| ≲ 1e-6·|log π| ≈ 1e-4 for ~20 scored tokens, times β = 0.5),
    and the loss −log σ(0) = log 2."""
    first = rows[0]
    assert float(first["loss"]) == pytest.approx(math.log(2), abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(float(first[name])) < 1e-4, first
    assert float(first["rewards/accuracies"]) <= 1.0


def test_the_nxdt_dpo_config_trains_and_starts_at_log_2(reference):
    rows, stdout, run = reference
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(r["aux_loss"] == "" for r in rows)  # a dense model: TRL's column, with no load-balancing loss to log
    _at_initialisation(rows)
    # it learns: the chosen answers gain on the rejected ones, and the loss falls below log 2
    assert float(rows[-1]["rewards/margins"]) > 0 and float(rows[-1]["loss"]) < math.log(2), rows
    for r in rows:  # the margin is the difference of the two means (each a mean over the same pairs)
        assert float(r["rewards/margins"]) == pytest.approx(float(r["rewards/chosen"]) - float(r["rewards/rejected"]), abs=1e-6)
    # the launcher read and truncated the pairs before any worker started, and said so
    assert "nxdt: train: 64 preference records → 64 pairs (chosen and rejected in one micro-batch); 0 prompts truncated" in stdout


# DP2 (ZeRO-1, as the files say) × PP2: data parallelism and the pipeline in one launch (module docstring)
DP2_X_PP2 = ["trainer.devices=4", "distributed_strategy.pipeline_model_parallel_size=2"]
# CP2 × PP2: every sequence split over two ranks, its log-probabilities added up over them (the reference's too, scored
# by the last stage), ZeRO-1 over the DP×CP replicas
CP2_X_PP2 = [*DP2_X_PP2, "distributed_strategy.context_parallel_size=2"]
# the reference scored each step instead (precompute_ref_log_probs: false, TRL's default) by a frozen copy of the starting
# weights — sharded in FSDP units of its own, its ring over the CP pair — on DP2 × CP2 with FSDP: the same numbers
ONLINE_REFERENCE = [
    "trainer.devices=4",
    "distributed_strategy.context_parallel_size=2",
    "distributed_strategy.zero1=false",
    "distributed_strategy.fsdp.enabled=true",
    "model_alignment_strategy.dpo.precompute_ref_log_probs=false",
]


@pytest.mark.parametrize(
    "layout", [DP2_X_PP2, CP2_X_PP2, ONLINE_REFERENCE], ids=["dp2-x-pp2", "cp2-x-pp2", "dp2-x-cp2-fsdp-online-reference"]
)
def test_parallel_dpo_equals_one_process(tmp_path, reference, tokenizer, layout):
    got, _, _ = _dpo(tmp_path, tokenizer, *layout)
    want, _, _ = reference
    _at_initialisation(got)
    # fp32, linear updates (PARITY): losses differ by float rounding only (~1e-7 relative), far inside 1e-4; rewards are
    # β·(differences of summed log-probs of ~-50): their rounding is ~β·1e-5 absolute, so abs 1e-4 next to rel 1e-4
    for g, w in zip(got, want, strict=True):
        assert float(g["loss"]) == pytest.approx(float(w["loss"]), rel=1e-4), (got, want)
        for name in REWARDS:
            assert float(g[name]) == pytest.approx(float(w[name]), rel=1e-4, abs=1e-4), (name, got, want)


def test_the_file_as_it_is_starts_from_a_checkpoint_and_keeps_its_reference_across_a_restart(tmp_path, reference, tokenizer):
    """NxDT's DPO file unchanged but for the shrinking (test_sft_e2e.SHRINK: lr 3e-3): mixed precision, ZeRO-1,
    weight_init_only from a checkpoint (the first run's step 3), kl_beta 0.01, 10 warm-up steps — the policy stays near
    the reference over three steps: every loss near log 2 and every reward near 0. Rank 1 is killed when step 3 starts
    and the run restarts from its step-2 checkpoint: the reference must again be the *starting* weights (loaded before
    the checkpoint is restored), not the model as freshly built. That one is made far from the checkpoint (seed 7,
    init_method_std 1.0: sharp random logits, where the checkpoint's are near uniform), so a reference taken from it
    would give rewards of β·|Δ log π| ≈ 0.01·(tens to hundreds) ≫ 1e-2; the weights it trains are the checkpoint's
    either way (weight_init_only)."""
    ckpt = reference[2] / "checkpoints" / "step-3"
    run = tmp_path / "run"
    result = _train(
        tmp_path,
        "hf_llama3_8B_DPO_config",
        "trainer.devices=2",
        f"exp_manager.explicit_log_dir={run}",
        f"exp_manager.resume_from_checkpoint={ckpt}",
        f"data.tokenizer.type={tokenizer}",
        f"data.train_dir={SAMPLE_PREFERENCES}",
        "data.dev_choose_samples=64",
        "exp_manager.checkpoint_callback_params.every_n_train_steps=1",
        "exp_manager.max_restarts=1",
        "exp_manager.fault_injection.step=3",
        "exp_manager.fault_injection.rank=1",
        "exp_manager.fault_injection.kind=sigkill",
        "seed=7",
        "model.init_method_std=1.0",
    )
    assert "restart 1 of 1" in result.stdout + result.stderr
    rows = _rows(run)
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    # bf16 autocast, 2 steps at lr ≤ 6e-4: |Δ log π| ≲ 0.5 over ~8 response tokens, times β = 0.01: ≲ 5e-3; the loss
    # −log σ(margin) moves by about margin/2
    for r in rows:
        assert float(r["loss"]) == pytest.approx(math.log(2), abs=5e-3), rows
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert abs(float(r[name])) < 1e-2, rows
    _resuming_needs_the_same_reference(run, ckpt, reference, tokenizer)


def _resuming_needs_the_same_reference(run, started_from, reference, tokenizer):
    """A new run resuming a DPO checkpoint (not weight_init_only) takes its reference from the weights it starts from as
    configured. For the run above those were the checkpoint it started from, which a resume cannot name (the one key
    names the checkpoint resumed), so the reference would silently become this config's random weights: refused, naming
    both, before any worker starts. The first run of this module started from seed 1234's random weights, so resuming
    it with the same seed and the same config (nxdt.config.resume_keys) passes; with another kl_beta it is refused."""
    from nxdt.cli import _composer, check_resume_checkpoint
    from nxdt.config import ConfigError
    from nxdt.planner import plan

    compose = _composer((str(CONFIGS), "hf_llama3_8B_DPO_config"))
    base = [
        *SHRINK,
        SHORT_PROMPTS["hf_llama3_8B_DPO_config"],
        f"data.tokenizer.type={tokenizer}",
        f"data.train_dir={SAMPLE_PREFERENCES}",
        "model.weight_init_only=false",
    ]
    cfg = compose([*base, "trainer.devices=2", "seed=7", f"exp_manager.resume_from_checkpoint={run / 'checkpoints' / 'step-3'}"])
    with pytest.raises(ConfigError) as refused:
        check_resume_checkpoint(cfg, plan(cfg))
    message = str(refused.value)
    assert f"trained by DPO against the reference checkpoint {started_from.resolve()}" in message, message
    assert "the reference would be random initialisation (seed 7" in message and "\n" not in message, message
    first = reference[2] / "checkpoints" / "step-3"
    same = [*base, *PARITY[:1], *PARITY[3:8], PARITY[-1], "trainer.devices=1", f"exp_manager.resume_from_checkpoint={first}"]
    cfg = compose([*same, "model_alignment_strategy.dpo.kl_beta=0.5"])  # the run's config (_dpo), without its train_dir twice
    check_resume_checkpoint(cfg, plan(cfg))
    cfg = compose([*same, "model_alignment_strategy.dpo.kl_beta=0.1"])
    with pytest.raises(ConfigError) as refused:
        check_resume_checkpoint(cfg, plan(cfg))
    assert str(refused.value).startswith("config error: model_alignment_strategy.dpo.kl_beta=0.1: checkpoint step-3 of ")
    assert "was trained with model_alignment_strategy.dpo.kl_beta=0.5, not 0.1" in str(refused.value)


def _orpo_formula(logits, mb, beta, pairs):
    """ORPO's pieces on one micro-batch (rows: `pairs` chosen, then `pairs` rejected), written out from the paper and
    TRL's ORPOTrainer: log P(y|x) the mean token log-probability of the response; odds = P / (1 − P); the per-pair term
    −β·log σ(log odds_c − log odds_r); the NLL of the chosen sequences over their prompt and response tokens (TRL:
    input_ids where the attention mask is 1, shifted), returned as (sum, tokens) for the token mean over the batch."""
    labels, ids, seq = mb["labels"], mb["input_ids"], mb["segment_ids"] != 0
    logp_all = torch.log_softmax(logits.double(), -1)
    mask = labels != -100
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    mean = logp.sum(-1) / mask.sum(-1)
    log_odds = mean - torch.log(1 - torch.exp(mean))
    odds_term = -beta * F.logsigmoid(log_odds[:pairs] - log_odds[pairs:])
    # every next token inside the sequence: the last position's is its label, the others' the next input id
    n = seq.sum(-1)
    nll_sum, tokens = 0.0, 0
    for row in range(pairs):
        k = int(n[row])
        targets = torch.cat([ids[row, 1:k], labels[row, k - 1 : k]])
        nll_sum -= float(logp_all[row, torch.arange(k), targets].sum())
        tokens += k
    return odds_term, nll_sum, tokens, beta * mean[:pairs]


@pytest.mark.parametrize(
    "layout", [DP2_X_PP2, ["trainer.devices=2", "distributed_strategy.context_parallel_size=2"]], ids=["dp2-x-pp2", "cp2"]
)
def test_orpo_loss_equals_the_formula_on_the_first_batch(tmp_path, tokenizer, layout):
    """DP2 × PP2: the NLL's token count summed over both data-parallel ranks, and each pipeline's last stage's loss
    with the count every stage computed (``nll_scale``). CP2: each sequence's log-probabilities, token counts and
    next-token labels (the prompt's too, across the two chunks' boundaries) added up over the two ranks."""
    import lightning.pytorch as pl

    from nxdt.config import load_run_config
    from nxdt.data.preferences import pair_rows
    from nxdt.data.sampler import GlobalBatchSampler
    from nxdt.lightning.datamodule import build_preference_dataset
    from nxdt.lightning.module import import_architecture

    run = tmp_path / "run"
    _train(
        tmp_path,
        "hf_llama3_8B_ORPO_config",
        *PARITY,
        *layout,
        f"exp_manager.explicit_log_dir={run}",
        f"data.tokenizer.type={tokenizer}",
    )
    rows = _rows(run)
    cfg = load_run_config(run / "config.yaml")
    pl.seed_everything(cfg.seed, verbose=False)  # what the worker does right before it builds the model
    model = import_architecture(cfg.model.architecture)(cfg.model).eval()
    data, orpo = cfg.data, cfg.model_alignment_strategy.orpo
    dataset = build_preference_dataset(data, orpo, data.train_dir, cfg.model.vocab_size, limit=data.dev_choose_samples)
    first = next(iter(GlobalBatchSampler(len(dataset), data.global_batch_size, data.global_batch_size, seed=cfg.seed)))
    odds, chosen, nll_sum, tokens = [], [], 0.0, 0
    with torch.no_grad():
        for k in range(0, len(first), data.micro_batch_size):
            mb = pair_rows(torch.utils.data.default_collate([dataset[i] for i in first[k : k + data.micro_batch_size]]))
            logits = model(mb["input_ids"], mb["position_ids"], mb["segment_ids"])
            term, s, n, reward = _orpo_formula(logits, mb, orpo.beta, data.micro_batch_size)
            odds += term.tolist()
            chosen += reward.tolist()
            nll_sum, tokens = nll_sum + s, tokens + n
    # DP2 (ZeRO-1, as the file says) × PP2 (two micro-batches per pipeline): the step's loss is the NLL's token mean
    # over every chosen token of the global batch plus the odds-ratio term's mean over its pairs, as TRL computes it on
    # one batch. The same fp32 forward of the same weights and rows, the formula in float64: rounding only (~1e-7 rel.)
    assert float(rows[0]["loss"]) == pytest.approx(nll_sum / tokens + sum(odds) / len(odds), rel=1e-5)
    assert float(rows[0]["nll_loss"]) == pytest.approx(nll_sum / tokens, rel=1e-5)
    assert float(rows[0]["rewards/chosen"]) == pytest.approx(sum(chosen) / len(chosen), rel=1e-5)
    assert [int(r["step"]) for r in rows] == [1, 2, 3] and all(math.isfinite(float(r["loss"])) for r in rows)


def test_dpo_on_a_mixture_of_experts_model_adds_trls_load_balancing_term_and_ep2_equals_one_process(tmp_path):
    """DPO on mixtral_tiny with its load-balancing weight (0.02): as TRL's DPOTrainer, each micro-batch's loss is DPO's
    plus 0.02 · transformers' load_balancing_loss_func over the chosen and rejected rows' real tokens (attention mask).
    At step 1 the policy is the reference, so the loss is log 2 + 0.02 · the mean of that term over the first global
    batch's micro-batches, computed here from the same initial weights and rows (fp32 both sides: ~1e-7; the term is
    ~0.04 of the loss, counting the padding moves it by ~1e-3 relative); validation after step 3 is TRL's eval loss,
    DPO's mean over the validation pairs plus the term (from the step-3 checkpoint and the starting weights).
    EP2 (each rank holds 2 of the 4 experts, tokens exchanged by all-to-all, the reference scored the same way), CP2
    (each rank half of every sequence: the routing statistics added up over the two) and PP2 (each stage two of the four
    layers: their real-token statistics travel with the activations, in training and in validation) equal one rank,
    fp32, through 3 steps."""
    import lightning.pytorch as pl
    import transformers.models.mixtral.modeling_mixtral as modeling

    from nxdt.config import load_run_config
    from nxdt.data.preferences import pair_rows
    from nxdt.data.sampler import GlobalBatchSampler
    from nxdt.lightning.datamodule import build_preference_dataset
    from nxdt.lightning.module import import_architecture
    from nxdt.lightning.reshard import read_full_state
    from test_train_e2e import assert_ok, nxdt

    common = [
        "train",
        "+recipe=dpo",
        "model=mixtral_tiny",
        "precision.type=fp32",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "data.global_batch_size=4",
        "data.micro_batch_size=1",
        "data.dev_choose_samples=16",  # the reference is scored for these pairs only
        "exp_manager.save_last=false",
        "exp_manager.create_tensorboard_logger=false",
        "trainer.gradient_clip_val=0",  # a wrongly scaled expert gradient must not be clipped back
    ]
    validation = tmp_path / "validation.jsonl"  # 4 pairs of their own: the training set stays the first 16
    validation.write_text("\n".join(SAMPLE_PREFERENCES.read_text().splitlines()[-4:]) + "\n")
    runs = {}
    for name, layout in (
        (
            "one",
            ["trainer.devices=1", f"data.val_dir={validation}", "trainer.val_check_interval=3", "exp_manager.save_last=true"],
        ),
        ("ep2", ["trainer.devices=2", "distributed_strategy.expert_model_parallel_size=2"]),
        ("cp2", ["trainer.devices=2", "distributed_strategy.context_parallel_size=2"]),
        (
            "pp2",
            [
                "trainer.devices=2",
                "distributed_strategy.pipeline_model_parallel_size=2",
                f"data.val_dir={validation}",
                "trainer.val_check_interval=3",
            ],
        ),
    ):
        runs[name] = tmp_path / name
        assert_ok(nxdt(*common, *layout, f"exp_manager.explicit_log_dir={runs[name]}", cwd=tmp_path))
    want = _rows(runs["one"])

    cfg = load_run_config(runs["one"] / "config.yaml")
    pl.seed_everything(cfg.seed, verbose=False)  # what the worker does right before it builds the model
    model = import_architecture(cfg.model.architecture)(cfg.model).eval()
    data, dpo = cfg.data, cfg.model_alignment_strategy.dpo
    dataset = build_preference_dataset(data, dpo, data.train_dir, cfg.model.vocab_size, limit=data.dev_choose_samples)
    first = next(iter(GlobalBatchSampler(len(dataset), data.global_batch_size, data.global_batch_size, seed=cfg.seed)))
    terms = []
    with torch.no_grad():
        for k in range(0, len(first), data.micro_batch_size):
            mb = pair_rows(torch.utils.data.default_collate([dataset[i] for i in first[k : k + data.micro_batch_size]]))
            model(mb["input_ids"], mb["position_ids"], mb["segment_ids"])
            mask = (mb["segment_ids"] != 0).long()
            terms.append(float(modeling.load_balancing_loss_func(tuple(model.router_logits()), 4, 2, attention_mask=mask)))
    assert float(want[0]["loss"]) == pytest.approx(math.log(2) + 0.02 * sum(terms) / len(terms), rel=1e-5)
    # logged as TRL logs it: aux_loss, the term unweighted, its mean over the step's micro-batches
    assert float(want[0]["aux_loss"]) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert abs(float(want[-1]["loss"]) - float(want[0]["loss"])) > 1e-4  # the policy moved: not the trivial comparison
    # validation after step 3: the mean over the 4 pairs of −log σ(β·(Δ log π − Δ log π_ref)) plus 0.02 · the mean term
    trained = import_architecture(cfg.model.architecture)(cfg.model).eval()
    state = read_full_state(runs["one"] / "checkpoints" / "step-3", optimizer=False).model
    trained.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    pairs = build_preference_dataset(data, dpo, str(validation), cfg.model.vocab_size)
    losses, terms = [], []
    with torch.no_grad():
        for i in range(len(pairs)):
            mb = pair_rows(torch.utils.data.default_collate([pairs[i]]))
            mask = mb["labels"] != -100
            logps = []
            for m in (model, trained):  # the reference (the starting weights), then the policy
                logp = torch.log_softmax(m(mb["input_ids"], mb["position_ids"], mb["segment_ids"]).double(), -1)
                logps.append((logp.gather(-1, mb["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask).sum(-1))
            margin = (logps[1][0] - logps[0][0]) - (logps[1][1] - logps[0][1])
            losses.append(float(-F.logsigmoid(dpo.kl_beta * margin)))
            attention = (mb["segment_ids"] != 0).long()
            terms.append(float(modeling.load_balancing_loss_func(tuple(trained.router_logits()), 4, 2, attention_mask=attention)))
    validated = float(next(r for r in want if r.get("val_loss"))["val_loss"])
    assert validated == pytest.approx(sum(losses) / len(losses) + 0.02 * sum(terms) / len(terms), rel=1e-5)
    val_aux = float(next(r for r in want if r.get("val_loss"))["val_aux_loss"])
    assert val_aux == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    for got in (_rows(runs["ep2"]), _rows(runs["cp2"]), _rows(runs["pp2"])):
        for g, w in zip(got, want, strict=True):
            assert float(g["loss"]) == pytest.approx(float(w["loss"]), rel=1e-5), (got, want)
            if w.get("val_loss") and "val_loss" in g:  # PP2's validation: the term's statistics cross the stages too
                assert float(g["val_loss"]) == pytest.approx(float(w["val_loss"]), rel=1e-5), (got, want)
            for name in (*REWARDS, "aux_loss"):
                assert float(g[name]) == pytest.approx(float(w[name]), rel=1e-4, abs=1e-5), (name, got, want)
