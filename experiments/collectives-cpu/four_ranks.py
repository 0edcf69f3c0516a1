"""nxdt's 4-rank all-reduce alone (no DeepSpeed in the processes, whose spinning ranks make a 4-rank run take minutes),
fp32 and bf16, default algorithm; fastest and median block of calls at the slowest rank. For before/after: run it
from this directory with PYTHONPATH=<a checkout> (see run_deepspeed.sh for why not from the repo root).

    PYTHONPATH=<checkout> python four_ranks.py --sizes 1kb 64kb 512kb 2mb >> four_ranks.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from nxdt.comm.bench import parse_size
from nxdt.comm.spawn import run_local


def _body(world, args: dict) -> dict:
    import nxdt

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    comm, out = world.world, {}
    slowest = torch.zeros(1, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        for nbytes in args["sizes"]:
            t = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
            calls = max(2, min(20, (8 << 20) // nbytes))
            for _ in range(3):
                comm.all_reduce(t)
            blocks = []
            for _ in range(args["blocks"]):
                comm.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    comm.all_reduce(t)
                slowest.fill_((time.perf_counter() - start) / calls)
                comm.all_reduce(slowest, "max")
                blocks.append(float(slowest) * 1e6)
            out[f"{str(dtype)[6:]} {nbytes >> 10} KB"] = (min(blocks), statistics.median(blocks))
    return {"rows": out, "nxdt": os.path.dirname(nxdt.__file__)} if world.rank == 0 else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size(s) for s in ("1kb", "64kb", "512kb", "2mb")])
    p.add_argument("--blocks", type=int, default=7)
    a = p.parse_args()
    load = os.getloadavg()[0]
    report = run_local(_body, 4, {"sizes": a.sizes, "blocks": a.blocks}, timeout_s=900)[0]
    print(
        f"# 4 ranks; nxdt from {report['nxdt']}; load average {load:.2f} -> {os.getloadavg()[0]:.2f}; fastest / median block, µs per call"
    )
    print("  " + "  ".join(f"{k} {lo:.0f} / {med:.0f}" for k, (lo, med) in report["rows"].items()))


if __name__ == "__main__":
    main()
