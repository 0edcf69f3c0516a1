"""Local launch: this host's workers under torch's elastic agent (the machinery behind torchrun).

The agent opens the rendezvous store (``nxdt-local``: a private file in the run directory, no socket, see
``nxdt.launch.rendezvous``), starts one worker per rank, watches them, and stops all of them when one
fails or on Ctrl-C. We turn its outcome into one line naming the failed rank, its
error and its log file, and remove the run's shared-memory segments whatever happened.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from nxdt.planner import Plan


# Seconds the agent gives the workers, after passing on a Ctrl-C or SIGTERM the launcher received, before it
# kills them (torch's default is 30). Checkpoints are atomic, so cutting a save short loses nothing committed.
# (Workers stopped because a peer failed end at once on the agent's SIGTERM: worker.die_on_sigterm.)
SHUTDOWN_GRACE_S = 5


def shutdown_grace() -> dict[str, int]:
    """LaunchConfig's ``shutdown_timeout=SHUTDOWN_GRACE_S`` where this torch's LaunchConfig takes it (2.13 does; the
    GPU image's 2.11 does not, and keeps torch's own 30 s)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    return {"shutdown_timeout": SHUTDOWN_GRACE_S} if "shutdown_timeout" in names else {}


class LaunchFailed(RuntimeError):
    """A worker failed; ``str()`` is the one line shown to the user."""


class LaunchInterrupted(RuntimeError):
    """Ctrl-C or SIGTERM reached the launcher; the agent has stopped every worker."""


def _summary(message: Any, exitcode: int) -> str:
    """The last unindented line of a recorded error ("ExceptionType: message"), else the exit code."""
    if isinstance(message, dict):
        message = message.get("message", message)
    text = [line for line in str(message).strip().splitlines() if line.strip() and not line.startswith(" ")]
    summary = text[-1] if text else ""
    return f"exit code {exitcode}" if not summary or summary.startswith("<N/A>") else summary


class _Record(NamedTuple):
    when: float  # error file's write time; -inf: died by a signal (first), inf: stopped by the agent
    pid: int | None
    summary: str
    recorded: bool  # the worker wrote an error of its own (an exception), not only an exit status


# ranks an error names as its cause: nxdt.comm's PeerDiedError ("rank 1 (pid 42) exited ...", "lost the connection to
# rank(s) [2] ...") and CommTimeoutError ("... waiting for ... rank(s) [1, 3] ...")
_CONSEQUENCE = ("PeerDiedError:", "CommTimeoutError:")
_NAMED_RANKS = re.compile(r"rank\(s\) \[([0-9, ]*)\]|rank (\d+) \(pid \d+\)")


def blamed_ranks(summary: str) -> list[int]:
    """The ranks a failure was waiting for when it failed, if it is the consequence of theirs (else [])."""
    if not summary.startswith(_CONSEQUENCE):
        return []
    match = _NAMED_RANKS.search(summary)
    if match is None:
        return []
    return [int(r) for r in match.group(1).split(",") if r.strip()] if match.group(1) is not None else [int(match.group(2))]


def _records(exc: Any, agent_logs: Path | None = None) -> dict[int, _Record]:
    """Every worker's failure: those the agent reported and every error file beside theirs. The agent may report
    whichever exit it saw first (only that one, for forked workers). A worker killed by a signal writes no file:
    it counts as first (it died before anyone could notice), unless the signal was SIGTERM, the agent's way of
    stopping the others. Such a failure names no error file (torch's "<N/A>"), so when the agent reported only
    it, the attempt's directory is the newest one under ``agent_logs`` (the launch's ``DefaultLogsSpecs`` log dir):
    a rank SIGKILLed by its peer after that peer's timeout was blamed on the signal, not on the timeout."""
    found: dict[int, _Record] = {}
    attempts = set()
    for rank, failure in exc.failures.items():
        recorded = os.path.isfile(failure.error_file)
        when = float("inf") if recorded or failure.exitcode == -signal.SIGTERM else float("-inf")
        found[rank] = _Record(when, failure.pid, _summary(failure.message, failure.exitcode), False)
        if os.path.isabs(failure.error_file):
            attempts.add(Path(failure.error_file).parent.parent)  # <attempt>/<local rank>/error.json
    if not attempts and agent_logs is not None:
        newest = max(agent_logs.glob("*/attempt_*"), key=lambda p: p.stat().st_mtime_ns, default=None)
        if newest is not None:
            attempts.add(newest)
    for path in sorted(p for attempt in attempts for p in attempt.glob("*/error.json")):
        other = int(path.parent.name)
        try:
            written, message = path.stat().st_mtime_ns / 1e9, json.loads(path.read_text())["message"]
        except (OSError, ValueError, KeyError):
            continue
        if other in found and found[other].when == float("-inf"):
            continue
        pid = found[other].pid if other in found else None
        found[other] = _Record(written, pid, _summary(message, 1), True)
    return found


def root_failure(exc: Any, *, single_host: bool, agent_logs: Path | None = None) -> tuple[int, int | None, str]:
    """(local rank, pid if known, one-line summary) of the failure that brought the job down.

    One failure brings down the rest: peers waiting for a dead rank raise ``PeerDiedError``, peers waiting for a
    stuck one ``CommTimeoutError`` at ``comm.timeout_s``, and the agent stops the others (SIGTERM), each
    recording an error of its own, often within the same clock tick. So the earliest failure is only the
    starting point: while it names the rank(s) it was waiting for, the blame moves to them (a rank's error is
    written before it exits, its peers notice only after, but file times are as coarse as the kernel's tick).
    A rank blamed by a timeout that recorded no error of its own stopped responding: the headline says so and
    quotes the rank that noticed. ``single_host``: every rank of the job runs on this host, so the ranks messages
    name are the local ranks of the error files; otherwise the blame is not followed (they may be on other nodes)."""
    found = _records(exc, agent_logs)
    rank, witness = _originating_rank(found, single_host)
    own = found.get(rank)
    if own is not None and own.recorded:
        return rank, own.pid, own.summary
    pid = own.pid if own is not None else None
    if witness is not None and found[witness].summary.startswith("CommTimeoutError:"):
        return rank, pid, f"stopped responding (rank {witness}: {found[witness].summary})"
    if own is not None and own.when == float("-inf"):  # died by a signal, which the waiting peers only noticed
        return rank, pid, own.summary
    if witness is not None:
        return rank, pid, f"exited without recording an error (rank {witness}: {found[witness].summary})"
    return rank, pid, own.summary if own is not None else "exited without recording an error"


def _originating_rank(found: dict[int, _Record], single_host: bool) -> tuple[int, int | None]:
    """(the rank where the failure began, the rank whose error names it as the one it waited for, if any)."""
    first = min(found, key=lambda r: (found[r].when, r))
    if not single_host:
        return first, None
    rank, witness, seen = first, None, {first}
    while rank in found:
        suspects = [b for b in blamed_ranks(found[rank].summary) if b not in seen]
        if not suspects:
            break
        witness, rank = rank, min(suspects, key=lambda b: (found[b].when if b in found else float("inf"), b))
        seen.add(rank)
    if rank in found and found[rank].recorded and blamed_ranks(found[rank].summary) and rank != first:
        return first, None  # a cycle of ranks waiting for each other (mismatched calls): the earliest failure
    if witness is None:  # nobody's wait led here: does a later error name this rank?
        witness = next((r for r in sorted(found, key=lambda r: found[r].when) if rank in blamed_ranks(found[r].summary)), None)
    return rank, witness


def _failure_line(exc: Any, run_dir: Path) -> str:
    rank, _, summary = root_failure(exc, single_host=True, agent_logs=run_dir / "logs" / "agent")
    return f"nxdt: rank {rank} failed: {summary} — see {run_dir / 'logs' / f'rank{rank}.log'}"


def launch_local(run_dir: Path, plan: Plan, *, console_tty: bool, max_restarts: int = 0, fork_workers: bool = False) -> None:
    """Run the plan's ranks on this host; with ``max_restarts`` the agent restarts every worker after a
    failure and the workers resume from the newest complete checkpoint. ``fork_workers``: fork them from this
    process if it can (:func:`nxdt.launch.forking.start_method`)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from nxdt.comm import cleanup_run
    from nxdt.comm.store import StoreAccessError, check_store_dir, new_secret
    from nxdt.config import schema_tree
    from nxdt.launch import rendezvous, worker
    from nxdt.launch.forking import ForkServerError, start_fork_server, start_method
    from nxdt.launch.rundir import STORE_FILE, STORE_SECRET_FILE, write_store_secret

    # the agent logs every worker exit at WARNING/ERROR; we report the failure ourselves in one line
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    run_id = f"x{uuid.uuid4().hex[:12]}"
    method = start_method(fork_workers)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=plan.ranks_per_node,
        run_id=run_id,
        rdzv_backend=rendezvous.BACKEND,
        rdzv_endpoint="",  # one store, a private file of the run directory: nothing listens, no pickled state
        rdzv_configs={"store_file": str(run_dir / STORE_FILE)},
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method=method,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs" / "agent")),
        **shutdown_grace(),
    )
    argv = [str(run_dir), "--local-store"] + (["--console-tty"] if console_tty else [])
    try:  # the store file will live there (a directory others may write: they could swap it for theirs)
        check_store_dir(run_dir)
    except StoreAccessError as exc:
        raise LaunchFailed(str(exc)) from None
    rendezvous.register()
    store_files = (run_dir / STORE_FILE, run_dir / STORE_SECRET_FILE)
    with guarded_agent(run_id, store_files, fork_server=method != "fork"):
        try:
            write_store_secret(run_dir, new_secret())  # the workers sign and check nxdt's keys in the store with it
            if method != "fork":
                start_fork_server()
            else:  # the workers are forks of this process: the config tree each reads its config.yaml onto, built once
                schema_tree()
                gc.freeze()  # and their collections skip what they share with it (as nxdt.launch.fork_server does)
            elastic_launch(config, entrypoint=worker.main)(argv)
        except ChildFailedError as exc:
            raise LaunchFailed(_failure_line(exc, run_dir)) from None
        except ForkServerError as exc:
            raise LaunchFailed(str(exc)) from None
        except (SignalException, KeyboardInterrupt) as exc:  # the agent turns SIGINT/SIGTERM into SignalException
            raise LaunchInterrupted(
                f"nxdt: interrupted ({getattr(exc, 'sigval', 'SIGINT')}); all workers stopped — "
                f"resume with exp_manager.resume_if_exists=true"
            ) from None
        finally:
            if method == "fork":
                gc.unfreeze()  # the caller collects as before (the workers kept their frozen copy)
            cleanup_run(run_id)
            (run_dir / STORE_SECRET_FILE).unlink(missing_ok=True)
            (run_dir / STORE_FILE).unlink(missing_ok=True)  # the agent's shutdown removes it too, when it gets there


@contextlib.contextmanager
def guarded_agent(run_id: str | None, run_files: Sequence[Path], *, fork_server: bool) -> Iterator[None]:
    """The block an agent launches in: its own temporary directory (:func:`agent_tempdir`), and a :func:`watchdog`
    that removes it, ``run_files`` and the run's segments if this process is killed — with, where the workers come
    from a fork server, multiprocessing's temporary directory (its socket; made here, before tempfile's default
    points into the agent's, so it stays where it always was and outlives the launch, as the server does)."""
    from multiprocessing.util import get_temp_dir

    private_dirs = [get_temp_dir()] if fork_server else []
    with agent_tempdir() as agent_tmp, watchdog(run_id, run_files, [*private_dirs, agent_tmp]):
        yield


@contextlib.contextmanager
def agent_tempdir() -> Iterator[str]:
    """A private directory (``tempfile.mkdtemp``: mode 0700, a name nobody can take first) as the default directory
    of Python's ``tempfile`` while torch's elastic agent starts and watches the workers, removed afterwards.

    Why: for each worker, ``torch.multiprocessing.start_processes`` names a file for its traceback in the temporary
    directory, unlinks it, and when the worker fails unpickles whatever then has that name — in a shared ``/tmp``,
    another local user could have put a file there first (the names can be watched), and nothing ever removes them
    (two each failed 2-rank run; 18 each suite run). torch gives that call no directory argument; ``tempfile.tempdir``
    is the default tempfile's documented functions take, set here for the launch only and restored after it."""
    previous = tempfile.tempdir
    path = tempfile.mkdtemp(prefix="nxdt-agent-")
    tempfile.tempdir = path
    try:
        yield path
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def watchdog(run_id: str | None, run_files: Sequence[Path] = (), private_dirs: Sequence[str] = ()) -> Iterator[None]:
    """:func:`watch_segments` for the block: at its end, however it ends, this process says goodbye (it removes its
    own temporary directories) and closes the pipe; the watchdog then removes what is left and exits."""
    fd = watch_segments(run_id, run_files, private_dirs)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # (a watchdog killed by someone: nothing reads)
            os.write(fd, b".")
        os.close(fd)


def watch_segments(run_id: str | None, run_files: Sequence[Path] = (), private_dirs: Sequence[str] = ()) -> int:
    """Start a watchdog that removes the run's shared-memory segments and ``run_files`` (the store and its secret)
    once this launcher is gone, even by SIGKILL (which skips ``launch_local``'s own cleanup): a grandchild process,
    detached (no zombie, no terminal, no signals from Ctrl-C), that blocks on a pipe only this process writes. The
    pipe reads end-of-file when the launcher exits however it exits; its workers die with it
    (``forking.die_with_agent``). The watchdog unlinks ``run_files`` at once (the run directory's lock went with the
    launcher, and a new launch takes seconds to get to writing its own), then removes ``nxdt-<run_id>…`` until it
    finds none twice in a row (a worker still dying may map one more; without a ``run_id`` none: a node agent of a
    multi-node run, whose run id other hosts' agents share where /dev/shm is shared). ``private_dirs``, directories
    of the launcher's own (multiprocessing's temporary directory, holding its fork server's socket; the agent's,
    :func:`agent_tempdir`), are emptied and removed only if the launcher died: one that lives to the end writes a byte
    before it closes the pipe and removes them itself. Returns the pipe's write end: closing it ends the watchdog (:func:`watchdog` does
    both for a block). Only ``os`` calls run in the fork."""
    paths = [str(path) for path in run_files]  # made before the fork
    private_dirs = [str(directory) for directory in private_dirs]
    from nxdt.comm import cleanup_run

    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (a forked child: coverage is not collected there)
        try:
            os.setsid()  # no controlling terminal: Ctrl-C in the launcher's terminal does not reach it
            if os.fork() != 0:
                os._exit(0)  # the grandchild is adopted by init: nobody has to wait for it
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.closerange(3, read_end)  # the run directory's lock, the launcher's pipes: not held by the watchdog
            os.closerange(read_end + 1, os.sysconf("SC_OPEN_MAX"))
            launcher_ended_it = False
            while os.read(read_end, 1):
                launcher_ended_it = True
            for path in paths:
                try:
                    os.unlink(path)
                except OSError:  # already removed by the launcher's own cleanup
                    pass
            for directory in private_dirs if not launcher_ended_it else ():
                try:
                    for name in os.listdir(directory):
                        os.unlink(os.path.join(directory, name))
                    os.rmdir(directory)
                except OSError:
                    pass
            quiet = 0
            while run_id is not None and quiet < 2:  # (no run id: a node agent's segments wait for the next sweep)
                quiet = quiet + 1 if cleanup_run(run_id) == 0 else 0
                time.sleep(0.2)
        finally:
            os._exit(0)
    os.close(read_end)
    os.waitpid(child, 0)
    return write_end
