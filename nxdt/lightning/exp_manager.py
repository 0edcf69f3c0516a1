"""Experiment manager: what a run leaves in its directory.

``metrics.csv`` (one row per logged step, flushed as written so a crash loses nothing already
logged), TensorBoard event files, ``checkpoints/step-<N>/`` (atomic, ``keep_last_k``), the newest
complete checkpoint for ``resume_if_exists``, and a rich progress bar on rank 0.
"""

from __future__ import annotations

import csv
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from nxdt.lightning import checkpoint as ckpt_io

# the last three are filled under FSDP: time compute waited for its communication, the share of that
# communication hidden behind compute, and the most gathered-parameter bytes held at once
METRIC_COLUMNS = ("step", "loss", "lr", "step_time_s", "tokens_per_s", "peak_rss_mb", "wall_time",
                  "exposed_comm_s", "overlap_pct", "peak_gathered_bytes")


class StepMetricsLogger(Callback):
    """Writes ``metrics.csv`` (and TensorBoard scalars) from the module's ``step_metrics``, on rank 0."""

    def __init__(self, path: Path, tokens_per_step: int, every_n_steps: int = 1, extra_columns: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        self.columns = METRIC_COLUMNS + tuple(extra_columns)  # e.g. grad_norm, param_norm (exp_manager.log_*_norm)
        self.tokens_per_step = tokens_per_step
        self.every_n_steps = max(1, every_n_steps)
        self._last_time: float | None = None
        self._last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_time = time.perf_counter()
        self._last_step = trainer.global_step
        if trainer.is_global_zero:
            self._truncate_after(trainer.global_step)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop rows a crashed attempt logged past the checkpoint: they are re-run now."""
        if not self.path.exists():
            return
        with open(self.path, newline="") as fh:
            rows = [r for r in csv.DictReader(fh) if int(r["step"]) <= step]
        with open(self.path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = getattr(pl_module, "step_metrics", None)
        if not metrics or metrics["step"] == self._last_step:
            return  # mid-accumulation: no optimizer step happened
        now = time.perf_counter()
        step_time = (now - self._last_time) / max(1, metrics["step"] - self._last_step)
        self._last_time, self._last_step = now, metrics["step"]
        if not trainer.is_global_zero or metrics["step"] % self.every_n_steps:
            return
        row = {**metrics, "step_time_s": step_time, "wall_time": round(time.time(), 3), "tokens_per_s": self.tokens_per_step / step_time if step_time > 0 else 0.0,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # rank 0's high-water mark (Linux: KiB)
        new_file = not self.path.exists()
        with open(self.path, "a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore")
            if new_file:
                writer.writeheader()
            writer.writerow(row)
        for logger in trainer.loggers:
            logger.log_metrics({k: v for k, v in row.items() if k != "step"}, step=row["step"])


class InjectedFault(RuntimeError):
    """Raised on purpose by :class:`FaultInjection` (reliability drills and tests)."""


class FaultInjection(Callback):
    """Fail on ``rank`` when optimizer step ``step`` starts, in launch attempt ``attempt`` only: rehearses
    a crash for real. ``raise``: an exception; ``sigkill``: the process vanishes (no cleanup, as after an
    OOM kill); ``sigkill_during_save``: the process vanishes in the middle of the next checkpoint write,
    after its files are written and before it is committed; ``hang``: the process stops responding (a stuck
    rank or host: the others wait until their collective timeout, or until the host is killed); ``nan``: the
    rank's loss of that step is NaN (the module's ``inject_nan``), as after an overflow."""

    def __init__(self, step: int, rank: int | None, kind: str = "raise", attempt: int = 0) -> None:
        self.step, self.rank, self.kind, self.attempt = step, rank, kind, attempt
        self._nan_injected = False

    def _armed(self, trainer: pl.Trainer) -> bool:
        return self.rank in (None, trainer.global_rank) and launch_attempt() == self.attempt

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.kind == "sigkill_during_save" and self._armed(trainer) and hasattr(trainer.strategy, "before_checkpoint_commit"):
            def die_if_due(tmp_dir: Any) -> None:
                if trainer.global_step >= self.step:
                    os.kill(os.getpid(), signal.SIGKILL)

            trainer.strategy.before_checkpoint_commit = die_if_due

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.kind == "sigkill_during_save" or trainer.global_step + 1 != self.step or not self._armed(trainer):
            return
        if self.kind == "sigkill":
            print(f"nxdt: fault injection: SIGKILL on rank {trainer.global_rank} at step {self.step} (t={time.time():.3f})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "nan":  # once: a skipped step starts again with the same step number
            pl_module.inject_nan, self._nan_injected = not self._nan_injected, True
            return
        if self.kind == "hang":
            print(f"nxdt: fault injection: rank {trainer.global_rank} hangs at step {self.step} (t={time.time():.3f})", flush=True)
            while True:
                signal.pause()
        raise InjectedFault(f"injected fault at step {self.step} on rank {trainer.global_rank} (exp_manager.fault_injection)")


def launch_attempt() -> int:
    """0 for the first start of the workers, k after the k-th restart by the elastic agent (several nodes: the
    k-th rendezvous round, which every node agrees on; an agent restarted by another node's failure does not
    count that restart in TORCHELASTIC_RESTART_COUNT)."""
    return int(os.environ.get("NXDT_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class DirectoryCheckpoint(ModelCheckpoint):
    """Lightning's checkpoint scheduling (every N steps, keep the newest k) writing ``step-<N>`` directories."""

    FILE_EXTENSION = ""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def resume_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run; leftovers of an interrupted save are removed first."""
    ckpt_io.remove_incomplete(checkpoint_dir(run_dir))
    return ckpt_io.latest_complete(checkpoint_dir(run_dir))


def agreed_resume_checkpoint(cfg: Any, run_dir: str | Path) -> Path | None:
    """The checkpoint every rank resumes from: the one named in the config; otherwise, when resuming
    (``resume_if_exists`` or a restart after a crash), the newest complete one — decided by rank 0 and
    published through the launcher's rendezvous store, so ranks never disagree (a file system listing
    can differ between ranks while a save is being committed)."""
    em = cfg.exp_manager
    if em.resume_from_checkpoint:
        return Path(em.resume_from_checkpoint).expanduser()
    attempt = launch_attempt()
    if not (em.resume_if_exists or attempt > 0):
        return None
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) == 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return resume_checkpoint(run_dir)
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=cfg.comm.timeout_s))
    key = f"nxdt/resume/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}"
    if int(env["RANK"]) == 0:
        chosen = resume_checkpoint(run_dir)
        store.set(key, str(chosen or ""))
    else:
        chosen = store.get(key).decode() or None
    return Path(chosen) if chosen else None


def build_callbacks(cfg: Any, run_dir: Path, tokens_per_step: int, *, show_progress: bool) -> list[Callback]:
    em = cfg.exp_manager
    norms = tuple(c for c, on in (("grad_norm", em.log_gradient_norm), ("param_norm", em.log_parameter_norm)) if on)
    callbacks: list[Callback] = [StepMetricsLogger(run_dir / "metrics.csv", tokens_per_step, cfg.trainer.log_every_n_steps, norms)]
    every = cfg.exp_manager.checkpoint_every_n_steps
    if every:
        callbacks.append(DirectoryCheckpoint(
            dirpath=checkpoint_dir(run_dir), filename="step-{step}", auto_insert_metric_name=False,
            every_n_train_steps=every, save_top_k=cfg.exp_manager.keep_last_k, monitor="step", mode="max",
            save_last=False, save_on_train_epoch_end=False,
        ))
    fault = cfg.exp_manager.fault_injection
    if fault.step is not None:
        callbacks.append(FaultInjection(fault.step, fault.rank, fault.kind, fault.attempt))
    if show_progress:
        callbacks.append(RichProgressBar(leave=True))
    return callbacks


def build_loggers(cfg: Any, run_dir: Path) -> list[Any]:
    if not cfg.exp_manager.create_tensorboard_logger:
        return []
    return [TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False)]
