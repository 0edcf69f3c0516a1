"""Tables from run_deepspeed.sh's JSON lines: per cell, every pass's slowest-rank median and the median over passes.

    python experiments/collectives-cpu/summarise_deepspeed.py deepspeed_r5_2ranks.json deepspeed_r5_4ranks.json

For each group size: nxdt (this tree, "after") against DeepSpeed — ratio = nxdt ÷ DeepSpeed per pass, then the
median of those ratios — and nxdt after against before (main), pass by pass (the two runs of a pass are
adjacent in time). A cell is marked:
  DS spinning — DeepSpeed's median is over 1 ms at ≤ 256 KB in that pass: its ranks spin without yielding and
                lost their cores to each other (the ratio then says nothing about either library's kernels);
  noisy       — nxdt's pass medians differ by more than 2× (max / min): the host, not the code, set the figure.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def size(b: int) -> str:
    return f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"


def load(paths: list[str]) -> tuple[dict, list[dict]]:
    runs = defaultdict(list)  # (kind, ranks) -> [run], in the order they ran
    everything = []
    for path in paths:
        for line in open(path):
            run = json.loads(line)
            runs[(run["label"].split()[0], run["ranks"])].append(run)
            everything.append(run)
    return runs, everything


def cells(runs: list[dict]) -> dict:
    out = defaultdict(list)  # (dtype, bytes) -> [row per pass]
    for run in runs:
        for row in run["rows"]:
            out[(row["dtype"], row["bytes"])].append(row)
    return out


def fmt(xs: list[float]) -> str:
    return " / ".join(f"{x:.1f}" if x < 100 else f"{x:.0f}" for x in xs)


def vs_deepspeed(after: list[dict], ranks: int) -> None:
    print(f"\n### {ranks} ranks: nxdt (after) vs DeepSpeed, {len(after)} passes; µs per call, slowest rank, pass by pass\n")
    print("| dtype | size | nxdt shared | nxdt plain | DeepSpeed | shared / DS | plain / DS | note |")
    print("|---|---|---|---|---|---|---|---|")
    for (dtype, nbytes), rows in cells(after).items():
        sh, pl, ds = ([r["median_us"][k] for r in rows] for k in ("nxdt shared", "nxdt plain", "deepspeed"))
        wrong = sum(sum(r["wrong"].values()) for r in rows)
        spinning = [d > 1000 and nbytes <= 256 << 10 for d in ds]
        good = [i for i, s in enumerate(spinning) if not s]
        rs = statistics.median(s / d for s, d in zip(sh, ds))
        rp = statistics.median(p / d for p, d in zip(pl, ds))
        notes = []
        if any(spinning):
            notes.append(
                f"DS spinning in {sum(spinning)}/{len(ds)}"
                + (
                    f"; where not: {statistics.median(sh[i] / ds[i] for i in good):.2f}, {statistics.median(pl[i] / ds[i] for i in good):.2f}"
                    if good
                    else ""
                )
            )
        if max(sh + pl) / min(sh + pl) > 2:
            notes.append("noisy")
        if wrong:
            notes.append(f"{wrong} WRONG")
        print(f"| {dtype} | {size(nbytes)} | {fmt(sh)} | {fmt(pl)} | {fmt(ds)} | {rs:.2f} | {rp:.2f} | {'; '.join(notes)} |")


def after_vs_before(after: list[dict], before: list[dict], ranks: int) -> None:
    print(f"\n### {ranks} ranks: nxdt after vs before, {min(len(after), len(before))} pass pairs; µs per call, slowest rank\n")
    print(
        "| dtype | size | after shared | before shared | after plain | before plain | after / before (shared, plain), median of pairs |"
    )
    print("|---|---|---|---|---|---|---|")
    a, b = cells(after), cells(before)
    for key in a:
        n = min(len(a[key]), len(b[key]))
        get = lambda rows, k: [r["median_us"][k] for r in rows[:n]]
        ash, bsh, apl, bpl = (
            get(a[key], "nxdt shared"),
            get(b[key], "nxdt shared"),
            get(a[key], "nxdt plain"),
            get(b[key], "nxdt plain"),
        )
        rs = statistics.median(x / y for x, y in zip(ash, bsh))
        rp = statistics.median(x / y for x, y in zip(apl, bpl))
        print(f"| {key[0]} | {size(key[1])} | {fmt(ash)} | {fmt(bsh)} | {fmt(apl)} | {fmt(bpl)} | {rs:.2f}, {rp:.2f} |")


def main() -> None:
    runs, everything = load(sys.argv[1:])
    for ranks in sorted({r for _, r in runs}):
        after, before = runs.get(("after", ranks), []), runs.get(("before", ranks), [])
        loads = [
            f"{run['label']}: {run['load_start'][0]:.1f} → {run['load'][0]:.1f}" for run in everything if run["ranks"] == ranks
        ]
        print(f"\n{ranks} ranks, load average (1 min) at start → end of each run: " + "; ".join(loads))
        if after:
            vs_deepspeed(after, ranks)
        if after and before:
            after_vs_before(after, before, ranks)


if __name__ == "__main__":
    main()
