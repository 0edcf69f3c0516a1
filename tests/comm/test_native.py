"""The shm transport's native fast path (nxdt/comm/_native.c) and its torch fallback.

Every op × dtype × group size with exact-sum inputs (small integers: exact in every dtype and any order)
through both paths; random half-precision inputs give bit-identical results on both paths (the native
kernel accumulates in fp32 and rounds once, like the fallback). The failure tests of test_collectives.py
(timeouts, dead peers, mismatches) run on the native path whenever it is built, which the last test checks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig

import pytest
import torch

from nxdt.comm import native
from nxdt.comm.spawn import run_local

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]
SIZES = [5, 1000, 20_000]  # one element per member and then some; one small step; past the 64 KB direct limit (3+ members slice)
needs_native = pytest.mark.skipif(native._built is None, reason="the C extension is not built here")


def _value(size: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(size) % 5) + rank + 1).to(dtype)  # at most 4 * 9: exact in bf16's 8-bit mantissa


def _exact_ops(world, expect_native: bool) -> None:
    assert (native.lib is not None) == expect_native
    comm, n, r = world.world, world.world_size, world.rank
    for dtype in DTYPES:
        for size in SIZES:
            everyone = [_value(size, q, dtype) for q in range(n)]
            total = sum(v.to(torch.int64) for v in everyone).to(dtype)
            t = _value(size, r, dtype)
            comm.all_reduce(t)
            assert torch.equal(t, total), ("all_reduce", dtype, size)
            t = _value(size, r, dtype)
            comm.all_reduce(t, "max")
            assert torch.equal(t, everyone[-1]), ("all_reduce max", dtype, size)
            t = _value(size, r, dtype)
            comm.reduce(t, size % n)
            assert torch.equal(t, total if r == size % n else _value(size, r, dtype)), ("reduce", dtype, size)
            out = torch.empty(size, dtype=dtype)
            comm.reduce_scatter(out, torch.cat([_value(size, r, dtype) + q for q in range(n)]))
            assert torch.equal(out, (total.to(torch.int64) + n * r).to(dtype)), ("reduce_scatter", dtype, size)
            gathered = torch.empty(n * size, dtype=dtype)
            comm.all_gather(gathered, _value(size, r, dtype))
            assert torch.equal(gathered, torch.cat(everyone)), ("all_gather", dtype, size)
            t = _value(size, r, dtype)
            comm.broadcast(t, n - 1)
            assert torch.equal(t, everyone[-1]), ("broadcast", dtype, size)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("use_native", [pytest.param(True, marks=needs_native, id="native"), pytest.param(False, id="fallback")])
def test_every_op_and_dtype_is_exact_on_both_paths(world_size, use_native):
    run_local(_exact_ops, world_size, use_native, timeout_s=180, init_options={"native": use_native})


def _random_half(world) -> tuple[str, str]:
    comm, reduced, scattered = world.world, hashlib.sha256(), hashlib.sha256()
    g = torch.Generator().manual_seed(world.rank)
    for dtype in (torch.bfloat16, torch.float16):
        for size in (100, 40_000):  # direct; slice (3+ members, past 64 KB)
            for op in ("sum", "avg", "max", "prod"):
                t = torch.randn(size, generator=g).to(dtype)
                comm.all_reduce(t, op)
                out = torch.empty(size // 4, dtype=dtype)
                comm.reduce_scatter(out, t)
                reduced.update(t.view(torch.uint8).numpy().tobytes())
                scattered.update(out.view(torch.uint8).numpy().tobytes())
    return reduced.hexdigest(), scattered.hexdigest()


@needs_native
@pytest.mark.timeout(120)
def test_native_and_fallback_give_identical_bits_on_random_half_inputs():
    on = run_local(_random_half, 4, timeout_s=100, init_options={"native": True})
    off = run_local(_random_half, 4, timeout_s=100, init_options={"native": False})
    assert len({all_reduced for all_reduced, _ in on}) == 1  # identical on every member
    assert on == off  # and the same bits on both paths, member by member


def test_the_extension_is_built_where_a_compiler_is():
    """Where ``pip install`` could compile it, it did: a broken build must not silently leave the slow fallback."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (compiler and headers and os.uname().sysname == "Linux"):
        pytest.skip("no C compiler or Python headers here: the torch fallback is expected")
    assert native._built is not None, "nxdt/comm/_native.c was not built: run `pip install -e .` and read its compiler output"
