"""``nxdt`` command lines run as forks of one pre-imported process (per pytest worker), not as fresh interpreters.

Every ``python -m nxdt.cli train ...`` of the suite paid ~18 s of CPU before its first step: the launcher imports torch
(~2.5 s) and its fork server imports torch, torch._dynamo, Lightning and what Lightning pulls in (torchmetrics, and
through it transformers, scipy and matplotlib: ~10 s), of which training a few steps is ~2 s. This module starts one
process that imports all of that once and then forks a child per command line. The child is the ``nxdt`` program as
a subprocess would be, with the command's own working directory, environment, stdin (``/dev/null``), stdout and stderr
(passed over a Unix socket), in a session of its own (so a test may signal its process group); it runs
``nxdt.cli.main(args, fork_workers=True)`` and exits with its code: the child has nxdt's Lightning layer imported and
one thread, so the launcher forks its workers itself (``nxdt.launch.forking.start_method``) instead of starting a
fork server that would import everything again.

What a fresh interpreter does differently — the fork server, the program's first line before torch is imported, the
``nxdt`` entry point — keeps being tested by the tests that start real subprocesses (test_first_output.py,
test_readme_commands.py, test_reliability.py's signals, test_fresh_install.py, test_multinode.py).

``run(args, cwd=..., env=..., timeout=...)`` returns a ``subprocess.CompletedProcess`` as ``subprocess.run(...,
capture_output=True, text=True)`` would; a command that outlives ``timeout`` has its process group killed and raises
``subprocess.TimeoutExpired``. Nothing here is pickled: requests are JSON, and the socket is a private socketpair.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

_SERVER = r"""
import nxdt.gc_paused  # noqa: F401  (the collector paused for the imports below, as in nxdt's fork servers)
import json, os, signal, socket, sys
import nxdt.cli, nxdt.lightning.train  # noqa: F401  (the imports every launch would repeat)
try:
    import torch.utils.tensorboard  # noqa: F401  (rank 0's TensorBoard writer)
except ImportError:
    pass
import importlib
# What a launch imports after the program's own imports (the modules new in sys.modules after one `nxdt train`: its
# launcher, torch's elastic agent, the planner's estimate, the meta-device model check), so that no fork imports them
# again: ~0.4 CPU-s a launch
for name in ("nxdt.launch.local", "nxdt.launch.worker", "nxdt.launch.console", "nxdt.launch.runs", "nxdt.launch.rundir",
             "nxdt.launch.multinode", "nxdt.launch.rendezvous", "nxdt.models.llama", "nxdt.models.meta",
             "nxdt.planner.estimate", "nxdt.planner.calibration", "nxdt.config.resume_keys", "nxdt.config.trackers",
             "torch.distributed.launcher.api", "torch.distributed.elastic.agent.server.local_elastic_agent",
             "torch.distributed.elastic.multiprocessing.errors", "faulthandler", "_strptime", "encodings.idna"):
    importlib.import_module(name)
from nxdt.config import compose_config, schema_tree
# What the first compose of a process fills once (Hydra's ConfigStore schemas, the typed tree workers read their config
# onto) and the group choices of most of the suite's launches (test_train_e2e.TINY, with data=synthetic), each composed
# once (nxdt.config._composed_defaults): ~0.4 CPU-s that the nxdt program pays once and every fork here paid again
for choices in ([], ["model=llama_tiny"], ["model=llama_tiny", "data=synthetic"]):
    compose_config(choices, check=False)
schema_tree()
# Its commands and their workers are forks: their collections skip what this process holds (as nxdt's fork servers
# do, nxdt/launch/fork_server.py): a one-step launch 3.0 -> 1.6 CPU-s; then the collector resumes
import nxdt.comm.frozen  # noqa: F401


# End this forked process with call()'s exit code: the int it returns, SystemExit's int, else 1 (a traceback printed).
def exit_with(call):
    code = 1
    try:
        result = call()
        code = result if isinstance(result, int) else 1
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# `torchrun --nproc-per-node NPROC SCRIPT ARGS` without the agent: the variables its agent gives each worker (rank 0
# hosts the store), one compute thread per rank (torchrun's OMP_NUM_THREADS=1), the script run as __main__ with its
# folder first on sys.path. Any rank failing stops the others, as torchrun does.
def run_ranks(script, args, nproc):
    import runpy, time
    import torch
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
              "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": f"warm-{os.getpid()}", "TORCHELASTIC_USE_AGENT_STORE": "False",
              "OMP_NUM_THREADS": "1"}
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update(common, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            torch.set_num_threads(1)
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))


            def as_main() -> int:
                runpy.run_path(script, run_name="__main__")
                return 0

            exit_with(as_main)
        pids.append(pid)
    code = 0
    while pids:
        pid, status = os.wait()
        pids.remove(pid)
        status = os.waitstatus_to_exitcode(status)
        if status != 0 and code == 0:
            code = status if status > 0 else 1
            for other in pids:
                os.kill(other, signal.SIGTERM)
    return code


sock = socket.socket(fileno=int(sys.argv[1]))
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
while True:
    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    if not msg:
        os._exit(0)
    request = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        sock.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # what a fresh interpreter would put on sys.path from PYTHONPATH (a test's own reward-function module)
        sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.argv = ["nxdt", *request["args"]]
        if "script" in request:
            exit_with(lambda: run_ranks(request["script"], request["args"], request["nproc"]))
        exit_with(lambda: nxdt.cli.main(request["args"], fork_workers=True))
    for fd in fds:
        os.close(fd)
    sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status, usage = os.wait4(pid, 0)  # the command's CPU, its reaped workers' included
    cpu = usage.ru_utime + usage.ru_stime
    sock.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status), "cpu_s": cpu}).encode() + b"\n")
"""


class _Server:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # OpenMP threads that wait passively (sleep at the end of a parallel region instead of spinning ~300k
        # iterations): libgomp reads this once, when torch loads it, so it is set for the process that imports torch
        # and every fork inherits it. A one-rank launch computes on cores // 1 = 2 threads while the suite's other
        # xdist worker computes on the same 2 cores; the spinning thread then burnt the core the others needed: the
        # 6-step one-rank llama_tiny run of test_model_parallel_e2e took 26.3 CPU-s (82 s) spinning, 3.4 CPU-s (10 s)
        # passive, on the loaded 2-core host. Thread counts and so the numbers are unchanged.
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.pending = b""
        self.lock = threading.Lock()
        self.cpu_s = 0.0  # CPU seconds of the commands run so far (for profiling the suite's cost per test)
        atexit.register(self.close)

    def close(self) -> None:
        """The server exits when its socket closes; reaping it leaves no orphan (and counts its CPU to this process)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def abandon(self, pid: int | None) -> None:
        """Kill the command ``pid`` (its session: its workers too) and the server, whose reply stream is out of step."""
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.close()

    def reply(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The server's next JSON line, or None if none came within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            data = self.sock.recv(1 << 16)
            if not data:
                raise RuntimeError("tests/warm_cli.py: the pre-imported process died")
            self.pending += data
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, args: Sequence[str], cwd: Path, env: Mapping[str, str], script: dict | None = None) -> "Command":
        """Send one command; it runs while the caller acts on it (its ``pid``). The server is this command's until
        ``Command.wait`` returns: it holds ``self.lock`` (replies come in order, one command at a time)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        command = Command(self, ["nxdt", *args], out_r, err_r)
        self.lock.acquire()
        try:
            try:
                request = {"args": list(args), "cwd": str(cwd), "env": dict(env), **(script or {})}
                socket.send_fds(self.sock, [json.dumps(request).encode()], [out_w, err_w])
            finally:
                os.close(out_w)
                os.close(err_w)
            command.pid = self.reply()["pid"]  # type: ignore[index]
        except BaseException:
            self.abandon(command.pid)
            self.lock.release()
            raise
        return command

    def run(
        self, args: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float, script: dict | None = None
    ) -> subprocess.CompletedProcess:
        return self.start(args, cwd, env, script).wait(timeout)


class Command:
    """A command running in a fork of the pre-imported process (``start``): ``pid`` is the ``nxdt`` program's (its
    session leader: its workers are forked from it), ``wait`` its ``subprocess.CompletedProcess``."""

    def __init__(self, server: _Server, args: list[str], out_r: int, err_r: int) -> None:
        self.server, self.args = server, args
        self.pid: int | None = None
        self.fds = (out_r, err_r)
        self.chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        self.readers = [threading.Thread(target=self._drain, args=(fd,), daemon=True) for fd in self.fds]
        for t in self.readers:
            t.start()

    def _drain(self, fd: int) -> None:
        with os.fdopen(fd, "rb", closefd=True) as fh:
            while data := fh.read1(1 << 16):
                self.chunks[fd].append(data)

    def _output(self) -> tuple[str, str]:
        out, err = (b"".join(self.chunks[fd]).decode(errors="replace") for fd in self.fds)
        return out, err

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        server = self.server
        try:
            try:
                done = server.reply(timeout)
            except BaseException:
                # interrupted between request and reply (pytest-timeout's Failed, Ctrl-C): the server's replies for
                # this command would be read as the next command's (a later launch "exited 2", the status of a
                # timed-out refusal: 14 tests of one worker under load), so the command and the server go; the
                # next run() starts a fresh server
                server.abandon(self.pid)
                raise
            if done is None:
                assert self.pid is not None
                try:
                    os.killpg(self.pid, signal.SIGKILL)  # the command and every worker it forked (its session)
                except ProcessLookupError:
                    pass
                server.reply()  # the server has reaped it
                for t in self.readers:
                    t.join(timeout=10)
                raise subprocess.TimeoutExpired(self.args, timeout, *(o.encode() for o in self._output()))
            status = done["status"]
            server.cpu_s += done.get("cpu_s", 0.0)
        finally:
            server.lock.release()
        for t in self.readers:
            t.join()  # until the last worker that held the command's stdout has gone
        out, err = self._output()
        return subprocess.CompletedProcess(self.args, status, out, err)


_server: list[_Server] = []  # one per pytest worker process, started on first use


def cpu_seconds() -> float:
    """CPU seconds spent by the commands this pytest process ran through the pre-imported process so far."""
    return _server[0].cpu_s if _server else 0.0


def run(
    args: Sequence[str], *, cwd: Path | str | None = None, env: Mapping[str, str] | None = None, timeout: float = 200
) -> subprocess.CompletedProcess:
    """``nxdt ARGS`` as a fork of the pre-imported process (see the module docstring)."""
    if not _server or not _server[0].alive():
        _server[:] = [_Server()]
    environment: dict[str, Any] = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else dict(env)
    return _server[0].run(args, Path.cwd() if cwd is None else Path(cwd), environment, timeout)


def start(args: Sequence[str], *, cwd: Path | str | None = None, env: Mapping[str, str] | None = None) -> Command:
    """``nxdt ARGS`` started as ``run`` would, returned while it runs (``.pid``, ``.wait(timeout)``): for what a test
    does to a run while it trains (signals, its store). No other command runs in this process until it is waited."""
    if not _server or not _server[0].alive():
        _server[:] = [_Server()]
    environment: dict[str, Any] = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else dict(env)
    return _server[0].start(args, Path.cwd() if cwd is None else Path(cwd), environment)


def torchrun(
    script: Path | str,
    args: Sequence[str],
    *,
    nproc: int = 2,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 200,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC SCRIPT ARGS`` for the suite's Lightning scripts: each rank a fork
    of the pre-imported process with the variables torchrun's agent sets (rank 0 hosts the store instead of the
    agent). The scripts compare strategies inside one launch, so what they check does not depend on the launcher;
    a user's ``torchrun``/``python train.py`` stays tested by test_lightning_api.py and test_lightning_conformance_dist.py."""
    if not _server or not _server[0].alive():
        _server[:] = [_Server()]
    environment: dict[str, Any] = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else dict(env)
    request = {"script": str(script), "nproc": nproc}
    return _server[0].run(list(args), Path.cwd() if cwd is None else Path(cwd), environment, timeout, request)
