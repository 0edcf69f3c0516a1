"""Range checks at their edges: the values just inside each range stay valid (the bad ones are cases of
test_bad_input_matrix.py), the catalogue's instances pass, and the run directory cannot leave exp_manager.exp_dir
even for a config that skipped validation."""

from __future__ import annotations

import pytest

from nxdt.config import ConfigError, available_options, compose_config
from nxdt.config.validate import check_ranges, fill_instance_defaults
from nxdt.launch.rundir import choose_run_dir

VALID_EDGES = [
    ["model.optim.lr=0"],  # frozen weights (test_hf_interop); the schedule's min_lr then does not apply
    ["model.optim.lr=1e-4", "model.optim.sched.name=constant"],  # constant: min_lr (3e-4) unused
    ["model.optim.weight_decay=0", "model.optim.betas=[0.0,0.999]", "model.optim.eps=1e-30"],
    ["model.optim.sched.min_lr=3e-3"],  # = lr
    ["model.optim.sched.warmup_steps=0", "model.optim.sched.constant_steps=0", "model.optim.sched.max_steps=1"],
    ["model.optim.sched.warmup_steps=500"],  # longer than the run: allowed (the rate then never reaches its peak)
    ["trainer.gradient_clip_val=0"],  # 0 = no clipping
    ["trainer.gradient_clip_val=null"],
    ["seed=0"],
    ["seed=4294967295"],
    ["trainer.max_epochs=-1"],
    ["trainer.max_epochs=3"],
    ["model.init_method_std=0"],
    ["model.norm_eps=1e-12", "model.rope_theta=500000"],
    ["comm.timeout_s=1"],
    ["comm.emulate_slowdown=0.5"],
    ["exp_manager.fault_injection.step=50"],
    ["exp_manager.max_restarts=1", "exp_manager.fault_injection.step=1", "exp_manager.fault_injection.attempt=1"],
    ["model=mixtral_tiny", "model.moe.top_k=4"],
    ["model=mixtral_tiny", "model.moe.top_k=1", "model.moe.router_aux_loss_coef=0"],
    ["trainer.devices=64", "data.global_batch_size=256"],
    ["trainer.max_steps=4611686018427387904"],
    ["name=a..b"],
    ["name=run 1"],
    ["name=run_${seed}"],
    ["name=${oc.env:NXDT_TEST_PLAIN_NAME}"],
]


@pytest.mark.parametrize("overrides", VALID_EDGES, ids=lambda o: " ".join(o))
def test_values_at_the_edge_of_each_range_stay_valid(overrides, monkeypatch):
    monkeypatch.setenv("NXDT_TEST_PLAIN_NAME", "from_env")
    compose_config(overrides)


def test_every_catalogue_instance_and_model_is_within_range():
    for group, option in [("instance", name) for name in available_options("instance")] + [
        ("model", name) for name in available_options("model")
    ]:
        cfg = compose_config([f"{group}={option}"], check=False)
        fill_instance_defaults(cfg)
        check_ranges(cfg)


@pytest.mark.parametrize("name", ["..", "../elsewhere", "a/b", "", ".", "/tmp/abs"])
def test_run_dir_never_leaves_exp_dir_even_unvalidated(tmp_path, name):
    cfg = compose_config([f"exp_manager.exp_dir={tmp_path / 'out'}"])
    cfg.name = name  # as if validation had been skipped
    with pytest.raises(ConfigError, match="exp_manager.exp_dir"):
        choose_run_dir(cfg)
    assert not (tmp_path / "out").exists()


def test_run_dir_is_one_directory_below_exp_dir(tmp_path):
    cfg = compose_config([f"exp_manager.exp_dir={tmp_path}", "name=a..b"])
    assert choose_run_dir(cfg).parent == tmp_path / "a..b"
    cfg.name = "../elsewhere"
    cfg.exp_manager.explicit_log_dir = str(tmp_path / "explicit")  # an explicit directory is the user's own choice
    assert choose_run_dir(cfg) == tmp_path / "explicit"
