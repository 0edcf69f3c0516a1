"""``nxdt comm-test --calibrate``: measure this host so plans for the ``cpu`` instance predict real runs.

Two measurements, each in N concurrent worker processes (threads per rank as ``nxdt train`` sets them):
collectives over 1 KB – 64 MB (nxdt's shared-memory algorithms, the same code training uses), and the
achieved FLOP/s of forward+backward of a small Llama (the compute rate small models reach here).
"""

from __future__ import annotations

import os
import time
import types
from typing import Any

from nxdt.comm.bench import _body as bench_body
from nxdt.comm.spawn import run_local
from nxdt.planner.estimate import flops_per_token

CALIBRATION_OPS = ["allr", "allg", "redsct", "alltoall", "bcast"]


def _threads_per_rank(n: int) -> int:
    return max(1, (os.cpu_count() or 1) // n)


def _flops_body(world: Any, hidden: int, seq: int, batch: int, steps: int) -> float:
    import torch

    from nxdt.models.llama import LlamaForCausalLM

    torch.set_num_threads(_threads_per_rank(world.world_size))
    cfg = types.SimpleNamespace(
        vocab_size=256,
        hidden_size=hidden,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=int(hidden * 8 / 3),
        max_position_embeddings=seq,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (batch, seq))

    def step() -> None:
        loss = model.loss_fn(model(ids), ids)
        loss.backward()

    step()
    world.world.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - start) / steps
    return flops_per_token(cfg, seq) * batch * seq / elapsed  # the planner's one FLOPs count, as MFU uses


def measure(nworkers: int = 2, maxbytes: int = 64 << 20, hidden: int = 128, seq: int = 128, batch: int = 4) -> dict[str, Any]:
    """Raw measurements: comm-test reports keyed by group size, and FLOP/s per rank."""
    opts = {
        "ops": CALIBRATION_OPS,
        "minbytes": 1 << 10,
        "maxbytes": maxbytes,
        "stepfactor": 4.0,
        "iters": 10,
        "warmup_iters": 3,
        "datatype": "fp32",
        "check": False,
        "algorithm": "auto",
        "baseline": None,
    }
    report = run_local(bench_body, nworkers, opts, timeout_s=3600, comm_timeout_s=300)[0]
    flops = run_local(_flops_body, nworkers, hidden, seq, batch, 5, timeout_s=600)
    return {"reports": {nworkers: report}, "flops_per_s": min(flops)}
