"""This rank's place in the run, as ``NxDStrategy.setup_environment`` establishes it: the plan (given, or laid out
from the strategy's degrees) checked against the processes Lightning started, the world joined through the
rendezvous store, one nxdt communicator per planned group, and torch.distributed's default process group beside them
for third-party code (torchmetrics, samplers, a user's ``torch.distributed.all_reduce``)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from nxdt.comm import Communicator, CommTimeoutError, EmulatedLink, World, init_process
from nxdt.comm.store import SignedKeys, SignedStore, secret_from_env
from nxdt.planner import DIMENSIONS, Dim, Plan, plan_layout

DEGREE_ARGS = {
    Dim.TP: "tensor_parallel_size",
    Dim.PP: "pipeline_parallel_size",
    Dim.CP: "context_parallel_size",
    Dim.EP: "expert_parallel_size",
}


def checked_degrees(degrees: dict[Dim, Any]) -> dict[Dim, int]:
    """The strategy's model-parallel degrees, each an integer ≥ 1 (else one line naming the argument)."""
    for dim, value in degrees.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"NxDStrategy({DEGREE_ARGS[dim]}={value!r}): must be an integer >= 1")
    return dict(degrees)


def check_ddp_options(
    *,
    broadcast_buffers: Any,
    process_group_backend: Any,
    static_graph: Any,
    gradient_as_bucket_view: Any,
    bucket_cap_mb: Any,
) -> None:
    """DDPStrategy's options NxDStrategy takes, each of its type (else one line naming it and what it takes)."""
    flags = {
        "broadcast_buffers": broadcast_buffers,
        "static_graph": static_graph,
        "gradient_as_bucket_view": gradient_as_bucket_view,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"NxDStrategy({name}={value!r}): must be True or False")
    if process_group_backend not in (None, "gloo"):
        raise ValueError(
            f"NxDStrategy(process_group_backend={process_group_backend!r}): the torch.distributed group beside nxdt's "
            f"communicators runs on CPU, where only 'gloo' works; pass 'gloo' or leave it unset"
        )
    if bucket_cap_mb is not None and (
        isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0
    ):
        raise ValueError(f"NxDStrategy(bucket_cap_mb={bucket_cap_mb!r}): must be a positive number of MiB, or None")


def run_plan(
    plan: Plan | None, world_size: int, *, degrees: dict[Dim, int], order: str, ranks_per_node: int, num_nodes: int
) -> Plan:
    """The plan of this run: ``plan`` when given (it must be for ``world_size`` ranks), else ``degrees`` laid out
    over ``world_size`` ranks in ``order``."""
    if plan is None:
        plan = plan_layout(
            world_size,
            tp=degrees[Dim.TP],
            pp=degrees[Dim.PP],
            cp=degrees[Dim.CP],
            ep=degrees[Dim.EP],
            order=order,
            ranks_per_node=ranks_per_node,
        )
    elif plan.world_size != world_size:
        raise RuntimeError(
            f"the plan is for {plan.world_size} ranks but Lightning started {world_size} (devices={ranks_per_node}, "
            f"num_nodes={num_nodes}); make trainer.devices × num_nodes match the plan"
        )
    return plan


def join_world(
    rank: int,
    world_size: int,
    address: str,
    port: int,
    *,
    timeout_s: float,
    node_rank: int = 0,
    ranks_per_node: int | None = None,
) -> World:
    """Join the run through its rendezvous store: the elastic agent hosts it under ``nxdt train`` / ``torchrun``
    (``TORCHELASTIC_USE_AGENT_STORE=True``), rank 0 otherwise. When ranks never join, the error says which launch
    mistake explains it: other nodes' ranks missing (Lightning starts one node's processes), or this node's own
    while LOCAL_RANK was in the environment (Lightning then starts none). ``ranks_per_node`` None: all on this one."""
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # a default process group made before this strategy (a DDPStrategy fit earlier in the script, or the user's) holds
    # the address and port with its store: join through that store rather than serve a second one on the same port.
    # torch has no public accessor for the default group's store; _get_default_store is what its own checkpoint and
    # elastic code use
    existing = dist.distributed_c10d._get_default_store() if dist.is_initialized() and not agent_hosts_store else None
    try:
        return init_process(
            rank,
            world_size,
            address,
            port,
            timeout_s=timeout_s,
            run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
            store_is_server=(rank == 0 and not agent_hosts_store and existing is None),
            store=existing,
        )
    except CommTimeoutError as exc:
        if not exc.missing_ranks or "TORCHELASTIC_RUN_ID" in os.environ:
            raise
        per_node = ranks_per_node or world_size
        this_node = range(node_rank * per_node, (node_rank + 1) * per_node)
        if not any(r in this_node for r in exc.missing_ranks):
            nodes = sorted({r // per_node for r in exc.missing_ranks})
            raise CommTimeoutError(
                f"{exc}; they are the ranks of node(s) {nodes} (num_nodes={world_size // per_node}, devices="
                f"{per_node}): Lightning starts the processes of its own node only — run the same script on every "
                f"other node with NODE_RANK set to its index and MASTER_ADDR, MASTER_PORT of node 0 (or start each node "
                f"with torchrun), or set num_nodes=1",
                missing_ranks=exc.missing_ranks,
            ) from exc
        if "LOCAL_RANK" not in os.environ:
            raise
        # Lightning starts the other ranks of a plain ``python script.py`` only when LOCAL_RANK is unset
        raise CommTimeoutError(
            f"{exc}; LOCAL_RANK={os.environ['LOCAL_RANK']} is set in this process's environment, so Lightning "
            f"expected an outside launcher to start the other ranks and started none: unset LOCAL_RANK, or "
            f"start the script with torchrun",
            missing_ranks=exc.missing_ranks,
        ) from exc


def open_groups(world: World, plan: Plan, *, links: dict[str, EmulatedLink], choice: dict[str, str]) -> dict[str, Communicator]:
    """``{"world": …, dim: …}``: this rank's communicator of every planned group (a collective every rank joins).
    ``links``: emulated link per dimension; ``choice``: ``comm.transport`` / ``comm.algorithm``."""
    comms = {"world": world.world}
    dims = DIMENSIONS + ((Dim.EDP,) if plan.ep > 1 else ()) + ((Dim.DP_CP,) if plan.cp > 1 else ())
    dims += (Dim.EDP_CP,) if plan.ep > 1 and plan.cp > 1 else ()
    for dim in dims:
        for index, ranks in enumerate(plan.groups[dim]):
            comm = world.new_communicator(
                list(ranks), name=f"{dim.value}{index}", link=links.get(dim), planned=plan.algorithms.get(dim.value), **choice
            )
            if comm is not None:
                comms[dim.value] = comm
    return comms


def init_torch_distributed(world: World, backend: str, generation: int) -> bool:
    """torch.distributed's default process group over the world's ranks, for code that calls torch.distributed itself
    (torchmetrics' sync, ``DistributedSampler()`` without arguments, a user's all-reduce) — what DDPStrategy gives such
    code. Its rendezvous goes through the run's store (no second listener; values signed with the run's secret:
    ``SignedStore``), under a key prefix of its own (``generation``: how many this strategy has made before, the same
    on every rank). On one host gloo's connections stay on loopback (``GLOO_SOCKET_IFNAME``, unless the user set it).
    Returns False, making nothing, when a default group exists already (a multi-host World made one for its links, or
    the user's script did): it is used as it is."""
    if dist.is_initialized():
        return False
    keys = SignedKeys(
        dist.PrefixStore(f"torch.distributed/{generation}", world.store),
        secret_from_env(),
        world.timeout_s,
        " (torch.distributed)",
    )
    lo = [name for _, name in socket.if_nameindex() if name == "lo"]
    pin = not world.multi_host and lo and "GLOO_SOCKET_IFNAME" not in os.environ
    if pin:  # read once, when gloo creates its device (the group's constructor): set only around it
        os.environ["GLOO_SOCKET_IFNAME"] = lo[0]
    try:
        dist.init_process_group(
            backend,
            store=SignedStore(keys),
            rank=world.rank,
            world_size=world.world_size,
            timeout=timedelta(seconds=world.timeout_s),
        )
    finally:
        if pin:
            del os.environ["GLOO_SOCKET_IFNAME"]
    return True
