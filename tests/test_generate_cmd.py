"""``nxdt generate`` (``nxdt.launch.generate``) on a tiny Llama that transformers saved with a tokenizer that has a
chat template: greedy completions equal transformers' ``generate`` decoded (with the chat template rendered as
``apply_chat_template`` renders it, and without it), seeded sampling reproducible, bad input one line, exit 2.
In-process through ``nxdt.cli.main``: no workers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hf_reference import TINY_LLAMA, llama_config
from nxdt.cli import main
from nxdt.launch.generate import printable

pytestmark = pytest.mark.timeout(300)

# ChatML-like, with the BOS the template writes itself (as Llama/Qwen templates do)
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = "system user assistant what is two plus three the answer five four one six seven eight nine zero".split()
PROMPTS = ["what is two plus three", "the answer is"]
EOS = 2  # "</s>"
NEW = 10


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers LlamaForCausalLM of the parity tests' tiny shape, saved with a word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(transformers, TINY_LLAMA)).eval()
    with torch.no_grad():  # distinctive weights (norms away from 1): logits far from ties, so greedy is well defined
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    assert len(vocab) <= TINY_LLAMA["vocab_size"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "clean_up_tokenization_spaces": False,
                "chat_template": TEMPLATE,
            }
        )
    )
    return directory


@pytest.fixture(scope="module")
def reference(hf_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(hf_dir))


def hf_completion(reference, ids: list[int]) -> tuple[list[int], str]:
    """transformers' greedy continuation of one prompt (new tokens only, stopping at EOS) and its text without EOS."""
    model, tok = reference
    prompt = torch.tensor([ids])
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=NEW,
        eos_token_id=EOS,
        pad_token_id=EOS,
        num_beams=1,
    )[0, len(ids) :].tolist()
    with torch.no_grad():  # nxdt's fp32 logits differ from these by rounding (~1e-6): greedy is decided far above it
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3
    text_ids = out[:-1] if out and out[-1] == EOS else out
    return out, tok.decode(text_ids, skip_special_tokens=True)


def generate(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "out.jsonl"
    assert main(["generate", *args, "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_greedy_equals_transformers_generate_with_the_chat_template(hf_dir, reference, tmp_path, capsys):
    _, tok = reference
    records = generate(tmp_path, str(hf_dir), *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", str(NEW))
    printed = capsys.readouterr().out
    for i, (prompt, record) in enumerate(zip(PROMPTS, records)):
        # the template renders "<s><|im_start|> user ... <|im_end|> <|im_start|> assistant" (apply_chat_template)
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        assert ids[:2] == [1, 3]  # BOS and <|im_start|>: the template was applied
        want_ids, want_text = hf_completion(reference, ids)
        # nxdt batches the two prompts left-padded; the same tokens as transformers on each alone
        assert record["completion_ids"] == want_ids and record["completion"] == want_text, (prompt, record)
        assert record["prompt"] == prompt and record["prompt_tokens"] == len(ids)
        assert record["finished"] == (want_ids[-1] == EOS) and record["completion_tokens"] == len(want_ids)
        assert f"--- {i}\n{want_text}\n" in printed  # one completion printed per prompt


def test_greedy_without_the_chat_template_continues_the_text_as_it_is(hf_dir, reference, tmp_path, capsys):
    _, tok = reference
    records = generate(tmp_path, str(hf_dir), "--prompt", PROMPTS[0], "--no-chat-template", "--max-new-tokens", str(NEW))
    ids = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]  # no BOS, no template: the text's own tokens
    want_ids, want_text = hf_completion(reference, ids)
    assert records[0]["completion_ids"] == want_ids and records[0]["prompt_tokens"] == len(ids)
    assert capsys.readouterr().out == want_text + "\n"  # one prompt: just its completion


def test_prompt_file_records_keep_their_fields_and_messages_use_the_template(hf_dir, reference, tmp_path):
    _, tok = reference
    messages = [{"role": "system", "content": "the answer"}, {"role": "user", "content": "what is two plus three"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": messages, "id": 7}) + "\n" + json.dumps({"prompt": "one plus one"}) + "\n")
    records = generate(tmp_path, str(hf_dir), "--prompts", str(prompts), "--max-new-tokens", str(NEW), "--batch-size", "1")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert records[0]["id"] == 7 and records[0]["prompt"] == messages and records[0]["prompt_tokens"] == len(ids)
    assert records[0]["completion_ids"] == hf_completion(reference, ids)[0]
    assert "id" not in records[1] and len(records) == 2


def test_seeded_sampling_is_reproducible(hf_dir, tmp_path):
    sample = [str(hf_dir), *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "12"]
    sample += ["--temperature", "1.5", "--top-k", "30", "--top-p", "0.95"]
    first = generate(tmp_path, *sample, "--seed", "3")
    again = generate(tmp_path, *sample, "--seed", "3")
    other = generate(tmp_path, *sample, "--seed", "4")
    greedy = generate(tmp_path, *sample[:7])  # the same without the sampling flags
    assert [r["completion_ids"] for r in first] == [r["completion_ids"] for r in again]
    # 2 prompts × up to 12 tokens drawn at temperature 1.5 from ~30 tokens: another seed (or greedy) giving the very
    # same tokens would mean the seed or the sampling flags were ignored
    assert [r["completion_ids"] for r in first] != [r["completion_ids"] for r in other]
    assert [r["completion_ids"] for r in first] != [r["completion_ids"] for r in greedy]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--prompt", "hi", "--temperature", "0"], "--temperature 0.0 must be a finite number > 0"),
        (["--prompt", "hi", "--temperature", "inf"], "--temperature inf must be a finite number > 0"),
        (["--prompt", "hi", "--temperature", "nan"], "--temperature nan must be a finite number > 0"),
        (["--prompt", "hi", "--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (["--prompt", "hi", "--top-k", "-1"], "--top-k -1 must be >= 0"),
        (["--prompt", "hi", "--top-k", "two"], "--top-k 'two' is not a valid int"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
        ([], "--prompt TEXT (one or more) or --prompts FILE.jsonl, one of the two"),
        (["--prompts", "{tmp}/absent.jsonl"], "absent.jsonl: no such file"),
        (["--prompts", "{tmp}/p.jsonl"], "p.jsonl record 1: needs a 'prompt' field"),
        (["--prompts", "{tmp}/m.jsonl"], "m.jsonl record 0: needs a 'prompt' field"),  # a message without content
        (["--prompt", "hi", "--prompts", "{tmp}/p.jsonl"], "one of the two"),
        (["--prompt", "hi", "--top_k", "5"], "unknown option '--top_k'"),
        # issue 38 probes: a huge --max-new-tokens ran until killed (the KV cache sized by it), a prompt past the
        # model's 64 positions and a seed past 2**64 raised tracebacks, a FIFO was "no such file", --out a directory
        # a traceback after the whole generation
        (
            ["--prompt", "hi", "--max-new-tokens", "1000000000000", "--no-chat-template"],
            "prompt 0 has 1 tokens; with --max-new-tokens 1000000000000 it would need 1000000000001 positions, more than "
            "the model's max_position_embeddings=64 — give --max-new-tokens 63 or less",
        ),
        (["--prompt", "one " * 70, "--max-new-tokens", "2", "--no-chat-template"], "— shorten the prompt"),
        (["--prompt", "hi", "--seed", str(2**70)], f"--seed {2**70} is out of range"),
        (["--prompts", "{tmp}/fifo.jsonl"], "fifo.jsonl: is a FIFO (named pipe), not a regular file"),
        (
            ["--prompt", "hi", "--max-new-tokens", "2", "--out", "{tmp}"],
            "exists and is not a regular file (a directory, FIFO or device); name a file",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(hf_dir, tmp_path, capsys, args, says):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"text": "no prompt"}) + "\n")
    (tmp_path / "m.jsonl").write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    os.mkfifo(tmp_path / "fifo.jsonl")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["generate", str(hf_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_printed_completions_show_terminal_controls_as_escapes():
    # a model may emit ESC sequences (colour, cursor, OSC title/link), CR (overwrites the line) or C1 CSI (0x9b)
    text = "ok\x1b[2J\x1b]0;owned\x07 \r\x9b31m\x7f é 中\tend\nnext"
    assert printable(text) == "ok\\x1b[2J\\x1b]0;owned\\x07 \\x0d\\x9b31m\\x7f é 中\tend\nnext"
    assert printable("plain text\n") == "plain text\n"


def test_a_missing_model_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "nxdt generate:" in err and "neither an nxdt checkpoint" in err and len(err.splitlines()) == 1, err


def test_a_tokenizer_larger_than_the_model_is_one_line_and_exit_2(hf_dir, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (model / name).symlink_to(hf_dir / name)
    words = SPECIAL + WORDS + [f"w{i}" for i in range(TINY_LLAMA["vocab_size"])]  # "w0" ... past the 64 rows
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    assert main(["generate", str(model), "--prompt", "the w60", "--no-chat-template"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        f"prompt 0 encodes to token id {words.index('w60')}, outside the model's vocab_size=64" in err
        and len(err.splitlines()) == 1
    ), err
