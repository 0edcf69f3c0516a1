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
# Training throughputs, per device class: the catalogue entry that holds the compute parameters, and the instances
# whose figures determine them (p4de.24xlarge inherits p4d's A100 compute values: the same chip, other HBM). The
# matmul efficiency is E · g/(g + g½) · T/(T + T½) (nxdt.planner.estimate.matmul_efficiency): E the large-GEMM
# efficiency (E_fp32 apart for fp32 training, against the fp32 / TF32 peak), g½ the per-rank GEMM width and T½ the
# tokens per micro-batch at which a GEMM reaches half of it. Each is determined by figures that vary it: on trn1
# widths 128-1,024 (Llama, GPT-3, BERT) and micro-batches of 1,024-8,192 tokens (BERT phase 2 / phase 1, GPT-3,
# Llama); on A100 widths 1,024-7,168 (BERT, MPT) and 4,096-65,536 tokens (BERT, SQuAD, MPT); on H100
# widths 1,024-7,168 and 4,096-65,536 tokens (MPT, torchtitan). The fp32 figures: A100 TF32 BERT (many, E_fp32 fitted),
# trn1 one (predicted with bf16's E: see STEP_PARAMS).
STEP_PARAMS = {
    # trn1: no E_fp32 of its own. neuronx-cc auto-casts fp32 matmuls to bf16 by default (peak_tflops_fp32 is the bf16
    # rate), so they run at bf16's efficiency; the fp32 figure is predicted from it, not fitted (one figure would
    # otherwise set the value alone, and its leave-one-out would say nothing)
    "trn1.32xlarge": ["compute_efficiency", "compute_half_size", "compute_half_tokens"],
    "p4d.24xlarge": ["compute_efficiency", "compute_efficiency_fp32", "compute_half_size", "compute_half_tokens"],
    # H100: no width term (fitted with one, it runs to 0: the MPT and torchtitan figures at widths 1,024-7,168 show
    # none; the A100's width term comes from BERT-Large at 1,024 against MPT, which the H100 figures do not have)
    "p5.48xlarge": ["compute_efficiency", "compute_half_tokens"],
}
STEP_MEMBERS = {"p4d.24xlarge": ("p4d.24xlarge", "p4de.24xlarge")}  # else the entry alone


def step_members(name: str) -> tuple[str, ...]:
    """The instances whose training figures fit the compute parameters ``name`` holds."""
    return STEP_MEMBERS.get(name, (name,))


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

    ``bind_step`` plans it once with matmul efficiency 1 (and the instance's collective parameters): the matmuls' time
    scales as 1 / efficiency, the memory-bound work (``memory_s``) and the blocking communication do not depend on it,
    a pipeline's bubble is a fixed share of compute (``bubble``: (compute + bubble) / compute), and communication
    that runs behind compute (FSDP's prefetched gathers and scatters, ``overlap_s``) is exposed only by what exceeds
    compute (plus ``cover_s``: what else it hides behind). So the step time for any compute parameters is
    ``bubble · c + exposed_s + max(0, overlap_s - c - cover_s)`` with ``c = work / efficiency + memory``, the
    efficiency that of nxdt.planner.estimate.matmul_efficiency at the figure's width, precision and tokens per
    micro-batch: what the planner's estimate_plan computes (fit.py checks every fitted figure against a full plan)."""

    id: str
    instance: str
    overrides: list[str]
    seq_per_s: float
    global_batch: int = 0
    work_s: float = 0.0  # matmul compute at efficiency 1
    exposed_s: float = 0.0  # blocking communication per step (exposed whatever the compute)
    width: float = 0.0  # hidden_size / TP
    memory_s: float = 0.0  # memory-bound (non-matmul) work
    precision: str = "bf16"  # precision.type as the efficiency sees it (fp32 or not)
    tokens: float = 0.0  # tokens per micro-batch on a rank
    bubble: float = 1.0  # (compute + pipeline bubble) / compute
    overlap_s: float = 0.0  # communication that hides behind compute
    cover_s: float = 0.0  # what else it hides behind (FSDP token_threaded: the other dimensions' collectives)
    label: str = ""  # the class its source file gives it (held-out files folded into the fit), else ""
    cfg: Any = field(default=None, repr=False)  # the composed configuration (from ``bind_step``)
    base: Any = field(default=None, repr=False)  # the instance it was bound on (its links, memory, peak)

    @property
    def seconds(self) -> float:
        return self.global_batch / self.seq_per_s

    def predict(self, instance: Any) -> float:
        eff = matmul_efficiency(instance, self.width, self.precision, self.tokens)
        compute = self.work_s / eff + self.memory_s
        return self.bubble * compute + self.exposed_s + max(0.0, self.overlap_s - compute - self.cover_s)


@functools.lru_cache(maxsize=None)
def _composed_instance(name: str) -> Any:
    from nxdt.config import catalogue_instance as read_entry

    return read_entry(name)


def catalogue_instance(name: str) -> Any:
    """The catalogue entry as the planner sees it (an entry's ``defaults`` parent included: nxdt.config's reader,
    which tests/test_topology_planner.py checks against Hydra's compose); a copy, for fits to change."""
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
    fig.base = instance
    cfg = copy.deepcopy(fig.cfg)
    unit = {"compute_efficiency": 1.0, "compute_efficiency_fp32": 1.0, "compute_half_size": 0.0, "compute_half_tokens": 0.0}
    cfg.instance = with_params(instance, unit)
    planned = plan(cfg)
    if any("hidden_by_flops" in row for row in planned.collectives):
        raise ValueError(f"{fig.id}: context parallelism's ring hides behind the attention FLOPs (not linear in 1 / efficiency)")
    est = planned.estimate
    fig.global_batch = cfg.data.global_batch_size
    compute = est["compute_s"]
    fig.bubble = (compute + est["bubble_s"]) / compute if compute else 1.0
    fig.memory_s = est["memory_bound_s"]
    fig.work_s = compute - est["memory_bound_s"]
    fig.overlap_s = sum(row["total_s"] for row in planned.collectives if row["overlap"])
    fsdp = cfg.distributed_strategy.fsdp
    if fsdp.enabled and fsdp.prefetch == "token_threaded":
        fig.cover_s = sum(row["total_s"] for row in planned.collectives if not row["overlap"] and row["dim"] != "dp")
    fig.exposed_s = est["exposed_comm_s"] - max(0.0, fig.overlap_s - compute - fig.cover_s)
    fig.width = cfg.model.hidden_size / planned.tp
    fig.precision = "fp32" if cfg.precision.type.removesuffix("SR") == "fp32" else "bf16"
    fig.tokens = cfg.data.micro_batch_size * cfg.data.seq_length / planned.cp
    return fig


def plan_step_time(fig: StepFigure, instance: Any, paths: list[str] | None = None) -> float:
    """The planner's step time for the figure's configuration on ``instance`` (the full plan, no shortcut); with
    ``paths``, on the instance the figure was bound on with those compute values taken from ``instance`` (a p4de
    figure fitted with p4d's A100 values keeps p4de's memory and bandwidth)."""
    from nxdt.planner import plan

    cfg = copy.deepcopy(fig.cfg) if fig.cfg is not None else compose_step(fig)
    if paths is not None and fig.base is not None:
        instance = with_params(fig.base, {p: get_param(instance, p) for p in paths})
    cfg.instance = instance
    return plan(cfg).estimate["step_time_s"]


# Fractions of a peak rate: fitted in (0, 1) (a large GEMM cannot run faster than the datasheet's peak; without the
# bound, an efficiency curve fitted to widths of 1,024-7,168 extrapolates past the peak at larger widths).
FRACTIONS = frozenset({"compute_efficiency", "compute_efficiency_fp32"})


def _to_values(paths: list[str], x: np.ndarray) -> np.ndarray:
    """Parameters from the fit's coordinates: logistic for FRACTIONS, exp for the rest (all positive)."""
    return np.array([1 / (1 + np.exp(-v)) if p in FRACTIONS else np.exp(v) for p, v in zip(paths, x)])


def _to_coordinates(paths: list[str], values: list[float]) -> np.ndarray:
    return np.array([math.log(v / (1 - v)) if p in FRACTIONS else math.log(v) for p, v in zip(paths, values)])


def _residuals(figures: list, instance: Any, paths: list[str], logs: np.ndarray) -> np.ndarray:
    values = _to_values(paths, logs)
    if not np.all(np.isfinite(values) & (values > 0)):  # a trial step out of range: reject it
        return np.full(len(figures), 1e3)
    inst = with_params(instance, dict(zip(paths, values)))
    return np.array([math.log(f.predict(inst) / f.seconds) for f in figures])


def fit(
    figures: list, instance: Any, paths: list[str], start: dict[str, float] | None = None, iters: int = 200, tol: float = 1e-10
) -> dict[str, float]:
    """Values of ``paths`` minimising Σ log²(predicted / measured) over ``figures`` (Levenberg-Marquardt in log space,
    logit space for FRACTIONS; forward-difference Jacobian). ``start``: initial values (default: START)."""
    start = {**START, **(start or {})}
    x = _to_coordinates(paths, [start[p] for p in paths])
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
    return {p: float(v) for p, v in zip(paths, _to_values(paths, x))}


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
        StepFigure(
            e["id"],
            e["instance"],
            [*(shared(e["instance"]) if e.get("common", True) else []), *e["overrides"]],
            float(e["value"]),
            label=e.get("class", ""),
        )
        for e in data.get("end_to_end", [])
        if e.get("use", True)
    ]
    return collectives, steps


def round_sig(value: float, digits: int = 3) -> float:
    """``value`` to ``digits`` significant digits (how the catalogue stores fitted values)."""
    if value == 0:
        return 0.0
    return float(f"{value:.{digits}g}")
