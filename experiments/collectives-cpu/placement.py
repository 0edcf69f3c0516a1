"""Where the two ranks ran, block by block: the side-by-side harness's variants (nxdt on a shared tensor, on a plain
tensor, DeepSpeed) with, per block and rank, wall and CPU time per call, voluntary / involuntary context switches
per call and the CPU at the block's start and end.

    PY=<python with deepspeed>; cd experiments/collectives-cpu
    PYTHONPATH=../.. $PY placement.py --sizes 256kb 1mb > placement.txt

Reading it: ranks on different CPUs with wall ≈ CPU time is the state in which both libraries run at their speed;
both ranks on one CPU (the host's other work holds the other) makes wall ≈ the sum of both ranks' CPU time, and
DeepSpeed, which never yields, collapses to milliseconds. The shared 2-core host flips between the two within a run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import time

import torch

from blocks import join_deepspeed
from nxdt.comm.bench import DTYPES, parse_size


def _body(world, args: dict) -> list:
    n = world.world_size
    ds = join_deepspeed(world, args["ds_port"])
    libc = ctypes.CDLL(None)
    comm = world.world
    arena = world.shared_empty(((64 << 20) + 64,), torch.uint8)
    rows = []
    mine, everyone = torch.zeros(5, dtype=torch.float64), torch.zeros(5 * n, dtype=torch.float64)
    for dtype_name in args["dtypes"]:
        dtype = DTYPES[dtype_name]
        for nbytes in args["sizes"]:
            count = nbytes // dtype.itemsize
            shared = arena[:nbytes].view(dtype).zero_()
            plain, ds_buf = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)
            variants = {
                "nxdt shared": lambda: comm.all_reduce(shared),
                "nxdt plain": lambda: comm.all_reduce(plain),
                "deepspeed": lambda: ds.inference_all_reduce(ds_buf),
            }
            calls = max(2, min(20, (8 << 20) // nbytes))
            for fn in variants.values():
                for _ in range(3):
                    fn()
            blocks: dict[str, list] = {k: [] for k in variants}
            for _ in range(args["blocks"]):
                for name, fn in variants.items():
                    comm.barrier()
                    cpu0, ru0 = libc.sched_getcpu(), resource.getrusage(resource.RUSAGE_SELF)
                    t0, start = time.thread_time(), time.perf_counter()
                    for _ in range(calls):
                        fn()
                    wall, cpu = (time.perf_counter() - start) / calls, (time.thread_time() - t0) / calls
                    ru1, cpu1 = resource.getrusage(resource.RUSAGE_SELF), libc.sched_getcpu()
                    mine[:] = torch.tensor(
                        [
                            wall,
                            cpu,
                            (ru1.ru_nvcsw - ru0.ru_nvcsw) / calls,
                            (ru1.ru_nivcsw - ru0.ru_nivcsw) / calls,
                            10 * cpu0 + cpu1,
                        ]
                    )
                    comm.all_gather(everyone, mine)
                    blocks[name].append(everyone.view(n, 5).tolist())
            rows.append({"dtype": dtype_name, "bytes": nbytes, "blocks": blocks})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size("256kb")])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--blocks", type=int, default=9)
    a = p.parse_args()
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    os.environ["DS_ACCELERATOR"] = "cpu"
    ShareMemCommBuilder().load()
    from nxdt.comm.spawn import free_port, run_local

    load = os.getloadavg()[0]
    opts = {"sizes": a.sizes, "dtypes": a.dtypes, "blocks": a.blocks, "ds_port": free_port()}
    rows = run_local(_body, 2, opts, timeout_s=900, comm_timeout_s=600)[0]
    print(
        f"# 2 ranks; load average {load:.2f} -> {os.getloadavg()[0]:.2f}; per block and rank: µs per call wall / CPU, "
        "voluntary / involuntary switches per call, CPU at start->end"
    )
    for row in rows:
        for name, blocks in row["blocks"].items():
            print(f"{row['dtype']} {row['bytes'] >> 10} KB {name}")
            for b in blocks:
                print(
                    "    "
                    + " | ".join(
                        f"r{q}: {r[0] * 1e6:7.1f} / {r[1] * 1e6:7.1f} µs, {r[2]:4.2f} / {r[3]:4.2f} csw, cpu {int(r[4]) // 10}->{int(r[4]) % 10}"
                        for q, r in enumerate(b)
                    )
                )
            wall = [max(r[0] for r in b) * 1e6 for b in blocks]
            split = sum(int(b[0][4]) // 10 != int(b[1][4]) // 10 for b in blocks)
            print(
                f"  median wall {statistics.median(wall):.1f} µs, fastest {min(wall):.1f}; ranks on different CPUs at the start of {split}/{len(blocks)} blocks"
            )


if __name__ == "__main__":
    main()
