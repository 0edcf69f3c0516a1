"""Local launch: this host's workers under torch's elastic agent (the machinery behind torchrun).

The agent hosts the rendezvous store (``nxdt-local``: on 127.0.0.1 only, see
``nxdt.launch.rendezvous``), starts one worker per rank, watches them, and stops all of them when one
fails or on Ctrl-C. We turn its outcome into one line naming the failed rank, its
error and its log file, and remove the run's shared-memory segments whatever happened.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from nxdt.planner import Plan


# Seconds the agent gives the workers, after passing on a Ctrl-C or SIGTERM the launcher received, before it
# kills them (torch's default is 30). Checkpoints are atomic, so cutting a save short loses nothing committed.
# (Workers stopped because a peer failed end at once on the agent's SIGTERM: worker.die_on_sigterm.)
SHUTDOWN_GRACE_S = 5


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


def root_failure(exc: Any) -> tuple[int, int | None, str]:
    """(local rank, pid if known, one-line summary) of the worker that failed first.

    One failure brings down the rest: peers waiting for a dead rank raise ``PeerDiedError`` and the
    agent stops the others (SIGTERM), each recording an error of its own, often within the same second.
    The agent may report whichever exit it saw first (only that one, for forked workers), so every
    worker's error file, which lies beside the reported one, is read and the first written wins: a
    rank's error is written before it exits, and its peers notice the exit only after that. A worker
    killed by a signal writes no file: it counts as first (it died before anyone could notice), unless the
    signal was SIGTERM, the agent's way of stopping the others."""
    first: dict[int, tuple[float, int | None, str]] = {}
    for rank, failure in exc.failures.items():
        recorded = os.path.isfile(failure.error_file)
        when = float("inf") if recorded or failure.exitcode == -signal.SIGTERM else float("-inf")
        first[rank] = (when, failure.pid, _summary(failure.message, failure.exitcode))
        if not recorded:
            continue
        for path in Path(failure.error_file).parent.parent.glob("*/error.json"):
            other = int(path.parent.name)
            try:
                written, message = path.stat().st_mtime_ns / 1e9, json.loads(path.read_text())["message"]
            except (OSError, ValueError, KeyError):
                continue
            if other in first and first[other][0] == float("-inf"):
                continue
            pid = first[other][1] if other in first else None
            first[other] = (written, pid, _summary(message, 1))
    rank = min(first, key=lambda r: (first[r][0], r))
    return rank, first[rank][1], first[rank][2]


def _failure_line(exc: Any, run_dir: Path) -> str:
    rank, _, summary = root_failure(exc)
    return f"nxdt: rank {rank} failed: {summary} — see {run_dir / 'logs' / f'rank{rank}.log'}"


def launch_local(run_dir: Path, plan: Plan, *, console_tty: bool, max_restarts: int = 0) -> None:
    """Run the plan's ranks on this host; with ``max_restarts`` the agent restarts every worker after a
    failure and the workers resume from the newest complete checkpoint."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from nxdt.comm import cleanup_run
    from nxdt.launch import rendezvous, worker

    # the agent logs every worker exit at WARNING/ERROR; we report the failure ourselves in one line
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    run_id = f"x{uuid.uuid4().hex[:12]}"
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=plan.ranks_per_node, run_id=run_id,
        rdzv_backend=rendezvous.BACKEND, rdzv_endpoint="",  # one store, on 127.0.0.1 only, no pickled state
        max_restarts=max_restarts, monitor_interval=0.2, start_method=worker.START_METHOD,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs" / "agent")),
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    argv = [str(run_dir)] + (["--console-tty"] if console_tty else [])
    rendezvous.register()
    try:
        worker.start_fork_server()
        elastic_launch(config, entrypoint=worker.main)(argv)
    except ChildFailedError as exc:
        raise LaunchFailed(_failure_line(exc, run_dir)) from None
    except (SignalException, KeyboardInterrupt) as exc:  # the agent turns SIGINT/SIGTERM into SignalException
        raise LaunchInterrupted(f"nxdt: interrupted ({getattr(exc, 'sigval', 'SIGINT')}); all workers stopped — "
                                f"resume with exp_manager.resume_if_exists=true") from None
    finally:
        cleanup_run(run_id)
