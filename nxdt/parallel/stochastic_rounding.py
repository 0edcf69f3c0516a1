"""Stochastic rounding (SR) to bf16, and AdamW whose bf16 updates are rounded stochastically.

bf16 keeps 8 significant bits. Rounded to nearest, an update smaller than half a unit in the last place
(ulp) of the weight is lost every time: a weight at 1.0 (ulp 2**-7 = 0.0078) never moves by 1e-4 steps,
however many it takes. Rounded stochastically, ``x`` with ``a < x < b`` (``a``, ``b`` adjacent bf16
values) becomes ``b`` with probability ``(x - a) / (b - a)`` and ``a`` otherwise: ``E[round(x)] = x``,
so small updates accumulate in expectation and bf16 weights follow the fp32 trajectory (with noise).

The cast works on the fp32 bit pattern: fp32 and bf16 share sign and exponent, bf16 is the top 16 bits.
Inside one binade the fp32 values are evenly spaced in their bit patterns, so adding a uniform integer
``r`` in ``[0, 2**16)`` to the pattern and clearing the low 16 bits rounds the magnitude up exactly when
``r >= 2**16 - low16(x)``: probability ``low16(x) / 2**16 = (|x| - |a|) / ulp``. A carry out of the
mantissa moves into the exponent, which is the next bf16 value (binade boundaries included); the sign bit
is never reached, so negatives round symmetrically; bf16 values themselves (low bits 0) never change.
Special cases: inf and nan pass through (as ``x.to(bfloat16)``); a finite value whose rounding would
carry into inf (above the largest bf16, 3.3895e38) saturates at +-3.3895e38 — finite weights stay finite.

Randomness is counter-based: the bits for one tensor of one optimizer step come from a
``torch.Generator`` on the tensor's device seeded with a 64-bit hash of ``(seed, step, parameter
index)`` (:func:`stream_seed`), so nothing but the step counter (already in the optimizer state) is
needed to continue a run bit-exactly after a resume, and the bits do not depend on how many steps a
process has run. The rank
is deliberately *not* part of the key: every copy of one parameter (data-parallel replicas, the layer
norms every tensor-parallel rank holds) has the same index, gradient and step, so it draws the same bits
and the copies stay bitwise identical without a broadcast. Ranks holding different slices (TP shards,
ZeRO-1/FSDP shards, PP stages) use the same bits at the same local positions: each element is still
rounded without bias; the noise of such elements is correlated across ranks, not biased.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "stochastic_round_bf16",
    "random_bits16",
    "stream_seed",
    "stream_generator",
    "StochasticRoundingAdamW",
    "BF16_MAX_BITS",
]

_MASK64 = (1 << 64) - 1
_HIGH16 = -(1 << 16)  # int32 0xFFFF0000: keeps sign, exponent and the 7 bf16 mantissa bits
_SIGN = -(1 << 31)  # int32 0x80000000
BF16_MAX_BITS = 0x7F7F0000  # the largest finite bf16 (3.3895e38) as an fp32 bit pattern
_INF_BITS = 0x7F800000


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_seed(*key: int) -> int:
    """A 64-bit seed from integers (seed, step, parameter index, ...): different keys give unrelated streams."""
    h = 0
    for k in key:
        h = _splitmix64(h ^ (int(k) & _MASK64))
    return h


def stream_generator(*key: int, device: torch.device | str | None = None) -> torch.Generator:
    """A generator on ``device`` (the CPU by default) seeded with :func:`stream_seed` of ``key``.

    A GPU parameter's bits are drawn on its GPU: drawn on the CPU they cost a CPU pass over every element and
    a host-to-device copy each step. CPU and CUDA generators are different algorithms (mt19937, Philox), so one
    key gives different, equally uniform bits on each; on one kind of device the bits are reproducible.
    """
    g = torch.Generator(device=device if device is not None else "cpu")
    g.manual_seed(stream_seed(*key))
    return g


def random_bits16(numel: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``numel`` independent uniform integers in ``[0, 2**16)`` (int32): four per 64 random bits, on the
    generator's device (the default CPU generator's without one)."""
    device = generator.device if generator is not None else None
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), None, generator=generator)
    return words.view(torch.int16)[:numel].to(torch.int32).add_(1 << 15)


@torch.no_grad()
def stochastic_round_bf16(
    x: torch.Tensor, generator: torch.Generator | None = None, *, bits: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` (fp32; other float dtypes are converted to fp32 first) rounded stochastically to bf16.

    The randomness is ``bits`` (int32 in ``[0, 2**16)``, ``x``'s number of elements) or drawn from
    ``generator`` (:func:`random_bits16`). Unbiased for finite values within bf16's range; exact bf16
    values, signs, zeros, inf and nan are preserved; finite values beyond the largest bf16 saturate to it.
    """
    x32 = x.detach().to(torch.float32).contiguous()
    if bits is None:
        bits = random_bits16(x32.numel(), generator)
    elif bits.numel() != x32.numel() or bits.dtype != torch.int32:
        raise ValueError(
            f"stochastic_round_bf16: bits must be int32 with {x32.numel()} elements, got {bits.dtype} with {bits.numel()}"
        )
    pattern = x32.view(torch.int32)
    rounded = (pattern + bits.view(x32.shape).to(pattern.device)).bitwise_and_(_HIGH16)
    out = rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    # inf/nan inputs and finite values carried past the largest bf16 all end with an all-ones exponent;
    # one reduction tells whether there is any (rare), only then are they told apart
    if x32.numel() and int(rounded.bitwise_and(~_SIGN).amax()) >= _INF_BITS:
        finite = torch.isfinite(x32)
        overflow = (rounded.bitwise_and(~_SIGN) >= _INF_BITS) & finite  # saturate at the largest bf16
        saturated = pattern.bitwise_and(_SIGN).bitwise_or_(BF16_MAX_BITS).view(torch.float32).to(torch.bfloat16)
        out = torch.where(overflow, saturated, out)
        out = torch.where(finite, out, x32.to(torch.bfloat16))  # inf keeps its sign, nan stays nan
    return out


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's formula) computed in fp32 for parameters of any float dtype;
    bf16 results (parameters, and the moments when they are kept in bf16) are written back with
    :func:`stochastic_round_bf16`. fp32 parameters and state are updated exactly as
    ``torch.optim.AdamW(foreach=False)`` would (bitwise).

    ``fp32_state``: keep the moments in fp32 (NxDT's ``adamw_fp32OptState``); by default they have the
    parameter's dtype (bf16 parameters: bf16 moments, rounded stochastically like the weights).
    ``seed``: the run's seed; the bits of step ``t`` for the parameter at position ``i`` (counted over the
    param groups in order) come from ``stream_generator(seed, t, i)`` on the parameter's device: parameter
    first, then ``exp_avg``, then ``exp_avg_sq``. The state is torch AdamW's (``step``, ``exp_avg``,
    ``exp_avg_sq``), so checkpoints, resharding and ZeRO-1 (which rebuilds this class around its flat
    shards) treat it like AdamW.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        seed: int = 0,
        fp32_state: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"StochasticRoundingAdamW: invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"StochasticRoundingAdamW: invalid epsilon {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"StochasticRoundingAdamW: invalid betas {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"StochasticRoundingAdamW: invalid weight_decay {weight_decay}")
        super().__init__(
            params,
            dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, seed=int(seed), fp32_state=bool(fp32_state)),
        )

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.defaults["fp32_state"] else p.dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        seed = self.defaults["seed"]  # the run's, not a checkpoint's param group's
        index = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StochasticRoundingAdamW does not support sparse gradients")
                if not p.dtype.is_floating_point:
                    raise TypeError(f"StochasticRoundingAdamW: parameter {index} has dtype {p.dtype}")
                state = self.state[p]
                dtype = self._state_dtype(p)
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                for key in ("exp_avg", "exp_avg_sq"):  # e.g. loaded into a buffer of the parameter's dtype
                    if state[key].dtype != dtype:
                        state[key] = state[key].to(dtype)
                state["step"] += 1
                step = state["step"].item()
                generator = stream_generator(seed, int(step), index, device=p.device)

                grad = p.grad.to(torch.float32)
                param = p if p.dtype == torch.float32 else p.to(torch.float32)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.to(torch.float32)
                v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.to(torch.float32)

                # torch.optim.adamw._single_tensor_adamw, op for op, in fp32
                if wd != 0:
                    param.mul_(1 - lr * wd)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
                param.addcdiv_(m, denom, value=-step_size)

                for target, value in ((p, param), (exp_avg, m), (exp_avg_sq, v)):
                    if target is value:
                        continue
                    if target.dtype == torch.bfloat16:
                        target.copy_(stochastic_round_bf16(value, generator).view_as(target))
                    else:  # fp16/fp64 parameters: no stochastic rounding defined here, round to nearest
                        target.copy_(value)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every floating state tensor to its parameter's dtype on load; fp32 moments of bf16
        parameters (``fp32_state``) are put back in fp32, so a resume continues bit-exactly."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, saved in state_dict["state"].items():
            if not isinstance(idx, int) or not 0 <= idx < len(params):
                continue
            p = params[idx]
            for key in ("exp_avg", "exp_avg_sq"):
                value = saved.get(key)
                if isinstance(value, torch.Tensor) and value.dtype != p.dtype and value.dtype == self._state_dtype(p):
                    self.state[p][key] = value.to(device=p.device, copy=True)
