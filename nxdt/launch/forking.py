"""How nxdt's agents start their workers, without importing anything heavy (``nxdt train`` starts the server
before it imports torch itself, and the server calls :func:`die_with_agent` before its own imports).

Workers are forks of a multiprocessing fork server that has imported torch and Lightning once
(:mod:`nxdt.launch.fork_server`): those imports cost 6-9 s of CPU per process, which ranks sharing a host's
cores would pay one after another, and a restart after a failure would pay again. No process outlives the
one that started it: a worker dies with its agent, and the server with its launcher."""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import signal

START_METHOD = "forkserver"
PRELOAD = ["nxdt.launch.fork_server"]  # what every worker imports before it trains
WORKER_MODULES = ("nxdt.lightning.train",)  # what the fork server's preload imports (nxdt.launch.fork_server)


def start_method(fork_here: bool = False) -> str:
    """How this process starts its workers: from the fork server, unless its caller asks to fork them here
    (``fork_here``: a process that runs many launches, e.g. the test suite's pre-imported one) and this process has
    imported what the server would (``WORKER_MODULES``) and runs one Python thread. Forking it is then as safe as
    forking the server — provided it never ran a multi-threaded torch operation, which the launcher's checks do not
    (one torch thread) — and spares the server's imports (torch, Lightning: ~10 s of CPU per launch). The workers are
    the same either way: they reset the signal dispositions they inherit (``worker.reset_signals``) and die with their
    parent."""
    import sys
    import threading

    if fork_here and all(name in sys.modules for name in WORKER_MODULES) and threading.active_count() == 1:
        return "fork"
    return START_METHOD


class ForkServerError(RuntimeError):
    """The fork server cannot start; ``str()`` is the one line for the user."""


def start_fork_server(preload: list[str] = PRELOAD) -> None:
    """Start the fork server the agent's workers come from, importing ``preload`` once (its first module calls
    :func:`die_with_agent`: ``nxdt.launch.fork_server``, or ``nxdt.launch.comm_fork_server`` for ``nxdt comm-test
    -N``'s ranks). Called before the launcher's own checks and the agent's rendezvous, so the imports overlap them;
    the server is single-threaded (it only imports), so forking it is safe, and it exits with the launcher.
    :class:`ForkServerError` where its Unix socket cannot be made: multiprocessing puts it under the temporary
    directory (``TMPDIR``), and a socket's path must fit 107 bytes — a deep per-job ``TMPDIR`` (as some clusters
    set) does not."""
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(preload)
    try:
        multiprocessing.forkserver.ensure_running()
    except OSError as exc:
        if "AF_UNIX path too long" not in str(exc):
            raise
        import tempfile

        raise ForkServerError(
            f"nxdt: the workers' fork server cannot listen: its socket's path under the temporary directory "
            f"{tempfile.gettempdir()} ({len(tempfile.gettempdir())} characters) would exceed the 107 bytes a Unix "
            "socket allows; set TMPDIR to a shorter directory (e.g. TMPDIR=/tmp)"
        ) from None


def die_with_agent() -> None:
    """A worker never outlives its agent: if the agent is killed (a host going down), its workers go too,
    so the other hosts see the peer vanish instead of a half-alive job."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the agent died before the call took effect
        os._exit(1)
