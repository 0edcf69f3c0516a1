"""Instruction (SFT) data as NxD Training reads it: records, chat templates, masking, packing, truncation.

**Records** (one JSON object per line of a ``.jsonl`` file, or any iterable of dicts):

* ``{"input": str, "output": str}`` with an optional ``"instruction": str``;
* ``{"messages": [{"role": str, "content": str}, ...]}`` chat records (at least one ``assistant`` message).

**Rendering.** When the tokenizer has a chat template (``chat_template`` in a Hugging Face
``tokenizer_config.json``) it is rendered as Hugging Face's ``apply_chat_template`` does (:func:`render_chat_template`:
a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, the globals ``raise_exception``,
``strftime_now``, ``namespace``, the ``tojson`` filter, and ``messages``, ``add_generation_prompt`` and the special
tokens ``bos_token``, ``eos_token``, … as variables). An ``input``/``output`` record then becomes the chat
``[user: instruction + "\\n\\n" + input, assistant: output]`` (just ``input`` without an instruction). Without a
template (the byte-level tokenizer, or ``use_chat_template=False``) the **plain template** is used:

* ``input``/``output``: prompt ``"{instruction}\\n{input}\\n"`` (``"{input}\\n"`` without an instruction), response
  ``"{output}"``; the tokenizer's BOS (if it has one) is prepended;
* ``messages``: each message as ``"{role}: {content}\\n"``, a generation prompt being ``"assistant: "``.

**Masking.** A record becomes a token list and a per-token "trained" flag: prompt text (everything that is not
an assistant reply: system and user turns, the template's role headers, the generation prompt) is not trained,
assistant replies are (under a chat template, each reply's rendering up to the next message: its content and the
template's end of turn, e.g. ChatML's ``<|im_end|>\n``). Under the plain template EOS is appended (trained) unless
the text already ends with it; under a chat template nothing is appended — the template ends each turn itself, and
TRL's SFTTrainer (conversational data, completion-only or assistant-only loss) trains exactly these tokens. Chat records are cut
at the message boundaries — ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i+1])`` for
each assistant message i — and every piece is tokenized on its own, so no token straddles a prompt/response
boundary (a template whose renderings are not prefixes of each other is refused). Every assistant turn is
trained, not only the last.

**Shift convention** (the same as every nxdt dataset and the hub models' ``loss_fn``): a record of N tokens
gives N − 1 positions, ``input_ids = tokens[:-1]`` and ``labels[t] = tokens[t+1]`` if that token is trained, else
-100. Pad positions have label -100. A record *fits* ``seq_length`` when N − 1 ≤ seq_length.

**Truncation** (``truncation=``), applied to a record that does not fit, always counted in :class:`BuildStats`:

* ``"truncate"`` (default): the leading prompt (the untrained tokens before the first trained one) is cut from
  the **left**, but never below ``min(its length, (seq_length + 1) // 2)`` tokens; if the record still does not
  fit, it is cut from the **right** (the end of the response, with its EOS, is lost). A record left with no
  trained label is dropped (counted as dropped).
* ``"drop"``: the record is dropped.

**Batches** (:func:`build_sft_examples`) are dicts of LongTensors [n, seq_length]:

* ``input_ids``; ``labels`` (already shifted, -100 = no loss);
* ``position_ids``: 0, 1, 2, … restarting at every record (pad positions: 0);
* ``segment_ids``: the record's number within its row, 1, 2, …; 0 for padding. Attention that stays within a
  record is ``block_causal_mask(segment_ids)`` (query t sees key s iff s ≤ t and both are in the same segment).

``packing=True`` appends whole records, in order, into rows of ``seq_length`` positions (a record never spans
two rows; a row is closed when the next record does not fit) and pads the tail; ``packing=False`` puts one record
per row, padded with the pad id. Both give every record exactly the same tokens, labels and positions.

**NxD Training's packed layout** (``packing_style="concat"``, :func:`concat_rows`; packing only). NxD Training
packs SFT records with its ``ConcatDataset`` (``lightning_modules/data/datasets/ConcatDataset.py``), and its HF
models read the rows as one causal stream. Rows of ``seq_length`` positions:

* each record's tokens (as tokenized here, trained flags ignored) followed by one EOS separator; a record joins
  the row while ``used + len(record) < seq_length`` (so record and separator fit), else the row is closed;
* a record longer than ``seq_length - 1`` tokens is skipped (counted as dropped) and closes the current row;
* the labels are the tokens themselves (prompts trained), the separator's label is ignored; in nxdt's shift
  convention ``labels[t]`` is the row's label at ``t + 1`` (NxDT's model shifts ``labels[..., 1:]``) and the last
  position has none, so the separator's position predicts the next record's first token;
* ``position_ids``: 0 … seq_length − 1 along the whole row (NxDT's model numbers every position, padding too);
  ``segment_ids``: 1 on the records and separators (attention crosses records, plain causal), 0 on padding (no
  label, and no real position sees it, so the loss is that of plain causal attention over the whole row).

``truncation`` does not apply to this layout (NxD Training skips what does not fit).

Imports nothing of nxdt beyond ``nxdt.data``; ``jinja2`` (which torch brings) only when a template is rendered.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from nxdt.collector import paused as collector_paused

from .files import MAX_RECORDS, DataFileError, not_regular, read_lines
from .tokenizers import ByteTokenizer, HFTokenizer

IGNORE_INDEX = -100
TRUNCATION_MODES = ("truncate", "drop")
PACKING_STYLES = ("per_record", "concat")  # model_alignment_strategy.sft.packing_style
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# ------------------------------------------------------------------------------------------------ tokenizer


@dataclass
class ChatTokenizer:
    """What building examples needs of a tokenizer: ``encode(text) -> ids`` (no special tokens added), the EOS id,
    and optionally a pad id (default: EOS — pad positions are never trained), a BOS id (prepended by the plain
    template only; chat templates write their own), a Jinja ``chat_template`` and the special-token strings the
    template sees (``bos_token``, ``eos_token``, …)."""

    encode: Callable[[str], list[int]]
    eos_id: int
    pad_id: int | None = None
    bos_id: int | None = None
    chat_template: str | None = None
    special_tokens: Mapping[str, Any] = field(default_factory=dict)  # token texts; additional_special_tokens a list
    decode: Callable[[Sequence[int]], str] | None = None
    vocab_size: int | None = None

    @property
    def pad(self) -> int:
        return self.eos_id if self.pad_id is None else self.pad_id


BYTE_EOS = 0
"""The byte-level tokenizer's EOS (and pad): the NUL byte, which text never contains."""


def byte_chat_tokenizer() -> ChatTokenizer:
    """The byte-level tokenizer (``nxdt.data.tokenizers.ByteTokenizer``) with EOS = pad = 0 (NUL), no BOS, no chat
    template (so the plain template applies)."""
    tok = ByteTokenizer()
    return ChatTokenizer(
        encode=tok.encode,
        eos_id=BYTE_EOS,
        pad_id=BYTE_EOS,
        decode=tok.decode,
        vocab_size=tok.vocab_size,
        special_tokens={"eos_token": "\x00"},
    )


def _token_text(value: Any) -> str | None:
    """A tokenizer_config.json special token: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_tokenizer(path: str | Path) -> ChatTokenizer:
    """A Hugging Face tokenizer directory (``data.tokenizer.type``): ``tokenizer.json`` + ``tokenizer_config.json``
    (special tokens, ``chat_template``; a ``chat_template.jinja`` file next to them is used when the config has
    none, as recent ``transformers`` saves it). EOS is required; pad defaults to EOS."""
    directory = Path(path)
    hf = HFTokenizer(directory)  # checks tokenizer.json, needs the `tokenizers` package
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # the named-templates form: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    special = {key: text for key in SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key))) is not None}
    extra = config.get("additional_special_tokens")
    extras = (
        {"additional_special_tokens": [t for t in map(_token_text, extra) if t is not None]} if isinstance(extra, list) else {}
    )
    inner = hf._tok  # tokenizers.Tokenizer

    def token_id(key: str) -> int | None:
        text = special.get(key)
        if text is None:
            return None
        tid = inner.token_to_id(text)
        if tid is None:
            raise ValueError(f"{config_file}: {key}={text!r} is not a token of {hf.path}")
        return tid

    eos = token_id("eos_token")
    if eos is None:
        raise ValueError(
            f"{directory}: tokenizer_config.json names no eos_token — fine-tuning data needs one to end each response"
        )
    return ChatTokenizer(
        encode=hf.encode,
        eos_id=eos,
        pad_id=token_id("pad_token"),
        bos_id=token_id("bos_token"),
        chat_template=template,
        special_tokens={**special, **extras},
        decode=hf.decode,
        vocab_size=hf.vocab_size,
    )


def build_chat_tokenizer(path: str | Path | None) -> ChatTokenizer:
    """``None`` → byte-level (:func:`byte_chat_tokenizer`); otherwise a Hugging Face tokenizer directory."""
    return byte_chat_tokenizer() if path is None else load_chat_tokenizer(path)


# ------------------------------------------------------------------------------------------------ chat templates


# A chat template renders one conversation in milliseconds; a crafted one (nested loops, a string doubled in a
# namespace) could run for hours or fill memory inside the sandbox. Each render gets this much time and output;
# any intermediate string, list or integer argument larger than the output budget is refused as it is made.
TEMPLATE_SECONDS = 1.0
TEMPLATE_OUTPUT_CHARS = 4 << 20


class ChatTemplateError(ValueError):
    """The chat template itself is at fault (does not compile, breaks the sandbox, exceeds its budget), not a
    record: the fix is in the tokenizer's template (``data.tokenizer``)."""


def _compile_template(template: str) -> Any:
    try:
        return _compile_cached(template)
    except Exception as exc:
        import jinja2

        if isinstance(exc, jinja2.exceptions.TemplateError):
            raise ChatTemplateError(f"chat template does not compile: {exc}") from None
        raise


def _size_of(value: Any) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict, set)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) if abs(value) < 1 << 64 else value.bit_length() << 32  # a huge int: its digits
    return 0


@functools.lru_cache(maxsize=16)
def _compile_cached(template: str) -> Any:
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - torch brings jinja2
        raise RuntimeError("rendering a chat template needs the 'jinja2' package — pip install jinja2") from exc
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        # as transformers: older versions have known sandbox escapes, and templates are untrusted input
        raise RuntimeError(f"rendering a chat template needs jinja2>=3.1.6 (found {jinja2.__version__})")

    class GenerationTag(Extension):
        """``{% generation %}…{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace, refusing underscore-prefixed names (as transformers does)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            check(value)  # ns.s = ns.s ~ ns.s doubles a string each turn of a loop
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    budget = threading.local()  # this thread's render: its deadline (render_chat_template sets it)

    def check(*values: Any) -> None:
        deadline = getattr(budget, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise jinja2.exceptions.SecurityError(f"rendering took more than {TEMPLATE_SECONDS:g} s")
        for v in values:
            if _size_of(v) > TEMPLATE_OUTPUT_CHARS:
                raise jinja2.exceptions.SecurityError(f"a value larger than {TEMPLATE_OUTPUT_CHARS:,} characters")

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with the clock and sizes checked at every call, attribute, item and arithmetic operator
        (a loop runs ``range``, reads ``loop.*`` or ``message[...]``: the checks run every few microseconds)."""

        intercepted_binops = frozenset({"*", "**", "+", "//", "%"})

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            check(*args, *kwargs.values())
            result = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
            check(result)
            return result

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            check(left, right)
            if operator == "**" and _size_of(left) > 1 and _size_of(right) > 64:
                raise jinja2.exceptions.SecurityError("an exponent above 64")
            repeats = operator == "*" and any(isinstance(v, (str, list, tuple)) for v in (left, right))
            if repeats and _size_of(left) * max(_size_of(right), 1) > TEMPLATE_OUTPUT_CHARS:
                raise jinja2.exceptions.SecurityError(f"a value larger than {TEMPLATE_OUTPUT_CHARS:,} characters")
            result = ImmutableSandboxedEnvironment.call_binop(self, context, operator, left, right)
            check(result)
            return result

        def getattr(self, obj: Any, attribute: str) -> Any:
            check()
            return ImmutableSandboxedEnvironment.getattr(self, obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            check()
            return ImmutableSandboxedEnvironment.getitem(self, obj, argument)

    def budgeted_filter(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
        def run(*args: Any, **kwargs: Any) -> Any:
            check(*(a for a in args if isinstance(a, int)), *kwargs.values())  # center(10**9), indent(10**9)
            result = f(*args, **kwargs)
            check(result)
            return result

        return run

    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.nxdt_budget = budget
    env.filters = {name: budgeted_filter(f) for name, f in env.filters.items()}
    env.filters["tojson"] = budgeted_filter(tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    return env.from_string(template)


def _rendered(compiled: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, variables: dict) -> str:
    parts, size = [], 0
    for part in compiled.generate(
        messages=[dict(m) for m in messages],
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **variables,
    ):
        size += len(part)
        if size > TEMPLATE_OUTPUT_CHARS:
            raise ChatTemplateError(f"chat template: renders more than {TEMPLATE_OUTPUT_CHARS:,} characters for one record")
        parts.append(part)
    return "".join(parts)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """Render a Hugging Face chat template exactly as ``tokenizer.apply_chat_template(messages, tokenize=False)``
    does: variables ``messages``, ``tools=None``, ``documents=None``, ``add_generation_prompt`` and the special
    tokens (``bos_token``, ``eos_token``, …; ``kwargs`` override them). A template error (a syntax error,
    ``raise_exception(...)``, a sandbox violation) becomes a ``ValueError`` carrying its message."""
    variables = {**(special_tokens or {}), **kwargs}
    compiled = _compile_template(template)
    import jinja2  # loaded by _compile_template

    budget = compiled.environment.nxdt_budget
    budget.deadline = time.monotonic() + TEMPLATE_SECONDS
    try:
        with collector_paused():  # a collection of the whole process is not the template's time (nxdt.collector)
            return _rendered(compiled, messages, add_generation_prompt, variables)
    except jinja2.exceptions.SecurityError as exc:  # the sandbox or the budget: the template's fault
        raise ChatTemplateError(f"chat template: {exc}") from None
    except (RecursionError, MemoryError, OverflowError) as exc:
        raise ChatTemplateError(f"chat template: {type(exc).__name__} while rendering") from None
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template: {exc}") from None
    finally:
        budget.deadline = None


def render_plain_chat(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
    """The plain chat template (no tokenizer template): ``"{role}: {content}\\n"`` per message, then
    ``"assistant: "`` when a generation prompt is asked for."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def is_message_list(value: Any) -> bool:
    """A non-empty list of ``{"role": str, "content": str}`` messages (a conversational prompt, TRL's
    ``is_conversational``)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    )


def render_generation_prompt(tok: ChatTokenizer, messages: Sequence[Mapping[str, Any]], *, use_chat_template: bool = True) -> str:
    """The text a model continues with the assistant's turn: the tokenizer's chat template with the generation prompt
    (``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``, as TRL's GRPOTrainer renders a
    conversational prompt) when it has one and ``use_chat_template``; else the plain template ending ``"assistant: "``."""
    if use_chat_template and tok.chat_template is not None:
        return render_chat_template(tok.chat_template, messages, add_generation_prompt=True, special_tokens=tok.special_tokens)
    return render_plain_chat(messages, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------------ records


def read_jsonl(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` file (blank lines skipped), the first ``limit`` only if given
    (NxDT's ``data.dev_choose_samples``). A line that is not a JSON object fails naming the file and line."""
    records: list[dict[str, Any]] = []
    for lineno, line in read_lines(path):  # a regular file, each line under MAX_RECORD_BYTES (nxdt/data/files.py)
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        if len(records) >= MAX_RECORDS:
            raise DataFileError(
                f"{path}: more than {MAX_RECORDS:,} records; train on a part (data.dev_choose_samples) or split the data"
            )
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({getattr(exc, 'msg', 'nested too deeply')})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: a record must be a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def check_instruction_record(record: Mapping[str, Any], where: str = "record") -> str:
    """The record's kind, ``"io"`` (input/output) or ``"messages"``; one clear ``ValueError`` otherwise."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a record must be an object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not _is_text(m.get("role")) or not _is_text(m.get("content")):
                raise ValueError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: 'messages' has no 'assistant' message — nothing to train on")
        return "messages"
    if "input" in record or "output" in record:
        for key in ("input", "output"):
            if not _is_text(record.get(key)):
                raise ValueError(
                    f"{where}: needs string '{key}' (an instruction record has 'input' and 'output', and "
                    f"optionally 'instruction')"
                )
        if "instruction" in record and not _is_text(record["instruction"]):
            raise ValueError(f"{where}: 'instruction' must be a string")
        if not record["output"]:
            raise ValueError(f"{where}: 'output' is empty — nothing to train on")
        return "io"
    raise ValueError(
        f"{where}: needs 'input' and 'output' (and optionally 'instruction'), or 'messages'; it has {sorted(record)}"
    )


def io_user_text(record: Mapping[str, Any]) -> str:
    """The user turn of an ``input``/``output`` record under a chat template: instruction + blank line + input."""
    instruction = record.get("instruction")
    return f"{instruction}\n\n{record['input']}" if instruction else record["input"]


def plain_prompt(record: Mapping[str, Any]) -> str:
    """The plain template's prompt of an ``input``/``output`` record: ``"{instruction}\\n{input}\\n"``."""
    instruction = record.get("instruction")
    return (f"{instruction}\n" if instruction else "") + f"{record['input']}\n"


def chat_segments(messages: Sequence[Mapping[str, Any]], render: Callable[..., str]) -> list[tuple[str, bool]]:
    """Cut a conversation's rendering into ``(text, trained)`` pieces at the assistant messages' boundaries.

    ``render(messages, add_generation_prompt=...)`` is the template. For each assistant message i the text up to
    ``render(messages[:i], add_generation_prompt=True)`` is prompt, up to ``render(messages[:i+1])`` is its reply
    (trained); what follows the last reply is prompt again. Each rendering must extend the previous one."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], add_generation_prompt=True)
        through = render(messages[: i + 1], add_generation_prompt=False)
        if not before.startswith(done) or not through.startswith(before):
            raise ValueError(
                f"chat template: the rendering up to message {i} does not extend the previous one, so the "
                f"assistant reply cannot be told from the prompt (the template must render a conversation "
                f"prefix as a prefix of the full rendering)"
            )
        pieces += [(before[len(done) :], False), (through[len(before) :], True)]
        done = through
    full = render(messages, add_generation_prompt=False)
    if not full.startswith(done):
        raise ValueError("chat template: the full rendering does not extend the rendering up to the last assistant reply")
    pieces.append((full[len(done) :], False))
    return [(text, trained) for text, trained in pieces if text]


def tokenize_record(
    record: Mapping[str, Any], tok: ChatTokenizer, *, use_chat_template: bool | None = None, where: str = "record"
) -> tuple[list[int], list[bool]]:
    """``(tokens, trained)`` of one instruction record (see the module docstring for the rendering and masking
    rules). ``use_chat_template``: None = when the tokenizer has one, True = required, False = plain template.
    Errors name the record as ``where``."""
    kind = check_instruction_record(record, where)
    if use_chat_template and tok.chat_template is None:
        raise ValueError("use_chat_template=True but the tokenizer has no chat_template")
    template = tok.chat_template if use_chat_template is not False else None
    templated = template is not None
    render: Callable[..., str] = (
        render_plain_chat
        if template is None
        else functools.partial(render_chat_template, template, special_tokens=tok.special_tokens)
    )
    if kind == "messages" or templated:
        messages = (
            record["messages"]
            if kind == "messages"
            else [{"role": "user", "content": io_user_text(record)}, {"role": "assistant", "content": record["output"]}]
        )
        try:
            pieces = chat_segments(messages, render)
        except ChatTemplateError as exc:  # keeps its type: the template is at fault, not this record
            raise ChatTemplateError(f"{exc} (rendering {where})") from None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    else:
        pieces = [(plain_prompt(record), False), (record["output"], True)]
    tokens: list[int] = []
    trained: list[bool] = []
    if not templated and tok.bos_id is not None:
        tokens.append(tok.bos_id)
        trained.append(False)
    for text, is_trained in pieces:
        ids = tok.encode(text)
        tokens += ids
        trained += [is_trained] * len(ids)
    # the plain template: EOS ends the response (as NxDT's SFT data and TRL's SFTTrainer for plain text); a chat
    # template writes its own end of turn (ChatML's <|im_end|>), and TRL's SFTTrainer appends nothing to a
    # conversation rendered by one (sft_trainer.py `_prepare_dataset`: "Add EOS token if needed: non-conversational only")
    if not templated and (not tokens or tokens[-1] != tok.eos_id):
        tokens.append(tok.eos_id)
        trained.append(True)
    return tokens, trained


# ------------------------------------------------------------------------------------------------ examples


@dataclass
class BuildStats:
    """What building did to the records — nothing is dropped or cut without being counted here."""

    records: int = 0  # records read
    examples: int = 0  # records kept (each is one example)
    truncated: int = 0  # kept records that were cut to fit
    prompt_truncated: int = 0  # … of which the prompt was cut from the left
    response_truncated: int = 0  # … of which the response was cut from the right
    dropped: int = 0  # records not kept (too long under "drop", or no trained token left)
    sequences: int = 0  # rows of the batch
    tokens: int = 0  # non-pad positions
    label_tokens: int = 0  # positions with a label (contributing to the loss)
    pad_tokens: int = 0  # pad positions

    def summary(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def fit_record(
    tokens: list[int], trained: list[bool], seq_length: int, truncation: str, stats: BuildStats | None = None
) -> tuple[list[int], list[bool]] | None:
    """Apply the truncation rule (module docstring) to one tokenized record: the record, cut if needed, or None
    when it is dropped. ``stats`` counts truncated / prompt_truncated / response_truncated / dropped."""
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation={truncation!r}: expected one of {TRUNCATION_MODES}")
    stats = stats if stats is not None else BuildStats()
    budget = seq_length + 1  # N tokens give N - 1 positions
    cut_prompt = cut_response = False
    if len(tokens) > budget:
        if truncation == "drop":
            stats.dropped += 1
            return None
        prompt = next((i for i, t in enumerate(trained) if t), len(trained))
        cut = min(len(tokens) - budget, max(0, prompt - min(prompt, budget // 2)))
        if cut:
            tokens, trained, cut_prompt = tokens[cut:], trained[cut:], True
        if len(tokens) > budget:
            tokens, trained, cut_response = tokens[:budget], trained[:budget], True
    if len(tokens) < 2 or not any(trained[1:]):  # no label left (trained[0] is never a label)
        stats.dropped += 1
        return None
    if cut_prompt or cut_response:
        stats.truncated += 1
        stats.prompt_truncated += cut_prompt
        stats.response_truncated += cut_response
    return tokens, trained


def record_example(tokens: Sequence[int], trained: Sequence[bool]) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one record in nxdt's shift convention: ``input_ids = tokens[:-1]``,
    ``labels[t] = tokens[t+1]`` if trained else -100."""
    return list(tokens[:-1]), [t if m else IGNORE_INDEX for t, m in zip(tokens[1:], trained[1:])]


def pack_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_length: int, pad_id: int, *, packing: bool
) -> dict[str, torch.Tensor]:
    """Lay ``(input_ids, labels)`` examples (each at most ``seq_length`` long) into rows: see the module
    docstring for ``packing`` and the four tensors."""
    rows: list[list[tuple[Sequence[int], Sequence[int]]]] = []
    used = seq_length  # forces a new row for the first example
    for ids, labels in examples:
        if len(ids) > seq_length:
            raise ValueError(f"an example of {len(ids)} positions does not fit seq_length={seq_length}")
        if not packing or used + len(ids) > seq_length:
            rows.append([])
            used = 0
        rows[-1].append((ids, labels))
        used += len(ids)
    n = len(rows)
    out = {
        "input_ids": torch.full((n, seq_length), pad_id, dtype=torch.long),
        "labels": torch.full((n, seq_length), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.zeros((n, seq_length), dtype=torch.long),
        "segment_ids": torch.zeros((n, seq_length), dtype=torch.long),
    }
    for r, row in enumerate(rows):
        start = 0
        for segment, (ids, labels) in enumerate(row, 1):
            end = start + len(ids)
            out["input_ids"][r, start:end] = torch.tensor(ids, dtype=torch.long)
            out["labels"][r, start:end] = torch.tensor(labels, dtype=torch.long)
            out["position_ids"][r, start:end] = torch.arange(len(ids))
            out["segment_ids"][r, start:end] = segment
            start = end
    return out


def concat_rows(
    records: Sequence[Sequence[int]], seq_length: int, eos_id: int, pad_id: int, stats: BuildStats | None = None
) -> dict[str, torch.Tensor]:
    """Tokenized records laid out as NxD Training's ``ConcatDataset.pack_datasets`` does (module docstring,
    ``packing_style="concat"``), in nxdt's shift convention. ``stats`` counts ``examples`` and ``dropped``."""
    stats = stats if stats is not None else BuildStats()
    rows: list[tuple[list[int], list[int]]] = []  # (ids, unshifted labels), as NxDT builds them
    i = 0
    while i < len(records):  # ConcatDataset.py lines 51-70
        ids: list[int] = []
        labels: list[int] = []
        # line 56: strictly below chunk_size, so the record and its separator fit
        while i < len(records) and len(ids) + len(records[i]) < seq_length:
            # line 59 extends every key with the record's input_ids + [pad_id_map[key]]: the separator is EOS in
            # input_ids (line 53) and -100 in labels (model_alignment_data_module.py line 193)
            ids += [*records[i], eos_id]
            labels += [*records[i], IGNORE_INDEX]
            stats.examples += 1
            i += 1
        if i < len(records) and len(records[i]) > seq_length - 1:  # line 64: too long for any row, skipped
            stats.dropped += 1
            i += 1
        if ids:
            rows.append((ids, labels))
    n = len(rows)
    out = {
        "input_ids": torch.full((n, seq_length), pad_id, dtype=torch.long),
        "labels": torch.full((n, seq_length), IGNORE_INDEX, dtype=torch.long),
        # NxDT's HF model numbers every position 0..S-1 (modeling_llama.py LlamaModel.forward, position_ids=None)
        "position_ids": torch.arange(seq_length, dtype=torch.long).repeat(n, 1),
        "segment_ids": torch.zeros((n, seq_length), dtype=torch.long),
    }
    for r, (ids, labels) in enumerate(rows):
        out["input_ids"][r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        # NxDT's model scores logits[..., :-1] against labels[..., 1:] (modeling_llama.py LlamaForCausalLM.forward)
        out["labels"][r, : len(ids) - 1] = torch.tensor(labels[1:], dtype=torch.long)
        out["segment_ids"][r, : len(ids)] = 1
    return out


def build_sft_examples(
    records: Iterable[Mapping[str, Any]],
    tok: ChatTokenizer,
    seq_length: int,
    *,
    packing: bool,
    truncation: str = "truncate",
    use_chat_template: bool | None = None,
    packing_style: str = "per_record",
) -> tuple[dict[str, torch.Tensor], BuildStats]:
    """Instruction records → a batch of SFT sequences and the :class:`BuildStats` of what happened.

    Each record is tokenized (:func:`tokenize_record`), fitted to ``seq_length`` (:func:`fit_record`), turned into
    shifted ``(input_ids, labels)`` (:func:`record_example`) and laid out by :func:`pack_examples`; under
    ``packing_style="concat"`` the tokenized records go to :func:`concat_rows` instead. A malformed record fails
    with its index."""
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length}: must be positive")
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation={truncation!r}: expected one of {TRUNCATION_MODES}")
    if packing_style not in PACKING_STYLES:
        raise ValueError(f"packing_style={packing_style!r}: expected one of {PACKING_STYLES}")
    if packing_style == "concat" and not packing:
        raise ValueError("packing_style='concat' is a packed layout: it needs packing=True")
    stats = BuildStats()
    examples = []
    token_lists = []
    for index, record in enumerate(records):
        stats.records += 1
        tokens, trained = tokenize_record(record, tok, use_chat_template=use_chat_template, where=f"record {index}")
        if packing_style == "concat":
            token_lists.append(tokens)
            continue
        fitted = fit_record(tokens, trained, seq_length, truncation, stats)
        if fitted is not None:
            examples.append(record_example(*fitted))
    if packing_style == "concat":
        batch = concat_rows(token_lists, seq_length, tok.eos_id, tok.pad, stats)
    else:
        stats.examples = len(examples)
        batch = pack_examples(examples, seq_length, tok.pad, packing=packing)
    stats.sequences = batch["input_ids"].shape[0]
    stats.tokens = int((batch["segment_ids"] > 0).sum())
    stats.label_tokens = int((batch["labels"] != IGNORE_INDEX).sum())
    stats.pad_tokens = stats.sequences * seq_length - stats.tokens
    return batch, stats


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask [..., S, S] (True = may attend) keeping attention inside each record: query t sees
    key s iff s ≤ t and ``segment_ids[s] == segment_ids[t]`` (padding, segment 0, sees only padding)."""
    s = segment_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return causal & (segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2))


def split_segments(batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The records of a batch, in order, each as ``{input_ids, labels, position_ids}`` (1-D): what packed and
    unpacked layouts of the same records must agree on."""
    out = []
    for r in range(batch["segment_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in range(1, int(seg.max()) + 1 if seg.numel() else 1):
            where = seg == s
            out.append({k: batch[k][r][where] for k in ("input_ids", "labels", "position_ids")})
    return out


# ------------------------------------------------------------------------------------------------ datasets


def read_instruction_records(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """NxDT's ``data.train_dir`` / ``val_dir`` for fine-tuning: a ``.jsonl`` file, a directory of ``*.jsonl`` files
    (read in name order), or a ``save_to_disk`` directory (Arrow; needs pyarrow). The first ``limit`` records only if
    given (``data.dev_choose_samples``). Records are not checked here (:func:`check_instruction_record` does)."""
    from .hf_dataset import is_saved_dataset, read_saved_records

    path = Path(path).expanduser()
    if path.is_dir() and is_saved_dataset(path):
        return read_saved_records(path, limit)
    files = sorted(f for f in path.glob("*.jsonl") if not_regular(f) is None) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no *.jsonl files and no save_to_disk dataset (state.json) there")
    records: list[dict[str, Any]] = []
    for file in files:
        records += read_jsonl(file, None if limit is None else limit - len(records))
        if limit is not None and len(records) >= limit:
            break
    return records


class SFTDataset(torch.utils.data.Dataset):
    """The rows of :func:`build_sft_examples` (``input_ids``, ``labels``, ``position_ids``, ``segment_ids``, each
    [seq_length]) as a map-style dataset; ``stats`` says what building did to the records."""

    def __init__(self, batch: Mapping[str, torch.Tensor], stats: BuildStats) -> None:
        self.batch, self.stats = dict(batch), stats

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, Any]],
        tok: ChatTokenizer,
        seq_length: int,
        *,
        packing: bool,
        truncation: str = "truncate",
        packing_style: str = "per_record",
    ) -> "SFTDataset":
        batch, stats = build_sft_examples(
            records, tok, seq_length, packing=packing, truncation=truncation, packing_style=packing_style
        )
        if stats.examples == 0:
            raise ValueError(
                f"no record left to train on ({stats.records} read, {stats.dropped} dropped as longer than "
                f"seq_length={seq_length} or without a response token)"
            )
        return cls(batch, stats)

    def __len__(self) -> int:
        return int(self.batch["input_ids"].shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: value[index] for name, value in self.batch.items()}


def sft_report(stats: BuildStats, what: str = "train") -> str:
    """One line for the user: what building the examples did, every cut or dropped record counted."""
    return (
        f"{what}: {stats.records} instruction records → {stats.sequences} sequences of {stats.examples} records "
        f"({stats.label_tokens} trained tokens, {stats.pad_tokens} pad); {stats.truncated} truncated "
        f"({stats.prompt_truncated} prompt, {stats.response_truncated} response), {stats.dropped} dropped"
    )


# ------------------------------------------------------------------------------------------------ shipped samples

TASKS = ("add", "reverse", "upper")


def _task(rng: random.Random, kind: str) -> tuple[str, str, str, str]:
    """(instruction, input, correct output, a wrong output) of one synthetic task."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    if kind == "add":
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        offset = rng.choice([-10, -2, -1, 1, 2, 10])
        wrong_sum = a + b + offset if a + b + offset >= 0 else a + b - offset
        return "Add the numbers.", f"{a}+{b}", str(a + b), str(wrong_sum)
    word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 6)))
    if kind == "reverse":
        wrong = word if word != word[::-1] else word + word[0]
        return "Reverse the letters.", word, word[::-1], wrong
    upper = word.upper()
    return "Write it in capitals.", word, upper, upper[:-1] + word[-1]


def make_instruction_samples(n: int = 200, seed: int = 0) -> list[dict[str, str]]:
    """The shipped ``samples/instructions.jsonl``: ``n`` synthetic ``instruction``/``input``/``output`` records,
    deterministic in ``seed``, cycling three tasks a tiny byte-level model can learn — add two numbers 0–49
    (``"Add the numbers."``, ``"17+25"`` → ``"42"``), reverse 3–6 lowercase letters (``"Reverse the letters."``),
    and upper-case them (``"Write it in capitals."``). Regenerate with
    ``write_jsonl(SAMPLE_INSTRUCTIONS, make_instruction_samples())``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        instruction, text, output, _ = _task(rng, TASKS[i % len(TASKS)])
        out.append({"instruction": instruction, "input": text, "output": output})
    return out


def write_jsonl(path: str | Path, records: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object per line (UTF-8, keys in the record's order)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
