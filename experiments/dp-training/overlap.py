"""Step time with the data-parallel gradient reduction overlapped with backward, and without, in the same run.

    python experiments/dp-training/overlap.py [--ranks 2] [--hidden 512] [--rows 4] [--seq 128] [--rounds 6]
                                              [--steps 4] [--bucket-cap-mb 25]

``--ranks`` data-parallel ranks (``nxdt.comm.spawn.run_local``, shared memory, one intra-op thread each; 3 or more
overlap since shm adds in member order, docs/architecture.md section 6), the hub's Llama widened
(``--hidden``; 4 layers, byte vocabulary), AdamW, gradient accumulation 2 (micro-batches of ``--rows`` × ``--seq``
tokens: fewer tokens make the reduction a larger share of the step). For plain DP
and ZeRO-1 one runtime is built with ``overlap_grad_reduce=True``; rounds alternate between arming the last
backward (overlap) and never arming it (the post-backward path, what ``overlap_grad_reduce=False`` runs), so both
see the same host load. A step is timed from the first forward to the end of the optimizer step, on rank 0, after a
barrier. Printed: the median step of each mode, the ratio overlap / after-backward of each round pair (the
figure to read on a shared, loaded host), and the median time ``finish_gradients`` takes (after backward: the whole
reduction; overlapped: what is left of it when backward ends). The weights of the two modes are not compared here: tests/parallel/
test_overlap.py proves them bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from nxdt.comm.spawn import run_local


def _model(hidden: int) -> nn.Module:
    from nxdt.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = SimpleNamespace(
        vocab_size=256,
        hidden_size=hidden,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=hidden * 11 // 4,
        max_position_embeddings=256,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
    )
    return LlamaForCausalLM(cfg)


def _worker(world, args: dict) -> dict:
    from nxdt.parallel.data_parallel import ModelParallel, data_parallel_runtime

    torch.set_num_threads(1)
    out: dict = {}
    for kind in ("replicated", "zero1"):
        model = _model(args["hidden"])
        rt = data_parallel_runtime(zero1=kind == "zero1", bucket_cap_mb=args["cap"])
        rt.bind(ModelParallel(dp=world.world, dp_size=world.world_size))
        rt.broadcast_parameters(model)
        opt = rt.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False), model)
        rt.shard_model(model, [opt])
        assert rt.overlap_off is None, rt.overlap_off
        g = torch.Generator().manual_seed(world.rank)
        times: dict[str, list[float]] = {"overlap": [], "after": []}
        finish: dict[str, list[float]] = {"overlap": [], "after": []}
        for r in range(2 * args["rounds"] + 2):  # the first pair warms up
            mode = "overlap" if r % 2 == 0 else "after"
            for _ in range(args["steps"]):
                world.world.barrier()
                start = time.perf_counter()
                for micro in range(2):
                    rt.before_backward(last=mode == "overlap" and micro == 1)
                    ids = torch.randint(0, 256, (args["rows"], args["seq"] + 1), generator=g)
                    logits = model(ids[:, :-1])
                    loss = nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1)) / 2
                    loss.backward()
                before_finish = time.perf_counter()
                rt.finish_gradients(model)
                finished = time.perf_counter()
                rt.clip_grad_norm_(model, 1.0)
                opt.step()
                opt.zero_grad()
                if r >= 2:
                    times[mode].append(time.perf_counter() - start)
                    finish[mode].append(finished - before_finish)
        params = sum(p.numel() for p in model.parameters())
        buckets = [len(x.buckets) for x in rt._reductions]
        out[kind] = {"times": times, "finish": finish, "params": params, "buckets": buckets}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    a = parser.parse_args()
    args = {"hidden": a.hidden, "rows": a.rows, "seq": a.seq, "rounds": a.rounds, "steps": a.steps, "cap": a.bucket_cap_mb}
    result = run_local(_worker, a.ranks, args, timeout_s=3600)[0]
    print(
        f"{a.ranks} ranks, hidden {a.hidden}, micro-batch {a.rows}x{a.seq} tokens, accumulation 2, "
        f"bucket_cap_mb {a.bucket_cap_mb or 25}, {a.rounds} round pairs of {a.steps} steps"
    )
    print(
        f"{'runtime':<11} {'params':>7} {'buckets':>7} {'overlap ms':>10} {'after ms':>9} {'ratio (median of pairs)':>24}"
        f"  {'finish_gradients ms: overlap / after':>36}"
    )
    summary = {}
    for kind, r in result.items():
        t = r["times"]
        pairs = [
            statistics.median(t["overlap"][i : i + a.steps]) / statistics.median(t["after"][i : i + a.steps])
            for i in range(0, len(t["after"]), a.steps)
        ]
        med = {m: statistics.median(v) * 1e3 for m, v in t.items()}
        fin = {m: statistics.median(v) * 1e3 for m, v in r["finish"].items()}
        ratio = statistics.median(pairs)
        summary[kind] = {**r, "median_ms": med, "finish_ms": fin, "pair_ratios": pairs, "ratio": ratio}
        print(
            f"{kind:<11} {r['params'] / 1e6:>6.2f}M {r['buckets'][0]:>7} {med['overlap']:>10.1f} {med['after']:>9.1f} "
            f"{ratio:>24.3f}  {fin['overlap']:>17.1f} / {fin['after']:.1f}   (pairs {min(pairs):.3f}-{max(pairs):.3f})"
        )
    ranks = "" if a.ranks == 2 else f"_dp{a.ranks}"
    out = Path(__file__).resolve().parent / f"overlap_results_cap{a.bucket_cap_mb or 25:g}{ranks}.json"
    out.write_text(json.dumps({"args": {**args, "ranks": a.ranks}, **summary}, indent=1))


if __name__ == "__main__":
    main()
