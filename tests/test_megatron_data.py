"""Megatron's indexed datasets (nxdt/data/megatron.py): the reader against .bin/.idx bytes built here with struct
(independently of nxdt's writer), GPT samples against a plain re-derivation, blending proportions, the .npy index
cache and its freshness, the converter and data_prefix parsing."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from nxdt.cli import main
from nxdt.data.megatron import (
    BlendedMegatronData,
    GPTSamples,
    IndexedDataError,
    blend_index,
    build_sample_index,
    parse_data_prefix,
    read_index,
    train_split_end,
    write_indexed,
)
from nxdt.data.tokenizers import ByteTokenizer

pytestmark = pytest.mark.timeout(60)


def hand_built(prefix, sequences, doc_bounds, code, fmt):
    """The format as Megatron-LM's docs state it, spelled out with struct: magic, <Q version, <B dtype code, <Q sequence
    count, <Q document-index count, <i4 sizes, <i8 byte pointers, <i8 document indices; .bin = the tokens back to back."""
    item = struct.calcsize("<" + fmt)
    body, pointers, at = b"", [], 0
    for seq in sequences:
        pointers.append(at)
        body += struct.pack(f"<{len(seq)}{fmt}", *seq)
        at += item * len(seq)
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sequences), len(doc_bounds))
    idx += struct.pack(f"<{len(sequences)}i", *[len(s) for s in sequences])
    idx += struct.pack(f"<{len(sequences)}q", *pointers)
    idx += struct.pack(f"<{len(doc_bounds)}q", *doc_bounds)
    (prefix.parent / (prefix.name + ".bin")).write_bytes(body)
    (prefix.parent / (prefix.name + ".idx")).write_bytes(idx)
    return idx, body


SEQS = [[5, 6, 7], [8], [9, 10], [70000, 11]]  # document 1 = sequences 1 and 2


@pytest.mark.parametrize("code, fmt, seqs", [(4, "i", SEQS), (8, "H", [[5, 6, 7], [8], [9, 10], [65535, 11]])])
def test_the_reader_reads_hand_built_index_and_tokens(tmp_path, code, fmt, seqs):
    hand_built(tmp_path / "d", seqs, [0, 1, 3, 4], code, fmt)
    data = read_index(tmp_path / "d")
    assert data.dtype == np.dtype({4: "<i4", 8: "<u2"}[code])
    assert data.sizes.tolist() == [len(s) for s in seqs]
    assert data.document_indices.tolist() == [0, 1, 3, 4] and data.num_documents == 3
    assert [data.sequence(i).tolist() for i in range(4)] == seqs
    assert [data.document(d).tolist() for d in range(3)] == [seqs[0], seqs[1] + seqs[2], seqs[3]]
    assert data.document_lengths().tolist() == [len(seqs[0]), len(seqs[1]) + len(seqs[2]), len(seqs[3])]


def test_the_writer_produces_the_same_bytes_as_the_format_spelled_out(tmp_path):
    docs = [[1, 2, 3], [4], [], [65000, 7]]
    idx, body = hand_built(tmp_path / "ref", docs, [0, 1, 2, 3, 4], 8, "H")
    assert write_indexed(tmp_path / "ours", docs, np.uint16) == 4
    assert (tmp_path / "ours.idx").read_bytes() == idx and (tmp_path / "ours.bin").read_bytes() == body


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda idx, b: (b"NOTMAGIC!" + idx[9:], b), "not a Megatron indexed-dataset index (no MMIDIDX header)"),
        (lambda idx, b: (idx[:9] + struct.pack("<Q", 2) + idx[17:], b), "index version 2; nxdt reads version 1"),
        (lambda idx, b: (idx[:17] + bytes([9]) + idx[18:], b), "dtype code 9"),
        (lambda idx, b: (idx[:-8], b), "but its header (4 sequences, 4 document indices) needs"),
        (lambda idx, b: (idx, b[:-4]), "does not hold every sequence"),
        (lambda idx, b: (idx[:-8] + struct.pack("<q", 3), b), "document indices must rise from 0 to the sequence count 4"),
    ],
)
def test_a_damaged_pair_is_refused_with_its_reason(tmp_path, damage, needle):
    idx, body = hand_built(tmp_path / "d", SEQS, [0, 1, 3, 4], 4, "i")
    idx, body = damage(idx, body)
    (tmp_path / "d.idx").write_bytes(idx)
    (tmp_path / "d.bin").write_bytes(body)
    with pytest.raises(IndexedDataError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        read_index(tmp_path / "d")


def test_a_missing_idx_names_the_file(tmp_path):
    (tmp_path / "d.bin").write_bytes(b"")
    with pytest.raises(IndexedDataError, match=r"no d\.idx beside it"):
        read_index(tmp_path / "d")


def test_gpt_samples_are_consecutive_windows_of_the_shuffled_documents():
    lengths = np.array([5, 0, 3, 9, 2])
    seq, n = 4, 9  # 19 tokens per epoch; 9 samples need 37 tokens: two epochs
    order, starts, shuffle = build_sample_index(lengths, n, seq, seed=3)
    assert len(order) == 10 and sorted(order[:5]) == sorted(order[5:]) == list(range(5))  # one permutation per epoch
    assert sorted(shuffle.tolist()) == list(range(n))
    # the stream, built the plain way: (document, offset) of every token, documents in order
    stream = [(int(d), o) for d in order for o in range(lengths[d])]
    for i in range(n):
        pos, off = starts[i]
        assert (int(order[pos]), int(off)) == stream[i * seq]  # sample i starts at token i·seq of the stream
    assert build_sample_index(lengths, n, seq, seed=3)[2].tolist() == shuffle.tolist()  # a pure function of the seed
    assert build_sample_index(lengths, n, seq, seed=4)[0].tolist() != order.tolist()


def test_samples_read_seq_plus_one_tokens_across_document_boundaries(tmp_path):
    docs = [list(range(100 * d, 100 * d + 3 + d)) for d in range(5)]  # token 100·d + k: document d, position k
    write_indexed(tmp_path / "d", docs, np.uint16)
    samples = GPTSamples(read_index(tmp_path / "d"), 6, 4, seed=1, cache_dir=tmp_path / "cache")
    order = samples.order.tolist()
    stream = [t for d in order for t in docs[d]]
    got = {int(samples.shuffle[i]): samples.tokens(i).tolist() for i in range(6)}
    assert got == {j: stream[4 * j : 4 * j + 5] for j in range(6)}  # overlapping by one token: every target once


def test_blending_follows_the_weights_at_every_prefix(tmp_path):
    weights = [0.2, 0.5, 0.3]
    which, local = blend_index(weights, 1000)
    for j, w in enumerate(weights):
        counts = np.cumsum(which == j)
        n = np.arange(1, 1001)
        assert np.all(np.abs(counts - w * n) <= 0.5 + len(weights) * w / 2)  # blend_index's bound
        assert local[which == j].tolist() == list(range(int(counts[-1])))  # each dataset's samples in order, none skipped
    # the samples really come from their dataset: dataset A holds ids < 100, B ids >= 100
    write_indexed(tmp_path / "a", [list(range(0, 50))] * 4, np.uint16)
    write_indexed(tmp_path / "b", [list(range(100, 150))] * 4, np.uint16)
    data = BlendedMegatronData([1, str(tmp_path / "a"), 3, str(tmp_path / "b")], 40, 8, seed=0, index_mapping_dir=tmp_path / "c")
    from_b = [bool(data[i]["input_ids"].min() >= 100) for i in range(40)]
    assert sum(from_b) == 30 and all(bool(data[i]["input_ids"].max() < 100) for i in range(40) if not from_b[i])
    item = data[0]
    assert (
        item["input_ids"].shape == item["labels"].shape == (8,) and item["labels"][:-1].tolist() == item["input_ids"][1:].tolist()
    )


def test_the_index_mapping_is_cached_as_npy_and_rebuilt_when_stale(tmp_path):
    write_indexed(tmp_path / "d", [list(range(20))] * 3, np.uint16)
    cache = tmp_path / "cache"
    first = GPTSamples(read_index(tmp_path / "d"), 10, 4, seed=0, cache_dir=cache)
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 4 and sum(f.endswith(".npy") for f in files) == 3 and files[0].startswith("d_")
    for f in cache.glob("*.npy"):
        assert np.load(f, allow_pickle=False).dtype == np.int64  # plain arrays; never pickle
    stamp = {f: (cache / f).stat().st_mtime_ns for f in files}
    again = GPTSamples(read_index(tmp_path / "d"), 10, 4, seed=0, cache_dir=cache)
    assert {f: (cache / f).stat().st_mtime_ns for f in files} == stamp  # reused, not rewritten
    assert again.shuffle.tolist() == first.shuffle.tolist()
    # another seed or length: another digest, files beside the first set
    GPTSamples(read_index(tmp_path / "d"), 12, 4, seed=0, cache_dir=cache)
    assert len(list(cache.iterdir())) == 8
    # the dataset changes (size, mtime): the cache no longer describes it
    write_indexed(tmp_path / "d", [list(range(30))] * 3, np.uint16)
    changed = GPTSamples(read_index(tmp_path / "d"), 10, 4, seed=0, cache_dir=cache)
    assert len(list(cache.iterdir())) == 12 and changed.starts.shape == (10, 2)
    # a damaged cache file is rebuilt, not trusted
    victim = next(f for f in files if f.endswith("shuffle.npy"))
    (cache / victim).write_bytes(b"garbage")
    write_indexed(tmp_path / "d", [list(range(20))] * 3, np.uint16)
    os.utime(tmp_path / "d.idx", ns=(0, 0))
    os.utime(tmp_path / "d.bin", ns=(0, 0))
    rebuilt = GPTSamples(read_index(tmp_path / "d"), 10, 4, seed=0, cache_dir=cache)
    assert sorted(rebuilt.shuffle.tolist()) == list(range(10))


@pytest.mark.parametrize(
    "kind, tamper",
    [
        ("doc_order", lambda a: a + 1000),  # documents that do not exist
        ("sample_starts", lambda a: a * 0 + [len(a) * 10, 0]),  # positions past the document order
        ("sample_starts", lambda a: a + [0, 10**6]),  # offsets past their document
        ("shuffle", lambda a: a * 0 + 3),  # not a permutation: one sample repeated
        ("doc_order", lambda a: a.astype(np.float64)),  # not integers
    ],
)
def test_a_tampered_index_cache_is_rebuilt_not_used(tmp_path, kind, tamper):
    """A cache anyone with write access to the dataset directory can change: values out of range (shapes kept, the
    description file untouched) used to fail in every worker with an IndexError; now the arrays are rebuilt."""
    write_indexed(tmp_path / "d", [list(range(20))] * 3, np.uint16)
    cache = tmp_path / "cache"
    first = GPTSamples(read_index(tmp_path / "d"), 10, 4, seed=0, cache_dir=cache)
    (victim,) = cache.glob(f"*_{kind}.npy")
    np.save(victim, tamper(np.load(victim)), allow_pickle=False)
    again = GPTSamples(read_index(tmp_path / "d"), 10, 4, seed=0, cache_dir=cache)
    for got, want in zip((again.order, again.starts, again.shuffle), (first.order, first.starts, first.shuffle)):
        assert np.array_equal(got, want)
    assert [len(again.tokens(i)) for i in range(len(again))] == [5] * 10


@pytest.mark.parametrize("kind", ["desc.json", "shuffle.npy", "doc_order.npy"])
@pytest.mark.timeout(60)
def test_a_fifo_in_a_cache_files_place_is_a_cache_miss_not_a_hang(tmp_path, kind):
    """Issue 38: a FIFO planted as a cache file blocked every rank's read of it (no writer ever comes). Now it is a
    cache miss: rebuilt over, at once."""
    write_indexed(tmp_path / "d", [list(range(20))] * 3, np.uint16)
    cache = tmp_path / "cache"
    first = GPTSamples(read_index(tmp_path / "d"), 10, 4, seed=0, cache_dir=cache)
    (victim,) = cache.glob(f"*_{kind}")
    victim.unlink()
    os.mkfifo(victim)
    again = GPTSamples(read_index(tmp_path / "d"), 10, 4, seed=0, cache_dir=cache)
    assert np.array_equal(again.shuffle, first.shuffle) and np.array_equal(again.starts, first.starts)
    assert victim.is_file()  # the rebuilt cache replaced it


def test_splits_string_keeps_the_leading_training_share():
    assert train_split_end(100, "980,10,10") == 98
    assert train_split_end(7, "980,10,10") == 7
    assert train_split_end(10, "8,1,1") == 8 and train_split_end(10, None) == 10


@pytest.mark.parametrize(
    "value, needle",
    [
        ([1.0, "/a", 2.0], "has 3 entries; give pairs"),
        (["x", "/a"], "weight 'x' (before '/a') is not a positive number"),
        ([0, "/a"], "weight 0 (before '/a') is not a positive number"),
        ([1.0, 2.0], "2.0 (after weight 1.0) is not a path prefix"),
        ({"validation": ["/a"]}, "needs a train entry"),
    ],
)
def test_bad_data_prefix_values_are_named(value, needle):
    with pytest.raises(IndexedDataError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_data_prefix(value)


def test_data_prefix_forms():
    assert parse_data_prefix("/a") == parse_data_prefix(["/a"]) == [(1.0, "/a")]
    assert parse_data_prefix({"train": [1, "/a", 3, "/b"]}) == [(0.25, "/a"), (0.75, "/b")]


def test_convert_megatron_writes_jsonl_documents_readable_back(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["héllo", "", "world!"])) + "\n")
    assert main(["data", "convert-megatron", str(src), "--output-prefix", str(tmp_path / "out"), "--eod-id", "0"]) == 0
    assert "3 documents" in capsys.readouterr().out
    data = read_index(tmp_path / "out")
    tok = ByteTokenizer()
    assert [data.document(d).tolist() for d in range(3)] == [tok.encode("héllo") + [0], [0], tok.encode("world!") + [0]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    assert main(["data", "convert-megatron", str(bad), "--output-prefix", str(tmp_path / "o2")]) == 2
    assert "bad.jsonl:1: no string field 'text'" in capsys.readouterr().err


def test_the_data_module_reads_megatron_data_in_index_order_sliced_by_data_parallel_rank(tmp_path):
    """data.source=megatron through NxDDataModule: trainer.max_steps × global batch samples, read in the order of the
    (already shuffled) sample index — no second shuffle — and DP rank r takes its contiguous slice of every global
    batch, so the ranks' micro-batches, concatenated, are the one-rank stream."""
    from types import SimpleNamespace

    import torch

    from nxdt.lightning.datamodule import NxDDataModule

    write_indexed(tmp_path / "d", [list(range(i, i + 37)) for i in range(0, 150, 10)], np.uint16)
    cfg = SimpleNamespace(
        source="megatron",
        micro_batch_size=2,
        global_batch_size=8,
        seq_length=16,
        data_prefix=[1.0, str(tmp_path / "d")],
        splits_string=None,
        index_mapping_dir=str(tmp_path / "c"),
        train_dir=None,
        val_dir=None,
        val_split=0.0,
    )

    def module(rank: int, dp: int) -> NxDDataModule:
        dm = NxDDataModule(cfg, seed=5, vocab_size=256)
        dm.trainer = SimpleNamespace(
            strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank}),
            global_step=0,
            accumulate_grad_batches=4 // dp,
            max_steps=3,
        )
        dm.setup("fit")
        return dm

    single = module(0, 1)
    assert len(single.dataset) == 3 * 8
    it = iter(single.train_dataloader())
    stream = [next(it)["input_ids"] for _ in range(12)]  # three global batches of 4 micro-batches
    assert torch.equal(torch.cat(stream), torch.stack([single.dataset[i]["input_ids"] for i in range(24)]))
    for step in range(3):
        got = []
        for rank in range(2):
            it = iter(module(rank, 2).train_dataloader())
            batches = [next(it)["input_ids"] for _ in range(2 * (step + 1))]
            got += batches[2 * step :]
        assert torch.equal(torch.cat(got), torch.cat(stream[4 * step : 4 * step + 4]))
