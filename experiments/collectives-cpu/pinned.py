"""2-rank all-reduce with the ranks pinned: on different CPUs (``--pin split``: each rank may still share its CPU
with other work on the host) or both on one (``--pin same``: every wait is a context switch). Several algorithms
alternate in blocks inside one world; every block counts at its slowest rank.

    python experiments/collectives-cpu/pinned.py --pin split --algorithms direct slice > pinned_split.txt
    PYTHONPATH=<checkout> python experiments/collectives-cpu/pinned.py ...   # another nxdt (run from this directory)

The regimes the shared 2-core host switches between on its own (experiments/collectives-cpu/README.md, issue #23
round 9), held still, so that an A/B of two algorithms or two builds compares like with like.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from blocks import alternating_blocks
from nxdt.comm.bench import parse_size
from nxdt.comm.spawn import run_local


def _body(world, args: dict) -> dict:
    import nxdt

    os.sched_setaffinity(0, {world.rank} if args["pin"] == "split" else {1})
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    comm, out = world.world, {}
    for dtype_name in args["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for nbytes in args["sizes"]:
            t = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)
            calls = max(2, min(20, (8 << 20) // nbytes))
            variants = {a: (lambda a=a: comm.all_reduce(t, algorithm=a)) for a in args["algorithms"]}
            times = {k: [s * 1e6 for s in v] for k, v in alternating_blocks(comm, variants, args["blocks"], calls).items()}
            out[f"{dtype_name} {nbytes >> 10} KB"] = {k: (min(v), statistics.median(v)) for k, v in times.items()}
    return {"rows": out, "nxdt": os.path.dirname(nxdt.__file__)} if world.rank == 0 else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pin", choices=["split", "same"], default="split")
    p.add_argument("--algorithms", nargs="+", default=["direct", "slice"])
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size(s) for s in ("64kb", "256kb", "1mb", "4mb")])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--blocks", type=int, default=11)
    a = p.parse_args()
    load = os.getloadavg()[0]
    opts = {k: getattr(a, k) for k in ("pin", "algorithms", "sizes", "dtypes", "blocks")}
    report = run_local(_body, 2, opts, timeout_s=900)[0]
    print(
        f"# pin {a.pin}; nxdt from {report['nxdt']}; load average {load:.2f} -> {os.getloadavg()[0]:.2f}; "
        f"fastest / median of {a.blocks} blocks, slowest rank, µs per call"
    )
    for row, cells in report["rows"].items():
        print(f"  {row:<18} " + "  ".join(f"{k}: {lo:8.1f} / {med:8.1f}" for k, (lo, med) in cells.items()))


if __name__ == "__main__":
    main()
