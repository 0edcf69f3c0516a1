"""``nxdt comm-test -N nodes``: the benchmark of :mod:`nxdt.comm.bench` on several nodes, each node's ranks
started by its own elastic agent through the launcher's multi-node machinery (c10d rendezvous, node order,
plan-style digest). Lives here, not in nxdt.comm, because it uses the launcher (a higher layer);
``nxdt.cli`` hands :func:`main_multinode` to ``nxdt.comm.bench.main``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from nxdt.comm.bench import _body as bench_body, finish, ranks_per_node
from nxdt.comm.world import init_from_env
from nxdt.config.validate import ConfigError
from nxdt.launch.local import LaunchFailed, LaunchInterrupted
from nxdt.launch.multinode import launch_node, resolve_node, settle_node
from nxdt.launch.forking import die_with_agent


def node_worker(opts: dict, node_key: Any, source: str, digest: str, timeout_s: float) -> dict[str, Any]:
    """One rank of a multi-node comm-test (started by this node's elastic agent)."""
    die_with_agent()
    settle_node(node_key, digest, source, timeout_s)
    world = init_from_env(timeout_s=timeout_s, run_id=os.environ.get("TORCHELASTIC_RUN_ID"))
    try:
        report = bench_body(world, opts)
        return {"rank": world.rank, "report": report}
    finally:
        world.close()  # then the forked rank ends through multiprocessing's os._exit: no final garbage collection


def main_multinode(args: argparse.Namespace, opts: dict) -> int:
    """Every node runs this; the node holding rank 0 prints the table."""
    launcher = SimpleNamespace(
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id or "nxdt-comm-test",
        node_rank=args.node_rank,
        local_addr=args.local_addr,
        port=29500,
        join_timeout_s=args.join_timeout,
    )
    try:
        spec = resolve_node(launcher, args.nodes, ranks_per_node(args.nworkers, args.nodes))
    except ConfigError as exc:
        print(f"nxdt comm-test: {exc}", file=sys.stderr)
        return 2
    digest = hashlib.sha256(json.dumps({**opts, "nodes": args.nodes, "r": args.nworkers}, sort_keys=True).encode()).hexdigest()[
        :16
    ]
    print(
        f"nxdt comm-test: node {spec.known_node_rank if spec.known_node_rank is not None else '?'} of {args.nodes} "
        f"({args.nworkers // args.nodes} of {args.nworkers} ranks, address {spec.local_addr}); c10d rendezvous {spec.rdzv_endpoint}",
        flush=True,
    )
    scratch = Path(tempfile.mkdtemp(prefix="nxdt-comm-test-"))
    try:
        results = launch_node(
            scratch,
            spec,
            (opts, spec.node_key, spec.node_key_source, digest, 300.0),
            entrypoint=node_worker,
            server_preload=["nxdt.launch.comm_fork_server"],  # the ranks are forks of one pre-imported process
        )
    except LaunchFailed as exc:
        print(f"nxdt comm-test: {exc}", file=sys.stderr)
        return 1
    except LaunchInterrupted as exc:
        print(str(exc), file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    first = next((r for r in results.values() if r and r["rank"] == 0), None)
    if first is None:
        print("nxdt comm-test: done; the node holding rank 0 prints the table", flush=True)
        return 0
    return finish(first["report"], args)
