"""The Llama model and the data pipeline (pure, no processes)."""

import pytest
import torch

from nxdt.config import compose_config
from nxdt.data import SAMPLE_TEXT
from nxdt.data.datasets import PackedText, SyntheticTokens
from nxdt.data.sampler import GlobalBatchSampler
from nxdt.data.tokenizers import ByteTokenizer
from nxdt.models.llama import LlamaForCausalLM


def tiny(**changes):
    cfg = compose_config(["model=llama_tiny"]).model
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


def test_shapes_gqa_and_tied_embeddings():
    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny(num_kv_heads=1))
    assert m(torch.randint(0, 256, (2, 16))).shape == (2, 16, 256)
    tied = LlamaForCausalLM(tiny(tie_word_embeddings=True))
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()
    assert tied.num_parameters() < m.num_parameters() + 256 * 128


def test_causal():
    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny()).eval()
    x = torch.randint(0, 256, (1, 20))
    y = x.clone()
    y[0, 12] = (y[0, 12] + 1) % 256
    a, b = m(x), m(y)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6) and not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_checkpointing_matches(granularity):
    x = torch.randint(0, 256, (2, 32))
    grads = []
    for g in (None, granularity):
        torch.manual_seed(0)
        m = LlamaForCausalLM(tiny(activations_checkpoint_granularity=g))
        loss = m.loss_fn(m(x), x)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    assert torch.allclose(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, atol=1e-6)


def test_same_seed_same_weights_and_it_learns():
    torch.manual_seed(0)
    a = LlamaForCausalLM(tiny())
    torch.manual_seed(0)
    b = LlamaForCausalLM(tiny())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    data = SyntheticTokens(8, 32, 256, seed=1)
    batch = torch.stack([data[i]["input_ids"] for i in range(8)]), torch.stack([data[i]["labels"] for i in range(8)])
    opt = torch.optim.AdamW(a.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        loss = a.loss_fn(a(batch[0]), batch[1])
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_tokenizer_and_packed_text(tmp_path):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo ∑")) == "héllo ∑"
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 3)
    ds = PackedText(path, tok, seq_length=8)
    assert len(ds) == 3
    assert torch.equal(ds[1]["labels"][:-1], ds[1]["input_ids"][1:])
    with pytest.raises(FileNotFoundError, match="no such file"):
        PackedText(tmp_path / "missing.txt", tok, 8)
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(ValueError, match="too short"):
        PackedText(tmp_path / "short.txt", tok, 8)
    assert SAMPLE_TEXT.stat().st_size <= 1 << 20 and len(tok.encode(SAMPLE_TEXT.read_text())) > 100_000


def test_synthetic_is_deterministic_per_index():
    a, b = SyntheticTokens(100, 16, 50, seed=3), SyntheticTokens(100, 16, 50, seed=3)
    assert torch.equal(a[7]["input_ids"], b[7]["input_ids"])
    _ = a[99]
    assert torch.equal(a[7]["input_ids"], b[7]["input_ids"])  # independent of access order
    assert torch.equal(a[7]["labels"][:-1], a[7]["input_ids"][1:])


def _steps(sampler, n_steps, micro_per_step):
    it = iter(sampler)
    return [[i for _ in range(micro_per_step) for i in next(it)] for _ in range(n_steps)]


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_shards_concatenate_to_the_single_rank_batch(dp):
    single = _steps(GlobalBatchSampler(50, 8, 2, seed=5), 10, 4)
    shards = [_steps(GlobalBatchSampler(50, 8, 2, dp_rank=r, dp_size=dp, seed=5), 10, 4 // dp) for r in range(dp)]
    for step in range(10):  # 10 steps × 8 = 80 > 50 samples: crosses an epoch boundary too
        assert sum((s[step] for s in shards), []) == single[step]


def test_resume_continues_the_stream_exactly():
    full = _steps(GlobalBatchSampler(30, 6, 3, seed=2), 8, 2)
    resumed = _steps(GlobalBatchSampler(30, 6, 3, consumed_samples=5 * 6, seed=2), 3, 2)
    assert resumed == full[5:]


def test_sampler_rejects_bad_batches():
    with pytest.raises(ValueError, match="divisible"):
        GlobalBatchSampler(10, 6, 4)
    with pytest.raises(ValueError, match="dp_rank"):
        GlobalBatchSampler(10, 8, 2, dp_rank=2, dp_size=2)
