"""Build a model for its names and shapes only: parameters on the ``meta`` device, their random fills skipped.

A meta tensor holds no values, so drawing into it computes nothing, but torch's meta kernel for ``normal_`` is a
Python decomposition whose first call imports torch's reference-op machinery: 2.5 s of CPU on an idle host (30 s on
a loaded one) that every ``nxdt train`` paid in its pre-launch model check. Skipping the fills changes nothing a
shape check can see, and no random generator is touched (meta tensors never consume one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# the in-place fills an ``nn.Module``'s initialisation calls (torch.nn.init and the models' own reset_parameters)
_FILLS = frozenset(
    {"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_"}
)


class _SkipMetaFills(TorchFunctionMode):
    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextmanager
def shapes_only() -> Iterator[None]:
    """``with shapes_only(): model = cls(cfg)`` — every parameter and buffer on ``meta``, no fill computed."""
    with torch.device("meta"), _SkipMetaFills():
        yield
