"""NxD Training's packed SFT layout one config value away: ``model_alignment_strategy.sft.packing_style=concat``.

The expected rows are written by hand from NxD Training's source, not from nxdt's code:
``lightning_modules/data/datasets/ConcatDataset.py`` (``pack_datasets``, lines 51-70: each record's input_ids + one
separator, EOS in input_ids and -100 in labels; a record joins while ``used + len < chunk_size``; a record longer
than ``chunk_size - 1`` is skipped and closes the row; rows padded to chunk_size), ``model_alignment_data_module.py``
(``_tokenize_and_modify_for_SFT``: a record is BOS + input + output + EOS; ``pad_id_map`` labels -100), and
``models/hf_models/modeling_llama.py`` (``LlamaForCausalLM.forward``: plain causal attention, the attention mask
unused, positions 0..S-1, loss on ``logits[..., :-1]`` against ``labels[..., 1:]``).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from models.llama import LlamaForCausalLM
from nxdt.config import ConfigError, compose_config
from nxdt.config.nxdt_compat import flatten, translate
from nxdt.config.validate import validate
from nxdt.data.instructions import ChatTokenizer, build_sft_examples
from nxdt.lightning.objective import CAUSAL_LM
from test_sft import _model as sft_model

BOS, EOS, PAD = 1, 2, 3
S = 12  # data.seq_length = ConcatDataset's chunk_size
TOK = ChatTokenizer(encode=lambda text: list(text.encode()), eos_id=EOS, pad_id=PAD, bos_id=BOS)
NL = ord("\n")


def _io(inp: str, out: str) -> dict:
    return {"input": inp, "output": out}


# each record's tokens under the plain template: BOS + input + "\n" + output + EOS
A = [BOS, ord("a"), NL, ord("b"), EOS]  # 5 tokens
C = [BOS, *b"xxxxxxxx", NL, ord("y"), EOS]  # 12 tokens = chunk_size: longer than chunk_size - 1, skipped
B = [BOS, ord("c"), NL, ord("d"), EOS]
D = [BOS, ord("e"), NL, ord("f"), EOS]
F11 = [BOS, *b"uvwxyzq", NL, ord("k"), EOS]  # 11 tokens = chunk_size - 1: fits alone with its separator
E = [BOS, ord("g"), NL, ord("h"), EOS]
RECORDS = [_io("a", "b"), _io("x" * 8, "y"), _io("c", "d"), _io("e", "f"), _io("uvwxyzq", "k"), _io("g", "h")]

X = -100
# NxDT's rows before its model shifts the labels (input_ids pad: the tokenizer's pad id; labels pad: -100):
# row 1: A + sep (6), then C does not fit (6 + 12 ≥ 12) and is too long for any row: skipped, the row closes
#        although B would have fitted;
# row 2: B + sep, D + sep (6 + 5 < 12), full; F11 does not fit after it (12 + 11 ≥ 12) but is not too long;
# row 3: F11 + sep (0 + 11 < 12), full; row 4: E + sep, padded.
NXDT_IDS = [
    A + [EOS] + [PAD] * 6,
    B + [EOS] + D + [EOS],
    F11 + [EOS],
    E + [EOS] + [PAD] * 6,
]
NXDT_LABELS = [  # labels = input_ids (prompts trained), the separator's label -100
    A + [X] + [X] * 6,
    B + [X] + D + [X],
    F11 + [X],
    E + [X] + [X] * 6,
]


def _shifted(labels: list[int]) -> list[int]:
    """nxdt's shift convention for NxDT's labels: position t is scored against labels[t + 1] (NxDT's model pairs
    logits[..., :-1] with labels[..., 1:]); the last position has no label."""
    return labels[1:] + [X]


def test_concat_style_reproduces_concat_datasets_rows():
    batch, stats = build_sft_examples(RECORDS, TOK, S, packing=True, packing_style="concat")
    assert batch["input_ids"].tolist() == NXDT_IDS
    assert batch["labels"].tolist() == [_shifted(row) for row in NXDT_LABELS]
    assert batch["position_ids"].tolist() == [list(range(S))] * 4  # along the whole row, as NxDT's model numbers them
    real = [6, 12, 12, 6]  # records and separators: one causal stream per row; padding 0
    assert batch["segment_ids"].tolist() == [[1] * n + [0] * (S - n) for n in real]
    # every record counted: 5 kept, C dropped (too long), nothing truncated
    assert (stats.records, stats.examples, stats.dropped, stats.truncated, stats.sequences) == (6, 5, 1, 0, 4)
    # the separator position predicts the next record's BOS; the record's own EOS predicts nothing (the sep's -100)
    assert batch["labels"][1, 4].item() == X and batch["labels"][1, 5].item() == BOS


def _model() -> LlamaForCausalLM:
    return sft_model(vocab_size=128, positions=S).double()


def test_the_loss_the_model_sees_is_plain_causal_with_nxdts_shift():
    model = _model()
    batch, _ = build_sft_examples(RECORDS, TOK, S, packing=True, packing_style="concat")
    with torch.no_grad():
        ours = CAUSAL_LM.loss(model, model(batch["input_ids"], batch["position_ids"], batch["segment_ids"]), batch)
        # NxDT's model: no mask beyond causal, positions 0..S-1, logits[..., :-1] against the unshifted labels[..., 1:]
        logits = model(torch.tensor(NXDT_IDS))
        labels = torch.tensor(NXDT_LABELS)
        theirs = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=X)
    # the model runs in float64 and the two differ only in the attention path (an explicit mask vs is_causal); the
    # model's loss_fn takes its cross-entropy in fp32 (models/llama.py next_token_loss): a few fp32 roundings
    # (eps 6e-8) per log-sum-exp, averaged over 36 labels, stay far inside 1e-6
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    # and it is not the per-record layout's loss (prompts masked, attention within records)
    per_record, _ = build_sft_examples(RECORDS, TOK, S, packing=True)
    with torch.no_grad():
        masked = CAUSAL_LM.loss(
            model, model(per_record["input_ids"], per_record["position_ids"], per_record["segment_ids"]), per_record
        )
    assert abs(masked.item() - theirs.item()) > 1e-3


def test_the_default_stays_per_record():
    cfg = compose_config(["+recipe=sft"])
    assert cfg.model_alignment_strategy.sft.packing_style == "per_record"
    default, stats = build_sft_examples(RECORDS, TOK, S, packing=True)
    explicit, _ = build_sft_examples(RECORDS, TOK, S, packing=True, packing_style="per_record")
    assert all(torch.equal(default[k], explicit[k]) for k in default)
    # prompts masked (A's labels: only "b" and EOS), C kept whole (its 12 tokens give 11 positions), positions
    # restarting at each record (B and D share row 2), no separator, nothing dropped
    first = [t for t, s in zip(default["labels"][0].tolist(), default["segment_ids"][0].tolist()) if s == 1]
    assert first == [X, X, ord("b"), EOS]
    assert default["position_ids"][1, :11].tolist() == list(range(11)) and stats.dropped == 0
    assert default["input_ids"][2, :8].tolist() == B[:-1] + D[:-1]
    assert default["position_ids"][2, :8].tolist() == [0, 1, 2, 3] * 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model_alignment_strategy.sft.packing_style=nxdt"], "model_alignment_strategy.sft.packing_style"),
        (
            ["model_alignment_strategy.sft.packing_style=concat", "model_alignment_strategy.sft.packing=false"],
            "model_alignment_strategy.sft.packing=true",
        ),
    ],
)
def test_a_bad_packing_style_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(compose_config(["+recipe=sft", *overrides]), paths=False)
    assert "model_alignment_strategy.sft.packing_style" in str(err.value)


def test_an_nxdt_config_keeps_per_record_and_notes_the_option():
    nxdt = {
        "name": "t",
        "model_source": "hf",
        "trainer": {"devices": 2, "num_nodes": 1, "max_steps": 10},
        "data": {"micro_batch_size": 1, "global_batch_size": 8, "train_dir": "/records.jsonl"},
        "model": {"model_config": "c.json", "encoder_seq_length": 128},
        "model_alignment_strategy": {"sft": {"packing": True}},
    }
    hf = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "max_position_embeddings": 128,
        "hidden_act": "silu",
    }
    t = translate(nxdt, hf)
    assert "model_alignment_strategy.sft.packing_style" not in flatten(t.config)  # nxdt's default applies
    assert [n for n in t.notes if "packing_style=concat reproduces it" in n], t.notes
    nxdt["model_alignment_strategy"]["sft"]["packing_style"] = "concat"  # nxdt's own key in the file: no note
    t = translate(nxdt, hf)
    assert flatten(t.config)["model_alignment_strategy.sft.packing_style"] == "concat"
    assert not [n for n in t.notes if "packing_style" in n]
