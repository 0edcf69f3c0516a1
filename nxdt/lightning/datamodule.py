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

import math
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, Subset

from nxdt.data import SAMPLE_INSTRUCTIONS, SAMPLE_PREFERENCES, SAMPLE_TEXT
from nxdt.data.datasets import PackedText, SyntheticTokens
from nxdt.data.hf_dataset import SavedHFDataset
from nxdt.data.instructions import SFTDataset, build_chat_tokenizer, read_instruction_records
from nxdt.data.megatron import BlendedMegatronData
from nxdt.data.preferences import PreferenceDataset
from nxdt.data.sampler import EvalBatchSampler, GlobalBatchSampler, PadRows
from nxdt.data.tokenizers import build_tokenizer


def chat_tokenizer_dir(path: str | None) -> str | None:
    """``data.tokenizer`` for instruction data: a Hugging Face tokenizer directory, or its tokenizer.json."""
    if path is None:
        return None
    p = Path(path).expanduser()
    return str(p.parent if p.is_file() else p)


def build_sft_dataset(data_cfg: Any, sft_cfg: Any, path: str | None, vocab_size: int, *, limit: int | None = None) -> SFTDataset:
    """Instruction records at ``path`` (None: the shipped set) as packed or padded SFT sequences (raises ValueError
    with the problem: a bad record, a tokenizer too large for the model, nothing left to train on)."""
    tok = build_chat_tokenizer(chat_tokenizer_dir(data_cfg.tokenizer))
    if tok.vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"data.tokenizer={data_cfg.tokenizer} has {tok.vocab_size} token ids but model.vocab_size={vocab_size}")
    records = read_instruction_records(path or SAMPLE_INSTRUCTIONS, limit)
    return SFTDataset.from_records(
        records,
        tok,
        data_cfg.seq_length,
        packing=sft_cfg.packing,
        truncation=sft_cfg.truncation,
        packing_style=sft_cfg.packing_style,
    )


def build_preference_dataset(
    data_cfg: Any, pref_cfg: Any, path: str | None, vocab_size: int, *, limit: int | None = None
) -> PreferenceDataset:
    """Preference records at ``path`` (None: the shipped set) as pairs of padded sequences, truncated as
    ``pref_cfg`` (model_alignment_strategy.dpo / .orpo: max_prompt_length, truncation_mode) says; ValueError with the
    problem (a bad record, a tokenizer too large for the model, no pair left)."""
    tok = build_chat_tokenizer(chat_tokenizer_dir(data_cfg.tokenizer))
    if tok.vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"data.tokenizer={data_cfg.tokenizer} has {tok.vocab_size} token ids but model.vocab_size={vocab_size}")
    records = read_instruction_records(path or SAMPLE_PREFERENCES, limit)
    return PreferenceDataset.from_records(
        records, tok, data_cfg.seq_length, max_prompt_length=pref_cfg.max_prompt_length, truncation_mode=pref_cfg.truncation_mode
    )


def hold_out(dataset: Dataset, fraction: float) -> tuple[Dataset, Dataset | None]:
    """``data.val_split``: (the first samples, the last ``ceil(fraction·n)``, at least one left to train on) — whole
    samples, so an instruction record (a packed sequence holds whole records) is never in both."""
    if not fraction:
        return dataset, None
    n = len(dataset)
    held = min(n - 1, max(1, math.ceil(fraction * n)))
    if held < 1:
        raise ValueError(f"data.val_split={fraction}: {n} sample(s) leave nothing to train on")
    return Subset(dataset, range(n - held)), Subset(dataset, range(n - held, n))


class NxDDataModule(pl.LightningDataModule):
    """``data_cfg`` has ``source`` ("synthetic" | "text" | "hf_dataset" | "megatron": ``data_prefix``, ``splits_string``,
    ``index_mapping_dir``), ``micro_batch_size``, ``global_batch_size``
    (None → micro_batch_size × DP), ``seq_length``, ``train_dir`` (None → the shipped sample text), ``tokenizer``
    (None → byte-level) and ``num_samples`` (synthetic). ``vocab_size`` is the model's: synthetic tokens are drawn below it and
    a tokenizer must fit in it."""

    def __init__(
        self,
        data_cfg: Any,
        seed: int,
        vocab_size: int,
        *,
        step_batches: bool = False,
        limit_val_batches: float = 1.0,
        dataset: Callable[[str | None, bool], Dataset] | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.seed, self.vocab_size = data_cfg, seed, vocab_size
        # an objective's own records (SFT's instructions, DPO/ORPO's preference pairs): ``dataset(path, validation)``,
        # given by its spec (nxdt.lightning.registry); None: the token sources below (pretraining)
        self.objective_dataset = dataset
        self.limit_val_batches = limit_val_batches  # trainer.limit_val_batches: <= 1 a fraction, > 1 a count
        self.val_dataset: Dataset | None = None
        # step_batches: one Lightning batch = this rank's whole share of a global batch (the module splits
        # it into micro-batches itself, e.g. for a pipeline schedule); otherwise one batch = one micro-batch
        self.step_batches = step_batches
        self.dataset: Dataset | None = None
        self.dp_rank, self.dp_size = 0, 1
        # The stream position is anchored at a (global_step, consumed_samples) pair: (0, 0) for a fresh run,
        # the checkpoint's pair after a resume; from there each step consumes one global batch.
        self._anchor_step, self._anchor_consumed = 0, 0

    # --- dataset -------------------------------------------------------------------------------------
    def build_dataset(self, path: str | None = None, *, validation: bool = False) -> Dataset:
        """The dataset at ``path`` (default: data.train_dir) in the configured source's format."""
        cfg = self.cfg
        path = cfg.train_dir if path is None and not validation else path
        if self.objective_dataset is not None:
            return self.objective_dataset(path, validation)
        if cfg.source == "synthetic":
            return SyntheticTokens(cfg.num_samples, cfg.seq_length, self.vocab_size, self.seed)
        if cfg.source == "text":
            tokenizer = build_tokenizer(cfg.tokenizer)
            if tokenizer.vocab_size > self.vocab_size:
                raise ValueError(
                    f"data.tokenizer={cfg.tokenizer} has {tokenizer.vocab_size} token ids but "
                    f"model.vocab_size={self.vocab_size} — use a model whose vocab_size is at least "
                    f"{tokenizer.vocab_size}, or another tokenizer"
                )
            return PackedText(path or SAMPLE_TEXT, tokenizer, cfg.seq_length)
        if cfg.source == "hf_dataset":
            if path is None:  # validation asks only for a given val_dir; training's train_dir is checked before launch
                raise ValueError("data.source=hf_dataset needs data.train_dir (a save_to_disk directory)")
            return SavedHFDataset(path, cfg.seq_length, self.vocab_size)
        if cfg.source == "megatron":
            if validation:
                raise ValueError("data.source=megatron has no data.val_dir; hold out samples with data.val_split")
            return BlendedMegatronData(
                cfg.data_prefix,
                self._megatron_samples(),
                cfg.seq_length,
                self.seed,
                vocab_size=self.vocab_size,
                splits_string=cfg.splits_string,
                index_mapping_dir=cfg.index_mapping_dir,
            )
        raise ValueError(
            f"data.source={cfg.source!r}: use synthetic, text, hf_dataset or megatron (an objective's records: the data "
            "module its spec builds, nxdt.lightning.registry.objective_spec(cfg).datamodule(cfg))"
        )

    def _megatron_samples(self) -> int:
        """Megatron's training sample count: trainer.max_steps global batches (the sample index is built for it)."""
        steps = getattr(self.trainer, "max_steps", -1) if self.trainer is not None else -1
        if steps is None or steps < 1:
            raise ValueError(
                "data.source=megatron builds its sample index for trainer.max_steps global batches; set trainer.max_steps"
            )
        return steps * self.global_batch_size

    def setup(self, stage: str | None = None) -> None:
        self.dp_rank, self.dp_size = self._data_parallel()
        if self.dataset is None:  # setup() may run again (another fit); the data does not change
            self.dataset = self.build_dataset()
            self.dataset, held_out = hold_out(self.dataset, getattr(self.cfg, "val_split", 0.0))
            if held_out is not None:
                self.val_dataset = held_out
                rank_zero_info(
                    f"data: the last {len(held_out)} of {len(self.dataset) + len(held_out)} samples held out "
                    f"for validation (data.val_split={self.cfg.val_split})"
                )
            rank_zero_info(
                f"data: {type(self.dataset).__name__}, {len(self.dataset)} samples of "
                f"{self.cfg.seq_length} tokens, data-parallel {self.dp_size}"
            )
        val_dir = getattr(self.cfg, "val_dir", None)  # optional in a Lightning API user's data config
        if self.val_dataset is None and val_dir is not None:
            self.val_dataset = self.build_dataset(val_dir, validation=True)

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

    @property
    def shuffles(self) -> bool:
        """data.shuffle (absent in a Lightning API user's data config: true); Megatron's sample index is shuffled
        already, so its stream is read in index order."""
        return self.cfg.source != "megatron" and bool(getattr(self.cfg, "shuffle", True))

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch: the whole global batches of the training samples (the last partial one
        dropped, as NxD Training's data loaders do: drop_last=True)."""
        if self.dataset is None:
            self.setup("fit")
        assert self.dataset is not None  # setup built it
        return len(self.dataset) // self.global_batch_size

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
        return {"consumed_samples": self.consumed_samples, "global_step": self._anchor_step if step is None else step}

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
            raise ValueError(
                f"data.global_batch_size={batch} must be divisible by micro_batch_size × DP = "
                f"{self.cfg.micro_batch_size}×{self.dp_size}"
            )
        per_batch = batch // self.dp_size if self.step_batches else self.cfg.micro_batch_size
        sampler = GlobalBatchSampler(
            len(self.dataset),
            batch,
            per_batch,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            consumed_samples=self.consumed_samples,
            seed=self.seed,
            shuffle=self.shuffles,
        )
        trainer = self.trainer
        if trainer is not None and trainer.accumulate_grad_batches != sampler.micro_batches_per_step:
            # otherwise optimizer steps and global batches drift apart: DP ≠ single process, resume skips data
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) must equal "
                f"global_batch_size / (micro_batch_size × DP) = {batch} / "
                f"({self.cfg.micro_batch_size} × {self.dp_size}) = {sampler.micro_batches_per_step}"
            )
        # workers=0: samples are cheap and in memory; worker processes would only add start-up time
        return DataLoader(self.dataset, batch_sampler=sampler, num_workers=0, pin_memory=self._pinned())

    # --- validation ----------------------------------------------------------------------------------
    def validation_batches(self) -> int:
        """Global validation batches per check: all of data.val_dir's, limited by trainer.limit_val_batches
        (a fraction <= 1, at least one batch when > 0; a count > 1); 0 without data.val_dir."""
        if self.val_dataset is None:
            return 0
        total = -(-len(self.val_dataset) // self.global_batch_size)
        limit = self.limit_val_batches
        if limit > 1:
            return min(total, int(limit))
        return 0 if limit <= 0 else max(1, int(total * limit))

    def val_dataloader(self) -> DataLoader:
        """One batch = this rank's share of one global validation batch, in order, the last one padded with rows
        without labels (:class:`~nxdt.data.sampler.EvalBatchSampler`): the token-weighted loss over the whole
        set is the same for any data-parallel degree."""
        if self.dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return DataLoader([])
        sampler = EvalBatchSampler(
            len(self.val_dataset), self.global_batch_size, self.dp_rank, self.dp_size, num_batches=self.validation_batches()
        )
        return DataLoader(PadRows(self.val_dataset), batch_sampler=sampler, num_workers=0, pin_memory=self._pinned())

    def _pinned(self) -> bool:
        """Batches in page-locked memory when the rank computes on a GPU: Lightning copies them with
        ``non_blocking=True``, which only from pinned memory leaves the host free to queue the step's kernels (from
        pageable memory the copy first waits for the GPU to finish the previous step)."""
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return device is not None and device.type == "cuda"


class EpochLimit(pl.Callback):
    """``trainer.max_epochs`` with nxdt's endless sample stream (its loader has no length, so Lightning never ends an
    epoch): stops the fit after ``max_epochs`` × the data module's ``steps_per_epoch`` optimizer steps, or at
    ``max_steps`` if that comes first — Lightning's rule, which NxD Training's trainer keeps (nlp_overrides.py passes
    max_epochs to its fit loop). ``should_stop`` ends the step as Lightning's early stopping does (a validation
    runs first, when there is validation data)."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        epochs = trainer.max_epochs
        data = trainer.datamodule
        if epochs is None or epochs < 0 or not isinstance(data, NxDDataModule):
            return
        per_epoch = data.steps_per_epoch
        if per_epoch < 1:
            raise ValueError(
                f"trainer.max_epochs={epochs}: the {len(data.dataset or ())} training samples hold no whole global batch "
                f"of data.global_batch_size={data.global_batch_size}; lower the batch or set trainer.max_epochs=-1"
            )
        if trainer.global_step >= epochs * per_epoch:
            trainer.should_stop = True
