"""NxD Training's semantics, one by one, each pinned to the NxD Training (or NeMo) source it follows
(github.com/aws-neuron/neuronx-distributed-training at its 2.26.0 release; NeMo at nemo_toolkit 2.1.0, the version
NxD Training's requirements.txt pins): the weight-decay groups of its HF and Megatron models, the learning-rate
warm-up of NeMo's CosineAnnealing, the order ``data.train_dir`` is read in, and ``trainer.max_epochs``."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nxdt_cases import CASE, EXAMPLES, write_cases

from nxdt.config import compose_nxdt_config
from nxdt.lightning.module import import_architecture
from nxdt.lightning.optim import build_optimizer, lr_lambda, parameter_groups

TINY = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "num_kv_heads": 1, "ffn_hidden_size": 32, "vocab_size": 32}


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """An NxD Training example config (a case of tests/nxdt_cases.py: hf_llama3_8B_config, hf_llama3.1_70B_config,
    megatron_gpt_config), planned for trn1.32xlarge, the instance it was written for (nothing is built)."""
    cases = write_cases(tmp_path_factory.mktemp("nxdt_cases"))

    def compose(name: str, *more: str):
        hf = CASE[name].hf_config
        extra = [f"model.model_config={EXAMPLES / (hf + '_config.json')}"] if hf else []
        return compose_nxdt_config(cases, name, ["instance=trn1.32xlarge", *extra, *more], paths=False)

    return compose


def groups_of(cfg) -> list[tuple[float, set[str]]]:
    """(weight decay, parameter names) of each group of the optimizer nxdt builds for ``cfg``'s model (shrunk to
    TINY: the groups depend on the kinds of parameters, not their sizes)."""
    model_cfg = OmegaConf.merge(cfg.model, TINY)
    model = import_architecture(cfg.model.architecture)(model_cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = build_optimizer(model, cfg.model.optim)
    return [(g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in opt.param_groups]


def nxdt_hf_groups(names: list[str], do_layer_norm_weight_decay: bool) -> list[tuple[float, set[str]]]:
    """NxD Training's own rule, by name (hf_models/base_model.py setup_optimizer_param_groups with
    utils/model_utils.py get_param_groups_by_weight_decay): names containing "bias" (and "LayerNorm" or "norm" with
    do_layer_norm_weight_decay) go in a group with weight decay 0.0, the rest in one with 0.01. The hub's parameter
    names are Hugging Face's, so the rule applies to them as it does to NxDT's HF models."""
    no_decay = ["bias"] + (["LayerNorm", "norm"] if do_layer_norm_weight_decay else [])
    exempt = {n for n in names if any(nd in n for nd in no_decay)}
    return [(0.01, set(names) - exempt), (0.0, exempt)]


# ------------------------------------------------------------------------------------------- weight decay


def test_hf_llama_configs_exempt_norms_and_decay_the_rest_at_001_as_nxdt_hf_models_do(example):
    cfg, _ = example("hf_llama3_8B_config")  # do_layer_norm_weight_decay: True, weight_decay: 0.01
    groups = groups_of(cfg)
    names = sorted(set().union(*(g[1] for g in groups)))
    assert groups == nxdt_hf_groups(names, True)
    assert {"norm.weight", "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"} <= groups[1][1]
    assert groups[0][0] == cfg.model.optim.weight_decay == 0.01


def test_hf_models_decay_at_001_whatever_optim_weight_decay_says_and_a_note_says_so(example):
    cfg, warnings = example("hf_llama3.1_70B_config")  # weight_decay: 0.1 in the file
    assert cfg.model.optim.weight_decay == 0.1  # kept, visible in config.yaml
    assert [g[0] for g in groups_of(cfg)] == [0.01, 0.0]  # what NxD Training's HF models use
    (note,) = [w for w in warnings if "model.optim.weight_decay=0.1" in w]
    assert "0.01" in note and "model.optim.fixed_weight_decay=null" in note
    # the config's own value, one nxdt key away
    cfg, _ = example("hf_llama3.1_70B_config", "model.optim.fixed_weight_decay=null")
    assert [g[0] for g in groups_of(cfg)] == [0.1, 0.0]


def test_hf_configs_without_do_layer_norm_weight_decay_decay_norm_weights_too(example):
    cfg, _ = example("hf_llama3_8B_config", "model.do_layer_norm_weight_decay=False")
    groups = groups_of(cfg)
    names = sorted(set().union(*(g[1] for g in groups)))
    # Llama has no biases: every parameter, the norm weights included, decays at 0.01
    assert groups == [g for g in nxdt_hf_groups(names, False) if g[1]] and len(groups) == 1
    assert cfg.model.optim.no_weight_decay == "biases"


def test_the_biases_rule_exempts_biases_only_by_nxdt_hf_name_rule(example):
    """GPT has biases and LayerNorm weights and biases: ``biases`` (an hf config with do_layer_norm_weight_decay
    false) exempts every bias, LayerNorm's included, and decays LayerNorm weights, as NxDT's substring rule does."""
    cfg, _ = example("megatron_gpt_config")
    model = import_architecture(cfg.model.architecture)(OmegaConf.merge(cfg.model, TINY))
    names = {id(p): n for n, p in model.named_parameters()}
    for mode, norms_too in (("biases", False), ("norms_and_biases", True)):
        got = [(g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in parameter_groups(model, 0.01, mode)]
        assert got == nxdt_hf_groups(sorted(names.values()), norms_too), mode


def test_megatron_do_layer_norm_weight_decay_true_decays_every_parameter_at_the_configs_rate(example):
    """megatron_gpt_model.py setup_optimizer_param_groups: True → NeMo's get_all_params_for_weight_decay_optimization
    (one group, the optimizer's weight_decay: "True means weight decay on all params", as the config's comment
    says); False → get_params_for_weight_decay_optimization (norms and biases at 0, the rest at weight_decay)."""
    cfg, _ = example("megatron_gpt_config", "model.optim.weight_decay=0.1")  # the file says False
    groups = groups_of(cfg)
    assert [g[0] for g in groups] == [0.1, 0.0]
    exempt = groups[1][1]
    assert exempt and all(n.endswith("bias") or "layernorm" in n or n.startswith("norm.") for n in exempt)
    assert not any(n.endswith("bias") for n in groups[0][1])
    cfg, _ = example("megatron_gpt_config", "model.optim.weight_decay=0.1", "model.do_layer_norm_weight_decay=True")
    (only,) = groups_of(cfg)
    assert only[0] == 0.1 and len(only[1]) == len(groups[0][1]) + len(exempt)


# ------------------------------------------------------------------------------------------- schedules


def _cosine(warmup: int, max_steps: int, min_lr: float, constant_steps: int = 0):
    sched = OmegaConf.create(
        {
            "name": "CosineAnnealing",
            "warmup_steps": warmup,
            "max_steps": max_steps,
            "min_lr": min_lr,
            "constant_steps": constant_steps,
        }
    )
    return lr_lambda(sched, base_lr=1.0)


def test_cosine_warm_up_is_nemos_step_plus_one_over_warmup_plus_one():
    """nemo/core/optim/lr_scheduler.py (2.1.0) CosineAnnealing without constant_steps: WarmupAnnealHoldPolicy's
    ``(step+1)/(warmup_steps+1)`` for step <= warmup_steps, then _cosine_annealing over max_steps - warmup_steps
    from step warmup_steps; min_lr after max_steps. The step is the scheduler's (0 for the first optimizer step)."""
    f = _cosine(warmup=4, max_steps=20, min_lr=0.1)
    assert [f(s) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 0.1 + 0.9 * 0.5 * (1 + 0.9807852804032304)])
    assert f(12) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the 16 decay steps
    assert f(20) == pytest.approx(0.1) and f(25) == pytest.approx(0.1)


def test_cosine_with_constant_steps_is_megatrons_warm_up_from_zero():
    """The same file, constant_steps > 0: _linear_warmup_with_cosine_annealing, ``step/warmup_steps`` (0 at step 0)
    up to step warmup_steps, the cosine over decay_steps = max_steps - constant_steps - warmup_steps, then min_lr."""
    f = _cosine(warmup=2, max_steps=16, min_lr=0.1, constant_steps=4)
    assert [f(s) for s in range(3)] == pytest.approx([0.0, 0.5, 1.0])
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5)  # 5 of the 10 decay steps
    assert [f(s) for s in (12, 14, 16)] == pytest.approx([0.1, 0.1, 0.1])


def test_warmup_policy_constant_warms_up_as_nemo():
    """NxDT's WarmupPolicy (nxdt's ``constant``): NeMo's WarmupPolicy._get_warmup_lr, (step+1)/(warmup_steps+1)."""
    sched = OmegaConf.create({"name": "constant", "warmup_steps": 3, "max_steps": 10, "min_lr": 0.0})
    f = lr_lambda(sched, base_lr=1.0)
    assert [f(s) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


# ------------------------------------------------------------------------------------------- data


def shrunk(example, *more: str):
    """hf_llama3_8B_config shrunk to one CPU rank and a tiny Llama, on the save_to_disk sample in conf/nxdt (96 rows
    of 33 byte ids: conf/nxdt/make_tokenized_sample.py)."""
    cfg, _ = example(
        "hf_llama3_8B_config",
        "instance=cpu",
        "trainer.devices=1",
        "trainer.num_nodes=1",
        "distributed_strategy.tensor_model_parallel_size=1",
        "distributed_strategy.sequence_parallel=False",
        "distributed_strategy.kv_replicator=1",
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.num_kv_heads=1",
        "model.ffn_hidden_size=64",
        "model.vocab_size=256",
        "model.encoder_seq_length=32",
        "precision.type=fp32",
        f"data.train_dir={EXAMPLES / 'tokenized_sample'}",
        *more,
    )
    return cfg


def test_train_dir_is_read_in_order_each_epoch_from_its_first_row(example):
    """hf_data_module.py HFDataModule._build_dataloader: DistributedSampler(shuffle=False, drop_last=True) and a
    DataLoader of global_batch_size/DP rows with drop_last=True: global batch k is rows [k·B, (k+1)·B) of
    data.train_dir, and each epoch starts again at row 0 (96 rows, B=10: 9 batches an epoch, rows 90-95 never)."""
    import torch

    from nxdt.data.hf_dataset import SavedHFDataset
    from nxdt.lightning.datamodule import NxDDataModule

    cfg = shrunk(example, "data.global_batch_size=10", "data.micro_batch_size=5")
    assert (cfg.data.source, cfg.data.shuffle) == ("hf_dataset", False)
    rows = SavedHFDataset(str(EXAMPLES / "tokenized_sample"), 32, 256)
    data = NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=256, step_batches=True)
    batches = iter(data.train_dataloader())
    order = [r for k in range(9 + 2) for r in range(10 * k, 10 * k + 10)]
    order = order[:90] + list(range(20))  # the second epoch: rows 0.. again
    for k in range(11):
        batch = next(batches)["input_ids"]
        expected = torch.stack([rows[i]["input_ids"] for i in order[10 * k : 10 * k + 10]])
        assert torch.equal(batch, expected), k
    assert data.steps_per_epoch == 9
    # nxdt's own configs keep the seeded shuffle; one key gives NxDT's order back or takes it away
    assert shrunk(example, "data.global_batch_size=10", "data.micro_batch_size=5", "data.shuffle=true").data.shuffle is True


def test_max_epochs_stops_at_the_end_of_the_epoch_before_max_steps(example, tmp_path):
    """Lightning stops at whichever of max_steps and max_epochs comes first; NxD Training's trainer keeps that
    (lightning_modules/nlp_overrides.py hands max_epochs to its fit loop). 96 rows / global batch 8 = 12 steps an
    epoch: max_epochs=1 with max_steps=30 trains 12 steps (CausalLMModule brings the callback that counts them)."""
    import lightning.pytorch as pl

    from nxdt.lightning import NxDStrategy
    from nxdt.lightning.datamodule import NxDDataModule
    from nxdt.lightning.module import CausalLMModule

    # one micro-batch a step: the fewest forwards that count 12 steps
    cfg = shrunk(example, "data.global_batch_size=8", "data.micro_batch_size=8", "trainer.max_steps=30", "trainer.max_epochs=1")
    assert (cfg.trainer.max_steps, cfg.trainer.max_epochs) == (30, 1)
    pl.seed_everything(cfg.seed, verbose=False)
    module = CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size)
    data = NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=NxDStrategy(),
        max_steps=cfg.trainer.max_steps,
        max_epochs=cfg.trainer.max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=data)
    trainer.strategy.close()
    assert trainer.global_step == 12 == data.steps_per_epoch


# ------------------------------------------------------------------------------------------- loss averaging


def test_loss_averaging_micro_batches_is_nxdts_mean_of_micro_batch_means(tmp_path):
    """lightning_modules/model/base.py forward_backward_step: each micro-batch's loss (a token mean) divided by the
    number of micro-batches, summed, then averaged over DP. ``model.loss_averaging=micro_batches`` trains on exactly
    that; nxdt's default (tokens) weighs each micro-batch by its labelled tokens. SFT records padded one per sequence
    hold different label counts, so the two differ here."""
    import copy

    import lightning.pytorch as pl
    import torch

    from nxdt.config import compose_config
    from nxdt.lightning import NxDStrategy
    from nxdt.lightning.module import CausalLMModule, split_micro_batches
    from nxdt.lightning.registry import objective_spec

    cfg = compose_config(
        [
            "+recipe=sft",
            "model.num_layers=1",
            "data.global_batch_size=4",
            "data.micro_batch_size=2",
            "data.dev_choose_samples=8",
            "model_alignment_strategy.sft.packing=false",
            "model.loss_averaging=micro_batches",
            "trainer.max_steps=1",
        ]
    )
    pl.seed_everything(cfg.seed, verbose=False)
    module = CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size)
    initial = copy.deepcopy(module.model)

    def data():
        return objective_spec(cfg).build_datamodule(cfg)  # SFT's instruction records (nxdt.lightning.registry)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=NxDStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=data())
    trainer.strategy.close()
    batch = next(iter(data().train_dataloader()))  # the same first global batch (the stream is a function of the seed)
    means, sums, counts = [], 0.0, 0
    with torch.no_grad():
        for mb in split_micro_batches(batch, cfg.data.micro_batch_size):
            logits = initial(mb["input_ids"], mb.get("position_ids"), mb.get("segment_ids"))
            loss = float(initial.loss_fn(logits, mb["labels"]))
            n = int((mb["labels"] != -100).sum())
            means, sums, counts = means + [loss], sums + loss * n, counts + n
    assert len(means) == 2 and len({int((mb["labels"] != -100).sum()) for mb in split_micro_batches(batch, 2)}) == 2
    # fp32 forwards of the same weights and rows, in another order of operations: rounding only (~1e-7 of a loss ≈ 5)
    assert module.step_metrics["loss"] == pytest.approx(sum(means) / 2, rel=1e-6)
    assert abs(sum(means) / 2 - sums / counts) > 1e-3  # the token mean (nxdt's default) is another number
