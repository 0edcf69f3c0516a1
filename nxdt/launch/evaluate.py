"""``nxdt eval``: perplexity of a model on a text, and generation metrics on an instruction set.

MODEL is an nxdt checkpoint (``<run>/checkpoints/step-<N>``, any layout: its run's ``config.yaml`` gives the model and
tokenizer) or a Hugging Face model directory (``config.json`` + safetensors, e.g. what ``nxdt checkpoint export-hf``
writes; its ``tokenizer.json`` if there, else byte-level).

**Perplexity** (``nxdt eval perplexity MODEL --data FILE``). The data's tokens — a text file's whole text, or a JSONL
file's ``text`` fields one record after the other, nothing between them — are cut into non-overlapping windows of
``seq_length`` tokens (``--seq-length``; default the run's ``data.seq_length``, a Hugging Face model's
``max_position_embeddings`` capped at 2048). Each window is read on its own, positions from 0, and every token of it but
the first is predicted from the tokens before it in the window; the last, shorter window is read the same way (a window
of one token predicts nothing and is left out). Perplexity = exp(total NLL / predicted tokens): the mean negative
log-likelihood per predicted token over all windows, token-weighted (not a mean of window means). This is Hugging
Face's perplexity guide (transformers docs, "Perplexity of fixed-length models") with ``stride == max_length``.
``--ranks N`` splits the windows over N data-parallel processes (window i on rank i mod N), each holding the whole model,
and sums the NLL and the token count with nxdt's all-reduce. A checkpoint of any training layout (TP, PP, ZeRO-1, FSDP,
EP) is read consolidated (``nxdt.launch.model_source.load_model``: the shards joined as ``nxdt checkpoint
consolidate`` joins them), so the evaluation itself never runs tensor- or pipeline-parallel; LoRA adapter checkpoints
are refused by name (export a merged model first). tests/test_reshard.py checks a TP2×DP2 and a PP2 checkpoint's
perplexity against transformers' on their exports.

**Generation** (``nxdt eval generate MODEL --data FILE.jsonl``). Each record is an SFT record as ``nxdt train
+recipe=sft`` reads it (``input``/``output`` with optional ``instruction``, or ``messages``), rendered as training renders
it (``nxdt.data.instructions.tokenize_record``): the tokens before the first trained token are the prompt, the first
trained span (without its EOS) is the reference. The model continues each prompt greedily
(``nxdt.models.generate.greedy_generate``, up to ``--max-new-tokens``, stopping at EOS), and the decoded answer is
scored against the reference with what NxD Training's SFT evaluation example computes
(examples/sft_evaluation: ``CustomAccuracy``, exact string equality, and torchmetrics' ``ROUGEScore``), ROUGE-1/2/L
and ROUGE-Lsum computed here from their definitions (:func:`rouge_n`, :func:`rouge_l`, :func:`rouge_lsum`), each a
mean over records. ROUGE-Lsum's sentences are cut at sentence-ending punctuation (:func:`sentences`), where
torchmetrics uses nltk's punkt model: the scores agree where the two cut alike.

Results: a JSON file (``--out``, default ``eval-<kind>.json``) and a table on stdout. Bad input (no such model, a data
file without the fields needed) is one line on stderr, exit 2.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from nxdt.data.files import not_regular
from nxdt.launch.model_source import CommandError, check_fits, check_model_dir, check_output, load_model, write_output

USAGE = """usage: nxdt eval perplexity MODEL --data FILE [--seq-length N] [--batch-size N] [--ranks N] [--out FILE.json]
       nxdt eval generate MODEL --data FILE.jsonl [--max-new-tokens N] [--batch-size N] [--limit N] [--out FILE.json]

MODEL: an nxdt checkpoint (<run>/checkpoints/step-<N>) or a Hugging Face model directory (config.json + safetensors)
perplexity: exp(mean NLL per predicted token) over non-overlapping windows of --seq-length tokens of FILE
            (a text file, or JSONL with a 'text' field); --ranks N: N data-parallel processes
generate:   exact match and ROUGE-1/2/L/Lsum of greedy answers to FILE's SFT records (input/output or messages)"""


class EvalError(CommandError):
    """Bad input to ``nxdt eval``: ``str()`` is one line naming what and how to fix it."""


# ------------------------------------------------------------------------------------------------ metrics


def rouge_tokens(text: str) -> list[str]:
    """Lower-cased alphanumeric words: torchmetrics' default ROUGE normalisation (``[^a-z0-9]+`` → space, split),
    as NxD Training's SFT evaluation uses it (no stemmer)."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _prf(overlap: int, predicted: int, reference: int) -> dict[str, float]:
    precision = overlap / predicted if predicted else 0.0
    recall = overlap / reference if reference else 0.0
    f = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "fmeasure": f}


def rouge_n(prediction: str, reference: str, n: int) -> dict[str, float]:
    """ROUGE-N (Lin 2004): n-gram overlap (clipped counts) over the prediction's n-grams (precision) and the
    reference's (recall), F1 of the two."""

    def grams(words: list[str]) -> Counter:
        return Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))

    pred, ref = grams(rouge_tokens(prediction)), grams(rouge_tokens(reference))
    return _prf(sum((pred & ref).values()), sum(pred.values()), sum(ref.values()))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, one row at a time)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-L (Lin 2004, sentence level): R = LCS(X, Y)/m, P = LCS(X, Y)/n for a reference X of m words and a
    prediction Y of n words, F = (1 + β²)RP/(R + β²P) with β = 1 (torchmetrics' and rouge-score's choice)."""
    pred, ref = rouge_tokens(prediction), rouge_tokens(reference)
    return _prf(lcs_length(ref, pred), len(pred), len(ref))


def sentences(text: str) -> list[str]:
    """The sentences ROUGE-Lsum compares: the text cut after ``.``, ``!`` or ``?`` followed by white space. torchmetrics
    cuts with nltk's punkt model (``nltk.sent_tokenize``), which nxdt does not depend on; the two agree on such plain
    sentence ends and differ where punkt knows better (abbreviations such as "Dr. Smith", which this rule cuts)."""
    return [part for part in re.split(r"(?<=[.!?])\s+", text.strip()) if part]


def lcs_positions(reference: Sequence[str], candidate: Sequence[str]) -> list[int]:
    """The positions in ``reference`` of one longest common subsequence with ``candidate``: walked back from the ends
    of the LCS table, a match taken, else a step back in the candidate when that keeps a longer LCS, else in the
    reference — the tie-break of rouge-score's rouge_scorer.py (``_backtrack_norec``) and torchmetrics'
    ``_backtracked_lcs``, which decides which words a union LCS holds."""
    table = [[0] * (len(candidate) + 1) for _ in range(len(reference) + 1)]
    for i, r in enumerate(reference, 1):
        for j, c in enumerate(candidate, 1):
            table[i][j] = table[i - 1][j - 1] + 1 if r == c else max(table[i - 1][j], table[i][j - 1])
    i, j, positions = len(reference), len(candidate), []
    while i > 0 and j > 0:
        if reference[i - 1] == candidate[j - 1]:
            positions.append(i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return positions[::-1]


def rouge_lsum(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-Lsum, summary-level LCS (Lin 2004 §3.2, as rouge-score and torchmetrics compute it): for each reference
    sentence, the union of its LCS positions with every predicted sentence; each word of that union is a hit while
    the word is still unclaimed in both texts (counts over the whole text, each hit claiming one of each); P = hits /
    predicted words, R = hits / reference words, F1 of the two. Sentences: :func:`sentences`."""
    pred = [rouge_tokens(s) for s in sentences(prediction)]
    ref = [rouge_tokens(s) for s in sentences(reference)]
    pred_len, ref_len = sum(map(len, pred)), sum(map(len, ref))
    if not pred_len or not ref_len:
        return _prf(0, pred_len, ref_len)
    pred_left = Counter(word for sentence in pred for word in sentence)
    ref_left = Counter(word for sentence in ref for word in sentence)
    hits = 0
    for sentence in ref:
        union = sorted({i for candidate in pred for i in lcs_positions(sentence, candidate)})
        for word in (sentence[i] for i in union):
            if pred_left[word] > 0 and ref_left[word] > 0:
                hits += 1
                pred_left[word] -= 1
                ref_left[word] -= 1
    return _prf(hits, pred_len, ref_len)


def generation_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Exact match (NxD Training's CustomAccuracy: the strings equal) and ROUGE-1/2/L/Lsum precision, recall and F1
    (the four keys of torchmetrics' ROUGEScore, which NxD Training's SFT evaluation uses with its defaults), each the
    mean over records (ROUGEScore averages per-record scores alike)."""
    count = len(predictions)
    out: dict[str, float] = {"exact_match": sum(p == r for p, r in zip(predictions, references)) / count}
    for name, score in (
        ("rouge1", lambda p, r: rouge_n(p, r, 1)),
        ("rouge2", lambda p, r: rouge_n(p, r, 2)),
        ("rougeL", rouge_l),
        ("rougeLsum", rouge_lsum),
    ):
        per_record = [score(p, r) for p, r in zip(predictions, references)]
        for part in ("fmeasure", "precision", "recall"):
            out[f"{name}_{part}"] = sum(s[part] for s in per_record) / count
    return out


# ------------------------------------------------------------------------------------------------ the model


# ------------------------------------------------------------------------------------------------ perplexity


def text_tokens(data: str, tokenizer: str | None) -> list[int]:
    """The evaluated token stream: a text file's text, or the ``text`` field of every JSONL record in order."""
    from nxdt.data.files import open_regular
    from nxdt.data.instructions import read_jsonl
    from nxdt.data.tokenizers import build_tokenizer

    tok = build_tokenizer(tokenizer)
    path = Path(data).expanduser()
    if path.suffix == ".jsonl":
        tokens: list[int] = []
        for i, record in enumerate(read_jsonl(path)):
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise EvalError(f"nxdt eval: {path} record {i}: needs a string 'text' field (perplexity reads JSONL text)")
            tokens += tok.encode(record["text"])
        return tokens
    try:
        with open_regular(path) as fh:
            return tok.encode(fh.read().decode("utf-8", errors="replace"))
    except (ValueError, OSError) as exc:  # DataFileError: a device, a FIFO
        raise EvalError(f"nxdt eval: --data {str(exc).splitlines()[0]}") from None


def windows(tokens: Sequence[int], seq_length: int) -> list[list[int]]:
    """Non-overlapping windows of ``seq_length`` tokens; the last may be shorter; one of a single token is dropped
    (it predicts nothing)."""
    cut = [list(tokens[i : i + seq_length]) for i in range(0, len(tokens), seq_length)]
    return [w for w in cut if len(w) >= 2]


def window_nll(model: Any, rows: Sequence[Sequence[int]], batch_size: int) -> tuple[float, int]:
    """Summed NLL (float64) of every predicted token of the windows, and how many were predicted."""
    import torch

    total, count = 0.0, 0
    by_length: dict[int, list[Sequence[int]]] = {}
    for row in rows:
        by_length.setdefault(len(row), []).append(row)
    with torch.no_grad():
        for same in by_length.values():
            for start in range(0, len(same), batch_size):
                ids = torch.tensor(same[start : start + batch_size], dtype=torch.long)
                logits = model(ids).float()
                nll = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
                )
                total += float(nll.double().sum())
                count += nll.numel()
    return total, count


def _perplexity_rank(world: Any, model_path: str, data: str, seq_length: int, batch_size: int) -> list[float]:
    """One data-parallel rank: its windows (i mod world size), the sums all-reduced over the ranks."""
    import torch

    loaded = load_model(model_path)
    rows = windows(text_tokens(data, loaded.tokenizer), seq_length)
    total, count = window_nll(loaded.model, rows[world.rank :: world.world_size], batch_size)
    sums = torch.tensor([total, float(count)], dtype=torch.float64)
    world.world.all_reduce(sums)
    return sums.tolist()


def perplexity(
    model_path: str, data: str, seq_length: int | None, batch_size: int, ranks: int, fork_ranks: bool = False
) -> dict[str, Any]:
    """``fork_ranks``: this process is the caller's own program (``nxdt eval``), so ``--ranks N`` may fork its ranks
    from it (``spawn.can_fork_here``) instead of from a fork server that imports torch and Lightning again."""
    from nxdt.comm.bench import RANKS_PER_CORE, usable_cores

    # each rank is a process holding the whole model: capped as comm-test's -r is (--ranks 100000 forked until the
    # host fell over), before the model is loaded
    most = RANKS_PER_CORE * usable_cores()
    if not 1 <= ranks <= most:
        raise EvalError(
            f"nxdt eval: --ranks {ranks} must be between 1 and {most} ({RANKS_PER_CORE} per usable CPU core; each rank "
            "holds the whole model)"
        )
    if ranks > 1 and fork_ranks:
        import torch

        # the ranks compute; this process only reads the model's sizes and the windows, on one thread, so that it
        # leaves no OpenMP team behind in the processes it forks (as the launcher's checks: cli._check_model)
        torch.set_num_threads(1)
    loaded = load_model(model_path)
    seq = seq_length or loaded.seq_length
    if seq > loaded.max_positions:
        raise EvalError(
            f"nxdt eval: --seq-length {seq} is more than the model's max_position_embeddings={loaded.max_positions} — "
            f"give --seq-length {loaded.max_positions} or less"
        )
    tokens = text_tokens(data, loaded.tokenizer)
    rows = windows(tokens, seq)
    if not rows:
        raise EvalError(f"nxdt eval: {data} has {len(tokens)} token(s): nothing to predict (a window needs 2)")
    if ranks == 1:
        total, count = window_nll(loaded.model, rows, batch_size)
    else:
        import nxdt.comm.world  # noqa: F401  (what every rank runs; can_fork_here asks for it)
        from nxdt.comm.spawn import can_fork_here, run_local

        if ranks > len(rows):
            raise EvalError(f"nxdt eval: --ranks {ranks} is more than the {len(rows)} windows of {data}")
        # every rank loads the model (load_model) through nxdt.lightning.module, whose Lightning import costs ~8 CPU-s:
        # this process has imported it (load_model above), so its forks start at once; else imported once by the fork
        # server instead of by each rank
        total, count = run_local(
            _perplexity_rank,
            ranks,
            model_path,
            data,
            seq,
            batch_size,
            timeout_s=3600,
            preload=["nxdt.lightning.module"],
            fork_here=fork_ranks and can_fork_here(_perplexity_rank),
        )[0]
        count = int(count)
    mean = total / count
    return {
        "kind": "perplexity",
        "model": str(model_path),
        "model_kind": loaded.what,
        "data": str(data),
        "seq_length": seq,
        "ranks": ranks,
        "tokens": len(tokens),
        "windows": len(rows),
        "predicted_tokens": count,
        "mean_nll": mean,
        "perplexity": math.exp(mean),
    }


# ------------------------------------------------------------------------------------------------ generation


def generation_prompts(records: Sequence[Any], tok: Any, where: str) -> tuple[list[list[int]], list[str]]:
    """Each record's prompt tokens and reference text, rendered as training renders the record."""
    from nxdt.data.instructions import tokenize_record

    prompts, references = [], []
    for i, record in enumerate(records):
        try:
            tokens, trained = tokenize_record(record, tok, where=f"{where} record {i}")
        except ValueError as exc:
            raise EvalError(f"nxdt eval: {str(exc).splitlines()[0]}") from None
        first = trained.index(True)
        end = first
        while end < len(trained) and trained[end]:
            end += 1
        answer = [t for t in tokens[first:end] if t != tok.eos_id]
        prompts.append(tokens[:first])
        references.append(tok.decode(answer))
    return prompts, references


def generate(model_path: str, data: str, max_new_tokens: int, batch_size: int, limit: int | None) -> dict[str, Any]:
    from nxdt.data.instructions import build_chat_tokenizer, read_instruction_records
    from nxdt.models.generate import greedy_generate

    loaded = load_model(model_path)
    tok = build_chat_tokenizer(loaded.tokenizer)
    try:
        records = read_instruction_records(data, limit)
    except (ValueError, OSError) as exc:
        raise EvalError(f"nxdt eval: {str(exc).splitlines()[0]}") from None
    if not records:
        raise EvalError(f"nxdt eval: {data} holds no records")
    decode = tok.decode
    if decode is None:  # every ChatTokenizer nxdt builds has one
        raise EvalError(f"nxdt eval: the tokenizer of {model_path} cannot decode")
    prompts, references = generation_prompts(records, tok, str(data))
    check_fits("nxdt eval", prompts, max_new_tokens, loaded.max_positions)
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        outputs += greedy_generate(loaded.model, prompts[start : start + batch_size], max_new_tokens, eos_id=tok.eos_id)
    predictions = [decode([t for t in out if t != tok.eos_id]) for out in outputs]
    return {
        "kind": "generate",
        "model": str(model_path),
        "model_kind": loaded.what,
        "data": str(data),
        "records": len(records),
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "metrics": generation_scores(predictions, references),
        "samples": [
            {"prompt": decode(p), "prediction": pred, "reference": ref, "ended_with_eos": bool(o) and o[-1] == tok.eos_id}
            for p, pred, ref, o in zip(prompts, predictions, references, outputs)
        ],
    }


# ------------------------------------------------------------------------------------------------ the command


def table(result: dict[str, Any]) -> str:
    rows = (
        [
            (k, result[k])
            for k in ("model", "data", "seq_length", "ranks", "windows", "predicted_tokens", "mean_nll", "perplexity")
        ]
        if result["kind"] == "perplexity"
        else [(k, result[k]) for k in ("model", "data", "records", "max_new_tokens")] + list(result["metrics"].items())
    )
    width = max(len(k) for k, _ in rows)
    shown = [f"{k:<{width}}  {v:.6g}" if isinstance(v, float) else f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(shown)


def _option(argv: list[str], flag: str, convert: Any = str, default: Any = None) -> tuple[Any, list[str]]:
    if flag not in argv:
        return default, argv
    at = argv.index(flag)
    if at + 1 >= len(argv):
        raise EvalError(f"nxdt eval: {flag} needs a value\n{USAGE}")
    try:
        value = convert(argv[at + 1])
    except ValueError:
        raise EvalError(f"nxdt eval: {flag} {argv[at + 1]!r} is not a valid value") from None
    if convert is int and value < 1:
        raise EvalError(f"nxdt eval: {flag} {value} must be >= 1")
    return value, argv[:at] + argv[at + 2 :]


def main(argv: list[str], fork_ranks: bool = False) -> int:
    """``fork_ranks``: see :func:`perplexity`."""
    try:
        if not argv or argv[0] not in ("perplexity", "generate"):
            raise EvalError(USAGE)
        kind, rest = argv[0], argv[1:]
        data, rest = _option(rest, "--data")
        out, rest = _option(rest, "--out", str, f"eval-{kind}.json")
        batch_size, rest = _option(rest, "--batch-size", int, 8)
        if kind == "perplexity":
            seq_length, rest = _option(rest, "--seq-length", int)
            ranks, rest = _option(rest, "--ranks", int, 1)
        else:
            max_new_tokens, rest = _option(rest, "--max-new-tokens", int, 64)
            limit, rest = _option(rest, "--limit", int)
        if len(rest) != 1 or rest[0].startswith("-") or data is None:
            raise EvalError(USAGE)
        if not Path(data).expanduser().exists():
            raise EvalError(f"nxdt eval: --data {data}: no such file")
        data_kind = not_regular(Path(data).expanduser())
        if data_kind is not None:  # a FIFO, a device: refused before torch is imported
            raise EvalError(f"nxdt eval: --data {data} is {data_kind}, not a regular file")
        check_output("nxdt eval", out)  # before the model is loaded
        check_model_dir("nxdt eval", rest[0])
        if kind == "perplexity":
            result = perplexity(rest[0], data, seq_length, batch_size, ranks, fork_ranks)
        else:
            result = generate(rest[0], data, max_new_tokens, batch_size, limit)
        write_output("nxdt eval", out, json.dumps(result, indent=1) + "\n")
    except CommandError as exc:  # EvalError, or the model directory's (load_model)
        print(str(exc), file=sys.stderr)
        return 2
    print(table(result))
    print(f"nxdt: wrote {out}")
    return 0
