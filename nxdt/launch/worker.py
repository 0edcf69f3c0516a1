"""Worker entry point: ``python -m nxdt.launch.worker RUN_DIR`` (started by the elastic agent).

Reads the resolved config and the plan from the run directory (never re-enters Hydra), sends this
rank's output to ``logs/rank<k>.log`` (rank 0 also to the console), then trains.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record


def _redirect_output(log_path: Path, tee_to_console: bool) -> None:
    """Point fds 1 and 2 at the rank's log file (through a tee thread for rank 0), so output of
    C++ code and subprocesses is captured too, not only Python's."""
    log = open(log_path, "ab", buffering=0)
    sys.stdout.flush()
    sys.stderr.flush()
    if not tee_to_console:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        return
    console = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump() -> None:
        while chunk := os.read(read_end, 65536):
            log.write(chunk)
            os.write(console, chunk)

    thread = threading.Thread(target=pump, name="nxdt-tee", daemon=True)
    thread.start()

    def drain() -> None:  # at exit: close our ends of the pipe so the pump sees EOF and flushes
        sys.stdout.flush()
        sys.stderr.flush()
        os.close(1)
        os.close(2)
        thread.join(timeout=2)

    atexit.register(drain)


def die_with_agent() -> None:
    """A worker never outlives its agent: if the agent is killed (a host going down), its workers go too,
    so the other hosts see the peer vanish instead of a half-alive job."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the agent died before the call took effect
        os._exit(1)


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nxdt.launch.worker")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--console-tty", action="store_true", help="the launcher's console is a terminal (live progress bar)")
    parser.add_argument("--node-key", default=None, help="multi-node: this node's order key (JSON), see nxdt.launch.multinode")
    parser.add_argument("--node-key-source", default="rendezvous order")
    parser.add_argument("--plan-digest", default=None, help="multi-node: digest of the plan this node's launcher computed")
    args = parser.parse_args(argv)
    die_with_agent()
    if args.plan_digest is not None:  # several nodes: take this node's place in the Plan before anything names a rank
        from nxdt.launch.multinode import settle_node

        settle_node(json.loads(args.node_key), args.plan_digest, args.node_key_source, timeout_s=120.0)
    rank = int(os.environ["RANK"])
    _redirect_output(args.run_dir / "logs" / f"rank{rank}.log", tee_to_console=rank == 0)
    print(f"nxdt: rank {rank} attempt {os.environ.get('NXDT_ATTEMPT') or os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} started (t={time.time():.3f})", flush=True)
    if args.plan_digest is not None:
        from nxdt.comm.world import host_identity

        print(f"nxdt: rank {rank} is on node {os.environ['GROUP_RANK']} (node order: {args.node_key_source}), "
              f"host {host_identity()}, address {os.environ.get('NXDT_LOCAL_ADDR', '?')}", flush=True)
    if args.console_tty and rank == 0:
        os.environ["FORCE_COLOR"] = "1"  # rich: the console at the end of the tee is a terminal
        os.environ["TTY_INTERACTIVE"] = "1"

    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))  # ranks share this host's cores

    from nxdt.config import load_run_config
    from nxdt.lightning.train import run_training
    from nxdt.launch.rundir import CONFIG_FILE, PLAN_FILE
    from nxdt.planner import Plan

    cfg = load_run_config(args.run_dir / CONFIG_FILE)
    plan = Plan.load(args.run_dir / PLAN_FILE)
    run_training(cfg, plan, args.run_dir)


if __name__ == "__main__":
    main()
