"""The planner: ``plan(config) -> Plan``, pure (no processes, no torch.distributed).

It lays ranks out on the instance topology (nxdt.topology), plans the communicator groups, checks
them against the hardware's rules (``placement``), picks a collective algorithm per group by an
alpha-beta cost model (``cost``) and estimates step time and memory (``estimate``).

Rank layout (NxD Core / Megatron style): reshape ``arange(world)`` to the dimensions of
``placement_order`` with the first-named dimension varying fastest, then slice. A group of dimension
``d`` is the set of ranks that differ only in their ``d`` coordinate.

Worked example, 8 ranks, TP=2, PP=2 (so DP=2), order ``tp-cp-ep-dp-pp``::

    rank = tp + 2·dp + 4·pp
    tp groups: [0,1] [2,3] [4,5] [6,7]
    dp groups: [0,2] [1,3] [4,6] [5,7]
    pp groups: [0,4] [1,5] [2,6] [3,7]
    mp (tp×pp, the model-parallel replica): [0,1,4,5] [2,3,6,7]

Expert parallelism subdivides data parallelism: with DP=4 and EP=2 the ``dp`` axis is viewed as
``ep × (dp/ep)``, ep fastest, so ep groups are pairs of consecutive DP ranks; ``edp`` groups (expert
data parallelism) join the ranks that hold the same experts: dp [0,1,2,3] → ep [0,1] [2,3], edp [0,2] [1,3].

Context parallelism splits the sequence, not the weights: the ranks of a CP group hold the same weights, so
gradients are averaged (and ZeRO-1/FSDP shard) over ``dp_cp`` groups, DP × CP with the cp coordinate fastest.
TP=2, CP=2 on 8 ranks (DP=2): cp [0,2] [1,3] [4,6] [5,7], dp [0,4] [1,5] [2,6] [3,7], dp_cp [0,2,4,6] [1,3,5,7].
With expert parallelism too, the replicas of the same experts are ``edp_cp`` groups, EDP × CP with cp fastest (planned
only where EP and CP are both > 1): CP=2, EP=2 on 8 ranks (DP=4): ep [0,2] [1,3] [4,6] [5,7], edp_cp [0,1,4,5] [2,3,6,7].

On a torus the grid is laid over *positions* and a device order maps positions to cores (see
``placement``): trn1.32xlarge TP=4 gives TP groups [0,8,16,24], [1,9,17,25], ... (torus columns).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from nxdt.config.validate import DIMENSIONS, ConfigError, Dim, batch_plan
from nxdt.planner.placement import CHECKED_DIMENSIONS, accepted_sizes, candidate_orders, group_violation, local_order
from nxdt.topology import Topology, TopologyError, check_lnc, topology_of

__all__ = ["DIMENSIONS", "Coords", "Dim", "Plan", "PlacementError", "plan", "plan_layout", "workable_tp_degrees"]
DEGREE_KEYS: dict[str, str] = {
    Dim.TP: "tensor_model_parallel_size",
    Dim.PP: "pipeline_model_parallel_size",
    Dim.CP: "context_parallel_size",
    Dim.EP: "expert_model_parallel_size",
}


class Coords(NamedTuple):
    """A rank's index within each of its groups (its tp rank, dp rank, ...); ``coords[Dim.TP]`` and ``coords["tp"]``
    read the same field as ``coords.tp``."""

    tp: int
    cp: int
    ep: int
    dp: int
    edp: int
    dp_cp: int
    pp: int
    mp: int
    world: int
    edp_cp: int = 0  # planned only with EP and CP both > 1

    def __getitem__(self, key: Any) -> int:  # type: ignore[override]
        return getattr(self, str(key)) if isinstance(key, str) else tuple.__getitem__(self, key)

    def as_dict(self) -> dict[str, int]:
        return self._asdict()


class PlacementError(ConfigError):
    """A layout the instance's topology cannot run (names the rule and the degrees that would work)."""


@dataclass
class Plan:
    world_size: int
    num_nodes: int
    ranks_per_node: int
    order: str
    degrees: dict[str, int]
    groups: dict[str, list[list[int]]]
    instance: str = "cpu"
    lnc: int = 1
    ranks_per_device: int = 1
    device_order: str = "identity"
    algorithms: dict[str, dict[str, str]] = field(default_factory=dict)  # dim → op → algorithm for comm
    collectives: list[dict[str, Any]] = field(default_factory=list)  # one row per collective kind of a step
    estimate: dict[str, Any] = field(default_factory=dict)  # step time, tokens/s, MFU, memory per device
    batch: dict[str, int] = field(default_factory=dict)  # global, micro, micro_batches (per DP rank and step), seq_length
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if Dim.DP_CP not in self.groups and Dim.DP in self.groups:  # a plan.json written before dp_cp existed
            self.groups[Dim.DP_CP.value] = _dp_cp_of(self.groups[Dim.DP], self.groups[Dim.CP])

    def group_of(self, dim: str, rank: int) -> list[int]:
        for group in self.groups[dim]:
            if rank in group:
                return group
        raise KeyError(f"rank {rank} is in no {dim} group")

    def degree(self, dim: Dim | str) -> int:
        """The size of dimension ``dim`` (EDP = DP / EP; MP = TP × PP; DP_CP = DP × CP; EDP_CP = EDP × CP)."""
        if dim == Dim.EDP:
            return self.degrees[Dim.DP] // self.degrees[Dim.EP]
        if dim == Dim.EDP_CP:
            return self.degrees[Dim.DP] // self.degrees[Dim.EP] * self.degrees[Dim.CP]
        if dim == Dim.DP_CP:
            return self.degrees[Dim.DP] * self.degrees[Dim.CP]
        if dim == Dim.MP:
            return self.degrees[Dim.TP] * self.degrees[Dim.PP]
        return self.degrees[Dim(dim)]

    tp = property(lambda self: self.degree(Dim.TP), doc="tensor-parallel degree")
    cp = property(lambda self: self.degree(Dim.CP), doc="context-parallel degree")
    ep = property(lambda self: self.degree(Dim.EP), doc="expert-parallel degree (a sub-axis of DP)")
    dp = property(lambda self: self.degree(Dim.DP), doc="data-parallel degree")
    pp = property(lambda self: self.degree(Dim.PP), doc="pipeline-parallel degree")
    edp = property(lambda self: self.degree(Dim.EDP), doc="expert-data-parallel degree, DP / EP")
    mp = property(lambda self: self.degree(Dim.MP), doc="model-parallel replica size, TP × PP")
    dp_cp = property(lambda self: self.degree(Dim.DP_CP), doc="replicas of the weights, DP × CP (CP ranks hold the same weights)")

    @property
    def micro_batches(self) -> int:
        """Micro-batches per DP rank and optimizer step (gradient accumulation), from ``batch``."""
        return self.batch["micro_batches"]

    def coords(self, rank: int) -> Coords:
        """Index of ``rank`` within each of its groups (its tp rank, dp rank, ...), computed once per plan."""
        cache = self.__dict__.get("_coords")
        if cache is None:  # one pass over the groups: rank → index, per dimension (not a dataclass field: not in plan.json)
            cache = self.__dict__["_coords"] = {}
            for dim, groups in self.groups.items():
                for group in groups:
                    for i, r in enumerate(group):
                        cache.setdefault(r, {})[dim] = i
        if rank not in cache:
            raise KeyError(f"rank {rank} is in no group of this plan (world size {self.world_size})")
        return Coords(**cache[rank])

    def place(self, rank: int) -> dict[str, int]:
        """Where a rank runs: node, device on the node, logical core on the node."""
        node, core = divmod(rank, self.ranks_per_node)
        return {"rank": rank, "node": node, "device": core // self.ranks_per_device, "core": core}

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self)}  # shallow: asdict would deep-copy every group
        return json.dumps(data, indent=1 if self.world_size <= 4096 else None)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(**json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    def summary(self) -> str:
        from nxdt.planner.report import render_plan

        return render_plan(self)


def _groups_along(grid: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(grid, axis, -1)
    return moved.reshape(-1, moved.shape[-1])


def _position_groups(world_size: int, degrees: dict[str, int], order: str) -> dict[str, np.ndarray]:
    """Groups over grid positions (before the device order maps positions to ranks)."""
    names = order.split("-")
    # EP is a sub-axis of DP: the "dp" axis of the grid holds only dp/ep (replicas across expert groups).
    sizes = {**degrees, Dim.DP: degrees[Dim.DP] // degrees[Dim.EP]}
    # numpy reshape is row-major (last axis fastest), so reverse the fastest-first order.
    grid = np.arange(world_size).reshape([sizes[n] for n in reversed(names)])
    axis = {n: len(names) - 1 - i for i, n in enumerate(names)}
    groups = {n.value: _groups_along(grid, axis[n]) for n in (Dim.TP, Dim.CP, Dim.EP, Dim.PP)}
    # data-parallel groups span both the ep and the remaining dp axes
    groups["dp"] = np.moveaxis(grid, [axis[Dim.EP], axis[Dim.DP]], [-1, -2]).reshape(-1, degrees[Dim.DP])
    # expert-data-parallel: the ranks holding the same experts (same ep coordinate, different ep groups)
    groups["edp"] = np.moveaxis(grid, axis[Dim.DP], -1).reshape(-1, degrees[Dim.DP] // degrees[Dim.EP])
    if degrees[Dim.EP] > 1 and degrees[Dim.CP] > 1:  # the same experts over context parallelism's replicas too
        groups["edp_cp"] = np.moveaxis(grid, [axis[Dim.DP], axis[Dim.CP]], [-2, -1]).reshape(
            -1, degrees[Dim.DP] // degrees[Dim.EP] * degrees[Dim.CP]
        )
    # the replicas of the weights: data and context parallelism together (cp fastest, then ep, then dp)
    groups["dp_cp"] = np.moveaxis(grid, [axis[Dim.DP], axis[Dim.EP], axis[Dim.CP]], [-3, -2, -1]).reshape(
        -1, degrees[Dim.DP] * degrees[Dim.CP]
    )
    groups["mp"] = np.moveaxis(grid, [axis[Dim.TP], axis[Dim.PP]], [-1, -2]).reshape(-1, degrees[Dim.TP] * degrees[Dim.PP])
    groups["world"] = np.arange(world_size).reshape(1, -1)
    return groups


def _dp_cp_of(dp_groups: list[list[int]], cp_groups: list[list[int]]) -> list[list[int]]:
    """DP × CP groups from the DP and CP groups: each CP group's members' DP groups together (ordered cp fastest)."""
    dp_of = {r: g for g in dp_groups for r in g}
    out = {tuple(r for d in zip(*(dp_of[m] for m in cp)) for r in d) for cp in cp_groups}
    return sorted(list(g) for g in out)


def _degrees(world_size: int, tp: int, pp: int, cp: int, ep: int, order: str) -> dict[str, int]:
    if world_size % (tp * pp * cp):
        raise ValueError(f"TP·PP·CP = {tp}·{pp}·{cp} = {tp * pp * cp} does not divide the world size {world_size}")
    dp = world_size // (tp * pp * cp)
    if dp % ep:
        raise ValueError(f"EP={ep} does not divide the data-parallel degree {dp}")
    if sorted(order.split("-")) != sorted(DIMENSIONS):
        raise ValueError(f"placement order {order!r} must name each of {', '.join(DIMENSIONS)} once")
    return {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}


def plan_layout(
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    ranks_per_node: int | None = None,
    topo: Topology | None = None,
    instance: Any = None,
    lnc: int = 1,
) -> Plan:
    """Lay out ``world_size`` ranks and plan their groups.

    Without a topology every layout that divides is accepted (a CPU host). With one, the first device
    order under which every group obeys the topology rules is used; ValueError names the degree that
    does not divide, PlacementError the rule a group breaks."""
    degrees = _degrees(world_size, tp, pp, cp, ep, order)
    ranks_per_node = ranks_per_node or world_size
    positions = _position_groups(world_size, degrees, order)
    full_node = topo is not None and ranks_per_node == topo.ranks_per_node
    orders = (
        candidate_orders(instance, topo, tp, lnc) if topo is not None and instance is not None and full_node else ["identity"]
    )
    first_violation = None
    for name in orders:
        core_of_position = local_order(name, topo) if topo is not None and full_node else np.arange(ranks_per_node)
        pos = np.arange(world_size)
        rank_of_position = (pos // ranks_per_node) * ranks_per_node + core_of_position[pos % ranks_per_node]
        groups = {dim: rank_of_position[g] for dim, g in positions.items()}
        violation = _first_violation(groups, degrees, topo, instance, lnc, ranks_per_node)
        if violation is None:
            break
        first_violation = first_violation or violation
    else:
        assert first_violation is not None and topo is not None  # every order broke a rule: a topology was given
        dim, (reason, example) = first_violation
        key = f"distributed_strategy.{DEGREE_KEYS[dim]}" if dim != "dp" else "distributed_strategy"
        value = degrees[dim] if dim != "dp" else "TP{tp}×PP{pp}×CP{cp} (DP{dp})".format(**degrees)
        raise PlacementError(key, value, f"{topo.name}: {dim.upper()} group {_short(example)} breaks a topology rule: {reason}")
    as_lists = {dim: sorted(g.tolist()) for dim, g in groups.items()}
    return Plan(
        world_size=world_size,
        num_nodes=-(-world_size // ranks_per_node),
        ranks_per_node=ranks_per_node,
        order=order,
        degrees=degrees,
        groups=as_lists,
        instance=getattr(instance, "name", "cpu"),
        lnc=lnc,
        ranks_per_device=topo.ranks_per_device if topo is not None and topo.graph != "host" else 1,
        device_order=name,
    )


def _short(group: list[int]) -> str:
    return str(group) if len(group) <= 8 else f"[{', '.join(map(str, group[:6]))}, … {group[-1]}]"


def _first_violation(
    groups: dict[str, np.ndarray], degrees: dict[str, int], topo: Topology | None, instance: Any, lnc: int, ranks_per_node: int
) -> tuple[str, tuple[str, list[int]]] | None:
    if topo is None or instance is None or topo.graph == "host":
        return None
    sizes = accepted_sizes(instance, lnc)
    for dim in CHECKED_DIMENSIONS:
        if degrees[dim] > 1:
            v = group_violation(groups[dim], topo, sizes, ranks_per_node)
            if v:
                return dim, v
    return None


def workable_tp_degrees(
    world_size: int, *, pp: int, cp: int, ep: int, order: str, ranks_per_node: int, topo: Topology, instance: Any, lnc: int
) -> list[int]:
    """TP degrees that give a valid layout with the other degrees unchanged (for error messages)."""
    good = []
    for tp in range(1, world_size + 1):
        if world_size % (tp * pp * cp) or (world_size // (tp * pp * cp)) % ep:
            continue
        try:
            plan_layout(
                world_size,
                tp=tp,
                pp=pp,
                cp=cp,
                ep=ep,
                order=order,
                ranks_per_node=ranks_per_node,
                topo=topo,
                instance=instance,
                lnc=lnc,
            )
        except PlacementError:
            continue
        good.append(tp)
    return good


def node_topology(cfg: Any) -> Topology:
    """The topology a config runs on (LNC and ranks per node checked); raises ConfigError."""
    inst, trainer = cfg.instance, cfg.trainer
    try:
        lnc = check_lnc(inst, trainer.lnc)
        topo = topology_of(inst, lnc, ranks_per_node=trainer.devices)
    except TopologyError as exc:
        raise ConfigError("trainer.lnc" if "LNC" in str(exc) else "instance", "", str(exc)) from None
    if trainer.devices is not None and trainer.devices > topo.ranks_per_node:
        raise ConfigError("trainer.devices", trainer.devices, f"a {inst.name} node has {topo.ranks_per_node} ranks at LNC {lnc}")
    return topo


def plan(cfg: Any, calibration: dict[str, Any] | None = None, *, estimate: bool = True) -> Plan:
    """The Plan of a validated config: layout, groups, algorithms, cost and memory estimates.
    ``calibration`` (``nxdt comm-test --calibrate``) replaces the ``cpu`` instance's default link figures."""
    ds, trainer, inst = cfg.distributed_strategy, cfg.trainer, cfg.instance
    topo = node_topology(cfg)
    lnc = check_lnc(inst, trainer.lnc)
    world = trainer.num_nodes * trainer.devices
    kwargs = dict(
        pp=ds.pipeline_model_parallel_size,
        cp=ds.context_parallel_size,
        ep=ds.expert_model_parallel_size,
        order=ds.placement_order,
        ranks_per_node=trainer.devices,
        topo=topo,
        instance=inst,
        lnc=lnc,
    )
    try:
        layout = plan_layout(world, tp=ds.tensor_model_parallel_size, **kwargs)
    except PlacementError as exc:
        good = workable_tp_degrees(world, **kwargs)
        hint = (
            f"; TP degrees that work here: {', '.join(map(str, good))}"
            if good
            else "; no TP degree works with these PP/CP/EP degrees"
        )
        raise PlacementError(exc.key, exc.value, exc.fix + hint) from None
    except ValueError as exc:
        raise ConfigError("distributed_strategy", "", str(exc)) from None
    data = cfg.data
    layout.batch = batch_plan(data, layout.dp)  # global null: micro × DP (validate() has resolved it already)
    batch = layout.batch["global"]
    if data.global_batch_size is None:  # an unvalidated config: the estimates read the number from a copy
        import copy

        cfg, data = copy.copy(cfg), copy.copy(data)
        data.global_batch_size, cfg.data = batch, data
    if estimate:
        from nxdt.planner.estimate import estimate_plan

        estimate_plan(layout, _in_sequences(cfg), topo, calibration)
    return layout


def _in_sequences(cfg: Any) -> Any:
    """Preference data (DPO, ORPO): a sample is a pair, two sequences through the model (batch sizes count pairs), so
    the estimates see twice the micro and global batch in sequences; other data unchanged."""
    if getattr(cfg.data, "source", None) != "preferences":
        return cfg
    import copy

    cfg, data = copy.copy(cfg), copy.copy(cfg.data)
    data.micro_batch_size, data.global_batch_size, cfg.data = 2 * data.micro_batch_size, 2 * data.global_batch_size, data
    return cfg
