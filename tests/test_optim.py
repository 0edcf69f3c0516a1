"""Learning-rate schedules of ``model.optim.sched`` (NxDT names)."""

from types import SimpleNamespace

import pytest
import torch

from nxdt.lightning.optim import build_optimizer, build_scheduler, lr_lambda


def _sched(name, warmup=4, total=20, min_lr=0.0):
    return SimpleNamespace(name=name, warmup_steps=warmup, max_steps=total, min_lr=min_lr)


def test_warmup_then_cosine_reaches_min_lr():
    f = lr_lambda(_sched("CosineAnnealing", min_lr=1e-4), base_lr=1e-3)
    # NeMo's warm-up, (step+1)/(warmup+1) up to step warmup (tests/test_nxdt_semantics.py pins it to NeMo's source)
    assert [f(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert f(12) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(20) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_linear_annealing_and_constant():
    lin = lr_lambda(_sched("LinearAnnealingWithWarmUp", warmup=0, total=10), base_lr=1.0)
    assert [lin(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_lambda(_sched("constant", warmup=0), 1.0)(7) == 1.0
    with pytest.raises(ValueError, match="sched.name='Nope'"):
        lr_lambda(_sched("Nope", warmup=0), 1.0)(3)


def test_no_weight_decay_on_vectors_and_scheduler_steps():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optim_cfg = SimpleNamespace(
        name="adamw", lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, sched=_sched("constant", warmup=2)
    )
    opt = build_optimizer(model, optim_cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]
    sched = build_scheduler(opt, optim_cfg.sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)  # NeMo's WarmupPolicy: (step+1)/(warmup+1)
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_constant_steps_hold_min_lr_at_the_end():
    sched = SimpleNamespace(name="CosineAnnealing", warmup_steps=0, max_steps=20, min_lr=0.1, constant_steps=10)
    f = lr_lambda(sched, base_lr=1.0)
    assert f(0) == pytest.approx(1.0) and f(5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert [f(s) for s in (10, 15, 20)] == pytest.approx([0.1, 0.1, 0.1])  # decayed over 10 steps, then held


def test_no_weight_decay_none_puts_every_parameter_under_weight_decay():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optim_cfg = SimpleNamespace(name="adamw", lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, no_weight_decay="none")
    opt = build_optimizer(model, optim_cfg)
    assert [(g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [(0.1, 4)]


def test_biases_exempts_biases_only_and_fixed_weight_decay_replaces_the_rate():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optim_cfg = SimpleNamespace(
        name="adamw", lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, no_weight_decay="biases", fixed_weight_decay=0.01
    )
    opt = build_optimizer(model, optim_cfg)
    # decayed: the Linear's weight and LayerNorm's weight; exempt: both biases
    assert [(g["weight_decay"], [tuple(p.shape) for p in g["params"]]) for g in opt.param_groups] == [
        (0.01, [(4, 4), (4,)]),
        (0.0, [(4,), (4,)]),
    ]
    with pytest.raises(ValueError, match="no_weight_decay='norms'"):
        build_optimizer(model, SimpleNamespace(**{**vars(optim_cfg), "no_weight_decay": "norms"}))
