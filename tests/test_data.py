"""nxdt.data: tokenizers, the synthetic and packed-text datasets, the shipped sample text, and the
global-batch sampler (data-parallel slices equal the single-rank batch; exact resume)."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

import nxdt.data.datasets as datasets
from nxdt.data import SAMPLE_TEXT, mix_seed
from nxdt.data.datasets import PackedText, SyntheticTokens
from nxdt.data.sampler import GlobalBatchSampler
from nxdt.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer


# --- tokenizers ------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8():
    tok = build_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    text = "Mr. Darcy — naïve 日本\n"
    ids = tok.encode(text)
    assert ids[:3] == [77, 114, 46] and all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert "\ufffd" in tok.decode(ids[:-2][:-1])  # a cut multi-byte character is shown, not an error


def test_hf_tokenizer_missing_file_and_missing_package_are_clear(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        build_tokenizer(tmp_path / "nope.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(RuntimeError, match="pip install tokenizers"):
        HFTokenizer(tmp_path)


def test_hf_tokenizer_reads_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "\n": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(tmp_path / "tokenizer.json")
    assert hf.vocab_size == 5 and hf.encode("the cat sat dog") == [1, 2, 3, 0]
    assert build_tokenizer(tmp_path).encode("cat") == [2]  # a model directory works too
    (tmp_path / "text.txt").write_text("the cat sat\n" * 40)
    data = PackedText(tmp_path / "text.txt", hf, seq_length=4)
    assert data.tokens.dtype == torch.uint8 and len(data) == (120 - 1) // 4
    assert data[0]["input_ids"].tolist() == [1, 2, 3, 1]


# --- synthetic -------------------------------------------------------------------------------------


def test_synthetic_tokens_are_deterministic_order_independent_and_follow_the_chain():
    a = SyntheticTokens(num_samples=50, seq_length=32, vocab_size=100, seed=3)
    b = SyntheticTokens(num_samples=50, seq_length=32, vocab_size=100, seed=3)
    forward = [a[i] for i in range(50)]
    for i in reversed(range(50)):  # another object, another order: same samples
        assert torch.equal(b[i]["input_ids"], forward[i]["input_ids"]) and torch.equal(b[i]["labels"], forward[i]["labels"])
    s = forward[7]
    assert s["input_ids"].shape == s["labels"].shape == (32,) and s["input_ids"].dtype == torch.long
    assert torch.equal(s["input_ids"][1:], s["labels"][:-1])  # labels are the next tokens
    for prev, nxt in zip(s["input_ids"].tolist(), s["labels"].tolist()):
        assert nxt in a.successors[prev]  # learnable structure: only table transitions occur
    assert int(s["labels"].max()) < 100
    other = SyntheticTokens(num_samples=50, seq_length=32, vocab_size=100, seed=4)
    assert not torch.equal(other[7]["input_ids"], s["input_ids"])
    assert not torch.equal(forward[0]["input_ids"], forward[1]["input_ids"])
    with pytest.raises(IndexError):
        a[50]


# --- packed text -----------------------------------------------------------------------------------


def test_packed_text_windows_tile_the_text(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(103))
    (tmp_path / "t.txt").write_text(text)
    data = PackedText(tmp_path / "t.txt", ByteTokenizer(), seq_length=10)
    assert len(data) == 10  # (103 - 1) // 10
    raw = list(text.encode())
    inputs = torch.cat([data[i]["input_ids"] for i in range(len(data))]).tolist()
    labels = torch.cat([data[i]["labels"] for i in range(len(data))]).tolist()
    assert inputs == raw[:100] and labels == raw[1:101]  # every token predicted exactly once, in order
    assert data[3]["input_ids"].dtype == torch.long and data[3]["input_ids"].shape == (10,)
    with pytest.raises(IndexError):
        data[10]


def test_packed_text_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        PackedText(tmp_path / "missing.txt", ByteTokenizer(), 8)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        PackedText(tmp_path / "empty.txt", ByteTokenizer(), 8)
    (tmp_path / "short.txt").write_text("12345678")
    with pytest.raises(ValueError, match="short.txt has 8 tokens, too short"):
        PackedText(tmp_path / "short.txt", ByteTokenizer(), 8)
    assert len(PackedText(tmp_path / "short.txt", ByteTokenizer(), 7)) == 1
    (tmp_path / "binary.txt").write_bytes(b"abc\xff\xfe")
    with pytest.raises(ValueError, match="binary.txt is not UTF-8"):
        PackedText(tmp_path / "binary.txt", ByteTokenizer(), 2)
    (tmp_path / "nodata").mkdir()
    with pytest.raises(FileNotFoundError, match="nodata holds no"):
        PackedText(tmp_path / "nodata", ByteTokenizer(), 2)


def test_packed_text_reads_a_directory_of_txt_files_in_order(tmp_path):
    (tmp_path / "b.txt").write_text("BBBB")
    (tmp_path / "a.txt").write_text("AAAA")
    (tmp_path / "ignored.md").write_text("XXXX")
    data = PackedText(tmp_path, ByteTokenizer(), seq_length=7)
    assert ByteTokenizer().decode(data.tokens.tolist()) == "AAAABBBB"


class WideByteTokenizer:
    """Byte ids in a vocabulary too big for uint8: takes the chunked path that subword tokenizers take."""

    vocab_size = 1000
    cache_key = ("wide-bytes",)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def test_chunked_tokenization_equals_whole_file_tokenization(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "_CHUNK_CHARS", 7)  # many chunks, lines longer than a chunk, a carry at the end
    text = "It is a truth universally acknowledged,\r\nthat a single man\n\nné à Paris — 1813\nno newline at end"
    (tmp_path / "t.txt").write_text(text, encoding="utf-8", newline="")
    data = PackedText(tmp_path / "t.txt", WideByteTokenizer(), seq_length=5)
    assert data.tokens.dtype == torch.int16
    assert data.tokens.tolist() == list(text.encode("utf-8"))
    fast = PackedText(tmp_path / "t.txt", ByteTokenizer(), seq_length=5)  # the byte fast path agrees
    assert fast.tokens.tolist() == data.tokens.tolist()


def test_tokenized_text_is_cached_per_file_version(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world, " * 10)
    first = PackedText(path, ByteTokenizer(), 8)
    assert PackedText(path, ByteTokenizer(), 16).tokens is first.tokens
    path.write_text("changed text " * 20)
    assert PackedText(path, ByteTokenizer(), 8).tokens is not first.tokens


def test_shipped_sample_text_is_small_real_prose_and_documented():
    size = SAMPLE_TEXT.stat().st_size
    assert 100_000 < size <= 1_000_000
    text = SAMPLE_TEXT.read_text(encoding="utf-8")
    assert "It is a truth universally acknowledged" in text and "Gutenberg" not in text
    readme = (SAMPLE_TEXT.parent / "README.md").read_text()
    assert SAMPLE_TEXT.name in readme and "public domain" in readme
    data = PackedText(SAMPLE_TEXT, ByteTokenizer(), 128)
    assert len(data) > 5000


# --- sampler ---------------------------------------------------------------------------------------


def steps(sampler: GlobalBatchSampler, n_steps: int) -> list[list[int]]:
    """The samples a rank sees in each of the first n optimizer steps (its micro-batches concatenated)."""
    it = iter(sampler)
    per_step = sampler.micro_batches_per_step
    return [sum((next(it) for _ in range(per_step)), []) for _ in range(n_steps)]


@pytest.mark.parametrize("dp_size,micro", [(2, 2), (4, 1), (2, 4), (8, 1)])
def test_data_parallel_ranks_together_see_the_single_rank_batch_in_order(dp_size, micro):
    kw = dict(num_samples=37, global_batch_size=8, seed=11)  # 37: batches straddle epoch boundaries
    single = steps(GlobalBatchSampler(micro_batch_size=micro, dp_rank=0, dp_size=1, **kw), 12)
    ranks = [steps(GlobalBatchSampler(micro_batch_size=micro, dp_rank=r, dp_size=dp_size, **kw), 12) for r in range(dp_size)]
    for k in range(12):
        assert sum((ranks[r][k] for r in range(dp_size)), []) == single[k]
        assert all(len(ranks[r][k]) == 8 // dp_size for r in range(dp_size))


def test_micro_batches_have_the_micro_batch_size():
    sampler = GlobalBatchSampler(num_samples=100, global_batch_size=12, micro_batch_size=3, dp_rank=1, dp_size=2)
    assert sampler.micro_batches_per_step == 2
    batches = list(itertools.islice(iter(sampler), 10))
    assert all(len(b) == 3 for b in batches)


@pytest.mark.parametrize("dp_rank,dp_size", [(0, 1), (1, 2)])
def test_resume_from_consumed_samples_continues_exactly(dp_rank, dp_size):
    kw = dict(num_samples=29, global_batch_size=8, micro_batch_size=2, dp_rank=dp_rank, dp_size=dp_size, seed=5)
    full = steps(GlobalBatchSampler(**kw), 10)
    for k in (1, 3, 4, 7):
        assert steps(GlobalBatchSampler(consumed_samples=k * 8, **kw), 10 - k) == full[k:]


@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_resume_with_another_global_batch_size_continues_the_stream_where_it_stopped(dp_size):
    """5 steps of 4 samples consumed 20; resumed with batches of 8 (20 is no multiple of 8), the stream goes on at
    position 20: no sample skipped or repeated (the sampler raised before: consumed_samples % 8 != 0)."""
    kw = dict(num_samples=29, micro_batch_size=2, dp_size=dp_size, seed=5)
    stream = sum(
        steps(GlobalBatchSampler(global_batch_size=4, dp_rank=0, dp_size=1, micro_batch_size=2, num_samples=29, seed=5), 12), []
    )
    resumed = [steps(GlobalBatchSampler(global_batch_size=8, consumed_samples=20, dp_rank=r, **kw), 3) for r in range(dp_size)]
    for k in range(3):
        assert sum((resumed[r][k] for r in range(dp_size)), []) == stream[20 + 8 * k : 28 + 8 * k]


def test_each_epoch_is_a_fresh_seeded_permutation():
    n = 20
    sampler = GlobalBatchSampler(num_samples=n, global_batch_size=4, micro_batch_size=4, seed=1)
    stream = sum(steps(sampler, 3 * n // 4), [])  # three epochs, back to back
    epochs = [stream[i * n : (i + 1) * n] for i in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(n))
    other_seed = sum(steps(GlobalBatchSampler(num_samples=n, global_batch_size=4, micro_batch_size=4, seed=2), 5), [])
    assert other_seed != epochs[0]
    in_order = GlobalBatchSampler(num_samples=n, global_batch_size=4, micro_batch_size=2, shuffle=False)
    assert sum(steps(in_order, 6), []) == list(range(n)) + list(range(4))
    # in order, an epoch is its whole global batches (NxDT's drop_last): 22 samples, batches of 4 → 0..19, then 0..
    in_order = GlobalBatchSampler(num_samples=22, global_batch_size=4, micro_batch_size=2, shuffle=False)
    assert sum(steps(in_order, 6), []) == list(range(20)) + list(range(4))
    # fewer samples than a global batch: the stream runs on through them (no whole batch to keep)
    small = GlobalBatchSampler(num_samples=3, global_batch_size=4, micro_batch_size=4, shuffle=False)
    assert steps(small, 2) == [[0, 1, 2, 0], [1, 2, 0, 1]]


def test_sampler_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="divisible by micro_batch_size × DP"):
        GlobalBatchSampler(num_samples=10, global_batch_size=6, micro_batch_size=2, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank=2"):
        GlobalBatchSampler(num_samples=10, global_batch_size=8, micro_batch_size=2, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="consumed_samples=-4"):
        GlobalBatchSampler(num_samples=10, global_batch_size=8, micro_batch_size=2, consumed_samples=-4)
    with pytest.raises(ValueError, match="empty"):
        GlobalBatchSampler(num_samples=0, global_batch_size=8, micro_batch_size=2)


def test_sampler_is_explicitly_unsized():
    # Infinite by design (training ends at max_steps): Lightning must see an unsized loader.
    sampler = GlobalBatchSampler(num_samples=10, global_batch_size=4, micro_batch_size=2)
    with pytest.raises(TypeError):
        len(sampler)


def test_mix_seed_is_stable_and_separates_nearby_inputs():
    assert mix_seed(0, 1) == mix_seed(0, 1)
    assert len({mix_seed(s, e) for s in range(20) for e in range(20)}) == 400
    assert 0 <= mix_seed(-5, 2**70) < 2**63
