"""Modules nxdt did not write — Lightning's own demos (BoringModel, ManualOptimBoringModel, DemoModel,
LightningTransformer) and Lightning's GAN example (BatchNorm in the generator, two Adams, ``toggle_optimizer``) — train
under NxDStrategy (plain, ZeRO-1, FSDP) as under DDPStrategy(gloo) on 2 CPU ranks: per-step losses, the logged
metrics (``sync_dist=True`` and ``self.log_dict``), final weights and buffers, and the module's own ``state_dict()``
after fit and inside ``on_save_checkpoint`` (FSDP: the module's names and full tensors, as under DDP — issue 33). The
runs: tests/lightning_conformance_demos.py (one torchrun launch).

Tolerance: rtol 1e-5, atol 1e-7. None of these runs clips, so the two strategies run the same fp32 operations: a 2-rank
average is exact in both (halving is exact, the sum rounds once), SGD/Adam are element-wise (a ZeRO-1/FSDP flat shard
steps as its parameters would), BatchNorm's buffers are rank 0's broadcast before each forward in both, dropout masks
come from the same seeded generator. Measured on this host: 0.0 (bit for bit) for every value compared; a missing or
doubled reduction or another rank's data moves them by whole percent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import warm_cli
import torch

HERE = Path(__file__).resolve().parent
RTOL, ATOL = 1e-5, 1e-7
MODULES = ("boring", "manual_boring", "demo", "transformer", "gan")
NXDT = ("nxdt", "nxdt_zero1", "nxdt_fsdp")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("conformance_demos")
    result = warm_cli.torchrun(HERE / "lightning_conformance_demos.py", [str(out)], cwd=out, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _same_weights(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), (what, list(got)[:4], list(want)[:4])  # the module's names, in its order
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("run", NXDT)
@pytest.mark.parametrize("module", MODULES)
def test_lightnings_own_modules_train_as_under_ddp(runs, module, run):
    out, reports = runs
    for rank, rep in enumerate(reports):
        states = {r: torch.load(out / r / f"{module}-rank{rank}.pt", weights_only=True) for r in ("ddp", run)}
        got, want = rep[f"{module}/{run}"], rep[f"{module}/ddp"]
        assert len(got["losses"]) == len(want["losses"]) == 8, rank  # 2 epochs of 4 batches
        assert got["losses"] == pytest.approx(want["losses"], rel=RTOL), rank
        assert got["metrics"].keys() == want["metrics"].keys(), rank
        for key, value in want["metrics"].items():
            assert got["metrics"][key] == pytest.approx(value, rel=RTOL), (rank, key)
        _same_weights(states[run]["weights"], states["ddp"]["weights"], "strategy.lightning_module_state_dict()")
        _same_weights(states[run]["own_state"], states["ddp"]["own_state"], "module.state_dict() after fit")
        _same_weights(states[run]["saved_state"], states["ddp"]["saved_state"], "module.state_dict() in on_save_checkpoint")
    # the ranks trained on different data, and the weights moved
    assert reports[0][f"{module}/ddp"]["losses"] != reports[1][f"{module}/ddp"]["losses"]
