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

from lightning_conformance_heldout import MODULES as HELDOUT
from test_lightning_conformance_ckpt import assert_same

HERE = Path(__file__).resolve().parent
RTOL, ATOL = 1e-5, 1e-7
MODULES = ("boring", "manual_boring", "demo", "transformer", "gan")
NXDT = ("nxdt", "nxdt_zero1", "nxdt_fsdp")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("conformance_demos")
    result = warm_cli.torchrun(HERE / "lightning_conformance_demos.py", [str(out)], cwd=out, timeout=560)
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


def _close(got, want, where: str) -> None:
    """Equal structure; numbers within the tolerance, everything else exactly."""
    if isinstance(want, dict):
        assert list(got) == list(want), (where, list(got), list(want))
        for k in want:
            _close(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=RTOL, abs=ATOL), where
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("run", NXDT)
@pytest.mark.parametrize("module", list(HELDOUT))
def test_held_out_modules_train_as_under_ddp(runs, module, run):
    """Modules written as Lightning users write them, not by nxdt (tests/lightning_conformance_heldout.py: several
    validation dataloaders with test/predict after fit, ``self.all_gather``, ``configure_gradient_clipping``,
    step-interval schedulers with ``frequency`` and ReduceLROnPlateau under LearningRateMonitor, manual gradient
    accumulation, a dict-returning ``training_step`` with ModelCheckpoint(monitor)/EarlyStopping, tied weights,
    on_epoch/reduce_fx logging): on each rank every loss, every logger call (LearningRateMonitor's rates included),
    the callback metrics, test metrics, predictions, the checkpoint callback's choices, and the final weights.
    Found by them: FSDP's test/predict after fit broadcast rank 0's flat shard over every rank's (weights 46x off);
    FSDP kept a manual loop's in-flight gradient through Lightning's zero_grad before validation (4.6% off).

    Tolerance: rtol 1e-5, atol 1e-7 (the table's). Measured bit for bit except manual accumulation (≤ 2.3e-6
    relative): DDP averages each backward's gradient and adds, (a1+b1)/2 + (a2+b2)/2, nxdt sums locally and averages
    once, ((a1+a2)+(b1+b2))/2 — an ulp or two per step, carried by AdamW over 10 steps; a missing or doubled
    reduction, another rank's data or a lost gradient moves values by percent."""
    out, reports = runs
    for rank, rep in enumerate(reports):
        got, want = rep[f"{module}/{run}"], rep[f"{module}/ddp"]
        assert "error" not in want, want.get("error")
        assert "error" not in got, got.get("error")
        _close(got, want, f"{module}/{run} rank {rank}")
        _same_weights(
            torch.load(out / run / f"{module}-rank{rank}.pt", weights_only=True),
            torch.load(out / "ddp" / f"{module}-rank{rank}.pt", weights_only=True),
            "final weights",
        )
    assert reports[0][f"{module}/ddp"]["losses"] != reports[1][f"{module}/ddp"]["losses"]  # each rank its own data


def _lightning_file(path: Path, tmp: Path) -> dict:
    """A checkpoint as Lightning reads it: the file, or nxdt's directory converted to one."""
    from nxdt.lightning import convert_to_lightning_checkpoint

    if path.is_dir():
        convert_to_lightning_checkpoint(path, tmp / "converted.ckpt")
        path = tmp / "converted.ckpt"
    return torch.load(path, weights_only=True)


def _paths_relative(value, root: str):
    """Checkpoint callbacks' states hold absolute paths: those under the run's root compared relative to it."""
    if isinstance(value, str):
        return value.replace(root, "<root>")
    if isinstance(value, dict):
        return {_paths_relative(k, root): _paths_relative(v, root) for k, v in value.items()}
    return value


@pytest.mark.parametrize("run", NXDT)
def test_held_out_best_checkpoint_holds_what_ddps_does(runs, run, tmp_path):
    """The ``checkpointed`` module's best checkpoint (ModelCheckpoint(monitor="val_loss", save_top_k=2)): the same
    file name, and the same contents as DDP's file — weights, optimizer and scheduler state, loops, callbacks
    (ModelCheckpoint's and EarlyStopping's states, paths relative to each run's folder), hyper-parameters, epoch and
    step; ZeRO-1's and FSDP's directories through ``convert_to_lightning_checkpoint``."""
    out, reports = runs
    best = reports[0]["checkpointed/ddp"]["best"]["path"]
    want = _lightning_file(out / "ddp" / "checkpointed" / "best" / best, tmp_path)
    got = _lightning_file(out / run / "checkpointed" / "best" / best, tmp_path)
    assert sorted(got) == sorted(want)
    for key in want:
        g, w = (_paths_relative(c[key], str(out / r / "checkpointed")) for c, r in ((got, run), (want, "ddp")))
        if key in ("state_dict", "optimizer_states"):
            assert_same(g, w, key)
        else:
            assert g == w, (key, g, w)
