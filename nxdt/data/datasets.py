"""Datasets yielding ``{"input_ids", "labels"}`` of ``seq_length`` tokens (labels shifted by one)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset


class SyntheticTokens(Dataset):
    """Deterministic token sequences from a fixed random Markov chain: a model can learn the
    transition table, so the loss really falls. Sample ``i`` depends only on (seed, i)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, branching: int = 4) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed
        g = torch.Generator().manual_seed(seed)
        # each token may be followed by one of `branching` successors
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        choices = torch.randint(0, self.successors.shape[1], (self.seq_length,), generator=g)
        tokens = torch.empty(self.seq_length + 1, dtype=torch.long)
        tokens[0] = torch.randint(0, self.vocab_size, (1,), generator=g)
        for t in range(self.seq_length):
            tokens[t + 1] = self.successors[tokens[t], choices[t]]
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class PackedText(Dataset):
    """A UTF-8 text file tokenized once and cut into consecutive windows of seq_length + 1 tokens."""

    def __init__(self, path: str | Path, tokenizer, seq_length: int) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"data.train_dir={path}: no such file — give a UTF-8 text file")
        self.tokens = torch.tensor(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=torch.long)
        self.seq_length = seq_length
        if len(self) == 0:
            raise ValueError(f"data.train_dir={path}: {self.tokens.numel()} tokens is too short for one sample of "
                             f"data.seq_length={seq_length}+1 tokens — use a longer text or a shorter seq_length")

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_length
        window = self.tokens[start:start + self.seq_length + 1]
        return {"input_ids": window[:-1], "labels": window[1:]}
