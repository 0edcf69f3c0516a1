"""Peak live heap bytes of one llama_tiny forward + loss + backward (fp32, batch 1), per core attention and sequence.

What the planner models, without the allocator: glibc's bytes in use (``mallinfo2``: heap chunks in use + mmapped
chunks) sampled after every module's forward and before and after every autograd node's backward; the peak over
the step minus the bytes in use before it (the model's parameters and pre-allocated gradients excluded). A peak
inside one op (a kernel's workspace) between two samples is not seen. glibc >= 2.33 (mallinfo2).

    python experiments/attention-memory/live_peak.py     # writes live.json beside this file
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import torch

from nxdt.config import compose_config
from nxdt.models.llama import LlamaForCausalLM

HERE = Path(__file__).resolve().parent
MiB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def peak_bytes(seq: int, impl: str) -> dict:
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
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(0, cfg.model.vocab_size, (1, seq))
    base, peak = in_use(), {"bytes": 0, "at": ""}

    def note(where: str) -> None:
        now = in_use() - base
        if now > peak["bytes"]:
            peak.update(bytes=now, at=where)

    for m in model.modules():
        m.register_forward_hook(lambda mod, args, out: note(f"forward {type(mod).__name__}"))
    loss = model.loss_fn(model(ids), ids)
    note("loss")
    seen, stack = set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        fn.register_prehook(lambda grads, fn=fn: note(f"before {fn.name()}"))
        fn.register_hook(lambda gi, go, fn=fn: note(f"after {fn.name()}"))
        stack += [nxt for nxt, _ in fn.next_functions]
    loss.backward()
    return {"peak_mib": peak["bytes"] / MiB, "at": peak["at"]}


def main() -> None:
    torch.set_num_threads(1)
    impls = sys.argv[1:] or ["naive", "sdpa", "blockwise"]
    out = {impl: {str(seq): peak_bytes(seq, impl) for seq in (128, 2048)} for impl in impls}
    for impl, by_seq in out.items():
        delta = by_seq["2048"]["peak_mib"] - by_seq["128"]["peak_mib"]
        print(
            f"{impl}: peak live {by_seq['128']['peak_mib']:.1f} → {by_seq['2048']['peak_mib']:.1f} MiB (Δ {delta:.1f}), "
            f"at 2048: {by_seq['2048']['at']}"
        )
    (HERE / "live.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
