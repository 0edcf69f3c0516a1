"""The objective registry (``nxdt.lightning.registry``): one spec per objective, the one place ``nxdt train`` asks which
objective runs — its config block, data, loss or module, metrics, reference model and pre-launch check. In-process
only: the objectives' own behaviour is guarded by their tests (test_sft*.py, test_dpo*.py, test_orpo.py,
test_grpo*.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest

from nxdt.config import ConfigError, compose_config
from nxdt.config.schema import ORPOConfig
from nxdt.config.validate import ALIGNMENT_BLOCKS, CHOICES, check_trainable
from nxdt.lightning import grpo
from nxdt.lightning.checkpoint import CheckpointError
from nxdt.lightning.module import CausalLMModule
from nxdt.lightning.objective import CAUSAL_LM, ORPO_METRICS, REWARD_METRICS, Objective
from nxdt.lightning.registry import (
    OBJECTIVES,
    check_launch,
    check_resume_reference,
    objective_spec,
    reference_meta,
    starting_weights,
)

RECIPES = Path(__file__).resolve().parents[1] / "conf" / "recipe"


def _cfg(recipe: str | None, *overrides: str):
    return compose_config(([f"+recipe={recipe}"] if recipe else []) + list(overrides), paths=False)


def test_the_registry_lists_exactly_the_five_objectives_and_the_configs_blocks():
    assert [s.name for s in OBJECTIVES] == ["pretraining", "sft", "dpo", "orpo", "grpo"]
    # every objective block of the schema has a spec, and no spec a block the schema lacks (peft adapts any of them)
    assert {s.key for s in OBJECTIVES if s.key} == set(ALIGNMENT_BLOCKS) - {"peft"}
    # data.source: every allowed value is read by exactly the objectives that declare it; nothing else is declared
    declared = [src for s in OBJECTIVES for src in s.data_sources]
    assert set(declared) == set(CHOICES["data.source"])
    assert {src for src in declared if declared.count(src) > 1} == {"preferences"}  # DPO and ORPO share their records


@pytest.mark.parametrize("spec", OBJECTIVES, ids=lambda s: s.name)
def test_every_spec_is_complete_and_is_what_its_recipe_selects(spec):
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name not in ("key", "recipe", "reference"):  # None there means: pretraining / no reference model
            assert value is not None and value != (), field.name
    assert spec.recipe == spec.key  # +recipe=<key> sets the block up
    if spec.recipe is not None:
        assert (RECIPES / f"{spec.recipe}.yaml").is_file()
    cfg = _cfg(spec.recipe)
    assert objective_spec(cfg) is spec
    block = spec.block(cfg)
    assert (block is None) == (spec.key is None)
    assert isinstance(spec.objective(block), Objective)
    metrics = spec.metrics(block)
    assert isinstance(metrics, tuple) and all(isinstance(m, str) for m in metrics)
    assert spec.console({}) is None  # a row without the objective's metrics adds nothing to the step line
    assert issubclass(spec.module, CausalLMModule)
    assert isinstance(spec.build_datamodule(cfg), pl.LightningDataModule)  # built, not set up: nothing read yet


def test_each_objective_brings_its_loss_metrics_module_and_reference():
    by_name = {s.name: s for s in OBJECTIVES}
    assert by_name["pretraining"].objective(None) is CAUSAL_LM and by_name["sft"].objective(object()) is CAUSAL_LM
    dpo, orpo = _cfg("dpo").model_alignment_strategy.dpo, _cfg("orpo").model_alignment_strategy.orpo
    assert by_name["dpo"].metrics(dpo) == (*REWARD_METRICS, "aux_loss") and by_name["orpo"].metrics(orpo) == ORPO_METRICS
    dpo.loss_type = ["sigmoid", "sft"]  # DPO's sft loss type: its token-mean term logged too
    assert by_name["dpo"].metrics(dpo) == (*REWARD_METRICS, "sft_loss", "aux_loss")
    cfg = _cfg("grpo")
    assert by_name["grpo"].metrics(cfg.model_alignment_strategy.grpo) == grpo.metric_names(cfg.model_alignment_strategy.grpo)
    assert by_name["grpo"].module is grpo.GRPOModule
    assert [s.name for s in OBJECTIVES if s.reference is not None] == ["dpo", "grpo"]
    row = {"rewards/accuracies": 0.75, "rewards/margins": 0.5}
    assert by_name["dpo"].console(row) == "reward acc 0.75 margin 0.5000"
    row = {"reward": 0.5, "reward_std": 0.25, "kl": 0.01, "completions/mean_length": 3.0}
    assert by_name["grpo"].console(row) == "reward 0.500 ± 0.250 kl 0.0100 len 3.0"


def test_a_config_selecting_two_objectives_is_refused_with_one_line():
    cfg = _cfg("dpo")
    cfg.model_alignment_strategy.orpo = ORPOConfig()  # what an NxDT YAML with both blocks composes to
    for refuse in (objective_spec, check_trainable):  # the registry (workers) and the config check (launcher)
        with pytest.raises(ConfigError) as info:
            refuse(cfg)
        message = str(info.value)
        assert "\n" not in message
        assert "model_alignment_strategy.orpo" in message and "model_alignment_strategy.dpo is set too" in message


def test_a_source_read_by_another_objective_names_it_before_launch():
    with pytest.raises(ConfigError) as info:
        check_launch(_cfg(None, "data.source=prompts"))
    assert str(info.value) == (
        "config error: data.source='prompts': prompts records are read by GRPO: add model_alignment_strategy.grpo (+recipe=grpo)"
    )
    with pytest.raises(ConfigError) as info:  # GRPO on token text: the source its spec reads
        check_launch(_cfg("grpo", "data.source=text"))
    assert str(info.value) == (
        "config error: data.source='text': model_alignment_strategy.grpo reads prompts records: set data.source=prompts"
    )


def _checkpoint(tmp_path: Path, meta: dict) -> Path:
    path = tmp_path / "step-3"
    path.mkdir()
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_grpo_with_a_kl_term_records_and_checks_its_reference_as_dpo_does(tmp_path):
    """GRPO's reference (beta != 0) is the starting weights, as DPO's: its checkpoints name them and a resume from
    other starting weights is refused; beta 0 keeps no reference and checks nothing."""
    kl = _cfg("grpo", "model_alignment_strategy.grpo.beta=0.04")
    assert reference_meta(kl) == {"grpo_reference": starting_weights(kl)}
    assert reference_meta(_cfg("grpo")) == {} and reference_meta(_cfg("orpo")) == {}
    assert reference_meta(_cfg("dpo")) == {"dpo_reference": starting_weights(_cfg("dpo"))}  # the key DPO has always had
    same = _checkpoint(tmp_path, {"grpo_reference": starting_weights(kl)})
    check_resume_reference(kl, same)
    other = _cfg("grpo", "model_alignment_strategy.grpo.beta=0.04", "seed=7")
    with pytest.raises(CheckpointError, match="trained by GRPO against the reference random initialisation \\(seed 1234"):
        check_resume_reference(other, same)
    (tmp_path / "plain").mkdir()
    plain = _checkpoint(tmp_path / "plain", {})
    with pytest.raises(CheckpointError, match="is not a GRPO run's with a reference model"):
        check_resume_reference(kl, plain)
    check_resume_reference(_cfg("grpo"), plain)  # beta 0: no reference to keep
