"""One writer per run directory, and a resumed run continues the same model on the same data: both refused
in one line (exit 2) before any worker starts. The CLI runs in-process (as in test_bad_input_matrix.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdt.cli import main
from nxdt.launch.rundir import lock_run_dir


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _stale_segment() -> Path:
    """A shared-memory segment as a SIGKILLed run leaves it: nxdt's header, a creator that no longer exists."""
    import subprocess
    import sys
    import uuid

    import numpy as np

    from nxdt.comm.shm import MAGIC, PREFIX, SHM_DIR

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = Path(SHM_DIR) / f"{PREFIX}stale-{uuid.uuid4().hex[:8]}"
    path.write_bytes(np.array([MAGIC, int(gone.stdout)], dtype=np.int64).tobytes() + bytes(4096))
    return path


def test_a_second_launcher_on_a_busy_run_directory_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    held = lock_run_dir(run)  # as a running nxdt train holds it
    stale = _stale_segment()
    try:
        assert main(["train", "data=synthetic", f"exp_manager.explicit_log_dir={run}"]) == 2
        assert not stale.exists()  # the next nxdt train removes what a killed run left, before anything else
        line = _one_line(capsys)
        assert f"run directory {run} is in use by another nxdt train" in line and "pid" in line
        assert not (run / "config.yaml").exists() and not (run / "logs").exists()
    finally:
        held.close()
    again = lock_run_dir(run)  # released with its holder: no stale lock
    again.close()


@pytest.mark.parametrize(
    "change, key",
    [
        ("model=gpt_tiny", "model.architecture"),
        ("data=synthetic", "data.source"),
        ("model.num_layers=2", "model.num_layers"),
        ("data.seq_length=64", "data.seq_length"),
    ],
)
def test_resuming_a_run_with_another_model_or_data_is_refused_by_name(tmp_path, capsys, change, key):
    from nxdt.config import compose_config as compose
    from nxdt.launch.rundir import write_run_dir
    from nxdt.planner import plan

    run = tmp_path / "run"
    cfg = compose([f"exp_manager.explicit_log_dir={run}"])
    write_run_dir(run, cfg, plan(cfg))  # the run being resumed: default model (llama_tiny) on the sample text
    before = (run / "config.yaml").read_text()
    assert main(["train", change, f"exp_manager.explicit_log_dir={run}"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"config error: {key}=") and "the run being resumed" in line, line
    assert (run / "config.yaml").read_text() == before  # not overwritten


def test_an_exp_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "outputs"
    blocker.write_text("not a directory")
    assert main(["train", "data=synthetic", f"exp_manager.exp_dir={blocker}"]) == 2
    line = _one_line(capsys)
    assert "cannot create the run directory" in line and "exp_manager.exp_dir" in line, line
