"""What the side-by-side scripts share: DeepSpeed's CPU shm all-reduce joined from the processes of an nxdt world, and
variants timed in alternating blocks of calls, each block counted at its slowest rank."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch


def join_deepspeed(world: Any, port: int) -> Any:
    """``deepspeed.comm`` on this rank: ``DS_ACCELERATOR=cpu``, the gloo backend, ``LOCAL_SIZE`` = world size (its
    shm all-reduce then covers every rank), no oneCCL; one compute thread and no autograd, as nccom-test."""
    n, rank = world.world_size, world.rank
    os.environ.update(
        DS_ACCELERATOR="cpu",
        LOCAL_SIZE=str(n),
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import deepspeed
    import deepspeed.comm as ds

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    return ds


def alternating_blocks(
    comm: Any,
    variants: dict[str, Callable[[], Any]],
    blocks: int,
    calls: int,
    *,
    warmup: int = 3,
    barrier: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per block at the slowest rank; the variants alternate block by
    block (after ``warmup`` calls each: segments mapped, pages faulted in), so the host's minute-to-minute noise
    falls on all of them alike. ``barrier`` lines the ranks up before each block (default: ``comm.barrier``)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    line_up = barrier or comm.barrier
    slowest = torch.zeros(1, dtype=torch.float64)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(blocks):
        for name, fn in variants.items():
            line_up()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            slowest.fill_((time.perf_counter() - start) / calls)
            comm.all_reduce(slowest, "max")
            times[name].append(float(slowest))
    return times
