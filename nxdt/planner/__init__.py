"""The planner: ``plan(config) -> Plan``, pure (no processes, no torch.distributed).

This first version lays ranks out and plans the communicator groups; the topology-aware placement,
algorithm choice and the cost/memory model plug in behind the same ``plan`` interface.

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
``ep × (dp/ep)``, ep fastest, so ep groups are pairs of consecutive DP ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")


@dataclass
class Plan:
    world_size: int
    num_nodes: int
    ranks_per_node: int
    order: str
    degrees: dict[str, int]
    groups: dict[str, list[list[int]]]
    placement: list[dict[str, int]]
    warnings: list[str] = field(default_factory=list)

    def group_of(self, dim: str, rank: int) -> list[int]:
        for group in self.groups[dim]:
            if rank in group:
                return group
        raise KeyError(f"rank {rank} is in no {dim} group")

    def coords(self, rank: int) -> dict[str, int]:
        """Index of ``rank`` within each of its groups (its tp rank, dp rank, ...)."""
        return {dim: self.group_of(dim, rank).index(rank) for dim in self.groups}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls(**json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    def summary(self) -> str:
        d = self.degrees
        lines = [f"world {self.world_size} = {self.num_nodes} node(s) × {self.ranks_per_node} ranks; "
                 f"TP{d['tp']} PP{d['pp']} CP{d['cp']} EP{d['ep']} DP{d['dp']} (order {self.order})"]
        for dim in ("tp", "cp", "ep", "dp", "pp", "mp"):
            groups = self.groups[dim]
            shown = " ".join(str(g) for g in groups[:8]) + (f" … ({len(groups)} groups)" if len(groups) > 8 else "")
            lines.append(f"  {dim:>2} groups: {shown}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _groups_along(grid: np.ndarray, axis: int) -> list[list[int]]:
    moved = np.moveaxis(grid, axis, -1)
    return moved.reshape(-1, moved.shape[-1]).tolist()


def plan_layout(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                order: str = "tp-cp-ep-dp-pp", ranks_per_node: int | None = None) -> Plan:
    """Lay out ``world_size`` ranks; raises ValueError naming the degree that does not fit."""
    if world_size % (tp * pp * cp):
        raise ValueError(f"TP·PP·CP = {tp}·{pp}·{cp} = {tp * pp * cp} does not divide the world size {world_size}")
    dp = world_size // (tp * pp * cp)
    if dp % ep:
        raise ValueError(f"EP={ep} does not divide the data-parallel degree {dp}")
    names = order.split("-")
    if sorted(names) != sorted(DIMENSIONS):
        raise ValueError(f"placement order {order!r} must name each of {', '.join(DIMENSIONS)} once")
    ranks_per_node = ranks_per_node or world_size
    # EP is a sub-axis of DP: the "dp" axis of the grid holds only dp/ep (replicas across expert groups).
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp // ep, "pp": pp}
    # numpy reshape is row-major (last axis fastest), so reverse the fastest-first order.
    grid = np.arange(world_size).reshape([sizes[n] for n in reversed(names)])
    axis = {n: len(names) - 1 - i for i, n in enumerate(names)}
    groups = {n: _groups_along(grid, axis[n]) for n in ("tp", "cp", "ep", "pp")}
    # data-parallel groups span both the ep and the remaining dp axes
    dp_grid = np.moveaxis(grid, [axis["ep"], axis["dp"]], [-1, -2])
    groups["dp"] = dp_grid.reshape(-1, dp).tolist()
    mp_grid = np.moveaxis(grid, [axis["tp"], axis["pp"]], [-1, -2])
    groups["mp"] = mp_grid.reshape(-1, tp * pp).tolist()
    groups["world"] = [list(range(world_size))]
    for g in groups.values():
        g.sort()
    placement = [{"rank": r, "node": r // ranks_per_node, "local_rank": r % ranks_per_node} for r in range(world_size)]
    return Plan(world_size=world_size, num_nodes=-(-world_size // ranks_per_node), ranks_per_node=ranks_per_node, order=order,
                degrees={"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}, groups=groups, placement=placement)


def plan(cfg: Any) -> Plan:
    """The Plan of a validated config."""
    ds = cfg.distributed_strategy
    return plan_layout(cfg.trainer.num_nodes * cfg.trainer.devices, tp=ds.tensor_model_parallel_size,
                       pp=ds.pipeline_model_parallel_size, cp=ds.context_parallel_size, ep=ds.expert_model_parallel_size,
                       order=ds.placement_order, ranks_per_node=cfg.trainer.devices)
