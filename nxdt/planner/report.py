"""Human-readable plan (``nxdt plan``): summary, placement picture, groups, collectives, warnings."""

from __future__ import annotations

import string
from typing import Any

from nxdt.config.validate import DIMENSIONS, Dim

GROUP_LINES = 8  # groups listed per dimension before eliding


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


def _bytes(n: float) -> str:
    for factor, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= factor:
            return f"{n / factor:.3g} {unit}"
    return f"{n:.0f} B"


def placement_picture(plan: Any, grid: tuple[int, int] | None) -> list[str]:
    """Node 0's devices, each labelled with the TP groups (a, b, …) of the ranks it holds."""
    rpn, rpd = plan.ranks_per_node, plan.ranks_per_device
    labels = string.ascii_lowercase + string.ascii_uppercase
    group_label = {}
    for i, g in enumerate(plan.groups[Dim.TP]):
        for r in g:
            if r < rpn:
                group_label[r] = labels[i % len(labels)]
    devices = -(-rpn // rpd)
    cell = {
        d: "".join(sorted({group_label.get(r, "?") for r in range(d * rpd, min((d + 1) * rpd, rpn))})) for d in range(devices)
    }
    width = max(len(f"{d}:{cell[d]}") for d in cell) + 2
    lines = [f"placement on node 0 (device:TP groups it holds; letters name TP groups, order {plan.device_order}):"]
    if grid and grid[0] * grid[1] == devices:
        rows, cols = grid
        for r in range(rows):
            lines.append("  " + "".join(f"[{d}:{cell[d]}]".ljust(width + 2) for d in range(r * cols, (r + 1) * cols)))
    else:
        per_line = 8
        for start in range(0, devices, per_line):
            lines.append(
                "  " + "".join(f"[{d}:{cell[d]}]".ljust(width + 2) for d in range(start, min(devices, start + per_line)))
            )
    return lines


def render_plan(plan: Any, grid: tuple[int, int] | None = None) -> str:
    lnc = f", LNC {plan.lnc}" if plan.instance != "cpu" else ""
    lines = [
        f"{plan.instance}: world {plan.world_size} = {plan.num_nodes} node(s) × {plan.ranks_per_node} ranks{lnc}; "
        f"TP{plan.tp} PP{plan.pp} CP{plan.cp} EP{plan.ep} DP{plan.dp} (order {plan.order})"
    ]
    b = plan.batch
    if b:
        lines.append(
            f"batch: global {b['global']} = micro {b['micro']} × DP {plan.dp} × {plan.micro_batches} micro-batches per step, "
            f"sequence {b['seq_length']} ({_si(b['global'] * b['seq_length'], 'tokens')} per step)"
        )
    e = plan.estimate
    if e:
        mem = f"{e['memory_per_device_GiB']:.2f} GiB per device"
        if e.get("device_memory_GiB"):
            mem += f" of {e['device_memory_GiB']:g} GiB"
        calibrated = " (calibrated cpu links)" if e.get("calibrated") else ""
        lines += [
            f"estimate{calibrated}: step {_seconds(e['step_time_s'])} (compute {_seconds(e['compute_s'])}, "
            f"pipeline bubble {_seconds(e['bubble_s'])}, exposed comm {_seconds(e['exposed_comm_s'])} of "
            f"{_seconds(e['comm_s'])}); {_si(e['tokens_per_s'], 'tokens/s')}; MFU {100 * e['mfu']:.1f}%",
            f"memory: {mem} — " + ", ".join(f"{k} {_bytes(v)}" for k, v in e["memory_per_rank_bytes"].items()) + " per rank",
        ]
        source = e.get("calibration")
        if source:
            lines.append(
                f"calibration: {source.get('file')} (measured {source.get('date')} on {source.get('host')}; "
                "--calibration asked for it)"
            )
        cp = e.get("context_parallel")
        if cp:
            lines.append(
                f"context parallelism: the ring sends {_bytes(cp['ring_bytes_per_step'])} per rank and step "
                f"({_seconds(cp['ring_s'])}, {cp['ring_hidden_pct']:.0f}% behind attention compute, "
                f"{_seconds(cp['ring_exposed_s'])} exposed); activations {_bytes(cp['activation_bytes_saved'])} "
                "smaller per rank than CP 1"
            )
    if plan.ranks_per_device > 1 or grid:
        lines += placement_picture(plan, grid)
    lines.append("groups:")
    for dim in DIMENSIONS:
        groups = plan.groups[dim]
        if len(groups[0]) == 1:
            continue
        shown = " ".join(str(g) if len(g) <= 16 else f"[{g[0]}, {g[1]}, … {g[-1]}]" for g in groups[:GROUP_LINES])
        more = f" … ({len(groups)} groups)" if len(groups) > GROUP_LINES else ""
        lines.append(f"  {dim.value}: {shown}{more}")
    if len(lines) and lines[-1] == "groups:":
        lines[-1] = "groups: every dimension has size 1 except data parallelism over one rank"
    if plan.collectives:
        lines.append("collectives per step:")
        lines.append(
            f"  {'dim':<4}{'op':<16}{'group':>6}{'bytes':>12}{'count':>8}  {'algorithm':<14}{'each':>10}{'busbw':>12}{'total':>10}"
        )
        for r in plan.collectives:
            lines.append(
                f"  {r['dim'] + ' ':<4}{r['op']:<16}{r['group_size']:>6}{_bytes(r['bytes']):>12}{r['count']:>8}  "
                f"{r['algorithm']:<14}{_seconds(r['seconds']):>10}{r['busbw_GBps']:>8.1f} GB/s{_seconds(r['total_s']):>10}"
                + ("  (overlapped)" if r["overlap"] else "")
            )
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
