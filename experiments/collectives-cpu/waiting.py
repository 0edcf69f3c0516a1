"""Measure nxdt.comm's waiting strategies with 2 and 4 ranks on this host (2 cores).

    python experiments/collectives-cpu/waiting.py > experiments/collectives-cpu/waiting.txt

Strategies (``init_process(wait_policy=...)``, each in a fresh set of ranks):
* default: adaptive spin (300 checks, doubling/halving) → 4 × sched_yield → futex sleep on the flag word
* spin-only: 10^8 spin checks (never yields or sleeps within a wait)
* poll-sleep: no futex — after the spin and yields, sleep 20 µs doubling to 1 ms between checks
Reported: mean all-reduce time (fp32) at 1 KB, 1 MB and 4 MB, and the CPU time the ranks used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

STRATEGIES = {  # name -> WaitPolicy fields
    "default (spin→yield→futex)": {},
    "spin-only": {"spin_checks": 100_000_000, "yields": 0},
    "poll-sleep (no futex)": {"futex": False},
}


def _body(world) -> dict:
    import resource

    import torch

    comm = world.world
    out = {}
    for nbytes, iters in ((1024, 2000), (1 << 20, 100), (4 << 20, 40)):
        t = torch.ones(nbytes // 4)
        for _ in range(10):
            comm.all_reduce(t)
        comm.barrier()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(t)
        elapsed = (time.perf_counter() - start) / iters
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / iters
        slow = torch.tensor([elapsed, cpu], dtype=torch.float64)
        comm.all_reduce(slow, "max")
        out[nbytes] = (float(slow[0]) * 1e6, float(slow[1]) * 1e6)
    return out


def _child(n: int, strategy: str) -> None:
    from nxdt.comm.spawn import run_local
    from nxdt.comm.waiting import WaitPolicy

    policy = WaitPolicy(**STRATEGIES[strategy])
    print(json.dumps({str(k): v for k, v in run_local(_body, n, timeout_s=600, init_options={"wait_policy": policy})[0].items()}))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), sys.argv[3])
        return
    print(f"# host: {os.cpu_count()} cores; load average at start {os.getloadavg()}")
    print(
        f"# {'strategy':<28} {'ranks':>5} {'1KB us':>9} {'1KB cpu/op':>10} {'1MB us':>9} {'1MB cpu/op':>10} {'4MB us':>9} {'4MB cpu/op':>10}"
    )
    for n in (2, 4):
        for name in STRATEGIES:
            res = subprocess.run([sys.executable, __file__, "--child", str(n), name], capture_output=True, text=True, timeout=900)
            if res.returncode:
                print(f"  {name:<28} {n:>5} failed: {res.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            cells = " ".join(f"{r[str(b)][0]:>9.1f} {r[str(b)][1]:>10.1f}" for b in (1024, 1 << 20, 4 << 20))
            print(f"  {name:<28} {n:>5} {cells}", flush=True)
    print(f"# load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
