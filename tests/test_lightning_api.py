"""The README's Lightning API example, run as a user runs it (under torchrun; ``python train.py``'s launch:
tests/test_lightning_conformance_dist.py) — the file is taken from the README so the documentation cannot rot."""

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


# what a launcher (Lightning's own, torchrun, an earlier in-process fit) leaves in a process's environment
LAUNCH_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def shell_environment(**extra: str) -> dict[str, str]:
    """The environment of a shell a user types ``python train.py`` into: no launcher's rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_lightning_example_trains_with_two_workers_under_torchrun(tmp_path):
    """The README's file, run as its second sentence says (``torchrun --nproc-per-node 2 train.py``: torch's agent
    hosts the store and starts both workers): it learns, on 2 workers, each reading half the data. Its first sentence's
    launch (``python train.py``: Lightning's launcher starts the second worker from the script) is how
    tests/test_lightning_conformance_dist.py starts its script; that file runs it (each start costs two fresh
    interpreters importing Lightning, ~10 CPU-s apiece here)."""
    script = tmp_path / "train.py"
    script.write_text(readme_example("lightning-api"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=170, env=shell_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(
        r"final loss ([0-9.]+) on (\d+) workers; first epoch: (\d+) samples on this worker, (\d+) in all", result.stdout
    )
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) < 1.0  # y = x·[1..8] has variance 204: only a run that learnt gets near 0
    assert match.group(2) == "2"
    assert (match.group(3), match.group(4)) == ("256", "512")  # the data was split, not seen twice


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


def test_a_rank_lightning_never_started_is_named_not_waited_for_silently(monkeypatch):
    """LOCAL_RANK left in the environment (by an outer launcher, or an earlier in-process fit: Lightning's
    launcher writes it into os.environ) makes Lightning start no other ranks; rank 0 then waits for rank 1 —
    the error names it and the variable, instead of a bare store timeout."""
    from nxdt.comm import CommTimeoutError
    from nxdt.lightning import environment

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(CommTimeoutError) as failure:
        environment.join_world(0, 2, "127.0.0.1", port_outside_the_ephemeral_range(), timeout_s=1.0)
    message = str(failure.value)
    assert "rank(s) [1] never joined the run (2 ranks at 127.0.0.1:" in message
    assert "LOCAL_RANK=0 is set in this process's environment" in message and "\n" not in message


def test_a_joining_rank_whose_wait_ends_as_the_store_closes_says_so_in_one_line():
    """A race seen under load (two nodes started, one never came): this rank's wait ran out just as the rank serving
    the store gave up and closed it, so asking which ranks were missing reset its connection. It says the store's
    server stopped (that rank's own error names the absent ones), not "DistNetworkError: Connection reset by peer"."""
    import torch.distributed as dist

    from nxdt.comm import CommError, CommTimeoutError
    from nxdt.comm.world import _joined

    class ClosingStore:
        def check(self, keys):
            raise dist.DistNetworkError("Connection reset by peer")

    class Keys:
        store = ClosingStore()

        def get(self, name):
            raise CommTimeoutError("wait timeout after 1000ms, keys: host/1")

    with pytest.raises(CommError, match=r"the rank serving the rendezvous store stopped while this rank was joining"):
        _joined(Keys(), ["host/1"], [1], "2 ranks at 127.0.0.1:29500")
