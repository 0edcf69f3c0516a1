"""Supervised fine-tuning wired end to end (issue 17): instruction records → masked, packed batches → the SFT loss
(a token mean over the whole global batch), validation over a whole set, starting from another run's weights.

In-process: the loss against a hand-computed masked cross-entropy, packed against padded batches of the same
records, the token weights, the validation sampler. The launched runs (slow) are in test_sft_e2e.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from models.llama import LlamaForCausalLM
from nxdt.data import SAMPLE_INSTRUCTIONS
from nxdt.data.instructions import IGNORE_INDEX, build_sft_examples, byte_chat_tokenizer, read_instruction_records
from nxdt.data.sampler import EvalBatchSampler, PadRows
from nxdt.lightning.module import split_micro_batches
from nxdt.lightning.objective import CAUSAL_LM, label_count, token_weights

SEQ = 64


def _model(vocab_size: int = 256, positions: int = SEQ) -> LlamaForCausalLM:
    """A seeded fp64 tiny Llama (sdpa): the SFT tests' model (test_sft_concat_packing.py takes it too)."""
    torch.manual_seed(0)
    cfg = SimpleNamespace(
        vocab_size=vocab_size,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        max_position_embeddings=positions,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
        core_attention="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _records(n: int = 12) -> list[dict]:
    return read_instruction_records(SAMPLE_INSTRUCTIONS, limit=n)


def _step_loss(model, batch: dict, micro_batch_size: int, dp_size: int = 1, global_count: int | None = None) -> torch.Tensor:
    """What CausalLMModule's step computes on one rank: the mean over micro-batches of each micro-batch's token-mean
    loss scaled by its token weight."""
    mbs = split_micro_batches(batch, micro_batch_size)
    counts = [label_count(mb["labels"]) for mb in mbs]
    weights = token_weights(counts, sum(counts) if global_count is None else global_count, dp_size)
    losses = [CAUSAL_LM.loss(model, model(mb["input_ids"], mb["position_ids"], mb["segment_ids"]), mb) for mb in mbs]
    return sum(w * loss for w, loss in zip(weights, losses)) / len(mbs)


def _hand_masked_cross_entropy(model, batch: dict) -> float:
    """−(1/N) Σ log p(label) over the labelled positions, one row at a time, each row's records run one by one
    (no packing), in float64 from the logits: independent of the packing, the weights and the loss function."""
    total, count = 0.0, 0
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in range(1, int(seg.max()) + 1):
            where = seg == s
            ids, labels = batch["input_ids"][r][where], batch["labels"][r][where]
            logits = model(ids[None])[0].double()
            logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
            for t in range(len(labels)):
                if labels[t] != IGNORE_INDEX:
                    total -= float(logp[t, labels[t]])
                    count += 1
    return total / count


def test_the_sft_loss_is_the_masked_cross_entropy_over_every_labelled_token_of_the_batch():
    model = _model()
    batch, stats = build_sft_examples(_records(), byte_chat_tokenizer(), SEQ, packing=True)
    assert batch["input_ids"].shape[0] >= 3 and stats.label_tokens == label_count(batch["labels"])
    with torch.no_grad():
        got = float(_step_loss(model, batch, micro_batch_size=1))  # micro-batches of unequal label counts
        want = _hand_masked_cross_entropy(model, batch)
    # fp32 forward against float64 softmax of the same fp32 logits, ~5 nats summed over a few hundred tokens:
    # the difference is the fp32 rounding of the means (~1e-7 relative), so 1e-5 relative has ample room
    assert got == pytest.approx(want, rel=1e-5)
    # a mean of per-micro-batch means would differ: the weighting is what makes it the token mean
    mbs = split_micro_batches(batch, 1)
    with torch.no_grad():
        mean_of_means = sum(
            float(model.loss_fn(model(mb["input_ids"], mb["position_ids"], mb["segment_ids"]), mb["labels"])) for mb in mbs
        ) / len(mbs)
    assert abs(mean_of_means - want) > 1e-4


def test_prompt_tokens_and_padding_carry_no_label():
    records = _records(3)
    batch, _ = build_sft_examples(records, byte_chat_tokenizer(), SEQ, packing=False)
    for r, record in enumerate(records):
        labelled = batch["labels"][r][batch["labels"][r] != IGNORE_INDEX].tolist()
        assert bytes(labelled[:-1]).decode() == record["output"] and labelled[-1] == 0  # the response, then EOS
    assert (batch["labels"][batch["segment_ids"] == 0] == IGNORE_INDEX).all()


def test_packed_and_padded_batches_of_the_same_records_give_the_same_per_record_losses():
    model = _model()
    records = _records(9)
    tok = byte_chat_tokenizer()
    packed, _ = build_sft_examples(records, tok, SEQ, packing=True)
    padded, _ = build_sft_examples(records, tok, SEQ, packing=False)
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0] == len(records)

    def per_record(batch):
        with torch.no_grad():
            logits = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        logp = torch.log_softmax(logits.float(), -1)
        out = []
        for r in range(batch["input_ids"].shape[0]):
            for s in range(1, int(batch["segment_ids"][r].max()) + 1):
                labels = batch["labels"][r][batch["segment_ids"][r] == s]
                rows = logp[r][batch["segment_ids"][r] == s]
                keep = labels != IGNORE_INDEX
                out.append(-rows[keep].gather(-1, labels[keep][:, None]).mean())
        return torch.stack(out)

    # the same record's logits in a packed row and alone differ only by the rounding of attention over other key
    # counts (sdpa's blocked kernel): ~1e-7 relative on O(5) losses
    torch.testing.assert_close(per_record(packed), per_record(padded), rtol=1e-5, atol=1e-6)


def test_token_weights_make_the_mean_over_micro_batches_and_ranks_the_global_token_mean():
    # rank 0 holds micro-batches with 3 and 5 labels, rank 1 with 0 and 8: 16 in all
    w0, w1 = token_weights([3, 5], 16, 2), token_weights([0, 8], 16, 2)
    assert w0 == [0.75, 1.25] and w1 == [0.0, 2.0]
    means = [[1.0, 2.0], [7.0, 4.0]]  # token means of each micro-batch
    ranks = [sum(w * m for w, m in zip(ws, ms)) / 2 for ws, ms in ((w0, means[0]), (w1, means[1]))]
    assert sum(ranks) / 2 == (3 * 1.0 + 5 * 2.0 + 8 * 4.0) / 16  # the DP mean of the step losses
    assert token_weights([4, 4], 16, 2) == [1.0, 1.0]  # every position labelled: nothing changes
    assert token_weights([0, 0], 0, 1) == [0.0, 0.0]


def test_objectives_by_recipe():
    from nxdt.lightning.registry import objective_spec

    def spec(**blocks):
        alignment = SimpleNamespace(**{"sft": None, "peft": None, "dpo": None, "orpo": None, "grpo": None, **blocks})
        chosen = objective_spec(SimpleNamespace(model_alignment_strategy=alignment))
        return chosen.objective(chosen.block(SimpleNamespace(model_alignment_strategy=alignment)))

    assert spec() is CAUSAL_LM
    assert spec(sft=object()) is CAUSAL_LM
    dpo = spec(dpo=SimpleNamespace(kl_beta=0.1, loss_type="sigmoid"))
    assert (dpo.name, dpo.pairs, dpo.reference, dpo.token_weighted) == ("dpo", True, True, False)
    orpo = spec(orpo=SimpleNamespace(beta=0.1, nll_mean="tokens"))
    assert (orpo.name, orpo.pairs, orpo.reference, orpo.token_weighted) == ("orpo", True, False, False)
    assert orpo.token_metric == "nll_loss"  # TRL's NLL: a token mean over the global batch (tests/test_orpo.py)
    nxdt_orpo = spec(orpo=SimpleNamespace(beta=0.1, nll_mean="sequences"))
    assert nxdt_orpo.token_metric is None  # NxD Training's: a mean over pairs
    with pytest.raises(ValueError, match="nll_mean='mean'"):
        spec(orpo=SimpleNamespace(beta=0.1, nll_mean="mean"))
    with pytest.raises(ValueError, match=r"loss_type \['hinj'\]: each must be one of sigmoid, hinge"):
        spec(dpo=SimpleNamespace(kl_beta=0.1, loss_type="hinj"))
    ipo = spec(dpo=SimpleNamespace(kl_beta=0.1, loss_type=["ipo", "sft"]))  # TRL's types; sft: a token mean
    assert ipo.token_metric == "sft_loss" and ipo.metrics[-2:] == ("sft_loss", "aux_loss")


@pytest.mark.parametrize("n, dp", [(10, 1), (10, 2), (7, 2), (12, 4)])
def test_validation_batches_cover_every_sample_once_whatever_the_data_parallel_degree(n, dp):
    batch = 4
    seen = []
    for rank in range(dp):
        batches = list(EvalBatchSampler(n, batch, rank, dp))
        assert len(batches) == math.ceil(n / batch) and all(len(b) == batch // dp for b in batches)
        seen += [i for b in batches for i in b if i >= 0]
    assert sorted(seen) == list(range(n))
    assert len(EvalBatchSampler(n, batch, 0, dp, num_batches=1)) == 1
    ds = PadRows([{"input_ids": torch.ones(3, dtype=torch.long), "labels": torch.ones(3, dtype=torch.long)}])
    assert ds[-1]["labels"].tolist() == [IGNORE_INDEX] * 3 and ds[-1]["input_ids"].tolist() == [0, 0, 0]


def test_the_sft_recipe_composes_onto_nxdts_config_tree():
    from nxdt.config import compose_config
    from nxdt.config.validate import check_trainable

    cfg = compose_config(["+recipe=sft", "model_alignment_strategy.sft.packing=false"])
    check_trainable(cfg)
    assert (cfg.data.source, cfg.data.train_dir, cfg.model_alignment_strategy.sft.packing) == ("instructions", None, False)
    assert cfg.model_alignment_strategy.dpo is None and cfg.model_alignment_strategy.peft is None


@pytest.mark.parametrize("limit, batches", [(1.0, 4), (0.5, 2), (0.1, 1), (0.0, 0), (3, 3), (10, 4)])
def test_limit_val_batches_counts_global_validation_batches(limit, batches):
    from nxdt.lightning.datamodule import NxDDataModule

    cfg = SimpleNamespace(
        source="synthetic",
        micro_batch_size=2,
        global_batch_size=8,
        seq_length=16,
        train_dir=None,
        tokenizer=None,
        num_samples=40,
        val_dir=None,
    )
    dm = NxDDataModule(cfg, seed=0, vocab_size=64, limit_val_batches=limit)
    dm.val_dataset = list(range(30))  # 30 samples: 4 global batches of 8, the last one padded
    assert dm.validation_batches() == batches
    dm.val_dataset = None
    assert dm.validation_batches() == 0


def test_instruction_records_read_from_jsonl_files_a_directory_and_a_save_to_disk_directory(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import json

    import pyarrow.ipc

    records = _records(7)
    saved = tmp_path / "saved"  # the layout Dataset.save_to_disk writes: state.json + Arrow stream shards
    saved.mkdir()
    table = pa.Table.from_pylist(records)
    for name, part in (("data-00000-of-00002.arrow", table.slice(0, 4)), ("data-00001-of-00002.arrow", table.slice(4))):
        with pa.OSFile(str(saved / name), "wb") as sink, pyarrow.ipc.new_stream(sink, part.schema) as writer:
            writer.write_table(part)
    (saved / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"}, {"filename": "data-00001-of-00002.arrow"}]})
    )
    assert read_instruction_records(saved) == records
    assert read_instruction_records(saved, limit=5) == records[:5]  # data.dev_choose_samples, across shards
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    (jsonl / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    (jsonl / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[3:]))
    assert read_instruction_records(jsonl) == records and read_instruction_records(jsonl, limit=4) == records[:4]
    with pytest.raises(ValueError, match="no \\*.jsonl files"):
        read_instruction_records(tmp_path)  # neither JSON lines nor a saved dataset


def test_val_split_holds_out_the_last_samples_and_never_trains_on_them():
    from nxdt.lightning.datamodule import NxDDataModule, hold_out

    train, val = hold_out(list(range(10)), 0.25)
    assert list(train) == list(range(7)) and list(val) == [7, 8, 9]
    assert hold_out(list(range(10)), 0.0)[1] is None
    with pytest.raises(ValueError, match="nothing to train on"):
        hold_out([0], 0.5)
    cfg = SimpleNamespace(
        source="synthetic",
        micro_batch_size=2,
        global_batch_size=8,
        seq_length=16,
        train_dir=None,
        tokenizer=None,
        num_samples=40,
        val_dir=None,
        val_split=0.1,
    )
    dm = NxDDataModule(cfg, seed=0, vocab_size=64)
    dm.setup("fit")
    assert (len(dm.dataset), len(dm.val_dataset), dm.validation_batches()) == (36, 4, 1)
    batch = next(iter(dm.val_dataloader()))
    assert torch.equal(batch["input_ids"][:4], torch.stack([dm.dataset.dataset[i]["input_ids"] for i in range(36, 40)]))
    assert (batch["labels"][4:] == IGNORE_INDEX).all()  # the rest of the global batch is padding
