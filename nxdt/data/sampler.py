"""The global-batch sampler (Megatron/NxDT pretraining style), resumable by consumed samples.

The sample stream is a seeded permutation of the dataset per epoch, epochs following each other without
a seam (a global batch may straddle two epochs); unshuffled (``shuffle=False``), the samples in order, each epoch
its whole global batches only (the last partial one dropped, as NxD Training's HF data module does). Global batch ``k`` is stream positions
``[k·B, (k+1)·B)``; data-parallel rank ``r`` of ``D`` takes the contiguous slice ``[r·B/D, (r+1)·B/D)`` of
it and yields it as micro-batches of ``micro_batch_size`` indices. Concatenating the ranks' slices, rank
by rank, gives exactly what one rank with the whole batch sees, which is why DP=2 reproduces the
single-process losses. Resuming is ``consumed_samples = k·B``: the stream is a pure function of
(seed, position), so nothing else needs saving. A run resumed with another global batch size B' continues at
the position it reached, whatever it is: its batches are ``[c + j·B', c + (j+1)·B')`` (Megatron's
``MegatronPretrainingSampler`` resumes by consumed samples the same way), so no sample is skipped or repeated.

Example (B=8, D=2, micro=2, stream = s0..s7 for step 0): rank 0 yields [s0,s1], [s2,s3]; rank 1 yields
[s4,s5], [s6,s7]; with D=1 one rank yields [s0,s1], [s2,s3], [s4,s5], [s6,s7].

The iterator is infinite and the sampler has no ``__len__`` on purpose: training is bounded by
``trainer.max_steps``, and Lightning treats an unsized loader as one endless epoch — it never restarts
the iterator (which would replay the stream from a stale position) nor warns about mid-epoch resumes.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

from nxdt.data import mix_seed


class GlobalBatchSampler(Sampler[list[int]]):
    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if num_samples < 1:
            raise ValueError("the dataset is empty: the sampler has nothing to draw from")
        if micro_batch_size < 1 or dp_size < 1 or global_batch_size < 1:
            raise ValueError(
                f"batch sizes and dp_size must be >= 1 (global={global_batch_size}, micro={micro_batch_size}, dp={dp_size})"
            )
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(
                f"data.global_batch_size={global_batch_size} must be divisible by micro_batch_size × DP = "
                f"{micro_batch_size}×{dp_size} = {micro_batch_size * dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside 0..{dp_size - 1}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} must be >= 0")
        self.num_samples, self.global_batch_size, self.micro_batch_size = num_samples, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.consumed_samples = dp_rank, dp_size, consumed_samples
        self.seed, self.shuffle = seed, shuffle
        self._epoch_order: tuple[int, list[int]] | None = None  # one epoch's permutation, computed once

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches this rank yields per global batch (Lightning's accumulate_grad_batches)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def epoch_samples(self) -> int:
        """Stream positions per epoch: every sample when shuffled (the stream runs on across epochs); in order, the
        whole global batches only, so each epoch starts again at sample 0 (NxD Training's HF data module:
        DistributedSampler(shuffle=False, drop_last=True) under a DataLoader with drop_last=True)."""
        if self.shuffle or self.num_samples < self.global_batch_size:
            return self.num_samples
        return self.num_samples - self.num_samples % self.global_batch_size

    def sample_at(self, position: int) -> int:
        """The dataset index at stream position ``position`` (epoch = position // epoch_samples)."""
        epoch, offset = divmod(position, self.epoch_samples)
        if not self.shuffle:
            return offset
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            self._epoch_order = (epoch, torch.randperm(self.num_samples, generator=g).tolist())
        return self._epoch_order[1][offset]

    def __iter__(self) -> Iterator[list[int]]:
        per_rank = self.global_batch_size // self.dp_size
        batch_start = self.consumed_samples  # any position: a run resumed with another global batch size goes on from it
        while True:
            start = batch_start + self.dp_rank * per_rank
            for m in range(0, per_rank, self.micro_batch_size):
                yield [self.sample_at(start + m + i) for i in range(self.micro_batch_size)]
            batch_start += self.global_batch_size


class EvalBatchSampler(Sampler[list[int]]):
    """Validation in order, whole: global batch ``k`` is dataset indices ``[k·B, (k+1)·B)``, data-parallel rank
    ``r`` of ``D`` takes the slice ``[r·B/D, (r+1)·B/D)`` of it as one list (the module cuts micro-batches, as in
    training). The last batch is filled up with index -1 (a row with no label: the dataset wrapper
    :class:`PadRows` gives it), so every rank runs the same number of forwards and the loss summed over all
    ranks covers every sample exactly once, whatever D. ``num_batches`` limits the global batches (None: all)."""

    def __init__(
        self, num_samples: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1, num_batches: int | None = None
    ) -> None:
        if global_batch_size < 1 or global_batch_size % dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of DP={dp_size}")
        self.num_samples, self.global_batch_size, self.dp_rank, self.dp_size = num_samples, global_batch_size, dp_rank, dp_size
        total = -(-num_samples // global_batch_size)
        self.num_batches = total if num_batches is None else min(total, num_batches)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        per_rank = self.global_batch_size // self.dp_size
        for k in range(self.num_batches):
            start = k * self.global_batch_size + self.dp_rank * per_rank
            yield [i if i < self.num_samples else -1 for i in range(start, start + per_rank)]


class PadRows(torch.utils.data.Dataset):
    """A dataset of dict samples whose index -1 is a padding row: every field of sample 0's shape, zeros, labels
    -100 (no loss), so it changes no sum of the loss."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index >= 0:
            return self.dataset[index]
        pad = {name: torch.zeros_like(value) for name, value in self.dataset[0].items()}
        pad["labels"] = torch.full_like(pad["labels"], -100)
        return pad
