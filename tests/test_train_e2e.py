"""End to end: ``nxdt train`` launches real worker processes and leaves a complete run directory.

Each test runs tiny trainings (llama_tiny, a few steps) in ``tmp_path``, or inspects a launch shared with other
modules (``shared_runs.py``: the default run, a failing one, one stopped by SIGINT, a 12-step reference); the acceptance
points of the walking skeleton: learning on the sample text, DP=2 equal to one process, exact resume, a failing worker
reported by rank, and sweeps with their report.
"""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import warm_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # the shared launches (shared_runs.py) may start here

TINY = ["model=llama_tiny", "trainer.log_every_n_steps=1", "exp_manager.create_tensorboard_logger=false"]


def nxdt(*args: str, cwd: Path, timeout: float = 200) -> subprocess.CompletedProcess:
    """``nxdt ARGS`` in ``cwd``, as a fork of a process that has imported nxdt once (tests/warm_cli.py)."""
    return warm_cli.run(args, cwd=cwd, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(fh)}


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def test_default_run_learns_on_the_sample_text_and_fills_the_run_dir(everyday_runs, capsys):
    """The default ``nxdt train`` (llama_tiny on the sample text, 2 ranks, TensorBoard on) with 30 steps and a
    checkpoint every 20: step-20 on schedule, step-30 because training ended (exp_manager.save_last, on by default,
    as NeMo's), both kept (keep_last_k=2), and the final one reads as a whole checkpoint of step 30."""
    run = everyday_runs["runs"]["llama_tiny"]
    assert_ok(everyday_runs["default"])
    loss = losses(run)
    assert sorted(loss) == list(range(1, 31))
    assert loss[30] < loss[1] - 1.0, loss  # byte-level text: starts near ln(256)=5.5, must clearly learn
    for name in (
        "config.yaml",
        "plan.json",
        "logs/rank0.log",
        "logs/rank1.log",
        "checkpoints/step-30/done",
        "checkpoints/step-20/done",
    ):
        assert (run / name).exists(), name
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-20", "step-30"]
    from nxdt.cli import main

    assert main(["checkpoint", "inspect", str(run / "checkpoints" / "step-30")]) == 0
    assert "step 30" in capsys.readouterr().out
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    with open(run / "metrics.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    assert {"step", "loss", "lr", "step_time_s", "tokens_per_s", "peak_rss_mb"} <= set(row) and float(row["tokens_per_s"]) > 0
    assert 50 < float(row["peak_rss_mb"]) < 20_000
    # private to their user: every directory 0700, every file 0600 (config, optimizer state, logs, metrics)
    for path in [run, *run.rglob("*")]:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


@pytest.fixture(scope="module")
def dp_sweep(tmp_path_factory) -> dict:
    """One sweep, ``trainer.devices=1,2``: job 0 trains on one process, job 1 the same run on two ranks (5 steps of 8
    sequences, clipped, validated at step 4 on data.val_dir: 37 windows, so the last global batch is partly padding).
    One launch serves the data-parallel comparison and the sweep's tools: the jobs of a sweep are separate worlds
    whatever they compare, so what each test checks is what two launches showed."""
    from nxdt.data import SAMPLE_TEXT

    root = tmp_path_factory.mktemp("dp_sweep")
    (root / "val.txt").write_bytes(SAMPLE_TEXT.read_bytes()[-37 * 128 - 1 :])
    result = nxdt(
        "train",
        "-m",
        *TINY,
        "data=text",
        "trainer.max_steps=5",
        "data.global_batch_size=8",
        "data.micro_batch_size=2",
        "trainer.gradient_clip_val=1.0",
        f"data.val_dir={root / 'val.txt'}",
        "trainer.val_check_interval=4",
        "trainer.devices=1,2",
        f"exp_manager.exp_dir={root / 'out'}",
        cwd=root,
    )
    assert_ok(result)
    metrics = sorted((root / "out").rglob("metrics.csv"))
    assert len(metrics) == 2, metrics  # one run directory per job
    sweep_dir = metrics[0].parent.parent
    jobs = {n: sweep_dir / str(n) for n in (0, 1)}
    for n, devices in ((0, 1), (1, 2)):
        assert f"trainer.devices={devices}" in (jobs[n] / "overrides.txt").read_text().split(), n
    return {"root": root, "result": result, "sweep_dir": sweep_dir, "one": jobs[0], "two": jobs[1]}


def test_data_parallel_losses_equal_single_process(dp_sweep):
    """Training losses and the validation loss (data.val_dir: 37 windows, so the last global batch is partly
    padding) equal one process's."""
    one, two = dp_sweep["one"], dp_sweep["two"]
    single, parallel = losses(one), losses(two)
    assert sorted(single) == sorted(parallel) == [1, 2, 3, 4, 5]
    for step in single:
        assert parallel[step] == pytest.approx(single[step], rel=1e-5), (step, single, parallel)
    assert single[5] != single[1]  # it trained
    val = [{int(r["step"]): r["val_loss"] for r in csv.DictReader(open(run / "metrics.csv", newline=""))} for run in (one, two)]
    assert [s for s, v in val[0].items() if v] == [4]  # every val_check_interval steps (5 is no multiple of 4)
    # a token-weighted sum over the same windows, whichever rank held them; fp32 forwards: rounding only
    assert float(val[1][4]) == pytest.approx(float(val[0][4]), rel=1e-6) and math.isfinite(float(val[0][4]))


def test_resume_continues_exactly(tmp_path, reliability_reference):
    """Stopped at step 5 (its checkpoint), the same command with resume_if_exists and trainer.max_steps=12 continues
    to the uninterrupted 12-step run's losses. The schedule length is pinned so the stopped run and the full run
    follow the same lr curve."""
    from shared_runs import RELIABILITY

    common = [*RELIABILITY, "model.optim.sched.max_steps=12", "exp_manager.resume_if_exists=true"]
    resumed = tmp_path / "resumed"
    assert_ok(nxdt("train", *common, "trainer.max_steps=5", f"exp_manager.explicit_log_dir={resumed}", cwd=tmp_path))
    assert sorted(losses(resumed)) == [1, 2, 3, 4, 5]
    # checkpoints every 6 steps now: the checkpoint callback's state key changes, so Lightning warns (call.py) on resume
    common = [o for o in common if not o.startswith("exp_manager.checkpoint_every_n_steps=")]
    common.append("exp_manager.checkpoint_every_n_steps=6")
    second = nxdt("train", *common, "trainer.max_steps=12", f"exp_manager.explicit_log_dir={resumed}", cwd=tmp_path)
    assert_ok(second)
    # Lightning's restoring lines and its call.py warning about nxdt's own checkpoint callback: the rank's log only
    log = (resumed / "logs" / "rank0.log").read_text()
    for noise in ("Restoring states from the checkpoint path", "Restored all states", "Please add the following callbacks"):
        assert noise not in second.stdout + second.stderr and noise in log, noise
    assert f"nxdt: resuming from {resumed / 'checkpoints' / 'step-5'}" in second.stdout
    got, want = losses(resumed), losses(reliability_reference)
    assert sorted(got) == list(range(1, 13))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got, want)
    # what changed, in one line; both launches kept in the run's config history (nxdt.launch.rundir)
    assert (
        f"nxdt: continuing {resumed}: trainer.max_steps 5 → 12, exp_manager.checkpoint_every_n_steps 5 → 6 "
        "(recorded in config-history/1-"
    ) in second.stdout
    history = sorted((resumed / "config-history").iterdir())
    assert [p.name.split("-", 1)[0] for p in history] == ["0", "1"]
    assert [(p / "overrides.txt").read_text().split()[-2] for p in history] == ["trainer.max_steps=5", "trainer.max_steps=12"]


def test_failing_worker_is_named_and_nothing_is_left_running(everyday_runs):
    """Rank 1 raises at step 3 of 20 (the shared run is quiet, -q: the failure line is printed all the same)."""
    result, run = everyday_runs["failing"], everyday_runs["runs"]["failing"]
    assert result.returncode != 0
    assert "rank 1" in result.stderr and "rank1.log" in result.stderr, result.stderr[-2000:]
    assert "injected fault" in (run / "logs" / "rank1.log").read_text()
    assert everyday_runs["failing_elapsed"] < 120
    assert not everyday_runs["failing_left"], f"processes left behind: {everyday_runs['failing_left']}"


def test_sweep_runs_one_world_per_job_and_reports(dp_sweep):
    """A sweep's jobs (one rank, then two: ``dp_sweep``) each run as their own world and are reported together."""
    result, sweep_dir, tmp_path = dp_sweep["result"], dp_sweep["sweep_dir"], dp_sweep["root"]
    report = nxdt("sweep-report", str(sweep_dir), cwd=tmp_path)
    assert_ok(report)
    assert "trainer.devices=1" in report.stdout and "trainer.devices=2" in report.stdout
    assert list(sweep_dir.glob("*.png"))
    # one tokens/s everywhere (nxdt.data.throughput): the console's summary of each job, `nxdt runs` and sweep-report
    # show 8 sequences × 128 tokens per step ÷ the mean step time of steps 2-5 (step 1 is start-up)
    listed = nxdt("runs", "--json", str(sweep_dir), cwd=tmp_path)
    assert_ok(listed)
    figures = {Path(r["run"]).name: r["tokens_per_s"] for r in json.loads(listed.stdout)}
    for job in ("0", "1"):
        with open(sweep_dir / job / "metrics.csv", newline="") as fh:
            times = [float(r["step_time_s"]) for r in csv.DictReader(fh)]
        assert len(times) == 5 and figures[job] == pytest.approx(8 * 128 * 4 / sum(times[1:]), rel=1e-9), (job, figures, times)
        shown = f"{figures[job]:,.0f}"
        row = next(line for line in report.stdout.splitlines() if re.match(rf"│ +{job} ", line))
        assert f" {shown} " in row and f"· {shown} tokens/s ·" in result.stdout, (shown, row, result.stdout)


def test_ctrl_c_stops_every_worker_with_one_line(everyday_runs):
    """SIGINT to the launcher once training has started (a checkpoint was written)."""
    stopped = everyday_runs["stopped"]
    assert stopped.returncode == 130
    assert "interrupted" in stopped.stderr and "Traceback" not in stopped.stderr, stopped.stderr[-2000:]
    assert not everyday_runs["stopped_left"], f"processes left behind: {everyday_runs['stopped_left']}"
