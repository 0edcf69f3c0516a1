"""What each layer of a small all-reduce costs: the Communicator call, the transport, the shm algorithm and
the native step underneath, interleaved in one 2-rank world (each layer called directly).

    python experiments/collectives-cpu/layers.py --dtype bfloat16 --count 256

Every layer does the whole all-reduce (the lower layers skip the ones above them), so the differences
between rows are what each layer adds. Blocks of ``--calls`` calls alternate between the layers; a block
counts at its slowest rank; the table shows the fastest block (the code's cost when both ranks have a core)
and the median block (what the host gave in those minutes).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from blocks import alternating_blocks


def _body(world, args: dict) -> dict:
    from nxdt.comm import native, shm_algorithms as algo
    from nxdt.comm.reduce import dtype_code

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    dtype, count, calls = getattr(torch, args["dtype"]), args["count"], args["calls"]
    comm = world.world
    transport = comm._transport
    ch = transport.channel("default", op="all_reduce")
    t = torch.ones(count, dtype=dtype)

    def uncached() -> None:  # what every call cost before the one-step cache, and still costs a first call
        comm._one_step.clear()
        comm.all_reduce(t)

    layers = {
        "Communicator.all_reduce (repeat call)": lambda: comm.all_reduce(t),
        "Communicator.all_reduce (first call)": uncached,
        "  async_op=True + Work.wait": lambda: comm.all_reduce(t, async_op=True).wait(),
        "ShmTransport.all_reduce": lambda: transport.all_reduce(t, "sum", "shm", None, "default"),
        "shm_algorithms.all_reduce": lambda: algo.all_reduce(ch, t, "sum"),
    }
    if native.lib is not None:
        fp = (algo.OP_ALL_REDUCE + 100, dtype_code(dtype), count, 0)
        comm.all_reduce(t)
        stream, run = comm._one_step[(dtype, count, "sum", "auto", "default")]
        layers["Stream.run_inline(one-step function)"] = lambda: stream.run_inline(run, t)
        layers["one-step function"] = lambda: run(t)
        layers["ShmChannel.all_reduce_step (native)"] = lambda: ch.all_reduce_step(t, fp, "all_reduce(sum)")
    layers["barrier (one synchronisation)"] = lambda: algo.barrier(ch)
    times = alternating_blocks(comm, layers, args["blocks"], calls, warmup=calls, barrier=lambda: algo.barrier(ch))
    return {k: (min(v) * 1e6, statistics.median(v) * 1e6) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--fallback", action="store_true", help="the torch fallback (init_process(native=False))")
    args = p.parse_args()
    import os

    from nxdt.comm.spawn import run_local

    opts = {k: getattr(args, k) for k in ("dtype", "count", "blocks", "calls")}
    load = os.getloadavg()[0]
    result = run_local(_body, 2, opts, timeout_s=1200, init_options={"native": not args.fallback})[0]
    print(
        f"# 2 ranks, all-reduce of {args.count} {args.dtype} ({'torch fallback' if args.fallback else 'native'}); "
        f"load average {load:.2f} → {os.getloadavg()[0]:.2f}; µs per call at the slowest rank"
    )
    print(f"# {'layer':<40} {'fastest block':>14} {'median block':>13}")
    for name, (best, median) in result.items():
        print(f"  {name:<40} {best:>14.2f} {median:>13.2f}")


if __name__ == "__main__":
    main()
