"""Nothing lost: a worker killed with SIGKILL is restarted by the elastic agent and the run resumes from
the newest complete checkpoint, bitwise equal to an uninterrupted run; a kill in the middle of an
(asynchronous) checkpoint write leaves the previous checkpoint usable; bad checkpoints are one clear line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nxdt.lightning.checkpoint import verify as verify_checkpoint

from shared_runs import RELIABILITY
from test_train_e2e import TINY, assert_ok, losses, nxdt

COMMON = RELIABILITY  # 12 DP2 steps, a checkpoint every 5


@pytest.fixture
def reference(reliability_reference) -> Path:
    """The uninterrupted run (shared_runs.py; test_train_e2e.py's resume_if_exists test compares with it too)."""
    return reliability_reference


@pytest.mark.timeout(240)
def test_sigkill_mid_run_restarts_and_matches_the_uninterrupted_run(tmp_path, reference):
    run = tmp_path / "run"
    result = nxdt(
        "train",
        *COMMON,
        "exp_manager.max_restarts=1",
        "exp_manager.fault_injection.step=7",
        "exp_manager.fault_injection.rank=1",
        "exp_manager.fault_injection.kind=sigkill",
        f"exp_manager.explicit_log_dir={run}",
        cwd=tmp_path,
    )
    assert_ok(result)
    # Lightning's own restoring line goes to the rank's log (nxdt.launch.console); the console has nxdt's line below
    assert "Restoring states from the checkpoint path at" not in result.stdout + result.stderr
    assert re.search(r"Restoring states from the checkpoint path at \S*step-5", (run / "logs" / "rank0.log").read_text())
    assert "nxdt: restart 1 of 1 after a worker failed (see logs/agent); resuming from step-5" in result.stdout
    assert losses(run) == losses(reference)  # bitwise: the restarted attempt replays steps 6-7 exactly
    got, want = (
        load_file(run / "checkpoints/step-10/model.safetensors"),
        load_file(reference / "checkpoints/step-10/model.safetensors"),
    )
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in got)


@pytest.mark.timeout(300)  # the shared launches (shared_runs.py) may start here
def test_sigkill_during_an_async_checkpoint_write_resumes_from_the_previous_one(attacked_restart, reference):
    """The save is asynchronous (a background writer commits while training goes on) and only one checkpoint
    is kept: Lightning asks to remove step-5 as soon as step-10's save is handed over, but the removal waits
    for step-10's commit, which never happens — so step-5 is still there to resume from. (The run is shared_runs.py's
    ``attacked_restart``: its store is also written into while it trains, see test_store_auth.py.)"""
    run, result = attacked_restart["run"], attacked_restart["result"]
    assert_ok(result)
    out = result.stdout + result.stderr
    assert "checkpoints/step-5" in out  # kept until step-10 committed, so the restart resumed from it
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the half-written step-10 was removed
    assert losses(run) == losses(reference)  # bitwise, though the snapshots were written while training went on
    got, want = (
        load_file(run / "checkpoints/step-10/model.safetensors"),
        load_file(reference / "checkpoints/step-10/model.safetensors"),
    )
    assert all(torch.equal(got[k], want[k]) for k in want)  # the snapshot of step 10, not of a later step


def _checkpoint_copy(reference: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "step-5"
    shutil.copytree(reference / "checkpoints/step-5", dst)
    return dst


DAMAGES = [
    (lambda d: (d / "done").unlink(), "incomplete"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]), "truncated"),
    (lambda d: (d / "trainer_state.pt").write_bytes(b"garbage"), "damaged"),
    (
        lambda d: (d / "meta.json").write_text(
            json.dumps({**json.loads((d / "meta.json").read_text()), "model": {"hidden_size": 999}})
        ),
        "another model",
    ),
    (lambda d: shutil.rmtree(d), "does not exist"),
]


def test_bad_checkpoints_are_one_line_before_any_worker(tmp_path, reference, capsys):
    """Damaged copies of a real trained checkpoint, each refused in the launcher (in-process: the check
    runs before any worker, so a subprocess per case would only add interpreter start-up time)."""
    from nxdt.cli import main

    failures = []
    for i, (damage, needle) in enumerate(DAMAGES):
        ckpt = shutil.copytree(reference / "checkpoints/step-5", tmp_path / f"step-5-{i}")
        damage(ckpt)
        run_dir = tmp_path / f"r{i}"
        code = main(["train", *COMMON, f"exp_manager.resume_from_checkpoint={ckpt}", f"exp_manager.explicit_log_dir={run_dir}"])
        err = capsys.readouterr().err.strip()
        if code != 2 or needle not in err or len(err.splitlines()) != 1 or "exp_manager.resume_from_checkpoint" not in err:
            failures.append(f"{needle}: exit {code}, stderr {err!r}")
        if run_dir.exists():  # no run directory, no worker
            failures.append(f"{needle}: {run_dir} was created")
    assert not failures, "\n".join(failures)


def test_resume_from_a_named_checkpoint_continues_exactly(tmp_path, reference):
    ckpt = _checkpoint_copy(reference, tmp_path)
    run = tmp_path / "run"
    assert_ok(
        nxdt("train", *COMMON, f"exp_manager.resume_from_checkpoint={ckpt}", f"exp_manager.explicit_log_dir={run}", cwd=tmp_path)
    )
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(6, 13)) and all(got[s] == want[s] for s in got)


def test_checkpoint_inspect(reference, capsys):
    from nxdt.cli import main

    assert main(["checkpoint", "inspect", str(reference / "checkpoints/step-10")]) == 0
    out = capsys.readouterr().out
    assert "step 10" in out and "model.embed_tokens.weight" in out and "parameters" in out


# ----------------------------------------------------------------------------- the NaN drill (exp_manager.nan_policy)
def _all_finite(checkpoint: Path) -> bool:
    return all(torch.isfinite(t).all() for f in checkpoint.glob("model*.safetensors") for t in load_file(f).values())


@pytest.mark.timeout(240)
def test_a_nan_loss_stops_the_run_with_one_line_and_the_checkpoints_stay_finite(tmp_path):
    run = tmp_path / "run"
    result = nxdt(
        "train",
        *COMMON,
        "exp_manager.fault_injection.step=7",
        "exp_manager.fault_injection.rank=1",
        "exp_manager.fault_injection.kind=nan",
        f"exp_manager.explicit_log_dir={run}",
        cwd=tmp_path,
    )
    assert result.returncode == 1
    headline = result.stderr.strip().splitlines()[-1]
    assert "non-finite loss nan at step 7 (from rank 1; exp_manager.nan_policy=stop)" in headline, headline
    assert sorted(losses(run)) == list(range(1, 7))  # nothing logged for the NaN step
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert kept == ["step-5"] and _all_finite(run / "checkpoints" / "step-5")


@pytest.mark.timeout(240)
def test_skip_step_drops_the_nan_update_and_the_run_finishes(tmp_path, reference):
    run = tmp_path / "run"
    result = nxdt(
        "train",
        *COMMON,
        "exp_manager.nan_policy=skip_step",
        "exp_manager.fault_injection.step=7",
        "exp_manager.fault_injection.rank=1",
        "exp_manager.fault_injection.kind=nan",
        f"exp_manager.explicit_log_dir={run}",
        cwd=tmp_path,
    )
    assert_ok(result)
    assert "step 7: loss nan (from rank 1) — update skipped" in result.stdout + result.stderr
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(1, 13))  # 12 updates made: the skipped batch did not count as a step
    assert all(got[s] == want[s] for s in range(1, 7))  # identical until the skipped batch
    assert got[7] != want[7]  # step 7 trains on the batch after the skipped one
    assert all(_all_finite(p) for p in (run / "checkpoints").glob("step-*"))


@pytest.mark.timeout(240)
def test_a_diverging_run_stops_at_the_first_non_finite_gradient(tmp_path):
    """The case from the hardening issue: lr=30 goes NaN within a few steps; it used to exit 0 with only NaN
    checkpoints left."""
    run = tmp_path / "run"
    result = nxdt(
        "train",
        *TINY,
        "data=synthetic",
        "trainer.max_steps=20",
        "model.optim.lr=30",
        "exp_manager.checkpoint_every_n_steps=2",
        f"exp_manager.explicit_log_dir={run}",
        cwd=tmp_path,
    )
    assert result.returncode == 1 and "non-finite" in result.stderr.strip().splitlines()[-1]
    kept = list((run / "checkpoints").glob("step-*"))
    assert kept and all(_all_finite(p) for p in kept)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["hang", "sigstop"])
def test_a_stuck_rank_is_named_and_the_job_ends_without_the_agents_kill_grace(tmp_path, kind):
    """Rank 1 stops responding: rank 0 times out at comm.timeout_s and the headline names rank 1. The agent would
    wait 30 s before SIGKILL for a worker that ignores its SIGTERM: a hung rank dies on the SIGTERM at once (without
    nxdt's handler Lightning only notes it), a SIGSTOPped one cannot run any handler and is killed by rank 0."""
    run = tmp_path / "run"
    result = nxdt(
        "train",
        *COMMON,
        "comm.timeout_s=5",
        "exp_manager.fault_injection.step=3",
        "exp_manager.fault_injection.rank=1",
        f"exp_manager.fault_injection.kind={kind}",
        f"exp_manager.explicit_log_dir={run}",
        cwd=tmp_path,
    )
    ended = time.time()
    assert result.returncode == 1
    headline = [line for line in result.stderr.splitlines() if line.startswith("nxdt: rank ")][-1]
    assert headline.startswith("nxdt: rank 1 failed: stopped responding (rank 0: CommTimeoutError") and "rank1.log" in headline
    assert "timed out after 5s" in headline and "rank(s) [1]" in headline
    launcher_log = run / "logs" / "launcher.log"  # torch's agent records, if it logged any
    launcher = launcher_log.read_text() if launcher_log.exists() else ""
    assert "Unable to shutdown process" not in launcher, launcher[-2000:]  # the agent never had to wait out its grace
    if kind == "hang":
        assert "via signal SIGTERM" in launcher and "SIGKILL" not in launcher, launcher[-2000:]
    else:
        assert (
            "rank 1 (pid " in (run / "logs" / "rank0.log").read_text()
            and "killed it (SIGKILL)" in (run / "logs" / "rank0.log").read_text()
        )
    # a loose bound on top of the mechanism: the agent's grace alone would end the job ≥ 30 s after the timeout
    injected = float(re.search(r"fault injection: .* \(t=([0-9.]+)\)", (run / "logs" / "rank1.log").read_text()).group(1))
    assert ended - injected < 5 + 20, ended - injected


@pytest.mark.timeout(240)
def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_survives(tmp_path):
    """checkpoints/ is a 14 MB tmpfs: llama_tiny's checkpoint at DP=2 (9.6 MB) fits once, the second runs out of space."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=14m,mode=0700", "tmpfs", str(checkpoints)], capture_output=True, text=True
        )
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        result = nxdt(
            "train",
            *TINY,
            "data=synthetic",
            "trainer.max_steps=4",
            "exp_manager.checkpoint_every_n_steps=2",
            "data.global_batch_size=4",
            "data.micro_batch_size=2",
            f"exp_manager.explicit_log_dir={checkpoints.parent}",
            cwd=tmp_path,
        )
        assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
        headline = [line for line in result.stderr.splitlines() if line.startswith("nxdt: rank ")]
        assert (
            len(headline) == 1 and f"could not write checkpoint {checkpoints / 'step-4'}: No space left on device" in headline[0]
        )
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-2"]  # no temporary directory left behind
        assert (checkpoints / "latest").read_text().strip() == "step-2"
        verify_checkpoint(checkpoints / "step-2")  # every file's checksum
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], capture_output=True)
