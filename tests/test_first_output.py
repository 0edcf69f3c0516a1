"""``nxdt train`` answers before its heavy imports (issue 39): the first line, saying what is launched, is printed as
soon as the config is composed — before torch (and Lightning after it) is imported and the data and model are checked,
which take seconds on an idle host and tens of seconds on a loaded one.

Measured by order, not by the clock: ``python -X importtime`` writes a line to stderr as each module's import ends,
and with stdout unbuffered into the same pipe the first nxdt line must come before any line of a ``torch`` module."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_the_first_line_comes_before_torch_is_imported(tmp_path):
    # a model class that does not exist: refused by the model check, which imports torch first, so the run proves
    # torch was imported after the first line and no worker starts. The command names the launcher, so the workers'
    # fork server starts after the config is composed (nxdt.cli._names_launcher): without it, the server starts
    # first and its own imports of torch, in another process, write their lines into the same pipe meanwhile
    result = subprocess.run(
        [
            sys.executable,
            *("-X", "importtime", "-u", "-m", "nxdt.cli", "train"),
            *("launcher.dry_run=false", "model.architecture=nxdt.models.llama.NoSuchModel"),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=170,
    )
    lines = result.stdout.splitlines()
    # (the fork server started for the workers inherits -X importtime: its lines may follow the error)
    errors = [line for line in lines if line.startswith("config error:")]
    assert result.returncode == 2 and len(errors) == 1 and "has no attribute 'NoSuchModel'" in errors[0], errors
    first = next(i for i, line in enumerate(lines) if line.startswith("nxdt: "))
    assert lines[first] == "nxdt: llama_tiny (nxdt's config) · 2 ranks on cpu, TP1 PP1 DP2 · checking the data and the model…"
    torch_lines = [
        i
        for i, line in enumerate(lines)
        if line.startswith("import time:") and line.split("|")[-1].strip().split(".")[0] == "torch"
    ]
    assert torch_lines, "torch was never imported: the check above did not run"
    assert first < torch_lines[0], lines[torch_lines[0]]


def test_the_first_line_names_the_nxdt_config_the_layout_and_a_given_run_dir():
    from nxdt.config import compose_config
    from nxdt.launch.console import first_line

    cfg = compose_config(
        [
            "trainer.devices=8",
            "distributed_strategy.tensor_model_parallel_size=2",
            "distributed_strategy.pipeline_model_parallel_size=2",
            "exp_manager.explicit_log_dir=/tmp/run",
        ]
    )
    assert first_line(cfg, 1, None) == (
        "nxdt: llama_tiny (nxdt's config) · 8 ranks on cpu, TP2 PP2 DP2 → /tmp/run · checking the data and the model…"
    )
    assert first_line(cfg, 3, ("tests/nxdt_configs", "hf_llama3_8B_config")).startswith(
        "nxdt: 3 jobs, the first: llama_tiny (NxDT config tests/nxdt_configs/hf_llama3_8B_config.yaml) · 8 ranks"
    )


def test_summary_times_count_from_the_process_start():
    """The summary counts from the user's Enter: this process's start time from /proc, not the moment it is asked."""
    import time

    from nxdt.launch.console import process_started_at

    started = process_started_at()
    # pytest and its imports ran before this test: the process started at least a moment ago, and not in the future
    assert started < time.time() - 0.05
    with open("/proc/self/stat") as fh:  # cross-check: the same process's start in clock ticks since boot
        ticks = int(fh.read().rpartition(")")[2].split()[19])
    with open("/proc/uptime") as fh:
        uptime = float(fh.read().split()[0])
    # both readings are to 1/100 s (clock ticks and /proc/uptime), a few ms apart
    assert abs((time.time() - started) - (uptime - ticks / os.sysconf("SC_CLK_TCK"))) < 0.05


def test_only_an_override_of_the_launcher_group_defers_the_worker_server():
    """``nxdt train`` starts its workers' fork server before composing the config unless a command-line override sets
    the launcher group or one of its keys (the only way a run leaves this host or becomes a dry run)."""
    from nxdt.cli import _names_launcher

    overrides = [
        "launcher=slurm",
        "launcher.dry_run=true",
        "+launcher.extra=1",
        "~launcher",
        "trainer.devices=2",
        "exp_manager.explicit_log_dir=/tmp/launcher",
        "model=llama_tiny",
    ]
    assert [o for o in overrides if _names_launcher(o)] == overrides[:4]
