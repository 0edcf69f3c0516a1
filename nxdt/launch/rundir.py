"""Run directories: ``<exp_dir>/<name>/<timestamp>/`` holding the resolved ``config.yaml`` and ``plan.json``
the workers read, and ``logs/``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from nxdt.config import ConfigError, save_run_config
from nxdt.planner import Plan

CONFIG_FILE, PLAN_FILE = "config.yaml", "plan.json"


def _resumable(run: Path) -> bool:
    return any((p / "done").is_file() for p in (run / "checkpoints").glob("step-*"))


def choose_run_dir(cfg: Any) -> Path:
    """explicit_log_dir if given; with resume_if_exists the newest run of this name that has a complete
    checkpoint (so the resumed run continues in the same directory); otherwise a new timestamped one."""
    em = cfg.exp_manager
    if em.explicit_log_dir:
        return Path(em.explicit_log_dir).expanduser().resolve()
    exp_root = Path(em.exp_dir).expanduser().resolve()
    root = exp_root / cfg.name
    normal = Path(os.path.normpath(root))
    if not cfg.name or normal == exp_root or normal.parent != exp_root:  # validate() refuses such names first
        raise ConfigError("name", cfg.name, f"the run directory {normal} would not be a directory of its own under "
                          f"exp_manager.exp_dir={exp_root}; give a plain directory name (no '/', '..' or absolute path)")
    if em.resume_if_exists and root.is_dir():
        candidates = sorted((p for p in root.iterdir() if p.is_dir() and _resumable(p)), key=lambda p: p.name)
        if candidates:
            return candidates[-1]
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    run = root / stamp
    n = 1
    while run.exists():
        run = root / f"{stamp}_{n}"
        n += 1
    return run


def write_run_dir(run_dir: Path, cfg: Any, plan: Plan) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_run_config(cfg, run_dir / CONFIG_FILE)
    plan.save(run_dir / PLAN_FILE)
