"""``nxdt train +recipe=grpo``: a reward function this project did not write (a module the test writes, found through
PYTHONPATH) trains on 2 data-parallel ranks with a KL reference; the logged rewards are that function's values on the
completions the workers sampled; bad reward functions and layouts are refused before any worker starts."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm_cli

from nxdt.config import compose_config
from nxdt.lightning.grpo import GRPOConfigError, check, score

# one 2-rank launch of 2 steps: ~30 s on a quiet 2-core host, several times that under load
pytestmark = pytest.mark.timeout(480)

HELD_OUT = '''
import json, os
from pathlib import Path

def length_reward(prompts, completions, answer, **kwargs):
    """0.1 per character; logs what it saw, one line per call and process."""
    with open(Path(__file__).with_name("calls.jsonl"), "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "completions": completions, "answer": answer}) + "\\n")
    return [0.1 * len(c) for c in completions]

def no_kwargs(prompts, completions):
    return [0.0] * len(completions)

def broken_count(prompts, completions, **kwargs):
    return [1.0]

def partly_scored(prompts, completions, **kwargs):
    return [None, 0.5]

def not_finite(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)
'''


def _nxdt(cwd: Path, *overrides: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p)
    return warm_cli.run(["train", "+recipe=grpo", *overrides], cwd=cwd, env=env, timeout=300)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user_code")
    (folder / "heldout_rewards.py").write_text(HELD_OUT)
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory, held_out):
    out = tmp_path_factory.mktemp("grpo") / "run"
    result = _nxdt(
        out.parent,
        "trainer.max_steps=2",
        f"exp_manager.explicit_log_dir={out}",
        "model_alignment_strategy.grpo.reward_funcs=[heldout_rewards:length_reward,nxdt.data.arithmetic:exact_answer]",
        "model_alignment_strategy.grpo.reward_weights=[1.0,2.0]",
        "model_alignment_strategy.grpo.beta=0.04",
        pythonpath=held_out,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return out, result


def test_held_out_reward_function_trains_on_two_ranks_and_its_values_are_logged(run, held_out):
    out, result = run
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == [1, 2]
    calls = [json.loads(line) for line in (held_out / "calls.jsonl").read_text().splitlines()]
    by_rank: dict[int, list[dict]] = {}
    for call in calls:
        by_rank.setdefault(call["pid"], []).append(call)
    assert len(by_rank) == 2 and all(len(c) == 2 for c in by_rank.values())  # 2 ranks, called once per step
    for step, row in enumerate(rows):
        completions = [c for calls_of in by_rank.values() for c in calls_of[step]["completions"]]
        answers = [a for calls_of in by_rank.values() for a in calls_of[step]["answer"]]
        assert len(completions) == 32  # data.global_batch_size completions per step, 16 on each rank
        length = [0.1 * len(c) for c in completions]
        exact = [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answers)]
        # fp32 rewards averaged in fp32 by both (the log's float32 → 1e-6 relative)
        assert float(row["rewards/length_reward/mean"]) == pytest.approx(sum(length) / 32, rel=1e-5)
        assert float(row["reward"]) == pytest.approx(sum(a + 2 * b for a, b in zip(length, exact)) / 32, rel=1e-5)
        assert float(row["completions/max_length"]) <= 6  # max_completion_length (EOS counted)
        assert math.isfinite(float(row["kl"])) and float(row["kl"]) >= 0  # k3 is non-negative
        for key in ("clip_ratio/region_mean", "reward_std", "rewards/exact_answer/std", "completions/mean_length"):
            assert math.isfinite(float(row[key])), key
    assert "reward" in result.stdout and "kl" in result.stdout  # the console line


def _completions_by_step(calls_file: Path) -> list[list[str]]:
    """Every completion the held-out reward function scored, per step (its calls in each process's order)."""
    calls: dict[int, list[list[str]]] = {}
    for line in calls_file.read_text().splitlines():
        call = json.loads(line)
        calls.setdefault(call["pid"], []).append(call["completions"])
    steps = {len(c) for c in calls.values()}
    assert len(steps) == 1, calls
    return [sorted(c for per_process in calls.values() for c in per_process[step]) for step in range(steps.pop())]


def test_tensor_parallel_with_sp_and_zero1_samples_and_trains_as_plain_data_parallelism(run, held_out, tmp_path):
    """TP2 with sequence parallelism × DP2 with ZeRO-1 (4 ranks), the same seed and settings as the plain DP2 run: every
    rank of a TP group samples from the gathered vocabulary with the generator of its data-parallel rank, so the run
    draws exactly plain DP's completions (each scored by both ranks of its TP group) at step 1 and, after one ZeRO-1
    update, at step 2; the reference (beta 0.04) is a copy of the TP-sharded model. Tolerances: the layouts differ by
    fp32 summation order (TP's all-reduces, the vocabulary-parallel log-softmax, ZeRO-1's reduce-scatter), ~1e-7
    relative per value, which moves step 2's weights by ~lr·1e-7 after Adam's normalisation: a sampled token changes
    only if a uniform draw falls within ~1e-6 of a cumulative-probability boundary (none here; the completions are
    compared exactly), and the losses and KL agree to far inside rel 1e-4."""
    user = tmp_path / "user_code"
    user.mkdir()
    (user / "heldout_rewards.py").write_text(HELD_OUT)
    out = tmp_path / "run"
    result = _nxdt(
        tmp_path,
        "trainer.max_steps=2",
        "trainer.devices=4",
        "distributed_strategy.tensor_model_parallel_size=2",
        "distributed_strategy.sequence_parallel=true",
        "distributed_strategy.zero1=true",
        f"exp_manager.explicit_log_dir={out}",
        "model_alignment_strategy.grpo.reward_funcs=[heldout_rewards:length_reward,nxdt.data.arithmetic:exact_answer]",
        "model_alignment_strategy.grpo.reward_weights=[1.0,2.0]",
        "model_alignment_strategy.grpo.beta=0.04",
        pythonpath=user,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    plain = _completions_by_step(held_out / "calls.jsonl")
    tp = _completions_by_step(user / "calls.jsonl")
    assert tp == [sorted(step * 2) for step in plain]  # each completion scored by both ranks of its TP group
    want = list(csv.DictReader(open(run[0] / "metrics.csv")))
    got = list(csv.DictReader(open(out / "metrics.csv")))
    assert [r["step"] for r in got] == [r["step"] for r in want] == ["1", "2"]
    for g, w in zip(got, want):
        for key in ("loss", "reward", "reward_std", "completions/mean_length"):
            assert float(g[key]) == pytest.approx(float(w[key]), rel=1e-4, abs=1e-6), (key, g, w)
        assert float(g["kl"]) == pytest.approx(float(w["kl"]), rel=1e-4, abs=1e-7), (g, w)


def _user_code(folder: Path) -> Path:
    folder.mkdir()
    (folder / "heldout_rewards.py").write_text(HELD_OUT)
    return folder


# the plain DP2 fixture's settings (beta 0.04: a reference model), FSDP over the same 2 ranks, a 4-step schedule
FSDP = [
    "distributed_strategy.fsdp.enabled=true",
    "model.optim.sched.max_steps=4",
    "exp_manager.checkpoint_every_n_steps=2",
    "model_alignment_strategy.grpo.reward_funcs=[heldout_rewards:length_reward,nxdt.data.arithmetic:exact_answer]",
    "model_alignment_strategy.grpo.reward_weights=[1.0,2.0]",
    "model_alignment_strategy.grpo.beta=0.04",
]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """FSDP over 2 ranks: 4 steps uninterrupted (checkpoints at steps 2 and 4), then a second run resumed from the first
    one's step-2 checkpoint (the state a run stopped after step 2 leaves) to step 4. Two launches."""
    root = tmp_path_factory.mktemp("grpo_fsdp")
    whole, resumed = root / "whole", root / "resumed"
    for out, extra in ((whole, []), (resumed, [f"exp_manager.resume_from_checkpoint={whole / 'checkpoints' / 'step-2'}"])):
        user = _user_code(root / f"user_{out.name}")
        result = _nxdt(root, *FSDP, "trainer.max_steps=4", f"exp_manager.explicit_log_dir={out}", *extra, pythonpath=user)
        assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return {name: (root / name, root / f"user_{name}" / "calls.jsonl") for name in ("whole", "resumed")}


def test_fsdp_samples_and_trains_as_plain_data_parallelism(run, held_out, fsdp_runs):
    """FSDP over the same 2 ranks as the plain DP2 run, same seed and settings: decoding gathers each unit's weights
    (the same values DP holds whole), the ranks decode in lockstep (idle forwards draw nothing), and the reference is a
    frozen copy sharded in FSDP units of its own — so steps 1 and 2 draw exactly DP's completions (compared exactly) and
    score them alike. Steps 1-2 do not depend on the schedule's length (warm-up, 2 steps). Tolerances: step 1's
    forward is the same arithmetic on the same weights; the gradients differ only in summation order (FSDP's
    reduce-scatter against DP's all-reduce: ~1e-7 relative), which moves step 2's weights by ~lr·1e-7 after Adam's
    normalisation — a sampled token would change only for a uniform draw within ~1e-6 of a cumulative-probability
    boundary — and the step-2 loss (a near-cancelling sum of ratio·advantage terms, ~4e-4) and KL agree far inside
    rel 1e-4 / abs 1e-6 (measured: loss rel 1.3e-6, KL rel 3.5e-7)."""
    out, calls = fsdp_runs["whole"]
    plain = _completions_by_step(held_out / "calls.jsonl")
    assert _completions_by_step(calls)[:2] == plain
    want = list(csv.DictReader(open(run[0] / "metrics.csv")))
    got = list(csv.DictReader(open(out / "metrics.csv")))[:2]
    assert [r["step"] for r in got] == [r["step"] for r in want] == ["1", "2"]
    for g, w in zip(got, want):
        for key in ("reward", "reward_std", "rewards/length_reward/mean", "completions/mean_length"):
            assert g[key] == w[key], key  # the same completions, the same reward arithmetic: the same bits
        for key in ("loss", "kl"):
            assert float(g[key]) == pytest.approx(float(w[key]), rel=1e-4, abs=1e-6), (key, g, w)
        assert float(g["peak_gathered_bytes"]) > 0  # FSDP's figures reach metrics.csv


def test_a_resumed_run_continues_bit_for_bit(fsdp_runs):
    """A GRPO run resumed from its step-2 checkpoint (FSDP, beta 0.04) samples, scores and trains at steps 3-4 exactly
    as the uninterrupted run: the sampling generator is a function of (seed, step, data-parallel rank) — seed from the
    run's config (a resume may not change it), step from the checkpoint — the prompt stream a function of (seed, step),
    the reference the starting weights again, the weights, Adam's moments and the schedule restored."""
    (whole, whole_calls), (resumed, resumed_calls) = fsdp_runs["whole"], fsdp_runs["resumed"]
    assert _completions_by_step(resumed_calls) == _completions_by_step(whole_calls)[2:]
    timing = {"step_time_s", "tokens_per_s", "peak_rss_mb", "wall_time", "exposed_comm_s", "overlap_pct"}
    want = [{k: v for k, v in r.items() if k not in timing} for r in csv.DictReader(open(whole / "metrics.csv"))][2:]
    got = [{k: v for k, v in r.items() if k not in timing} for r in csv.DictReader(open(resumed / "metrics.csv"))]
    assert [r["step"] for r in got] == ["3", "4"]
    assert got == want  # every logged value, as written: bit for bit
    from safetensors import safe_open

    with safe_open(str(whole / "checkpoints" / "step-2" / "model.safetensors"), "pt") as fh:
        names = list(fh.keys())
    # the policy's tensors only: the reference is held outside the module tree, so no checkpoint carries a second copy
    assert names and all(n.startswith("model.") for n in names), [n for n in names if not n.startswith("model.")][:3]


def _cfg(*overrides: str):
    return compose_config(["+recipe=grpo", *overrides], paths=False)


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (
            [
                "model_alignment_strategy.grpo.reward_funcs=[no_such_module_xyz:f]",
                "model_alignment_strategy.grpo.reward_weights=null",
            ],
            "reward_funcs[0]",
            "cannot import no_such_module_xyz",
        ),
        (
            [
                "model_alignment_strategy.grpo.reward_funcs=[heldout_rewards:missing]",
                "model_alignment_strategy.grpo.reward_weights=null",
            ],
            "reward_funcs[0]",
            "has no function missing",
        ),
        (
            [
                "model_alignment_strategy.grpo.reward_funcs=[heldout_rewards:no_kwargs]",
                "model_alignment_strategy.grpo.reward_weights=null",
            ],
            "reward_funcs[0]",
            "must accept f(prompts",
        ),
        (["model_alignment_strategy.grpo.num_generations=5"], "data.global_batch_size", "multiple of"),
        (["distributed_strategy.pipeline_model_parallel_size=2"], "pipeline_model_parallel_size", "(PP not built)"),
        (["model_alignment_strategy.grpo.reward_weights=[1.0]"], "reward_weights", "one weight per reward function"),
        (["model_alignment_strategy.grpo.num_iterations=0"], "num_iterations", "must be an integer >= 1"),
    ],
)
def test_bad_settings_are_refused_by_name(held_out, monkeypatch_free_path, overrides, key, message):
    with pytest.raises(GRPOConfigError) as info:
        check(_cfg(*overrides), 2)
    assert key in info.value.key and message in info.value.fix


@pytest.fixture
def monkeypatch_free_path(held_out):
    """The held-out module importable in this process too (what PYTHONPATH does for a launch)."""
    sys.path.insert(0, str(held_out))
    yield
    sys.path.remove(str(held_out))
    sys.modules.pop("heldout_rewards", None)


@pytest.mark.parametrize(
    "overrides, key, says",
    [
        (
            [
                "model_alignment_strategy.grpo.reward_funcs=[no_such_module_xyz:f]",
                "model_alignment_strategy.grpo.reward_weights=null",
            ],
            "model_alignment_strategy.grpo.reward_funcs[0]",
            "cannot import",
        ),
        (
            ["distributed_strategy.pipeline_model_parallel_size=2"],
            "distributed_strategy.pipeline_model_parallel_size=2",
            "(PP not built)",
        ),
    ],
)
def test_a_bad_reward_function_or_layout_stops_the_launcher_with_one_line_and_exit_2(tmp_path, overrides, key, says):
    result = _nxdt(tmp_path, *overrides)
    assert result.returncode == 2
    # the launcher's first line (what is being launched, printed before the checks: tests/test_first_output.py) aside
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip() and not line.endswith("model…")]
    assert len(lines) == 1 and key in lines[0] and says in lines[0]
    assert not (tmp_path / "nxdt_runs").exists() or not any((tmp_path / "nxdt_runs").rglob("metrics.csv"))


IDS_LOGGER = '''
import json, os
from pathlib import Path

def logged(prompts, completions, completion_ids, **kwargs):
    """0 for every completion (no advantage: the policy term is 0); logs the prompts and the sampled ids."""
    with open(Path(__file__).with_name("ids.jsonl"), "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "prompts": prompts, "completion_ids": completion_ids}) + "\\n")
    return [0.0] * len(completions)
'''


def _transformers_aux(overrides: list[str], calls: Path) -> float:
    """Step 1's micro-batches of every rank rebuilt from what its reward function saw (each process's first call),
    through the starting weights (built as the worker builds them), and scored by transformers'
    load_balancing_loss_func with the batch's attention mask: their mean."""
    modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    import lightning.pytorch as pl
    import torch

    from nxdt.data.instructions import build_chat_tokenizer
    from nxdt.lightning.datamodule import chat_tokenizer_dir
    from nxdt.lightning.grpo import encode_prompts
    from nxdt.lightning.module import import_architecture
    from nxdt.models.generate import completion_batch

    cfg = _cfg(*overrides)
    firsts: dict[int, dict] = {}
    for line in calls.read_text().splitlines():
        call = json.loads(line)
        firsts.setdefault(call["pid"], call)
    tokenizer = build_chat_tokenizer(chat_tokenizer_dir(cfg.data.tokenizer))
    grpo = cfg.model_alignment_strategy.grpo
    pl.seed_everything(cfg.seed, verbose=False)  # what the worker does right before it builds the model
    model = import_architecture(cfg.model.architecture)(cfg.model)
    b, losses = cfg.data.micro_batch_size, []
    with torch.no_grad():
        for call in firsts.values():
            prompts = encode_prompts(
                [{"prompt": t} for t in call["prompts"]], tokenizer, grpo.max_prompt_length, cfg.model.vocab_size
            )
            completions = call["completion_ids"]
            for start in range(0, len(prompts), b):
                batch = completion_batch(prompts[start : start + b], completions[start : start + b])
                model(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
                mask = (batch["segment_ids"] != 0).long()
                losses.append(float(modeling.load_balancing_loss_func(tuple(model.router_logits()), 4, 2, attention_mask=mask)))
    return sum(losses) / len(losses)


def test_a_mixture_of_experts_policy_adds_trls_load_balancing_term_and_trains_on_expert_parallelism(tmp_path):
    """Mixtral (router_aux_loss_coef 0.02), zero rewards (no advantage: the surrogate is 0), beta 0.04, two steps on
    plain DP2 and on EP2 with FSDP (each rank 2 of the 4 experts, tokens exchanged by all-to-all in every decoding step
    — the ranks decode in lockstep — and in scoring; the reference a copy of the sliced model, its experts kept whole
    per rank by FSDP and its dense weights sharded: a copy that lost its experts' marks would shard different experts
    as one and score other log-probabilities, a KL ≠ 0 at step 1). TRL's term: at step 1 the
    policy is the reference (KL 0), so the logged loss is 0.02 · aux_loss, the mean over micro-batches of the policy
    forward's load-balancing loss over its real tokens — equal to transformers' load_balancing_loss_func with the
    attention mask on the same rows, rebuilt here from the sampled ids (counting the padding moves it by ~1e-3). EP2
    samples what DP2 samples and trains to the same step-2 numbers (the router learns from the term). Tolerance rel
    1e-5: fp32 sums in another order (~1e-7); under SP the masked rows are gathered as the logits are
    (tests/parallel/test_moe.py)."""
    common = [
        "model=mixtral_tiny",
        "trainer.max_steps=2",
        "trainer.devices=2",
        "model_alignment_strategy.grpo.beta=0.04",
        "model_alignment_strategy.grpo.reward_funcs=[ids_logger:logged]",
        "model_alignment_strategy.grpo.reward_weights=[1.0]",
    ]
    rows = {}
    ep2_fsdp = ["distributed_strategy.expert_model_parallel_size=2", "distributed_strategy.fsdp.enabled=true"]
    for name, layout in (("dp2", []), ("ep2", ep2_fsdp)):
        user = _user_code(tmp_path / f"user_{name}")
        (user / "ids_logger.py").write_text(IDS_LOGGER)
        run = tmp_path / name
        result = _nxdt(tmp_path, *common, *layout, f"exp_manager.explicit_log_dir={run}", pythonpath=user)
        assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        rows[name] = list(csv.DictReader(open(run / "metrics.csv")))
        first = rows[name][0]
        aux = float(first["aux_loss"])
        assert 1.9 < aux < 3.0  # top-2 of 4 experts: 2 when perfectly balanced
        assert float(first["loss"]) == pytest.approx(0.02 * aux, rel=1e-5), first
        if name == "dp2":
            assert aux == pytest.approx(_transformers_aux([*common, *layout], user / "ids.jsonl"), rel=1e-5)
    assert [r["step"] for r in rows["ep2"]] == [r["step"] for r in rows["dp2"]] == ["1", "2"]
    for got, want in zip(rows["ep2"], rows["dp2"]):
        assert got["completions/mean_length"] == want["completions/mean_length"]
        for key in ("loss", "aux_loss", "kl"):
            assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-4, abs=1e-7), (key, got, want)
    assert float(rows["dp2"][1]["kl"]) > 0  # step 1 moved the policy


def test_wrong_count_and_non_finite_rewards_name_the_function(held_out, monkeypatch_free_path):
    import heldout_rewards as user

    records = [{"prompt": "1+1=", "answer": "2"}] * 2
    with pytest.raises(ValueError, match="broken_count returned 1 values for 2 completions"):
        score([user.broken_count], ["broken_count"], records, ["2", "3"], [[50], [51]])
    with pytest.raises(ValueError, match="not_finite returned nan for completion 0"):
        score([user.not_finite], ["not_finite"], records, ["2", "3"], [[50], [51]])
    values = score([user.partly_scored], ["partly_scored"], records, ["2", "3"], [[50], [51]])
    assert math.isnan(values[0, 0]) and values[1, 0] == 0.5  # None: not scored by this function (TRL's NaN)


def test_padding_columns_for_sequence_parallelism_change_no_completion_log_probability():
    """The scoring batch widened to a multiple of the TP degree (pad_columns: segment 0, label -100) gives every
    completion token the log-probability it has unpadded (the same forward of the same rows: fp32 rounding only), and
    a plain model's logits pass FullVocabLogits unchanged."""
    from types import SimpleNamespace

    import torch
    from hf_reference import TINY_LLAMA

    from nxdt.lightning.grpo import FullVocabLogits, pad_columns
    from nxdt.models.generate import completion_batch
    from nxdt.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(SimpleNamespace(**TINY_LLAMA)).eval()
    batch = completion_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 2]])
    assert batch["input_ids"].shape[1] == 7
    padded = pad_columns(batch, 4)
    assert padded["input_ids"].shape[1] == 8 and pad_columns(batch, 7) is batch
    assert (padded["labels"][:, 7] == -100).all() and (padded["segment_ids"][:, 7] == 0).all()
    with torch.no_grad():
        logps = [
            model.token_log_probs(model(b["input_ids"], b["position_ids"], b["segment_ids"]), b["labels"])
            for b in (batch, padded)
        ]
        full = FullVocabLogits(model, TINY_LLAMA["vocab_size"])
        ids = batch["input_ids"]
        assert torch.equal(full(ids, position_ids=batch["position_ids"]), model(ids, position_ids=batch["position_ids"]))
    torch.testing.assert_close(logps[1][:, :7], logps[0], rtol=1e-5, atol=1e-6)


def test_prompt_stream_resumes_where_it_was_and_splits_each_step_over_ranks():
    """Step k's prompts are a function of (seed, k): a stream started at step 3 (a resume) yields what the
    uninterrupted one yields from step 3; the ranks' slices of a step are disjoint and together the step's prompts;
    records are all visited once per epoch (10 records, 4 prompts per step)."""
    from itertools import islice

    from nxdt.lightning.grpo import PromptSteps

    def take(rank, start, steps):
        stream = PromptSteps(10, 4, seed=7, rank=rank, dp_size=2, start=lambda: start)
        return [b["indices"].tolist() for b in islice(iter(stream), steps)]

    whole = [a + b for a, b in zip(take(0, 0, 6), take(1, 0, 6))]
    assert [a + b for a, b in zip(take(0, 3, 3), take(1, 3, 3))] == whole[3:]
    flat = [i for step in whole for i in step]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # one epoch = a permutation
    assert flat[:10] != flat[10:20]  # each epoch its own order

    def take_every(rank, start, steps, iterations):  # num_iterations: a generation's prompts serve that many steps
        stream = PromptSteps(10, 4, seed=7, rank=rank, dp_size=2, start=lambda: start, iterations=iterations)
        return [b["indices"].tolist() for b in islice(iter(stream), steps)]

    assert take_every(0, 0, 6, 3) == [take(0, 0, 2)[0]] * 3 + [take(0, 0, 2)[1]] * 3  # generation g = step g's prompts
    assert take_every(1, 4, 2, 3) == take_every(1, 0, 6, 3)[4:]  # resumed inside a generation: its prompts again


def test_shipped_arithmetic_prompts_are_the_generator_output_and_the_rewards_score_them():
    from nxdt.data import SAMPLE_ARITHMETIC
    from nxdt.data.arithmetic import digits_only, exact_answer, make_arithmetic_records

    records = [json.loads(line) for line in SAMPLE_ARITHMETIC.read_text().splitlines()]
    assert records == make_arithmetic_records(256, seed=0)
    assert exact_answer(["12+13="] * 3, ["25", " 25 ", "26"], answer=["25"] * 3) == [1.0, 1.0, 0.0]
    assert digits_only(["1+1="] * 3, ["2", "2a", ""]) == [1.0, 0.5, 0.0]


# ChatML-like with the BOS the template writes itself (as Llama/Qwen templates do); the generation prompt opens the
# assistant's turn
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CHAT_REWARD = '''
import json
from pathlib import Path

def seen(prompts, completions, answer, **kwargs):
    """Logs what TRL's convention hands a reward function for conversational prompts; rewards the answer's digits."""
    with open(Path(__file__).with_name("chat_calls.jsonl"), "a") as fh:
        fh.write(json.dumps({"prompts": prompts, "completions": completions, "answer": answer}) + "\\n")
    return [float(sum(ch in a for ch in c[0]["content"])) for c, a in zip(completions, answer)]
'''


def _chat_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer directory as Hugging Face saves one (4 special tokens + 256 bytes), with a chat
    template."""
    tokenizers = pytest.importorskip("tokenizers")
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|begin|>", "<|end|>", "<|im_start|>", "<|im_end|>"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE({t: i for i, t in enumerate(specials + sorted(alphabet))}, [], unk_token=None)
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(specials)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin|>",
        "eos_token": "<|end|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_chat_prompts_get_the_chat_template_and_reward_functions_get_message_completions(tmp_path, monkeypatch_free_path):
    """Conversational prompt records (``prompt``: a message list) are rendered as transformers'
    ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` renders them (the same ids), and one
    GRPO step (in process, one rank) hands the reward function TRL's convention (trl/trainer/grpo_trainer.py,
    ``_generate_and_score_completions`` / ``_calculate_rewards``): ``prompts`` the records' message lists, each
    completion ``[{"role": "assistant", "content": text}]`` — the text of the sampled ids, decoded without special
    tokens — and the records' other columns as keyword lists; the metrics are those rewards."""
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl
    import torch

    from nxdt.lightning.grpo import encode_prompts
    from nxdt.lightning.registry import GRPO
    from nxdt.data.instructions import build_chat_tokenizer

    tokenizer_dir = _chat_tokenizer(tmp_path / "tokenizer")
    user = tmp_path / "chat_user"
    user.mkdir()
    (user / "chat_rewards.py").write_text(CHAT_REWARD)
    sys.path.insert(0, str(user))
    records = [
        {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a, b in ((3, 4), (12, 9), (7, 7), (15, 2))
    ]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = _cfg(
        f"data.tokenizer={tokenizer_dir}",
        f"data.train_dir={data}",
        "model.vocab_size=272",
        "model_alignment_strategy.grpo.reward_funcs=[chat_rewards:seen]",
        "model_alignment_strategy.grpo.reward_weights=null",
        "model_alignment_strategy.grpo.max_prompt_length=48",
        "model_alignment_strategy.grpo.max_completion_length=4",
        "data.seq_length=64",
        "data.global_batch_size=8",
        "data.micro_batch_size=4",
    )
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
        ids = encode_prompts(records, build_chat_tokenizer(tokenizer_dir), 48, 272)
        want = [hf.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True) for r in records]
        assert ids == [list(w["input_ids"]) for w in want]
        assert hf.decode(ids[0]).endswith("<|im_start|>assistant\n")  # the generation prompt opens the reply

        torch.manual_seed(cfg.seed)
        module = GRPO.build_module(cfg, 1, cfg.model, 8, 64, 4, seed=cfg.seed)
        trainer = pl.Trainer(
            max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
        )
        trainer.fit(module, datamodule=GRPO.build_datamodule(cfg))
        (call,) = [json.loads(line) for line in (user / "chat_calls.jsonl").read_text().splitlines()]
    finally:
        sys.path.remove(str(user))
        sys.modules.pop("chat_rewards", None)
    assert len(call["completions"]) == 8  # 2 prompts x num_generations 4
    by_prompt = {json.dumps(r["prompt"]): r["answer"] for r in records}
    assert [by_prompt[json.dumps(p)] for p in call["prompts"]] == call["answer"]  # prompts: the records' message lists
    for completion in call["completions"]:
        assert len(completion) == 1 and completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
    rewards = [float(sum(ch in a for ch in c[0]["content"])) for c, a in zip(call["completions"], call["answer"])]
    assert module.step_metrics["reward"] == pytest.approx(sum(rewards) / 8, rel=1e-6)  # fp32 mean of these values


def _grpo_iterations(tmp_path: Path, name: str, *layout: str) -> tuple[Path, list[dict]]:
    """4 steps of num_iterations=2 (epsilon 1e-6, beta 0.04) with the held-out length reward: the run and the reward
    function's calls."""
    user = _user_code(tmp_path / f"user_{name}")
    out = tmp_path / name
    result = _nxdt(
        tmp_path,
        *layout,
        "trainer.max_steps=4",
        "data.global_batch_size=8",
        "model_alignment_strategy.grpo.num_generations=4",
        "model_alignment_strategy.grpo.num_iterations=2",
        "model_alignment_strategy.grpo.epsilon=1e-6",
        "model_alignment_strategy.grpo.beta=0.04",
        "model_alignment_strategy.grpo.reward_funcs=[heldout_rewards:length_reward]",
        "model_alignment_strategy.grpo.reward_weights=null",
        # AdamW with eps=1: its update ≈ lr·m̂, linear in the gradient, so the layouts' summation-order differences in
        # the gradients stay that small instead of being blown up by Adam's normalisation of near-zero elements
        "model.optim.eps=1.0",
        "model.optim.lr=0.05",
        f"exp_manager.explicit_log_dir={out}",
        pythonpath=user,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return out, [json.loads(line) for line in (user / "calls.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_num_iterations_trains_each_generation_twice_and_context_parallelism_samples_and_trains_as_one_rank(tmp_path):
    """num_iterations=2 (TRL's μ) on one rank, 4 steps: two generations, each scored by the reward function once and
    trained on at two steps, the prompt stream advancing once per generation. A generation's first step sees the
    probability ratio 1 (its own forward is the sampling policy: nothing clipped, whatever epsilon); its second step
    scores the same completions with the updated policy against the kept log-probabilities, so with epsilon 1e-6 every
    token whose ratio moved by more than that and whose advantage pushes it further is clipped (the surrogate's
    arithmetic against TRL's, old log-probabilities given: tests/test_grpo_loss.py).

    The same on CP2 (2 ranks, one data-parallel rank): both ranks sample the whole completions (the KV cache holds whole
    sequences; the same generator, seeded by the data-parallel rank), each scores its two chunks of every row through
    the ring, its loss the share of its tokens. So the completions are one rank's, exactly, and the losses and KL one
    rank's up to the ring's summation order (measured: ≤ 2e-6 relative; rel 1e-4, and abs 1e-6 for step 1's loss,
    which is 0 up to rounding: ratio 1, advantages summing to 0)."""
    out, calls = _grpo_iterations(tmp_path, "one", "trainer.devices=1")
    assert len(calls) == 2  # one scoring per generation
    assert calls[0]["answer"] != calls[1]["answer"]  # the second generation's prompts are the stream's next
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    for first, second in ((rows[0], rows[1]), (rows[2], rows[3])):
        for key in ("reward", "reward_std", "completions/mean_length"):
            assert first[key] == second[key], key  # the same completions and rewards
        assert float(first["clip_ratio/region_mean"]) == 0.0
        assert float(second["clip_ratio/region_mean"]) > 0.05, second  # measured: 0.21 and 0.125 of the tokens
        assert float(second["loss"]) != float(first["loss"])

    cp_out, cp_calls = _grpo_iterations(tmp_path, "cp2", "trainer.devices=2", "distributed_strategy.context_parallel_size=2")
    by_rank: dict[int, list[list[str]]] = {}
    for call in cp_calls:
        by_rank.setdefault(call["pid"], []).append(call["completions"])
    assert len(by_rank) == 2 and all(c == [call["completions"] for call in calls] for c in by_rank.values())
    cp_rows = list(csv.DictReader(open(cp_out / "metrics.csv")))
    for got, want in zip(cp_rows, rows, strict=True):
        for key in ("reward", "reward_std", "completions/mean_length"):
            assert got[key] == want[key], (key, got, want)
        # a fraction of the tokens (counted in float64 over the two ranks' parts, in float32 on one rank)
        assert float(got["clip_ratio/region_mean"]) == pytest.approx(float(want["clip_ratio/region_mean"]), abs=1e-6)
        for key in ("loss", "kl"):
            assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-4, abs=1e-6), (key, got, want)
