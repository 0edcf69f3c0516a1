"""Warnings before launch for settings that cannot take effect (issue 39): one ``warning:`` line each, before any worker
starts; the run still goes ahead. Checked in-process on composed configs; the schedule cases against the schedule the
workers run (``nxdt.lightning.optim.lr_lambda``), so a warning means exactly "the run never gets there"."""

from __future__ import annotations

import pytest

from nxdt.config import compose_config
from nxdt.config.validate import ineffective_settings
from nxdt.data import SAMPLE_INSTRUCTIONS
from nxdt.lightning.optim import lr_lambda


def warnings_for(*overrides: str) -> list[str]:
    return ineffective_settings(compose_config(list(overrides)))


def test_validation_past_the_last_step_is_never_reached():
    # the case: the SFT recipe trains 40 steps, validation asked for every 50
    (line,) = warnings_for("+recipe=sft", f"data.val_dir={SAMPLE_INSTRUCTIONS}", "trainer.val_check_interval=50")
    assert line == (
        "warning: trainer.val_check_interval=50 is beyond trainer.max_steps=40: data.val_dir is never validated; "
        "set trainer.val_check_interval to at most 40 (null: once, after the last step)"
    )
    assert "data.val_split is never validated" in warnings_for("data.val_split=0.1", "trainer.val_check_interval=51")[0]
    # validated: at the last step, after the last step (null), or nothing to validate at all
    assert warnings_for("data.val_split=0.1", "trainer.val_check_interval=50") == []
    assert warnings_for("data.val_split=0.1") == []
    assert warnings_for("trainer.val_check_interval=500") == []


@pytest.mark.parametrize(
    "name, warmup, max_steps",
    [
        ("CosineAnnealing", 10, 10),
        ("CosineAnnealing", 10, 11),
        ("LinearAnnealingWithWarmUp", 10, 10),
        ("LinearAnnealingWithWarmUp", 10, 9),
        ("constant", 5, 5),
        ("constant", 5, 6),
    ],
)
def test_a_warm_up_the_run_stops_inside_is_named_exactly_when_the_peak_is_never_reached(name, warmup, max_steps):
    cfg = compose_config(
        [f"trainer.max_steps={max_steps}", f"model.optim.sched.name={name}", f"model.optim.sched.warmup_steps={warmup}"]
    )
    f = lr_lambda(cfg.model.optim.sched, cfg.model.optim.lr)
    reaches_peak = max(f(step) for step in range(max_steps)) >= 1.0 - 1e-12  # optimizer steps 0 .. max_steps-1
    warned = [w for w in ineffective_settings(cfg) if "warmup_steps" in w]
    assert bool(warned) == (not reaches_peak), (name, warmup, max_steps)
    if warned:
        assert warned[0] == (
            f"warning: model.optim.sched.warmup_steps={warmup} does not end within trainer.max_steps={max_steps}: the "
            "learning rate never reaches model.optim.lr=0.003; use fewer warm-up steps or more steps"
        )


def test_a_decay_longer_than_the_run_is_named():
    cfg = compose_config(["trainer.max_steps=50", "model.optim.sched.max_steps=200"])
    (line,) = ineffective_settings(cfg)
    assert line.startswith(
        "warning: model.optim.sched.max_steps=200 is beyond trainer.max_steps=50: the CosineAnnealing decay runs to step "
        "200, so the run stops before the learning rate falls to model.optim.sched.min_lr=0.0003"
    )
    last = cfg.model.optim.lr * lr_lambda(cfg.model.optim.sched, cfg.model.optim.lr)(49)
    assert last > 5 * cfg.model.optim.sched.min_lr  # what the warning means: the run ends far above min_lr (2.7e-3)
    # following trainer.max_steps (the default), or a decay that ends at the run's end with a hold after it: no warning
    assert warnings_for("trainer.max_steps=50") == []
    assert warnings_for("trainer.max_steps=50", "model.optim.sched.max_steps=60", "model.optim.sched.constant_steps=10") == []
    assert warnings_for("trainer.max_steps=50", "model.optim.sched.max_steps=200", "model.optim.sched.name=constant") == []


def test_lora_on_a_random_base_is_named():
    (line,) = warnings_for("+recipe=lora")
    assert line.startswith("warning: LoRA (model_alignment_strategy.peft) without model.hf_checkpoint: the adapters train on")
    assert "set model.hf_checkpoint=DIR" in line
    assert warnings_for("+recipe=sft") == []  # full fine-tuning of the tiny model: no adapters
    assert warnings_for("+recipe=lora", "exp_manager.resume_if_exists=true") == []  # the run's own checkpoint has the base


def test_the_warnings_come_before_anything_starts(tmp_path, capsys):
    from nxdt.cli import main

    code = main(
        [
            "train",
            "launcher.dry_run=true",
            f"exp_manager.exp_dir={tmp_path}",
            "trainer.max_steps=40",
            "data.val_split=0.1",
            "trainer.val_check_interval=50",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and err.splitlines() == [
        "warning: trainer.val_check_interval=50 is beyond trainer.max_steps=40: data.val_split is never validated; "
        "set trainer.val_check_interval to at most 40 (null: once, after the last step)"
    ]
    assert "nxdt: dry run — nothing started, nothing written" in out
    assert not any(tmp_path.iterdir())  # the run directory it names is only where the run would go
