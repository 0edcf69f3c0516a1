"""DPO / ORPO pieces in one process: the pair dataset and its micro-batch layout, and DPO through the Lightning API
(``CausalLMModule(objective=...)`` + the DPO spec's data module, ``nxdt.lightning.registry`` + ``NxDStrategy``) — the reference table it
precomputes equals each pair's log-probabilities computed here from a copy of the initial model, pair by pair.
Multi-rank layouts: tests/test_dpo_e2e.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from nxdt.data import SAMPLE_PREFERENCES
from nxdt.data.instructions import byte_chat_tokenizer, read_jsonl
from nxdt.data.preferences import PreferenceDataset, build_preference_batch, pair_rows, split_chosen_rejected

RECORDS = read_jsonl(SAMPLE_PREFERENCES)[:12]


def test_a_sample_is_a_pair_and_pair_rows_lays_out_chosen_then_rejected():
    tok = byte_chat_tokenizer()
    batch, _ = build_preference_batch(RECORDS[:4], tok, 48)
    dataset = PreferenceDataset.from_records(RECORDS[:4], tok, 48)
    assert len(dataset) == 4 and set(dataset[0]) == {"input_ids", "labels", "position_ids", "segment_ids"}
    assert dataset[2]["input_ids"].shape == (2, 48)
    mb = pair_rows(torch.utils.data.default_collate([dataset[1], dataset[3]]))
    for name in ("input_ids", "labels", "position_ids", "segment_ids"):  # rows: chosen 1, chosen 3, rejected 1, rejected 3
        assert torch.equal(mb[name], batch[name][[1, 3, 5, 7]])
    dataset.set_reference_log_probs(torch.tensor([[float(i), -float(i)] for i in range(4)]))
    assert dataset[3]["ref_logps"].tolist() == [3.0, -3.0]  # keyed by the sample's index
    with pytest.raises(ValueError, match="expected \\(4, 2\\)"):
        dataset.set_reference_log_probs(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="not \\[pairs, 2, seq_length\\]"):
        pair_rows(dataset[0])


def test_dpo_through_the_lightning_api_precomputes_every_pairs_reference(tmp_path):
    import lightning.pytorch as pl

    from nxdt.config import compose_config
    from nxdt.lightning import NxDStrategy
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.registry import objective_spec

    cfg = compose_config(
        [
            "+recipe=dpo",
            "model.num_layers=1",
            "data.global_batch_size=4",
            "data.micro_batch_size=2",
            "data.dev_choose_samples=12",
            "trainer.max_steps=1",
        ]
    )
    pl.seed_everything(cfg.seed, verbose=False)
    spec = objective_spec(cfg)  # the objective registry: DPO's loss and its preference-pair data module
    module = CausalLMModule(
        cfg.model,
        cfg.data.global_batch_size,
        cfg.data.seq_length,
        cfg.data.micro_batch_size,
        objective=spec.objective(spec.block(cfg)),
    )
    initial = copy.deepcopy(module.model).eval()
    data = spec.build_datamodule(cfg)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=NxDStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=data)
    trainer.strategy.close()
    dataset = data.dataset
    assert len(dataset) == 12 and dataset.ref_logps is not None
    with torch.no_grad():  # every pair alone, through the initial model: log π_ref(chosen), log π_ref(rejected)
        for i in range(len(dataset)):
            mb = pair_rows(torch.utils.data.default_collate([dataset[i]]))
            logp = torch.log_softmax(initial(mb["input_ids"], mb["position_ids"], mb["segment_ids"]).double(), -1)
            mask = mb["labels"] != -100
            sums = (logp.gather(-1, mb["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask).sum(-1)
            chosen, rejected = split_chosen_rejected(sums)
            # the same fp32 forward (in a batch of 2 pairs there, 1 here): rounding only, ~1e-7 of |log π| ≈ 100
            assert dataset.ref_logps[i].tolist() == pytest.approx([float(chosen[0]), float(rejected[0])], rel=1e-5)
    metrics = module.step_metrics
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 1
    assert {k: metrics[k] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")} == pytest.approx(
        {"rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/margins": 0.0}, abs=1e-5
    )


def test_objective_refuses_a_batch_without_reference():
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.objective import dpo_objective
    from nxdt.config import compose_config

    cfg = compose_config(["+recipe=dpo", "model.num_layers=1"])
    module = CausalLMModule(cfg.model, 8, 64, 2, objective=dpo_objective(cfg.model_alignment_strategy.dpo))
    dataset = PreferenceDataset.from_records(RECORDS[:2], byte_chat_tokenizer(), 64)
    with pytest.raises(RuntimeError, match="reference model's log-probabilities"):
        module._lay_out([torch.utils.data.default_collate([dataset[0], dataset[1]])])


def test_the_plan_prices_a_pair_as_two_sequences():
    from nxdt.config import compose_config
    from nxdt.planner import plan

    pairs = plan(compose_config(["+recipe=dpo", "trainer.devices=2", "data.micro_batch_size=2", "data.global_batch_size=8"]))
    sequences = plan(
        compose_config(
            ["data=synthetic", "trainer.devices=2", "data.seq_length=64", "data.micro_batch_size=4", "data.global_batch_size=16"]
        )
    )
    assert pairs.batch == {"global": 8, "micro": 2, "seq_length": 64, "micro_batches": 2}  # the config's numbers: pairs
    for key in ("step_time_s", "tokens_per_s"):
        assert pairs.estimate[key] == pytest.approx(sequences.estimate[key], rel=1e-9), key
