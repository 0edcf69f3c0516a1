"""Examples that run as written (issue 39): nxdt's examples in NxDT's config format ship in the package (``conf/nxdt/``) and are
named with ``--config-name nxdt/NAME`` from any directory; a checkpoint path the run no longer has says which it has."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdt.cli import example_names, examples_dir, main

ROOT = Path(__file__).resolve().parents[1]


def test_the_examples_are_package_data_and_the_tests_folder_is_the_same(tmp_path):
    assert examples_dir().resolve() == (ROOT / "conf" / "nxdt").resolve()
    assert (ROOT / "tests" / "nxdt_configs").resolve() == examples_dir().resolve()
    assert {"hf_llama3_8B_config", "hf_llama3_8B_SFT_lora_config", "hf_mixtral_8x7b_ep_config"} <= set(example_names())
    # what setuptools installs: pyproject's package-data patterns cover every file the examples need
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["nxdt.conf"]
    needed = [p for p in (ROOT / "conf" / "nxdt").rglob("*") if p.is_file()]
    needed = [p.relative_to(ROOT / "conf") for p in needed if p.suffix != ".py" and "__pycache__" not in p.parts]
    assert all(any(p.match(pattern) for pattern in patterns) for p in needed), [
        str(p) for p in needed if not any(p.match(pattern) for pattern in patterns)
    ]


def test_config_name_nxdt_slash_plans_an_example_without_a_path(capsys):
    assert main(["plan", "--config-name", "nxdt/hf_llama3_8B_config", "instance=trn1.32xlarge"]) == 0
    out = capsys.readouterr().out
    assert "trn1.32xlarge: world 128 = 4 node(s) × 32 ranks" in out and "TP32" in out


def test_a_misspelt_example_is_named_with_the_closest_one(capsys):
    assert main(["plan", "--config-name", "nxdt/hf_llama3_8b_config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nxdt: --config-name nxdt/hf_llama3_8b_config: no such example config; did you mean ")
    assert "nxdt/hf_llama3_8B_config?" in err and "\n" not in err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_checkpoint_removed_by_keep_last_k_is_answered_with_the_ones_there(tmp_path, capsys, command):
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (20, 30):
        (checkpoints / f"step-{step}").mkdir(parents=True)
        (checkpoints / f"step-{step}" / "done").write_text("")
    assert main(["checkpoint", command, str(checkpoints / "step-10")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"nxdt checkpoint: checkpoint {checkpoints / 'step-10'} does not exist: {checkpoints} holds step-20, step-30 "
        "(a run keeps its newest exp_manager.keep_last_k checkpoints) — pass one of them"
    )
