"""``nxdt train`` with ``launcher=torchrun`` or ``launcher=slurm``, and ``launcher.dry_run=true`` for any
launcher: from a validated config and its Plan to the agents (or to what they would be)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from nxdt.config import run_config_text
from nxdt.config.validate import ConfigError


def multinode_run_dir(cfg: Any, rdzv_id: str) -> Path:
    """The same directory on every node without talking to the others: explicit_log_dir, else
    ``<exp_dir>/<name>/<rdzv_id>`` (restart with the same id and resume_if_exists=true to continue)."""
    em = cfg.exp_manager
    if em.explicit_log_dir:
        return Path(em.explicit_log_dir).expanduser().resolve()
    return Path(em.exp_dir).expanduser().resolve() / cfg.name / rdzv_id


def run_torchrun(cfg: Any, plan: Any, overrides: list[str], console_tty: bool) -> int:
    from nxdt.launch.multinode import resolve_node, write_atomically
    from nxdt.launch.node import run_node
    from nxdt.launch.rundir import CONFIG_FILE, OVERRIDES_FILE, PLAN_FILE, check_same_run, record_history, resume_lines

    try:
        spec = resolve_node(cfg.launcher, plan.num_nodes, plan.ranks_per_node, cfg.exp_manager.max_restarts)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    run_dir = multinode_run_dir(cfg, spec.rdzv_id)
    if not cfg.launcher.dry_run:
        try:
            changes = check_same_run(cfg, run_dir)  # every node refuses a changed model or training key alike
        except ConfigError as exc:
            print(str(exc), file=sys.stderr)
            return 2
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        # one history entry per launch: written by the node that hosts the rendezvous (the directory may be shared,
        # and the other nodes write the same config.yaml at the same time)
        text = run_config_text(cfg)
        entry = record_history(run_dir, text, overrides, keep_earlier=False) if spec.is_host else None
        write_atomically(run_dir / CONFIG_FILE, text)
        write_atomically(run_dir / PLAN_FILE, plan.to_json())
        write_atomically(run_dir / OVERRIDES_FILE, "\n".join(overrides) + "\n")
        print(f"nxdt: run directory {run_dir} ({plan.world_size} ranks on {plan.num_nodes} nodes)", flush=True)
        if changes is not None:
            print("\n".join(resume_lines(run_dir, changes, entry, cfg.data.source == "megatron")), flush=True)
    return run_node(run_dir, cfg, plan, dry_run=cfg.launcher.dry_run, console_tty=console_tty)


def run_slurm(cfg: Any, plan: Any, overrides: list[str]) -> int:
    from nxdt.launch.rundir import check_same_run, choose_run_dir, resume_lines, write_run_dir
    from nxdt.launch.slurm import sbatch_command, sbatch_script, submit

    run_dir = choose_run_dir(cfg)
    try:
        changes = check_same_run(cfg, run_dir)  # a dry run shows a refused resume too
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if cfg.launcher.dry_run:
        from nxdt.launch.devices import device_lines

        script = run_dir / "job.sbatch"
        print(
            f"nxdt: dry run — nothing submitted, nothing written; the run directory would be {run_dir} (config.yaml, plan.json, job.sbatch)"
        )
        print(f"command: {shlex.join(sbatch_command(script, cfg.launcher.wait))}")
        print(f"--- {script}")
        print(sbatch_script(cfg, plan, run_dir), end="")
        print("---")
        for line in device_lines(cfg, plan.ranks_per_node, "local rank"):  # a GPU instance: on every node
            print(line)
        return 0
    entry = write_run_dir(run_dir, cfg, plan, overrides)
    print(f"nxdt: run directory {run_dir} ({plan.world_size} ranks on {plan.num_nodes} nodes)", flush=True)
    if changes is not None:
        print("\n".join(resume_lines(run_dir, changes, entry, cfg.data.source == "megatron")), flush=True)
    return submit(cfg, plan, run_dir)


def describe_local(cfg: Any, plan: Any, console_tty: bool) -> str:
    """What a local run would start; a resume that would be refused raises ConfigError, as the run would."""
    from nxdt.launch.devices import device_lines
    from nxdt.launch.multinode import WORKER_MODULE
    from nxdt.launch.rundir import check_same_run, choose_run_dir, resume_lines

    run_dir = choose_run_dir(cfg)
    changes = check_same_run(cfg, run_dir)
    resumed = resume_lines(run_dir, changes, None, cfg.data.source == "megatron") if changes is not None else []
    args = [sys.executable, *WORKER_MODULE, str(run_dir)] + (["--console-tty"] if console_tty else [])
    return "\n".join(
        [
            *resumed,
            f"nxdt: dry run — nothing started, nothing written; the run directory would be {run_dir}",
            f"agent: torch elastic_launch on this host, {plan.ranks_per_node} workers, nxdt-local rendezvous: one store on 127.0.0.1 only (a free port), "
            f"max_restarts={cfg.exp_manager.max_restarts}",
            f"worker command: {shlex.join(args)} (forked from a server that has imported torch and Lightning once)",
            f"worker environment (set by the agent): RANK LOCAL_RANK WORLD_SIZE={plan.world_size} LOCAL_WORLD_SIZE={plan.ranks_per_node} "
            "MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID",
            *device_lines(cfg, plan.ranks_per_node),
        ]
    )


def launch(cfg: Any, plan: Any, overrides: list[str], console_tty: bool) -> int:
    """Dispatch on ``launcher.name`` for everything but a real local run (the caller does that)."""
    name = cfg.launcher.name
    if name == "torchrun":
        return run_torchrun(cfg, plan, overrides, console_tty)
    if name == "slurm":
        return run_slurm(cfg, plan, overrides)
    try:
        print(describe_local(cfg, plan, console_tty))
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    return 0
