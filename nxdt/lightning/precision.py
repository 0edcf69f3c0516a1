"""Lightning's precision plugins with gradient clipping that sees the whole model.

Lightning clips through the precision plugin (``clip_grad_by_norm`` / ``clip_grad_by_value`` on the
optimizer's own tensors: the norm of that optimizer's parameters only), both for ``Trainer(gradient_clip_val=...)`` and for a module's
``self.clip_gradients(...)``. Under tensor/pipeline parallelism, ZeRO-1 or FSDP those tensors are one
rank's part of the gradient (or not the reduced gradient at all), so a local norm is wrong.
``NxDStrategy`` therefore takes every precision plugin Lightning builds for the CPU in this clipping
variant: the same plugin (same class behaviour, same state), whose clipping asks the strategy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

if TYPE_CHECKING:
    from nxdt.lightning.strategy import NxDStrategy


class _StrategyClipping:
    """Clipping delegated to the strategy, which finishes the gradients (DP reduction) first if needed."""

    strategy: "NxDStrategy"

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.strategy.clip_grad_norm(float(clip_val), optimizer)  # that optimizer's parameters, as Lightning clips

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        self.strategy.clip_grad_value(float(clip_val), optimizer)


class NxDPrecision(_StrategyClipping, Precision):
    pass


class NxDMixedPrecision(_StrategyClipping, MixedPrecision):
    pass


class NxDHalfPrecision(_StrategyClipping, HalfPrecision):
    pass


class NxDDoublePrecision(_StrategyClipping, DoublePrecision):
    pass


_VARIANTS: dict[type, type[_StrategyClipping]] = {
    Precision: NxDPrecision,
    MixedPrecision: NxDMixedPrecision,
    HalfPrecision: NxDHalfPrecision,
    DoublePrecision: NxDDoublePrecision,
}


def with_strategy_clipping(plugin: Precision, strategy: "NxDStrategy") -> Precision:
    """``plugin`` as its clipping variant bound to ``strategy`` (a variant already: rebound)."""
    if isinstance(plugin, _StrategyClipping):
        plugin.strategy = strategy
        return plugin
    variant = _VARIANTS.get(type(plugin))
    if variant is None:
        raise ValueError(
            f"NxDStrategy: the precision plugin {type(plugin).__name__} is not supported; use "
            "precision='32-true', 'bf16-mixed', 'bf16-true', '16-true' or '64-true'"
        )
    clipping = object.__new__(variant)  # a plugin instance without running __init__: its state is copied next
    clipping.__dict__.update(plugin.__dict__)  # the plugin's settings and state (precision flag, scaler, ...)
    clipping.strategy = strategy
    return clipping
