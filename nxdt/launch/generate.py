"""``nxdt generate``: sample completions of prompts from an nxdt checkpoint or a Hugging Face model directory.

MODEL is read as ``nxdt eval`` reads it (:func:`nxdt.launch.model_source.load_model`: a checkpoint of any layout with
its run's tokenizer, or a Hugging Face directory with its ``tokenizer.json``, else byte-level). Prompts are
``--prompt TEXT`` (repeatable) or ``--prompts FILE.jsonl``: records with a ``prompt`` field, a string or a list of
``{"role", "content"}`` messages (GRPO's prompt records); the records' other fields are copied to ``--out``.

**Rendering.** When the tokenizer has a chat template (and ``--no-chat-template`` is not given) a prompt string is one
user message, and the messages are rendered as ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``
renders them (:func:`nxdt.data.instructions.render_chat_template`), then encoded without added special tokens (the
template writes its own, as ``apply_chat_template(tokenize=True)`` does). Without a template a string is encoded as
it is — no BOS added, as GRPO encodes its prompts — and a message list through the plain template training uses
(:func:`nxdt.data.instructions.render_plain_chat`).

**Decoding** is :func:`nxdt.models.generate.generate` (KV cache, left-padded batches of ``--batch-size`` prompts,
stopping at the tokenizer's EOS or after ``--max-new-tokens``): greedy by default; ``--temperature``, ``--top-p`` or
``--top-k`` turn sampling on (transformers' warpers), drawn from a ``torch.Generator`` seeded with ``--seed`` (default
0) — the same command gives the same completions. A completion is decoded without its EOS.

Output: each completion on stdout (a ``--- i`` line before each when there are several prompts) and, with ``--out
FILE.jsonl``, one record per prompt: its fields, ``completion``, ``prompt_tokens``, ``completion_tokens``,
``completion_ids`` (EOS included when produced) and ``finished`` (ended at EOS).
Bad input (no such model, a prompt file without ``prompt`` fields, a bad sampling value, token ids past the model's
vocabulary) is one line, exit 2.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nxdt.launch.model_source import CommandError, check_fits, check_model_dir, check_output, load_model, write_output

USAGE = """usage: nxdt generate MODEL (--prompt TEXT [--prompt TEXT ...] | --prompts FILE.jsonl) [--max-new-tokens N]
       [--temperature T] [--top-p P] [--top-k K] [--seed N] [--batch-size N] [--no-chat-template] [--out FILE.jsonl]

MODEL: an nxdt checkpoint (<run>/checkpoints/step-<N>) or a Hugging Face model directory (config.json + safetensors)
greedy unless --temperature, --top-p or --top-k is given (then sampled, seeded by --seed, default 0);
the tokenizer's chat template is applied when it has one (--no-chat-template: the prompt text as it is);
completions are printed with control characters (other than newline and tab) as \\xNN, --out keeps the exact text"""

WHO = "nxdt generate"


@dataclass
class Request:
    model: str
    records: list[dict[str, Any]]  # each with a 'prompt': a string or a list of messages
    max_new_tokens: int = 64
    batch_size: int = 8
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    chat_template: bool = True
    out: str | None = None

    def check(self) -> "Request":
        """Each sampling value in its range (transformers' ranges), refused by flag before anything is loaded."""
        # inf passes "> 0" but divides every logit to 0 (a uniform draw over the whole vocabulary); nan passes nothing
        if self.temperature is not None and not 0 < self.temperature < math.inf:
            raise CommandError(
                f"{WHO}: --temperature {self.temperature} must be a finite number > 0 (leave the sampling flags out for greedy)"
            )
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise CommandError(f"{WHO}: --top-p {self.top_p} must be in (0, 1] (1 keeps every token)")
        if self.top_k is not None and self.top_k < 0:
            raise CommandError(f"{WHO}: --top-k {self.top_k} must be >= 0 (0 keeps every token)")
        # torch.Generator.manual_seed also takes negatives (wrapped to 2**64 + seed); refused as `seed` is in train
        if not 0 <= self.seed < 2**64:
            raise CommandError(f"{WHO}: --seed {self.seed} is out of range; give a seed between 0 and 2**64 - 1")
        if self.out is not None:
            check_output(WHO, self.out)  # before the model is loaded
        check_model_dir(WHO, self.model)  # before torch is imported
        return self

    def sampling(self) -> dict[str, Any]:
        """:func:`~nxdt.models.generate.generate`'s options: sampled when any sampling flag is given."""
        return {
            "do_sample": any(v is not None for v in (self.temperature, self.top_p, self.top_k)),
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_k": 0 if self.top_k is None else self.top_k,
            "top_p": 1.0 if self.top_p is None else self.top_p,
        }


def check_records(records: list[Any], where: str) -> list[dict[str, Any]]:
    """Each record a JSON object whose ``prompt`` is a non-empty string or a non-empty list of messages."""
    from nxdt.data.instructions import is_message_list

    for i, record in enumerate(records):
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not (isinstance(prompt, str) and prompt) and not is_message_list(prompt):
            raise CommandError(
                f"{WHO}: {where} record {i}: needs a 'prompt' field, a non-empty string or a list of "
                f'{{"role": ..., "content": ...}} messages (got {type(prompt).__name__})'
            )
    return records


def read_prompt_file(path: str) -> list[dict[str, Any]]:
    from nxdt.data.files import not_regular
    from nxdt.data.instructions import read_jsonl

    where = Path(path).expanduser()
    if not where.is_file():
        kind = not_regular(where)
        raise CommandError(f"{WHO}: --prompts {path}: {'no such file' if kind is None else f'is {kind}, not a regular file'}")
    try:
        records = read_jsonl(where)
    except (ValueError, OSError) as exc:
        raise CommandError(f"{WHO}: --prompts {path}: {str(exc).splitlines()[0]}") from None
    if not records:
        raise CommandError(f"{WHO}: --prompts {path} holds no records")
    return check_records(records, str(path))


def prompt_renderer(tok: Any, use_chat_template: bool) -> Callable[[Any], str]:
    """A record's prompt (string or messages) → the text the model continues (module docstring, Rendering)."""
    from nxdt.data.instructions import render_generation_prompt

    templated = use_chat_template and tok.chat_template is not None

    def render(prompt: Any) -> str:
        if isinstance(prompt, str) and not templated:
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return render_generation_prompt(tok, messages, use_chat_template=use_chat_template)

    return render


def run(request: Request) -> list[dict[str, Any]]:
    """One output record per prompt record, in order (module docstring)."""
    import torch

    from nxdt.data.instructions import build_chat_tokenizer
    from nxdt.models.generate import generate

    request.check()
    loaded = load_model(request.model, WHO)
    try:
        tok = build_chat_tokenizer(loaded.tokenizer)
    except (ValueError, OSError) as exc:
        raise CommandError(f"{WHO}: the tokenizer of {request.model}: {str(exc).splitlines()[0]}") from None
    decode = tok.decode
    if decode is None:  # every ChatTokenizer nxdt builds has one
        raise CommandError(f"{WHO}: the tokenizer of {request.model} cannot decode")
    render = prompt_renderer(tok, request.chat_template)
    prompts: list[list[int]] = []
    for i, record in enumerate(request.records):
        try:
            ids = tok.encode(render(record["prompt"]))
        except ValueError as exc:  # the chat template refused the messages
            raise CommandError(f"{WHO}: prompt {i}: {str(exc).splitlines()[0]}") from None
        if not ids:
            raise CommandError(f"{WHO}: prompt {i} encodes to no tokens")
        if max(ids) >= loaded.vocab_size:  # an embedding lookup would fail mid-batch with an index error
            raise CommandError(
                f"{WHO}: prompt {i} encodes to token id {max(ids)}, outside the model's vocab_size={loaded.vocab_size}: "
                f"the tokenizer ({loaded.tokenizer or 'byte-level'}) is not this model's"
            )
        prompts.append(ids)
    check_fits(WHO, prompts, request.max_new_tokens, loaded.max_positions)
    generator = torch.Generator(next(loaded.model.parameters()).device).manual_seed(request.seed)
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), request.batch_size):
        outputs += generate(
            loaded.model,
            prompts[start : start + request.batch_size],
            request.max_new_tokens,
            eos_id=tok.eos_id,
            generator=generator,
            **request.sampling(),
        )
    results = []
    for record, ids, out in zip(request.records, prompts, outputs):
        finished = bool(out) and out[-1] == tok.eos_id
        tokens = out[:-1] if finished else out
        results.append(
            {
                **record,
                "completion": decode(tokens),
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "completion_ids": out,
                "finished": finished,
            }
        )
    return results


def _value(argv: list[str], at: int, convert: Any) -> Any:
    flag = argv[at]
    if at + 1 >= len(argv):
        raise CommandError(f"{WHO}: {flag} needs a value")
    try:
        return convert(argv[at + 1])
    except ValueError:
        raise CommandError(f"{WHO}: {flag} {argv[at + 1]!r} is not a valid {convert.__name__}") from None


# C0 controls but newline and tab, DEL and C1 controls: what a terminal would act on (cursor moves, colours, title
# changes, OSC 8 links) rather than show
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}


def printable(text: str) -> str:
    """``text`` with the control characters a terminal would obey written as ``\\xNN`` escapes: a model's completion
    is untrusted text (a fine-tuned or downloaded model can emit ESC sequences). ``--out`` keeps the exact text."""
    return text.translate(_CONTROLS)


def parse(argv: list[str]) -> Request:
    """The command line as a :class:`Request` (prompts read; sampling values checked); nothing loaded yet."""
    positional: list[str] = []
    texts: list[str] = []
    values: dict[str, Any] = {}
    options = {
        "--prompts": ("prompts", str),
        "--max-new-tokens": ("max_new_tokens", int),
        "--batch-size": ("batch_size", int),
        "--temperature": ("temperature", float),
        "--top-p": ("top_p", float),
        "--top-k": ("top_k", int),
        "--seed": ("seed", int),
        "--out": ("out", str),
    }
    at = 0
    while at < len(argv):
        arg = argv[at]
        if arg == "--prompt":
            texts.append(_value(argv, at, str))
            at += 2
        elif arg in options:
            values[options[arg][0]] = _value(argv, at, options[arg][1])
            at += 2
        elif arg == "--no-chat-template":
            values["chat_template"] = False
            at += 1
        elif arg.startswith("-"):
            raise CommandError(f"{WHO}: unknown option {arg!r} (nxdt generate alone prints the usage)")
        else:
            positional.append(arg)
            at += 1
    if len(positional) != 1:
        raise CommandError(USAGE)
    for key, flag in (("max_new_tokens", "--max-new-tokens"), ("batch_size", "--batch-size")):
        if key in values and values[key] < 1:
            raise CommandError(f"{WHO}: {flag} {values[key]} must be >= 1")
    prompts_file = values.pop("prompts", None)
    if bool(texts) == (prompts_file is not None):
        raise CommandError(f"{WHO}: give the prompts as --prompt TEXT (one or more) or --prompts FILE.jsonl, one of the two")
    records = read_prompt_file(prompts_file) if prompts_file else check_records([{"prompt": t} for t in texts], "--prompt")
    return Request(positional[0], records, **values).check()


def main(argv: list[str]) -> int:
    try:
        request = parse(argv)
        results = run(request)
        if request.out:
            write_output(WHO, request.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    except CommandError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    for i, result in enumerate(results):
        if len(results) > 1:
            print(f"--- {i}")
        print(printable(result["completion"]))
    if request.out:
        print(f"nxdt: wrote {request.out}", file=sys.stderr)
    return 0
