"""End to end: ``nxdt train`` launches real worker processes and leaves a complete run directory.

Each test runs tiny trainings (llama_tiny, a few steps) in ``tmp_path``; the acceptance points of
the walking skeleton: learning on the sample text, DP=2 equal to one process, exact resume, a
failing worker reported by rank, and sweeps with their report.
"""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nxdt.comm.waiting import pid_alive  # zombies count as gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TINY = ["model=llama_tiny", "trainer.log_every_n_steps=1", "exp_manager.create_tensorboard_logger=false"]


def nxdt(*args: str, cwd: Path, timeout: float = 200) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "nxdt.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(fh)}


def assert_no_process_left(run_dir: Path) -> None:
    """Every worker the run started, and the fork server they came from, has exited (zombies count as gone)."""
    started = re.findall(r"started [0-9-]+ [0-9:.]+ \(pid (\d+), parent (\d+)\)", "".join(
        path.read_text() for path in (run_dir / "logs").glob("rank*.log")))
    assert started, "no worker logged its start"
    pids = {int(pid) for pair in started for pid in pair}
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in pids if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


def test_default_run_learns_on_the_sample_text_and_fills_the_run_dir(tmp_path):
    run = tmp_path / "run"
    result = nxdt("train", *TINY, "trainer.max_steps=30", "exp_manager.checkpoint_every_n_steps=15",
                  "exp_manager.create_tensorboard_logger=true", f"exp_manager.explicit_log_dir={run}", cwd=tmp_path)
    assert_ok(result)
    loss = losses(run)
    assert sorted(loss) == list(range(1, 31))
    assert loss[30] < loss[1] - 1.0, loss  # byte-level text: starts near ln(256)=5.5, must clearly learn
    for name in ("config.yaml", "plan.json", "logs/rank0.log", "logs/rank1.log", "checkpoints/step-30/done", "checkpoints/step-15/done"):
        assert (run / name).exists(), name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    with open(run / "metrics.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    assert {"step", "loss", "lr", "step_time_s", "tokens_per_s", "peak_rss_mb"} <= set(row) and float(row["tokens_per_s"]) > 0
    assert 50 < float(row["peak_rss_mb"]) < 20_000
    # private to their user: every directory 0700, every file 0600 (config, optimizer state, logs, metrics)
    for path in [run, *run.rglob("*")]:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_data_parallel_losses_equal_single_process(tmp_path):
    """Training losses and the validation loss (data.val_dir: 37 windows, so the last global batch is partly
    padding) equal one process's."""
    from nxdt.data import SAMPLE_TEXT

    (tmp_path / "val.txt").write_bytes(SAMPLE_TEXT.read_bytes()[-37 * 128 - 1:])
    common = [*TINY, "data=text", "trainer.max_steps=5", "data.global_batch_size=8", "data.micro_batch_size=2",
              "trainer.gradient_clip_val=1.0", f"data.val_dir={tmp_path / 'val.txt'}", "trainer.val_check_interval=4"]
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    assert_ok(nxdt("train", *common, "trainer.devices=1", f"exp_manager.explicit_log_dir={one}", cwd=tmp_path))
    assert_ok(nxdt("train", *common, "trainer.devices=2", f"exp_manager.explicit_log_dir={two}", cwd=tmp_path))
    single, parallel = losses(one), losses(two)
    assert sorted(single) == sorted(parallel) == [1, 2, 3, 4, 5]
    for step in single:
        assert parallel[step] == pytest.approx(single[step], rel=1e-5), (step, single, parallel)
    assert single[5] != single[1]  # it trained
    val = [{int(r["step"]): r["val_loss"] for r in csv.DictReader(open(run / "metrics.csv", newline=""))} for run in (one, two)]
    assert [s for s, v in val[0].items() if v] == [4]  # every val_check_interval steps (5 is no multiple of 4)
    # a token-weighted sum over the same windows, whichever rank held them; fp32 forwards: rounding only
    assert float(val[1][4]) == pytest.approx(float(val[0][4]), rel=1e-6) and math.isfinite(float(val[0][4]))


def test_resume_continues_exactly(tmp_path):
    # The schedule length is pinned so the stopped run and the full run follow the same lr curve.
    common = [*TINY, "data=synthetic", "data.global_batch_size=4", "data.micro_batch_size=2",
              "model.optim.sched.max_steps=6", "exp_manager.checkpoint_every_n_steps=3", "exp_manager.resume_if_exists=true"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert_ok(nxdt("train", *common, "trainer.max_steps=6", f"exp_manager.explicit_log_dir={full}", cwd=tmp_path))
    assert_ok(nxdt("train", *common, "trainer.max_steps=3", f"exp_manager.explicit_log_dir={resumed}", cwd=tmp_path))
    assert sorted(losses(resumed)) == [1, 2, 3]
    second = nxdt("train", *common, "trainer.max_steps=6", f"exp_manager.explicit_log_dir={resumed}", cwd=tmp_path)
    assert_ok(second)
    got, want = losses(resumed), losses(full)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got, want)


def test_failing_worker_is_named_and_nothing_is_left_running(tmp_path):
    run = tmp_path / "run"
    start = time.monotonic()
    result = nxdt("train", *TINY, "data=synthetic", "trainer.max_steps=20", "exp_manager.fault_injection.step=3",
                  "exp_manager.fault_injection.rank=1", f"exp_manager.explicit_log_dir={run}", cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "rank 1" in result.stderr and "rank1.log" in result.stderr, result.stderr[-2000:]
    assert "injected fault" in (run / "logs" / "rank1.log").read_text()
    assert elapsed < 120
    assert_no_process_left(run)


def test_sweep_runs_one_world_per_job_and_reports(tmp_path):
    result = nxdt("train", "-m", *TINY, "data=synthetic", "trainer.max_steps=3", "data.global_batch_size=4",
                  "data.micro_batch_size=2", "trainer.devices=1,2", f"exp_manager.exp_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert_ok(result)
    metrics = sorted((tmp_path / "out").rglob("metrics.csv"))
    assert len(metrics) == 2
    sweep_dir = metrics[0].parent.parent
    report = nxdt("sweep-report", str(sweep_dir), cwd=tmp_path)
    assert_ok(report)
    assert "trainer.devices=1" in report.stdout and "trainer.devices=2" in report.stdout
    assert list(sweep_dir.glob("*.png"))


def test_ctrl_c_stops_every_worker_with_one_line(tmp_path):
    import signal

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "nxdt.cli", "train", *TINY, "data=synthetic", "trainer.max_steps=100000",
                             f"exp_manager.explicit_log_dir={run}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / "metrics.csv").exists():  # training has started
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err, err[-2000:]
    assert_no_process_left(run)
