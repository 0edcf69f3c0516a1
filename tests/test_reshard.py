"""Resume on another layout: a checkpoint's shards ⇄ one full state ⇄ another layout's shards.

In-process: the resharding core round-trips a real Llama's TP shards (tied embeddings, replicated KV
heads) and AdamW state bit for bit, and one rank loads the consolidated result directly. End to end: a
TP2×DP2 run's checkpoint resumed as DP4 with ZeRO-1 (written asynchronously), whose ZeRO-1 checkpoint,
consolidated, is resumed as TP1×PP2 — every continuation has the uninterrupted run's losses (1e-5 relative)."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nxdt.lightning import checkpoint as ckpt_io, reshard
from nxdt.lightning.optim import parameter_groups
from nxdt.models.llama import LlamaForCausalLM
from nxdt.parallel.tensor_parallel import apply_tensor_parallel, shard_layout
from nxdt.config.hf_model import tensor_parallel_plan_of

CFG = types.SimpleNamespace(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    max_position_embeddings=64,
    rope_theta=10000.0,
    norm_eps=1e-5,
    tie_word_embeddings=True,
    init_method_std=0.02,
    activations_checkpoint_granularity=None,
)


class _Module(torch.nn.Module):  # stands in for CausalLMModule: the hub model as `model`
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def _full_module_and_optimizer() -> tuple[_Module, torch.optim.AdamW]:
    torch.manual_seed(0)
    module = _Module(LlamaForCausalLM(CFG))
    opt = torch.optim.AdamW(parameter_groups(module.model, 0.1), lr=1e-2)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # real moments and step counters
    return module, opt


def _tp_rank(full: _Module, rank: int, size: int) -> tuple[_Module, torch.optim.AdamW]:
    module = copy.deepcopy(full)
    apply_tensor_parallel(
        module.model, types.SimpleNamespace(rank=rank, size=size), plan=tensor_parallel_plan_of(module.model)
    )  # slicing only needs rank/size
    return module, torch.optim.AdamW(parameter_groups(module.model, 0.1), lr=1e-2)


def test_tp_shards_round_trip_through_the_full_state_bitwise(tmp_path):
    """Full state → TP4 ranks (the load path) → shard files → full state (the read path): identical, including
    the tied lm_head (one vocab shard per rank) and KV heads held by two ranks each."""
    tp = 4
    full, full_opt = _full_module_and_optimizer()
    names = reshard.param_names(full_opt, full)
    saved = reshard.by_name(full_opt.state_dict(), names)
    root = tmp_path / "step-1"
    root.mkdir()
    for r in range(tp):
        module, opt = _tp_rank(full, r, tp)
        opt.load_state_dict(reshard.optimizer_state_for(saved, opt, module, tp_rank=r))
        assert opt.state[module.model.layers[0].self_attn.k_proj.weight]["exp_avg"].shape[0] == 8  # 2 KV heads → 1 per 2 ranks
        save_file(ckpt_io._dedupe_shared(module.state_dict()), str(root / f"model-mp{r}.safetensors"))
        state = reshard.with_param_names({"global_step": 1, "optimizer_states": [opt.state_dict()]}, [opt], module)
        torch.save(state, root / f"trainer_state-mp{r}.pt")
    layout = shard_layout(module.model)
    assert layout["lm_head.weight"] == layout["embed_tokens.weight"] and layout["layers.0.self_attn.k_proj.weight"] == [0, 2]
    (root / "meta.json").write_text(
        json.dumps(
            {
                "format_version": 2,
                "step": 1,
                "world_size": tp,
                "zero1": False,
                "degrees": {"tp": tp, "pp": 1, "cp": 1, "ep": 1, "dp": 1},
                "tensor_parallel": layout,
            }
        )
    )
    (root / "done").write_text("ok\n")

    got = reshard.read_full_state(root)
    want = full.state_dict()
    assert got.model.keys() == want.keys() and all(torch.equal(got.model[k], want[k]) for k in want)
    opt_state = got.optimizers[0]
    assert opt_state["param_groups"] == saved["param_groups"]
    for name, entry in saved["state"].items():
        assert all(torch.equal(opt_state["state"][name][k], v) for k, v in entry.items()), name
    assert got.trainer["global_step"] == 1

    # one rank loads the consolidated checkpoint directly (no resharding); an optimizer that holds its
    # parameters in another order gets each parameter's own state, matched by name
    out = reshard.consolidate(root, tmp_path / "full")
    assert ckpt_io.read_meta(out)["degrees"]["tp"] == 1 and not (tmp_path / "latest").exists()
    assert not ckpt_io.check_layout(out, {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1}, False)
    loaded = ckpt_io.load(out)
    fresh = copy.deepcopy(full)
    fresh_opt = torch.optim.AdamW([{**g, "params": g["params"][::-1]} for g in parameter_groups(fresh.model, 0.1)], lr=1e-2)
    [state] = reshard.optimizer_states_for(loaded, [fresh_opt], fresh, tp_rank=0)
    fresh_opt.load_state_dict(state)
    want_by_name = {n: full_opt.state[p] for n, p in full.named_parameters()}
    for n, p in fresh.named_parameters():
        assert all(torch.equal(fresh_opt.state[p][k], v) for k, v in want_by_name[n].items()), n


def test_an_unsupported_reshard_is_one_line_naming_it(tmp_path):
    meta = {"format_version": 2, "degrees": {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "dp": 1}, "zero1": False}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt_io.CheckpointError, match="records no tensor-parallel layout"):
        ckpt_io.check_layout(tmp_path, {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 2}, False)
    degrees = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 2}
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "format_version": 1, "degrees": degrees}))
    with pytest.raises(ckpt_io.CheckpointError, match="older nxdt"):
        ckpt_io.check_layout(tmp_path, {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "dp": 1}, False)
    # the data-parallel degree alone may change without resharding (each rank reads its own shard files)
    assert not ckpt_io.check_layout(tmp_path, {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 4}, False)


# ---------------------------------------------------------------------------------------------- end to end
E2E = [
    "model=llama_tiny",
    "trainer.log_every_n_steps=1",
    "exp_manager.create_tensorboard_logger=false",
    "data=synthetic",
    "trainer.max_steps=9",
    "model.optim.sched.max_steps=9",
    "data.global_batch_size=8",
    "data.micro_batch_size=2",
    "trainer.gradient_clip_val=0.5",
    "exp_manager.checkpoint_every_n_steps=3",
    "exp_manager.keep_last_k=5",
]


def assert_eval_perplexity_equals_transformers(checkpoint: Path, tmp_path: Path) -> None:
    """``nxdt eval perplexity`` reads a checkpoint of any layout (its shards consolidated on read, one process):
    on 1,500 bytes of the sample text it equals transformers' perplexity of the checkpoint's Hugging Face export on
    the same windows (tests/test_eval.py's reference and its tolerance analysis: 1e-5 relative)."""
    pytest.importorskip("transformers")
    from test_eval import run_eval, transformers_perplexity

    from nxdt.data import SAMPLE_TEXT
    from nxdt.lightning.hf import export_hf

    name = f"{checkpoint.parent.parent.name}-{checkpoint.name}"
    text, hf = tmp_path / f"{name}.txt", tmp_path / f"{name}-hf"
    text.write_bytes(SAMPLE_TEXT.read_bytes()[-1500:])
    export_hf(checkpoint, hf)
    want, predicted = transformers_perplexity(hf, list(text.read_bytes()), 128)
    got = run_eval("perplexity", str(checkpoint), "--data", str(text), "--seq-length", "128", out=tmp_path / f"{name}.json")
    assert got["predicted_tokens"] == predicted == 11 * 127 + 91  # 1,500 byte tokens: 11 windows and a 92-token tail
    assert got["perplexity"] == pytest.approx(want, rel=1e-5), (checkpoint, got, want)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_tp2_dp2_resumes_as_dp4_zero1_then_as_tp1_pp2_and_pp2_fsdp2_with_the_uninterrupted_losses(tmp_path, capsys):
    from test_train_e2e import assert_ok, losses, nxdt
    from nxdt.cli import main

    ref, dp4, pp2 = tmp_path / "tp2-dp2", tmp_path / "dp4-zero1", tmp_path / "pp2"
    assert_ok(
        nxdt(
            "train",
            *E2E,
            "trainer.devices=4",
            "distributed_strategy.tensor_model_parallel_size=2",
            f"exp_manager.explicit_log_dir={ref}",
            cwd=tmp_path,
        )
    )
    want = losses(ref)
    assert_eval_perplexity_equals_transformers(ref / "checkpoints/step-3", tmp_path)  # TP2×DP2 shards

    def assert_continues(run: Path, first: int) -> None:
        got = losses(run)
        assert sorted(got) == list(range(first, 10)), got
        for step, loss in got.items():
            assert loss == pytest.approx(want[step], rel=1e-5), (run.name, step, got, want)

    # TP2×DP2 → DP4 with ZeRO-1 (TP shards joined, moments sliced over 4 DP ranks), saved asynchronously
    result = nxdt(
        "train",
        *E2E,
        "trainer.devices=4",
        "distributed_strategy.zero1=true",
        "exp_manager.async_checkpointing=true",
        f"exp_manager.resume_from_checkpoint={ref / 'checkpoints/step-3'}",
        f"exp_manager.explicit_log_dir={dp4}",
        cwd=tmp_path,
    )
    assert_ok(result)
    assert "reshards it" in result.stdout
    assert_continues(dp4, 4)
    assert {"trainer_state-dp3.pt", "rng-rank3.safetensors"} <= {p.name for p in (dp4 / "checkpoints/step-6").iterdir()}

    # its ZeRO-1 DP4 shards consolidated into one full-state checkpoint (the reader resharding uses), resumed as
    # TP1×PP2 without ZeRO-1 (one rank loads it directly: test_tp_shards_round_trip_through_the_full_state_bitwise)
    full = tmp_path / "full"
    assert main(["checkpoint", "consolidate", str(dp4 / "checkpoints/step-6"), str(full)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert_ok(
        nxdt(
            "train",
            *E2E,
            "trainer.devices=2",
            "distributed_strategy.pipeline_model_parallel_size=2",
            f"exp_manager.resume_from_checkpoint={full}",
            f"exp_manager.explicit_log_dir={pp2}",
            cwd=tmp_path,
        )
    )
    assert_continues(pp2, 7)
    assert_eval_perplexity_equals_transformers(pp2 / "checkpoints/step-9", tmp_path)  # PP2 stages

    # the same ZeRO-1 shards resumed as PP2 × FSDP2 (each stage's moments cut into its FSDP flat shards; the step's
    # micro-batches interleave over the stages, each unit gathered once per step, the clip norm summed over both
    # stages); its FSDP shards then consolidate (each stage's unflattened by its recorded layout) into the
    # uninterrupted run's weights
    fsdp, fsdp_full = tmp_path / "pp2-fsdp2", tmp_path / "fsdp-full"
    assert_ok(
        nxdt(
            "train",
            *E2E,
            "trainer.devices=4",
            "distributed_strategy.pipeline_model_parallel_size=2",
            "distributed_strategy.fsdp.enabled=true",
            f"exp_manager.resume_from_checkpoint={dp4 / 'checkpoints/step-6'}",
            f"exp_manager.explicit_log_dir={fsdp}",
            cwd=tmp_path,
        )
    )
    assert_continues(fsdp, 7)
    assert {f"trainer_state-mp{s}-dp{d}.pt" for s in (0, 1) for d in (0, 1)} <= {
        p.name for p in (fsdp / "checkpoints/step-9").iterdir()
    }
    assert main(["checkpoint", "consolidate", str(fsdp / "checkpoints/step-9"), str(fsdp_full)]) == 0
    got, want_state = reshard.read_full_state(fsdp_full), reshard.read_full_state(ref / "checkpoints/step-9")
    assert sorted(got.model) == sorted(want_state.model)
    for name, tensor in want_state.model.items():
        assert torch.allclose(got.model[name], tensor, rtol=1e-4, atol=1e-5), name
    moments = {n: s["exp_avg"] for n, s in got.optimizers[0]["state"].items()}
    assert sorted(moments) == sorted(want_state.optimizers[0]["state"])
    for name, m in moments.items():
        assert torch.allclose(m, want_state.optimizers[0]["state"][name]["exp_avg"], rtol=1e-3, atol=1e-6), name


def test_step_counters_are_never_shared_between_parameters():
    """A by-name optimizer state (an FSDP flat's is one step counter for all its parameters) loads into torch's
    AdamW with one counter per parameter: AdamW increments them in place, so a shared one would advance once per
    parameter per step and skew the bias correction of all of them."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = torch.tensor(2.0)
    moments = {"exp_avg": torch.full((2, 2), 0.1), "exp_avg_sq": torch.full((2, 2), 0.01)}
    saved = {
        "state": {name: {"step": step, **{k: v.clone() for k, v in moments.items()}} for name in ("0.weight", "1.weight")},
        "param_groups": [{**opt.param_groups[0], "params": ["0.weight", "1.weight"]}],
    }
    opt.load_state_dict(reshard.optimizer_state_for(saved, opt, model, None))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [3.0, 3.0] and float(step) == 2.0
