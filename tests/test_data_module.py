"""nxdt.lightning.datamodule.NxDDataModule: datasets from the data config, the data-parallel slice
from the strategy, and resume at the checkpointed step's stream position (one process, in-process
Lightning runs of a few steps)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from nxdt.data.datasets import PackedText, SyntheticTokens
from nxdt.lightning.datamodule import NxDDataModule


def data_cfg(**overrides) -> SimpleNamespace:
    base = dict(
        source="synthetic", micro_batch_size=2, global_batch_size=8, seq_length=16, train_dir=None, tokenizer=None, num_samples=40
    )
    return SimpleNamespace(**{**base, **overrides})


def first_batches(dm: NxDDataModule, n: int) -> list[dict[str, torch.Tensor]]:
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n)]


def test_synthetic_loader_yields_micro_batch_dicts():
    dm = NxDDataModule(data_cfg(), seed=3, vocab_size=50)
    dm.setup("fit")
    assert isinstance(dm.dataset, SyntheticTokens) and dm.dataset.vocab_size == 50
    batch = first_batches(dm, 1)[0]
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 16) and batch["input_ids"].dtype == torch.long
    again = first_batches(NxDDataModule(data_cfg(), seed=3, vocab_size=50), 1)[0]
    assert torch.equal(batch["input_ids"], again["input_ids"])


def test_text_source_defaults_to_the_sample_text_and_checks_the_vocabulary(tmp_path):
    dm = NxDDataModule(data_cfg(source="text", seq_length=64), seed=0, vocab_size=256)
    dm.setup("fit")
    assert isinstance(dm.dataset, PackedText) and len(dm.dataset) > 5000
    (tmp_path / "t.txt").write_text("some text " * 20)
    own = NxDDataModule(data_cfg(source="text", train_dir=str(tmp_path / "t.txt")), seed=0, vocab_size=256)
    own.setup("fit")
    assert len(own.dataset) == (200 - 1) // 16
    small = NxDDataModule(data_cfg(source="text"), seed=0, vocab_size=100)
    with pytest.raises(ValueError, match="256 token ids but model.vocab_size=100"):
        small.setup("fit")
    missing = NxDDataModule(data_cfg(source="text", train_dir=str(tmp_path / "nope.txt")), seed=0, vocab_size=256)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        missing.setup("fit")


def test_data_parallel_rank_comes_from_the_strategy():
    cfg = data_cfg()
    single = NxDDataModule(cfg, seed=1, vocab_size=50)
    single.setup("fit")
    assert (single.dp_rank, single.dp_size) == (0, 1)
    reference = first_batches(single, 4)  # the first global batch: 4 micro-batches of 2
    got = []
    for rank in range(2):
        dm = NxDDataModule(cfg, seed=1, vocab_size=50)
        dm.trainer = SimpleNamespace(
            strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}),
            global_step=0,
            accumulate_grad_batches=2,
        )
        dm.setup("fit")
        assert (dm.dp_rank, dm.dp_size) == (rank, 2)
        got += first_batches(dm, 2)
    for a, b in zip(got, reference):
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_state_dict_round_trip_moves_the_stream():
    cfg = data_cfg()
    fresh = NxDDataModule(cfg, seed=1, vocab_size=50)
    assert fresh.state_dict()["consumed_samples"] == 0
    stream = first_batches(fresh, 12)  # 3 global batches
    resumed = NxDDataModule(cfg, seed=1, vocab_size=50)
    resumed.load_state_dict({"consumed_samples": 16})  # two global batches done
    assert resumed.state_dict()["consumed_samples"] == 16
    for a, b in zip(first_batches(resumed, 4), stream[8:]):
        assert torch.equal(a["input_ids"], b["input_ids"])
    # a trainer's global_step moves the position on from the loaded anchor
    resumed.trainer = SimpleNamespace(strategy=None, global_step=5, accumulate_grad_batches=4)
    resumed.load_state_dict({"consumed_samples": 16, "global_step": 2})
    assert resumed.state_dict() == {"consumed_samples": 16 + 3 * 8, "global_step": 5}


class Recorder(pl.LightningModule):
    """A one-parameter model that records the input of every micro-batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"][:, 0].tolist())
        return (self.w - batch["input_ids"].float().mean()) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(dm: NxDDataModule, max_steps: int, accumulate: int, root, ckpt_path=None) -> tuple[Recorder, pl.Trainer]:
    model = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=str(root),
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model, trainer


def test_lightning_resume_continues_the_data_stream_exactly(tmp_path):
    cfg = data_cfg(global_batch_size=4, micro_batch_size=2)  # 2 micro-batches per optimizer step
    full, _ = fit(NxDDataModule(cfg, seed=9, vocab_size=50), max_steps=5, accumulate=2, root=tmp_path)
    assert len(full.seen) == 10
    first, trainer = fit(NxDDataModule(cfg, seed=9, vocab_size=50), max_steps=2, accumulate=2, root=tmp_path)
    assert first.seen == full.seen[:4]
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    assert torch.load(tmp_path / "step2.ckpt", weights_only=True)["NxDDataModule"] == {"consumed_samples": 8, "global_step": 2}
    resumed, _ = fit(
        NxDDataModule(cfg, seed=9, vocab_size=50),
        max_steps=5,
        accumulate=2,
        root=tmp_path,
        ckpt_path=str(tmp_path / "step2.ckpt"),
    )
    assert resumed.seen == full.seen[4:]


def test_accumulation_must_match_the_global_batch(tmp_path):
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=1\) must equal .* = 4"):
        fit(NxDDataModule(data_cfg(), seed=0, vocab_size=50), max_steps=1, accumulate=1, root=tmp_path)
