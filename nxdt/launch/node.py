"""One node's agent of a multi-node job: ``python -m nxdt.launch.node RUN_DIR [options]``.

What ``nxdt train launcher=torchrun`` runs on each node after planning, and what the Slurm job's srun
starts on each node (the plan was written once, to the shared run directory, at submission). Options
override ``launcher.*`` of the run's config; the rest comes from the environment (``$SLURM_NODEID``,
``$NODE_RANK``, ...), see :mod:`nxdt.launch.multinode`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from nxdt.config.validate import ConfigError


def announce(spec: Any, plan: Any) -> str:
    rank = spec.known_node_rank
    return (
        f"nxdt: node agent: node rank {rank if rank is not None else '?'} of {spec.nnodes} (from {spec.node_key_source}), "
        f"{spec.nproc_per_node} workers, address {spec.local_addr}; c10d rendezvous {spec.rdzv_endpoint} id {spec.rdzv_id}"
        f"{' (hosted here)' if spec.is_host else ''}"
    )


def run_node(run_dir: Path, cfg: Any, plan: Any, *, dry_run: bool, console_tty: bool = False) -> int:
    """Resolve this node's part and run its agent; exit status as ``nxdt train`` gives it."""
    from nxdt.launch.local import LaunchFailed, LaunchInterrupted
    from nxdt.launch.multinode import describe_node, launch_node, plan_digest, resolve_node, worker_args

    try:
        spec = resolve_node(cfg.launcher, plan.num_nodes, plan.ranks_per_node, cfg.exp_manager.max_restarts)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    args = worker_args(run_dir, spec, plan_digest(plan), console_tty)
    if dry_run:
        from nxdt.launch.devices import device_lines

        print("\n".join([describe_node(spec, run_dir, args), *device_lines(cfg, plan.ranks_per_node, "local rank")]))
        return 0
    print(announce(spec, plan), flush=True)
    try:
        launch_node(run_dir, spec, args)
    except LaunchFailed as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except LaunchInterrupted as exc:
        print(str(exc), file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nxdt.launch.node", description="Run this node's agent of a multi-node nxdt job.")
    p.add_argument("run_dir", type=Path, help="run directory holding config.yaml and plan.json (shared by every node)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (launcher.rdzv_endpoint)")
    p.add_argument("--rdzv-id", help="job id, the same on every node (launcher.rdzv_id)")
    p.add_argument("--node-rank", type=int, help="this node's place in the plan (launcher.node_rank)")
    p.add_argument("--local-addr", help="address the other nodes reach this node at (launcher.local_addr)")
    p.add_argument("--dry-run", action="store_true", help="print what would run and start nothing")
    args = p.parse_args(argv)
    from nxdt.config import load_run_config
    from nxdt.launch.rundir import CONFIG_FILE, PLAN_FILE
    from nxdt.planner import Plan

    try:
        cfg = load_run_config(args.run_dir / CONFIG_FILE)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    plan = Plan.load(args.run_dir / PLAN_FILE)
    for key in ("rdzv_endpoint", "rdzv_id", "node_rank", "local_addr"):
        if getattr(args, key) is not None:
            setattr(cfg.launcher, key, getattr(args, key))
    return run_node(args.run_dir.resolve(), cfg, plan, dry_run=args.dry_run or cfg.launcher.dry_run)


if __name__ == "__main__":
    sys.exit(main())
