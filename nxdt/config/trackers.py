"""The experiment-tracker keys checked before launch (``nxdt train`` runs :func:`check_trackers` before any worker
starts): each tracker asked for has its package, its arguments, and a server that answers. Pure stdlib: no torch,
no Lightning, no tracker package imported (their presence is looked up). The loggers themselves:
:mod:`nxdt.lightning.trackers`."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import OmegaConf

from nxdt.config.validate import ConfigError

REACH_TIMEOUT_S = 5.0  # a tracking server that does not answer within this is refused before launch
WANDB_DEFAULT_URL = "https://api.wandb.ai"

# create_* key → (the module it needs, what to install)
PACKAGES = {
    "create_wandb_logger": ("wandb", "pip install 'nxdt[trackers]' (wandb)"),
    "create_mlflow_logger": ("mlflow", "pip install 'nxdt[trackers]' (mlflow-skinny)"),
    "create_clearml_logger": ("clearml", "pip install clearml (or 'nxdt[trackers]')"),
}

# clearml_logger_kwargs: NeMo's ClearMLParams (nemo/utils/loggers/clearml_logger.py). project / task / tags /
# connect_pytorch name the task; log_model, model_name, log_cfg and log_metrics concern the .nemo OutputModel NeMo
# uploads with each checkpoint, which nxdt does not (its checkpoints are directories): false is accepted, true refused.
CLEARML_KEYS = ("project", "task", "tags", "connect_pytorch")
CLEARML_MODEL_KEYS = ("log_model", "model_name", "log_cfg", "log_metrics")


def clearml_offline(env: Mapping[str, str]) -> bool:
    """ClearML's own switch (``CLEARML_OFFLINE_MODE``, read as clearml reads a boolean environment variable)."""
    return env.get("CLEARML_OFFLINE_MODE", "").strip().lower() in ("1", "true", "yes", "y", "on")


def plain(value: Any) -> Any:
    """A config node (the typed dataclasses a worker reads, or an OmegaConf node) as plain Python containers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def mlflow_tracking_uri(cfg: Any, env: Mapping[str, str] | None = None) -> str:
    """Where MLflow logs: ``mlflow_logger_kwargs.tracking_uri``, else ``save_dir`` (NeMo's MLFlowParams), else
    ``MLFLOW_TRACKING_URI``, else ``file:<exp_dir>/mlruns`` (NxDT: ``./mlruns``; under exp_dir, every run of it in one
    store). Relative file paths are made absolute here, so the launcher's check and the worker agree."""
    env = os.environ if env is None else env
    kwargs = plain(cfg.exp_manager.mlflow_logger_kwargs) or {}
    uri = kwargs.get("tracking_uri") or (f"file:{kwargs['save_dir']}" if kwargs.get("save_dir") else None)
    uri = uri or env.get("MLFLOW_TRACKING_URI") or f"file:{Path(cfg.exp_manager.exp_dir) / 'mlruns'}"
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("", "file"):
        return "file:" + str(Path(parsed.path or uri).expanduser().resolve())
    return uri


def _reachable(url: str, timeout_s: float) -> str | None:
    """None when an HTTP server answers at ``url`` (any status: it is there), else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (the tracker packages take seconds to import)."""
    return importlib.util.find_spec(module) is not None


def check_trackers(
    cfg: Any,
    env: Mapping[str, str] | None = None,
    timeout_s: float = REACH_TIMEOUT_S,
    is_installed: Callable[[str], bool] = installed,
) -> None:
    """Before launch: every tracker asked for has its package (``is_installed``), its arguments and (when online) a
    server that answers; otherwise a ``ConfigError`` naming the key."""
    env = os.environ if env is None else env
    em = cfg.exp_manager
    for key, (module, install) in PACKAGES.items():
        if getattr(em, key) and not is_installed(module):
            raise ConfigError(
                f"exp_manager.{key}", True, f"needs the {module} package, not installed: {install}, or set it false"
            )
    if em.create_dllogger_logger:  # whether dllogger is installed or not: why, in nxdt.lightning.trackers' docstring
        raise ConfigError(
            "exp_manager.create_dllogger_logger",
            True,
            "not attached by nxdt (NxD Training passes it to NeMo as false): metrics.csv holds every step's values; "
            "use create_wandb_logger, create_mlflow_logger or create_clearml_logger, or set it false",
        )
    if em.create_clearml_logger:
        _check_clearml(plain(em.clearml_logger_kwargs) or {}, env, timeout_s)
    if em.create_wandb_logger:
        kwargs = plain(em.wandb_logger_kwargs) or {}
        if "name" not in kwargs and "project" not in kwargs:  # NeMo's configure_loggers: the same rule
            raise ConfigError(
                "exp_manager.wandb_logger_kwargs",
                kwargs,
                "W&B needs a name or a project (as in NxD Training): +exp_manager.wandb_logger_kwargs.project=NAME",
            )
        mode = "offline" if kwargs.get("offline") else kwargs.get("mode") or env.get("WANDB_MODE", "online")
        if mode not in ("offline", "disabled", "dryrun"):
            url = env.get("WANDB_BASE_URL", WANDB_DEFAULT_URL)
            why = _reachable(url, timeout_s)
            if why is not None:
                raise ConfigError(
                    "exp_manager.create_wandb_logger",
                    True,
                    f"the W&B server {url} cannot be reached ({why}) within {timeout_s:g} s; "
                    "run with WANDB_MODE=offline to log locally (wandb sync later)",
                )
    if em.create_mlflow_logger:
        uri = mlflow_tracking_uri(cfg, env)
        scheme = urllib.parse.urlparse(uri).scheme
        if scheme == "file":
            store = Path(uri[len("file:") :])
            existing = next((p for p in (store, *store.parents) if p.exists()), None)
            if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
                raise ConfigError(
                    "exp_manager.mlflow_logger_kwargs.tracking_uri", uri, f"{existing} is not a directory this user can write"
                )
        elif scheme in ("http", "https"):
            why = _reachable(uri.rstrip("/") + "/health", timeout_s)  # the MLflow server's health endpoint
            if why is not None:
                raise ConfigError(
                    "exp_manager.mlflow_logger_kwargs.tracking_uri",
                    uri,
                    f"cannot be reached ({why}) within {timeout_s:g} s; start the tracking server, or log to a file store "
                    "(tracking_uri=file:DIR)",
                )


def _check_clearml(kwargs: dict[str, Any], env: Mapping[str, str], timeout_s: float) -> None:
    """ClearML's arguments, and where it would report: offline (``CLEARML_OFFLINE_MODE=1``) needs nothing; online needs
    a server (``CLEARML_API_HOST``, which must answer) or a ClearML configuration file (``clearml-init`` writes one)."""
    key = "exp_manager.clearml_logger_kwargs"
    for name, value in kwargs.items():
        if name in CLEARML_MODEL_KEYS:
            if value:
                raise ConfigError(
                    f"{key}.{name}",
                    value,
                    "concerns the .nemo output model NeMo uploads with each checkpoint; nxdt uploads no model "
                    "(nxdt checkpoint export-hf writes one): set it false or drop it",
                )
        elif name not in CLEARML_KEYS:
            raise ConfigError(f"{key}.{name}", value, f"not a ClearML logger argument: use {', '.join(CLEARML_KEYS)}")
    tags = kwargs.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        raise ConfigError(f"{key}.tags", tags, "must be a list of strings, e.g. '+exp_manager.clearml_logger_kwargs.tags=[a,b]'")
    if clearml_offline(env):
        return
    host = env.get("CLEARML_API_HOST")
    if host:
        why = _reachable(host.rstrip("/") + "/debug.ping", timeout_s)  # the API server's liveness endpoint
        if why is not None:
            raise ConfigError(
                "exp_manager.create_clearml_logger",
                True,
                f"the ClearML server CLEARML_API_HOST={host} cannot be reached ({why}) within {timeout_s:g} s; "
                "run with CLEARML_OFFLINE_MODE=1 to keep the session locally (clearml-task import later)",
            )
        return
    files = [env.get("CLEARML_CONFIG_FILE"), str(Path("~/clearml.conf").expanduser())]
    if not any(f and Path(f).expanduser().is_file() for f in files):
        raise ConfigError(
            "exp_manager.create_clearml_logger",
            True,
            "ClearML has no server configured (no ~/clearml.conf, CLEARML_CONFIG_FILE or CLEARML_API_HOST): run "
            "clearml-init, or CLEARML_OFFLINE_MODE=1 to keep the session under <run>/clearml/",
        )
