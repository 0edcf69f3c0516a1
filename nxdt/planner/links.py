"""Link emulation figures: which link each communicator should pretend to run on (``comm.emulate``).

``comm`` knows nothing of the planner; it is *given* an ``EmulatedLink(latency_s, bytes_per_s)`` per
communicator. This module computes them: plan the run's degrees on the instance named by
``comm.emulate`` (e.g. trn1.32xlarge), and give every dimension the cost model's figures
(nxdt.planner.cost) of the link class its groups span there — a TP pair on one Trainium device gets
the intra-device link, a DP pair across devices the NeuronLink, a group across nodes the network.
"""

from __future__ import annotations

from typing import Any

from nxdt.config.validate import ConfigError
from nxdt.planner import Plan, PlacementError, plan_layout
from nxdt.planner.cost import Link, inter_link, intra_link, shape_of
from nxdt.topology import Topology, TopologyError, check_lnc, topology_of


def load_instance(name: str) -> Any:
    """The catalogue entry ``conf/instance/<name>.yaml`` as a typed InstanceConfig (no Hydra compose: workers call
    this too; :func:`nxdt.config.catalogue_instance`)."""
    from nxdt.config import available_options, catalogue_instance

    choices = available_options("instance")
    if name not in choices:
        raise ConfigError("comm.emulate", name, f"unknown instance; choose one of {', '.join(choices)}")
    return catalogue_instance(name)


def group_link(group: list[int], topology: Topology, instance: Any, ranks_per_node: int) -> Link:
    """Cost-model figures of the slowest link class ``group`` spans (the network once it spans nodes)."""
    shape = shape_of(group, topology, ranks_per_node)
    if shape.nodes > 1:
        return inter_link(shape, topology, instance, ranks_per_node)
    return intra_link(shape, topology, instance, None)


def emulated_links(plan: Plan, topology: Topology, instance: Any = None) -> dict[str, tuple[float, float]]:
    """``{dim: (latency_s, bytes_per_s)}`` for every dimension whose groups have 2+ ranks, from the
    slowest group of that dimension (groups of one dimension step together, the slowest sets the
    pace). ``instance``: the catalogue entry ``plan`` was planned on (default: loaded by its name)."""
    instance = instance if instance is not None else load_instance(plan.instance)
    links: dict[str, tuple[float, float]] = {}
    for dim, groups in plan.groups.items():
        figures = [group_link(g, topology, instance, plan.ranks_per_node) for g in groups if len(g) > 1]
        if figures:
            slowest = min(figures, key=lambda link: (link.bw, -link.alpha))
            links[dim] = (slowest.alpha, slowest.bw)
    return links


def emulation_plan(cfg: Any) -> tuple[Plan, Topology, Any]:
    """The run's degrees and world size planned on the ``comm.emulate`` instance (full nodes of it;
    a run smaller than one node fills the first ranks of one)."""
    name = cfg.comm.emulate
    instance = load_instance(name)
    ds, trainer = cfg.distributed_strategy, cfg.trainer
    world = trainer.num_nodes * trainer.devices
    try:
        lnc = check_lnc(instance, None)
        topo = topology_of(instance, lnc, ranks_per_node=world if instance.graph == "host" else None)
        per_node = min(world, topo.ranks_per_node)
        layout = plan_layout(
            world,
            tp=ds.tensor_model_parallel_size,
            pp=ds.pipeline_model_parallel_size,
            cp=ds.context_parallel_size,
            ep=ds.expert_model_parallel_size,
            order=ds.placement_order,
            ranks_per_node=per_node,
            topo=topo,
            instance=instance,
            lnc=lnc,
        )
    except (PlacementError, TopologyError, ValueError) as exc:
        raise ConfigError("comm.emulate", name, f"this run's layout cannot be emulated on {name}: {exc}") from None
    return layout, topo, instance


def emulated_links_for(cfg: Any) -> dict[str, tuple[float, float]]:
    """``emulated_links`` of the run's layout on the ``comm.emulate`` instance; {} when emulation is off."""
    if cfg.comm.emulate is None:
        return {}
    layout, topo, instance = emulation_plan(cfg)
    slow = float(getattr(cfg.comm, "emulate_slowdown", 1.0))
    return {
        dim: (latency * slow, bandwidth / slow) for dim, (latency, bandwidth) in emulated_links(layout, topo, instance).items()
    }
