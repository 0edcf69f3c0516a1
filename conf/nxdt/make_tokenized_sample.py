"""Regenerates tokenized_sample/: a tiny tokenized corpus in the layout NxDT's data.train_dir expects,
written by the real ``datasets`` library (``Dataset.save_to_disk``), so the reader is tested against
that library's own output. Byte-level token ids (< 256) of nxdt's sample text, 96 rows of 33 tokens
(``input_ids``, ``attention_mask``, ``labels`` = input_ids, as NxD's tokenize-and-group recipe writes).

Not run by the tests (``datasets`` is not a dependency): ``pip install datasets`` and run it from here.
"""

from pathlib import Path

import datasets

SAMPLE_TEXT = Path(__file__).resolve().parents[2] / "nxdt" / "data" / "samples" / "austen_pride_and_prejudice.txt"
ROW, ROWS = 33, 96
ids = list(Path(SAMPLE_TEXT).read_bytes()[: ROW * ROWS])
rows = [ids[i * ROW : (i + 1) * ROW] for i in range(ROWS)]
features = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "attention_mask": datasets.Sequence(datasets.Value("int8")),
        "labels": datasets.Sequence(datasets.Value("int64")),
    }
)
ds = datasets.Dataset.from_dict(
    {"input_ids": rows, "attention_mask": [[1] * ROW for _ in rows], "labels": rows}, features=features
)
ds.save_to_disk(str(Path(__file__).parent / "tokenized_sample"))
