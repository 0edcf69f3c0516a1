"""The README's Lightning API example, run as a user runs it: ``python train.py`` (the strategy starts
its own second worker) — the file is taken from the README so the documentation cannot rot."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_example(tag: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- example: {tag} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"README.md has no example tagged {tag}"
    return match.group(1)


def port_outside_the_ephemeral_range() -> int:
    """A free TCP port below the kernel's ephemeral range. Lightning picks MASTER_PORT by binding port 0 and releasing
    it, so a test running beside this one (pytest-xdist) can be handed the same ephemeral port before rank 0 binds it
    again; a port the kernel never hands out for port 0 cannot be taken that way."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in range(low - 1, 1024, -1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_lightning_example_trains_with_two_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_example("lightning-api"))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port_outside_the_ephemeral_range())},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(
        r"final loss ([0-9.]+) on (\d+) workers; first epoch: (\d+) samples on this worker, (\d+) in all", result.stdout
    )
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) < 1.0  # y = x·[1..8] has variance 204: only a run that learnt gets near 0
    assert match.group(2) == "2"
    assert (match.group(3), match.group(4)) == ("256", "512")  # the data was split, not seen twice


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_lightning_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_example("lightning-api"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=170, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"final loss [0-9.]+ on 2 workers", result.stdout), result.stdout[-2000:]


@pytest.mark.timeout(120)
def test_readme_collectives_example(tmp_path):
    script = tmp_path / "comm_example.py"
    script.write_text(readme_example("comm"))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[6.0, 6.0, 6.0, 6.0]"


def test_strategy_is_registered_by_name():
    import lightning.pytorch as pl

    from nxdt.lightning import NxDStrategy

    trainer = pl.Trainer(strategy="nxdt", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, NxDStrategy) and trainer.strategy.num_processes == 2
