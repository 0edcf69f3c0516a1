"""What ``nxdt train`` shows on the console: nxdt's own lines first.

* the launcher prints a banner (run directory, the layout in one line, the plan's predicted step time) and,
  when the job ends, a summary (steps, time, first → last loss, the run's tokens/s (``nxdt.data.throughput``), newest checkpoint, the
  command to resume and the one to look at the run);
* rank 0 prints one line per ``trainer.log_every_n_steps`` (``nxdt.lightning.exp_manager.StepConsole``),
  restarts and checkpoints;
* third-party banners, tips and deprecation warnings (Lightning's "GPU available" / "TPU available" lines
  and "Tip" adverts, FutureWarning/DeprecationWarning) go to the rank's log file only, through the logging
  configuration of the loggers that emit them — the per-rank logs keep everything.

``-q`` (``quiet``): banner and summary only (rank 0's output goes to its log file alone). ``-v``
(``verbose``): everything, third-party lines included. The launcher passes the mode to its workers in
``$NXDT_CONSOLE``; the lightning layer reads the same variable (``exp_manager.console_mode``).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import IO, Any, Sequence

MODE_ENV = "NXDT_CONSOLE"
MODES = ("quiet", "normal", "verbose")
MODE_FLAGS = {"-q": "quiet", "--quiet": "quiet", "-v": "verbose", "--verbose": "verbose"}

# Lightning's info lines that are not about this run: device banners, advertisements, its TF32 tip on GPUs (nxdt keeps
# fp32 matmuls exact, torch's default; bf16 runs compute in bf16 anyway), its own stop notice (nxdt's summary says why
# training stopped) and its two lines on restoring a checkpoint (rank 0 prints nxdt's own "nxdt: resuming from ..."
# line). Everything else Lightning logs stays on the console.
THIRD_PARTY_NOISE = re.compile(
    r"^(GPU available|TPU available|HPU available|IPU available|💡 Tip|LOCAL_RANK: \d|You are using a CUDA device|"
    r"`Trainer\.fit` stopped|Restoring states from the checkpoint path at |Restored all states from the checkpoint at )"
)
# nxdt's own callbacks (nxdt.lightning.exp_manager, datamodule): Lightning's call.py warns on resume when the state key
# of one saved in the checkpoint is not among the Trainer's, which for these means only that a setting in their key
# changed (exp_manager.checkpoint_every_n_steps: the launcher's "continuing" line names the change). The warning
# stays on the console when any callback it lists is someone else's.
NXDT_CALLBACKS = ("DirectoryCheckpoint", "StepMetricsLogger", "StepProgressBar", "EpochLimit", "FaultInjection")
_OWN_CALLBACK = r"""["'](?:""" + "|".join(NXDT_CALLBACKS) + r""")(?:\{[^{}]*\})?["']"""
# warnings that concern library authors, not the person training: deprecations of APIs nxdt's dependencies use,
# Lightning's advice on manual optimization with ModelCheckpoint (nxdt's module steps its optimizer itself and
# its checkpoints are meant to hold the state after the step), its note that a resumed run's checkpoint directory is not
# empty (it is the run's own), and its advice to give nxdt's loaders workers (they have none on purpose: the samples are
# in memory, nxdt.lightning.datamodule)
WARNING_NOISE = re.compile(
    r"deprecat|FutureWarning|DeprecationWarning|Using ModelCheckpoint with manual optimization|"
    r"The '(?:train|val)_dataloader' does not have many workers|"
    r"Checkpoint directory .* exists and is not empty|"
    rf"Please add the following callbacks: \[{_OWN_CALLBACK}(?:, {_OWN_CALLBACK})*\]",
    re.IGNORECASE,
)
THIRD_PARTY_LOGGERS = ("lightning.pytorch", "lightning.fabric")


def mode() -> str:
    value = os.environ.get(MODE_ENV, "normal")
    return value if value in MODES else "normal"


def set_mode(value: str | None) -> str:
    """The launcher's console mode, handed on to its workers (they inherit the environment); deprecation
    warnings of the launcher's own imports are silenced unless verbose."""
    if value is not None:
        os.environ[MODE_ENV] = value
    chosen = mode()
    if chosen != "verbose":
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category)
    return chosen


# ---------------------------------------------------------------- worker side


class _Noise(logging.Filter):
    """Passes third-party noise only (``keep=False``: passes everything else)."""

    def __init__(self, pattern: re.Pattern, keep: bool) -> None:
        super().__init__()
        self.pattern, self.keep = pattern, keep

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(self.pattern.search(record.getMessage())) == self.keep


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).rstrip("\n")  # a formatted warning ends in a newline of its own


def _route(logger: logging.Logger, pattern: re.Pattern, log_only: IO[str]) -> None:
    """Records matching ``pattern`` to the log file only, the rest to stderr (the console tee, which logs too)."""
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(_Noise(pattern, keep=False))
    to_log = logging.StreamHandler(log_only)
    to_log.addFilter(_Noise(pattern, keep=True))
    for handler in (console, to_log):
        handler.setFormatter(_OneLine("%(message)s"))
    logger.handlers = [console, to_log]
    logger.propagate = False


def worker_output(log_path: Path, *, console: bool) -> IO[str]:
    """Set up a worker's third-party output; returns the stream for lines meant for the rank's log file only.

    ``console``: this worker's stdout/stderr reach the console (rank 0, not quiet). Then, unless verbose,
    Lightning's banner and tip lines and deprecation warnings go to the log file only. Other workers write
    everything to their log already."""
    if not console or mode() == "verbose":
        return sys.stdout
    log_only = open(log_path, "a", buffering=1)  # O_APPEND beside the tee's writes to the same file
    import lightning.pytorch  # noqa: F401  (its logger's handlers exist before they are configured; preloaded anyway)

    for name in THIRD_PARTY_LOGGERS:
        _route(logging.getLogger(name), THIRD_PARTY_NOISE, log_only)
    logging.captureWarnings(True)  # warnings become records of "py.warnings", routed like the rest
    _route(logging.getLogger("py.warnings"), WARNING_NOISE, log_only)
    return log_only


# ---------------------------------------------------------------- launcher side

# when the user pressed Enter (the launcher process's start, seconds since the epoch), handed to the workers so that
# their "ready" line and the summary count from there
STARTED_ENV = "NXDT_STARTED_AT"


def process_started_at() -> float:
    """This process's start time (the user's Enter): its age from /proc (start time in clock ticks since boot vs the
    uptime, both to 1/100 s), subtracted from now. Python's own start-up and imports are counted, as the user waits
    for them too. Where /proc cannot say (not Linux), now."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        started_ticks = int(fields[19])  # field 22 of proc(5), counted after the parenthesised name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - max(0.0, age)


def started_at() -> float:
    """The Enter time the launcher recorded in ``$NXDT_STARTED_AT`` (now if none: a caller's own process)."""
    try:
        return float(os.environ[STARTED_ENV])
    except (KeyError, ValueError):
        return time.time()


def first_line(cfg: Any, jobs: int, source: tuple[str, str] | None) -> str:
    """What is being launched, printed as soon as the config is composed: before torch and Lightning are imported
    (seconds of CPU) and the data and model are checked, so the console answers within a second of Enter."""
    from nxdt.launch.runs import get

    tp, pp, cp = (
        get(cfg, f"distributed_strategy.{k}", 1) or 1
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    )
    world = (get(cfg, "trainer.devices", 1) or 1) * (get(cfg, "trainer.num_nodes", 1) or 1)
    dp = world // max(1, tp * pp * cp)
    what = f"NxDT config {source[0]}/{source[1]}.yaml" if source else "nxdt's config"
    sweep = f"{jobs} jobs, the first: " if jobs > 1 else ""
    where = get(cfg, "exp_manager.explicit_log_dir")
    into = f" → {where}" if where and jobs == 1 else ""
    return (
        f"nxdt: {sweep}{get(cfg, 'name')} ({what}) · {world} ranks on {get(cfg, 'instance.name')}, TP{tp} PP{pp} DP{dp}"
        f"{f' CP{cp}' if cp > 1 else ''}{into} · checking the data and the model…"
    )


def banner(run_dir: Path, plan: Any, cfg: Any, label: str = "") -> list[str]:
    """Run directory, the layout in one line, and what the plan predicts."""
    from nxdt.launch.runs import get, layout_line

    est = getattr(plan, "estimate", None) or {}
    lines = [f"nxdt: {label}run directory {run_dir} ({plan.world_size} ranks)", f"nxdt: layout: {layout_line(plan, cfg)}"]
    batch = getattr(plan, "batch", None) or {}
    unit = "pairs (chosen + rejected sequences)" if get(cfg, "data.source") == "preferences" else "sequences"
    what = (
        f"{get(cfg, 'name')}: {get(cfg, 'trainer.max_steps')} steps × {batch.get('global', '?')} {unit} of "
        f"{batch.get('seq_length', '?')} tokens (micro-batch {batch.get('micro', '?')})"
    )
    if est.get("step_time_s"):
        guessed = (
            "" if est.get("calibrated") or not _peak_is_guess(cfg) else f" ({get(cfg, 'instance.name')}: placeholder figures)"
        )
        what += f" · plan: {est['step_time_s']:.3f} s/step, {est['tokens_per_s']:,.0f} tokens/s{guessed}"
    lines.append(f"nxdt: {what}")
    return lines


def _peak_is_guess(cfg: Any) -> bool:
    from nxdt.launch.runs import get

    provenance = get(cfg, "instance.provenance", {}) or {}
    key = "peak_tflops_fp32" if get(cfg, "precision.type") == "fp32" else "peak_tflops_bf16"
    entry = provenance.get(key) if isinstance(provenance, dict) else getattr(provenance, key, None)
    return bool(get(entry, "guess", False))


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    m, s = divmod(int(s), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def command_line(source_args: list[str], overrides: list[str], extra: list[str]) -> str:
    """``nxdt train ...`` with ``extra`` overriding the same keys of the original command."""
    keys = {e.split("=", 1)[0] for e in extra}
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys]
    return shlex.join(["nxdt", "train", *source_args, *kept, *extra])


def summary(run_dir: Path, status: str, launched_at: float, overrides: list[str], source_args: Sequence[str] = ()) -> list[str]:
    """The lines printed when a job ends: how far it got, how fast, where its checkpoint is, what to type next.
    Times count from ``launched_at``: the user's Enter for a single run (:func:`job_started`)."""
    from nxdt.launch.runs import get, load_run

    run = load_run(run_dir)
    elapsed = time.time() - launched_at
    rows = run.rows
    this_launch = [r for r in rows if r.get("wall_time", launched_at) >= launched_at]
    verb = {"finished": "finished", "failed": "failed", "interrupted": "interrupted"}.get(status, status)
    if rows:
        first_at = (
            f" (first step logged after {_seconds(this_launch[0]['wall_time'] - launched_at)})"
            if this_launch and "wall_time" in this_launch[0]
            else ""
        )
        head = f"nxdt: {verb} at step {run.last_step} of {run.max_steps} in {_seconds(elapsed)}{first_at}"
        figures = [f"loss {run.first_loss:.4f} → {run.last_loss:.4f}"]
        tps = run.tokens_per_s  # the figure nxdt runs / report / sweep-report show (nxdt.data.throughput)
        if tps is not None:
            figures.append(f"{tps:,.0f} tokens/s")
        gpu = max((r["peak_gpu_mb"] for r in rows if r.get("peak_gpu_mb") is not None), default=None)
        if gpu is not None:
            figures.append(f"peak GPU memory {gpu:,.0f} MB (rank 0)")
        peak = max((r["peak_rss_mb"] for r in rows if "peak_rss_mb" in r), default=None)
        if peak is not None:
            figures.append(f"peak {'host ' if gpu is not None else ''}memory {peak:,.0f} MB (rank 0)")
        lines = [head, "nxdt: " + " · ".join(figures)]
    else:
        lines = [f"nxdt: {verb} after {_seconds(elapsed)}, before any step was logged"]
    if run.checkpoint is not None:
        lines.append(f"nxdt: newest checkpoint: {run.checkpoint}")
        hf_out = shlex.quote(f"{get(run.config, 'name')}-hf")
        lines.append(f"nxdt: export it: nxdt checkpoint export-hf {shlex.quote(str(run.checkpoint))} {hf_out}")
        extend = []
        if status == "finished" and isinstance(run.max_steps, int) and run.max_steps > 0:
            # the printed command runs as it is: a finished run continues only to a larger trainer.max_steps (the
            # same one would start the workers to train nothing; check_resume refuses it)
            extend = [f"trainer.max_steps={2 * run.max_steps}"]
        resume = command_line(
            list(source_args),
            overrides,
            [*extend, f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.resume_if_exists=true"],
        )
        lines.append(f"nxdt: {'continue it' if extend else 'resume'}: {resume}")
    else:
        every = get(run.config, "exp_manager.checkpoint_every_n_steps")
        last = get(run.config, "exp_manager.save_last", False)
        lines.append(
            "nxdt: newest checkpoint: none"
            + ("" if every or last else " (exp_manager.checkpoint_every_n_steps=N saves one every N steps)")
        )
    look = f"nxdt report {shlex.quote(str(run_dir))}"
    if get(run.config, "exp_manager.create_tensorboard_logger", False):
        look += f"   ·   tensorboard --logdir {shlex.quote(str(run_dir / 'tensorboard'))}"
    lines.append(f"nxdt: look at it: {look}")
    return lines


def print_lines(lines: list[str], stream: IO[str] | None = None) -> None:
    for line in lines:
        print(line, file=stream or sys.stdout, flush=True)


# ---------------------------------------------------------------- the launcher's hooks around one job


# the launcher's torch loggers: the agent's notes on stopping workers ("Received 2 death signal, shutting down
# workers", "Terminating process N via signal SIGTERM") repeat what nxdt's own failure/interruption line says
LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


class _LauncherLogFile(logging.FileHandler):
    """The handler ``launcher_log`` installs (and removes before installing the next job's)."""


def launcher_log(run_dir: Path | None) -> None:
    """Unless verbose, the launcher's torch records go to ``logs/launcher.log`` of the job's run directory only: nxdt
    names a failure itself in one line, and the agent's own errors (e.g. an exit barrier broken by a garbled store
    key after the workers finished) are its bookkeeping, not the run's outcome. ``None`` detaches the file."""
    if mode() == "verbose":
        return
    for name in LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, _LauncherLogFile):
                logger.removeHandler(handler)
                handler.close()
        if run_dir is None:
            continue
        to_file = _LauncherLogFile(Path(run_dir) / "logs" / "launcher.log", delay=True)
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(to_file)
        logger.propagate = False


def job_started(
    run_dir: Path, plan: Any, cfg: Any, label: str, overrides: list[str], source_args: list[str], first: bool = True
) -> float:
    """Banner, ``status.json`` saying running (best effort: a run is never refused for it), the launcher's log, and
    a status line while the workers start (their imports take seconds; rank 0 says when they are ready).
    Returns the time the summary counts from: the user's Enter for the first job, this job's start for a sweep's
    later ones."""
    from nxdt.launch.runs import write_status

    now = time.time()
    print_lines(banner(run_dir, plan, cfg, label))
    launcher_log(run_dir)
    try:
        write_status(run_dir, "running", command=command_line(source_args, overrides, []))
    except OSError:
        pass
    if mode() != "quiet":
        print(f"nxdt: starting {plan.world_size} worker{'s' if plan.world_size != 1 else ''}…", flush=True)
    return min(now, started_at()) if first else now


def job_ended(
    run_dir: Path, outcome: str, reason: str, launched_at: float, overrides: list[str], source_args: list[str], exit_code: int
) -> None:
    """``status.json`` completed, and the summary printed."""
    from nxdt.launch.runs import write_status

    launcher_log(None)
    try:
        write_status(run_dir, outcome, reason=reason.removeprefix("nxdt: "), exit_code=exit_code)
    except OSError:
        pass
    try:
        print_lines(summary(run_dir, outcome, launched_at, overrides, source_args))
    except Exception as exc:  # the summary must never hide how the job ended
        print(f"nxdt: no summary ({type(exc).__name__}: {exc}); see nxdt report {run_dir}", flush=True)
