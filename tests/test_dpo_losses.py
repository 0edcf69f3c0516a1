"""DPO's loss types (TRL's ``DPOConfig.loss_type``, ``loss_weights``, ``label_smoothing``, ``f_divergence_type``,
``discopop_tau``) equal to TRL's DPOTrainer on the same pairs, and what a config may ask for.

TRL's ``DPOTrainer._compute_loss`` (trl/trainer/dpo_trainer.py) is the reference: it is run on an HF Llama holding the
initial weights of nxdt's model, on the same 8 pairs, with reference log-probabilities given in the batch (TRL's
``precompute_ref_log_probs`` path) — the policy's own plus fixed offsets of a few nats, so that every loss is away from
its value at policy = reference. nxdt's loss is its training objective on one micro-batch of those pairs
(``CausalLMModule``'s objective: the rows' log-probabilities, token counts, the per-pair losses and the ``sft`` term's
token mean). The global-batch token mean of ``sft`` at any micro-batch size: the last test.
"""

from __future__ import annotations


import pytest
import torch

from nxdt.data import SAMPLE_PREFERENCES
from nxdt.data.instructions import IGNORE_INDEX, read_jsonl, write_jsonl
from nxdt.data.preferences import pair_rows

from hf_reference import llama_config
from test_orpo import PAIRS
from test_orpo import SHAPE as PAIR_SHAPE

pytestmark = pytest.mark.timeout(240)

BETA = 0.5
SHAPE = [  # test_orpo's tiny model and batch of 8 pairs, here in one micro-batch
    *PAIR_SHAPE,
    f"data.micro_batch_size={PAIRS}",
    "precision.type=fp32",
    f"model_alignment_strategy.dpo.kl_beta={BETA}",
]
# the log-ratios log π − log π_ref of the 8 chosen and the 8 rejected answers: β·Δ from −1.6 to 1.25, both signs of
# each ratio, so that no loss sits on a flat part (hinge's 0 beyond β·Δ = 1) for every pair
LOG_RATIOS = [[1.5, -0.5, 0.3, -2.0, 2.5, 0.1, -1.2, 0.8], [-1.0, 0.7, 0.2, -0.5, 1.0, -0.3, 0.9, -2.2]]
# (loss_type, loss_weights, label_smoothing, f_divergence_type, f_alpha_divergence_coef): every type alone, TRL's MPO
# mixture, and the f-divergences on the losses that admit them
CASES = [
    *[([name], None, 0.0, "reverse_kl", 0.5) for name in ("sigmoid", "hinge", "ipo", "nca_pair", "bco_pair", "sppo_hard")],
    *[([name], None, 0.0, "reverse_kl", 0.5) for name in ("apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft")],
    (["robust"], None, 0.1, "reverse_kl", 0.5),
    (["exo_pair"], None, 1e-3, "reverse_kl", 0.5),
    (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.0, "reverse_kl", 0.5),
    (["sigmoid"], None, 0.0, "forward_kl", 0.5),
    (["ipo", "sft"], [1.0, 0.5], 0.0, "js_divergence", 0.5),
    (["hinge"], None, 0.0, "alpha_divergence", 0.3),
]


def _case_id(case) -> str:
    names, weights, eps, fdiv, _ = case
    return "+".join(names) + ("" if fdiv == "reverse_kl" else f"-{fdiv}")


def _dpo_block(case):
    from nxdt.config import compose_config

    names, weights, eps, fdiv, alpha = case
    key = "model_alignment_strategy.dpo"
    overrides = [f"{key}.loss_type=[{','.join(names)}]", f"{key}.label_smoothing={eps}", f"{key}.f_divergence_type={fdiv}"]
    overrides.append(f"{key}.f_alpha_divergence_coef={alpha}")
    if weights is not None:
        overrides.append(f"{key}.loss_weights=[{','.join(map(str, weights))}]")
    cfg = compose_config(["+recipe=dpo", *SHAPE, *overrides])
    return cfg, cfg.model_alignment_strategy.dpo


def _records(path):
    """The shipped sample's first 8 pairs, each rejected answer lengthened by 0..7 characters: chosen and rejected
    responses of unequal lengths (the shipped pairs' are equal), which ipo's and sigmoid_norm's normalisations see."""
    records = read_jsonl(SAMPLE_PREFERENCES)[:PAIRS]
    for i, record in enumerate(records):
        record["rejected"] += " maybe!"[:i]
    write_jsonl(path, records)
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """nxdt's initial model and its 8 training pairs laid out in one micro-batch, with reference log-probabilities
    that give the policy the log-ratios LOG_RATIOS."""
    import lightning.pytorch as pl

    from nxdt.config import compose_config
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.objective import pair_scores
    from nxdt.lightning.registry import objective_spec

    records = _records(tmp_path_factory.mktemp("dpo_pairs") / "pairs.jsonl")
    cfg = compose_config(["+recipe=dpo", *SHAPE, f"data.train_dir={records}"])
    pl.seed_everything(cfg.seed, verbose=False)
    spec = objective_spec(cfg)
    module = CausalLMModule(
        cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, PAIRS, objective=spec.objective(spec.block(cfg))
    )
    data = spec.build_datamodule(cfg)
    data.setup("fit")
    dataset = data.dataset
    mb = pair_rows(torch.utils.data.default_collate([dataset[i] for i in range(PAIRS)]))
    model = module.model.eval()
    with torch.no_grad():
        sums = pair_scores(model, model(mb["input_ids"], mb["position_ids"], mb["segment_ids"]), mb)[0].double()
    ratios = torch.tensor(LOG_RATIOS, dtype=torch.float64).T  # [pairs, 2]: the policy's log-ratios to the reference
    mb["ref_logps"] = torch.stack([sums[:PAIRS], sums[PAIRS:]], dim=1) - ratios
    return cfg, model, dataset, mb


def _trl_examples(dataset, ref: torch.Tensor) -> list[dict]:
    """nxdt's pairs as TRL's DataCollatorForPreference takes them (prompt, chosen and rejected token lists; the EOS is
    the response's last token), rebuilt from nxdt's shifted rows, with the reference log-probabilities."""
    examples = []
    for i in range(len(dataset)):
        pair, example = dataset[i], {}
        for row, side in enumerate(("chosen", "rejected")):
            ids, labels, segments = pair["input_ids"][row], pair["labels"][row], pair["segment_ids"][row]
            n = int((segments != 0).sum())
            tokens = ids[:n].tolist() + [int(labels[n - 1])]
            prompt = int((labels[:n] == IGNORE_INDEX).sum()) + 1  # labels[t] is tokens[t + 1]
            assert example.setdefault("prompt_ids", tokens[:prompt]) == tokens[:prompt]  # one prompt per pair
            example[f"{side}_ids"] = tokens[prompt:]
        example["ref_chosen_logps"], example["ref_rejected_logps"] = float(ref[i, 0]), float(ref[i, 1])
        examples.append(example)
    return examples


@pytest.fixture(scope="module")
def trl_trainer(pairs, tmp_path_factory):
    """TRL's DPOTrainer on an HF Llama with nxdt's initial weights (precompute_ref_log_probs: the reference values come
    with the batch), and TRL's collation of the 8 pairs."""
    trl = pytest.importorskip("trl", minversion="1.0")
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from nxdt.lightning.hf import hf_name
    from test_sft_e2e import _tokenizer

    cfg, model, dataset, mb = pairs
    shape = {k: getattr(cfg.model, k) for k in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers")}
    shape.update({k: getattr(cfg.model, k) for k in ("num_attention_heads", "num_kv_heads", "max_position_embeddings")})
    shape.update(rope_theta=cfg.model.rope_theta, norm_eps=cfg.model.norm_eps)
    hf = transformers.LlamaForCausalLM(llama_config(transformers, shape)).eval()
    hf.load_state_dict({hf_name(n): t for n, t in model.state_dict().items()}, strict=True)
    tmp = tmp_path_factory.mktemp("trl_dpo")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(_tokenizer(tmp / "tokenizer")))
    tokenizer.pad_token = tokenizer.eos_token
    args = trl.DPOConfig(
        output_dir=str(tmp / "trl"),
        beta=BETA,
        precompute_ref_log_probs=True,
        per_device_train_batch_size=PAIRS,
        report_to=[],
        use_cpu=True,
    )
    placeholder = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    trainer = trl.DPOTrainer(model=hf, args=args, train_dataset=placeholder, processing_class=tokenizer)
    return trainer, trainer.data_collator(_trl_examples(dataset, mb["ref_logps"]))


def _trl_loss(trainer, batch, case) -> tuple[float, dict[str, float]]:
    """TRL's loss and reward metrics for ``case``: the settings DPOTrainer.__init__ copies from its DPOConfig (the
    attributes ``_compute_loss`` reads) set on the one trainer, rather than a trainer built per case."""
    names, weights, eps, fdiv, alpha = case
    trainer.loss_types, trainer.loss_weights = list(names), list(weights or [1.0] * len(names))
    trainer.label_smoothing, trainer.f_divergence_type, trainer.f_alpha_divergence_coef = eps, fdiv, alpha
    trainer._metrics["train"].clear()
    trainer.model.train()  # TRL's metrics go to the "train" bucket; no dropout in this model
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("rewards/")}
    return float(loss), metrics


def _nxdt_loss(pairs, case) -> tuple[float, dict[str, float]]:
    """nxdt's training loss of the 8 pairs as one micro-batch on one rank (nll_scale: 1 micro-batch × 1 rank / the
    sft term's tokens, as CausalLMModule sets it), and its recorded reward metrics."""
    from nxdt.lightning.objective import dpo_objective

    cfg, model, dataset, mb = pairs
    _, block = _dpo_block(case)
    objective = dpo_objective(block)
    mb = dict(mb)
    if objective.token_count is not None:
        mb["nll_scale"] = torch.tensor(1.0 / objective.token_count(mb), dtype=torch.float64)
    with torch.no_grad():
        loss = objective.loss(model, model(mb["input_ids"], mb["position_ids"], mb["segment_ids"]), mb)
    sums = mb["metric_sums"]
    metrics = {name: float(sums[i] / sums[-1]) for i, name in enumerate(objective.metrics)}
    return float(loss), metrics


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_loss_type_equals_trls_dpo_trainer(pairs, trl_trainer, case):
    """Two fp32 forwards of the same weights through two implementations (sdpa with segment masks vs eager with an
    attention mask) differ by ~1e-6 relative per token log-probability: ≤ 2e-5 nats on a ~20-token response's sum (~20
    values of ≈ 5). The losses' derivatives in the log-ratios are at most ~5 (sppo_hard's squares: 2|c ∓ 1/2β|), so
    they differ by ≤ 1e-4 (measured: ≤ 3e-6, sppo_hard's); atol 1e-4 + rtol 1e-5. A wrong formula, sign, weight or
    normalisation (ipo's or sft's token counts) moves a loss by ≥ 1e-2."""
    trainer, batch = trl_trainer
    want, want_metrics = _trl_loss(trainer, batch, case)
    got, metrics = _nxdt_loss(pairs, case)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4), (got, want)
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-4), (name, metrics, want_metrics)


def test_the_config_layer_knows_the_loss_types_the_loss_computes():
    """nxdt.config.validate (torch-free, checked before launch) keeps its own copy of the names."""
    import importlib

    from nxdt.models import objectives

    validate = importlib.import_module("nxdt.config.validate")  # the package's `validate` names its function

    for name in ("DPO_LOSS_TYPES", "DPO_BATCH_SORTED_LOSS_TYPES", "F_DIVERGENCES", "F_DIVERGENCE_LOSS_TYPES"):
        assert getattr(validate, name) == getattr(objectives, name), name
