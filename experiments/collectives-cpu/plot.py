"""Plot the comm-test JSON reports of this experiment: bus bandwidth vs size, nxdt vs gloo vs memcpy.

python experiments/collectives-cpu/plot.py experiments/collectives-cpu/results_2ranks.json experiments/collectives-cpu/results_4ranks.json
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

TITLES = {
    "allr": "all-reduce",
    "allg": "all-gather",
    "redsct": "reduce-scatter",
    "alltoall": "all-to-all",
    "bcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "send/recv",
}


def main(paths: list[str]) -> None:
    reports = [json.loads(Path(p).read_text()) for p in paths]
    ops = list(dict.fromkeys(r["op"] for r in reports[0]["results"]))
    fig, axes = plt.subplots(len(reports), len(ops), figsize=(3.2 * len(ops), 3.0 * len(reports)), squeeze=False)
    for row, rep in enumerate(reports):
        memcpy = {int(k): v for k, v in rep["memcpy"].items()}
        for col, op in enumerate(ops):
            ax = axes[row][col]
            for key, label, style in (("results", "nxdt", "-o"), ("baseline", "gloo", "--s")):
                pts = [(r["size(B)"], r["busbw(GB/s)"]) for r in rep[key] if r["op"] == op]
                if pts:
                    ax.plot(*zip(*pts), style, label=label, markersize=3)
            sizes = sorted(r["size(B)"] for r in rep["results"] if r["op"] == op)
            ax.plot(sizes, [memcpy.get(s, float("nan")) for s in sizes], ":", color="gray", label="memcpy (1 thread)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{TITLES[op]}, {rep['nworkers']} ranks", fontsize=9)
            ax.set_xlabel("size (B)", fontsize=8)
            if col == 0:
                ax.set_ylabel("busbw (GB/s)", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(paths[0]).parent / "busbw.png"
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
