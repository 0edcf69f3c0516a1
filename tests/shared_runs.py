"""Launches that several test modules inspect (session-scoped, registered in conftest.py).

Each ``nxdt train`` costs seconds of start-up (the fork server imports torch and Lightning) and the training itself is
a small part of that, so runs whose configuration several tests need are launched once:

* ``everyday_runs``: the default ``nxdt train`` (finished, with checkpoints), a run whose rank 1 raises (failed, ``-q``)
  and one stopped with SIGINT (interrupted), all under one exp_dir — for test_train_e2e.py (learning, the run
  directory, failure and Ctrl-C handling) and test_runs_report.py (the console, ``nxdt runs``, ``nxdt report``).
* ``reliability_reference``: 12 uninterrupted DP2 steps with checkpoints every 5 — the reference of
  test_reliability.py's restarts and resumes and of test_train_e2e.py's ``resume_if_exists``.
* ``attacked_restart``: the reference's 12 steps with rank 0 killed while asynchronously saving step 10 and one
  restart, its store written with pickled commands while it trains — for test_reliability.py (the kept step-5
  resumed from, bitwise), test_store_auth.py (no store to find) and test_security.py (nothing from the store is
  unpickled). One launch serves all three: the restart reads the keys planted for it, which a run without one
  never would.

What is timed or checked during or right after a launch (elapsed time, processes left behind, the sockets a
training run listens on: test_security.py) is measured here, at that moment, and asserted by the tests."""

from __future__ import annotations

import ipaddress
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import warm_cli

from nxdt.comm.waiting import pid_alive  # zombies count as gone
from test_train_e2e import TINY, assert_ok, nxdt

RELIABILITY = [
    *TINY,
    "data=synthetic",
    "trainer.max_steps=12",
    "exp_manager.checkpoint_every_n_steps=5",
    "exp_manager.keep_last_k=5",
    "data.global_batch_size=4",
    "data.micro_batch_size=2",
]
DEFAULT_STEPS = 30  # the default run: enough steps to learn clearly on the sample text (test_train_e2e)
# a checkpoint every 20 steps: step-20 on schedule, step-30 only by exp_manager.save_last (on by default)
DEFAULT_EVERY = 20
STOPPED_ARGS = [
    "name=stopped",
    "data=synthetic",
    "trainer.max_steps=100000",
    "exp_manager.checkpoint_every_n_steps=2",
    "exp_manager.keep_last_k=1",
]


NOBODY = 65534


def as_other_user(fn) -> int:
    """The exit code of ``fn()`` run in a child process that became another user (nobody)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the forked child)
        code = 3
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = fn()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def opens(path: Path) -> int:
    """0: opened ``path`` for reading and writing; 13: permission denied (EACCES)."""
    try:
        os.close(os.open(path, os.O_RDWR))
        return 0
    except PermissionError:
        return 13


def start_train(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``nxdt train ARGS`` as a fresh program (its own fork server), for what is done to it while it runs; ``env``:
    variables added to this process's environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "nxdt.cli", "train", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_train(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 200) -> subprocess.CompletedProcess:
    """``nxdt train ARGS`` as a fresh program, to its end (``start_train``'s environment)."""
    proc = start_train(args, cwd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_segments(tree: set[int]) -> list[Path]:
    """The run's shared-memory segments: their header names a creator in the run's process tree."""
    found = []
    for path in Path("/dev/shm").glob("nxdt-x*"):
        try:
            if np.frombuffer(path.read_bytes()[:16], dtype=np.int64)[1] in tree:
                found.append(path)
        except (OSError, IndexError):
            continue
    return found


def wait_training(pid: int, run: Path) -> tuple[set[int], list[Path]]:
    """(the process tree of the launcher ``pid``, the run's shared-memory segments) once the run has logged a step."""
    deadline = time.monotonic() + 150
    while True:
        assert time.monotonic() < deadline and pid_alive(pid), "the run did not start"
        tree = process_tree(pid)
        segments = run_segments(tree) if (run / "metrics.csv").exists() else []
        if segments:
            return tree, segments
        time.sleep(0.2)


class RunsCode:
    """Unpickling this runs ``touch MARKER``: what a forged payload on a socket or in a segment would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def processes_left(run_dir: Path) -> list[int]:
    """Pids still alive (after up to 10 s) among the workers the run started and the fork server they came from."""
    started = re.findall(
        r"started [0-9-]+ [0-9:.]+ \(pid (\d+), parent (\d+)\)",
        "".join(path.read_text() for path in (run_dir / "logs").glob("rank*.log")),
    )
    assert started, "no worker logged its start"
    pids = {int(pid) for pair in started for pid in pair}
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in pids if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def process_tree(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def listening_addresses(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket (IPv4 and IPv6) that one of ``pids`` holds."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as host-order 32-bit words
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            found.append((str(ipaddress.ip_address(packed)), int(hex_port, 16)))
    return found


@pytest.fixture(scope="session")
def everyday_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("everyday")
    default = nxdt(
        "train", f"trainer.max_steps={DEFAULT_STEPS}", f"exp_manager.checkpoint_every_n_steps={DEFAULT_EVERY}", cwd=root
    )
    start = time.monotonic()
    failing = nxdt(
        "train",
        "-q",
        "name=failing",
        "data=synthetic",
        "trainer.max_steps=20",
        "exp_manager.fault_injection.step=3",
        "exp_manager.fault_injection.rank=1",
        cwd=root,
    )
    failing_elapsed = time.monotonic() - start
    runs = {"llama_tiny": next(root.glob("outputs/llama_tiny/*")), "failing": next(root.glob("outputs/failing/*"))}
    failing_left = processes_left(runs["failing"])
    proc = start_train(STOPPED_ARGS, root)
    deadline = time.monotonic() + 120
    while not list(root.glob("outputs/stopped/*/checkpoints/step-*/done")):  # trained and saved: well under way
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    tree = process_tree(proc.pid)  # while it trains: the launcher, its fork server, the workers
    listening = listening_addresses(tree)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    stopped = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    runs["stopped"] = next(root.glob("outputs/stopped/*"))
    return {
        "root": root,
        "default": default,
        "failing": failing,
        "failing_elapsed": failing_elapsed,
        "failing_left": failing_left,
        "stopped": stopped,
        "stopped_left": processes_left(runs["stopped"]),
        "stopped_tree": tree,
        "stopped_listening": listening,
        "runs": runs,
    }


@pytest.fixture(scope="session")
def reliability_reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ref") / "run"
    assert_ok(nxdt("train", *RELIABILITY, f"exp_manager.explicit_log_dir={run}", cwd=run.parent))
    return run


@pytest.fixture(scope="session")
def attacked_restart(tmp_path_factory) -> dict:
    """Rank 0 killed in the middle of an asynchronous save of step 10 with one checkpoint kept (test_reliability.py),
    one restart (resuming from step-5), and meanwhile another process of this user — since issue 38 nobody else can
    reach the store, a private file — that knows the run id (the names in /dev/shm) writes a pickled ``touch MARKER``
    into every key nxdt and torch's agent read: the running attempt's (after their use) and the restart's (before it:
    its bootstrap, the resume choice, the agent's rank assignment and exit barrier). What is checked while it trains is measured here. A warm launch (tests/warm_cli.py): the agent,
    the store and the workers are the program's; a fresh program's fork server, which reads no store, is in the
    stopped run's process tree (``everyday_runs``: test_security.py) and in test_store_auth.py's SIGKILL test."""
    import torch.distributed as dist

    from nxdt.launch.rundir import STORE_FILE

    root = tmp_path_factory.mktemp("attacked")
    run, marker = root / "run", root / "pwned"
    args = [
        "train",
        *RELIABILITY,
        "exp_manager.keep_last_k=1",
        "exp_manager.save_last=false",  # step-12's final save would remove step-10, which test_reliability.py compares
        "exp_manager.async_checkpointing=true",
        "exp_manager.max_restarts=1",
        "exp_manager.fault_injection.step=10",
        "exp_manager.fault_injection.kind=sigkill_during_save",
        "exp_manager.fault_injection.rank=0",
        f"exp_manager.explicit_log_dir={run}",
    ]
    command = warm_cli.start(args, cwd=root)
    assert command.pid is not None
    try:
        tree, segments = wait_training(command.pid, run)
        listening = listening_addresses(tree)
        store = run / STORE_FILE
        modes = (store.stat().st_mode & 0o777, run.stat().st_mode & 0o777)
        other_user = None
        if os.geteuid() == 0:
            os.chmod(root, 0o755)  # the run directory's own mode is what keeps others out
            other_user = as_other_user(lambda: opens(store))
        run_id = segments[0].name[len("nxdt-") :].split(".")[0]
        payload = pickle.dumps(RunsCode(str(marker)))
        writer = dist.FileStore(str(store), -1)  # this user's own process writes in it
        keys = [f"nxdt/{run_id}/{attempt}/1/{k}" for attempt in (0, 1) for k in ("run_nonce", "host/0", "host/1", "left")]
        keys += [f"nxdt/resume/{run_id}/0", f"nxdt/resume/{run_id}/1", "MASTER_ADDR", "MASTER_PORT"]
        keys += [
            f"{run_id}/torchelastic/{k}"
            for k in ("role_info/0", "assigned_ranks/0", "agent/terminal_state/num_members", "agent/terminal_state/last_member")
        ]
        for key in keys:
            writer.set(key, payload)
        del writer
    except BaseException:
        os.killpg(command.pid, signal.SIGKILL)  # the launcher and its workers (its session)
        command.wait(60)
        raise
    return {
        "run": run,
        "marker": marker,
        "result": command.wait(240),
        "tree": tree,
        "listening": listening,
        "modes": modes,
        "other_user": other_user,
    }
