"""Data: tokenizers, datasets (synthetic, packed text) and the resumable global-batch sampler.

Pure torch/python — no Lightning here (the DataModule lives in ``nxdt.lightning.datamodule``)::

    tokenizers.py  ByteTokenizer, HFTokenizer (tokenizer.json), build_tokenizer
    datasets.py    SyntheticTokens (learnable Markov chain), PackedText (a text file cut into windows)
    megatron.py    Megatron's indexed .bin/.idx datasets: reader, writer (convert-megatron), GPT samples, blending
    sampler.py     GlobalBatchSampler (seeded epochs, DP slices of each global batch, resumable)
    instructions.py SFT records (input/output, messages), chat templates as HF renders them, prompt masking,
                   packing (position_ids/segment_ids per record) or padding, counted truncation
    preferences.py DPO/ORPO records (prompt/chosen/rejected): chosen rows then rejected rows, TRL truncation
    samples/       the default training text (public domain; see samples/README.md), and tiny synthetic
                   instruction and preference sets
"""

from pathlib import Path

SAMPLE_TEXT = Path(__file__).parent / "samples" / "austen_pride_and_prejudice.txt"
"""The default training text (``data.train_dir=null``): Jane Austen's *Pride and Prejudice*."""

SAMPLE_INSTRUCTIONS = Path(__file__).parent / "samples" / "instructions.jsonl"
"""200 synthetic instruction records (``instructions.make_instruction_samples()``): add, reverse, capitals."""

SAMPLE_ARITHMETIC = Path(__file__).parent / "samples" / "arithmetic.jsonl"
"""256 short sums (``arithmetic.make_arithmetic_records(256, 0)``): GRPO's prompt records with an exact answer."""

SAMPLE_PREFERENCES = Path(__file__).parent / "samples" / "preferences.jsonl"
"""200 synthetic preference triples (``preferences.make_preference_samples()``): chosen right, rejected wrong."""


def mix_seed(*values: int) -> int:
    """One 63-bit generator seed from several integers (splitmix64 finaliser per value).

    Plain sums like ``seed + epoch`` collide across runs (seed 0 epoch 1 = seed 1 epoch 0); this does not
    in practice, and is a pure function of its inputs, so every process derives the same seed."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF
