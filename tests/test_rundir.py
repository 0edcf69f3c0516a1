"""Run-directory choice: explicit dir, a new timestamped dir, or — with resume_if_exists — the newest
run of this name that holds a complete checkpoint."""

from nxdt.config import compose_config
from nxdt.launch.rundir import choose_run_dir, write_run_dir
from nxdt.planner import plan


def _cfg(tmp_path, *extra):
    return compose_config([f"exp_manager.exp_dir={tmp_path}", *extra])


def test_new_run_gets_a_fresh_timestamped_dir(tmp_path):
    cfg = _cfg(tmp_path)
    first = choose_run_dir(cfg)
    write_run_dir(first, cfg, plan(cfg))
    second = choose_run_dir(cfg)
    assert first.parent == second.parent == tmp_path / "llama_tiny" and first != second
    assert (first / "config.yaml").exists() and (first / "plan.json").exists() and (first / "logs").is_dir()


def test_resume_picks_the_newest_run_with_a_complete_checkpoint(tmp_path):
    root = tmp_path / "llama_tiny"
    (root / "2026-01-01_00-00-00" / "checkpoints" / "step-5").mkdir(parents=True)
    (root / "2026-01-01_00-00-00" / "checkpoints" / "step-5" / "done").write_text("ok")
    (root / "2026-01-02_00-00-00" / "checkpoints" / "step-9").mkdir(parents=True)  # interrupted save: no done marker
    (root / "2026-01-03_00-00-00").mkdir()  # a run that never checkpointed
    assert choose_run_dir(_cfg(tmp_path, "exp_manager.resume_if_exists=true")).name == "2026-01-01_00-00-00"
    assert choose_run_dir(_cfg(tmp_path)).parent == root  # without resume: a new directory
    assert choose_run_dir(_cfg(tmp_path, f"exp_manager.explicit_log_dir={tmp_path / 'x'}")) == tmp_path / "x"


def test_new_training_from_weights_continues_only_a_run_that_trains_the_same_way(tmp_path):
    """model.weight_init_only with resume_if_exists (NxDT's fine-tuning files): a run of this name that started from the
    same weights and trains the same way is continued; one with another training key (nxdt.config.resume_keys) is
    another run: a new directory, not a refusal."""
    ckpt = tmp_path / "pretrained" / "checkpoints" / "step-3"
    ckpt.mkdir(parents=True)
    start = [f"exp_manager.resume_from_checkpoint={ckpt}", "model.weight_init_only=true", "exp_manager.resume_if_exists=true"]
    first = _cfg(tmp_path, *start)
    run = choose_run_dir(first)
    write_run_dir(run, first, plan(first))
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "done").write_text("ok")
    assert choose_run_dir(_cfg(tmp_path, *start, "trainer.max_steps=80")) == run  # a free key: the same run
    assert choose_run_dir(_cfg(tmp_path, *start, "model.optim.lr=1e-2")) != run  # another training: a new run
