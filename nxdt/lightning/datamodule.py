"""``NxDDataModule``: the configured dataset behind the global-batch sampler, sharded by the strategy's
data-parallel rank and resumed where the checkpointed step left the sample stream.

One Lightning batch is one micro-batch (a dict of ``input_ids``/``labels`` [micro_batch_size, S]);
Lightning accumulates ``global_batch / (micro_batch · DP)`` of them per optimizer step, so optimizer
step ``k`` consumes exactly stream positions ``[k·B, (k+1)·B)`` (see :mod:`nxdt.data.sampler`).

Resume: Lightning restores the datamodule state and ``trainer.global_step`` before it builds the train
dataloader, so :meth:`train_dataloader` starts the stream at the samples consumed by the restored step.
The state holds ``consumed_samples`` and the step it belongs to, so the position stays right even if a
later run changes ``data.global_batch_size``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from nxdt.data import SAMPLE_TEXT
from nxdt.data.datasets import PackedText, SyntheticTokens
from nxdt.data.hf_dataset import SavedHFDataset
from nxdt.data.megatron import BlendedMegatronData
from nxdt.data.sampler import GlobalBatchSampler
from nxdt.data.tokenizers import build_tokenizer


class NxDDataModule(pl.LightningDataModule):
    """``data_cfg`` has ``source`` ("synthetic" | "text" | "hf_dataset" | "megatron": ``data_prefix``, ``splits_string``,
    ``index_mapping_dir``), ``micro_batch_size``, ``global_batch_size``
    (None → micro_batch_size × DP), ``seq_length``, ``train_dir`` (None → the shipped sample text), ``tokenizer``
    (None → byte-level) and ``num_samples`` (synthetic). ``vocab_size`` is the model's: synthetic tokens are drawn below it and
    a tokenizer must fit in it."""

    def __init__(self, data_cfg: Any, seed: int, vocab_size: int, *, step_batches: bool = False) -> None:
        super().__init__()
        self.cfg, self.seed, self.vocab_size = data_cfg, seed, vocab_size
        # step_batches: one Lightning batch = this rank's whole share of a global batch (the module splits
        # it into micro-batches itself, e.g. for a pipeline schedule); otherwise one batch = one micro-batch
        self.step_batches = step_batches
        self.dataset: Dataset | None = None
        self.dp_rank, self.dp_size = 0, 1
        # The stream position is anchored at a (global_step, consumed_samples) pair: (0, 0) for a fresh run,
        # the checkpoint's pair after a resume; from there each step consumes one global batch.
        self._anchor_step, self._anchor_consumed = 0, 0

    # --- dataset -------------------------------------------------------------------------------------
    def build_dataset(self) -> Dataset:
        cfg = self.cfg
        if cfg.source == "synthetic":
            return SyntheticTokens(cfg.num_samples, cfg.seq_length, self.vocab_size, self.seed)
        if cfg.source == "text":
            tokenizer = build_tokenizer(cfg.tokenizer)
            if tokenizer.vocab_size > self.vocab_size:
                raise ValueError(f"data.tokenizer={cfg.tokenizer} has {tokenizer.vocab_size} token ids but "
                                 f"model.vocab_size={self.vocab_size} — use a model whose vocab_size is at least "
                                 f"{tokenizer.vocab_size}, or another tokenizer")
            return PackedText(cfg.train_dir or SAMPLE_TEXT, tokenizer, cfg.seq_length)
        if cfg.source == "hf_dataset":
            return SavedHFDataset(cfg.train_dir, cfg.seq_length, self.vocab_size)
        if cfg.source == "megatron":
            return BlendedMegatronData(cfg.data_prefix, self._megatron_samples(), cfg.seq_length, self.seed,
                                       vocab_size=self.vocab_size, splits_string=cfg.splits_string,
                                       index_mapping_dir=cfg.index_mapping_dir)
        raise ValueError(f"data.source={cfg.source!r}: use synthetic, text, hf_dataset or megatron")

    def _megatron_samples(self) -> int:
        """Megatron's training sample count: trainer.max_steps global batches (the sample index is built for it)."""
        steps = getattr(self.trainer, "max_steps", -1) if self.trainer is not None else -1
        if steps is None or steps < 1:
            raise ValueError("data.source=megatron builds its sample index for trainer.max_steps global batches; set trainer.max_steps")
        return steps * self.global_batch_size

    def setup(self, stage: str | None = None) -> None:
        self.dp_rank, self.dp_size = self._data_parallel()
        if self.dataset is None:  # setup() may run again (another fit); the data does not change
            self.dataset = self.build_dataset()
            rank_zero_info(f"data: {type(self.dataset).__name__}, {len(self.dataset)} samples of "
                           f"{self.cfg.seq_length} tokens, data-parallel {self.dp_size}")

    def _data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this process's data-parallel group, from the strategy (1 process: (0, 1))."""
        trainer = self.trainer
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not kwargs:
            return 0, 1
        return int(kwargs["rank"]), int(kwargs["num_replicas"])

    @property
    def global_batch_size(self) -> int:
        """``data.global_batch_size``; null: micro_batch_size × DP (one micro-batch per rank per step)."""
        batch = self.cfg.global_batch_size
        return self.cfg.micro_batch_size * self.dp_size if batch is None else batch

    # --- resume position -----------------------------------------------------------------------------
    def _global_step(self) -> int | None:
        return self.trainer.global_step if self.trainer is not None else None

    @property
    def consumed_samples(self) -> int:
        """Samples of the stream used by the optimizer steps done so far (all data-parallel ranks)."""
        step = self._global_step()
        if step is None:
            return self._anchor_consumed
        return self._anchor_consumed + (step - self._anchor_step) * self.global_batch_size

    def state_dict(self) -> dict[str, int]:
        step = self._global_step()
        return {"consumed_samples": self.consumed_samples,
                "global_step": self._anchor_step if step is None else step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        consumed = int(state_dict["consumed_samples"])
        # a state without the step (hand-made) means: consumed at the current batch size
        step = int(state_dict.get("global_step", consumed // self.global_batch_size))
        self._anchor_step, self._anchor_consumed = step, consumed

    # --- loader --------------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        if self.dataset is None:  # used without a Trainer
            self.setup("fit")
        assert self.dataset is not None  # setup built it
        batch = self.global_batch_size
        if batch % (self.cfg.micro_batch_size * self.dp_size):
            raise ValueError(f"data.global_batch_size={batch} must be divisible by micro_batch_size × DP = "
                             f"{self.cfg.micro_batch_size}×{self.dp_size}")
        per_batch = batch // self.dp_size if self.step_batches else self.cfg.micro_batch_size
        sampler = GlobalBatchSampler(len(self.dataset), batch, per_batch,
                                     dp_rank=self.dp_rank, dp_size=self.dp_size,
                                     consumed_samples=self.consumed_samples, seed=self.seed,
                                     shuffle=self.cfg.source != "megatron")  # Megatron's sample index is shuffled already
        trainer = self.trainer
        if trainer is not None and trainer.accumulate_grad_batches != sampler.micro_batches_per_step:
            # otherwise optimizer steps and global batches drift apart: DP ≠ single process, resume skips data
            raise ValueError(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) must equal "
                             f"global_batch_size / (micro_batch_size × DP) = {batch} / "
                             f"({self.cfg.micro_batch_size} × {self.dp_size}) = {sampler.micro_batches_per_step}")
        # workers=0: samples are cheap and in memory; worker processes would only add start-up time
        return DataLoader(self.dataset, batch_sampler=sampler, num_workers=0)
