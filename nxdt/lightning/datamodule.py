"""``NxDDataModule``: the configured dataset behind the global-batch sampler, sharded by the
strategy's data-parallel rank and resumed at ``global_step × global_batch_size`` samples."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from nxdt.data import SAMPLE_TEXT
from nxdt.data.datasets import PackedText, SyntheticTokens
from nxdt.data.sampler import GlobalBatchSampler
from nxdt.data.tokenizers import build_tokenizer


class NxDDataModule(pl.LightningDataModule):
    def __init__(self, data_cfg: Any, seed: int, vocab_size: int) -> None:
        super().__init__()
        self.cfg, self.seed, self.vocab_size = data_cfg, seed, vocab_size
        self.dataset = None

    def setup(self, stage: str | None = None) -> None:
        cfg = self.cfg
        if cfg.source == "synthetic":
            self.dataset = SyntheticTokens(cfg.num_samples, cfg.seq_length, self.vocab_size, self.seed)
        else:
            tokenizer = build_tokenizer(cfg.tokenizer)
            if tokenizer.vocab_size > self.vocab_size:
                raise ValueError(f"data.tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={self.vocab_size} — use a model with a larger vocabulary")
            self.dataset = PackedText(cfg.train_dir or SAMPLE_TEXT, tokenizer, cfg.seq_length)

    def _dp(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        kwargs = trainer.strategy.distributed_sampler_kwargs if trainer is not None else None
        return (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)

    def train_dataloader(self) -> DataLoader:
        rank, size = self._dp()
        consumed = self.trainer.global_step * self.cfg.global_batch_size if getattr(self, "trainer", None) else 0
        sampler = GlobalBatchSampler(len(self.dataset), self.cfg.global_batch_size, self.cfg.micro_batch_size,
                                     dp_rank=rank, dp_size=size, consumed_samples=consumed, seed=self.seed)
        return DataLoader(self.dataset, batch_sampler=sampler, num_workers=0)
