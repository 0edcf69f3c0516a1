"""The global-batch sampler (Megatron/NxDT pretraining style), resumable by consumed samples.

The sample stream is a seeded permutation per epoch, epochs following each other without a seam.
Global batch ``k`` is stream positions ``[k·B, (k+1)·B)``; data-parallel rank ``r`` of ``D`` takes the
contiguous slice ``[r·B/D, (r+1)·B/D)`` of it and yields it as micro-batches. Concatenating the ranks'
slices gives exactly what one rank with the whole batch sees, which is why DP=2 reproduces the
single-process losses.

Example (B=8, D=2, micro=2, stream = 0..7 for step 0): rank 0 yields [0,1], [2,3]; rank 1 yields [4,5], [6,7].
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


class GlobalBatchSampler(Sampler[list[int]]):
    def __init__(self, num_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0, seed: int = 0, shuffle: bool = True) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global_batch_size={global_batch_size} must be divisible by micro_batch_size×dp={micro_batch_size}×{dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside 0..{dp_size - 1}")
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.num_samples, self.global_batch_size, self.micro_batch_size = num_samples, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.consumed_samples = dp_rank, dp_size, consumed_samples
        self.seed, self.shuffle = seed, shuffle
        self._epoch_order: tuple[int, torch.Tensor] | None = None

    def _sample_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if not self.shuffle:
            return offset
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch_order = (epoch, torch.randperm(self.num_samples, generator=g))
        return int(self._epoch_order[1][offset])

    # No __len__: the stream is unbounded and trainer.max_steps ends training, so Lightning never
    # restarts an "epoch" with a stale start position.
    def __iter__(self) -> Iterator[list[int]]:
        per_rank = self.global_batch_size // self.dp_size
        step = self.consumed_samples // self.global_batch_size
        while True:
            start = step * self.global_batch_size + self.dp_rank * per_rank
            for m in range(0, per_rank, self.micro_batch_size):
                yield [self._sample_at(start + m + i) for i in range(self.micro_batch_size)]
            step += 1
