"""Fit the cost model's instance parameters to published measurements, and measure how well it predicts them.

A *figure* is one published number: the time of one collective (an nccom-test / nccl-tests row: op, ranks, nodes,
size) or the throughput of one training configuration (sequences per second of a stated model, layout, batch and
sequence). ``predict`` runs the planner's own code on a copy of the catalogue entry with some parameters replaced
(dotted paths such as ``inter_node.latency_us``), so a fitted value means exactly what the planner does with it.

``fit`` minimises the squared log-ratios predicted / measured (every figure weighs the same whatever its size) with
Levenberg-Marquardt over the logarithms of the parameters (all positive), numpy only. ``leave_one_out`` refits
without each figure in turn and predicts the one left out. The data file and the script that ships the results:
experiments/planner-accuracy/ (published.yaml, fit.py).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from nxdt.planner.cost import estimate_collective
from nxdt.planner.estimate import matmul_efficiency

# Which parameters each kind of figure can determine, per instance (the rest keep their catalogue values).
COLLECTIVE_PARAMS = {
    # nccom-test on one chip (2 ranks), one node (32 ranks) and two nodes (64 ranks): the software overhead per
    # collective and per rank from the 2- and 32-rank sweeps (at 1-64 KB, 58 and 150 µs: flat in size, so software,
    # not link steps), the intra-device bandwidth from the 2-rank sweep, the network's latency, efficiency and ramp
    # from the two-node one. The link step latencies are confounded with the overheads and the NeuronLink efficiency
    # with the network's in these sweeps: they keep their catalogue values.
    "trn1.32xlarge": [
        "collective_overhead_us",
        "collective_overhead_per_rank_us",
        "intra_device.efficiency",
        "inter_node.latency_us",
        "inter_node.efficiency",
        "inter_node.ramp_us",
        "inter_node.ramp_bytes",
    ],
    # nccl-tests all_reduce on 2 nodes x 8 GPUs (p4de, p5) and on 2-32 p5 nodes, and all-to-all on 2-32 p5 nodes
    # (its message cost): the network's latency carries every latency the 2-node sweep cannot separate (NVSwitch steps;
    # the per-call overhead is NCCL's base latency, kept), the NVSwitch bandwidth is hidden behind the slower network
    # stage (pipelined)
    "p4d.24xlarge": ["inter_node.latency_us", "inter_node.efficiency", "inter_node.ramp_us", "inter_node.ramp_bytes"],
    # p5 also from one H100 node (2, 4, 6 GPUs): NCCL's per-call cost, the NVLink efficiency (ring) and NVLS's
    "p5.48xlarge": [
        "collective_overhead_us",
        "device_link.efficiency",
        "nvls_efficiency",
        "inter_node.latency_us",
        "inter_node.efficiency",
        "inter_node.ramp_us",
        "inter_node.ramp_bytes",
        "inter_node.message_us",
    ],
}
# Training throughputs, per instance: on trn1 the compute efficiency curve over GEMM widths (its 5 Llama figures span
# widths 128-1024; fitting the NeuronLink efficiency with it too was tried and is degenerate: the fit then explains
# them by communication alone); on p4de (BERT-Large, one width) the bf16 and fp32 (TF32) efficiencies apart. The curve
# over tokens per micro-batch (compute_half_tokens) is determined by neither: with it, trn1's fit does not improve
# (its figures have 4,096 or 8,192 tokens, confounded with the model) and p4de's runs to efficiencies above 1 (its
# SQuAD figures, 12,288 tokens, are 1.7x slower per FLOP than pre-training at 16,384-32,768: not a saturating curve).
STEP_PARAMS = {
    "trn1.32xlarge": ["compute_efficiency", "compute_half_size"],
    "p4de.24xlarge": ["compute_efficiency", "compute_efficiency_fp32"],
}
# Where every fit starts (fixed, so that a fit never depends on values an earlier fit wrote into the catalogue).
START = {
    "collective_overhead_us": 10.0,
    "collective_overhead_per_rank_us": 1.0,
    "intra_device.efficiency": 0.8,
    "inter_node.latency_us": 15.0,
    "inter_node.efficiency": 0.8,
    "inter_node.ramp_us": 100.0,
    "inter_node.ramp_bytes": 65536.0,
    "inter_node.message_us": 1.0,
    "device_link.efficiency": 0.8,
    "nvls_efficiency": 0.8,
    "compute_efficiency": 0.4,
    "compute_half_size": 128.0,
    "compute_efficiency_fp32": 0.4,
    "compute_half_tokens": 4096.0,
}


def get_param(instance: Any, path: str) -> float:
    obj = instance
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def with_params(instance: Any, values: dict[str, float]) -> Any:
    """A deep copy of ``instance`` with the dotted ``values`` set."""
    out = copy.deepcopy(instance)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        obj = out
        for part in parents:
            obj = getattr(obj, part)
        setattr(obj, leaf, float(value))
    return out


def effective(instance: Any, path: str) -> float:
    """The value the planner uses for ``path``: a link's unset efficiency is the instance's link_efficiency."""
    value = get_param(instance, path)
    if value is None and path.endswith(".efficiency"):
        return instance.link_efficiency
    if value is None and path == "compute_efficiency_fp32":
        return instance.compute_efficiency
    return value


@dataclass
class CollectiveFigure:
    """One published collective time: ``op`` on ``ranks`` over ``nodes`` nodes, ``nbytes``, ``seconds``."""

    id: str
    instance: str
    op: str
    ranks: int
    nodes: int
    nbytes: int
    seconds: float
    topo: Any = field(default=None, repr=False)  # the node topology the planner uses (from ``bind``)

    def predict(self, instance: Any) -> float:
        per_node = self.ranks // self.nodes
        return estimate_collective(self.op, list(range(self.ranks)), self.nbytes, self.topo, instance, per_node)[1]


@dataclass
class StepFigure:
    """One published training throughput (sequences per second) of the configuration ``overrides`` compose.

    ``bind_step`` plans it once with matmul efficiency 1 (and the instance's collective parameters): the matmuls' share
    of compute and bubble scales as 1 / efficiency, the memory-bound work (``memory_s``, its bubble share included) and
    the exposed communication do not depend on it (no FSDP overlap in these layouts; checked), so the step time for any
    compute parameters is ``work / efficiency + memory + exposed``, the efficiency that of
    nxdt.planner.estimate.matmul_efficiency at the figure's width, precision and tokens per micro-batch."""

    id: str
    instance: str
    overrides: list[str]
    seq_per_s: float
    global_batch: int = 0
    work_s: float = 0.0  # compute + bubble at efficiency 1
    exposed_s: float = 0.0  # exposed communication per step
    width: float = 0.0  # hidden_size / TP
    memory_s: float = 0.0  # memory-bound (non-matmul) work + its bubble share
    precision: str = "bf16"  # precision.type as the efficiency sees it (fp32 or not)
    tokens: float = 0.0  # tokens per micro-batch on a rank
    cfg: Any = field(default=None, repr=False)  # the composed configuration (from ``bind_step``)

    @property
    def seconds(self) -> float:
        return self.global_batch / self.seq_per_s

    def predict(self, instance: Any) -> float:
        eff = matmul_efficiency(instance, self.width, self.precision, self.tokens)
        return self.work_s / eff + self.memory_s + self.exposed_s


@functools.lru_cache(maxsize=None)
def _composed_instance(name: str) -> Any:
    from nxdt.config import compose_config

    return compose_config([f"instance={name}"], check=False).instance


def catalogue_instance(name: str) -> Any:
    """The catalogue entry as the planner sees it (composed: an entry's ``defaults`` parent included); a copy."""
    return copy.deepcopy(_composed_instance(name))


def bind_collective(fig: CollectiveFigure, cache: dict | None = None) -> CollectiveFigure:
    """Attach the node topology the planner (and ``nxdt comm-test --estimate``) uses for this figure's ranks
    (``cache``: shared between figures); the instance's default LNC, ``ranks / nodes`` ranks on each node."""
    from nxdt.topology import check_lnc, topology_of

    cache = {} if cache is None else cache
    key = (fig.instance, fig.ranks, fig.nodes)
    if key not in cache:
        instance = _composed_instance(fig.instance)
        topo = topology_of(instance, check_lnc(instance, None), ranks_per_node=fig.ranks // fig.nodes)
        if fig.ranks // fig.nodes > topo.ranks_per_node:
            raise ValueError(
                f"{fig.id}: {fig.ranks // fig.nodes} ranks per node, a {fig.instance} node has {topo.ranks_per_node}"
            )
        cache[key] = topo
    fig.topo = cache[key]
    return fig


def compose_step(fig: StepFigure) -> Any:
    """The figure's configuration as its framework ran it: NxD Training reduces the DP gradients after backward (its
    optimizer step's bucket_allreduce_gradients, neuronx_distributed/parallel_layers/grads.py), not behind it as nxdt's
    overlap_grad_reduce does, so the exposed communication stays all of it (and linear in nothing)."""
    from nxdt.config import compose_config

    return compose_config([*fig.overrides, "distributed_strategy.overlap_grad_reduce=false"], check=False)


def bind_step(fig: StepFigure, instance: Any) -> StepFigure:
    """Plan the figure's configuration once on ``instance`` (collective parameters as given) at efficiency 1."""
    from nxdt.planner import plan

    fig.cfg = compose_step(fig)
    cfg = copy.deepcopy(fig.cfg)
    unit = {"compute_efficiency": 1.0, "compute_efficiency_fp32": 1.0, "compute_half_size": 0.0, "compute_half_tokens": 0.0}
    cfg.instance = with_params(instance, unit)
    planned = plan(cfg)
    if any(row["overlap"] for row in planned.collectives):
        raise ValueError(f"{fig.id}: overlapped collectives make the step time non-linear in the compute efficiency")
    est = planned.estimate
    fig.exposed_s = est["exposed_comm_s"]
    fig.global_batch = cfg.data.global_batch_size
    with_bubble = (est["compute_s"] + est["bubble_s"]) / est["compute_s"] if est["compute_s"] else 1.0
    fig.memory_s = est["memory_bound_s"] * with_bubble
    fig.work_s = (est["compute_s"] - est["memory_bound_s"]) * with_bubble
    fig.width = cfg.model.hidden_size / planned.tp
    fig.precision = "fp32" if cfg.precision.type.removesuffix("SR") == "fp32" else "bf16"
    fig.tokens = cfg.data.micro_batch_size * cfg.data.seq_length / planned.cp
    return fig


def plan_step_time(fig: StepFigure, instance: Any) -> float:
    """The planner's step time for the figure's configuration on ``instance`` (the full plan, no shortcut)."""
    from nxdt.planner import plan

    cfg = copy.deepcopy(fig.cfg) if fig.cfg is not None else compose_step(fig)
    cfg.instance = instance
    return plan(cfg).estimate["step_time_s"]


def _residuals(figures: list, instance: Any, paths: list[str], logs: np.ndarray) -> np.ndarray:
    values = np.exp(logs)
    if not np.all(np.isfinite(values) & (values > 0)):  # a trial step out of range: reject it
        return np.full(len(figures), 1e3)
    inst = with_params(instance, dict(zip(paths, values)))
    return np.array([math.log(f.predict(inst) / f.seconds) for f in figures])


def fit(
    figures: list, instance: Any, paths: list[str], start: dict[str, float] | None = None, iters: int = 200, tol: float = 1e-10
) -> dict[str, float]:
    """Values of ``paths`` minimising Σ log²(predicted / measured) over ``figures`` (Levenberg-Marquardt in log space,
    forward-difference Jacobian). ``start``: initial values (default: START)."""
    start = {**START, **(start or {})}
    x = np.log([start[p] for p in paths])
    r = _residuals(figures, instance, paths, x)
    cost, lam, h = float(r @ r), 1e-3, 1e-6
    for _ in range(iters):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            dx = np.zeros_like(x)
            dx[j] = h
            jac[:, j] = (_residuals(figures, instance, paths, x + dx) - r) / h
        a, g = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e12:
            step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
            r_new = _residuals(figures, instance, paths, x + step)
            cost_new = float(r_new @ r_new)
            if cost_new < cost:
                improved = cost - cost_new > tol * max(cost, 1e-30)
                x, r, cost, lam = x + step, r_new, cost_new, max(lam / 3, 1e-12)
                break
            lam *= 4
        if not improved:
            break
    return {p: float(v) for p, v in zip(paths, np.exp(x))}


def leave_one_out(
    figures: list,
    instance: Any,
    paths: list[str],
    start: dict[str, float] | None = None,
    on_fold: Callable[[int], None] | None = None,
) -> list[float]:
    """For each figure, its prediction by the model fitted to all the others (from the same start)."""
    out = []
    for i, fig in enumerate(figures):
        rest = figures[:i] + figures[i + 1 :]
        values = fit(rest, instance, paths, start)
        out.append(fig.predict(with_params(instance, values)))
        if on_fold:
            on_fold(i)
    return out


def _seconds(entry: dict[str, Any], size: float, value: float) -> float:
    """A point's time: printed in µs (the default), or as nccl-tests' algbw in GB/s (``unit: algbw_GBps``), which
    nccl-tests defines as size / time."""
    unit = entry.get("unit", "us")
    if unit == "us":
        return float(value) * 1e-6
    if unit == "algbw_GBps":
        return float(size) / (float(value) * 1e9)
    raise ValueError(f"{entry['id']}: unit {unit!r} (us | algbw_GBps)")


def load_published(data: dict[str, Any]) -> tuple[list[CollectiveFigure], list[StepFigure]]:
    """The figures of a published.yaml mapping that are marked for use (``use: false`` entries are skipped)."""
    collectives = [
        CollectiveFigure(f"{e['id']}@{size}", e["instance"], e["op"], e["ranks"], e["nodes"], int(size), _seconds(e, size, value))
        for e in data.get("collectives", [])
        if e.get("use", True)
        for size, value in e["points"]
    ]
    common = data.get("end_to_end_common", {})  # per instance (a list: for every entry)
    shared = lambda name: list(common.get(name, []) if isinstance(common, dict) else common)
    steps = [
        StepFigure(e["id"], e["instance"], [*shared(e["instance"]), *e["overrides"]], float(e["value"]))
        for e in data.get("end_to_end", [])
        if e.get("use", True)
    ]
    return collectives, steps


def round_sig(value: float, digits: int = 3) -> float:
    """``value`` to ``digits`` significant digits (how the catalogue stores fitted values)."""
    if value == 0:
        return 0.0
    return float(f"{value:.{digits}g}")
