"""Preference (DPO / ORPO) data: ``{"prompt", "chosen", "rejected"}`` records → chosen and rejected sequences.

**Records.** ``prompt``, ``chosen`` and ``rejected`` are non-empty strings. As in TRL's conversational form,
``prompt`` may instead be a list of ``{"role", "content"}`` messages and ``chosen`` / ``rejected`` a list holding
one ``assistant`` message.

**Rendering** (the same rules as SFT, :mod:`nxdt.data.instructions`). With the tokenizer's chat template the
prompt is ``render([user: prompt], add_generation_prompt=True)`` (or the message list); without one, the plain
template: the tokenizer's BOS if any, then ``"{prompt}\\n"`` — exactly an ``input``-only instruction record's
prompt, so SFT and preference tuning on the shipped samples see one format. Each response is tokenized on its
own and EOS appended (unless it already ends with it).

**Truncation** (as TRL's DPO/ORPO, counted in :class:`PreferenceStats`):

1. a prompt longer than ``max_prompt_length`` tokens keeps its first (``truncation_mode="keep_start"``) or last
   (``"keep_end"``, the default, as TRL) ``max_prompt_length`` tokens;
2. a response that makes prompt + response longer than ``seq_length + 1`` tokens is cut from the right (its EOS
   is lost);
3. a pair whose prompt leaves no room for one response token is dropped.

**Batch** (:func:`build_preference_batch`): LongTensors [2B, seq_length] — rows 0..B-1 the chosen sequences,
rows B..2B-1 the rejected ones of the same pairs in the same order — in nxdt's shift convention
(``input_ids = tokens[:-1]``, ``labels[t] = tokens[t+1]``, prompt and padding labelled -100), with
``position_ids`` (0.. per row, 0 on padding) and ``segment_ids`` (1 on the sequence, 0 on padding). The
per-sequence log-probs the objectives need are then ``sequence_log_probs(logits, labels)`` split at row B.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from .instructions import (
    IGNORE_INDEX,
    TASKS,
    ChatTokenizer,
    _task,
    pack_examples,
    plain_prompt,
    record_example,
    render_chat_template,
    render_plain_chat,
)

TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class PreferenceStats:
    """What building did to the pairs; nothing is cut or dropped uncounted."""

    records: int = 0
    pairs: int = 0
    prompt_truncated: int = 0  # prompts cut to max_prompt_length
    response_truncated: int = 0  # pairs with the chosen or the rejected response cut to fit seq_length
    dropped: int = 0  # pairs whose prompt left no room for a response

    def summary(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def _messages_ok(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    )


def _response_text(value: Any, key: str, where: str) -> str:
    if isinstance(value, list):
        if not (_messages_ok(value) and len(value) == 1 and value[0]["role"] == "assistant"):
            raise ValueError(f"{where}: '{key}' as a list must hold exactly one assistant message")
        value = value[0]["content"]
    if not isinstance(value, str) or not value:
        raise ValueError(
            f"{where}: '{key}' must be a non-empty string (a preference record has 'prompt', 'chosen' and 'rejected')"
        )
    return value


def check_preference_record(record: Mapping[str, Any], where: str = "record") -> tuple[Any, str, str]:
    """``(prompt, chosen text, rejected text)`` of a valid record; one clear ``ValueError`` otherwise."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a record must be an object, got {type(record).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        raise ValueError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'; missing {missing}")
    prompt = record["prompt"]
    if not (isinstance(prompt, str) and prompt) and not _messages_ok(prompt):
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or a list of {{'role', 'content'}} messages")
    return prompt, _response_text(record["chosen"], "chosen", where), _response_text(record["rejected"], "rejected", where)


def tokenize_preference(
    record: Mapping[str, Any], tok: ChatTokenizer, *, use_chat_template: bool | None = None, where: str = "record"
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, chosen ids, rejected ids)``, untruncated; responses end with EOS."""
    prompt, chosen, rejected = check_preference_record(record, where)
    if use_chat_template and tok.chat_template is None:
        raise ValueError("use_chat_template=True but the tokenizer has no chat_template")
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tok.chat_template is not None and use_chat_template is not False:
        prompt_ids = tok.encode(
            render_chat_template(tok.chat_template, messages, add_generation_prompt=True, special_tokens=tok.special_tokens)
        )
    else:
        text = (
            render_plain_chat(messages, add_generation_prompt=True)
            if isinstance(prompt, list)
            else plain_prompt({"input": prompt})
        )
        prompt_ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)

    def response(text: str) -> list[int]:
        ids = tok.encode(text)
        return ids if ids and ids[-1] == tok.eos_id else ids + [tok.eos_id]

    return prompt_ids, response(chosen), response(rejected)


def build_preference_batch(
    records: Iterable[Mapping[str, Any]],
    tok: ChatTokenizer,
    seq_length: int,
    *,
    max_prompt_length: int | None = None,
    truncation_mode: str = "keep_end",
    use_chat_template: bool | None = None,
) -> tuple[dict[str, torch.Tensor], PreferenceStats]:
    """Preference records → one batch (chosen rows, then rejected rows) and the :class:`PreferenceStats`.
    See the module docstring for the rules; a malformed record fails with its index."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode={truncation_mode!r}: expected one of {TRUNCATION_MODES} (as TRL)")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length={max_prompt_length}: must be positive (or None)")
    stats = PreferenceStats()
    budget = seq_length + 1
    chosen_rows: list[tuple[list[int], list[int]]] = []
    rejected_rows: list[tuple[list[int], list[int]]] = []
    for index, record in enumerate(records):
        stats.records += 1
        prompt, chosen, rejected = tokenize_preference(record, tok, use_chat_template=use_chat_template, where=f"record {index}")
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            prompt = prompt[:max_prompt_length] if truncation_mode == "keep_start" else prompt[-max_prompt_length:]
            stats.prompt_truncated += 1
        room = budget - len(prompt)
        if room < 1:
            stats.dropped += 1
            continue
        if len(chosen) > room or len(rejected) > room:
            stats.response_truncated += 1
        pair = []
        for resp in (chosen[:room], rejected[:room]):
            tokens = prompt + resp
            pair.append(record_example(tokens, [False] * len(prompt) + [True] * len(resp)))
        chosen_rows.append(pair[0])
        rejected_rows.append(pair[1])
        stats.pairs += 1
    batch = pack_examples(chosen_rows + rejected_rows, seq_length, tok.pad, packing=False)
    return batch, stats


def split_chosen_rejected(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row values of a preference batch (e.g. sequence log-probs [2B]) → (chosen [B], rejected [B])."""
    if values.shape[0] % 2:
        raise ValueError(f"a preference batch has an even number of rows (chosen then rejected), got {values.shape[0]}")
    half = values.shape[0] // 2
    return values[:half], values[half:]


PAIR_FIELDS = ("input_ids", "labels", "position_ids", "segment_ids")


class PreferenceDataset(torch.utils.data.Dataset):
    """One sample = one pair: each of :data:`PAIR_FIELDS` as [2, seq_length] (row 0 the chosen sequence, row 1 the
    rejected one), so a sampler that hands out samples never separates a pair; plus ``ref_logps`` [2] (the reference
    model's summed log-probabilities of chosen and rejected) once :meth:`set_reference_log_probs` has stored them, keyed
    by the sample's index. ``stats`` says what building did to the records."""

    def __init__(self, batch: Mapping[str, torch.Tensor], stats: PreferenceStats) -> None:
        self.batch, self.stats = dict(batch), stats
        self.pairs = int(batch["input_ids"].shape[0]) // 2
        self.ref_logps: torch.Tensor | None = None

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, Any]],
        tok: ChatTokenizer,
        seq_length: int,
        *,
        max_prompt_length: int | None = None,
        truncation_mode: str = "keep_end",
    ) -> "PreferenceDataset":
        records = list(records)
        same = [i for i, r in enumerate(records) if isinstance(r, Mapping) and r.get("chosen") == r.get("rejected")]
        if records and len(same) == len(records):  # the DPO/ORPO margin is 0 for every pair: nothing to learn
            raise ValueError(
                f"every record has 'chosen' equal to 'rejected' ({len(same)} of {len(records)}): a preference pair needs two "
                "different responses, the preferred one as 'chosen'"
            )
        batch, stats = build_preference_batch(
            records, tok, seq_length, max_prompt_length=max_prompt_length, truncation_mode=truncation_mode
        )
        if stats.pairs == 0:
            raise ValueError(
                f"no preference pair left to train on ({stats.records} read, {stats.dropped} dropped: the "
                f"prompt left no room for a response in seq_length={seq_length})"
            )
        return cls(batch, stats)

    def __len__(self) -> int:
        return self.pairs

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {name: torch.stack([self.batch[name][index], self.batch[name][self.pairs + index]]) for name in PAIR_FIELDS}
        if self.ref_logps is not None:
            item["ref_logps"] = self.ref_logps[index]
        return item

    def set_reference_log_probs(self, table: torch.Tensor) -> None:
        """``table`` [len(self), 2]: (chosen, rejected) reference log-probabilities of every pair, by sample index."""
        if tuple(table.shape) != (self.pairs, 2):
            raise ValueError(f"reference log-probabilities {tuple(table.shape)}: expected ({self.pairs}, 2)")
        self.ref_logps = table.detach().to(torch.float64).clone()


def sequence_labels(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every position's next token inside its sequence, prompt included (padding -100): the labels of TRL's ORPO NLL
    (``ORPOTrainer.concatenated_forward``: ``input_ids`` where ``attention_mask`` is 1, shifted by one). A prompt
    position (labelled -100, next position in the same segment) gets ``input_ids[t + 1]``; the rest keep ``labels``.
    A micro-batch laid out by :func:`pair_rows` carries them (``sequence_labels``), computed on the whole rows: a part
    of the sequence (context parallelism) does not hold every next token."""
    if "sequence_labels" in micro_batch:
        return micro_batch["sequence_labels"]
    labels, ids, segments = micro_batch["labels"], micro_batch["input_ids"], micro_batch["segment_ids"]
    next_segments = torch.cat([segments[..., 1:], torch.zeros_like(segments[..., :1])], dim=-1)
    prompt = (labels == IGNORE_INDEX) & (segments != 0) & (next_segments == segments)
    return torch.where(prompt, torch.roll(ids, -1, dims=-1), labels)


def pair_rows(micro_batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collated micro-batch of ``b`` pairs (each of :data:`PAIR_FIELDS` [b, 2, S]) as the model reads it: [2b, S],
    rows 0..b-1 the chosen sequences, rows b..2b-1 the rejected ones of the same pairs (the layout of
    :func:`build_preference_batch`, split by :func:`split_chosen_rejected`), with :func:`sequence_labels` of every row.
    Other fields (``ref_logps`` [b, 2]) stay per pair."""
    out = dict(micro_batch)
    for name in PAIR_FIELDS:
        value = micro_batch[name]
        if value.dim() != 3 or value.shape[1] != 2:
            raise ValueError(f"pair_rows: {name} {tuple(value.shape)} is not [pairs, 2, seq_length]")
        out[name] = torch.cat([value[:, 0], value[:, 1]])
    out.pop("sequence_labels", None)  # a laid-out micro-batch's own, never a stale one
    out["sequence_labels"] = sequence_labels(out)
    return out


def preference_report(stats: PreferenceStats, what: str = "train") -> str:
    """One line for the user: what building the pairs did, every cut or dropped pair counted."""
    return (
        f"{what}: {stats.records} preference records → {stats.pairs} pairs (chosen and rejected in one micro-batch); "
        f"{stats.prompt_truncated} prompts truncated, {stats.response_truncated} pairs with a response truncated, "
        f"{stats.dropped} dropped"
    )


def make_preference_samples(n: int = 200, seed: int = 1) -> list[dict[str, str]]:
    """The shipped ``samples/preferences.jsonl``: ``n`` synthetic ``prompt``/``chosen``/``rejected`` triples,
    deterministic in ``seed``, on the three tasks of :func:`~nxdt.data.instructions.make_instruction_samples`
    (prompt ``"{instruction}\\n{input}"``): ``chosen`` is the correct answer, ``rejected`` a wrong one (a sum off by
    1, 2 or 10; the letters not reversed; the last letter left lower-case)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        instruction, text, right, wrong = _task(rng, TASKS[i % len(TASKS)])
        out.append({"prompt": f"{instruction}\n{text}", "chosen": right, "rejected": wrong})
    return out


__all__ = [
    "TRUNCATION_MODES",
    "PreferenceStats",
    "check_preference_record",
    "tokenize_preference",
    "build_preference_batch",
    "split_chosen_rejected",
    "make_preference_samples",
    "IGNORE_INDEX",
    "PAIR_FIELDS",
    "PreferenceDataset",
    "pair_rows",
    "preference_report",
]
