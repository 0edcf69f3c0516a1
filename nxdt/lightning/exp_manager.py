"""Experiment manager: what a run leaves in its directory.

``metrics.csv`` (one row per logged step, flushed as written so a crash loses nothing already
logged), TensorBoard event files, ``checkpoints/step-<N>/`` (atomic, ``keep_last_k``), the newest
complete checkpoint for ``resume_if_exists``; on rank 0's console one line per logged step
(:class:`StepConsole`), each checkpoint announced, and on a terminal a rich progress bar counting steps.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from nxdt.data.throughput import tokens_per_s
from nxdt.lightning import checkpoint as ckpt_io

# exposed_comm_s, overlap_pct and peak_gathered_bytes are filled under FSDP: time compute waited for its communication,
# the share of that communication hidden behind compute, and the most gathered-parameter bytes held at once;
# peak_gpu_mb on GPU ranks: torch's high-water mark of the device memory it allocated (peak_rss_mb is host memory)
METRIC_COLUMNS = (
    "step",
    "loss",
    "lr",
    "step_time_s",
    "tokens_per_s",
    "peak_rss_mb",
    "wall_time",
    "exposed_comm_s",
    "overlap_pct",
    "peak_gathered_bytes",
    "peak_gpu_mb",
)


def console_mode() -> str:
    """quiet | normal | verbose: ``nxdt train -q/-v``, handed to the workers by the launcher (``nxdt.launch.console``)."""
    value = os.environ.get("NXDT_CONSOLE", "normal")
    return value if value in ("quiet", "normal", "verbose") else "normal"


class StepConsole:
    """One console line per logged step, on rank 0: step, loss, learning rate, tokens/s, MFU (when the instance's
    peak FLOP/s is known, not a placeholder), peak memory and, under FSDP, the communication compute waited for.

    MFU is the plan's own estimate scaled by measured over predicted throughput: the plan's FLOPs per token and
    peak (``nxdt.planner.estimate``) are used as they are, no formula is repeated here."""

    def __init__(
        self,
        max_steps: int,
        estimate: dict[str, Any] | None = None,
        peak_known: bool = False,
        objective: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> None:
        self.max_steps = max_steps
        self.objective = objective  # the objective's part of the line (DPO: reward accuracy; GRPO: rewards, KL)
        est = estimate or {}
        predicted, mfu = est.get("tokens_per_s") or 0.0, est.get("mfu") or 0.0
        self.mfu_per_token_per_s = mfu / predicted if peak_known and predicted > 0 and mfu > 0 else None

    @classmethod
    def for_run(cls, cfg: Any, run_dir: Path, objective: Callable[[dict[str, Any]], str | None] | None = None) -> "StepConsole":
        try:
            estimate = json.loads((Path(run_dir) / "plan.json").read_text()).get("estimate") or {}
        except (OSError, ValueError):
            estimate = {}
        key = "peak_tflops_fp32" if cfg.precision.type == "fp32" else "peak_tflops_bf16"
        provenance = getattr(cfg.instance, "provenance", None) or {}
        entry = provenance.get(key) if hasattr(provenance, "get") else None
        guessed = bool(getattr(entry, "guess", False) if not isinstance(entry, dict) else entry.get("guess"))
        return cls(
            cfg.trainer.max_steps, estimate, peak_known=bool(estimate.get("calibrated")) or not guessed, objective=objective
        )

    def line(self, row: dict[str, Any]) -> str:
        width = len(str(self.max_steps)) if self.max_steps and self.max_steps > 0 else 1
        total = f"/{self.max_steps}" if self.max_steps and self.max_steps > 0 else ""
        parts = [
            f"step {int(row['step']):>{width}}{total}",
            f"loss {row['loss']:.4f}",
            f"lr {row['lr']:.2e}",
            f"{row['tokens_per_s']:,.0f} tokens/s",
        ]
        if self.mfu_per_token_per_s is not None:
            parts.append(f"MFU {100 * self.mfu_per_token_per_s * row['tokens_per_s']:.1f}%")
        if row.get("peak_gpu_mb") is not None:
            parts.append(f"peak GPU mem {row['peak_gpu_mb']:,.0f} MB")
        parts.append(f"peak {'host ' if row.get('peak_gpu_mb') is not None else ''}mem {row['peak_rss_mb']:,.0f} MB")
        shown = self.objective(row) if self.objective is not None else None
        if shown:
            parts.append(shown)
        if row.get("grad_norm") is not None:
            parts.append(f"grad norm {row['grad_norm']:.3f}")
        if row.get("exposed_comm_s") is not None:
            overlap = f" (overlap {row['overlap_pct']:.0f}%)" if row.get("overlap_pct") is not None else ""
            parts.append(f"exposed comm {1000 * row['exposed_comm_s']:.1f} ms{overlap}")
        return "  ".join(parts)

    def show(self, row: dict[str, Any]) -> None:
        print(self.line(row), flush=True)

    @staticmethod
    def ready(world_size: int, env: Mapping[str, str] | None = None) -> str:
        """The line that follows the launcher's "starting N workers…": they are set up and training starts, counted
        from the user's Enter (``$NXDT_STARTED_AT``, which ``nxdt.launch.console`` sets)."""
        env = os.environ if env is None else env
        try:
            after = f" {time.time() - float(env['NXDT_STARTED_AT']):.1f} s after Enter"
        except (KeyError, ValueError):
            after = ""
        return f"nxdt: {world_size} worker{'s' if world_size != 1 else ''} ready{after}; training"


class StepMetricsLogger(Callback):
    """Writes ``metrics.csv`` and hands every value of the row, the same names, to each logger of the trainer
    (TensorBoard; W&B and MLflow: ``nxdt.lightning.trackers``) from the module's ``step_metrics``, on rank 0, and shows
    the row on the console (``console``)."""

    def __init__(
        self,
        path: Path,
        tokens_per_step: int,
        every_n_steps: int = 1,
        extra_columns: tuple[str, ...] = (),
        console: StepConsole | None = None,
        validation: bool = False,
        val_columns: tuple[str, ...] = (),
    ) -> None:
        self.console = console
        self.path = Path(path)
        # val_loss when data.val_dir is validated, and the objective's validation metrics (DPO: val_rewards/...)
        self.val_columns = ("val_loss",) + tuple(val_columns) if validation else ()
        # e.g. grad_norm, param_norm (exp_manager.log_*_norm)
        self.columns = METRIC_COLUMNS + tuple(extra_columns) + self.val_columns
        # with validation a step's row is written once its validation (if any) has run: after the step's
        # validation, or when the next step starts, or training ends — one row per step, val_loss in it
        self.validation = validation
        self._pending: dict[str, Any] | None = None
        self.tokens_per_step = tokens_per_step
        self.every_n_steps = max(1, every_n_steps)
        self._last_time = time.perf_counter()  # reset when training starts
        self._last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_time = time.perf_counter()
        self._last_step = trainer.global_step
        if trainer.is_global_zero:
            self._truncate_after(trainer.global_step)
            if self.console is not None:
                print(self.console.ready(trainer.world_size), flush=True)

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

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = getattr(pl_module, "step_metrics", None)
        if not metrics or metrics["step"] == self._last_step:
            return  # mid-accumulation: no optimizer step happened
        now = time.perf_counter()
        step_time = (now - self._last_time) / max(1, metrics["step"] - self._last_step)
        self._last_time, self._last_step = now, metrics["step"]
        if not trainer.is_global_zero or metrics["step"] % self.every_n_steps:
            return
        row = {
            **metrics,
            "step_time_s": step_time,
            "wall_time": round(time.time(), 3),
            "tokens_per_s": tokens_per_s(self.tokens_per_step, step_time),  # global tokens: nxdt.data.throughput
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }  # rank 0's high-water mark (Linux: KiB)
        if pl_module.device.type == "cuda":
            row["peak_gpu_mb"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
        mfu_scale = self.console.mfu_per_token_per_s if self.console is not None else None
        if mfu_scale is not None:  # the loggers (TensorBoard, trackers) get the console's MFU; metrics.csv keeps its columns
            row["mfu"] = mfu_scale * row["tokens_per_s"]
        for logger in trainer.loggers:
            logger.log_metrics({k: v for k, v in row.items() if k != "step"}, step=row["step"])
        if self.console is not None:
            self.console.show(row)
        if self.validation:
            self._flush()
            self._pending = row
        else:
            self._write(row)

    def _write(self, row: dict[str, Any]) -> None:
        new_file = not self.path.exists()
        with open(self.path, "a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns, extrasaction="ignore")
            if new_file:
                writer.writeheader()
            writer.writerow(row)

    def _flush(self) -> None:
        if self._pending is not None:
            row, self._pending = self._pending, None
            self._write(row)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._flush()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last_time is not None and getattr(self, "_val_start", None) is not None:
            self._last_time += time.perf_counter() - self._val_start  # validation is not the next step's time
        metrics = getattr(pl_module, "val_metrics", None)
        if trainer.sanity_checking or not metrics or not trainer.is_global_zero:
            return
        step, loss = metrics["step"], metrics["val_loss"]
        values = {name: metrics[name] for name in self.val_columns if name in metrics}
        if self._pending is not None and self._pending["step"] == step:
            self._pending.update(values)
            self._flush()
        else:  # the step's own row was not logged (log_every_n_steps): a row with the validation alone
            self._flush()
            self._write({"step": step, **values, "wall_time": round(time.time(), 3)})
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
        if self.console is not None:
            counted = f"{metrics['val_pairs']:,} pairs" if "val_pairs" in metrics else f"{metrics.get('val_tokens', 0):,} tokens"
            accuracy = f", reward acc {values['val_rewards/accuracies']:.3f}" if "val_rewards/accuracies" in values else ""
            print(f"step {step}: val_loss {loss:.4f}{accuracy} ({counted})", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._flush()


class InjectedFault(RuntimeError):
    """Raised on purpose by :class:`FaultInjection` (reliability drills and tests)."""


class FaultInjection(Callback):
    """Fail on ``rank`` when optimizer step ``step`` starts, in launch attempt ``attempt`` only: rehearses
    a crash for real. ``raise``: an exception; ``sigkill``: the process vanishes (no cleanup, as after an
    OOM kill); ``sigkill_during_save``: the process vanishes in the middle of the next checkpoint write,
    after its files are written and before it is committed; ``hang``: the process stops responding (a stuck
    rank or host: the others wait until their collective timeout, or until the host is killed); ``sigstop``: the
    process is stopped by SIGSTOP (it cannot even run a signal handler; see ``worker.kill_stopped_peers``); ``nan``: the
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
                    print(
                        f"nxdt: fault injection: SIGKILL on rank {trainer.global_rank} during the save of "
                        f"step {trainer.global_step} (t={time.time():.3f})",
                        flush=True,
                    )
                    os.kill(os.getpid(), signal.SIGKILL)

            trainer.strategy.before_checkpoint_commit = die_if_due

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.kind == "sigkill_during_save" or trainer.global_step + 1 != self.step or not self._armed(trainer):
            return
        if self.kind == "sigkill":
            print(
                f"nxdt: fault injection: SIGKILL on rank {trainer.global_rank} at step {self.step} (t={time.time():.3f})",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "nan":  # once: a skipped step starts again with the same step number
            pl_module.inject_nan, self._nan_injected = not self._nan_injected, True
            return
        if self.kind == "sigstop":
            print(
                f"nxdt: fault injection: SIGSTOP on rank {trainer.global_rank} at step {self.step} (t={time.time():.3f})",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.kind == "hang":
            print(
                f"nxdt: fault injection: rank {trainer.global_rank} hangs at step {self.step} (t={time.time():.3f})", flush=True
            )
            while True:
                signal.pause()
        raise InjectedFault(f"injected fault at step {self.step} on rank {trainer.global_rank} (exp_manager.fault_injection)")


def launch_attempt(env: Mapping[str, str] | None = None) -> int:
    """0 for the first start of the workers, k after the k-th restart by the elastic agent (several nodes: the
    k-th rendezvous round, which every node agrees on; an agent restarted by another node's failure does not
    count that restart in TORCHELASTIC_RESTART_COUNT)."""
    env = os.environ if env is None else env
    return int(env.get("NXDT_ATTEMPT") or env.get("TORCHELASTIC_RESTART_COUNT", "0"))


class DirectoryCheckpoint(ModelCheckpoint):
    """Lightning's checkpoint scheduling (every N steps, keep the newest k) writing ``step-<N>`` directories;
    rank 0 announces each one (``background``: handed to the asynchronous writer, committed later).

    ``final`` (``exp_manager.save_last``): when training ends, the last step is saved too unless it just was — as
    NeMo's ``save_last``, but as one more ``step-<N>`` in the keep_last_k rotation rather than a ``-last`` copy, so
    resuming and exporting it work as for any other. Lightning's own ``save_last`` is not used: it writes a
    ``last`` file beside the step directories."""

    FILE_EXTENSION = ""

    def __init__(self, *args: Any, background: bool = False, final: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.background = background
        self.final = final

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if not self.final or trainer.global_step < 1 or self._should_skip_saving_checkpoint(trainer):
            return
        if (Path(self.dirpath or "") / f"step-{trainer.global_step}").exists():  # a resume that trained no step
            return
        before = self.best_model_path
        self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        self._announce(trainer, before)

    def _announce(self, trainer: pl.Trainer, before: str) -> None:
        if self.best_model_path and self.best_model_path != before and trainer.is_global_zero:
            path = Path(self.best_model_path)
            how = "being written in the background" if self.background else "saved"
            print(f"nxdt: checkpoint {path.parent.name}/{path.name} {how}", flush=True)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if trainer.is_global_zero:
            for old in self.beyond_keep_last_k(Path(filepath)):
                trainer.strategy.remove_checkpoint(old)  # asynchronous saves: once this one is committed

    def beyond_keep_last_k(self, saved: Path) -> list[Path]:
        """The committed checkpoints older than ``saved`` beyond ``keep_last_k`` (``save_top_k``) counting it, read
        from the directory: Lightning's own count starts from what its restored state remembers, and a resumed run
        would keep every checkpoint of earlier launches. Newer steps (another timeline, e.g. after resuming an
        older checkpoint) are not this save's to remove."""
        if self.save_top_k < 1 or not ckpt_io.is_step_name(saved.name):
            return []
        step = int(saved.name[len("step-") :])
        older = [
            p for p in ckpt_io.list_complete(saved.parent) if ckpt_io.is_step_name(p.name) and int(p.name[len("step-") :]) < step
        ]
        return older[: max(0, len(older) - (self.save_top_k - 1))]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        before = self.best_model_path  # monitor="step", mode="max": the best is the newest
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._announce(trainer, before)


class StepProgressBar(RichProgressBar):
    """Rich's progress bar for step-bounded runs: one bar for the whole run counting optimizer steps to
    ``trainer.max_steps`` (resumed runs start where they left off), across epochs — not the batches of the
    current epoch under ``Epoch 0/-2``. Runs bounded by epochs keep Lightning's per-epoch bar."""

    train_progress_bar_id: Any  # RichProgressBar's task id (a rich TaskID, or None before the bar exists)

    def __init__(self) -> None:
        super().__init__(leave=True)

    def _step_bounded(self) -> bool:
        return self.trainer.max_steps is not None and self.trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._step_bounded() else super().total_train_batches

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._step_bounded():
            return super().on_train_epoch_start(trainer, pl_module)
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:
            self.train_progress_bar_id = self._add_task(self.total_train_batches, "steps")
        self.progress.update(self.train_progress_bar_id, completed=trainer.global_step, visible=True)
        self.refresh()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the bar's position is the optimizer step (one Lightning batch is one global batch), not the batch index
        super().on_train_batch_end(
            trainer, pl_module, outputs, batch, trainer.global_step - 1 if self._step_bounded() else batch_idx
        )


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def resume_checkpoint(run_dir: str | Path, *, set_aside_damaged: bool = True) -> Path | None:
    """The newest complete checkpoint of the run whose files match their checksums; leftovers of an interrupted
    save are removed first, and damaged checkpoints newer than it are moved aside (``step-N.damaged``), saying so.
    The launcher runs the same check before the first start (``rundir.check_resume``); this catches damage on a
    restart after a crash. ``set_aside_damaged``: only one process of a job renames."""
    root = checkpoint_dir(run_dir)
    if set_aside_damaged:
        ckpt_io.remove_incomplete(root)
    good, skipped = ckpt_io.newest_verified(root)
    for path, reason in skipped:
        fallback = f"resuming from {good.name}" if good else "no good checkpoint left: starting from step 0"
        if set_aside_damaged:
            moved = ckpt_io.set_aside(path)
            print(f"nxdt: checkpoint {path.name} is damaged ({reason}); {fallback} (moved it to {moved.name})", flush=True)
    return good


def agreed_resume_checkpoint(cfg: Any, run_dir: str | Path, env: Mapping[str, str] | None = None) -> Path | None:
    """The checkpoint every rank resumes from: the one named in the config; otherwise, when resuming
    (``resume_if_exists`` or a restart after a crash), the newest complete one — decided by rank 0 and
    published through the launcher's rendezvous store, so ranks never disagree (a file system listing
    can differ between ranks while a save is being committed).

    What goes through the store is only the checkpoint's name, signed with the run's secret
    (``nxdt.comm.store.SignedKeys``): a value another local process planted is refused, and a name is accepted
    only as a ``step-<N>`` directory of this run's ``checkpoints/`` — nothing read from the store picks a path
    outside the run. ``env``: the worker's environment (default ``os.environ``)."""
    em = cfg.exp_manager
    if em.resume_from_checkpoint and not cfg.model.weight_init_only:  # weight_init_only: it only names starting weights
        return Path(em.resume_from_checkpoint).expanduser()
    env = os.environ if env is None else env
    attempt = launch_attempt(env)
    if not (em.resume_if_exists or attempt > 0):
        return None
    if int(env.get("WORLD_SIZE", "1")) == 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # every rank decides alike (the same files, the same checks); only rank 0 renames damaged ones
        return resume_checkpoint(run_dir, set_aside_damaged=int(env.get("RANK", "0")) == 0)
    from datetime import timedelta

    from nxdt.comm.store import SignedKeys, connect_store, secret_from_env

    store = connect_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), timedelta(seconds=cfg.comm.timeout_s), env)
    keys = SignedKeys(store, secret_from_env(env), cfg.comm.timeout_s, " (the checkpoint to resume from)")
    key = f"nxdt/resume/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}"
    root = checkpoint_dir(run_dir)
    if int(env["RANK"]) == 0:
        chosen = resume_checkpoint(run_dir)
        keys.set(key, chosen.name if chosen else "")
        return chosen
    name = keys.get(key).decode(errors="replace")
    if not name:
        return None
    if not ckpt_io.is_step_name(name) or not (root / name).is_dir() or (root / name).is_symlink():
        raise ckpt_io.CheckpointError(
            f"the checkpoint to resume from, {name!r} in the rendezvous store, is not a step-<N> directory of {root}; refused"
        )
    return root / name


def validates(cfg: Any) -> bool:
    """Whether the run validates: data.val_dir (or a data.val_split) set and trainer.limit_val_batches > 0."""
    return (cfg.data.val_dir is not None or cfg.data.val_split > 0) and cfg.trainer.limit_val_batches > 0


def build_callbacks(
    cfg: Any,
    run_dir: Path,
    tokens_per_step: int,
    *,
    show_progress: bool,
    objective_metrics: tuple[str, ...] = (),
    objective_console: Callable[[dict[str, Any]], str | None] | None = None,
) -> list[Callback]:
    """``objective_metrics`` / ``objective_console``: the run's objective's columns (also as ``val_<name>``) and its part
    of the console line (its spec's, ``nxdt.lightning.registry``)."""
    em = cfg.exp_manager
    norms = tuple(c for c, on in (("grad_norm", em.log_gradient_norm), ("param_norm", em.log_parameter_norm)) if on)
    callbacks: list[Callback] = [
        StepMetricsLogger(
            run_dir / "metrics.csv",
            tokens_per_step,
            cfg.trainer.log_every_n_steps,
            norms + objective_metrics,
            console=StepConsole.for_run(cfg, run_dir, objective_console),
            validation=validates(cfg),
            val_columns=tuple(f"val_{name}" for name in objective_metrics),
        )
    ]
    every = cfg.exp_manager.checkpoint_every_n_steps
    final = cfg.exp_manager.save_last
    if every or final:
        callbacks.append(
            DirectoryCheckpoint(
                dirpath=checkpoint_dir(run_dir),
                filename="step-{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=every or 0,  # 0, not None: None everywhere would make Lightning save every epoch
                final=final,
                save_top_k=cfg.exp_manager.keep_last_k,
                monitor="step",
                mode="max",
                save_last=False,
                save_on_train_epoch_end=False,
                background=cfg.exp_manager.async_checkpointing,
            )
        )
    if cfg.exp_manager.profile_steps is not None:
        from nxdt.lightning.profiling import StepProfiler

        first, last = cfg.exp_manager.profile_steps
        callbacks.append(StepProfiler(run_dir / "profile", first, last))
    fault = cfg.exp_manager.fault_injection
    if fault.step is not None:
        callbacks.append(FaultInjection(fault.step, fault.rank, fault.kind, fault.attempt))
    if show_progress:
        # a live bar only on a terminal (the worker sets NXDT_CONSOLE_TTY): elsewhere its one final frame would
        # only repeat the step lines; disabled rather than left out, or Lightning would add its default bar
        bar = StepProgressBar()
        if console_mode() == "quiet" or os.environ.get("NXDT_CONSOLE_TTY") != "1":
            bar.disable()
        callbacks.append(bar)
    return callbacks


def build_loggers(cfg: Any, run_dir: Path) -> list[Any]:
    if not cfg.exp_manager.create_tensorboard_logger:
        return []
    return [TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False)]
