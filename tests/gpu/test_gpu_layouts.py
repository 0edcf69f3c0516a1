"""Model and data parallelism on a GPU (issue 37): two ranks sharing the one GPU (CUDA IPC from 1 MiB, staged below)
under each layout, against one rank on the same GPU — the same model, seed and global batch at fp32.

Bound: the CPU suite's parity bounds (tests/test_model_parallel_e2e.py 1e-5, tests/test_context_parallel_e2e.py 1e-4)
are rounding-level: each layout computes the same sums split or ordered differently. On a GPU cuBLAS also picks its
kernel (and its split of the inner dimension) by shape, so a TP shard's matmul adds in another order than the whole
one: fp32 reorderings of ~1e-7 relative each, grown by 8 AdamW steps to ~1e-5. 1e-4 for every layout."""

from __future__ import annotations

import pytest

from test_gpu import nxdt_train, train_rows

COMMON = ["instance=gpu", "precision.type=fp32", "data.global_batch_size=8"]
LAYOUTS = {
    "zero1": ["distributed_strategy.zero1=true"],
    "fsdp": ["distributed_strategy.fsdp.enabled=true"],
    "tp2_sp": ["distributed_strategy.tensor_model_parallel_size=2", "distributed_strategy.sequence_parallel=true"],
    "pp2": ["distributed_strategy.pipeline_model_parallel_size=2"],
    # FSDP's units gathered once per step and the micro-batches' gradients summed across the interleaved 1F1B passes
    "pp2_fsdp": ["distributed_strategy.pipeline_model_parallel_size=2", "distributed_strategy.fsdp.enabled=true"],
    "cp2": ["distributed_strategy.context_parallel_size=2"],
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return nxdt_train(tmp_path_factory.mktemp("one"), *COMMON, "trainer.devices=1")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_on_one_gpu_match_one_rank(layout, one_rank, tmp_path):
    two = nxdt_train(tmp_path / layout, *COMMON, "trainer.devices=2", *LAYOUTS[layout])
    assert sorted(two) == sorted(one_rank) == list(range(1, 9))
    for step in one_rank:
        assert two[step] == pytest.approx(one_rank[step], rel=1e-4), (layout, step, one_rank, two)


def test_expert_parallel_on_one_gpu_matches_one_rank(tmp_path):
    """Mixtral with EP=2 (each rank holds 2 of the 4 experts; tokens go to their experts' rank by all-to-all) against
    one rank holding all 4, fp32. The same 1e-4: expert matmuls see other row groupings (cuBLAS picks by shape), and a
    router choice flips only where two experts' scores tie within ~1e-6, which 8 steps of 512 tokens rarely meet."""
    mixtral = [*COMMON, "model=mixtral_tiny"]
    one = nxdt_train(tmp_path / "one", *mixtral, "trainer.devices=1")
    two = nxdt_train(tmp_path / "ep2", *mixtral, "trainer.devices=2", "distributed_strategy.expert_model_parallel_size=2")
    assert sorted(two) == sorted(one) == list(range(1, 9))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), (step, one, two)


@pytest.mark.parametrize("layout", ["one_rank", "zero1"])
def test_a_run_stopped_at_its_checkpoint_resumes_on_the_gpu_to_the_uninterrupted_losses(layout, one_rank, tmp_path):
    """Checkpoints of a GPU run (the model, the optimizer state — ZeRO-1's shards — and the RNG) saved at step 4 and
    resumed by the same command to step 8 continue one rank's uninterrupted run. The schedule is pinned to 8 steps, as
    the uninterrupted run's is; the same bound as the layouts (the resumed steps are the same kernels on the same
    data, apart from the order of CUDA's atomic additions)."""
    ranks = ["trainer.devices=1"] if layout == "one_rank" else ["trainer.devices=2", *LAYOUTS["zero1"]]
    resume = [*COMMON, *ranks, "model.optim.sched.max_steps=8", "exp_manager.resume_if_exists=true"]
    run = tmp_path / layout
    first = nxdt_train(run, *resume, "exp_manager.checkpoint_every_n_steps=4", "trainer.max_steps=4")
    assert sorted(first) == [1, 2, 3, 4] and (run / "checkpoints" / "step-4").is_dir()
    both = nxdt_train(run, *resume, "exp_manager.checkpoint_every_n_steps=4", "trainer.max_steps=8")
    assert sorted(both) == list(range(1, 9))
    for step in one_rank:
        assert both[step] == pytest.approx(one_rank[step], rel=1e-4), (layout, step, one_rank, both)


def test_packed_sft_validated_under_cp_on_one_gpu_matches_one_rank(tmp_path):
    """``+recipe=sft`` (packed instruction records) validated at steps 4 and 8: CP=2 on two ranks sharing the GPU (the
    ring masks keys of other records, each attention call all-gathers the segment ids on the GPU; validation runs the
    ring forward and combines the ranks' token means) against one rank, fp32; losses and val_loss to the layouts'
    1e-4."""
    sft = [
        "instance=gpu",
        "precision.type=fp32",
        "+recipe=sft",
        "data.val_split=0.1",
        "trainer.val_check_interval=4",
        "trainer.max_steps=8",
        "trainer.log_every_n_steps=1",
        "exp_manager.save_last=false",
    ]
    one = train_rows(tmp_path / "one", *sft, "trainer.devices=1")
    two = train_rows(tmp_path / "cp2", *sft, "trainer.devices=2", "distributed_strategy.context_parallel_size=2")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [str(s) for s in range(1, 9)]
    for a, b in zip(one, two):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-4), (a, b)
        assert (a["val_loss"] == "") == (b["val_loss"] == "") and (a["step"] in ("4", "8")) == (a["val_loss"] != ""), (a, b)
        if a["val_loss"]:
            assert float(b["val_loss"]) == pytest.approx(float(a["val_loss"]), rel=1e-4), (a, b)
