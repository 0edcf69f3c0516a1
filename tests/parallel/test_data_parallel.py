"""nxdt.parallel.data_parallel: the replicated, ZeRO-1 and FSDP runtimes answer the same protocol alike.

Two ranks, a tiny MLP, two clipped SGD steps per runtime in one spawned world: replicas start equal
(``broadcast_parameters``), ``finish_gradients`` averages over DP (the replicated runtime's gradients equal
the whole batch's), the clipped norm, ``parameter_norm`` and the weights after every step equal a
single-process reference, and the model state dict has the reference's names and values (FSDP gathers it) — the
runtime's and the module's own ``state_dict()``, in the reference's order; ``load_state_dict`` of full weights loads
them into FSDP's shards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nxdt.comm.spawn import run_local
from nxdt.parallel.data_parallel import (
    DataParallelRuntime,
    FSDPRuntime,
    ModelParallel,
    ReplicatedRuntime,
    Zero1Runtime,
    data_parallel_runtime,
)

KINDS = {"replicated": {}, "zero1": {"zero1": True}, "fsdp": {"fsdp": {"param_persistence_threshold": 0}}}
BATCH, STEPS, LR, MAX_NORM = 8, 2, 0.1, 0.05  # the MLP's gradient norm is ~1.3: clipping is active


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 3, generator=g)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)


def _worker(world) -> dict:
    rank, size = world.rank, world.world_size
    out = {}
    for kind, options in KINDS.items():
        ref = _model(0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        model = _model(rank)  # replicas seeded apart: broadcast_parameters makes them rank 0's
        rt = data_parallel_runtime(**options)
        rt.bind(ModelParallel(dp=world.world, dp_size=size))
        rt.broadcast_parameters(model)
        checks = {
            "protocol": isinstance(rt, DataParallelRuntime),
            "format": rt.dp_format,
            "broadcast": all(_close(p, q) for p, q in zip(model.parameters(), ref.parameters())),
        }
        opt = rt.shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR), model)
        rt.shard_model(model, [opt])
        grads_ok, norms_ok, weights_ok, pnorm_ok = True, True, True, True
        for step in range(STEPS):
            x, y = _batch(step)
            nn.functional.mse_loss(ref(x), y).backward()
            per = BATCH // size
            nn.functional.mse_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
            rt.finish_gradients(model)
            if kind == "replicated":  # the average of the two halves' gradients is the whole batch's
                grads_ok &= all(_close(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            norms_ok &= bool(torch.isclose(rt.clip_grad_norm_(model, MAX_NORM), ref_norm, rtol=1e-5))
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            state = rt.model_state_dict(model)
            weights_ok &= set(state) == set(ref.state_dict()) and all(_close(state[k], v) for k, v in ref.state_dict().items())
            ref_pnorm = torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in ref.parameters()]))
            pnorm_ok &= bool(torch.isclose(rt.parameter_norm(model), ref_pnorm, rtol=1e-5))
        checks.update(grads=grads_ok, norms=norms_ok, weights=weights_ok, param_norm=pnorm_ok, stats=sorted(rt.step_stats()))
        # the module's own state_dict() is DDP's (names, order, full tensors; FSDP gathers it), and load_state_dict()
        # takes it back (FSDP cuts it into the shards)
        own, want = model.state_dict(), ref.state_dict()
        checks["own_state_dict"] = list(own) == list(want) and all(_close(own[k], v) for k, v in want.items())
        sub, sub_want = model[2].state_dict(), ref[2].state_dict()  # a submodule's too
        checks["own_state_dict"] &= list(sub) == list(sub_want) and all(_close(sub[k], v) for k, v in sub_want.items())
        other = {k: v + 1.0 for k, v in want.items()}
        model.load_state_dict(other)
        checks["own_load_state_dict"] = all(_close(model.state_dict()[k], v) for k, v in other.items())
        rt.close()
        try:
            model.state_dict()
            checks["after_close"] = "no error"
        except RuntimeError as exc:
            checks["after_close"] = str(exc)
        out[kind] = checks
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_local(_worker, 2, timeout_s=120)


@pytest.mark.parametrize("kind", list(KINDS))
def test_runtimes_train_like_one_process(results, kind):
    for rank, per_rank in enumerate(results):
        got = per_rank[kind]
        assert got["protocol"] and got["format"] == kind, (rank, got)
        assert got["broadcast"], f"rank {rank}: replicas did not start from rank 0's weights"
        assert got["grads"], f"rank {rank}: finish_gradients did not average over DP"
        assert got["norms"], f"rank {rank}: the clipped norm differs from torch's on the whole batch"
        assert got["weights"], f"rank {rank}: weights after the step differ from the single-process reference"
        assert got["param_norm"], f"rank {rank}: parameter_norm differs from the reference's"
        assert got["own_state_dict"], f"rank {rank}: module.state_dict() is not the module's own names and full weights"
        assert got["own_load_state_dict"], f"rank {rank}: module.load_state_dict() of full weights did not load them"
        if kind == "fsdp":  # after close() nothing can gather the shards: the error names the alternatives
            assert "after strategy.close()" in got["after_close"], got["after_close"]
            assert "convert_to_lightning_checkpoint" in got["after_close"]
        else:
            assert got["after_close"] == "no error"
    stats = results[0][kind]["stats"]
    assert ("exposed_comm_s" in stats) == (kind == "fsdp")


def test_choice_and_checkpoint_format():
    assert type(data_parallel_runtime()) is ReplicatedRuntime
    assert type(data_parallel_runtime(zero1=True)) is Zero1Runtime
    assert type(data_parallel_runtime(fsdp=True)) is FSDPRuntime
    assert type(data_parallel_runtime(fsdp={})) is ReplicatedRuntime  # an empty options dict is "off", as before
    assert data_parallel_runtime(fsdp={"prefetch": "eager"}).options == {"prefetch": "eager"}
    with pytest.raises(ValueError, match="choose one"):
        data_parallel_runtime(zero1=True, fsdp=True)
    for kind, options in KINDS.items():
        rt = data_parallel_runtime(**options)
        assert rt.dp_format == kind
        assert rt.checkpoint_flags() == {"zero1": kind == "zero1", "fsdp": kind == "fsdp"}
        assert rt.shards_optimizer_state == (kind != "replicated")


def test_clipping_factor_is_applied_per_dtype_as_each_gradient_would_round_it():
    """``scale_`` (gradient clipping's multiply, one foreach kernel per dtype, with no host read of the factor on a
    GPU) gives the bits of ``g.mul_(coef.to(g.dtype))`` per gradient, and a factor of 1 changes nothing."""
    from nxdt.parallel import scale_

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, generator=gen), torch.randn(3, 5, generator=gen).bfloat16(), torch.randn(4, generator=gen)]
    coef = torch.tensor(0.3171)
    expected = [g.clone().mul_(coef.to(g.dtype)) for g in grads]
    scale_(grads, coef)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    before = [g.clone() for g in grads]
    scale_(grads, torch.tensor(1.0))
    assert all(torch.equal(g, b) for g, b in zip(grads, before))


def test_squared_norm_is_the_float64_sum_without_a_float64_copy_of_the_tensor():
    """The CPU's norm piece: Σ t² against the exact sum (``math.fsum`` of the float64 squares, each exact). Bound: a sum
    of n ≥ 0 float64 terms in any order is within (n-1)·u of the exact one (u = 2⁻⁵³), here n = 3 blocks + 17
    elements. And the memory a user's large tensor costs: torch.profiler's largest CPU allocation during the call is
    one block (2 MiB), where ``vector_norm(dtype=float64)`` made a float64 copy of the whole 16 MiB tensor (32 MiB)."""
    import math

    from torch.profiler import ProfilerActivity, profile

    from nxdt.parallel import NORM_CHUNK, squared_norm

    gen = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(3 * NORM_CHUNK + 17, generator=gen),
        torch.randn(100, generator=gen).bfloat16(),
        torch.randn(40, 30, generator=gen).t(),  # not contiguous
        torch.randn(5, generator=gen) * 1e30,  # squares beyond float32's range
        torch.empty(0),
    ]
    for t in cases:
        exact = math.fsum(x * x for x in t.double().reshape(-1).tolist())
        got = squared_norm(t)
        assert got.dtype == torch.float64 and got.shape == ()
        assert float(got) == pytest.approx(exact, rel=max(t.numel() - 1, 0) * 2**-53, abs=0.0)
    big = torch.randn(1 << 22, generator=gen)  # 16 MiB of float32
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        squared_norm(big)
    assert max(e.cpu_memory_usage for e in prof.events()) <= NORM_CHUNK * 8


def test_foreach_squared_norm_is_the_float64_sum_within_fp32_accumulation():
    """The GPU's gradient-norm path (torch's foreach norm per dtype, each tensor accumulated in fp32, then squared and
    added in float64) against Σ t² in float64. Bound: a sum of n ≥ 0 terms in fp32 is within (n-1)·u of the exact sum in
    any order (u = 2⁻²⁴), and the square root and re-squaring add ~2u: with n ≤ 64 elements a tensor, < 4.2e-6."""
    from nxdt.parallel import foreach_squared_norm

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, generator=gen), torch.randn(8, 8, generator=gen).bfloat16(), torch.randn(5, generator=gen) * 1e3]
    exact = sum(float(t.double().square().sum()) for t in tensors)
    got = foreach_squared_norm(tensors)
    assert got.dtype == torch.float64 and got.shape == ()
    assert float(got) == pytest.approx(exact, rel=64 * 2**-24 + 4 * 2**-24)
    assert float(foreach_squared_norm([])) == 0.0
