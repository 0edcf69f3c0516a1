"""``exp_manager.profile_steps``: torch.profiler over a window of optimizer steps, on every rank.

Each rank writes ``profile/rank<k>.json`` (a Chrome trace; Perfetto opens it) and ``profile/rank<k>.txt``: the
window's wall time, on a GPU the time the GPU was busy (the union of its kernels' and copies' intervals) as a share of
it — what tells a step the host holds back from one the device bounds — and the ops by self time. The window starts
after the device has finished the steps before it and ends once it has finished the last, so the figures are the
window's own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

TOP_OPS = 30  # rows of the ops table


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (seconds or any one unit)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class StepProfiler(Callback):
    """Profile optimizer steps ``first``..``last`` (1-based, inclusive) into ``profile_dir``."""

    def __init__(self, profile_dir: Path, first: int, last: int) -> None:
        self.profile_dir, self.first, self.last = Path(profile_dir), first, last
        self._prof: Any = None
        self._started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._prof is not None or trainer.global_step + 1 != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if pl_module.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        _sync(pl_module.device)
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._prof is not None and trainer.global_step >= self.last:
            self._finish(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._prof is not None:  # training ended inside the window (max_epochs, a stop)
            self._finish(trainer, pl_module)

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        _sync(device)
        wall = time.perf_counter() - self._started
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        last = min(self.last, trainer.global_step)
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        prof.export_chrome_trace(str(self.profile_dir / f"rank{rank}.json"))
        span = f"step {last}" if last == self.first else f"steps {self.first}-{last}"
        (self.profile_dir / f"rank{rank}.txt").write_text(summary(prof, wall, device, f"{span} on rank {rank}"))


def summary(prof: Any, wall: float, device: torch.device, span: str) -> str:
    """The report of a finished profile ``prof`` over ``wall`` seconds: on a GPU the share of them the GPU was busy
    (the union of its kernels' and copies' intervals), then the ops by self time (on the device where there is one).
    ``experiments/gpu/plain_loop.py --profile`` writes the same report for the plain loop, to set beside nxdt's."""
    lines = [f"{span} ({device}): {wall:.3f} s wall"]
    on_gpu = device.type == "cuda"
    if on_gpu:
        kernels = [
            (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        busy = busy_seconds(kernels) / 1e6  # the profiler's clock counts microseconds
        lines.append(f"GPU busy {busy:.3f} s: {100 * busy / wall:.1f} % of the wall time ({len(kernels)} kernels and copies)")
        if kernels:  # from the first kernel's start to the last one's end: the device's own view of the window
            span_s = (max(e for _, e in kernels) - min(s for s, _ in kernels)) / 1e6
            lines.append(f"GPU span {span_s:.3f} s: busy {100 * busy / span_s:.1f} % of it")
    sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    lines.append(prof.key_averages().table(sort_by=sort, row_limit=TOP_OPS))
    return "\n".join(lines) + "\n"
