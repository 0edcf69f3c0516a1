"""Fit the NVLink values of the GPU classes no published.yaml figure determines to heldout4.yaml's DEV half only.

    python experiments/planner-accuracy/tune_dev.py        # seconds: the fitted values, then the dev half's errors

heldout4.yaml (nccl-tests inside one GPU node, NVIDIA's AIConfigurator database) is split by the rule in its header
into a dev half, which this script may fit to, and a blind half, which nothing fits to (heldout.py --half blind
predicts it once). The A100's (p4d.24xlarge, inherited by p4de.24xlarge) and GB200's (gb200-nvl72) NVLink efficiency
and ramp inside one node were guesses (no single-node sweep in published.yaml); the H100's single-node values are
fit.py's (published.yaml's HGX H100 sweeps) and are not refitted here. Levenberg-Marquardt on log(predicted /
measured), as fit.py does (nxdt.planner.fitting.fit). Copy the printed values into conf/instance/.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import yaml

from nxdt.planner.fitting import (
    bind_collective,
    catalogue_instance,
    fit,
    get_param,
    load_published,
    round_sig,
    with_params,
)

HERE = Path(__file__).resolve().parent
PARAMS = ["device_link.efficiency", "device_link.ramp_us", "device_link.ramp_bytes"]
START = {"device_link.efficiency": 0.8, "device_link.ramp_us": 20.0, "device_link.ramp_bytes": 4e6}
# the figures' instance -> the catalogue entry that holds the values (p4de inherits p4d's NVLink: the same A100 board)
TUNED = {"p4de.24xlarge": "p4d.24xlarge", "gb200-nvl72": "gb200-nvl72"}


def dev_figures() -> list:
    data = yaml.safe_load((HERE / "heldout4.yaml").read_text())
    figures, _ = load_published({"collectives": [e for e in data["collectives"] if e["half"] == "dev"]})
    cache: dict = {}
    return [bind_collective(f, cache) for f in figures]


def tuned_values(figures: list | None = None) -> dict[str, dict[str, float]]:
    """{catalogue entry: its fitted device_link values (3 significant digits, as the catalogue stores them)}."""
    figures = dev_figures() if figures is None else figures
    out = {}
    for instance_name, holder in TUNED.items():
        figs = [f for f in figures if f.instance == instance_name]
        out[holder] = {p: round_sig(v) for p, v in fit(figs, catalogue_instance(instance_name), PARAMS, start=START).items()}
    return out


def main() -> int:
    figures = dev_figures()
    for holder, values in tuned_values(figures).items():
        instance_name = next(name for name, h in TUNED.items() if h == holder)
        figs = [f for f in figures if f.instance == instance_name]
        tuned = with_params(catalogue_instance(instance_name), values)
        errs = [abs(f.predict(tuned) / f.seconds - 1) for f in figs]
        shipped = {p: get_param(catalogue_instance(holder), p) for p in PARAMS}
        print(f"{holder} ({len(figs)} dev figures on {instance_name}): {values}")
        print(f"  dev error: median {100 * statistics.median(errs):.0f} %, max {100 * max(errs):.0f} %")
        if shipped != values:
            print(f"  catalogue differs: {shipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
