"""``data.global_batch_size: null`` (the default of nxdt's own configs) = micro_batch_size × DP, one micro-batch
per rank per step: resolved by validation, so the plan, the datamodule and the run's config.yaml see the
number; a given value is still checked. All in-process, no workers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from nxdt.config import ConfigError, compose_config, load_run_config
from nxdt.config.schema import DataConfig
from nxdt.config.validate import global_batch, validate
from nxdt.planner import plan

TP4_8B = ["instance=trn1.32xlarge", "model=llama3_8b", "distributed_strategy.tensor_model_parallel_size=4"]


def test_null_is_the_default_of_the_schema_and_of_the_shipped_configs():
    assert DataConfig().global_batch_size is None
    for source in ("text", "synthetic"):
        assert compose_config([f"data={source}"], check=False).data.global_batch_size is None


def test_validation_resolves_null_to_micro_times_dp():
    assert compose_config([]).data.global_batch_size == 8  # cpu: 2 ranks × micro 4 (the old default, unchanged)
    assert compose_config(["trainer.devices=3"]).data.global_batch_size == 12
    cfg = compose_config(["trainer.devices=4", "distributed_strategy.tensor_model_parallel_size=2", "data.micro_batch_size=3"])
    assert cfg.data.global_batch_size == 6  # DP 2
    assert global_batch(SimpleNamespace(global_batch_size=None, micro_batch_size=2), 5) == 10
    assert global_batch(SimpleNamespace(global_batch_size=40, micro_batch_size=2), 5) == 40


def test_a_given_value_is_still_checked():
    assert compose_config(["trainer.devices=4", "data.global_batch_size=32"]).data.global_batch_size == 32
    with pytest.raises(ConfigError, match=r"data.global_batch_size=6: must be divisible by micro_batch_size × DP = 4×2"):
        compose_config(["data.global_batch_size=6"])
    with pytest.raises(ConfigError, match=r"data.global_batch_size=8: must be divisible by micro_batch_size × DP = 4×8 = 32"):
        compose_config([*TP4_8B, "data.global_batch_size=8"], paths=False)


def test_null_with_the_interleaved_schedule_names_the_fix():
    overrides = [
        "trainer.devices=4",
        "distributed_strategy.pipeline_model_parallel_size=2",
        "distributed_strategy.virtual_pipeline_model_parallel_size=2",
    ]
    with pytest.raises(ConfigError) as err:
        compose_config(overrides)
    text = str(err.value)
    assert text.startswith("config error: data.global_batch_size: the interleaved schedule") and "\n" not in text
    assert "null means one micro-batch per rank per step (micro_batch_size × DP = 8): set a multiple of 16" in text
    assert compose_config([*overrides, "data.global_batch_size=16"]).data.global_batch_size == 16


def test_the_plan_uses_the_resolved_batch():
    p = plan(compose_config(TP4_8B, paths=False))
    assert p.batch == {"global": 32, "micro": 4, "seq_length": 128, "micro_batches": 1}  # DP 8 × micro 4
    cfg = compose_config(TP4_8B, paths=False)
    cfg.data.global_batch_size = None  # a config nobody validated: the plan resolves it, the config stays as given
    again = plan(cfg)
    assert again.batch == p.batch and again.estimate == p.estimate and cfg.data.global_batch_size is None


def test_the_run_config_records_the_resolved_number(tmp_path):
    from nxdt.launch.rundir import write_run_dir

    cfg = compose_config(["data=synthetic", "trainer.devices=3"])
    write_run_dir(tmp_path, cfg, plan(cfg))  # what `nxdt train` writes before any worker starts
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["global_batch_size"] == 12
    assert load_run_config(tmp_path / "config.yaml").data.global_batch_size == 12
    assert plan(load_run_config(tmp_path / "config.yaml")).batch["global"] == 12


def test_the_datamodule_resolves_null_with_its_data_parallel_size():
    from nxdt.lightning.datamodule import NxDDataModule

    cfg = SimpleNamespace(
        source="synthetic",
        micro_batch_size=2,
        global_batch_size=None,
        seq_length=16,
        train_dir=None,
        tokenizer=None,
        num_samples=40,
    )
    dm = NxDDataModule(cfg, seed=1, vocab_size=50)
    dm.setup("fit")
    assert dm.global_batch_size == 2  # one process: DP 1
    dm.dp_rank, dm.dp_size = 1, 2
    assert dm.global_batch_size == 4
    loader = dm.train_dataloader()
    assert loader.batch_sampler.micro_batches_per_step == 1
    assert next(iter(loader))["input_ids"].shape == (2, 16)
    assert dm.state_dict() == {"consumed_samples": 0, "global_step": 0}


def test_validate_leaves_a_given_value_alone():
    cfg = compose_config(["data.global_batch_size=16"], check=False)
    validate(cfg, paths=False)
    assert cfg.data.global_batch_size == 16
