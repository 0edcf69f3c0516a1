"""A resume may change only what does not change the computation (``nxdt.config.resume_keys``): a changed model or
training key is refused by name with both values (exit 2) before anything in the run directory is written; what
may change is said in one line, and every launch into a run directory is kept in its config history. Run
directories and checkpoints are made in-process (the check runs before any worker); the CLI runs in-process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nxdt.cli import check_resume_checkpoint, main
from nxdt.config import compose_config
from nxdt.config.resume_keys import FREE, MODEL, NOTED, RESUME_KEYS, TRAINING, config_changes, key_class
from nxdt.config.schema import field_docs
from nxdt.launch.rundir import (
    HISTORY_DIR,
    check_same_run,
    config_dict,
    history_entries,
    resume_lines,
    write_run_dir,
)
from nxdt.planner import plan

BASE = ["data=synthetic", "trainer.max_steps=5"]


def test_every_schema_key_has_a_resume_class_and_every_entry_is_a_key():
    """A key added to the schema without a class fails here: whoever adds it decides whether a resume may change it."""
    keys = [k for k, _, _ in field_docs()]
    assert not [k for k in keys if key_class(k) is None], "classify these in nxdt/config/resume_keys.py"
    for entry, kind in RESUME_KEYS.items():
        assert kind in (MODEL, TRAINING, NOTED, FREE)
        # a key, a section ("instance.") or an optional block whose keys are listed (model_alignment_strategy.dpo)
        assert entry in keys or any(k.startswith(entry if entry.endswith(".") else entry + ".") for k in keys), entry


def _snapshot(run: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(run)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))
    }


def _run_dir(tmp_path: Path, *extra: str) -> Path:
    """A run directory as `nxdt train` leaves it (config.yaml, plan.json, overrides.txt, its history entry)."""
    run = tmp_path / "run"
    overrides = [*BASE, *extra, f"exp_manager.explicit_log_dir={run}"]
    cfg = compose_config(overrides)
    write_run_dir(run, cfg, plan(cfg), overrides)
    return run


@pytest.mark.parametrize(
    "was, now, key, shown",
    [
        ("model.rope_theta=500000", "model.rope_theta=10000", "model.rope_theta", ("500000.0", "10000.0")),
        ("model.norm_eps=1e-6", "model.norm_eps=1e-5", "model.norm_eps", ("1e-06", "1e-05")),
        ("model=llama_tiny", "model=gpt_tiny", "model.architecture", ("LlamaForCausalLM", "GPTForCausalLM")),
        ("precision.type=fp32", "precision.type=bf16", "precision.type", ("fp32", "bf16")),
        ("model.optim.lr=3e-4", "model.optim.lr=1e-3", "model.optim.lr", ("0.0003", "0.001")),
    ],
)
def test_a_resume_that_changes_the_computation_is_refused_by_name_and_touches_nothing(tmp_path, capsys, was, now, key, shown):
    run = _run_dir(tmp_path, was)
    before = _snapshot(run)
    code = main(["train", *BASE, now, f"exp_manager.explicit_log_dir={run}", "exp_manager.resume_if_exists=true"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert line.startswith(f"config error: {key}") and f"was trained with {key}=" in line, line
    assert all(value in line for value in shown), line  # both values
    assert _snapshot(run) == before  # not a byte, not a timestamp, no .lock: the run directory as it was


@pytest.mark.parametrize(
    "was, now, key, kind",
    [
        (["model.rope_scaling.rope_type=llama3"], [], "model.rope_scaling.rope_type", MODEL),
        (
            ["model.rope_scaling.rope_type=llama3"],
            ["model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=32"],
            "model.rope_scaling.factor",
            MODEL,
        ),
        ([], ["model.tie_word_embeddings=true"], "model.tie_word_embeddings", MODEL),
        ([], ["model.optim.betas=[0.9,0.99]"], "model.optim.betas", TRAINING),
        ([], ["model.optim.weight_decay=0.1"], "model.optim.weight_decay", TRAINING),
        ([], ["model.optim.sched.warmup_steps=1"], "model.optim.sched.warmup_steps", TRAINING),
        ([], ["seed=7"], "seed", TRAINING),
        ([], ["data.seq_length=64"], "data.seq_length", TRAINING),
        (
            ["+recipe=lora"],
            ["+recipe=lora", "model_alignment_strategy.peft.lora_rank=4"],
            "model_alignment_strategy.peft.lora_rank",
            TRAINING,
        ),
    ],
)
def test_each_change_that_changes_the_computation_is_refused_and_model_keys_even_for_new_training(was, now, key, kind):
    from nxdt.config.resume_keys import refusal

    before = config_dict(compose_config([*BASE, *was], check=False))
    after = config_dict(compose_config([*BASE, *now], check=False))
    change = refusal(config_changes(before, after), weight_init_only=False)
    assert change is not None and (change.key, change.kind) == (key, kind)
    # starting new training from the weights (weight_init_only) may change anything but the model
    assert (refusal(config_changes(before, after), weight_init_only=True) is None) == (kind == TRAINING)


def test_a_dry_run_shows_the_refusal_or_what_would_change(tmp_path, capsys):
    run = _run_dir(tmp_path, "model.rope_theta=500000")
    before = _snapshot(run)
    args = ["train", *BASE, f"exp_manager.explicit_log_dir={run}", "launcher.dry_run=true"]
    assert main([*args, "model.rope_theta=10000"]) == 2
    assert capsys.readouterr().err.startswith("config error: model.rope_theta=10000.0: the run being resumed")
    assert main([*args, "model.rope_theta=500000", "trainer.max_steps=6", "model.optim.sched.max_steps=5"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"nxdt: continuing {run}: trainer.max_steps 5 → 6, launcher.dry_run False → True\nnxdt: dry run")
    assert _snapshot(run) == before


def test_resuming_a_named_checkpoint_compares_its_runs_config_and_weight_init_only_only_the_model(tmp_path):
    """exp_manager.resume_from_checkpoint=<run>/checkpoints/step-N: that run's config.yaml is the reference. A run that
    only starts from the weights (weight_init_only) may change everything but the model; a resume may not."""
    from nxdt.config import ConfigError
    from nxdt.config.validate import MODEL_SHAPE_FIELDS
    from nxdt.lightning import checkpoint as ckpt_io

    import torch

    run = _run_dir(tmp_path, "model.rope_theta=500000")
    cfg = compose_config([*BASE, "model.rope_theta=500000"])
    ckpt = run / "checkpoints" / "step-3"
    meta = {
        "degrees": {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 2},
        "world_size": 2,
        "zero1": False,
        "model": {k: getattr(cfg.model, k) for k in MODEL_SHAPE_FIELDS},
    }
    ckpt_io.save({"state_dict": {"model.w": torch.ones(4)}, "global_step": 3, "optimizer_states": []}, ckpt, meta=meta)

    def check(*overrides: str) -> None:
        cfg = compose_config([*BASE, f"exp_manager.resume_from_checkpoint={ckpt}", *overrides])
        check_resume_checkpoint(cfg, plan(cfg))

    check("model.rope_theta=500000", "model.optim.lr=1e-3", "model.weight_init_only=true")  # fine-tuning: other lr
    check("model.rope_theta=500000", "trainer.max_steps=9", "exp_manager.log_gradient_norm=true")  # free keys
    with pytest.raises(ConfigError) as resumed:
        check("model.rope_theta=500000", "model.optim.lr=1e-3")
    assert str(resumed.value).startswith("config error: model.optim.lr=0.001: checkpoint step-3 of ")
    assert "model.optim.lr=0.003, not 0.001" in str(resumed.value) and "model.weight_init_only=true" in str(resumed.value)
    with pytest.raises(ConfigError) as init_only:
        check("model.weight_init_only=true")
    line = str(init_only.value)
    assert line.startswith("config error: model.rope_theta=10000.0:") and "model.rope_theta=500000.0" in line, line
    assert "export-hf" in line and "\n" not in line


def test_what_may_change_is_said_in_one_line_and_the_history_keeps_every_launch(tmp_path):
    """The launch sequence of `nxdt train` (check, write, say): a first run and two resumes — one extends the run
    (trainer.max_steps, and so the schedule: a note), one changes the global batch size and logging (a note)."""
    run = _run_dir(tmp_path)
    launches = [
        [*BASE, "trainer.max_steps=8", "exp_manager.resume_if_exists=true"],
        [
            *BASE,
            "trainer.max_steps=8",
            "model.optim.sched.max_steps=8",
            "data.global_batch_size=16",
            "exp_manager.log_gradient_norm=true",
        ],
    ]
    said, changed = [], []
    for overrides in launches:
        cfg = compose_config([*overrides, f"exp_manager.explicit_log_dir={run}"])
        changes = check_same_run(cfg, run)
        assert changes is not None
        said.append(resume_lines(run, changes, write_run_dir(run, cfg, plan(cfg), overrides)))
        changed.append(changes)
    first, second = said
    first_changes = changed[0]
    assert first[0] == (
        f"nxdt: continuing {run}: trainer.max_steps 5 → 8, exp_manager.resume_if_exists False → True, "
        f"model.optim.sched.max_steps 5 → 8 (recorded in {HISTORY_DIR}/1-{first[0].rsplit('/1-', 1)[1]}"
    ), first
    assert first[1].startswith("nxdt: note: model.optim.sched.max_steps 5 → 8: the rest of the learning-rate schedule")
    assert "data.global_batch_size 8 → 16" in second[0] and "exp_manager.log_gradient_norm False → True" in second[0]
    assert second[1].startswith("nxdt: note: data.global_batch_size 8 → 16: the data stream continues at the samples")
    megatron = resume_lines(run, check_same_run(cfg, run) or [], None, megatron=True)  # nothing changed since
    assert megatron == [f"nxdt: continuing {run}: no config key changed"]
    assert "Megatron's sample index" in resume_lines(run, first_changes, None, megatron=True)[-1]
    entries = history_entries(run)
    assert [e.name.split("-", 1)[0] for e in entries] == ["0", "1", "2"]
    assert [(e / "overrides.txt").read_text().split() for e in entries[1:]] == launches
    assert "global_batch_size: 16" in (entries[2] / "config.yaml").read_text()
    assert "global_batch_size: 8" in (entries[0] / "config.yaml").read_text()
    assert (run / "config.yaml").read_text() == (entries[2] / "config.yaml").read_text()  # the newest is the run's


def test_a_run_directory_from_before_the_history_keeps_its_first_config_as_entry_0(tmp_path):
    run = tmp_path / "run"
    cfg = compose_config([*BASE, f"exp_manager.explicit_log_dir={run}"])
    write_run_dir(run, cfg, plan(cfg))  # config.yaml and plan.json only, as an older nxdt (and a dry run) left them
    (run / "overrides.txt").write_text("data=synthetic\n")
    os.utime(run / "config.yaml", (0, 0))  # 1970: the entry is named by when that launch wrote its config
    write_run_dir(run, cfg, plan(cfg), BASE)
    old, new = history_entries(run)
    assert old.name.startswith("0-1970-01-01") and (old / "overrides.txt").read_text() == "data=synthetic\n"
    assert new.name.startswith("1-") and (new / "overrides.txt").read_text().split() == BASE


def test_changes_of_an_optional_block_and_of_the_hardware():
    """Switching an objective on is one change (the block), and a different instance is named once, not per figure."""
    base = config_dict(compose_config(BASE))
    sft = config_dict(compose_config([*BASE, "+recipe=sft", "instance=trn1.32xlarge"], check=False))
    changes = {c.key: c for c in config_changes(base, sft)}
    assert changes["model_alignment_strategy.sft"].kind == TRAINING and changes["model_alignment_strategy.sft"].was is None
    assert changes["instance.name"].kind == FREE
    assert not [k for k in changes if k.startswith("instance.") and k != "instance.name"]
    assert not [k for k in changes if k.startswith("model_alignment_strategy.sft.")]  # its keys: the block says it
