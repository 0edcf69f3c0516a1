"""Separate hosts on one machine for tests: network namespaces joined by a veth pair, and a real Slurm
(slurmctld + one slurmd per namespace) on top of them.

Each namespace has its own network stack, so nxdt sees a different host identity in each (no shared
memory between them) and every byte between them crosses a real TCP connection. Everything made here
is removed at teardown, also when a test fails: the processes we started (with their process groups),
anything still running inside the namespaces, the namespaces (which takes the veth pair with them) and
the temporary files.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

NXDT = [sys.executable, "-m", "nxdt.cli"]


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)


class Hosts:
    """``count`` network namespaces on one subnet (a veth pair for two): host i has address ``addr[i]``."""

    def __init__(self, tag: str) -> None:
        self.names = [f"nxdt{tag}a", f"nxdt{tag}b"]
        self.addr = ["10.231.0.1", "10.231.0.2"]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def setup(self) -> None:
        veth = [f"nx{self.names[0][4:-1]}a", f"nx{self.names[1][4:-1]}b"]
        steps = [
            ["ip", "netns", "add", self.names[0]],
            ["ip", "netns", "add", self.names[1]],
            ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
        ]
        for i in range(2):
            steps += [
                ["ip", "link", "set", veth[i], "netns", self.names[i]],
                ["ip", "-n", self.names[i], "addr", "add", f"{self.addr[i]}/24", "dev", veth[i]],
                ["ip", "-n", self.names[i], "link", "set", "lo", "up"],
                ["ip", "-n", self.names[i], "link", "set", veth[i], "up"],
            ]
        for step in steps:
            result = _run(*step)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(step)}: {result.stderr.strip()}")
            if step[1] == "netns":
                self._made.append(step[3])

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``host`` (``ip netns exec`` execs it: the pid is the program's own)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
            **kwargs,
        )
        self.procs.append(proc)
        return proc

    def nxdt(self, host: int, args: list[str], **kwargs) -> subprocess.Popen:
        return self.popen(host, [*NXDT, *args], **kwargs)

    def pids(self, host: int) -> list[int]:
        out = _run("ip", "netns", "pids", self.names[host]).stdout
        return [int(p) for p in out.split()]

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.communicate(timeout=10)
            except Exception:
                pass
        self.procs.clear()
        for host in range(len(self._made)):  # whatever still runs inside our namespaces is ours
            for pid in self.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def teardown(self) -> None:
        self.stop_all()
        for name in self._made:
            _run("ip", "netns", "del", name)


def make_hosts() -> Hosts:
    if os.geteuid() != 0:
        pytest.skip("two hosts on one machine need root (ip netns + veth); run the tests as root to include them")
    if shutil.which("ip") is None:
        pytest.skip("two hosts on one machine need iproute2's `ip` (apt-get install iproute2)")
    hosts = Hosts(str(os.getpid() % 100000))
    try:
        hosts.setup()
    except RuntimeError as exc:
        hosts.teardown()
        pytest.skip(f"network namespaces are not allowed here ({exc})")
    return hosts


SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "sinfo", "munged", "mungekey", "nsenter")


def slurm_installed() -> bool:
    return all(shutil.which(t) for t in SLURM_TOOLS)


class Slurm:
    """slurmctld and slurmd n0 on host 0, slurmd n1 on host 1, authenticated by a private munged."""

    def __init__(self, hosts: Hosts, root: Path) -> None:
        self.hosts, self.root = hosts, root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {"SLURM_CONF": str(self.conf)}

    def _start(self, argv: list[str], log: str, host: int | None = None) -> None:
        # nsenter switches only the network namespace: slurmd needs the machine's cgroup mounts,
        # which `ip netns exec` hides by remounting /sys
        prefix = ["nsenter", f"--net=/run/netns/{self.hosts.names[host]}"] if host is not None else []
        with open(self.root / "log" / log, "w") as out:
            self.procs.append(subprocess.Popen(prefix + argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    def start(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool/n0", "spool/n1", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        subprocess.run(["mungekey", "-c", "-k", str(r / "munge/munge.key")], check=True, capture_output=True, timeout=30)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=nxdttest",
                    f"SlurmctldHost={socket.gethostname()}({self.hosts.addr[0]})",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={r}/munge/sock",
                    "CredType=cred/munge",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool/%n",
                    f"SlurmctldPidFile={r}/slurmctld.pid",
                    f"SlurmdPidFile={r}/slurmd.%n.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd.%n.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/builtin",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SlurmdParameters=config_overrides",
                    "InactiveLimit=0",
                    "KillWait=5",
                    "MinJobAge=4",  # sbatch --wait then polls every 2 s (it backs off to 32 s when records live long)
                    f"NodeName=n0 NodeAddr={self.hosts.addr[0]} CPUs=2 State=UNKNOWN",
                    f"NodeName=n1 NodeAddr={self.hosts.addr[1]} CPUs=2 State=UNKNOWN",
                    "PartitionName=debug Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self._start(
            [
                "munged",
                "-F",
                "-f",
                f"--socket={r}/munge/sock",
                f"--key-file={r}/munge/munge.key",
                f"--pid-file={r}/munge/pid",
                f"--log-file={r}/log/munged.log",
                f"--seed-file={r}/munge/seed",
            ],
            "munged.out",
        )
        self._start(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld.out", host=0)
        self._start(["slurmd", "-D", "-N", "n0", "-f", str(self.conf)], "slurmd-n0.out", host=0)
        self._start(["slurmd", "-D", "-N", "n1", "-f", str(self.conf)], "slurmd-n1.out", host=1)
        deadline = time.monotonic() + 60
        states = ""
        while time.monotonic() < deadline:
            states = self.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
            if states.count("idle") == 2:
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.3)
        logs = {p.name: p.read_text()[-500:] for p in (r / "log").iterdir()}
        raise RuntimeError(f"Slurm did not come up (sinfo: {states!r}); logs: {logs}")

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command on host 0 (where slurmctld listens)."""
        return subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.hosts.names[0]}", *argv],
            capture_output=True,
            text=True,
            env={**os.environ, **self.env},
            timeout=kwargs.pop("timeout", 30),
            **kwargs,
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(timeout=10)
        self.procs.clear()
