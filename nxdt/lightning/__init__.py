"""Lightning integration: ``NxDStrategy`` (registered as ``strategy="nxdt"`` on import), the causal-LM
module, checkpoint I/O and the experiment manager; ``convert_to_lightning_checkpoint`` turns an nxdt checkpoint
directory into one Lightning ``.ckpt`` file."""

from nxdt.lightning.lightning_checkpoint import convert_to_lightning_checkpoint
from nxdt.lightning.strategy import NxDStrategy

__all__ = ["NxDStrategy", "convert_to_lightning_checkpoint"]
