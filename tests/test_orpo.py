"""ORPO's loss over a global batch, whatever the micro-batch size, equal to TRL's ORPOTrainer on the same pairs.

TRL's ORPOTrainer (trl/experimental/orpo/orpo_trainer.py, ``concatenated_forward`` and ``odds_ratio_loss``) is the
reference for the details the paper (Hong et al. 2024) leaves open: the NLL term is one ``CrossEntropyLoss`` over the
chosen sequences' tokens, prompt **and** response (``input_ids`` where the attention mask is 1), a token mean over the
batch; the odds-ratio term uses the response tokens' mean log-probability and is a mean over pairs. nxdt takes the
token mean over the whole global batch — what TRL computes when the step is one batch (no gradient accumulation) — so
micro-batches of 1, 2, 4 or 8 pairs give one loss. Before, the NLL was a per-micro-batch token mean (and response-only),
averaged over micro-batches: 6.4364 at micro-batch 2, 6.4260 at 4, 6.4163 at 8 on NxDT's ORPO config.

``model_alignment_strategy.orpo.nll_mean=sequences`` (NxD Training's base_orpo.py: a mean over pairs of each chosen
response's mean log-probability) is checked against that formula, also at two micro-batch sizes; validation against the
training loss. Also here: DPO's loss is a mean over pairs and each micro-batch holds the same number of pairs, so it has no such
dependence (checked the same way); SFT's token weighting is checked in tests/test_sft.py.
"""

from __future__ import annotations

import copy
import os

import lightning.pytorch as pl
import pytest
import torch

from nxdt.data import SAMPLE_PREFERENCES
from nxdt.data.instructions import IGNORE_INDEX, read_jsonl
from nxdt.data.preferences import pair_rows
from nxdt.lightning.hf import hf_name
from nxdt.lightning.objective import sequence_labels

from hf_reference import llama_config

# four in-process fits in one fixture: ~20 CPU-s, more wall time on a busy host
pytestmark = pytest.mark.timeout(240)

PAIRS = 8


class Steps(pl.Callback):
    """Collects the module's metrics after every step."""

    def __init__(self, into: list) -> None:
        self.into = into

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.into.append(dict(pl_module.step_metrics))


MICRO = (1, 2, 4, 8)
SHAPE = [
    "trainer.devices=1",
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    f"data.global_batch_size={PAIRS}",
    f"data.dev_choose_samples={PAIRS}",
]
# AdamW with eps=1: for these gradients (|g| ≪ 1) the first update lr·m̂/(√v̂+1) ≈ lr·g is linear in the gradient, so step
# 2's loss measures step 1's gradient, and rounding differences in it stay rounding-sized (Adam's normalisation would
# turn a sign flip of a near-zero gradient element into a full lr-sized difference)
LINEAR = ["precision.type=fp32", "model.optim.eps=1.0", "model.optim.lr=0.5", "model.optim.weight_decay=0.0"]


def _trainer(tmp_path, **kwargs):
    from nxdt.lightning import NxDStrategy

    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=NxDStrategy(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


def _fit_or_validate(trainer, how: str, module, data) -> None:
    saved = dict(os.environ)  # Lightning writes MASTER_PORT etc. here: the next run must pick its own port
    try:
        getattr(trainer, how)(module, datamodule=data)
        trainer.strategy.close()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _two_steps(recipe: str, micro: int, tmp_path, *overrides: str):
    """Two training steps of ``recipe`` at ``data.micro_batch_size=micro`` through the Lightning API on one process, on
    the same global batch of 8 pairs: the module's metrics of each step, its initial model and its training pairs."""
    from nxdt.config import compose_config
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.registry import objective_spec

    cfg = compose_config(
        [f"+recipe={recipe}", f"data.micro_batch_size={micro}", "trainer.max_steps=2", *SHAPE, *LINEAR, *overrides]
    )
    pl.seed_everything(cfg.seed, verbose=False)
    spec = objective_spec(cfg)  # the recipe's objective: its loss and its preference-pair data module
    module = CausalLMModule(
        cfg.model,
        cfg.data.global_batch_size,
        cfg.data.seq_length,
        micro,
        objective=spec.objective(spec.block(cfg)),
        peft=cfg.model_alignment_strategy.peft,  # LoRA, when the overrides ask for it
    )
    initial = copy.deepcopy(module.model).eval()
    data = spec.build_datamodule(cfg)
    steps: list = []
    trainer = _trainer(tmp_path / f"{recipe}{micro}", max_steps=2, limit_val_batches=0, callbacks=[Steps(steps)])
    _fit_or_validate(trainer, "fit", module, data)
    return steps, initial, data.dataset, cfg


@pytest.fixture(scope="module")
def orpo_steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orpo")
    return {micro: _two_steps("orpo", micro, tmp) for micro in MICRO}


def test_orpo_loss_is_the_same_at_micro_batch_1_2_4_and_8(orpo_steps):
    """One global batch of 8 pairs, the same initial weights: the step's loss and metrics agree to rtol 1e-6. The
    forwards differ only in batch shape (fp32 matmul blocking, ~1e-7 relative per value) and the sums in their order
    (~30 fp32 terms of ≈5 per row: ~1e-7 relative), well inside 1e-6; the old per-micro-batch NLL mean moved the loss
    by ~1e-3 relative."""
    for step in (0, 1):  # step 2's loss follows from step 1's gradient (LINEAR)
        want = orpo_steps[PAIRS][0][step]
        for micro in MICRO:
            got = orpo_steps[micro][0][step]
            for name in ("loss", "nll_loss", "log_odds_ratio", "rewards/chosen", "rewards/rejected"):
                assert got[name] == pytest.approx(want[name], rel=1e-6), (step, micro, name, got[name], want[name])


def _trl_features(dataset) -> list[dict[str, list[int]]]:
    """nxdt's pairs as TRL's ORPOTrainer.tokenize_row hands them to its collator: the whole token lists (prompt +
    response + EOS), the response's labels, attention masks; rebuilt from nxdt's shifted rows, so both see the same
    tokens."""
    features = []
    for i in range(len(dataset)):
        pair, feature = dataset[i], {}
        for row, side in enumerate(("chosen", "rejected")):
            ids, labels, segments = pair["input_ids"][row], pair["labels"][row], pair["segment_ids"][row]
            n = int((segments != 0).sum())  # positions of the sequence: tokens[:-1]
            tokens = ids[:n].tolist() + [int(labels[n - 1])]
            prompt = int((labels[:n] == IGNORE_INDEX).sum()) + 1  # labels[t] is tokens[t + 1]
            feature[f"{side}_input_ids"] = tokens
            feature[f"{side}_attention_mask"] = [1] * len(tokens)
            feature[f"{side}_labels"] = [IGNORE_INDEX] * prompt + tokens[prompt:]
            feature["prompt_input_ids"], feature["prompt_attention_mask"] = tokens[:prompt], [1] * prompt
        features.append(feature)
    return features


def _trl_orpo_trainer(trl, transformers, datasets, model, beta: float, tmp_path):
    """TRL's ORPOTrainer around ``model`` (its own tokenizer is needed only to construct it: the pairs come tokenized)."""
    from test_sft_e2e import _tokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(_tokenizer(tmp_path / "tokenizer")))
    tokenizer.pad_token = tokenizer.eos_token
    args = trl.experimental.orpo.ORPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=beta,
        max_length=128,
        per_device_train_batch_size=PAIRS,
        report_to=[],
        use_cpu=True,
        padding_value=0,
        dataset_num_proc=None,
    )
    placeholder = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    return trl.experimental.orpo.ORPOTrainer(model=model, args=args, train_dataset=placeholder, processing_class=tokenizer)


def test_orpo_loss_equals_trls_orpo_trainer_on_the_same_pairs(orpo_steps, tmp_path):
    """TRL's loss (its ``get_batch_loss_metrics``: the collator, the concatenated forward, the odds-ratio loss) on an
    HF Llama holding the same initial weights, the 8 pairs in one batch. Two fp32 forwards of the same weights through
    two implementations (sdpa with segment masks vs eager with an attention mask): ~1e-6 relative per log-probability,
    averaged over ~200 tokens; rel 1e-5 leaves room for that and fails on the old per-micro-batch, response-only NLL
    (≈1e-2 relative here)."""
    trl = pytest.importorskip("trl", minversion="0.20")
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("trl.experimental.orpo")
    steps, initial, dataset, cfg = orpo_steps[2]
    metrics = steps[0]
    shape = {k: getattr(cfg.model, k) for k in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers")}
    shape.update({k: getattr(cfg.model, k) for k in ("num_attention_heads", "num_kv_heads", "max_position_embeddings")})
    shape.update(rope_theta=cfg.model.rope_theta, norm_eps=cfg.model.norm_eps)
    hf = transformers.LlamaForCausalLM(llama_config(transformers, shape)).eval()
    hf.load_state_dict({hf_name(n): t for n, t in initial.state_dict().items()}, strict=True)
    trainer = _trl_orpo_trainer(trl, transformers, datasets, hf, float(cfg.model_alignment_strategy.orpo.beta), tmp_path)
    batch = trainer.data_collator(_trl_features(dataset))
    with torch.no_grad():
        loss, trl_metrics = trainer.get_batch_loss_metrics(hf, batch)
    assert metrics["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert metrics["nll_loss"] == pytest.approx(trl_metrics["nll_loss"], rel=1e-5)
    for name in ("log_odds_ratio", "rewards/chosen", "rewards/rejected"):
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5), name


def test_orpo_nll_counts_the_prompt_tokens_as_trl_does():
    """sequence_labels (TRL's NLL labels) keep the response's labels and give every prompt position its next token;
    padding stays unlabelled."""
    from nxdt.data.instructions import byte_chat_tokenizer
    from nxdt.data.preferences import PreferenceDataset

    records = read_jsonl(SAMPLE_PREFERENCES)[:2]
    dataset = PreferenceDataset.from_records(records, byte_chat_tokenizer(), 64)
    mb = pair_rows(torch.utils.data.default_collate([dataset[0], dataset[1]]))
    full = sequence_labels(mb)
    seq = mb["segment_ids"] != 0
    response = mb["labels"] != IGNORE_INDEX
    assert torch.equal(full[response], mb["labels"][response])
    assert torch.equal(full[seq & ~response], torch.roll(mb["input_ids"], -1, dims=-1)[seq & ~response])
    assert bool((full[~seq] == IGNORE_INDEX).all()) and bool(((full != IGNORE_INDEX) == seq).all())


def test_orpo_validation_over_the_whole_set_is_the_training_loss_at_any_micro_batch(orpo_steps, tmp_path):
    """Validation (forward only, every pair scored, then the NLL's token mean and the odds-ratio term's pair mean over
    the whole set) on the 8 training pairs with the initial weights: step 1's training loss, at micro-batch 1 and 8.
    The same forwards and sums (float64 accumulation): rounding only, inside rel 1e-6."""
    from nxdt.config import compose_config
    from nxdt.data.instructions import write_jsonl
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.registry import objective_spec

    val = tmp_path / "val.jsonl"
    write_jsonl(val, read_jsonl(SAMPLE_PREFERENCES)[:PAIRS])  # the training run's pairs (dev_choose_samples: the first 8)
    want = orpo_steps[PAIRS][0][0]
    for micro in (1, PAIRS):
        cfg = compose_config(["+recipe=orpo", f"data.micro_batch_size={micro}", f"data.val_dir={val}", *SHAPE, *LINEAR])
        pl.seed_everything(cfg.seed, verbose=False)
        spec = objective_spec(cfg)
        module = CausalLMModule(
            cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, micro, objective=spec.objective(spec.block(cfg))
        )
        data = spec.build_datamodule(cfg)
        _fit_or_validate(_trainer(tmp_path / f"val{micro}"), "validate", module, data)
        got = module.val_metrics
        assert got["val_pairs"] == PAIRS
        for name in ("loss", "nll_loss", "log_odds_ratio", "rewards/chosen"):
            assert got[f"val_{name}"] == pytest.approx(want[name], rel=1e-6), (micro, name, got, want)


def test_orpo_nll_mean_sequences_is_nxd_trainings_formula_at_any_micro_batch(tmp_path):
    """``model_alignment_strategy.orpo.nll_mean=sequences``: NxD Training's ORPO (lightning_modules/model/base_orpo.py,
    ``model_fwd_calc_loss``): NLL = −mean over pairs of each chosen response's mean token log-probability (response
    tokens only), plus −β·mean log σ(log-odds ratio); written out here in float64 from the initial weights. A mean over
    pairs, so micro-batch 1 and 8 agree; the fp32 run against the float64 formula: rounding, inside rel 1e-5."""
    runs = {
        micro: _two_steps("orpo", micro, tmp_path / str(micro), "model_alignment_strategy.orpo.nll_mean=sequences")
        for micro in (1, 8)
    }
    steps, initial, dataset, cfg = runs[8]
    mb = pair_rows(torch.utils.data.default_collate([dataset[i] for i in range(len(dataset))]))
    with torch.no_grad():
        logp = torch.log_softmax(initial(mb["input_ids"], mb["position_ids"], mb["segment_ids"]).double(), -1)
    mask = mb["labels"] != IGNORE_INDEX
    mean = (logp.gather(-1, mb["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask).sum(-1) / mask.sum(-1)
    chosen, rejected = mean[:PAIRS], mean[PAIRS:]
    log_odds = (chosen - torch.log(1 - torch.exp(chosen))) - (rejected - torch.log(1 - torch.exp(rejected)))
    beta = cfg.model_alignment_strategy.orpo.beta
    want = float(-chosen.mean() - beta * torch.nn.functional.logsigmoid(log_odds).mean())
    assert steps[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert steps[0]["nll_loss"] == pytest.approx(float(-chosen.mean()), rel=1e-5)
    for step in (0, 1):
        for name in ("loss", "nll_loss", "log_odds_ratio"):
            assert runs[1][0][step][name] == pytest.approx(runs[8][0][step][name], rel=1e-6), (step, name)


def test_dpo_loss_is_the_same_at_micro_batch_1_and_8(tmp_path):
    """DPO's per-pair losses are means over pairs and every micro-batch holds micro_batch_size of them: no micro-batch
    dependence. Its ``sft`` type's token mean is over the global batch's chosen responses (``nll_scale``), so it has
    none either (a mean of per-micro-batch means moved step 1's loss by 1e-4 relative here). Step 1's per-pair part is
    sigmoid's log 2 and ipo's 1/(4β²) (policy = reference); step 2's loss and rewards follow from step 1's gradient
    (LINEAR)."""
    override = "model_alignment_strategy.dpo.loss_type=[sigmoid,ipo,sft]"  # sigmoid: the paper's loss, and two of TRL's
    runs = {micro: _two_steps("dpo", micro, tmp_path / str(micro), override)[0] for micro in (1, 8)}
    assert runs[8][1]["loss"] < runs[8][0]["loss"]  # it moved
    names = ("loss", "rewards/chosen", "rewards/margins", "sft_loss")
    for step in (0, 1):
        for name in names:
            assert runs[1][step][name] == pytest.approx(runs[8][step][name], rel=1e-6, abs=1e-7), (step, name)


def test_dpo_reference_scored_each_step_equals_the_precomputed_one(tmp_path):
    """``precompute_ref_log_probs: false`` (TRL's default): a frozen copy of the starting weights scores each step's
    pairs instead of the table computed before training — the same forward on the same weights in eval mode, so the
    same numbers (measured: bit for bit); after step 1 the policy has moved, so a reference taken from the current
    weights would give rewards of 0 again at step 2."""
    precomputed = _two_steps("dpo", 2, tmp_path / "pre")[0]
    online = _two_steps("dpo", 2, tmp_path / "online", "model_alignment_strategy.dpo.precompute_ref_log_probs=false")[0]
    assert abs(online[1]["rewards/margins"]) > 1e-3  # step 2 scores against the starting weights, not the current ones
    for step in (0, 1):
        for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert online[step][name] == pytest.approx(precomputed[step][name], rel=1e-6, abs=1e-9), (step, name)


def test_dpo_with_fresh_lora_adapters_scores_its_reference_with_the_adapters_off(tmp_path):
    """LoRA with ``precompute_ref_log_probs: false``: fresh adapters (B = 0) make the starting weights the base alone,
    so the policy with its adapters switched off is the reference (PEFT's disable_adapter, what TRL scores a PEFT
    model's reference with) — no frozen copy of the base — and the numbers are the precomputed reference's (measured: bit
    for bit); with the adapters left on, step 2's rewards would be 0."""
    from nxdt.config import compose_config
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.registry import objective_spec

    lora = ["model_alignment_strategy.peft.lora_rank=8", "model_alignment_strategy.peft.lora_dropout=0.0", "model.optim.lr=5.0"]
    online = "model_alignment_strategy.dpo.precompute_ref_log_probs=false"
    cfg = compose_config(["+recipe=dpo", *SHAPE, *lora, online])
    spec = objective_spec(cfg)
    module = CausalLMModule(
        cfg.model,
        PAIRS,
        cfg.data.seq_length,
        2,
        objective=spec.objective(spec.block(cfg)),
        peft=cfg.model_alignment_strategy.peft,
    )
    assert not module.wants_frozen_reference()  # no copy of the base is taken
    precomputed = _two_steps("dpo", 2, tmp_path / "pre", *lora)[0]
    adapters_off = _two_steps("dpo", 2, tmp_path / "online", *lora, online)[0]
    assert abs(adapters_off[1]["rewards/margins"]) > 1e-4
    for step in (0, 1):
        for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert adapters_off[step][name] == pytest.approx(precomputed[step][name], rel=1e-6, abs=1e-9), (step, name)
