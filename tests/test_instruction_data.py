"""nxdt/data/instructions.py and preferences.py on hand-built records: prompt masking in nxdt's shift convention,
packed vs padded layouts, counted truncation, chat templates against transformers' apply_chat_template, and the
shipped sample sets."""

from __future__ import annotations

import json

import pytest
import torch

from nxdt.data import SAMPLE_INSTRUCTIONS, SAMPLE_PREFERENCES
from nxdt.data.instructions import (
    IGNORE_INDEX,
    BuildStats,
    ChatTokenizer,
    block_causal_mask,
    build_sft_examples,
    byte_chat_tokenizer,
    fit_record,
    load_chat_tokenizer,
    make_instruction_samples,
    read_jsonl,
    render_chat_template,
    split_segments,
    tokenize_record,
)
from nxdt.data.preferences import build_preference_batch, make_preference_samples, split_chosen_rejected
from nxdt.models.objectives import sequence_log_probs, token_log_probs

BYTE = byte_chat_tokenizer()


def _b(text):
    return list(text.encode())


# ------------------------------------------------------------------------------------------------ masking


def test_io_record_masks_the_prompt_and_trains_response_and_eos():
    batch, stats = build_sft_examples([{"instruction": "Add.", "input": "1+1", "output": "2"}], BYTE, 16, packing=False)
    prompt = _b("Add.\n1+1\n")
    tokens = prompt + _b("2") + [0]
    n = len(tokens) - 1
    assert batch["input_ids"][0, :n].tolist() == tokens[:-1]
    assert batch["labels"][0, :n].tolist() == [-100] * (len(prompt) - 1) + [ord("2"), 0]
    assert batch["labels"][0, n:].eq(-100).all() and batch["input_ids"][0, n:].eq(BYTE.pad).all()
    assert batch["position_ids"][0, :n].tolist() == list(range(n))
    assert batch["segment_ids"][0].tolist() == [1] * n + [0] * (16 - n)
    assert (stats.records, stats.examples, stats.truncated, stats.dropped, stats.label_tokens) == (1, 1, 0, 0, 2)


def test_input_without_instruction_and_bos():
    tok = ChatTokenizer(encode=_b, eos_id=0, bos_id=1)
    tokens, trained = tokenize_record({"input": "hi", "output": "yo"}, tok)
    assert tokens == [1] + _b("hi\n") + _b("yo") + [0]
    assert trained == [False] * 4 + [True] * 3


def test_chat_record_trains_every_assistant_turn_only():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    tokens, trained = tokenize_record({"messages": messages}, BYTE)
    text = "system: S\nuser: a\nassistant: b\nuser: c\nassistant: d\n"
    assert tokens == _b(text) + [0]
    trained_text = bytes(t for t, m in zip(tokens, trained) if m and t)
    assert trained_text == b"b\nd\n"


def test_bad_records_fail_with_one_clear_line():
    with pytest.raises(ValueError, match=r"record 1: needs 'input' and 'output'"):
        build_sft_examples([{"input": "a", "output": "b"}, {"text": "x"}], BYTE, 8, packing=True)
    with pytest.raises(ValueError, match="no 'assistant' message"):
        tokenize_record({"messages": [{"role": "user", "content": "x"}]}, BYTE)
    with pytest.raises(ValueError, match="'output' is empty"):
        tokenize_record({"input": "x", "output": ""}, BYTE)


# ------------------------------------------------------------------------------------------------ packing


RECORDS = [
    {"input": "ab", "output": "c"},
    {"instruction": "I", "input": "xyz", "output": "uvw"},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]},
    {"input": "", "output": "zz"},
    {"input": "12", "output": "3"},
]


def test_packed_and_padded_give_every_record_the_same_tokens_labels_and_positions():
    packed, ps = build_sft_examples(RECORDS, BYTE, 24, packing=True)
    padded, us = build_sft_examples(RECORDS, BYTE, 24, packing=False)
    assert padded["input_ids"].shape[0] == len(RECORDS) > packed["input_ids"].shape[0]
    a, b = split_segments(packed), split_segments(padded)
    assert len(a) == len(b) == len(RECORDS)
    for x, y in zip(a, b):
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(x[key], y[key]), key
        assert x["position_ids"].tolist() == list(range(len(x["position_ids"])))  # restart at each record
    assert ps.label_tokens == us.label_tokens and ps.tokens == us.tokens and ps.pad_tokens < us.pad_tokens
    assert packed["segment_ids"][0].max() >= 2  # really packed


def test_block_causal_mask_keeps_attention_inside_a_record():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0]])
    m = block_causal_mask(seg)[0]
    assert m[1].tolist() == [True, True, False, False, False, False]
    assert m[4].tolist() == [False, False, True, True, True, False]
    assert m[5].tolist() == [False] * 5 + [True]  # padding sees only padding: no empty row


class _ToyLM(torch.nn.Module):
    """One attention layer using position_ids and a mask: enough to show the packing tensors isolate records."""

    def __init__(self, vocab=256, dim=16, positions=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(positions, dim, generator=g))
        self.qkv = torch.nn.Parameter(torch.randn(dim, 3 * dim, generator=g) / dim**0.5)
        self.out = torch.nn.Parameter(torch.randn(dim, vocab, generator=g) / dim**0.5)

    def forward(self, input_ids, position_ids, segment_ids):
        h = self.emb[input_ids] + self.pos[position_ids]
        q, k, v = (h @ self.qkv).chunk(3, dim=-1)
        mask = block_causal_mask(segment_ids)
        return (h + torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)) @ self.out


def test_packed_and_padded_give_the_same_per_record_losses():
    model = _ToyLM().double()
    losses = []
    for packing in (True, False):
        batch, _ = build_sft_examples(RECORDS, BYTE, 24, packing=packing)
        logits = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        logp = token_log_probs(logits, batch["labels"])
        per_record = []
        for r in range(batch["segment_ids"].shape[0]):
            seg = batch["segment_ids"][r]
            per_record += [float(-logp.detach()[r][seg == s].sum()) for s in range(1, int(seg.max()) + 1)]
        losses.append(per_record)
    assert losses[0] == pytest.approx(losses[1], rel=1e-10)


# ------------------------------------------------------------------------------------------------ truncation


def test_too_long_records_are_counted_never_silently_dropped():
    long_prompt = {"input": "p" * 30, "output": "abc"}
    long_response = {"input": "q", "output": "r" * 30}
    ok = {"input": "a", "output": "b"}
    batch, stats = build_sft_examples([ok, long_prompt, long_response], BYTE, 12, packing=False)
    assert (stats.records, stats.examples, stats.truncated, stats.dropped) == (3, 3, 2, 0)
    assert (stats.prompt_truncated, stats.response_truncated) == (1, 1)
    rows = split_segments(batch)
    # long prompt: cut from the left, the whole response kept (ends with its EOS)
    assert rows[1]["labels"].tolist()[-4:] == _b("abc") + [0] and len(rows[1]["input_ids"]) == 12
    assert bytes(rows[1]["input_ids"][:6].tolist()) == b"pppppp"
    # long response: prompt kept, response cut from the right, no EOS
    assert bytes(rows[2]["input_ids"][:2].tolist()) == b"q\n" and 0 not in rows[2]["labels"].tolist()
    _, dropped = build_sft_examples([ok, long_prompt, long_response], BYTE, 12, packing=True, truncation="drop")
    assert (dropped.examples, dropped.dropped, dropped.truncated) == (1, 2, 0)


def test_prompt_keeps_at_least_half_the_budget_and_a_labelless_record_is_dropped():
    tokens, trained = [7] * 20 + [8] * 20, [False] * 20 + [True] * 20
    out = fit_record(tokens, trained, 15, "truncate", stats := BuildStats())
    assert out is not None and len(out[0]) == 16 and out[0][:8] == [7] * 8  # (15 + 1) // 2 prompt tokens kept
    assert (stats.truncated, stats.prompt_truncated, stats.response_truncated) == (1, 1, 1)
    assert fit_record([1, 2, 3], [False, False, False], 8, "truncate", stats) is None and stats.dropped == 1


# ------------------------------------------------------------------------------------------------ chat template

TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(sys=false) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.sys = true %}{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|> {{ message['role'] }} {{ message['content'] | trim }} <|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
WORDS = "system user assistant you are kind hello there how can i help thanks bye".split()


@pytest.fixture()
def hf_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"] + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": TEMPLATE,
            }
        )
    )
    return tmp_path


CHAT = [
    {"role": "system", "content": "you are kind"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "how can i help"},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "bye"},
]


def test_chat_template_renders_as_transformers_does(hf_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tok = load_chat_tokenizer(hf_dir)
    assert (tok.eos_id, tok.bos_id, tok.pad) == (2, 1, 2)
    for upto in range(1, len(CHAT) + 1):
        for gen in (False, True):
            want = ref.apply_chat_template(CHAT[:upto], tokenize=False, add_generation_prompt=gen)
            assert (
                render_chat_template(tok.chat_template, CHAT[:upto], add_generation_prompt=gen, special_tokens=tok.special_tokens)
                == want
            )
    with pytest.raises(ValueError, match="chat template: bad role"):
        render_chat_template(TEMPLATE, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="record 0: chat template: bad role"):
        build_sft_examples(
            [{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}], tok, 32, packing=True
        )
    with pytest.raises(ValueError, match="does not compile"):
        render_chat_template("{% for %}", CHAT)
    # tokens: the whole conversation as transformers tokenizes it and nothing more (the template ends each turn; TRL's
    # SFTTrainer appends no EOS to conversational data: tests/test_sft_trl.py), assistant replies trained
    tokens, trained = tokenize_record({"messages": CHAT}, tok)
    ids = ref.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokens == list(ids)
    assert ref.decode([t for t, m in zip(tokens, trained) if m]) == "how can i help <|im_end|> bye <|im_end|>"


def test_io_record_under_a_chat_template_and_preferences_too(hf_dir):
    tok = load_chat_tokenizer(hf_dir)
    tokens, trained = tokenize_record({"input": "hello", "output": "bye"}, tok)
    text = render_chat_template(
        TEMPLATE,
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "bye"}],
        special_tokens=tok.special_tokens,
    )
    assert tokens == tok.encode(text)  # no EOS after the template's <|im_end|>
    assert tokenize_record({"input": "hello", "output": "bye"}, tok, use_chat_template=False)[0][0] == tok.bos_id
    batch, stats = build_preference_batch([{"prompt": "hello", "chosen": "bye", "rejected": "thanks"}], tok, 16)
    prompt = tok.encode(
        render_chat_template(
            TEMPLATE, [{"role": "user", "content": "hello"}], add_generation_prompt=True, special_tokens=tok.special_tokens
        )
    )
    assert batch["input_ids"][0, : len(prompt)].tolist() == prompt
    assert batch["labels"][0, len(prompt) - 1 : len(prompt) + 1].tolist() == tok.encode("bye") + [2]


# ------------------------------------------------------------------------------------------------ preferences


def test_preference_batch_chosen_rows_then_rejected_rows_prompt_masked():
    records = [{"prompt": "1+1", "chosen": "2", "rejected": "3"}, {"prompt": "ab", "chosen": "ba", "rejected": "ab"}]
    batch, stats = build_preference_batch(records, BYTE, 10)
    assert batch["input_ids"].shape == (4, 10) and (stats.records, stats.pairs, stats.dropped) == (2, 2, 0)
    expect = [(_b("1+1\n"), _b("2")), (_b("ab\n"), _b("ba")), (_b("1+1\n"), _b("3")), (_b("ab\n"), _b("ab"))]
    for row, (prompt, resp) in enumerate(expect):
        tokens = prompt + resp + [0]
        n = len(tokens) - 1
        assert batch["input_ids"][row, :n].tolist() == tokens[:-1]
        assert batch["labels"][row].tolist() == [-100] * (len(prompt) - 1) + resp + [0] + [-100] * (10 - n)
    sums, counts = sequence_log_probs(torch.zeros(4, 10, 256), batch["labels"])
    chosen, rejected = split_chosen_rejected(counts)
    assert chosen.tolist() == [2, 3] and rejected.tolist() == [2, 3]


def test_preference_truncation_as_trl():
    rec = {"prompt": "abcdefgh", "chosen": "XYZ", "rejected": "W"}
    start, s = build_preference_batch([rec], BYTE, 32, max_prompt_length=4, truncation_mode="keep_start")
    end, _ = build_preference_batch([rec], BYTE, 32, max_prompt_length=4, truncation_mode="keep_end")
    assert bytes(start["input_ids"][0, :4].tolist()) == b"abcd" and s.prompt_truncated == 1
    assert bytes(end["input_ids"][0, :4].tolist()) == b"fgh\n"
    cut, s = build_preference_batch([rec], BYTE, 10)  # 9 prompt tokens + room for 2 response tokens
    assert s.response_truncated == 1 and cut["labels"][0].tolist()[8:] == _b("XY")
    assert cut["labels"][1].tolist()[8:] == _b("W") + [0]
    _, s = build_preference_batch([rec, {"prompt": "p" * 40, "chosen": "a", "rejected": "b"}], BYTE, 10)
    assert (s.pairs, s.dropped) == (1, 1)
    with pytest.raises(ValueError, match="truncation_mode='middle'"):
        build_preference_batch([rec], BYTE, 10, truncation_mode="middle")


def test_bad_preference_records():
    with pytest.raises(ValueError, match="record 0: 'chosen' must be a non-empty string"):
        build_preference_batch([{"prompt": "a", "chosen": "", "rejected": "b"}], BYTE, 8)
    with pytest.raises(ValueError, match=r"missing \['rejected'\]"):
        build_preference_batch([{"prompt": "a", "chosen": "c"}], BYTE, 8)


# ------------------------------------------------------------------------------------------------ shipped samples


def test_shipped_samples_are_the_generators_output_and_build_cleanly():
    instructions, preferences = read_jsonl(SAMPLE_INSTRUCTIONS), read_jsonl(SAMPLE_PREFERENCES)
    assert instructions == make_instruction_samples() and len(instructions) == 200
    assert preferences == make_preference_samples() and len(preferences) == 200
    assert all(p["chosen"] != p["rejected"] for p in preferences)
    assert len(read_jsonl(SAMPLE_INSTRUCTIONS, limit=7)) == 7  # data.dev_choose_samples
    _, stats = build_sft_examples(instructions, BYTE, 64, packing=True)
    assert (stats.examples, stats.truncated, stats.dropped) == (200, 0, 0)
    _, stats = build_preference_batch(preferences, BYTE, 48)
    assert (stats.pairs, stats.prompt_truncated, stats.response_truncated, stats.dropped) == (200, 0, 0, 0)
    for r in instructions:  # the answers are right
        if r["instruction"] == "Add the numbers.":
            a, b = map(int, r["input"].split("+"))
            assert int(r["output"]) == a + b
        elif r["instruction"] == "Reverse the letters.":
            assert r["output"] == r["input"][::-1]
        else:
            assert r["output"] == r["input"].upper()
    assert IGNORE_INDEX == -100


def test_a_template_whose_prefixes_do_not_extend_is_refused():
    tok = ChatTokenizer(
        encode=_b,
        eos_id=0,
        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}{% if not add_generation_prompt %}END{% endif %}",
    )
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(ValueError, match="record 0: chat template: the rendering up to message 3 does not extend"):
        build_sft_examples([{"messages": chat}], tok, 32, packing=False)


# ------------------------------------------------------------------------------------------------ hostile input


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "took more than 1 s"),
        # output as well as time: whichever budget a host reaches first (a fast one writes 4 M characters within 1 s)
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
            "took more than 1 s|renders more than 4,194,304 characters",
        ),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "a value larger than 4,194,304 characters",
        ),
        ("{{ 'x' | center(1000000000) }}", "a value larger than"),
        ("{{ 'x' * 1000000000 }}", "a value larger than"),
        ("{{ 'x'.ljust(1000000000) }}", "a value larger than"),
        ("{{ 10 ** 10 ** 10 }}", "a value larger than"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ],
)
def test_a_chat_template_renders_under_a_time_and_size_budget(template, needle):
    """Sandboxed Jinja stops unsafe attribute access, not loops or sizes (jinja2.sandbox: only range() is capped, at
    100,000 items): a template from an untrusted tokenizer folder could run for hours or fill memory. Each render gets
    TEMPLATE_SECONDS and TEMPLATE_OUTPUT_CHARS; the error is a ChatTemplateError (blamed on data.tokenizer)."""
    import time

    from nxdt.data.instructions import TEMPLATE_SECONDS, ChatTemplateError

    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=needle):
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 20 * TEMPLATE_SECONDS  # bounded (loose: a loaded 2-core host)
    # an ordinary template still renders, and the budget does not outlive its render
    assert (
        render_chat_template("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}", [{"role": "u", "content": "x"}])
        == "u: x"
    )


def test_record_files_must_be_regular_and_lines_bounded(tmp_path):
    import os

    from nxdt.data.files import DataFileError
    from nxdt.data.instructions import read_instruction_records

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # open() for reading would wait for a writer forever
    with pytest.raises(DataFileError, match="is a FIFO"):
        read_jsonl(fifo)
    with pytest.raises(DataFileError, match="/dev/zero is a character device"):
        read_instruction_records("/dev/zero")
    (tmp_path / "long.jsonl").write_bytes(b'{"input": "' + b"a" * 100)
    from nxdt.data import files

    with pytest.raises(DataFileError, match=r"long.jsonl:1: a line longer than"):
        list(files.read_lines(tmp_path / "long.jsonl", max_line=64))
    good = tmp_path / "dir"
    good.mkdir()
    (good / "a.jsonl").write_text('{"input": "q", "output": "a"}\n')
    os.mkfifo(good / "b.jsonl")  # a FIFO among the files of a directory is left out, not opened
    assert read_instruction_records(good) == [{"input": "q", "output": "a"}]
