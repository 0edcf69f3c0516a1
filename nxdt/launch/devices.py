"""The launcher's side of GPU runs: the GPUs this host has, checked before any worker starts, and what a dry run
says about every rank's device and the NCCL settings the workers export (the policy itself:
:mod:`nxdt.parallel.devices`)."""

from __future__ import annotations

from typing import Any

from nxdt.config.validate import ConfigError
from nxdt.parallel.devices import node_devices, worker_environment


def visible_gpus() -> int:
    """The CUDA devices torch sees here, counted through NVML (no CUDA context: the workers fork after this)."""
    import torch

    return torch.cuda.device_count()


def resolve_accelerator(cfg: Any, gpus: int, *, runs_here: bool) -> None:
    """``instance.accelerator=cuda`` on this host, before planning: ``instance=gpu`` takes the ``gpus`` found as
    ``instance.devices``; a run that starts here (not a dry run, not a Slurm submission) needs the GPUs its ranks
    are placed on. One ConfigError line otherwise (exit 2, nothing started)."""
    inst = cfg.instance
    if inst.accelerator == "cpu":
        return
    if inst.name == "gpu" and gpus > 0:
        inst.devices = gpus
    if not runs_here:
        return
    if gpus == 0:
        raise ConfigError(
            "instance",
            inst.name,
            "places every rank on an NVIDIA GPU (instance.accelerator=cuda), but torch sees no CUDA device on this host "
            "(torch.cuda.device_count() is 0: no GPU, no driver, or a CPU-only torch build); train on the CPU with "
            "instance=cpu, or run on a host with NVIDIA GPUs",
        )
    ranks = cfg.trainer.devices or inst.devices
    needed = len(set(node_devices("cuda", ranks, inst.devices)))
    if needed > gpus:
        raise ConfigError(
            "instance.devices",
            inst.devices,
            f"{inst.name} places {ranks} ranks on {needed} GPUs, but this host has {gpus}; use instance=gpu (the GPUs "
            f"found here) or trainer.devices={gpus} with instance.devices={gpus}",
        )


def device_lines(cfg: Any, ranks_per_node: int, label: str = "rank") -> list[str]:
    """A dry run's lines for a GPU instance: every rank's device, and the environment each worker exports
    (``instance.env`` minus what this environment sets already). Nothing for a CPU instance."""
    import os

    inst = cfg.instance
    if inst.accelerator == "cpu":
        return []
    devices = node_devices(inst.accelerator, ranks_per_node, inst.devices)
    shared = len(set(devices)) < len(devices)
    lines = [
        "devices: "
        + ", ".join(f"{label} {r} → {d}" for r, d in enumerate(devices))
        + f" (instance.accelerator={inst.accelerator}; "
        + ("ranks share GPUs)" if shared else "one GPU per rank)"),
        "collectives on CUDA tensors: "
        + (
            "where ranks share a GPU (NCCL takes one rank per GPU), through CUDA IPC from 1 MiB and host memory below"
            if shared
            else "nccl, one NCCL communicator per planned group and stream"
        ),
    ]
    env = worker_environment(inst.env, os.environ)
    kept = sorted(set(map(str, inst.env)) - set(env))
    lines.append(
        "NCCL/EFA environment exported by every worker (instance.env): "
        + (" ".join(f"{k}={v}" for k, v in sorted(env.items())) or "none")
        + (f"; kept from this environment: {' '.join(kept)}" if kept else "")
    )
    return lines
