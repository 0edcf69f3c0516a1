"""nxdt.parallel.pipeline: stage splits, schedule invariants (every forward/backward once, forward before
backward, neighbours agree on message order, no deadlock, 1F1B memory bound) checked by an in-process
simulator; then the executor on the tiny Llama — in process (one stage, virtual chunks) and in spawned
worlds (PP2 1F1B / interleaved / GPipe, PP4) — against the single-process loss, gradients and 5 AdamW steps.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from nxdt.comm.spawn import run_local
from nxdt.models.llama import LlamaForCausalLM
from nxdt.parallel.pipeline import (
    Backward,
    Forward,
    PipelineDeadlock,
    PipelineExecutor,
    RecvActivation,
    SendActivation,
    build_chunks,
    chunk_parameters,
    forward_only,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    simulate,
    split_layers,
)

SEQ, MICRO_BATCH, LR, STEPS = 8, 2, 1e-2, 5
WEIGHTS = (0.5, 1.5, 0.0, 2.0)  # token weights of four micro-batches (mean 1, one without labels)


def config(num_layers: int = 4, **overrides) -> SimpleNamespace:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=num_layers,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        max_position_embeddings=64,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_word_embeddings=False,
        init_method_std=0.02,
        activations_checkpoint_granularity=None,
    )
    return SimpleNamespace(**{**base, **overrides})


def build(num_layers: int = 4, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config(num_layers, **overrides))


def microbatches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (MICRO_BATCH, SEQ), generator=g)
        labels = torch.randint(0, 64, (MICRO_BATCH, SEQ), generator=g)
        labels[:, -1] = -100  # ignored positions must stay ignored through the pipeline
        out.append((ids, labels))
    return out


def schedule_for(kind: str, num_stages: int, stage: int, num_microbatches: int, virtual: int):
    if kind == "1f1b":
        return one_f_one_b(num_stages, stage, num_microbatches)
    if kind == "interleaved":
        return interleaved_one_f_one_b(num_stages, stage, num_microbatches, virtual)
    return gpipe(num_stages, stage, num_microbatches, virtual)


# ------------------------------------------------------------------------------------------ single-process reference
def reference_grads(num_layers: int, mbs) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean micro-batch loss and its gradients; backward per micro-batch in order (as every schedule does)."""
    model = build(num_layers)
    total = 0.0
    for ids, labels in mbs:
        loss = model.loss_fn(model(ids), labels)
        total += loss.item()
        (loss / len(mbs)).backward()
    return total / len(mbs), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_training(num_layers: int, num_microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(num_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        mbs = microbatches(num_microbatches, seed=100 + step)
        opt.zero_grad()
        total = 0.0
        for ids, labels in mbs:
            loss = model.loss_fn(model(ids), labels)
            total += loss.item()
            (loss / len(mbs)).backward()
        opt.step()
        losses.append(total / len(mbs))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------ pure: stages
def test_split_layers_even_uneven_virtual_and_cuts():
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_layers(4, 2, virtual=2) == [[0], [1], [2], [3]]
    assert split_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_layers(6, 2, cuts=[4]) == [[0, 1, 2, 3], [4, 5]]
    assert split_layers(6, 2, virtual=2, cuts=[1, 3, 5]) == [[0], [1, 2], [3, 4], [5]]


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(num_layers=4, num_stages=8), r"8 stages = 8 model chunks but the model has only 4 layers"),
        (dict(num_layers=4, num_stages=2, virtual=4), r"2 stages × 4 virtual chunks = 8 model chunks .* only 4 layers"),
        (dict(num_layers=6, num_stages=3, cuts=[4, 2]), r"cuts=\[4, 2\] must be strictly increasing"),
        (dict(num_layers=6, num_stages=2, cuts=[6]), r"cuts=\[6\] must be strictly increasing integers in 1..5"),
        (dict(num_layers=6, num_stages=2, cuts=[0]), r"strictly increasing"),
        (dict(num_layers=6, num_stages=3, cuts=[2]), r"2 values for 3 chunks, got 1"),
        (dict(num_layers=4, num_stages=0), r"num_stages=0 must be a positive integer"),
    ],
)
def test_split_layers_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        split_layers(**args)


def test_build_chunks_owns_its_slice_and_drops_the_rest():
    full = dict(build(5).named_parameters())
    model = build(5)
    chunks = build_chunks(model, stage=1, num_stages=2, virtual=2, cuts=[1, 2, 4])  # chunks [0] [1] [2,3] [4]
    assert [c.layer_indices for c in chunks] == [[1], [4]]
    assert [(c.is_first, c.is_last) for c in chunks] == [(False, False), (False, True)]
    params = chunk_parameters(chunks)
    assert set(params) == {n for n in full if n.startswith(("layers.1.", "layers.4.", "norm.", "lm_head."))}
    for n, p in params.items():
        assert torch.equal(p, full[n]), n  # same seed → same weights as the single-process model
    # layers (and the embedding) of other stages are gone from this rank
    assert model.embed_tokens is None
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in params.values())
    # the first stage keeps the embedding; its first chunk eats token ids
    first = build_chunks(build(5), stage=0, num_stages=2, virtual=2, cuts=[1, 2, 4])
    assert first[0].is_first and not first[1].is_first and "embed_tokens.weight" in chunk_parameters(first)
    assert first[0](microbatches(1, 0)[0][0]).shape == (MICRO_BATCH, SEQ, 32)


def test_tied_embeddings_with_pp_raise_clearly():
    with pytest.raises(ValueError, match="tie_word_embeddings with PP>1 is not supported"):
        build_chunks(build(tie_word_embeddings=True), stage=0, num_stages=2)
    chunks = build_chunks(build(tie_word_embeddings=True), stage=0, num_stages=1, virtual=2)  # one stage: fine
    assert len(chunk_parameters(chunks)) == len(dict(build(tie_word_embeddings=True).named_parameters()))


def test_interleaved_needs_divisible_microbatches():
    with pytest.raises(ValueError, match=r"num_microbatches divisible by num_stages: got num_microbatches=6, num_stages=4"):
        list(interleaved_one_f_one_b(4, 0, 6, 2))
    with pytest.raises(ValueError, match=r"stage=2 must be in 0..1"):
        list(one_f_one_b(2, 2, 4))


# ------------------------------------------------------------------------------------------ pure: schedules
CASES = [(p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8) for v in (1, 2, 3)]


def _check_compute(tasks, num_microbatches: int, num_chunks: int) -> None:
    compute = [(type(t), t.microbatch, t.chunk) for t in tasks if isinstance(t, (Forward, Backward))]
    expected = {(k, mb, c) for k in (Forward, Backward) for mb in range(num_microbatches) for c in range(num_chunks)}
    counts = Counter(compute)
    assert set(counts) == expected and set(counts.values()) == {1}  # every F and B exactly once
    position = {key: i for i, key in enumerate(compute)}
    for mb in range(num_microbatches):
        for c in range(num_chunks):
            assert position[(Forward, mb, c)] < position[(Backward, mb, c)]


@pytest.mark.parametrize("kind", ["1f1b", "interleaved", "gpipe"])
def test_schedules_complete_ordered_and_deadlock_free(kind):
    checked = 0
    for p, m, v in CASES:
        if kind == "1f1b" and v > 1 or kind == "interleaved" and m % p:
            continue
        streams = [list(schedule_for(kind, p, s, m, v)) for s in range(p)]
        for tasks in streams:
            _check_compute(tasks, m, v)
        # blocking receives, asynchronous sends (the executor's semantics): finishes, messages match in order
        result = simulate(streams, num_chunks=v)
        if kind == "1f1b":
            assert result.peak_in_flight == [min(p - s, m) for s in range(p)]
            assert max(result.peak_in_flight) <= p
        if kind == "gpipe":
            assert result.peak_in_flight == [m * v] * p  # what 1F1B avoids
        checked += 1
    assert checked >= 20


def test_interleaved_order_matches_megatron_for_pp2_v2():
    # stage 0 of 2, 4 micro-batches, 2 chunks: warm-up (P-s-1)*2 + (V-1)*P = 4 forwards, then 1F1B
    compute = [
        ("F" if isinstance(t, Forward) else "B", t.microbatch, t.chunk)
        for t in interleaved_one_f_one_b(2, 0, 4, 2)
        if isinstance(t, (Forward, Backward))
    ]
    assert compute[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]
    assert compute[4:8] == [("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1)]
    # interleaving holds fewer activations than GPipe over the same chunks
    peak = simulate([interleaved_one_f_one_b(4, s, 8, 2) for s in range(4)], num_chunks=2).peak_in_flight
    assert max(peak) < 8 * 2


def test_simulator_detects_deadlock_and_misordered_messages():
    # with rendezvous sends, plain 1F1B deadlocks (stage 0 sends activation 1 while stage 1 sends grad 0):
    # this is why the executor's sends are asynchronous
    with pytest.raises(PipelineDeadlock, match="deadlock: every unfinished stage is blocked"):
        simulate([one_f_one_b(2, s, 4) for s in range(2)], send_capacity=0)
    # a stage that receives micro-batches in a different order than its neighbour sends them
    stage1 = list(one_f_one_b(2, 1, 3))
    i, j = [k for k, t in enumerate(stage1) if isinstance(t, RecvActivation)][:2]
    stage1[i], stage1[j] = stage1[j], stage1[i]
    with pytest.raises(PipelineDeadlock, match="expected micro-batch"):
        simulate([list(one_f_one_b(2, 0, 3)), stage1])
    # a send nobody receives
    stage0 = list(one_f_one_b(2, 0, 2)) + [SendActivation(0, 0, 1)]
    with pytest.raises(PipelineDeadlock, match="never received"):
        simulate([stage0, list(one_f_one_b(2, 1, 2))])


# ------------------------------------------------------------------------------------------ executor, in process
def test_executor_single_stage_virtual_chunks_matches_reference():
    """PP=1 with 2 chunks: activations hand over locally; same loss and gradients as the plain model."""
    mbs = microbatches(3, seed=7)
    ref_loss, ref_grads = reference_grads(4, mbs)
    chunks = build_chunks(build(4), stage=0, num_stages=1, virtual=2)
    loss = PipelineExecutor(chunks, None, LlamaForCausalLM.loss_fn).run(gpipe(1, 0, 3, 2), mbs)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    grads = {n: p.grad for n, p in chunk_parameters(chunks).items()}
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)


# ------------------------------------------------------------------------------------------ executor, spawned
def _pp_worker(world, runs):
    pp = world.new_communicator(list(range(world.world_size)), "pp")
    out = []
    for kind, num_layers, virtual, num_microbatches, train in runs:
        model = build(num_layers)
        chunks = build_chunks(model, pp.rank, pp.size, virtual)
        executor = PipelineExecutor(chunks, pp, LlamaForCausalLM.loss_fn)
        params = chunk_parameters(chunks)
        result = {"params": sorted(params)}
        if kind == "evaluate":  # validation: forward only, each micro-batch's loss on every stage, no gradient
            result["eval"] = executor.evaluate(
                [{"input_ids": i, "labels": lab} for i, lab in microbatches(num_microbatches, seed=7)]
            )
            result["grads"] = {n: p.grad for n, p in params.items() if p.grad is not None}
        elif kind == "weighted":  # micro-batch losses scaled by their loss_weight (SFT's token weights)
            mbs = [
                {"input_ids": i, "labels": lab, "loss_weight": torch.tensor(w, dtype=torch.float64)}
                for (i, lab), w in zip(microbatches(num_microbatches, seed=7), WEIGHTS)
            ]
            result["loss"] = executor.run(one_f_one_b(pp.size, pp.rank, num_microbatches), mbs)
            result["grads"] = {n: p.grad.numpy().copy() for n, p in params.items()}
        elif not train:
            mbs = microbatches(num_microbatches, seed=7)
            result["loss"] = executor.run(schedule_for(kind, pp.size, pp.rank, num_microbatches, virtual), mbs)
            result["grads"] = {n: p.grad.numpy().copy() for n, p in params.items()}  # numpy: plain pickles
        else:
            opt = torch.optim.AdamW(params.values(), lr=LR)
            losses = []
            for step in range(STEPS):
                opt.zero_grad()
                mbs = microbatches(num_microbatches, seed=100 + step)
                losses.append(executor.run(schedule_for(kind, pp.size, pp.rank, num_microbatches, virtual), mbs))
                opt.step()
            result["losses"] = losses
            result["final"] = {n: p.detach().numpy().copy() for n, p in params.items()}
        out.append(result)
    return out


def _check_runs(runs, per_rank) -> None:
    for i, (kind, num_layers, virtual, num_microbatches, train) in enumerate(runs):
        results = [r[i] for r in per_rank]
        names = [n for r in results for n in r["params"]]
        full = dict(build(num_layers).named_parameters())
        assert sorted(names) == sorted(full), f"{kind}: stages must own every parameter exactly once"
        if kind == "evaluate":
            model = build(num_layers)
            with torch.no_grad():
                want = [float(model.loss_fn(model(ids), labels)) for ids, labels in microbatches(num_microbatches, seed=7)]
            for r in results:
                assert r["eval"] == pytest.approx(want, rel=1e-6) and r["grads"] == {}
        elif kind == "weighted":
            model = build(num_layers)
            ref_loss = 0.0
            for (ids, labels), w in zip(microbatches(num_microbatches, seed=7), WEIGHTS):
                loss = model.loss_fn(model(ids), labels) * w / num_microbatches
                loss.backward()
                ref_loss += float(loss)
            for r in results:
                assert r["loss"] == pytest.approx(ref_loss, rel=1e-5)
                for n, g in r["grads"].items():
                    torch.testing.assert_close(torch.from_numpy(g), dict(model.named_parameters())[n].grad, rtol=1e-5, atol=1e-7)
        elif not train:
            ref_loss, ref_grads = reference_grads(num_layers, microbatches(num_microbatches, seed=7))
            for r in results:  # the mean loss is known on every stage
                assert r["loss"] == pytest.approx(ref_loss, rel=1e-5), kind
            for r in results:
                for n, g in r["grads"].items():
                    torch.testing.assert_close(torch.from_numpy(g), ref_grads[n], rtol=1e-5, atol=1e-7, msg=f"{kind}: {n}")
        else:
            ref_losses, ref_final = reference_training(num_layers, num_microbatches)
            for r in results:
                assert r["losses"] == pytest.approx(ref_losses, rel=1e-4), kind
                for n, p in r["final"].items():
                    torch.testing.assert_close(torch.from_numpy(p), ref_final[n], rtol=1e-4, atol=1e-6, msg=f"{kind}: {n}")


@pytest.mark.timeout(120)
def test_pp2_1f1b_interleaved_gpipe_match_single_process():
    runs = [
        ("1f1b", 4, 1, 4, False),
        ("interleaved", 4, 2, 4, False),
        ("gpipe", 4, 1, 3, False),
        ("1f1b", 4, 1, 3, True),
        ("interleaved", 4, 2, 4, True),
        ("evaluate", 4, 2, 3, False),
        ("weighted", 4, 1, 4, False),
    ]
    _check_runs(runs, run_local(_pp_worker, 2, runs, timeout_s=110))


@pytest.mark.timeout(120)
def test_pp4_1f1b_and_interleaved_match_single_process():
    runs = [("1f1b", 4, 1, 6, False), ("interleaved", 8, 2, 4, False)]
    _check_runs(runs, run_local(_pp_worker, 4, runs, timeout_s=110))


@pytest.mark.parametrize("stages, chunks, mbs", [(2, 1, 3), (4, 1, 5), (2, 2, 4), (3, 2, 2)])
def test_forward_only_schedule_runs_every_forward_once_without_deadlock(stages, chunks, mbs):
    """Validation's schedule: each stage forwards every (micro-batch, chunk) once, in micro-batch order, with the
    matching receives and sends (simulate checks every message's source), no backward."""
    result = simulate([forward_only(stages, s, mbs, chunks) for s in range(stages)], num_chunks=chunks)
    for stream in result.tasks:
        forwards = [(t.microbatch, t.chunk) for t in stream if isinstance(t, Forward)]
        assert forwards == [(m, v) for m in range(mbs) for v in range(chunks)]
        assert not any(isinstance(t, Backward) for t in stream)
