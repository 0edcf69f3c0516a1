"""This rank's place in the run, as ``NxDStrategy.setup_environment`` establishes it: the plan (given, or laid out
from the strategy's degrees) checked against the processes Lightning started, the world joined through the
rendezvous store, and one nxdt communicator per planned group."""

from __future__ import annotations

import os
from typing import Any

from nxdt.comm import Communicator, CommTimeoutError, EmulatedLink, World, init_process
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
    if plan.cp > 1 and plan.ep > 1:
        raise NotImplementedError(
            f"NxDStrategy: degrees {plan.degrees} — context parallelism together with expert parallelism is "
            f"not implemented yet; context parallelism trains with data, tensor and pipeline parallelism, ZeRO-1 and FSDP"
        )
    return plan


def join_world(rank: int, world_size: int, address: str, port: int, *, timeout_s: float) -> World:
    """Join the run through its rendezvous store: the elastic agent hosts it under ``nxdt train`` / ``torchrun``
    (``TORCHELASTIC_USE_AGENT_STORE=True``), rank 0 otherwise."""
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        return init_process(
            rank,
            world_size,
            address,
            port,
            timeout_s=timeout_s,
            run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
            store_is_server=(rank == 0 and not agent_hosts_store),
        )
    except CommTimeoutError as exc:
        inherited = "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ
        if not inherited:
            raise
        # Lightning starts the other ranks of a plain ``python script.py`` only when LOCAL_RANK is unset
        raise CommTimeoutError(
            f"{exc}; LOCAL_RANK={os.environ['LOCAL_RANK']} is set in this process's environment, so Lightning "
            f"expected an outside launcher to start the other ranks and started none: unset LOCAL_RANK, or "
            f"start the script with torchrun"
        ) from exc


def open_groups(world: World, plan: Plan, *, links: dict[str, EmulatedLink], choice: dict[str, str]) -> dict[str, Communicator]:
    """``{"world": …, dim: …}``: this rank's communicator of every planned group (a collective every rank joins).
    ``links``: emulated link per dimension; ``choice``: ``comm.transport`` / ``comm.algorithm``."""
    comms = {"world": world.world}
    dims = DIMENSIONS + ((Dim.EDP,) if plan.ep > 1 else ()) + ((Dim.DP_CP,) if plan.cp > 1 else ())
    for dim in dims:
        for index, ranks in enumerate(plan.groups[dim]):
            comm = world.new_communicator(
                list(ranks), name=f"{dim.value}{index}", link=links.get(dim), planned=plan.algorithms.get(dim.value), **choice
            )
            if comm is not None:
                comms[dim.value] = comm
    return comms
