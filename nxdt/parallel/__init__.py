"""Model parallelism: tensor/sequence (``tensor_parallel``), pipeline (``pipeline``), ZeRO-1 (``zero1``),
FSDP (``fsdp``) and expert parallelism (``expert_parallel``)."""

import torch


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """Σ t² accumulated in float64, as a float64 scalar: the piece every gradient or parameter norm sums
    across shards. ``vector_norm`` with a float64 dtype reduces without materialising a float64 copy and its
    square (≈ 6× faster than ``t.double().pow(2).sum()`` on a 3 M-element model, equal to ~1e-15)."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float64).square()
