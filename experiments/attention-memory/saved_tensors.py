"""Bytes autograd keeps for backward in one llama_tiny forward (fp32, batch 1), per core attention and sequence.

The part of peak RSS the planner's activation model describes: every tensor saved for backward, counted once per
storage (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded; the loss's own saved tensors are not
included (the model returns logits). The rest of a step's peak (backward's transient gradients, allocator
retention, the runtime) is not in it.

    python experiments/attention-memory/saved_tensors.py     # writes saved.json beside this file
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nxdt.config import compose_config
from nxdt.models.llama import LlamaForCausalLM

HERE = Path(__file__).resolve().parent


def saved_bytes(seq: int, impl: str) -> int:
    cfg = compose_config(
        [
            "model=llama_tiny",
            f"model.max_position_embeddings={seq}",
            f"model.core_attention={impl}",
            f"data.seq_length={seq}",
            "precision.type=fp32",
        ],
        check=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg.model)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, cfg.model.vocab_size, (1, seq)))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def main() -> None:
    torch.set_num_threads(1)
    out = {impl: {str(seq): saved_bytes(seq, impl) for seq in (128, 2048)} for impl in ("naive", "sdpa", "blockwise")}
    for impl, by_seq in out.items():
        print(impl, {k: f"{v / 1e6:.1f} MB" for k, v in by_seq.items()})
    (HERE / "saved.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
