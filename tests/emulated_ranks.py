"""Under ``torchrun --nproc-per-node N``: each line of the file ``argv[1]`` (config overrides) trained as one run of N
ranks, every rank on the emulated accelerator (``accelerator_emulation``), runs one after another in these processes
(each ends by closing its world); rank 0 prints ``ok <line number>`` after each, and a rank whose run fails prints
``DEVICE-MIX <line number>: <error>`` and exits 1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from accelerator_emulation import EMULATED, EmulatedAccelerator  # noqa: E402
from nxdt.config import compose_config  # noqa: E402
from nxdt.lightning.train import run_training  # noqa: E402
from nxdt.planner import plan  # noqa: E402


def main(cases_file: str, run_root: str) -> int:
    torch.set_num_threads(1)  # ranks share the host's cores
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    lines = [line.split() for line in Path(cases_file).read_text().splitlines() if line.strip()]
    for number, overrides in enumerate(lines, 1):
        cfg = compose_config([f"trainer.devices={world}", *overrides])
        try:
            with EmulatedAccelerator():
                run_training(cfg, plan(cfg), Path(run_root) / f"run{number}", devices=[EMULATED] * world)
        except Exception as error:  # noqa: BLE001  (reported with the case, then this rank stops)
            print(f"DEVICE-MIX {number}: {type(error).__name__}: {error}", flush=True)
            return 1
        if rank == 0:
            print(f"ok {number}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
