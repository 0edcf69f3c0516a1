"""nxdt's all-reduce vs DeepSpeed's shared-memory all-reduce, interleaved in one set of processes.

    python experiments/collectives-cpu/deepspeed_side_by_side.py -r 2 --dtypes fp32 bf16 --json ds_2ranks.json

DeepSpeed (``pip install deepspeed``; a benchmark-only dependency, never imported by nxdt) runs its
``deepspeed_shm_comm`` op (csrc/cpu/comm/shm.cpp, JIT-built with g++) through
``deepspeed.comm.inference_all_reduce``: ``DS_ACCELERATOR=cpu``, the gloo backend, ``LOCAL_SIZE`` = world
size, no oneCCL. In every rank of one nxdt world the variants — nxdt on a shared tensor
(``World.shared_empty``), nxdt on a plain tensor, DeepSpeed, and (``--gloo``) torch.distributed's gloo —
alternate in blocks of calls; every rank times every block, a block counts at its slowest rank, the table
reports the median block per call. After timing, every variant is checked once with exact-sum inputs.
Rank 0's single-thread ``copy_`` time of the message is the physical reference.

Runs against whichever nxdt is importable, so ``PYTHONPATH=<a checkout of main>`` measures the code before
a change with the same script (it uses only APIs main has).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from blocks import alternating_blocks, join_deepspeed
from nxdt.comm.bench import DTYPES, memcpy_gbps, parse_size

SIZES = ["1kb", "4kb", "64kb", "256kb", "1mb", "4mb", "16mb", "64mb"]


def _calls_per_block(nbytes: int, block: int) -> int:
    return max(2, min(block, (8 << 20) // max(nbytes, 1)))  # ≥ 2 calls, ≈ 8 MB moved per block at most


def _body(world, args: dict) -> dict:
    import nxdt

    n, rank = world.world_size, world.rank
    ds = join_deepspeed(world, args["ds_port"])
    import torch.distributed as dist

    comm = world.world
    arena = world.shared_empty(((64 << 20) + 64,), torch.uint8)
    rows = []
    for dtype_name in args["dtypes"]:
        dtype = DTYPES[dtype_name]
        for nbytes in args["sizes"]:
            count = max(n, nbytes // dtype.itemsize)
            shared = arena[: count * dtype.itemsize].view(dtype).zero_()  # zeros: values never overflow while timed
            plain, ds_buf, gloo_buf = (torch.zeros(count, dtype=dtype) for _ in range(3))
            variants = {
                "nxdt shared": lambda: comm.all_reduce(shared),
                "nxdt plain": lambda: comm.all_reduce(plain),
                "deepspeed": lambda: ds.inference_all_reduce(ds_buf),
            }
            if args["gloo"]:
                variants["gloo"] = lambda: dist.all_reduce(gloo_buf)
            calls = _calls_per_block(nbytes, args["block"])
            times = alternating_blocks(comm, variants, args["blocks"], calls)
            wrong = {}
            for name, buf in (("nxdt shared", shared), ("nxdt plain", plain), ("deepspeed", ds_buf), ("gloo", gloo_buf)):
                if name in variants:
                    buf.fill_(rank + 1)  # small integers: the sum is exact in every dtype
                    variants[name]()
                    wrong[name] = int((buf != n * (n + 1) // 2).sum())
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            rows.append(
                {
                    "dtype": dtype_name,
                    "bytes": count * dtype.itemsize,
                    "median_us": med,
                    "wrong": wrong,
                    "calls_per_block": calls,
                    "memcpy_us": count * dtype.itemsize / memcpy_gbps(count * dtype.itemsize) / 1e3 if rank == 0 else 0.0,
                }
            )
    return {"rows": rows, "nxdt": os.path.dirname(nxdt.__file__), "load": os.getloadavg()} if rank == 0 else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-r", "--nworkers", type=int, default=2)
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size(s) for s in SIZES])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--blocks", type=int, default=9)
    p.add_argument("--block", type=int, default=20, help="calls per block for small messages (fewer above 400 KB)")
    p.add_argument("--gloo", action="store_true", help="also time torch.distributed's gloo all-reduce")
    p.add_argument("--label", default="", help="a name for this run in the output (e.g. before / after)")
    p.add_argument("--json", help="append this run's rows here (one JSON object per line)")
    args = p.parse_args()
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    os.environ["DS_ACCELERATOR"] = "cpu"
    ShareMemCommBuilder().load()  # JIT-build once here, not in every rank at once
    from nxdt.comm.spawn import free_port, run_local

    opts = {k: getattr(args, k) for k in ("sizes", "dtypes", "blocks", "block", "gloo")}
    opts["ds_port"] = free_port()
    load_start = os.getloadavg()
    report = run_local(_body, args.nworkers, opts, timeout_s=3600, comm_timeout_s=600)[0]
    print(
        f"# {args.label} {args.nworkers} ranks; nxdt from {report['nxdt']}; load average at start {load_start[0]:.2f}, "
        f"at end {report['load'][0]:.2f}; median of {args.blocks} interleaved blocks, slowest rank, µs per call"
    )
    names = list(report["rows"][0]["median_us"])
    print(
        f"# {'dtype':<5} {'size':>9} "
        + " ".join(f"{k:>12}" for k in names)
        + f" {'memcpy':>9} {'shared/DS':>10} {'plain/DS':>9} wrong"
    )
    for r in report["rows"]:
        m = r["median_us"]
        print(
            f"  {r['dtype']:<5} {r['bytes']:>9} " + " ".join(f"{m[k]:>12.1f}" for k in names) + f" {r['memcpy_us']:>9.1f} "
            f"{m['nxdt shared'] / m['deepspeed']:>10.2f} {m['nxdt plain'] / m['deepspeed']:>9.2f} {sum(r['wrong'].values())}"
        )
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps({"label": args.label, "ranks": args.nworkers, "load_start": load_start, **report}) + "\n")


if __name__ == "__main__":
    main()
