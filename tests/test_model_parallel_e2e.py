"""Model parallelism through `nxdt train`: the same per-step losses as one process (fp32), and sharded
checkpoints that resume exactly and refuse a different model-parallel layout with one clear line."""

from __future__ import annotations

import pytest

from test_train_e2e import TINY, assert_ok, losses, nxdt

COMMON = [*TINY, "data=synthetic", "trainer.max_steps=5", "data.global_batch_size=8", "data.micro_batch_size=2",
          "trainer.gradient_clip_val=0.5"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    assert_ok(nxdt("train", *COMMON, "trainer.devices=1", f"exp_manager.explicit_log_dir={run}", cwd=run.parent))
    return losses(run)


@pytest.mark.parametrize("layout", [
    ["trainer.devices=2", "distributed_strategy.pipeline_model_parallel_size=2", "distributed_strategy.virtual_pipeline_model_parallel_size=2"],
    ["trainer.devices=2", "distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.sequence_parallel=true"],
    ["trainer.devices=4", "distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.pipeline_model_parallel_size=2"],
    ["trainer.devices=2", "distributed_strategy.zero1=true"],
], ids=["pp2-interleaved", "tp2-sp", "tp2xpp2", "zero1-dp2"])
@pytest.mark.timeout(240)
def test_parallel_losses_equal_single_process(tmp_path, single, layout):
    run = tmp_path / "run"
    assert_ok(nxdt("train", *COMMON, *layout, f"exp_manager.explicit_log_dir={run}", cwd=tmp_path))
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, want in single.items():
        assert got[step] == pytest.approx(want, rel=1e-5), (step, got, single)


@pytest.mark.parametrize("layout,files", [
    ("distributed_strategy.pipeline_model_parallel_size=2", {"model-mp0.safetensors", "model-mp1.safetensors", "trainer_state-mp1.pt"}),
    ("distributed_strategy.zero1=true", {"model.safetensors", "trainer_state-dp0.pt", "trainer_state-dp1.pt"}),
], ids=["pp2", "zero1"])
@pytest.mark.timeout(300)
def test_sharded_checkpoints_resume_exactly(tmp_path, layout, files):
    common = [*COMMON, "trainer.devices=2", layout, "model.optim.sched.max_steps=6",
              "exp_manager.checkpoint_every_n_steps=3", "exp_manager.resume_if_exists=true"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert_ok(nxdt("train", *common, "trainer.max_steps=6", f"exp_manager.explicit_log_dir={full}", cwd=tmp_path))
    assert {p.name for p in (full / "checkpoints/step-3").iterdir()} >= files | {"done", "meta.json"}
    assert_ok(nxdt("train", *common, "trainer.max_steps=3", f"exp_manager.explicit_log_dir={resumed}", cwd=tmp_path))
    assert_ok(nxdt("train", *common, "trainer.max_steps=6", f"exp_manager.explicit_log_dir={resumed}", cwd=tmp_path))
    assert losses(resumed) == losses(full)
    # the same checkpoint on a different pipeline layout: one clear line, not a shape error deep in a worker
    other = nxdt("train", *COMMON, "trainer.devices=1", "trainer.max_steps=6",
                 f"exp_manager.resume_from_checkpoint={full / 'checkpoints/step-3'}", f"exp_manager.explicit_log_dir={tmp_path / 'o'}",
                 cwd=tmp_path)
    err = other.stderr.strip()
    assert other.returncode == 2 and len(err.splitlines()) == 1, err  # refused before any worker started
    assert "another tensor/pipeline/expert layout" in err or "same ZeRO-1 setting" in err


@pytest.mark.timeout(300)
def test_mixtral_expert_parallel_equals_single_process(tmp_path):
    common = [*COMMON, "model=mixtral_tiny"]
    one, two = tmp_path / "one", tmp_path / "ep2"
    assert_ok(nxdt("train", *common, "trainer.devices=1", f"exp_manager.explicit_log_dir={one}", cwd=tmp_path))
    assert_ok(nxdt("train", *common, "trainer.devices=2", "distributed_strategy.expert_model_parallel_size=2",
                   "exp_manager.checkpoint_every_n_steps=5", f"exp_manager.explicit_log_dir={two}", cwd=tmp_path))
    single, parallel = losses(one), losses(two)
    assert sorted(parallel) == [1, 2, 3, 4, 5]
    for step, want in single.items():
        assert parallel[step] == pytest.approx(want, rel=1e-5), (step, single, parallel)
    assert {"model-ep0.safetensors", "model-ep1.safetensors"} <= {p.name for p in (two / "checkpoints/step-5").iterdir()}
