"""``nxdt eval`` (``nxdt.launch.evaluate``): ROUGE and exact match against hand-computed values; perplexity of a
checkpoint (one process and two data-parallel ranks) and of its Hugging Face export equal to transformers' on the same
windows; generation scored from greedy answers; bad input one line, exit 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import warm_cli

from nxdt.launch.evaluate import generation_scores, lcs_length, main, rouge_l, rouge_lsum, rouge_n, sentences, windows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # launches (shared or this module's) on a loaded host


def test_rouge_and_exact_match_equal_hand_computed_values():
    # reference "the cat sat on the mat" (6 words), prediction "the cat lay on the mat" (6):
    # LCS = the cat on the mat = 5 -> P = R = F = 5/6; unigrams: the×2 cat on mat = 5 of 6;
    # bigrams: the-cat, on-the, the-mat = 3 of 5
    ref, pred = "The cat sat on the mat.", "the cat lay on the mat"
    assert lcs_length("the cat sat on the mat".split(), pred.split()) == 5
    assert rouge_l(pred, ref) == pytest.approx({"precision": 5 / 6, "recall": 5 / 6, "fmeasure": 5 / 6}, abs=1e-15)
    assert rouge_n(pred, ref, 1)["fmeasure"] == pytest.approx(5 / 6, abs=1e-15)
    assert rouge_n(pred, ref, 2) == pytest.approx({"precision": 3 / 5, "recall": 3 / 5, "fmeasure": 3 / 5}, abs=1e-15)
    # uneven lengths: reference a b c d e (m=5), prediction a c e x (n=4): LCS a c e = 3,
    # R = 3/5, P = 3/4, F = 2·0.6·0.75/(0.6 + 0.75) = 2/3
    got = rouge_l("a c e x", "a b c d e")
    assert got == pytest.approx({"precision": 0.75, "recall": 0.6, "fmeasure": 2 / 3}, abs=1e-15)
    assert rouge_n("a c e x", "a b c d e", 2)["fmeasure"] == 0.0  # no bigram in common
    assert rouge_l("", "a b")["fmeasure"] == 0.0 and rouge_l("!!", "")["fmeasure"] == 0.0  # empty sides score 0
    # means over records; exact match is string equality (NxD Training's CustomAccuracy): "The cat" != "the cat"
    scores = generation_scores(["a c e x", "the cat", "x"], ["a b c d e", "the cat", "The cat"])
    assert scores["exact_match"] == pytest.approx(1 / 3)
    assert scores["rougeL_fmeasure"] == pytest.approx((2 / 3 + 1 + 0) / 3)
    assert scores["rouge1_recall"] == pytest.approx((3 / 5 + 1 + 0) / 3)


def test_rouge_equals_torchmetrics_rougescore():
    """NxD Training's SFT evaluation scores with torchmetrics' ROUGEScore (defaults: no stemmer, its normaliser)."""
    rouge = pytest.importorskip("torchmetrics.text.rouge")
    pairs = [
        ("Summary: the quick brown fox jumps", "the quick brown fox jumped over the lazy dog"),
        ("a b a b c", "b a b c a"),
        ("42 is the answer, 42!", "The answer is 42."),
        ("no overlap here", "completely different words"),
    ]
    metric = rouge.ROUGEScore(rouge_keys=("rouge1", "rouge2", "rougeL"))
    want = metric([p for p, _ in pairs], [r for _, r in pairs])
    got = generation_scores([p for p, _ in pairs], [r for _, r in pairs])
    for key in ("rouge1", "rouge2", "rougeL"):
        for part in ("fmeasure", "precision", "recall"):
            # torchmetrics keeps its scores in float32: 1e-6 relative is its rounding, not a difference of definition
            assert got[f"{key}_{part}"] == pytest.approx(float(want[f"{key}_{part}"]), rel=1e-6, abs=1e-7), (key, part)


def test_rouge_lsum_equals_hand_computed_values():
    # Lin 2004 §3.2's example: reference w1 w2 w3 w4 w5; predicted sentences w1 w2 w6 w7 w8 and w1 w3 w8 w9 w5.
    # Their LCSs with the reference: w1 w2 and w1 w3 w5; union w1 w2 w3 w5 = 4 hits (w1 counted once: the reference
    # has one) -> R = 4/5, P = 4/10, F = 2·0.8·0.4/1.2 = 8/15
    pred, ref = "W1 w2 w6 w7 w8. w1 w3 w8 w9 w5!", "w1 w2 w3 w4 w5."
    assert sentences(pred) == ["W1 w2 w6 w7 w8.", "w1 w3 w8 w9 w5!"]
    assert rouge_lsum(pred, ref) == pytest.approx({"precision": 0.4, "recall": 0.8, "fmeasure": 8 / 15}, abs=1e-15)
    # a repeated reference sentence: the second finds its words already claimed -> 2 hits of 4 reference words
    assert rouge_lsum("a b.", "a b. a b.") == pytest.approx({"precision": 1.0, "recall": 0.5, "fmeasure": 2 / 3})
    # sentence-level ROUGE-L of the same texts sees one sequence: LCS(w1 w2 w3 w4 w5, the 10 words) = w1 w2 w3 w5 too,
    # but order across sentences matters there: "c d. a b" vs "a b. c d" is 2/4 for ROUGE-L, 4/4 for ROUGE-Lsum
    assert rouge_l("c d. a b", "a b. c d")["fmeasure"] == 0.5
    assert rouge_lsum("c d. a b", "a b. c d")["fmeasure"] == 1.0
    assert rouge_lsum("", "a b.")["fmeasure"] == 0.0 and rouge_lsum("?", "a")["recall"] == 0.0
    scores = generation_scores(["c d. a b", "x"], ["a b. c d", "y"])
    assert scores["rougeLsum_fmeasure"] == 0.5 and scores["rougeL_fmeasure"] == 0.25


def test_rouge_lsum_equals_torchmetrics_on_split_sentences():
    """torchmetrics' ROUGE-Lsum (what NxD Training's SFT evaluation computes) on the same sentences. Its public
    ROUGEScore cuts sentences with nltk's punkt model, which needs nltk and a downloaded model; its scoring function
    (``_rouge_lsum_score``, tokenized sentences in, rouge-score's union-LCS algorithm) is compared here instead, on
    random sentences over a 4-word vocabulary, where LCS ties (and so the tie-break) are frequent."""
    import random

    rouge = pytest.importorskip("torchmetrics.functional.text.rouge")
    score = getattr(rouge, "_rouge_lsum_score", None)
    if score is None:
        pytest.skip("this torchmetrics has no _rouge_lsum_score")
    rng = random.Random(0)

    def text() -> list[list[str]]:
        return [[rng.choice("abcd") for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))]

    for case in range(200):
        pred, ref = text(), text()
        want = score(pred, ref)
        got = rouge_lsum(". ".join(map(" ".join, pred)) + ".", ". ".join(map(" ".join, ref)))
        for part in ("fmeasure", "precision", "recall"):
            # torchmetrics returns float32 tensors: 1e-6 relative is its rounding
            assert got[part] == pytest.approx(float(want[part]), rel=1e-6, abs=1e-7), (case, pred, ref, part)


def test_windows_are_non_overlapping_and_the_short_tail_is_kept():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail predicts nothing


@pytest.fixture(scope="module")
def evaluated(reliability_reference, tmp_path_factory):
    """The shared 12-step llama_tiny run's step-10 checkpoint (DP=2), its HF export, and a text of 3,000 bytes of
    the sample text: 23 windows of 128 tokens and a 56-token tail."""
    from nxdt.data import SAMPLE_TEXT
    from nxdt.lightning.hf import export_hf

    root = tmp_path_factory.mktemp("eval")
    checkpoint = reliability_reference / "checkpoints" / "step-10"
    text = root / "held_out.txt"
    text.write_bytes(SAMPLE_TEXT.read_bytes()[-3000:])
    hf_dir = root / "hf"
    export_hf(checkpoint, hf_dir)
    return {"root": root, "checkpoint": checkpoint, "text": text, "hf": hf_dir}


def run_eval(*args: str, out: Path) -> dict:
    assert main([*args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def transformers_perplexity(hf_dir: Path, tokens: list[int], seq_length: int) -> tuple[float, int]:
    """Hugging Face's perplexity guide with stride = max_length: each window's loss with labels = inputs (the model
    shifts them: every token but the window's first is predicted), summed as loss × predicted tokens."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for begin in range(0, len(tokens), seq_length):
            ids = torch.tensor([tokens[begin : begin + seq_length]])
            if ids.shape[1] < 2:
                continue
            loss = model(ids, labels=ids).loss
            total += float(loss.double()) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / count), count


def test_perplexity_equals_transformers_on_the_same_windows(evaluated, tmp_path):
    pytest.importorskip("transformers")
    text = evaluated["text"]
    tokens = list(text.read_bytes())  # the run's byte-level tokenizer
    want, predicted = transformers_perplexity(evaluated["hf"], tokens, 128)
    assert predicted == 23 * 127 + 55
    one = run_eval(
        "perplexity", str(evaluated["checkpoint"]), "--data", str(text), "--seq-length", "128", out=tmp_path / "a.json"
    )
    # two ranks as the `nxdt eval` program runs them: forks of the program, which has imported what they run
    # (tests/warm_cli.py: a fork of a pre-imported process; in this process they would come from a fork server that
    # imports torch and Lightning again, ~20 s on the loaded 2-core host)
    argv = ["eval", "perplexity", str(evaluated["checkpoint"]), "--data", str(text), "--seq-length", "128", "--ranks", "2"]
    launched = warm_cli.run([*argv, "--out", str(tmp_path / "b.json")], cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    two = json.loads((tmp_path / "b.json").read_text())
    hf = run_eval("perplexity", str(evaluated["hf"]), "--data", str(text), "--seq-length", "128", out=tmp_path / "c.json")
    for got in (one, two, hf):
        assert (got["windows"], got["predicted_tokens"]) == (24, predicted)
        # fp32 logits of the same weights through two implementations (summation orders differ, ~1e-7 relative per
        # token) and a float64 sum of 2,976 NLLs: 1e-5 relative on exp(mean NLL) is 1e-5 absolute on the mean NLL
        assert got["perplexity"] == pytest.approx(want, rel=1e-5), (got, want)
    assert two["ranks"] == 2 and one["model_kind"] == "nxdt checkpoint" and hf["model_kind"] == "Hugging Face directory"
    assert one["perplexity"] == pytest.approx(math.exp(one["mean_nll"]), rel=1e-12)


def test_generate_scores_the_greedy_answers(evaluated, tmp_path, capsys):
    from nxdt.data.instructions import byte_chat_tokenizer, tokenize_record
    from nxdt.launch.evaluate import load_model
    from nxdt.models.generate import greedy_generate

    records = [
        {"instruction": "Reverse the word.", "input": "abc", "output": "cba"},
        {"input": "2 + 2 =", "output": "4"},
        {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]},
    ]
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = run_eval(
        "generate", str(evaluated["checkpoint"]), "--data", str(data), "--max-new-tokens", "6", out=tmp_path / "g.json"
    )
    printed = capsys.readouterr().out
    assert "rougeL_fmeasure" in printed and "exact_match" in printed
    # the same answers decoded by hand: the prompt is what training reads before the response
    tok, model = byte_chat_tokenizer(), load_model(str(evaluated["checkpoint"])).model
    prompts = []
    for record in records:
        tokens, trained = tokenize_record(record, tok)
        prompts.append(tokens[: trained.index(True)])
    answers = [bytes(t for t in out if t != 0).decode("utf-8", "replace") for out in greedy_generate(model, prompts, 6, 0)]
    assert [s["prediction"] for s in got["samples"]] == answers
    # the references are the trained spans without EOS: the plain chat rendering ends the assistant turn with a newline
    references = ["cba", "4", "hi there\n"]
    assert [s["reference"] for s in got["samples"]] == references
    assert got["metrics"] == pytest.approx(generation_scores(answers, references))
    assert got["records"] == 3 and got["decoding"] == "greedy"


@pytest.mark.parametrize(
    "kind, content, expected",
    [
        ("generate", '{"prompt": "x", "label": "y"}\n', "nxdt eval: "),
        ("perplexity", '{"body": "no text field"}\n', "nxdt eval: "),
    ],
    ids=["generate-without-input-output", "perplexity-jsonl-without-text"],
)
def test_an_eval_set_without_the_needed_fields_is_one_line_exit_2(evaluated, tmp_path, capsys, kind, content, expected):
    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    assert main([kind, str(evaluated["checkpoint"]), "--data", str(data), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expected) and "record 0" in err[0], err
    assert ("'input' and 'output'" if kind == "generate" else "'text'") in err[0]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    "kind, args, expected",
    [
        ("perplexity", ["--data", "/dev/zero"], "nxdt eval: --data /dev/zero is a character device, not a regular file"),
        (
            "perplexity",
            ["--data", "{text}", "--seq-length", "100000"],
            "nxdt eval: --seq-length 100000 is more than the model's max_position_embeddings=256 — give --seq-length 256 or less",
        ),
        (
            "generate",
            ["--data", "{records}", "--max-new-tokens", "1000000000000"],
            "with --max-new-tokens 1000000000000 it would need",
        ),
        (
            "perplexity",
            ["--data", "{text}", "--seq-length", "128", "--out", "{tmp}"],
            "exists and is not a regular file (a directory",
        ),
    ],
    ids=["data-a-device", "window-past-the-positions", "max-new-tokens-past-the-positions", "out-a-directory"],
)
def test_eval_arguments_past_what_the_model_or_host_holds_are_one_line_exit_2(evaluated, tmp_path, capsys, kind, args, expected):
    """Issue 38 probes: these raised tracebacks (a device as data, a window or completion past the model's positions,
    --out a directory) or ran until killed (--max-new-tokens 10**12 sized the decoding by it)."""
    records = tmp_path / "records.jsonl"
    records.write_text('{"input": "abc", "output": "cba"}\n')
    args = [a.format(text=evaluated["text"], records=records, tmp=tmp_path) for a in args]
    assert main([kind, str(evaluated["checkpoint"]), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_a_checkpoint_consolidated_outside_its_run_directory_evaluates_from_its_own_meta(evaluated, tmp_path, capsys):
    """Issue 36 leftover: `nxdt eval` on `nxdt checkpoint consolidate`'s output elsewhere failed ("<dir>/../../config.yaml
    (its run's config) is missing"). The checkpoint's meta.json records the model config and tokenizer export-hf uses:
    the same weights, the same windows, the same perplexity to the bit. One that records no model is refused naming
    what to pass."""
    import torch

    from nxdt.lightning import checkpoint as ckpt_io
    from nxdt.lightning.reshard import consolidate

    full = tmp_path / "elsewhere" / "full"
    consolidate(evaluated["checkpoint"], full)
    assert not (full.parent.parent / "config.yaml").exists()
    args = ["perplexity", "--data", str(evaluated["text"]), "--seq-length", "128"]
    inside = run_eval(args[0], str(evaluated["checkpoint"]), *args[1:], out=tmp_path / "inside.json")
    outside = run_eval(args[0], str(full), *args[1:], out=tmp_path / "outside.json")
    assert outside["perplexity"] == inside["perplexity"] and outside["predicted_tokens"] == inside["predicted_tokens"]

    old = tmp_path / "old" / "step-3"  # an older nxdt's checkpoint: no model_config in meta.json
    ckpt_io.save({"state_dict": {"model.w": torch.ones(2)}, "global_step": 3}, old, meta={"step": 3})
    assert main([*args[:1], str(old), *args[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not record its model (written by an older nxdt)" in err[0] and "export-hf" in err[0], err


def test_a_path_that_is_no_model_is_one_line_exit_2(tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text("hello")
    assert main(["perplexity", str(tmp_path), "--data", str(data)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"nxdt eval: {tmp_path} is neither an nxdt checkpoint (meta.json) nor a Hugging Face model directory (config.json)"
    ]
