"""Lightning integration: ``NxDStrategy`` (registered as ``strategy="nxdt"`` on import), the causal-LM
module, checkpoint I/O and the experiment manager."""

from nxdt.lightning.strategy import NxDStrategy

__all__ = ["NxDStrategy"]
