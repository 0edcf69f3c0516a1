"""Experiment trackers from NxDT's exp_manager keys: Weights & Biases and MLflow, as Lightning's own ``WandbLogger``
and ``MLFlowLogger``, on rank 0 only.

NxD Training's ``exp_manager`` (src/neuronx_distributed_training/utils/exp_manager.py) hands ``create_wandb_logger`` /
``wandb_logger_kwargs`` and ``create_mlflow_logger`` / ``mlflow_logger_kwargs`` to NeMo's ``configure_loggers``, which
builds ``WandbLogger(save_dir=exp_dir, version=<run version>, **wandb_logger_kwargs)`` (``name`` or ``project``
required) and ``MLFlowLogger(run_name=<run version>, **mlflow_logger_kwargs)`` (``experiment_name`` defaulting to the
run name). nxdt does the same with its run directory, and:

* every value ``StepMetricsLogger`` writes to metrics.csv / TensorBoard reaches them at its step (it calls
  ``log_metrics`` of every logger of the trainer);
* the resolved config is logged as parameters, the run directory as ``nxdt.run_dir`` (a parameter; an MLflow tag too);
* the tracker's run id is kept in ``<run dir>/trackers.json``: a resumed run (same run directory) continues it
  (W&B ``id`` with ``resume="allow"``, MLflow ``run_id``);
* a tracker that fails never stops training: :class:`GuardedLogger` prints one warning line and drops it.

ClearML (``create_clearml_logger`` / ``clearml_logger_kwargs``: NeMo's ClearMLParams; NxDT itself passes
``create_clearml_logger=False`` to NeMo whatever the config says) has no Lightning logger: :class:`ClearMLLogger` is
nxdt's, on rank 0 when the clearml package is installed (refused by name before launch otherwise). Unlike NeMo's, whose
``log_metrics`` reports nothing per step (it relies on ClearML's TensorBoard hook), it reports every metric as a
scalar at its step (ClearML's TensorBoard hook is switched off, so nothing is reported twice) and connects the config
as the task's ``nxdt`` hyperparameter section. Offline (``CLEARML_OFFLINE_MODE=1``) the session folder is kept under
``<run>/clearml/offline/<task id>/`` (``CLEARML_CACHE_DIR``, unless the user set it); a resume continues the same task
(``Task.init(reuse_last_task_id=<id>, continue_last_task=0)``: ClearML's own way to continue a task, with no iteration
offset, so a step is reported at its number) — offline too, the session folder then holds both launches.
``Task.init`` also records the task in ``~/.clearml/.session.json`` (its task-reuse cache), offline too, and no ClearML
setting moves or stops that: the folder is the literal ``~/.clearml`` (``SessionCache.SESSION_CACHE_FOLDER``,
clearml/config/cache.py), written whenever the task is not running remotely (task.py, ``__update_last_used_task_id``
under ``in_dev_mode``); ``CLEARML_CACHE_DIR`` moves the offline session only and ``CLEARML_TASK_NO_REUSE`` stops
the read, not the write. Only ``HOME`` would move it, and with it every other library's
files (W&B's credentials, caches), so nxdt leaves it: it holds the last task id per project and name, nothing else.

DLLogger is refused before launch, installed or not: NxDT never attaches it, and NeMo's DLLogger with its default
``verbose: false`` writes no record (its backends' verbosity DEFAULT=0 is below ``dllogger.log``'s default 1:
NVIDIA/dllogger dllogger/logger.py), so there is no NxD Training behaviour to re-create; metrics.csv has the values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from lightning.pytorch.loggers import Logger

from nxdt.config.trackers import clearml_offline, mlflow_tracking_uri, plain

STATE_FILE = "trackers.json"  # in the run directory: each tracker's run id, for a resume


def flat_params(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """The resolved config as dotted keys (lists as their text), and the run directory as ``nxdt.run_dir``."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = node if isinstance(node, (int, float, str, bool)) or node is None else str(node)

    walk(plain(cfg), "")
    out["nxdt.run_dir"] = str(run_dir)
    return out


def read_state(run_dir: Path) -> dict[str, Any]:
    try:
        state = json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = Path(run_dir) / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, Path(run_dir) / STATE_FILE)


def _say(line: str) -> None:
    print(line, flush=True)


class GuardedLogger(Logger):
    """A tracker's Lightning logger whose failure never stops training: the first exception of any call prints one
    warning line (``warn``) and every later call is skipped; metrics.csv and TensorBoard go on."""

    def __init__(
        self, inner: Logger, label: str, warn: Callable[[str], None] = _say, on_finalize: Callable[[str], None] | None = None
    ):
        super().__init__()
        self.inner, self.label, self.warn, self.on_finalize = inner, label, warn, on_finalize
        self.failed = False

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # any failure of a tracker: network, server, its own bugs
            self.failed = True
            reason = (str(exc).strip().splitlines() or [""])[0][:300]
            self.warn(
                f"nxdt: warning: the {self.label} tracker failed ({what}: {type(exc).__name__}: {reason}); "
                "training continues without it (metrics.csv has every step)"
            )
            return None

    @property
    def name(self) -> str | None:
        return self.inner.name

    @property
    def version(self) -> int | str | None:
        return self.inner.version

    @property
    def save_dir(self) -> str | None:
        return self.inner.save_dir

    @property
    def experiment(self) -> Any:
        return self.inner.experiment

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._guard("log_metrics", self.inner.log_metrics, metrics, step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self._guard("log_hyperparams", self.inner.log_hyperparams, params, *args, **kwargs)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        self._guard("log_graph", self.inner.log_graph, model, input_array)

    def save(self) -> None:
        self._guard("save", self.inner.save)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self._guard("after_save_checkpoint", self.inner.after_save_checkpoint, checkpoint_callback)

    def finalize(self, status: str) -> None:
        self._guard("finalize", self.inner.finalize, status)
        if self.on_finalize is not None:
            self._guard("finish", self.on_finalize, status)


def _wandb(cfg: Any, run_dir: Path, state: dict[str, Any]) -> tuple[Logger, Callable[[str], None], dict[str, Any]]:
    from lightning.pytorch.loggers import WandbLogger

    kwargs = dict(plain(cfg.exp_manager.wandb_logger_kwargs) or {})
    kwargs.setdefault("save_dir", str(run_dir))  # NeMo: the experiment directory; here the run's own (run_dir/wandb/)
    previous = state.get("wandb", {}).get("id")
    if previous and "id" not in kwargs and "version" not in kwargs:
        kwargs["id"] = previous  # WandbLogger passes resume="allow": the same W&B run continues
    logger = WandbLogger(**kwargs)
    run = logger.experiment  # wandb.init now: its id is kept for a resume
    return logger, lambda status: run.finish(exit_code=0 if status == "success" else 1), {"id": run.id}


def _mlflow(cfg: Any, run_dir: Path, state: dict[str, Any]) -> tuple[Logger, None, dict[str, Any]]:
    from lightning.pytorch.loggers import MLFlowLogger

    kwargs = dict(plain(cfg.exp_manager.mlflow_logger_kwargs) or {})
    uri = mlflow_tracking_uri(cfg)
    kwargs.pop("save_dir", None)
    kwargs["tracking_uri"] = uri
    if uri.startswith("file:"):
        # MLflow 3 refuses its file store unless asked: the key names one (NxDT's default ./mlruns is one)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    kwargs["experiment_name"] = kwargs.get("experiment_name") or cfg.name  # NxDT's default: the run name
    kwargs.setdefault("run_name", run_dir.name)  # NeMo: the run's version (its timestamp)
    kwargs["tags"] = {**(kwargs.get("tags") or {}), "nxdt.run_dir": str(run_dir)}
    previous = state.get("mlflow", {})
    if previous.get("run_id") and previous.get("tracking_uri") == uri and not kwargs.get("run_id"):
        kwargs["run_id"] = previous["run_id"]
    logger = MLFlowLogger(**kwargs)
    client, run_id = logger.experiment, logger.run_id
    client.set_tag(run_id, "nxdt.run_dir", str(run_dir))  # a continued run's tags were set when it was created
    return logger, None, {"run_id": run_id, "tracking_uri": uri, "experiment_id": logger.experiment_id}


class ClearMLLogger(Logger):
    """A ClearML task as a Lightning logger: every metric a scalar (title and series its name) at its step, the
    hyperparameters connected as the task's ``nxdt`` section. ``task`` is a ``clearml.Task`` (``Task.init``'s)."""

    def __init__(self, task: Any):
        super().__init__()
        self.task = task

    @property
    def name(self) -> str | None:
        return str(self.task.name)

    @property
    def version(self) -> str | None:
        return str(self.task.id)

    @property
    def experiment(self) -> Any:
        return self.task

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        report = self.task.get_logger().report_scalar
        for key, value in metrics.items():
            report(title=key, series=key, value=float(value), iteration=0 if step is None else int(step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.task.connect(dict(params), name="nxdt")

    def finalize(self, status: str) -> None:
        if status != "success":
            self.task.mark_failed(status_reason=f"nxdt: training {status}")
        self.task.close()  # flushes the reports; offline: the session folder (and its .zip) is complete


def _report_in_a_thread() -> None:
    """Offline, ClearML's reports go to the session folder from a thread of this process, not from the subprocess it
    forks by default on Linux (``sdk.development.report_use_subprocess``), unless the user's ClearML config says
    which. Offline that subprocess only writes local files, and ``Task.close()`` waits for it: the flush and stop
    events it waits on are thread events its forked copy never sees (``BackgroundReportService._flush_event`` is a
    ``ForkEvent``, clearml/backend_interface/metrics/reporter.py), so every close sat out its 5 s flush period
    twice — 9.5 s measured per launch (clearml 2.x), 0.02 s with the thread."""
    from clearml.config import config_obj

    if config_obj.get("sdk.development.report_use_subprocess", None) is None:
        config_obj.set_overrides({"sdk": {"development": {"report_use_subprocess": False}}})


def _clearml(cfg: Any, run_dir: Path, state: dict[str, Any]) -> tuple[Logger, None, dict[str, Any]]:
    from clearml import Task

    kwargs = plain(cfg.exp_manager.clearml_logger_kwargs) or {}
    offline = clearml_offline(os.environ)
    if offline:
        os.environ.setdefault("CLEARML_CACHE_DIR", str(run_dir / "clearml"))  # the session folder under the run
        Task.set_offline(True)
        _report_in_a_thread()
    previous = state.get("clearml", {})
    resume = previous.get("task_id") if previous.get("offline") == offline else None
    task = Task.init(
        project_name=kwargs.get("project") or "NeMo",  # NeMo's defaults: project NeMo; task: here the run name
        task_name=kwargs.get("task") or cfg.name,
        tags=["nxdt", *(kwargs.get("tags") or [])],
        # ClearML's TensorBoard hook would report nxdt's TensorBoard scalars a second time; argparse: nxdt's own.
        # No repository detection: its thread runs `git` (subprocess) while Task.init os.forks ClearML's background
        # monitor, and the fork can inherit the pipe that tells Popen the exec happened — Popen then waits forever and
        # Task.close() joins that thread at the end of training (seen: the run hung after its last step). The run's
        # config, not the launch directory's git state, describes what ran.
        auto_connect_frameworks={
            "pytorch": bool(kwargs.get("connect_pytorch")),
            "tensorboard": False,
            "detect_repository": False,
        },
        auto_connect_arg_parser=False,
        reuse_last_task_id=resume or False,  # a new run is a new task (not ClearML's reuse of an unused one)
        continue_last_task=0 if resume else False,  # 0: continue without offsetting the iterations
    )
    task.connect({"nxdt.run_dir": str(run_dir)}, name="nxdt")
    ids = {"task_id": str(task.id), "offline": offline}
    if offline:
        ids["session_dir"] = str(task.get_offline_mode_folder())
    return ClearMLLogger(task), None, ids


def _log_params(label: str, logger: Logger, params: dict[str, Any], warn: Callable[[str], None]) -> None:
    """The config as parameters. MLflow parameters cannot change: a continued run logs the new keys only and names the
    changed ones (nxdt's config-history/ in the run directory holds every launch's config)."""
    if label == "MLflow":
        logged = logger.experiment.get_run(logger.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != str(v)[:250])
        params = {k: v for k, v in params.items() if k not in logged}
        if changed:
            warn(f"nxdt: MLflow keeps this run's first parameters; changed on resume (see config-history/): {', '.join(changed)}")
    if params:
        logger.log_hyperparams(params)


def tracker_loggers(cfg: Any, run_dir: Path, warn: Callable[[str], None] = _say) -> list[Logger]:
    """The trackers the config asks for, built on rank 0 (the caller's job), each guarded, the config logged; their
    run ids written to ``trackers.json``. A tracker that cannot start is left out with one warning line."""
    run_dir = Path(run_dir)
    em = cfg.exp_manager
    state = read_state(run_dir)
    params = flat_params(cfg, run_dir)
    loggers: list[Logger] = []
    for enabled, label, key, build in (
        (em.create_wandb_logger, "W&B", "wandb", _wandb),
        (em.create_mlflow_logger, "MLflow", "mlflow", _mlflow),
        (em.create_clearml_logger, "ClearML", "clearml", _clearml),
    ):
        if not enabled:
            continue
        try:
            inner, finish, ids = build(cfg, run_dir, state)
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [""])[0][:300]
            warn(
                f"nxdt: warning: the {label} tracker could not start ({type(exc).__name__}: {reason}); training continues without it"
            )
            continue
        logger = GuardedLogger(inner, label, warn, finish)
        state[key] = ids
        write_state(run_dir, state)
        logger._guard("log_hyperparams", _log_params, label, inner, params, warn)
        loggers.append(logger)
    return loggers
