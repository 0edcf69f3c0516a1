"""Checks that need a CUDA device, run in a fresh interpreter by tests/gpu/test_gpu.py (so the pytest process never
holds a CUDA context: the launches beside it fork their workers). Prints one JSON object; exits non-zero on failure.

1. nxdt.comm on CUDA tensors, in forked ranks (before this process touches CUDA): one rank on its GPU takes NCCL;
   two ranks on one GPU take CUDA IPC (NCCL refuses two ranks per GPU), reduce exactly as the CPU does, and time
   their all-reduce against the staged path (through host memory).
2. Placement and kernels of one rank: parameters, optimizer state and data on cuda:0, torch's fused AdamW, and
   attention through flash / memory-efficient / cuDNN kernels only under ``attention_kernels``."""

from __future__ import annotations

import json
import sys

import torch


def _nccl_rank(world):
    torch.cuda.set_device(0)
    comm = world.new_communicator([0], "solo")
    x = torch.arange(4, dtype=torch.float32, device="cuda")
    out = torch.empty(4, dtype=torch.float32, device="cuda")
    comm.all_gather(out, x)
    return {"transport": comm.transport_on("cuda"), "gathered": out.tolist()}


def _shared_gpu_rank(world):
    """Both paths of two ranks on one GPU: messages from IPC_MIN_BYTES up in device memory (CUDA IPC), smaller ones
    through host memory; each equal to what the CPU computes, bit for bit."""
    import time

    from nxdt.comm.cuda_ipc import IPC_MIN_BYTES

    torch.cuda.set_device(0)
    r = world.rank
    comm = world.new_communicator([0, 1], "pair")
    n = IPC_MIN_BYTES // 4  # fp32 elements of the smallest IPC message
    out = {"transport": None}
    for size, path in ((5, "staged"), (n, "cuda_ipc")):
        x = torch.full((2 * size,), float(r + 1), device="cuda", dtype=torch.bfloat16)
        comm.all_reduce(x)
        base = torch.arange(size, dtype=torch.float32) * 0.1 + 0.05
        y = base.cuda() * (r + 1)
        comm.all_reduce(y, op="avg")
        gathered = torch.empty(2 * size, device="cuda")
        comm.all_gather(gathered, torch.arange(size, dtype=torch.float32, device="cuda") + 10 * r)
        scattered = torch.empty(size, device="cuda")
        comm.reduce_scatter(scattered, torch.arange(2 * size, dtype=torch.float32, device="cuda") * (r + 1))
        root = torch.full((size,), float(r), device="cuda")
        comm.broadcast(root, 1)
        ar = torch.arange(size, dtype=torch.float32)
        out[path] = {
            "bf16_sum": bool(torch.equal(x.cpu(), torch.full((2 * size,), 3.0, dtype=torch.bfloat16))),
            "avg_equals_cpu": bool(torch.equal(y.cpu(), (base * 1 + base * 2) / 2)),
            "all_gather": bool(torch.equal(gathered.cpu(), torch.cat([ar, ar + 10]))),
            "reduce_scatter": bool(
                torch.equal(scattered.cpu(), torch.arange(2 * size, dtype=torch.float32)[r * size :][:size] * 3)
            ),
            "broadcast": bool(torch.equal(root.cpu(), torch.ones(size))),
        }
        out["transport"] = comm.transport_on(x.device)
    # all-reduce time, fp32: this communicator (CUDA IPC from IPC_MIN_BYTES) against the staged path's work done by
    # hand (to the host, the shm transport, back: what StagedTransport does for every op)
    times = {}
    for nbytes, reps in ((256 << 10, 30), (1 << 20, 30), (4 << 20, 20), (64 << 20, 5)):
        t = torch.ones(nbytes // 4, device="cuda")
        row = {}
        for how in ("comm", "staged"):
            for i in range(reps + 2):
                if i == 2:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                if how == "comm":
                    comm.all_reduce(t)
                else:
                    h = t.to("cpu")
                    comm.all_reduce(h)
                    t.copy_(h)
            torch.cuda.synchronize()
            row[how] = (time.perf_counter() - start) / reps * 1e6
        times[f"{nbytes >> 10} KiB"] = {k: round(v, 1) for k, v in row.items()}
    out["all_reduce_us"] = times
    return out


def _slow_full(n: int, value: float) -> torch.Tensor:
    """A tensor of ``n`` copies of ``value`` that the GPU finishes writing only after a few milliseconds of matmuls
    queued before it on the current stream: an op that read it without waiting for that stream would read garbage."""
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(8):
        a = a @ a / 2048**0.5
    return torch.full((n,), value, device="cuda") + 0 * a.sum()


def _stream_order_rank(world):
    """Asynchronous ops on nxdt streams (nxdt.comm.cuda_streams): each reads its inputs after the work queued before
    it on the issuing stream, hands its results to the waiter's stream, follows its ``after=`` op on the device, and
    keeps the memory of an input its caller dropped until it has read it. For both paths of two ranks on one GPU
    (staged below IPC_MIN_BYTES, CUDA IPC from it) and one rank over NCCL."""
    from nxdt.comm.cuda_ipc import IPC_MIN_BYTES

    torch.cuda.set_device(0)
    r, size = world.rank, world.world_size
    comm = world.new_communicator(list(range(size)), "order")
    total = sum(range(1, size + 1))
    out = {}
    for n in (5, IPC_MIN_BYTES // 4):
        t = _slow_full(n, float(r + 1))
        work = comm.all_reduce(t, stream="a", async_op=True)  # inputs: after the matmuls
        work.wait()
        ready = bool(torch.equal(t.cpu(), torch.full((n,), float(total))))
        gathered = torch.empty(size * n, device="cuda")
        first = comm.all_reduce(t, stream="a", async_op=True)  # every member's total: size · total
        second = comm.all_gather(gathered, t, stream="b", async_op=True, after=first)  # stream b after stream a's op
        second.wait()
        chained = bool(torch.equal(gathered.cpu(), torch.full((size * n,), float(size * total))))
        dropped = _slow_full(n, float(r + 1))
        kept = torch.empty(size * n, device="cuda")
        work = comm.all_gather(kept, dropped, stream="c", async_op=True)
        del dropped  # its memory goes back to the allocator before the op has read it
        for _ in range(4):
            torch.full((n,), -7.0, device="cuda")  # would land on the dropped input's memory without record_stream
        work.wait()
        expect = torch.cat([torch.full((n,), float(k + 1)) for k in range(size)])
        kept_ok = bool(torch.equal(kept.cpu(), expect))
        out[str(n)] = {"inputs_ready": ready, "after_chain": chained, "dropped_input": kept_ok}
    out["transport"] = comm.transport_on("cuda")
    out["device_queues"] = sorted(name for name, s in world._streams.items() if s.device_queues)
    return out


def comm_checks() -> dict:
    from nxdt.comm.spawn import run_local

    solo = run_local(_nccl_rank, 1, timeout_s=120)[0]
    assert solo["transport"] == "nccl" and solo["gathered"] == [0.0, 1.0, 2.0, 3.0], solo
    pair = run_local(_shared_gpu_rank, 2, timeout_s=120)
    for got in pair:
        assert got["transport"] == "cuda_ipc", got
        for path in ("staged", "cuda_ipc"):
            assert all(got[path].values()), (path, got)
    order = {"nccl": run_local(_stream_order_rank, 1, timeout_s=120), "pair": run_local(_stream_order_rank, 2, timeout_s=120)}
    for kind, ranks in order.items():
        for got in ranks:  # a one-member all-reduce has nothing to move: only the pair's stream "a" has device work
            assert got["device_queues"] == (["a", "b", "c"] if kind == "pair" else ["b", "c"]), (kind, got)
            for n, checks in got.items():
                assert n in ("transport", "device_queues") or all(checks.values()), (kind, n, got)
    return {"solo": solo, "pair": pair, "stream_order": order}


def placement_checks() -> dict:
    from torch.profiler import ProfilerActivity, profile

    from nxdt.config import compose_config
    from nxdt.lightning.optim import build_optimizer
    from nxdt.models.llama import LlamaForCausalLM
    from nxdt.parallel.devices import attention_kernels, policy_for

    cfg = compose_config(["model=llama_tiny"], check=False)
    policy = policy_for("cuda", 0, 1, torch.cuda.device_count(), "mixed_precision")
    torch.cuda.set_device(policy.torch_device)
    model = LlamaForCausalLM(cfg.model).to(policy.torch_device)
    opt = build_optimizer(model, cfg.model.optim, precision="mixed_precision")
    ids = torch.randint(0, cfg.model.vocab_size, (2, 64), device=policy.torch_device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with attention_kernels("cuda", policy.half), torch.autocast("cuda", dtype=policy.autocast_dtype):
            loss = model.loss_fn(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
    # the gradient norm's GPU path (foreach norms, fp32 accumulation per tensor) against float64 on the host; a block-
    # and tree-wise fp32 sum of ≤ 32 k squares is within ~1e-6 relative: 1e-5 leaves room
    from nxdt.parallel.data_parallel import ModelParallel

    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    norm_gpu = float(ModelParallel(dp=None).global_norm(model, named))  # type: ignore[arg-type]
    norm_ref = sum(float(g.double().square().sum()) for _, g in named) ** 0.5
    assert abs(norm_gpu - norm_ref) <= 1e-5 * norm_ref, (norm_gpu, norm_ref)
    opt.step()
    # sampling on the GPU, with a generator of the model's device (GRPO's, nxdt generate's) or a CPU one (drawn there)
    from nxdt.models.generate import generate

    sampled = {}
    for where in ("cuda", "cpu"):
        draws = [
            generate(model, [[1, 2, 3], [4, 5]], 6, do_sample=True, generator=torch.Generator(where).manual_seed(7))
            for _ in range(2)
        ]
        assert draws[0] == draws[1] and all(len(row) == 6 for row in draws[0]), (where, draws)
        sampled[where] = draws[0]
    ops = {e.key for e in prof.key_averages()}
    attention = sorted(k for k in ops if "attention" in k and k.startswith("aten::_"))
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    out = {
        "device": policy.device,
        "params_on": sorted({str(p.device) for p in model.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "state_on": sorted({str(t.device) for t in state}),
        "fused": opt.defaults.get("fused"),
        "attention_ops": attention,
        "grad_norm": {"gpu": norm_gpu, "float64": norm_ref},
        "sampled": sampled,
    }
    assert out["params_on"] == ["cuda:0"] and out["state_on"] == ["cuda:0"], out
    assert out["param_dtypes"] == ["torch.float32"] and out["fused"] is True, out  # fp32 master weights, fused AdamW
    assert attention and not any("math" in k for k in attention), out  # a fused kernel, never the math one
    return out


def sr_checks() -> dict:
    """bf16 stochastic rounding of CUDA tensors draws its bits on the GPU: uniform and repeatable there, unbiased, and
    an optimizer step lands on one of the two bf16 neighbours of the fp32 AdamW result. Times rounding a 64 M-element
    tensor with the bits drawn on the GPU and, for the record, drawn on the CPU and copied over (before 2026-11-30)."""
    import math
    import time

    from nxdt.parallel.stochastic_rounding import (
        StochasticRoundingAdamW,
        random_bits16,
        stochastic_round_bf16,
        stream_generator,
    )

    bits = random_bits16(1_000_003, stream_generator(1, 2, 3, device="cuda"))
    assert bits.device.type == "cuda" and bits.dtype == torch.int32, bits
    assert int(bits.min()) == 0 and int(bits.max()) == 65535
    for bit in range(16):  # each bit a fair coin, within 5 sigma
        assert abs(float(((bits >> bit) & 1).double().mean()) - 0.5) < 5 * 0.5 / math.sqrt(bits.numel()), bit
    assert torch.equal(bits, random_bits16(1_000_003, stream_generator(1, 2, 3, device="cuda")))
    # x a quarter of the way from 1.0 to the next bf16 (1 + 2^-7): rounds up with probability 1/4
    x = torch.full((4_000_000,), 1.0 + 2.0**-9, device="cuda")
    up = (stochastic_round_bf16(x, stream_generator(5, device="cuda")).float() > 1.0).double().mean().item()
    assert abs(up - 0.25) < 5 * math.sqrt(0.25 * 0.75 / x.numel()), up
    # one AdamW step on bf16 parameters: each element lands on one of the two bf16 values around torch AdamW's fp32
    # result from the same start (foreach=False: the op-for-op formula StochasticRoundingAdamW computes in fp32)
    torch.manual_seed(0)
    w = (torch.randn(1 << 20, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    w.grad = (torch.randn(1 << 20, device="cuda") * 1e-3).to(torch.bfloat16)
    expected = w.detach().float().clone().requires_grad_()
    expected.grad = w.grad.float()
    torch.optim.AdamW([expected], lr=1e-3, weight_decay=0.1, foreach=False).step()
    StochasticRoundingAdamW([w], lr=1e-3, weight_decay=0.1, seed=3).step()
    pattern = expected.detach().view(torch.int32).bitwise_and(-(1 << 16))  # toward zero, to bf16
    toward_zero, away = pattern.view(torch.float32), (pattern + (1 << 16)).view(torch.float32)
    got = w.detach().float()
    assert bool(((got == toward_zero) | (got == away)).all()), "a stochastically rounded weight left its bf16 neighbours"
    times = {}
    big = torch.randn(64 << 20, device="cuda")
    for where in ("cuda", "cpu"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for step in range(3):
            stochastic_round_bf16(big, stream_generator(1, step, 0, device=where))
        torch.cuda.synchronize()
        times[f"bits_on_{where}_ms"] = round((time.perf_counter() - start) / 3 * 1e3, 2)
    return {"bits_device": str(bits.device), "round_up_share": up, "round_64M_elements": times}


if __name__ == "__main__":
    # comm first: its ranks fork before CUDA is used here
    result = {"comm": comm_checks(), "placement": placement_checks(), "stochastic_rounding": sr_checks()}
    print(json.dumps(result))
    sys.exit(0)
