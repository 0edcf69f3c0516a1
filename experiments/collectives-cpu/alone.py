"""nxdt's 2-rank all-reduce alone (no DeepSpeed in the processes), fp32 and bf16 at 256 KB and 1 MB on plain tensors,
and the native reduction kernel alone (one thread, CPU time): the reference for the harness's bf16 256 KB / 1 MB rows.

    python experiments/collectives-cpu/alone.py > alone.txt
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from nxdt.comm.spawn import run_local


def _body(world, _) -> dict:
    from nxdt.comm import native

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    comm, out = world.world, {}
    for dtype, code in ((torch.float32, 1), (torch.bfloat16, 3)):
        for nbytes in (256 << 10, 1 << 20):
            t = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
            for _ in range(5):
                comm.all_reduce(t)
            blocks = []
            for _ in range(15):
                comm.barrier()
                start = time.perf_counter()
                for _ in range(20):
                    comm.all_reduce(t)
                blocks.append((time.perf_counter() - start) / 20 * 1e6)
            other, kernel = torch.zeros_like(t), []
            for _ in range(30):
                start = time.thread_time_ns()
                native.lib.reduce(t.data_ptr(), (t.data_ptr(), other.data_ptr()), t.numel(), code, 1, 2)
                kernel.append((time.thread_time_ns() - start) / 1e3)
            out[f"{str(dtype)[6:]} {nbytes >> 10} KB"] = (min(blocks), statistics.median(blocks), min(kernel))
    return out


if __name__ == "__main__":
    load = os.getloadavg()[0]
    results = run_local(_body, 2, None, timeout_s=300)
    print(f"# 2 ranks, plain tensors, this rank's block times (20 calls); load {load:.2f} → {os.getloadavg()[0]:.2f}")
    for rank, res in enumerate(results):
        for k, (best, med, kern) in res.items():
            print(f"  rank {rank} {k:<14} all_reduce fastest {best:7.1f} median {med:7.1f} µs; kernel alone {kern:6.1f} µs")
