"""Data: tokenizers, datasets (synthetic, packed text), and the resumable global-batch sampler.
Pure torch/python: no Lightning here (the DataModule lives in nxdt.lightning.datamodule)."""

from pathlib import Path

SAMPLE_TEXT = Path(__file__).parent / "samples" / "kjv_genesis_exodus_proverbs.txt"
