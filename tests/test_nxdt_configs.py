"""NxDT configs as they are (issue 9): NxD Training YAML files plan and train unchanged.

In-process: the translation rules (pure), the NxDT-format configs in tests/nxdt_configs planned at full
size (degrees, groups and global batch as NxD lays them out, only the no-effect warning), the misspelled-key
error, the save_to_disk reader. Subprocess (slow): the same configs, shrunk, train a few steps on CPU (the 70B
context-parallel one on 4 ranks as CP2 × PP2).
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import warm_cli

from nxdt.cli import main
from nxdt.config import ConfigError, compose_nxdt_config, field_docs
from nxdt.config.nxdt_compat import MAP, RULES, infer_instance, mapping_table, translate
from nxdt.planner import plan

pytestmark = pytest.mark.timeout(120)

CONFIGS = Path(__file__).parent / "nxdt_configs"
SAMPLE = CONFIGS / "tokenized_sample"
DOC = Path(__file__).parents[1] / "docs" / "migrating-from-nxdt.md"
LLAMA_HF = json.loads((CONFIGS / "llama3_8B_config.json").read_text())
MIXTRAL_HF = json.loads((CONFIGS / "mixtral_8x7B_config.json").read_text())
NEURON_ONLY = (
    "compiler_flags",
    "compiler_cache_url",
    "aync_exec_max_inflight_requests",
    "bucket_size_collectives",
    "neuron_rt_exec_timeout",
    "neuron_experimental_compress_rg",
    "precision.xla_use_bf16",
    "precision.xla_downcast_bf16",
    "precision.neuron_rt_stochastic_rounding_en",
    "precision.master_weights",  # read by NxDT only with precision.type: manual (lightning_modules/model/base.py)
    "precision.fp32_grad_acc",
    "exp_manager.save_xser",
)


def nxdt_config(name: str, *overrides: str):
    return compose_nxdt_config(CONFIGS, name, list(overrides), paths=False)


WEIGHT_DECAY_NOTE = "model.optim.weight_decay=0.1: NxDT's hf models decay at 0.01 whatever it says"


PACKING_NOTE = "model_alignment_strategy.sft.packing_style=concat reproduces it"
AUTOCAST_NOTE = "precision.type=autocast with distributed_strategy.zero1=False: NxDT's hf Llama casts the model to bf16"
AUX_NOTE = (
    "model.moe.router_aux_loss_coef=0.02 is nxdt's 0.01: NxD's load_balancing_loss_func is Hugging Face's divided by top_k=2"
)


def only_the_no_effect_warning(
    warnings: list[str],
    *,
    weight_decay_noted: bool = False,
    packing_noted: bool = False,
    autocast_noted: bool = False,
    aux_noted: bool = False,
) -> str:
    """The one warning naming the keys with no effect; with ``weight_decay_noted`` (a file with weight_decay 0.1)
    also the note that NxDT's hf models decay at 0.01 whatever it says, which nxdt follows; with ``packing_noted``
    (packed SFT) the note naming the option that gives NxDT's packed layout; with ``autocast_noted`` (the LoRA config:
    autocast without ZeRO-1) the note that NxDT's weights are bf16 there; with ``aux_noted`` (Mixtral, top-2) the
    note that the load-balancing weight is NxD's over top_k."""
    for noted_here, note in (
        (weight_decay_noted, WEIGHT_DECAY_NOTE),
        (packing_noted, PACKING_NOTE),
        (autocast_noted, AUTOCAST_NOTE),
        (aux_noted, AUX_NOTE),
    ):
        if noted_here:
            noted = [w for w in warnings if note in w]
            assert len(noted) == 1, warnings
            warnings = [w for w in warnings if w not in noted]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("nxdt: ") and "have no effect here" in warnings[0]
    assert all(k in warnings[0] for k in NEURON_ONLY)
    return warnings[0]


# ---------------------------------------------------------------------------------------------- full-size plans


def test_llama3_8b_on_four_trn1_nodes_at_tp32_plans_as_nxdt_runs_it():
    cfg, warnings = nxdt_config("hf_llama3_8B_config", "instance=trn1.32xlarge")
    only_the_no_effect_warning(warnings)
    p = plan(cfg)
    assert p.warnings == []
    assert (p.instance, p.world_size, p.ranks_per_node) == ("trn1.32xlarge", 128, 32)
    assert p.degrees == {"tp": 32, "pp": 1, "cp": 1, "ep": 1, "dp": 4}
    # NxD's layout: TP fastest (a whole node per TP group), then DP
    assert p.groups["tp"] == [list(range(n * 32, n * 32 + 32)) for n in range(4)]
    assert p.groups["dp"] == [[r, r + 32, r + 64, r + 96] for r in range(32)]
    # global 1024 = micro 1 × DP 4 × 256 accumulated micro-batches, 8192 tokens each
    assert p.batch == {"global": 1024, "micro": 1, "micro_batches": 256, "seq_length": 8192}
    m, ds = cfg.model, cfg.distributed_strategy
    assert (
        m.architecture,
        m.vocab_size,
        m.hidden_size,
        m.num_layers,
        m.num_attention_heads,
        m.num_kv_heads,
        m.ffn_hidden_size,
    ) == ("nxdt.models.llama.LlamaForCausalLM", 128256, 4096, 32, 32, 8, 14336)
    assert (ds.zero1, ds.sequence_parallel, ds.kv_replicator, cfg.precision.type) == (True, True, 4, "mixed_precision")
    assert (m.optim.name, m.optim.betas, m.optim.no_weight_decay, m.activations_checkpoint_granularity) == (
        "adamw_fp32OptState",
        [0.9, 0.999],
        "norms_and_biases",  # do_layer_norm_weight_decay: True in an hf config (tests/test_nxdt_semantics.py)
        "selective",
    )
    assert (m.optim.sched.name, m.optim.sched.warmup_steps, m.optim.sched.max_steps) == ("LinearAnnealingWithWarmUp", 100, 10000)
    em = cfg.exp_manager
    assert (cfg.name, em.checkpoint_every_n_steps, em.keep_last_k, em.resume_if_exists, em.log_gradient_norm) == (
        "hf_llama",
        10,
        1,
        True,
        True,
    )


def test_llama3_70b_on_trn2_at_tp32_pp4_lnc2_plans_with_the_runtimes_row_pairs():
    cfg, warnings = nxdt_config("hf_llama3_70B_trn2_config", "instance=trn2.48xlarge")
    assert "trainer.sequential_move_factor" in only_the_no_effect_warning(warnings, weight_decay_noted=True)
    p = plan(cfg)
    assert p.warnings == []
    assert (p.world_size, p.num_nodes, p.ranks_per_node, p.lnc, p.ranks_per_device) == (512, 8, 64, 2, 4)
    assert p.degrees == {"tp": 32, "pp": 4, "cp": 1, "ep": 1, "dp": 4}
    # NxD's "logic 2" for trn2 TP32 at LNC 2: TP groups are torus rows {0,3} and {1,2} of each node
    node0 = [sorted(g) for g in p.groups["tp"] if g[0] < 64]
    assert sorted(node0) == [list(range(0, 16)) + list(range(48, 64)), list(range(16, 48))]
    assert all(len(g) == 32 and len({r // 64 for r in g}) == 1 for g in p.groups["tp"])
    # PP outermost: stage s of a replica is 128 ranks (two nodes) further on
    assert [0, 128, 256, 384] in p.groups["pp"] and len(p.groups["pp"]) == 128
    assert p.group_of("dp", 0) == [0, 16, 64, 80]  # directly linked devices 0↔4 inside a node, then the next node
    assert p.batch == {"global": 1024, "micro": 1, "micro_batches": 256, "seq_length": 8192}
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.trainer.lnc) == (80, 8192, 64, 2)
    s = cfg.model.optim.sched
    assert (s.name, s.min_lr, s.warmup_steps, cfg.model.optim.weight_decay) == ("CosineAnnealing", 1e-6, 2000, 0.1)


def test_mixtral_8x7b_with_expert_parallelism_plans_as_nxdt_runs_it():
    cfg, warnings = nxdt_config("hf_mixtral_8x7b_ep_config", "instance=trn1.32xlarge")
    only_the_no_effect_warning(warnings, weight_decay_noted=True, aux_noted=True)
    p = plan(cfg)
    assert p.warnings == []
    assert p.degrees == {"tp": 8, "pp": 4, "cp": 1, "ep": 4, "dp": 4}
    assert p.groups["tp"][:2] == [list(range(0, 8)), list(range(8, 16))]
    assert p.group_of("ep", 0) == [0, 8, 16, 24] == p.group_of("dp", 0)  # EP subdivides DP (here all of it)
    assert p.group_of("pp", 0) == [0, 32, 64, 96]
    assert p.batch == {"global": 256, "micro": 1, "micro_batches": 64, "seq_length": 4096}
    moe = cfg.model.moe
    # the file's 0.02 × NxD's load-balancing loss (Hugging Face's over top_k) is 0.01 × the one nxdt computes
    assert (cfg.model.architecture, moe.num_experts, moe.top_k, moe.router_aux_loss_coef) == (
        "nxdt.models.mixtral.MixtralForCausalLM",
        8,
        2,
        0.01,
    )
    assert (cfg.model.max_position_embeddings, cfg.data.seq_length) == (32768, 4096)  # max(config.json, yaml), as NxDT


def test_llama3_70b_with_context_parallelism_plans_as_nxdt_runs_it():
    """NxDT's hf_llama3_70B_CP_config: TP32 × CP2 × PP8 on 16 trn1.32xlarge nodes; the ring priced by hand: a K/V
    block is K and V × 4096 tokens × 1 KV head per TP rank (8 × kv_replicator 4 / TP32) × 128 × 2 bytes = 2 MiB;
    per step 10 layers × 1024 micro-batches × (CP−1) forward, twice with selective recompute (20480), once backward
    (10240), and CP dK/dV hops in fp32 (20480 × 4 MiB): 71680 × 2 MiB = 140 GiB per rank."""
    cfg, warnings = nxdt_config("hf_llama3_70B_CP_config", "instance=trn1.32xlarge")
    only_the_no_effect_warning(warnings, weight_decay_noted=True)
    p = plan(cfg)
    assert p.degrees == {"tp": 32, "cp": 2, "ep": 1, "dp": 1, "pp": 8} and p.world_size == 512
    assert p.groups["cp"][:2] == [[0, 32], [1, 33]]  # TP fills a node, so a CP pair spans two nodes
    assert p.groups["dp_cp"] == p.groups["cp"]  # DP 1: ZeRO-1 shards over the CP pair
    ring = [(r["bytes"], r["count"]) for r in p.collectives if r["dim"] == "cp"]
    assert ring == [(2 * 2**20, 20480), (2 * 2**20, 10240), (4 * 2**20, 20480)]
    assert p.estimate["context_parallel"]["ring_bytes_per_step"] == 140 * 2**30


def test_nxdt_plan_command_prints_the_plan_and_one_warning(capsys):
    assert main(["plan", "--config-path", str(CONFIGS), "--config-name", "hf_llama3_8B_config", "instance=trn1.32xlarge"]) == 0
    out, err = capsys.readouterr()
    only_the_no_effect_warning(err.splitlines())
    assert "TP32 PP1 CP1 EP1 DP4" in out and "batch: global 1024 = micro 1 × DP 4 × 256 micro-batches" in out


def test_the_instance_is_inferred_only_when_unambiguous(capsys):
    assert main(["plan", "--config-path", str(CONFIGS), "--config-name", "hf_llama3_70B_trn2_config"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fits trn2.48xlarge" in err and "add instance=" in err
    catalogue = {"trn1.2xlarge": {0: 2, 1: 2}, "trn1.32xlarge": {0: 32, 1: 32}, "trn2.48xlarge": {0: 64, 1: 128, 2: 64}}
    assert infer_instance(2, None, catalogue) == "trn1.2xlarge"
    assert infer_instance(128, 1, catalogue) == "trn2.48xlarge"
    with pytest.raises(ConfigError, match="no Trainium node runs trainer.devices=4; .*instance=cpu"):
        infer_instance(4, None, catalogue)


# ---------------------------------------------------------------------------------------------- bad input


def test_a_misspelled_key_in_the_file_fails_with_one_line_naming_the_spelling(tmp_path, capsys):
    original = (CONFIGS / "hf_llama3_8B_config.yaml").read_text()
    (tmp_path / "typo.yaml").write_text(original)
    shutil.copy(CONFIGS / "llama3_8B_config.json", tmp_path)
    cfg, _ = compose_nxdt_config(tmp_path, "typo", ["instance=trn1.32xlarge"], paths=False)
    assert cfg.distributed_strategy.tensor_model_parallel_size == 32
    # the same file, edited: read again (a file's compose is kept per process by its text, nxdt_loader._composed_file)
    text = original.replace("  tensor_model_parallel_size: 32", "  tensor_model_paralel_size: 32")
    (tmp_path / "typo.yaml").write_text(text)
    run = tmp_path / "run"
    code = main(
        ["train", "--config-path", str(tmp_path), "--config-name", "typo", "instance=cpu", f"exp_manager.explicit_log_dir={run}"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and not run.exists()  # nothing was launched
    assert err == (
        "config error: distributed_strategy.tensor_model_paralel_size: unknown key (did you mean "
        "'distributed_strategy.tensor_model_parallel_size'?): neither an NxDT key nor nxdt's; see docs/migrating-from-nxdt.md"
    )


@pytest.mark.parametrize(
    "override, needle",
    [
        (["model.optim.nmae=adamw"], "unknown key (did you mean 'model.optim.name'?)"),
        (["model.optim.name=sgd"], "model.optim.name='sgd': not supported; nxdt trains with adamw or adamw_fp32OptState"),
        (["model.optim.sched.name=NoamAnnealing"], "model.optim.sched.name='NoamAnnealing': not supported"),
        (["precision.type=bf17"], "precision.type='bf17': must be one of fp32, bf16, bf16SR"),
        (["model_source=nemo"], "model_source='nemo': must be hf (model.model_config) or megatron (Megatron model keys)"),
        (["model.moe.frequency=2"], "model.moe.frequency=2: not supported here"),
        (["model.model_config=/no/such/config.json"], "model.model_config='/no/such/config.json': no such file"),
        (["data.seq_length=4096"], "differs from model.encoder_seq_length=8192"),
        (["trainer.accumulate_grad_batches=4"], "trainer.accumulate_grad_batches=4: not supported here"),
        (["instance=trn1.32xlarge", "trainer.devices=64"], "trainer.devices=64: a trn1.32xlarge node runs at most 32 ranks"),
        (
            ["+model_alignment_strategy.sft.packing=true", "data.source=text"],
            "model_alignment_strategy.sft trains on instruction records",
        ),
        (
            ["model.weight_init_only=true"],
            "model.weight_init_only=True: loads the model weights of exp_manager.resume_from_checkpoint",
        ),
    ],
)
def test_unsupported_values_are_one_line_errors(override, needle):
    with pytest.raises(ConfigError) as info:
        nxdt_config("hf_llama3_8B_config", "instance=trn1.32xlarge", *override)
    assert needle in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- fine-tuning configs

FINE_TUNING = ("hf_llama3_8B_SFT_config", "hf_llama3_8B_SFT_lora_config", "hf_llama3_8B_DPO_config", "hf_llama3_8B_ORPO_config")


@pytest.mark.parametrize("name", FINE_TUNING)
def test_nxdts_fine_tuning_configs_read_every_key_and_train(name):
    from nxdt.config.validate import NotYetSupported, check_trainable

    cfg, warnings = nxdt_config(name, "instance=trn1.32xlarge")
    # every other key is honoured: no "unknown", no note but the packed layout's (packing: True)
    only_the_no_effect_warning(warnings, packing_noted="SFT" in name, autocast_noted="lora" in name)
    em, data, m = cfg.exp_manager, cfg.data, cfg.model
    assert (m.weight_init_only, em.resume_from_checkpoint.rstrip("/"), data.seq_length) == (
        True,
        "/home/ubuntu/pretrained_ckpt",
        4096,
    )
    assert (data.tokenizer, cfg.trainer.limit_val_batches, cfg.trainer.val_check_interval) == (
        "/home/ubuntu/llama3_tokenizer",
        0.0,
        500,
    )
    assert plan(cfg).degrees["tp"] == 32
    mas = cfg.model_alignment_strategy
    if name in ("hf_llama3_8B_SFT_config", "hf_llama3_8B_SFT_lora_config"):
        assert (mas.sft.packing, data.source, data.dev_choose_samples, data.val_dir) == (
            True,
            "instructions",
            2250,
            "/home/ubuntu/validation.jsonl",
        )
        if mas.peft is not None:
            assert (
                mas.peft.lora_rank,
                mas.peft.lora_alpha,
                mas.peft.target_modules,
                mas.peft.save_lora_base,
                mas.peft.save_lora_config_adapter,
            ) == (16, 32, ["qkv_proj"], True, True)
        check_trainable(cfg)  # SFT trains, full or LoRA (tests/test_lora_e2e.py)
        return
    key = {"hf_llama3_8B_DPO_config": "dpo", "hf_llama3_8B_ORPO_config": "orpo"}[name]
    if key == "dpo":
        assert (
            mas.dpo.kl_beta,
            mas.dpo.loss_type,
            mas.dpo.max_prompt_length,
            mas.dpo.truncation_mode,
            mas.dpo.precompute_ref_log_probs,
        ) == (0.01, "sigmoid", 2048, "keep_start", True)
    else:
        assert (mas.orpo.beta, mas.orpo.max_prompt_length, mas.orpo.truncation_mode) == (0.1, 2048, "keep_start")
    assert (data.source, data.train_dir) == ("preferences", f"/home/ubuntu/data_{key}.jsonl")
    check_trainable(cfg)  # DPO / ORPO train (tests/test_dpo_e2e.py), with validation too (test_dpo_validation_e2e.py)
    check_trainable(nxdt_config(name, "instance=trn1.32xlarge", "data.val_dir=/v.jsonl")[0])
    if key == "dpo":  # TRL's default, scored each step by a frozen copy; not through a pipeline
        online = "model_alignment_strategy.dpo.precompute_ref_log_probs=false"
        check_trainable(nxdt_config(name, "instance=trn1.32xlarge", online)[0])
        with pytest.raises(NotYetSupported, match="precompute_ref_log_probs=False: with pipeline parallelism"):
            check_trainable(
                nxdt_config(
                    name,
                    "instance=trn1.32xlarge",
                    online,
                    "distributed_strategy.pipeline_model_parallel_size=2",
                    "distributed_strategy.tensor_model_parallel_size=8",
                )[0]
            )


# ---------------------------------------------------------------------------------------------- the rules (pure)


def minimal(**sections) -> dict:
    cfg = {
        "name": "t",
        "model_source": "hf",
        "trainer": {"devices": 2, "num_nodes": 1, "max_steps": 100},
        "data": {"micro_batch_size": 1, "global_batch_size": 8},
        "model": {"model_config": "c.json", "encoder_seq_length": 128},
    }
    for key, value in sections.items():
        node = cfg
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def flat(translation) -> dict:
    from nxdt.config.nxdt_compat import flatten

    return flatten(translation.config)


@pytest.mark.parametrize(
    "nxdt_type, flags, ours, sr_noted",
    [
        ("fp32", {}, "fp32", False),
        ("bf16SR", {}, "bf16SR", True),
        ("autocast", {}, "mixed_precision", False),
        ("mixed_precision", {"xla_downcast_bf16": "1"}, "mixed_precision", False),  # flags are read only for manual
        ("mixed_precisionSR", {}, "mixed_precisionSR", True),
        ("manual", {"xla_downcast_bf16": "1", "master_weights": True}, "mixed_precision", False),
        ("manual", {"xla_use_bf16": "1", "neuron_rt_stochastic_rounding_en": "1"}, "bf16SR", True),
        ("manual", {}, "fp32", False),
    ],
)
def test_precision_types(nxdt_type, flags, ours, sr_noted):
    t = translate(minimal(precision={"type": nxdt_type, **flags}), LLAMA_HF)
    assert flat(t)["precision.type"] == ours
    assert any("stochastic" in n for n in t.notes) == sr_noted


@pytest.mark.parametrize(
    "precision, zero1, ours, needle",
    [
        # examples/training_orchestrator.py accepts this spelling only; base.py tests "mixed_precisionSR", so no
        # master weights: bf16 weights updated with stochastic rounding
        ({"type": "mixed_precision_SR"}, True, "bf16SR", "precision.type=mixed_precision_SR: NxDT's orchestrator"),
        # lightning_modules/model/base.py: use_master_weights = ... and zero_one_enabled; XLA_DOWNCAST_BF16=1
        ({"type": "mixed_precision"}, False, "bf16", "precision.type=mixed_precision with distributed_strategy.zero1=False"),
        ({"type": "mixed_precisionSR"}, False, "bf16SR", "NxDT keeps fp32 master weights and fp32 gradients only with ZeRO-1"),
        ({"type": "mixed_precision"}, True, "mixed_precision", None),
        ({"type": "autocast"}, False, "mixed_precision", AUTOCAST_NOTE),  # nxdt's choice, bf16 one value away
        (
            {"type": "manual", "xla_downcast_bf16": "1", "master_weights": True, "fp32_grad_acc": True},
            False,
            "bf16",
            "precision.master_weights=True with distributed_strategy.zero1=False: NxDT keeps no fp32 master weights",
        ),
        (
            {"type": "manual", "xla_downcast_bf16": "1", "master_weights": True, "fp32_grad_acc": True},
            True,
            "mixed_precision",
            None,
        ),
        (
            {"type": "manual", "xla_downcast_bf16": "1", "master_weights": True, "fp32_grad_acc": False},
            True,
            "mixed_precision",
            "precision.fp32_grad_acc=False: NxDT accumulates gradients in bf16",
        ),
        (
            {"type": "manual", "xla_use_bf16": "1", "fp32_grad_acc": True},
            True,
            "bf16",
            "precision.fp32_grad_acc=True: NxDT accumulates gradients in fp32",
        ),
    ],
)
def test_precision_follows_what_nxdt_computes_with_and_without_zero1(precision, zero1, ours, needle):
    """NxDT keeps fp32 master weights and accumulates gradients in fp32 only with ZeRO-1
    (lightning_modules/model/base.py _initialize_nxd_config; neuronx-distributed's initialize_parallel_optimizer
    builds a plain optimizer over the bf16 parameters without it). No silent change: each difference is one note."""
    t = translate(minimal(precision=precision, distributed_strategy={"zero1": zero1}), LLAMA_HF)
    assert flat(t)["precision.type"] == ours
    if needle is None:  # nothing to say: nxdt computes what NxDT does
        assert not [n for n in t.notes if "ZeRO-1" in n or "accumulates gradients" in n], t.notes
    else:
        assert sum(needle in n for n in t.notes) == 1, t.notes


def test_precision_flags_outside_manual_are_named_as_having_no_effect():
    t = translate(minimal(precision={"type": "mixed_precision", "master_weights": False, "fp32_grad_acc": False}), LLAMA_HF)
    assert flat(t)["precision.type"] == "mixed_precision"  # master_weights: False is not read (NxDT's base.py either)
    assert {"precision.master_weights", "precision.fp32_grad_acc"} <= set(t.ignored)


@pytest.mark.parametrize(
    "trainer, needle",
    [
        ({"max_steps": -1, "max_epochs": 1}, "trainer.max_steps=-1: must be a step count >= 1"),
        ({"max_steps": None, "max_epochs": 2}, "to stop after trainer.max_epochs=2, give a max_steps"),
        ({"max_steps": 0}, "give the number of optimizer steps"),
    ],
)
def test_epochs_alone_are_refused_by_name_as_nxdts_schedule_needs_max_steps(trainer, needle):
    """lightning_modules/model/base.py asserts trainer.max_steps is set and builds the schedule over it."""
    with pytest.raises(ConfigError) as info:
        translate(minimal(trainer={"devices": 2, "num_nodes": 1, **trainer}), LLAMA_HF)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_key_in_the_wrong_section_names_where_it_belongs():
    """NxDT's config guide lists do_layer_norm_weight_decay under fusions.; NxDT reads model.do_layer_norm_weight_decay."""
    with pytest.raises(ConfigError, match=r"did you mean 'model.do_layer_norm_weight_decay'"):
        translate(minimal(model__fusions__do_layer_norm_weight_decay=True), LLAMA_HF)


def test_a_setting_that_is_a_section_here_names_the_section():
    """Lightning's Trainer(precision=...) habit: NxDT's precision is a section of its own (precision.type)."""
    with pytest.raises(ConfigError, match=r"trainer.precision: unknown key \(did you mean 'precision.type'\?\)"):
        translate(minimal(trainer={"devices": 2, "num_nodes": 1, "precision": "bf16-mixed"}), LLAMA_HF)


def test_moe_keys_on_a_dense_config_json_are_noted_and_not_planned():
    """NxDT's hf Llama reads no model.moe key; kept, they would make the plan count experts the model never builds."""
    t = translate(minimal(model__moe__num_experts=4, model__moe__top_k=2), LLAMA_HF)
    assert not any(k.startswith("model.moe.") for k in flat(t))
    assert t.notes == ["model.moe.num_experts, model.moe.top_k have no effect: nxdt.models.llama.LlamaForCausalLM has no experts"]
    assert flat(translate(minimal(model__moe__num_experts=4), MIXTRAL_HF))["model.moe.num_experts"] == 4


def test_nxdt_defaults_apply_where_nxdt_and_nxdt_differ():
    f = flat(translate(minimal(), LLAMA_HF))
    assert f["distributed_strategy.zero1"] is True  # NxDT's code default
    assert f["trainer.gradient_clip_val"] is None  # Lightning's default: no clipping
    assert (f["model.optim.betas"], f["model.optim.weight_decay"]) == ([0.9, 0.999], 0.0)  # NeMo's AdamW
    assert (f["model.optim.sched.name"], f["model.optim.sched.warmup_steps"]) == ("constant", 0)  # no sched: constant lr
    assert f["model.optim.sched.max_steps"] == "${trainer.max_steps}"


def test_schedules_checkpoints_and_names():
    t = translate(
        minimal(
            model__optim={"name": "adamw", "lr": 1e-3, "sched": {"name": "WarmupPolicy", "warmup_ratio": 0.1, "max_steps": 7}},
            exp_manager={
                "name": "run_a",
                "create_checkpoint_callback": False,
                "checkpoint_callback_params": {"every_n_train_steps": 5, "save_top_k": 3},
            },
        ),
        LLAMA_HF,
    )
    f = flat(t)
    assert (f["model.optim.sched.name"], f["model.optim.sched.warmup_steps"]) == ("constant", 10)
    assert any("sched.max_steps=7 is replaced by trainer.max_steps=100" in n for n in t.notes)
    assert (f["exp_manager.checkpoint_every_n_steps"], f["exp_manager.keep_last_k"], f["name"]) == (None, 3, "run_a")
    assert f["exp_manager.save_last"] is False  # no checkpoint callback: not the last step's either
    f = flat(
        translate(minimal(exp_manager={"checkpoint_callback_params": {"every_n_train_steps": 5, "save_top_k": 0}}), LLAMA_HF)
    )
    assert f["exp_manager.checkpoint_every_n_steps"] is None  # save_top_k 0 keeps nothing
    assert f["exp_manager.save_last"] is False
    # NeMo's save_last (NxDT's examples: false) is nxdt's exp_manager.save_last; absent, nxdt's default (true) as NeMo's
    params = {"every_n_train_steps": 5, "save_top_k": 1}
    f = flat(translate(minimal(exp_manager={"checkpoint_callback_params": {**params, "save_last": False}}), LLAMA_HF))
    assert f["exp_manager.save_last"] is False
    assert "exp_manager.save_last" not in flat(translate(minimal(exp_manager={"checkpoint_callback_params": params}), LLAMA_HF))
    with pytest.raises(ConfigError, match="keeping every checkpoint is not supported"):
        translate(minimal(exp_manager={"checkpoint_callback_params": {"save_top_k": -1}}), LLAMA_HF)


def test_model_config_overrides_follow_nxdt():
    t = translate(
        minimal(
            model__num_layers=-1,
            model__hidden_size=2048,
            model__max_position_embeddings=4096,
            model__moe={"num_experts": 4, "output_router_logits": False, "capacity_factor": 2.0},
        ),
        MIXTRAL_HF,
    )
    f = flat(t)
    assert f["model.num_layers"] == 32  # -1 keeps config.json's
    assert f["model.hidden_size"] == 2048
    assert f["model.max_position_embeddings"] == 32768  # the larger of config.json's and the yaml's
    assert (f["model.moe.num_experts"], f["model.moe.top_k"], f["model.moe.router_aux_loss_coef"]) == (4, 2, 0.0)
    assert any("capacity_factor=2.0: nxdt's MoE is dropless" in n for n in t.notes)
    assert flat(translate(minimal(model__encoder_seq_length=64), LLAMA_HF))["data.seq_length"] == 64
    with pytest.raises(ConfigError, match="rope_scaling|hidden_act='gelu'"):
        translate(minimal(), {**LLAMA_HF, "hidden_act": "gelu"})


def test_the_load_balancing_weight_gives_nxdts_loss():
    """NxDT's hf Mixtral takes output_router_logits and router_aux_loss_coef from the yaml's moe block (True and 0.02
    when absent: config.json's output_router_logits false and its own coefficient are not read) and adds coef · NxD's
    load_balancing_loss_func, which scales by E/top_k where transformers' scales by E. Written out here from NxD's
    definition (fp64 softmax, a one-hot per top-k slot, means over the rows): the translated weight times nxdt's
    (Hugging Face's) aux loss equals the file's coefficient times NxD's, on the same router logits."""
    from nxdt.models.mixtral import load_balancing_loss

    def weight(moe: dict, hf: dict = MIXTRAL_HF, **sections) -> float:
        return flat(translate(minimal(model__moe={"num_experts": 8, **moe}, **sections), hf))["model.moe.router_aux_loss_coef"]

    assert weight({}) == 0.01  # NxDT's defaults: on, 0.02; config.json says false and 0.02, not read
    assert weight({}, {**MIXTRAL_HF, "router_aux_loss_coef": 0.5}) == 0.01
    assert weight({"router_aux_loss_coef": 0.1, "top_k": 1}) == 0.1
    assert weight({"router_aux_loss_coef": 0.1, "output_router_logits": False}) == 0.0
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3 * 40, 8, generator=g, dtype=torch.float64)  # 3 layers × 40 tokens, 8 experts
    top_k, coef = 2, 0.02
    probs = torch.softmax(logits, dim=-1)
    slots = torch.topk(probs, top_k).indices  # [rows, k]
    one_hot = torch.stack([torch.nn.functional.one_hot(slots[:, s], 8).double() for s in range(top_k)], dim=1)
    nxd = (one_hot.mean(dim=0) * probs.mean(dim=0).unsqueeze(0)).sum() * (8 / top_k)
    ours = load_balancing_loss(logits.float(), 8, top_k).double()
    assert float(weight({"router_aux_loss_coef": coef, "top_k": top_k}) * ours) == pytest.approx(float(coef * nxd), rel=1e-6)


def test_data_sources_and_our_own_keys():
    f = flat(translate(minimal(data__train_dir="/corpus"), LLAMA_HF))
    assert (f["data.source"], f["data.train_dir"]) == ("hf_dataset", "/corpus")
    f = flat(translate(minimal(data__train_dir="/corpus", data__source="synthetic"), LLAMA_HF))
    assert f["data.source"] == "synthetic" and "data.train_dir" not in f  # synthetic reads no files
    f = flat(translate(minimal(exp_manager__max_restarts=2, comm__timeout_s=30.0), LLAMA_HF))  # nxdt keys in an NxDT file
    assert (f["exp_manager.max_restarts"], f["comm.timeout_s"]) == (2, 30.0)
    with pytest.raises(ConfigError, match="contradicts the NxDT key exp_manager.checkpoint_callback_params.every_n_train_steps"):
        translate(
            minimal(exp_manager={"checkpoint_every_n_steps": 3, "checkpoint_callback_params": {"every_n_train_steps": 5}}),
            LLAMA_HF,
        )


def test_values_nxdt_cannot_honour_are_noted_not_dropped_silently():
    t = translate(
        minimal(trainer__check_val_every_n_epoch=1, exp_manager__async_checkpointing=True, precision={"type": "bf16SR"}), LLAMA_HF
    )
    assert [n.split(" has no effect")[0] for n in t.notes if "has no effect" in n] == ["trainer.check_val_every_n_epoch=1"]
    assert flat(t)["exp_manager.async_checkpointing"] is True  # nxdt implements it: translated, not noted
    t = translate(minimal(trainer__limit_val_batches=0.0, exp_manager__async_checkpointing=False), LLAMA_HF)
    assert t.notes == [] and t.ignored == []


def test_every_rule_targets_a_schema_key_and_the_guide_holds_the_table():
    ours = {k for k, _, _ in field_docs()}
    assert {r.to or k for k, r in RULES.items() if r.kind == MAP} <= ours
    doc = DOC.read_text()
    table = doc.split("<!-- table: begin -->\n", 1)[1].split("\n<!-- table: end -->", 1)[0]
    assert table == mapping_table(), "docs/migrating-from-nxdt.md is stale: python -m nxdt.config.nxdt_compat"
    assert "nxdt plan --config-path" in doc and "nxdt train --config-path" in doc


# ---------------------------------------------------------------------------------------------- save_to_disk data


def test_a_save_to_disk_directory_reads_as_shifted_samples(tmp_path):
    from nxdt.data.hf_dataset import DatasetDirError, SavedHFDataset

    raw = (Path(__file__).parents[1] / "nxdt" / "data" / "samples" / "austen_pride_and_prejudice.txt").read_bytes()
    ds = SavedHFDataset(SAMPLE, 32, vocab_size=256)  # written by datasets.save_to_disk: 96 rows of 33 byte ids
    assert len(ds) == 96
    s = ds[5]
    assert s["input_ids"].tolist() == list(raw[5 * 33 : 5 * 33 + 32])
    assert s["labels"].tolist() == list(raw[5 * 33 + 1 : 5 * 33 + 33])  # next token, from the row's labels column
    assert SavedHFDataset(SAMPLE, 33)[0]["labels"][-1] == -100  # the row's last token has no successor
    with pytest.raises(DatasetDirError, match="rows hold 33 tokens, fewer than data.seq_length=64"):
        SavedHFDataset(SAMPLE, 64)
    with pytest.raises(DatasetDirError, match="token id .* does not fit model.vocab_size=100"):
        SavedHFDataset(SAMPLE, 32, vocab_size=100)
    dict_dir = tmp_path / "dict"  # DatasetDict.save_to_disk layout: dataset_dict.json + one directory per split
    shutil.copytree(SAMPLE, dict_dir / "train")
    (dict_dir / "dataset_dict.json").write_text('{"splits": ["train"]}')
    assert len(SavedHFDataset(dict_dir, 32)) == 96
    with pytest.raises(DatasetDirError, match="not a Hugging Face datasets directory"):
        SavedHFDataset(tmp_path, 32)


def test_without_pyarrow_the_error_says_what_to_install(monkeypatch):
    from nxdt.data.hf_dataset import DatasetDirError, SavedHFDataset

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DatasetDirError, match=r"pip install 'nxdt\[hf\]'"):
        SavedHFDataset(SAMPLE, 32)


# ---------------------------------------------------------------------------------------------- shrunk, trained

SHRINK = [
    "instance=cpu",
    "trainer.devices=2",
    "trainer.num_nodes=1",
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=96",
    "model.vocab_size=256",
    "model.encoder_seq_length=32",
    "data.global_batch_size=4",
    f"data.train_dir={SAMPLE}",
    "model.optim.lr=3e-3",
    "model.optim.sched.warmup_steps=0",
    "exp_manager.create_tensorboard_logger=false",
    "comm.timeout_s=60",
]
LAYOUTS = {  # the layout each config is shrunk to: TP + SP, PP, EP on 2 ranks; CP2 × PP2 on 4 (ZeRO-1, SP, selective)
    "hf_llama3_8B_config": ["distributed_strategy.tensor_model_parallel_size=2"],
    "hf_llama3_70B_trn2_config": [
        "trainer.lnc=null",
        "distributed_strategy.tensor_model_parallel_size=1",
        "distributed_strategy.pipeline_model_parallel_size=2",
    ],
    "hf_mixtral_8x7b_ep_config": [
        "distributed_strategy.tensor_model_parallel_size=1",
        "distributed_strategy.pipeline_model_parallel_size=1",
        "distributed_strategy.expert_model_parallel_size=2",
        "distributed_strategy.zero1=false",
        "model.moe.num_experts=4",
    ],
    "hf_llama3_70B_CP_config": [
        "trainer.devices=4",
        "distributed_strategy.tensor_model_parallel_size=1",
        "distributed_strategy.pipeline_model_parallel_size=2",
    ],
}


def initial_parameter_norm(cfg) -> float:
    """What rank 0 must log at step 1: the norm of the whole initial model, built in one process."""
    import lightning.pytorch as pl
    import torch

    from nxdt.lightning.module import CausalLMModule

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    module = CausalLMModule(cfg.model, cfg.data.global_batch_size, cfg.data.seq_length, cfg.data.micro_batch_size)
    return float(torch.linalg.vector_norm(torch.stack([p.detach().double().norm() for p in module.model.parameters()])))


def train_case(cases: Path, name: str, overrides: list[str], cwd) -> subprocess.CompletedProcess:
    """``nxdt train`` on a case's NxDT config file with overrides; it must finish, with no key called unknown."""
    result = warm_cli.run(
        ["train", "--config-path", str(cases), "--config-name", name, *overrides],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=170,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert "unknown key" not in result.stderr
    return result


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_same_config_shrunk_trains_on_cpu(name, tmp_path):
    run = tmp_path / "run"
    overrides = [*SHRINK, *LAYOUTS[name], f"exp_manager.explicit_log_dir={run}"]
    result = train_case(CONFIGS, name, overrides, tmp_path)
    assert result.stderr.count("have no effect here") == 1
    with open(run / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    loss = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0], loss
    assert all(float(r["grad_norm"]) > 0 for r in rows)  # exp_manager.log_gradient_norm: True in the file
    cfg, _ = compose_nxdt_config(CONFIGS, name, overrides)
    # the norm gathered over TP shards / PP stages / EP experts equals the single-process model's
    assert float(rows[0]["param_norm"]) == pytest.approx(initial_parameter_norm(cfg), rel=1e-5)


def test_nxdt_groups_and_keys_on_the_command_line_apply_to_an_nxdt_config():
    cfg, _ = nxdt_config(
        "hf_llama3_8B_config",
        "instance=trn1.32xlarge",
        "launcher=slurm",
        "launcher.partition=trn",
        "data.source=synthetic",
        "comm.timeout_s=30",
    )
    assert (cfg.launcher.name, cfg.launcher.partition, cfg.comm.timeout_s) == ("slurm", "trn", 30.0)
    assert (cfg.data.source, cfg.data.train_dir) == ("synthetic", None)  # NxDT's train_dir is not read then
    cfg, _ = nxdt_config("hf_llama3_8B_config", "instance=trn1.32xlarge", "exp_manager.checkpoint_every_n_steps=5")
    assert cfg.exp_manager.checkpoint_every_n_steps == 5  # the command line wins over the file's every_n_train_steps
