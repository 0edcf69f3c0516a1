"""precision.type=bf16SR: the stochastic-rounding cast to bf16 (unbiased, exact on bf16 values, signs and
specials kept), AdamW whose bf16 updates are rounded stochastically (learns where round-to-nearest stalls,
repeatable and resumable bitwise), and its wiring (build_optimizer, validation, NxDT translation)."""

from __future__ import annotations

import copy
import io
import inspect
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import warm_cli
import torch

from nxdt.lightning.optim import build_optimizer
from nxdt.parallel.stochastic_rounding import (
    StochasticRoundingAdamW,
    random_bits16,
    stochastic_round_bf16,
    stream_generator,
    stream_seed,
)
from nxdt.parallel.zero1 import Zero1Optimizer

BF16_MAX = torch.finfo(torch.bfloat16).max


def neighbours(x: float) -> tuple[float, float]:
    """The bf16 values a <= x < b around the fp32 value x (x >= 0)."""
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32).item()
    a = torch.tensor([bits & -65536], dtype=torch.int32).view(torch.float32).item()
    b = torch.tensor([(bits & -65536) + 65536], dtype=torch.int32).view(torch.float32).item()
    return a, b


# ------------------------------------------------------------------------------------------------ the cast


@pytest.mark.parametrize(
    "x",
    [1.0 + 0.3 * 2**-7, 1.0 + 0.999 * 2**-7, 1.0 + 2**-23, 2.0 - 2**-22, 3.14159, -2.71828, 1e-3, -7.5e-20, 6e4, 1.5e-39, 3.3e38],
)
def test_rounding_is_unbiased_between_bf16_neighbours(x):
    """N roundings of x: only the two neighbours occur, and their mean is x within 5 standard errors.

    round(x) = a + (b-a)·B with B ~ Bernoulli(p), p = (x-a)/(b-a): the mean of N has standard error
    (b-a)·sqrt(p(1-p)/N). With a fixed seed the check is deterministic; for a random seed it would fail
    with probability < 1e-6 (5 sigma)."""
    n = 200_000
    xs = torch.full((n,), x, dtype=torch.float32)
    x32 = xs[0].item()  # x as fp32
    a, b = neighbours(abs(x32))
    if x32 < 0:
        a, b = -b, -a
    out = stochastic_round_bf16(xs, stream_generator(1234, int(abs(x32) * 1e6) % 1000)).double()
    assert set(out.unique().tolist()) <= {a, b}
    p = (x32 - a) / (b - a)
    se = (b - a) * math.sqrt(p * (1 - p) / n)
    mean = out.mean().item()
    assert abs(mean - x32) <= 5 * se + 1e-12 * abs(x32), (mean, x32, se)
    frac_up = (out == b).double().mean().item()
    assert abs(frac_up - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_unbiased_over_many_magnitudes_and_signs():
    """Values spread over 60 binades, both signs: the mean rounding error in units of each value's ulp is 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, generator=g) * torch.exp2(torch.randint(-30, 30, (400_000,), generator=g).float())
    err = stochastic_round_bf16(x, stream_generator(5)).double() - x.double()
    ulp = torch.exp2(torch.floor(torch.log2(x.abs().double())) - 7)
    rel = err / ulp  # each in (-1, 1), mean 0, std <= 0.5
    assert rel.abs().max() < 1
    assert abs(rel.mean().item()) < 5 * 0.5 / math.sqrt(x.numel())


def test_exact_bf16_values_are_unchanged():
    g = torch.Generator().manual_seed(1)
    values = (torch.randn(100_000, generator=g) * 1e3).to(torch.bfloat16)
    specials = torch.tensor(
        [0.0, -0.0, BF16_MAX, -BF16_MAX, torch.finfo(torch.bfloat16).tiny, 9.1835e-41, 1.0, -1.0], dtype=torch.bfloat16
    )
    values = torch.cat([values, specials])
    for seed in range(3):
        out = stochastic_round_bf16(values.float(), stream_generator(seed))
        assert torch.equal(out.view(torch.int16), values.view(torch.int16))


def test_signs_zeros_inf_nan_and_saturation():
    x = torch.tensor(
        [
            math.inf,
            -math.inf,
            math.nan,
            0.0,
            -0.0,
            3.4e38,
            -3.4e38,
            torch.finfo(torch.float32).max,
            -torch.finfo(torch.float32).max,
            -1.0 - 0.5 * 2**-7,
            1e-45,
            -1e-45,
        ]
    )
    for seed in range(20):
        out = stochastic_round_bf16(x, stream_generator(seed)).float()
        assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2])
        assert torch.equal(torch.signbit(out[3:5]), torch.tensor([False, True])) and (out[3:5] == 0).all()
        # beyond the largest bf16 (where rounding to nearest gives inf): finite stays finite, at +-max
        assert out[5:9].tolist() == [BF16_MAX, -BF16_MAX, BF16_MAX, -BF16_MAX]
        assert out[9].item() in (-1.0, -1.0 - 2**-7)  # negatives round between their (negative) neighbours
        assert torch.signbit(out[10:12]).tolist() == [False, True]  # subnormals: sign kept (rounds to 0 or up)
    # values just below the largest bf16 round up to it, never past it
    below = torch.full((10_000,), BF16_MAX * (1 - 2**-10))
    assert stochastic_round_bf16(below, stream_generator(3)).float().max().item() == BF16_MAX


def test_negatives_mirror_positives_with_the_same_bits():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50_000, generator=g)
    bits = random_bits16(x.numel(), stream_generator(9))
    assert torch.equal(stochastic_round_bf16(-x, bits=bits), -stochastic_round_bf16(x, bits=bits))


def test_random_bits_are_16_uniform_bits_and_keyed():
    r = random_bits16(1_000_003, stream_generator(1, 2, 3))
    assert r.dtype == torch.int32 and r.min().item() == 0 and r.max().item() == 65535
    for bit in range(16):  # each bit is a fair coin: within 5 sigma of 1/2
        assert abs(((r >> bit) & 1).double().mean().item() - 0.5) < 5 * 0.5 / math.sqrt(r.numel())
    assert torch.equal(r, random_bits16(1_000_003, stream_generator(1, 2, 3)))
    assert not torch.equal(r[:1000], random_bits16(1000, stream_generator(1, 2, 4)))
    assert len({stream_seed(s, t, i) for s in range(4) for t in range(4) for i in range(4)}) == 64


# ------------------------------------------------------------------------------------------------ the optimizer


def test_fp32_parameters_update_exactly_as_torch_adamw():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(20, 12), torch.nn.Linear(20, 12)
    theirs.load_state_dict(ours.state_dict())

    def groups(m):
        return [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}]

    a = StochasticRoundingAdamW(groups(ours), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, seed=1)
    b = torch.optim.AdamW(groups(theirs), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(25):
        x = torch.randn(8, 20)
        for m in (ours, theirs):
            m.zero_grad()
            m(x).square().mean().backward()
        a.step()
        b.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])


def _quadratic_run(kind: str, steps: int, n: int = 4096, lr: float = 1e-4) -> list[float]:
    """w (n elements, all 1.0) descends 0.5·Σ(w - 0.9)² with AdamW(lr): the mean of w after each step."""
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    w = torch.nn.Parameter(torch.ones(n, dtype=dtype))
    if kind == "sr":
        opt = StochasticRoundingAdamW([w], lr=lr, betas=(0.9, 0.999), weight_decay=0.0, seed=11)
    else:
        opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.999), weight_decay=0.0, foreach=False)
    means = []
    for _ in range(steps):
        w.grad = (w.detach().float() - 0.9).to(dtype)
        opt.step()
        means.append(w.detach().double().mean().item())
    return means


def test_round_to_nearest_stalls_where_stochastic_rounding_tracks_fp32():
    """Adam's step is ~lr = 1e-4 per step, far below half a bf16 ulp at 1.0 (2**-9 ≈ 0.002 below it).

    Round-to-nearest bf16 never moves; SR moves each element by a whole ulp with probability step/ulp, so the
    mean follows the fp32 trajectory. Band: one element's deviation is a random walk of at most T roundings
    of variance <= ulp²/4 (ulp = 2**-8 below 1.0), std <= 2**-9·sqrt(T) ≈ 0.035 at T = 300; the mean of
    4096 elements has std <= 0.00055, so 0.003 is > 5 sigma."""
    steps = 300
    fp32, rtn, sr = _quadratic_run("fp32", steps), _quadratic_run("bf16", steps), _quadratic_run("sr", steps)
    assert rtn[-1] == 1.0  # stalled: every update rounded away
    assert 1.0 - fp32[-1] > 0.025  # fp32 learns ~lr per step
    for t in (49, 149, 299):
        assert abs(sr[t] - fp32[t]) < 0.003, (t, sr[t], fp32[t])
    assert (1.0 - sr[-1]) / (1.0 - fp32[-1]) > 0.9


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(torch.bfloat16)


def _train(model, opt, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=g).to(torch.bfloat16)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def _groups(model):
    return [
        {"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0},
    ]


def _snapshot(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out += [s["exp_avg"].clone(), s["exp_avg_sq"].clone(), s["step"].clone()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fp32_state", [False, True])
def test_same_seed_is_bitwise_repeatable_and_a_resume_continues_bitwise(fp32_state):
    def fresh(seed=7):
        model = _mlp()
        return model, StochasticRoundingAdamW(_groups(model), lr=1e-3, betas=(0.9, 0.95), seed=seed, fp32_state=fp32_state)

    m1, o1 = fresh()
    _train(m1, o1, 12)
    m2, o2 = fresh()
    _train(m2, o2, 12)
    assert _same(_snapshot(m1, o1), _snapshot(m2, o2))
    assert all(p.dtype == torch.bfloat16 for p in m1.parameters())
    state_dtype = torch.float32 if fp32_state else torch.bfloat16
    assert all(s["exp_avg"].dtype == state_dtype == s["exp_avg_sq"].dtype for s in o1.state.values())
    m3, o3 = fresh(seed=8)
    _train(m3, o3, 12)
    assert not _same(_snapshot(m1, o1), _snapshot(m3, o3))  # the seed matters

    # resume at step 5: a new model and optimizer from the saved (serialized) weights and state dict
    m4, o4 = fresh()
    _train(m4, o4, 5)
    buffer = io.BytesIO()
    torch.save({"model": m4.state_dict(), "optimizer": o4.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    m5, o5 = fresh()
    m5.load_state_dict(saved["model"])
    o5.load_state_dict(saved["optimizer"])
    assert all(s["exp_avg"].dtype == state_dtype for s in o5.state.values())  # torch would cast fp32 moments to bf16
    _train(m5, o5, 7, start=5)
    assert _same(_snapshot(m1, o1), _snapshot(m5, o5))


def test_zero1_rebuilds_it_from_its_defaults_and_resumes_bitwise():
    """NxDStrategy.shard_optimizer rebuilds the module's optimizer class around flat shards from the defaults
    its constructor accepts: the seed and fp32_state must be among them."""

    def fresh():
        model = _mlp()
        built = StochasticRoundingAdamW(_groups(model), lr=1e-3, seed=3, fp32_state=True)
        accepted = inspect.signature(type(built).__init__).parameters
        kwargs = {k: v for k, v in built.defaults.items() if k in accepted}
        assert kwargs["seed"] == 3 and kwargs["fp32_state"] is True
        return model, Zero1Optimizer([dict(g) for g in built.param_groups], type(built), None, model=model, **kwargs)

    m1, o1 = fresh()
    _train(m1, o1, 8)
    assert isinstance(o1.inner, StochasticRoundingAdamW)
    m2, o2 = fresh()
    _train(m2, o2, 3)
    saved = copy.deepcopy((m2.state_dict(), o2.state_dict()))
    m3, o3 = fresh()
    m3.load_state_dict(saved[0])
    o3.load_state_dict(saved[1])
    _train(m3, o3, 5, start=3)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m3.parameters()))
    assert all(s["exp_avg"].dtype == torch.float32 for s in o3.inner.state.values())


def test_replicas_round_alike():
    """Data-parallel replicas (same parameter index, gradient and step) draw the same bits: they stay identical."""
    a, b = _mlp(), _mlp()
    oa = StochasticRoundingAdamW(_groups(a), lr=1e-3, seed=5)
    ob = StochasticRoundingAdamW(_groups(b), lr=1e-3, seed=5)
    _train(a, oa, 6)
    _train(b, ob, 6)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------------------------------------ wiring


def _optim_cfg(name="adamw"):
    return SimpleNamespace(name=name, lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.01, no_weight_decay="norms_and_biases")


def test_build_optimizer_follows_the_precision_type():
    model = _mlp()
    assert type(build_optimizer(model, _optim_cfg())) is torch.optim.AdamW
    opt = build_optimizer(model, _optim_cfg(), precision="bf16SR", seed=42)
    assert isinstance(opt, StochasticRoundingAdamW) and opt.defaults["seed"] == 42 and not opt.defaults["fp32_state"]
    assert build_optimizer(model, _optim_cfg("adamw_fp32OptState"), precision="bf16SR", seed=42).defaults["fp32_state"] is True
    for kind in ("fp32", "bf16", "mixed_precision", "mixed_precisionSR"):
        assert type(build_optimizer(model, _optim_cfg(), precision=kind, seed=42)) is torch.optim.AdamW


def test_sr_types_validate_and_map_to_lightning_precisions():
    from nxdt.config import compose_config
    from nxdt.lightning.train import PRECISION

    for kind, lightning in (("bf16SR", "bf16-true"), ("mixed_precisionSR", "bf16-mixed")):
        cfg = compose_config(["data=synthetic", f"precision.type={kind}"])
        assert cfg.precision.type == kind and PRECISION[kind] == lightning
    assert PRECISION["mixed_precisionSR"] == PRECISION["mixed_precision"]


def test_sr_with_fp32_is_one_line_exit_2(tmp_path):
    from nxdt.config import ConfigError, compose_config

    with pytest.raises(ConfigError, match="fp32SR.*nothing to bf16.*bf16SR, mixed_precisionSR"):
        compose_config(["data=synthetic", "precision.type=fp32SR"])
    result = warm_cli.run(["train", "precision.type=fp32SR"], cwd=tmp_path, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "precision.type='fp32SR'" in lines[0], result.stderr
    assert not (tmp_path / "outputs").exists()


CONFIGS = Path(__file__).parent / "nxdt_configs"


def _nxdt_precision(**precision):
    from nxdt.config.nxdt_compat import flatten, translate

    cfg = {
        "name": "t",
        "model_source": "hf",
        "trainer": {"devices": 2, "num_nodes": 1, "max_steps": 100},
        "data": {"micro_batch_size": 1, "global_batch_size": 8},
        "model": {"model_config": "c.json", "encoder_seq_length": 128},
        "precision": precision,
    }
    t = translate(cfg, json.loads((CONFIGS / "llama3_8B_config.json").read_text()))
    return flatten(t.config)["precision.type"], t.notes


@pytest.mark.parametrize(
    "precision, ours",
    [
        ({"type": "bf16SR"}, "bf16SR"),
        ({"type": "mixed_precisionSR"}, "mixed_precisionSR"),
        ({"type": "manual", "xla_use_bf16": "1", "neuron_rt_stochastic_rounding_en": "1"}, "bf16SR"),
        (
            {"type": "manual", "xla_downcast_bf16": "1", "master_weights": True, "neuron_rt_stochastic_rounding_en": "1"},
            "mixed_precisionSR",
        ),
    ],
)
def test_nxdt_sr_types_translate_to_ours_with_a_note(precision, ours):
    kind, notes = _nxdt_precision(**precision)
    assert kind == ours
    assert any("stochastic" in n or "nothing to round" in n for n in notes)


def test_nxdt_manual_sr_with_fp32_is_refused():
    from nxdt.config import ConfigError

    with pytest.raises(ConfigError, match="neuron_rt_stochastic_rounding_en='1'.*nothing to round"):
        _nxdt_precision(type="manual", neuron_rt_stochastic_rounding_en="1")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nxdt_train_bf16sr_end_to_end(tmp_path):
    """One shrunk run (llama_tiny, DP=2, 4 steps): it learns, and its checkpoint holds bf16 weights and the
    stochastic-rounding AdamW's state (bf16 moments, the run's seed)."""
    import csv
    import os

    from safetensors.torch import load_file

    run = tmp_path / "run"
    result = warm_cli.run(
        [
            "train",
            "model=llama_tiny",
            "data=synthetic",
            "seed=7",
            "precision.type=bf16SR",
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=1",
            "exp_manager.create_tensorboard_logger=false",
            "exp_manager.checkpoint_every_n_steps=4",
            f"exp_manager.explicit_log_dir={run}",
        ],
        cwd=tmp_path,
        timeout=200,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run / "metrics.csv", newline="") as fh:
        loss = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(fh)}
    assert sorted(loss) == [1, 2, 3, 4] and loss[4] < loss[1] - 0.2, loss
    step = run / "checkpoints" / "step-4"
    assert all(t.dtype == torch.bfloat16 for t in load_file(step / "model.safetensors").values())
    state = torch.load(step / "trainer_state.pt", weights_only=False)["optimizer_states"][0]
    assert all(g["seed"] == 7 and g["fp32_state"] is False for g in state["param_groups"])
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in state["state"].values())


def test_the_planner_prices_sr_types_as_what_they_store():
    from nxdt.config import compose_config
    from nxdt.planner import plan

    def memory(kind: str) -> dict:
        cfg = compose_config(
            [
                "instance=trn1.32xlarge",
                "model=llama3_8b",
                "distributed_strategy.tensor_model_parallel_size=8",
                "distributed_strategy.zero1=false",  # one layout for every type (its default is off under bf16SR only)
                f"precision.type={kind}",
            ]
        )
        return plan(cfg).estimate["memory_per_rank_bytes"]

    assert memory("mixed_precisionSR") == memory("mixed_precision")  # fp32 master weights and moments, as without SR
    assert memory("bf16SR") == memory("bf16") != memory("mixed_precision")  # bf16 weights and moments
