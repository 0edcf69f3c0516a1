"""All-reduce across two hosts: nxdt (hierarchical) vs torch.distributed gloo over the same hosts.

Two network namespaces joined by a veth pair are the two hosts (as in the tests); each runs
``nxdt comm-test -N 2 -r 4`` with its own torch elastic agent, so 4 ranks = 2 hosts × 2 ranks. Every
run times nxdt and gloo back to back on the same buffers (``--baseline gloo``) and checks nxdt's
result exactly (``--check``). Run as root from the repository root:

    python experiments/multinode/run.py --repeats 3            # -> results.json, tables/*.txt, README numbers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from netns_hosts import Hosts  # noqa: E402  (the tests' two-host setup, reused)


def one_run(hosts: Hosts, algorithm: str, port: int, out: Path) -> dict:
    args = [
        "comm-test",
        "-N",
        "2",
        "-r",
        "4",
        "--rdzv-endpoint",
        f"{hosts.addr[0]}:{port}",
        "-b",
        "1mb",
        "-e",
        "64mb",
        "-f",
        "2",
        "-n",
        "10",
        "-w",
        "3",
        "--check",
        "--baseline",
        "gloo",
        "--show-algorithm",
        "--algorithm",
        algorithm,
        "--report-to-json-file",
        str(out.with_suffix(".json")),
        "allr",
    ]
    b = hosts.nxdt(1, [*args, "--node-rank", "1"])
    a = hosts.nxdt(0, [*args, "--node-rank", "0"])
    (a_out, a_err), (_, b_err) = a.communicate(timeout=1800), b.communicate(timeout=1800)
    if a.returncode or b.returncode:
        raise SystemExit(f"comm-test failed: {a_err[-2000:]}\n{b_err[-2000:]}")
    out.write_text(a_out)
    return json.loads(out.with_suffix(".json").read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    (HERE / "tables").mkdir(exist_ok=True)
    hosts = Hosts(str(os.getpid() % 100000))
    runs = []
    try:
        hosts.setup()
        for i in range(args.repeats):
            load = os.getloadavg()[0]
            report = one_run(hosts, "auto", 29600 + i, HERE / "tables" / f"run{i}_auto.txt")
            runs.append({"algorithm": "auto", "load_before": load, "load_after": os.getloadavg()[0], **report})
        load = os.getloadavg()[0]  # flat ring over all 4 ranks (the non-hierarchical alternative), once
        report = one_run(hosts, "ring", 29650, HERE / "tables" / "run_flat_ring.txt")
        runs.append({"algorithm": "ring", "load_before": load, "load_after": os.getloadavg()[0], **report})
    finally:
        hosts.teardown()
    (HERE / "results.json").write_text(json.dumps(runs, indent=1))

    auto = [r for r in runs if r["algorithm"] == "auto"]
    ring = next(r for r in runs if r["algorithm"] == "ring")
    print(
        "| size | nxdt hierarchical µs (median) | gloo µs (median) | speed-up gloo/nxdt (median, min–max) | flat ring µs | #wrong |"
    )
    print("|---|---|---|---|---|---|")
    for row_i, row in enumerate(auto[0]["results"]):
        size = row["size(B)"]
        nx = [r["results"][row_i]["time:avg(us)"] for r in auto]
        gl = [r["baseline"][row_i]["time:avg(us)"] for r in auto]
        ratio = [g / n for g, n in zip(gl, nx)]
        wrong = sum(r["results"][row_i].get("#wrong", 0) for r in auto)
        print(
            f"| {size >> 20} MB | {statistics.median(nx):.0f} | {statistics.median(gl):.0f} | {statistics.median(ratio):.2f}× "
            f"({min(ratio):.2f}–{max(ratio):.2f}) | {ring['results'][row_i]['time:avg(us)']:.0f} | {wrong} |"
        )
    print(f"algorithms: {auto[0].get('algorithms')}")
    print(f"load average (1 min) per run: {[(round(r['load_before'], 1), round(r['load_after'], 1)) for r in runs]}")


if __name__ == "__main__":
    main()
