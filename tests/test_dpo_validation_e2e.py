"""Validation of DPO: NxD Training's DPO config (tests/nxdt_configs/hf_llama3_8B_DPO_config.yaml, shrunk as
test_dpo_e2e does) on DP2 with ZeRO-1 and ``data.val_split``, and on CP2 (each sequence split over two ranks, its
log-probabilities added up over them), each launch checked against a single-process computation written here from the
DPO paper's formula.

The 64 shipped pairs: the last 10 are held out; the global batch is 8 pairs, so the second validation batch is padded
with 6 pairs that have no label — rank 0 holds 2 real pairs of it, rank 1 none. After three training steps the
validation at step 3 must give, over exactly those 10 pairs:

* ``val_rewards/chosen`` = mean β·(log π(y_c|x) − log π_ref(y_c|x)) with π the step-3 checkpoint's weights and π_ref
  the initial ones (the reference of the validation pairs is precomputed before training too, from the held-out part
  of the same dataset), ``val_rewards/rejected`` likewise, ``val_rewards/margins`` their difference, ``val_loss`` the
  mean over pairs of −log σ(margin) (not token-weighted);
* ``val_rewards/accuracies`` the fraction of the 10 pairs whose chosen reward is higher (a count over the whole set,
  not a mean of per-batch or per-rank fractions: those would differ here, the ranks holding 8, 2 and 0 pairs).

The values reach metrics.csv (in step 3's row) and TensorBoard under the same names.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from test_dpo_e2e import PARITY, _train
from test_sft_e2e import _rows, _tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BETA = 0.5
VAL_PAIRS = 10  # ceil(0.15 · 64)
VALIDATION = [
    "trainer.devices=2",
    "data.val_split=0.15",
    "exp_manager.create_tensorboard_logger=true",
    f"model_alignment_strategy.dpo.kl_beta={BETA}",
]


@pytest.fixture(scope="module", params=[[], ["distributed_strategy.context_parallel_size=2"]], ids=["dp2", "cp2"])
def launched(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("dpo_val")
    tokenizer = _tokenizer(tmp / "tokenizer")
    run = tmp / "run"
    result = _train(
        tmp,
        "hf_llama3_8B_DPO_config",
        *PARITY,
        *VALIDATION,
        *request.param,
        f"exp_manager.explicit_log_dir={run}",
        f"data.tokenizer.type={tokenizer}",
    )
    return run, result.stdout


def _sequence_log_probs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log π(y|x) of every row, in float64 from the model's logits: Σ over labelled positions of log softmax[label]."""
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"]).double()
    labels = batch["labels"]
    mask = labels != -100
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1)


def _expected(run) -> dict[str, Any]:
    """DPO over the held-out pairs, one process, the step-3 checkpoint against the initial weights."""
    import lightning.pytorch as pl

    from nxdt.config import load_run_config
    from nxdt.data.preferences import pair_rows
    from nxdt.lightning.datamodule import build_preference_dataset, hold_out
    from nxdt.lightning.module import import_architecture, read_checkpoint_weights

    cfg = load_run_config(run / "config.yaml")
    pl.seed_everything(cfg.seed, verbose=False)  # what the worker does right before it builds the model
    initial = import_architecture(cfg.model.architecture)(cfg.model).eval()
    trained = import_architecture(cfg.model.architecture)(cfg.model).eval()
    trained.load_state_dict(read_checkpoint_weights(str(run / "checkpoints" / "step-3"))[0])
    data = cfg.data
    dataset = build_preference_dataset(
        data, cfg.model_alignment_strategy.dpo, data.train_dir, cfg.model.vocab_size, limit=data.dev_choose_samples
    )
    _, held = hold_out(dataset, data.val_split)
    assert len(held) == VAL_PAIRS
    batch = pair_rows(torch.utils.data.default_collate([held[i] for i in range(len(held))]))
    policy, reference = _sequence_log_probs(trained, batch), _sequence_log_probs(initial, batch)
    chosen = BETA * (policy[:VAL_PAIRS] - reference[:VAL_PAIRS])
    rejected = BETA * (policy[VAL_PAIRS:] - reference[VAL_PAIRS:])
    margins = chosen - rejected
    # a margin within rounding of 0 (≲ 2e-5: two rewards' error, see the tolerances) may count either way in the run
    near_zero = 2e-5
    return {
        "val_loss": float(-F.logsigmoid(margins).mean()),
        "val_rewards/chosen": float(chosen.mean()),
        "val_rewards/rejected": float(rejected.mean()),
        "val_rewards/margins": float(margins.mean()),
        "wins": (int((margins > near_zero).sum()), int((margins > -near_zero).sum())),
    }


def test_dpo_validation_over_the_whole_held_out_set_equals_one_process(launched):
    run, stdout = launched
    rows = _rows(run)
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    got = rows[-1]
    want = _expected(run)
    # The rewards are β·differences of summed log-probabilities of magnitude ≲ 10² (a few to ~20 response tokens of a
    # 272-token vocabulary): the run's objective takes that difference in fp32 (ulp 7.6e-6 at 64..128), so each reward is
    # off by ≲ β·1e-5 = 5e-6 absolute, and the fp32 forwards of the same rows in differently sized batches add ~1e-6;
    # being differences, the error is absolute (the means here are ~1e-2): abs 2e-5 next to rel 1e-5. Seen: ≤ 4e-7.
    for name in ("val_loss", "val_rewards/chosen", "val_rewards/rejected", "val_rewards/margins"):
        assert float(got[name]) == pytest.approx(want[name], rel=1e-5, abs=2e-5), (name, got, want)
    # the training moved the policy: the comparison is not the trivial one at initialisation (rewards 0, loss log 2)
    assert abs(float(got["val_loss"]) - math.log(2)) > 1e-3, got
    # a fraction over the whole set: exactly wins / 10
    accuracy = float(got["val_rewards/accuracies"])
    assert accuracy * VAL_PAIRS == pytest.approx(round(accuracy * VAL_PAIRS), abs=1e-9), accuracy
    fewest, most = want["wins"]
    assert fewest <= round(accuracy * VAL_PAIRS) <= most, (accuracy, want)
    assert all(r["val_loss"] == "" for r in rows[:-1])  # validated at val_check_interval=3 only
    assert f"step 3: val_loss {float(got['val_loss']):.4f}, reward acc {accuracy:.3f} ({VAL_PAIRS} pairs)" in stdout


def test_dpo_validation_metrics_reach_tensorboard(launched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = launched
    got = _rows(run)[-1]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for name in ("val_loss", "val_rewards/chosen", "val_rewards/rejected", "val_rewards/accuracies", "val_rewards/margins"):
        (scalar,) = events.Scalars(name)
        assert scalar.step == 3 and scalar.value == pytest.approx(float(got[name]), rel=1e-6), (name, scalar, got)
