"""Checkpoints Lightning loads (issue 33, item 6): under plain data parallelism NxDStrategy writes the one ``.ckpt`` file
DDPStrategy writes; ZeRO-1 and FSDP write nxdt directories that ``convert_to_lightning_checkpoint`` turns into that
file; NxDStrategy resumes a Lightning file on every layout. The runs: tests/lightning_conformance_ckpt.py (one torchrun
launch, 2 CPU ranks); the loads (``torch.load(weights_only=True)``, ``load_from_checkpoint``, ``Trainer(devices=1)
.validate(ckpt_path=)``) run here, in this process.

Tolerance (the conformance table's, docs/lightning-conformance.md): rtol 1e-5 with an absolute floor of 1e-7. With 2
ranks the data-parallel average is exact in both libraries and Adam applies the same element-wise operations to a
ZeRO-1/FSDP flat shard as to a parameter, so these runs (no clipping) agree bit for bit (measured: 0.0); a wrong
parameter order, a missing shard or the wrong optimizer state moves values by whole percent or changes shapes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import warm_cli
import torch
import lightning.pytorch as pl

from nxdt.cli import main
from nxdt.lightning import NxDStrategy, convert_to_lightning_checkpoint, reshard
from nxdt.lightning.checkpoint import CheckpointError, save
from nxdt.lightning.lightning_checkpoint import load_file, resolve_format
from nxdt.lightning.module import CausalLMModule
from nxdt.planner import plan_layout

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lightning_conformance_ckpt import HUB_RUNS, Net, data, hub_config, hub_module  # noqa: E402

RTOL, ATOL = 1e-5, 1e-7
CONVERTED = ("nxdt_zero1", "nxdt_fsdp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("conformance_ckpt")
    result = warm_cli.torchrun(HERE / "lightning_conformance_ckpt.py", [str(out)], cwd=out, timeout=220)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def lightning_file(out: Path, run: str) -> Path:
    """The file a run's epoch-1 checkpoint is for Lightning: its own, or its directory converted."""
    return out / f"{run}-converted.ckpt" if run in CONVERTED else out / run / "epoch1.ckpt"


def assert_same(got, want, where: str = "") -> None:
    """Equal structure; tensors within the tolerance, everything else exactly."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype, where
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, dict):
        assert list(got) == list(want), (where, list(got), list(want))
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", ["nxdt", *CONVERTED])
def test_the_lightning_file_is_ddps_file(runs, run):
    """``torch.load(weights_only=True)`` reads it; the same keys as DDP's, the same weights by the module's own names
    in its order, each optimizer's per-parameter state in the optimizer's own order (ZeRO-1's shards gathered, FSDP's
    flats cut back into parameters), schedulers, loops, epoch/global step and hyper-parameters."""
    out, _ = runs
    ddp = torch.load(out / "ddp" / "epoch1.ckpt", weights_only=True)
    got = torch.load(lightning_file(out, run), weights_only=True)
    assert sorted(got) == sorted(ddp)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "hyper_parameters", "hparams_name"):
        assert_same(got[key], ddp[key], key)
    assert (got["epoch"], got["global_step"]) == (ddp["epoch"], ddp["global_step"]) == (1, 4)
    # the ModelCheckpoint state is DDP's but for the run's own directory
    assert json.dumps(got["callbacks"], default=str).replace(run, "ddp") == json.dumps(ddp["callbacks"], default=str)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_plain_data_parallel_writes_files_and_sharded_runs_directories(runs):
    out, _ = runs
    for name in ("epoch1.ckpt", "last.ckpt", "epoch=0-step=4.ckpt"):  # trainer.save_checkpoint and ModelCheckpoint's
        assert (out / "nxdt" / name).is_file(), name
        torch.load(out / "nxdt" / name, weights_only=True)
        for run in CONVERTED:
            assert (out / run / name / "done").is_file(), (run, name)  # a committed nxdt directory


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", ["nxdt", *CONVERTED])
def test_load_from_checkpoint_gives_ddps_module(runs, run):
    out, _ = runs
    want = Net.load_from_checkpoint(out / "ddp" / "epoch1.ckpt")
    got = Net.load_from_checkpoint(lightning_file(out, run))
    assert dict(got.hparams) == dict(want.hparams) == {"hidden": 8, "lr": 0.01}
    assert_same(got.state_dict(), want.state_dict())
    assert not torch.equal(got.head.weight, Net().head.weight)  # trained: not the initial weights


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_validate_on_one_device_from_each_file_gives_ddps_metrics(runs, tmp_path):
    out, _ = runs

    def validate(path: Path) -> float:
        t = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
        return float(t.validate(Net(), data(2), ckpt_path=path, verbose=False)[0]["val_loss"])

    want = validate(out / "ddp" / "epoch1.ckpt")
    for run in ("nxdt", *CONVERTED):
        assert validate(lightning_file(out, run)) == pytest.approx(want, rel=RTOL), run


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", ["nxdt", *CONVERTED])
def test_fit_resumed_from_a_lightning_file_reaches_ddps_weights(runs, run):
    """The plain run resumes its own file; ZeRO-1 and FSDP resume DDP's (its optimizer state cut into their shards);
    after the second epoch every rank holds what DDP holds after resuming its own file."""
    _, reports = runs
    for rep in reports:
        want, got = rep["ddp"]["resumed_weights"], rep[run]["resumed_weights"]
        assert list(got) == list(want)
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=RTOL, abs=ATOL), name
        assert got != rep["ddp"]["epoch1_weights"]  # the second epoch trained
        assert rep[run]["resumed_val_loss"] == pytest.approx(rep["ddp"]["resumed_val_loss"], rel=RTOL)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_state_dict_has_the_modules_own_names_in_its_order(runs):
    """``strategy.lightning_module_state_dict()`` under FSDP: DDP's keys, in DDP's order (not fsdp_shard_<k>)."""
    _, reports = runs
    for rep in reports:
        assert rep["nxdt_fsdp"]["state_keys"] == rep["ddp"]["state_keys"] == list(Net().state_dict())


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(HUB_RUNS))
def test_pipeline_and_expert_parallel_directories_convert_to_the_file_load_from_checkpoint_reads(runs, name):
    """A Llama over 2 pipeline stages and a Mixtral with its 4 experts over 2 expert-parallel ranks, converted: the
    file holds every rank's part (each stage's layers; the dense layers once and every rank's experts), exactly, by
    the module's names in its order; ``CausalLMModule.load_from_checkpoint`` builds the module from it; the optimizer
    state is numbered as the unsharded model's own optimizer numbers its parameters (``load_state_dict`` takes it, and
    each index holds the moments of the parameter at that index). EP used to be refused ("not supported yet")."""
    out, reports = runs
    cfg = hub_config(HUB_RUNS[name][0])
    ranks = [torch.load(out / f"{name}-rank{r}.pt", weights_only=True) for r in range(2)]
    path = out / f"{name}-converted.ckpt"
    loaded = CausalLMModule.load_from_checkpoint(
        path,
        model_cfg=cfg.model,
        global_batch_size=cfg.data.global_batch_size,
        seq_length=cfg.data.seq_length,
        micro_batch_size=cfg.data.micro_batch_size,
    )
    state = loaded.state_dict()
    assert list(state) == list(hub_module(cfg).state_dict())  # the module's own names and order
    held = {k: v for rank in ranks for k, v in rank["weights"].items()}
    assert held.keys() == state.keys()  # the ranks' parts together are the whole model
    for rank in ranks:  # each rank's part, exactly (dense tensors of EP ranks are replicas)
        for k, v in rank["weights"].items():
            assert torch.equal(state[k], v), k
    if name == "ep2":  # each EP rank held 2 of the 4 experts of every layer
        assert [k for k in ranks[1]["weights"] if ".experts.0." in k] == []
        assert any(".experts.3." in k for k in ranks[1]["weights"]) and any(".experts.3." in k for k in state)
    optimizer = loaded.configure_optimizers()["optimizer"]  # what a single-process Trainer would build
    file_state = torch.load(path, weights_only=True)["optimizer_states"][0]
    optimizer.load_state_dict(file_state)  # the groups' sizes match the unsharded model's optimizer
    names = {id(p): n for n, p in loaded.named_parameters()}
    moments = {k: v for rank in ranks for k, v in rank["exp_avg"].items()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    assert sorted(order) == sorted(moments)
    for index, n in enumerate(order):
        assert torch.equal(file_state["state"][index]["exp_avg"], moments[n]), (index, n)
    # `nxdt checkpoint consolidate` (a one-rank nxdt directory) reads the same full state
    assert main(["checkpoint", "consolidate", str(out / f"{name}.ckpt"), str(out / f"{name}-full")]) == 0
    full = reshard.read_full_state(out / f"{name}-full")
    assert list(full.model) == list(state) and all(torch.equal(full.model[k], v) for k, v in state.items())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_expert_parallel_checkpoint_exports_and_starts_a_run_as_other_layouts(runs):
    """The Mixtral over EP2 (4 experts, each EP rank 2): ``nxdt checkpoint export-hf`` of its directory gives
    transformers the model whose logits equal those of the same weights exported from one rank (the directory
    consolidated to EP1 first) and those of nxdt's own module holding them; ``model.weight_init_only`` from it is
    accepted before any worker starts (it was refused: "expert-parallel ... cannot be consolidated yet") and starts
    the module from every rank's tensors, as from a checkpoint of any other layout.

    Tolerance: atol 1e-5 on logits of order 1. The two exports hold the same fp32 tensors (equal bit for bit, checked)
    and run the same transformers code: equal. nxdt's Mixtral computes the same function with its own kernels (the
    routing's top-2 weights, SwiGLU, RoPE): fp32 rounding of a 2-layer model, ~1e-6; a wrong or missing expert moves
    logits by ~1e-1."""
    from transformers import AutoModelForCausalLM

    from nxdt.cli import check_resume_checkpoint
    from nxdt.config import compose_config

    out, _ = runs
    cfg = hub_config(HUB_RUNS["ep2"][0])
    directory = out / "ep2.ckpt"
    assert main(["checkpoint", "consolidate", str(directory), str(out / "ep2-as-ep1")]) == 0
    for source, target in ((directory, "hf-ep2"), (out / "ep2-as-ep1", "hf-ep1")):
        assert main(["checkpoint", "export-hf", str(source), str(out / target)]) == 0
    from safetensors.torch import load_file as load_safetensors

    ep2, ep1 = (load_safetensors(out / t / "model.safetensors") for t in ("hf-ep2", "hf-ep1"))
    assert ep2.keys() == ep1.keys() and all(torch.equal(ep2[k], ep1[k]) for k in ep1)
    assert any(".experts.3." in k for k in ep2)  # rank 1's experts are in the export
    tokens = torch.randint(cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {t: AutoModelForCausalLM.from_pretrained(out / t).eval()(tokens).logits for t in ("hf-ep2", "hf-ep1")}
        module = CausalLMModule.load_from_checkpoint(
            out / "ep2-converted.ckpt",
            model_cfg=cfg.model,
            global_batch_size=cfg.data.global_batch_size,
            seq_length=cfg.data.seq_length,
            micro_batch_size=cfg.data.micro_batch_size,
        ).eval()
        own = module(tokens)
    torch.testing.assert_close(logits["hf-ep2"], logits["hf-ep1"], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits["hf-ep2"], own, rtol=0, atol=1e-5)

    # model.weight_init_only from the EP2 directory: accepted before workers start, and the module starts from it
    start = compose_config(
        [*HUB_RUNS["ep2"][0], f"exp_manager.resume_from_checkpoint={directory}", "model.weight_init_only=true"]
    )
    check_resume_checkpoint(start, None)  # raised ConfigError (EP2) before
    started = CausalLMModule(
        start.model,
        cfg.data.global_batch_size,
        cfg.data.seq_length,
        cfg.data.micro_batch_size,
        init_checkpoint=str(directory),
    )
    ranks = [torch.load(out / f"ep2-rank{r}.pt", weights_only=True)["weights"] for r in range(2)]
    state = started.state_dict()
    held = {k: v for rank in ranks for k, v in rank.items()}
    assert held.keys() == state.keys()
    assert all(torch.equal(state[k], v) for k, v in held.items())


# ------------------------------------------------------------------------------------------ without a launch
def test_unknown_checkpoint_format_is_refused_by_name():
    with pytest.raises(ValueError, match=r"checkpoint_format='zip'\): must be one of auto, file, directory"):
        NxDStrategy(checkpoint_format="zip")


def test_a_file_where_the_state_is_sharded_is_refused_naming_the_conversion():
    plan = plan_layout(2)
    assert resolve_format("auto", plan, "replicated", async_writes=False, peft_adapter=False) == "file"
    assert resolve_format("auto", plan, "zero1", async_writes=False, peft_adapter=False) == "directory"
    assert resolve_format("auto", plan, "replicated", async_writes=True, peft_adapter=False) == "directory"
    with pytest.raises(ValueError, match=r"sharded here \(fsdp=True\).*convert_to_lightning_checkpoint\(dir, out\)"):
        resolve_format("file", plan, "fsdp", async_writes=False, peft_adapter=False)
    tp = plan_layout(2, tp=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2"):
        resolve_format("file", tp, "replicated", async_writes=False, peft_adapter=False)
    with pytest.raises(ValueError, match=r"async_checkpointing=True writes nxdt directories only"):
        resolve_format("file", plan, "replicated", async_writes=True, peft_adapter=False)


def test_a_file_holding_objects_is_not_unpickled(tmp_path):
    from lightning.fabric.plugins import TorchCheckpointIO

    torch.save({"state_dict": {}, "anything": CheckpointError("not plain data")}, tmp_path / "x.ckpt")
    with pytest.raises(CheckpointError, match=r"nxdt does not unpickle \(weights_only=True\).*weights_only=False"):
        load_file(tmp_path / "x.ckpt", TorchCheckpointIO(), None)


def test_conversion_refuses_an_existing_target_and_adapters_only_checkpoints(tmp_path, capsys):
    ckpt = save({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, tmp_path / "step-1", write_latest=False)
    (tmp_path / "taken.ckpt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"taken.ckpt exists — name a new file"):
        convert_to_lightning_checkpoint(ckpt, tmp_path / "taken.ckpt")
    with pytest.raises(CheckpointError, match=r"inside the checkpoint"):
        convert_to_lightning_checkpoint(ckpt, ckpt / "out.ckpt")
    converted = torch.load(convert_to_lightning_checkpoint(ckpt, tmp_path / "out.ckpt"), weights_only=True)
    assert_same(converted, {"global_step": 1, "state_dict": {"w": torch.ones(2)}, "optimizer_states": []})
    # the same from the command line: nxdt checkpoint consolidate DIR OUT --lightning
    assert main(["checkpoint", "consolidate", str(ckpt), str(tmp_path / "cli.ckpt"), "--lightning"]) == 0
    assert_same(torch.load(tmp_path / "cli.ckpt", weights_only=True), converted)
    assert main(["checkpoint", "consolidate", str(ckpt), str(tmp_path / "cli.ckpt"), "--lightning"]) == 2
    assert "cli.ckpt exists — name a new file" in capsys.readouterr().err
    lora = save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "step-2", meta={"adapters_only": True}, write_latest=False)
    with pytest.raises(CheckpointError, match=r"LoRA adapters only .* export-hf"):
        convert_to_lightning_checkpoint(lora, tmp_path / "lora.ckpt")


def test_a_tensor_parallel_directory_converts_to_the_unsharded_models_file(tmp_path):
    """TP2 shards of a real Llama (tied embeddings, KV heads held by both ranks) and their AdamW state, written as the
    checkpointer writes them, convert to the file a single-process run of the unsharded model would hold: its
    ``state_dict()`` and its optimizer's own ``state_dict()`` (indices in its param-group order), bit for bit —
    concatenating shards is exact."""
    from safetensors.torch import save_file

    from nxdt.lightning import checkpoint as ckpt_io, reshard
    from nxdt.parallel.tensor_parallel import shard_layout
    from test_reshard import _full_module_and_optimizer, _tp_rank

    full, full_opt = _full_module_and_optimizer()
    saved = reshard.by_name(full_opt.state_dict(), reshard.param_names(full_opt, full))
    root = tmp_path / "step-1"
    root.mkdir()
    for r in range(2):
        module, opt = _tp_rank(full, r, 2)
        opt.load_state_dict(reshard.optimizer_state_for(saved, opt, module, tp_rank=r))
        save_file(ckpt_io._dedupe_shared(module.state_dict()), str(root / f"model-mp{r}.safetensors"))
        state = reshard.with_param_names({"global_step": 1, "optimizer_states": [opt.state_dict()]}, [opt], module)
        torch.save({**state, reshard.STATE_ORDER_KEY: list(module.state_dict())}, root / f"trainer_state-mp{r}.pt")
    degrees = {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "dp": 1}
    meta = {"format_version": 2, "step": 1, "world_size": 2, "degrees": degrees, "tensor_parallel": shard_layout(module.model)}
    (root / "meta.json").write_text(json.dumps(meta))
    (root / "done").write_text("ok\n")

    converted = torch.load(convert_to_lightning_checkpoint(root, tmp_path / "tp2.ckpt"), weights_only=True)
    assert sorted(converted) == ["global_step", "optimizer_states", "state_dict"]
    assert list(converted["state_dict"]) == list(full.state_dict())  # the module's own order
    for name, value in full.state_dict().items():
        assert torch.equal(converted["state_dict"][name], value), name
    [got] = converted["optimizer_states"]
    want = full_opt.state_dict()
    assert got["param_groups"] == want["param_groups"] and list(got["state"]) == list(want["state"])
    for i, entry in want["state"].items():
        assert all(torch.equal(got["state"][i][k], v) for k, v in entry.items()), i


def test_merged_order_keeps_every_ranks_own_order():
    """The names of EP ranks (each its own experts, global ids) and PP stages (each its own layers) merge into the
    unsharded module's order: a file numbers optimizer state in it, so a wrong merge would swap parameters' moments."""
    from nxdt.lightning.reshard import merged_order

    ep0 = ["embed", "l0.gate", "l0.experts.0", "l0.experts.1", "l0.norm", "l1.gate", "l1.experts.0", "l1.experts.1", "head"]
    ep1 = ["embed", "l0.gate", "l0.experts.2", "l0.experts.3", "l0.norm", "l1.gate", "l1.experts.2", "l1.experts.3", "head"]
    assert merged_order([ep0, ep1]) == [
        "embed",
        "l0.gate",
        "l0.experts.0",
        "l0.experts.1",
        "l0.experts.2",
        "l0.experts.3",
        "l0.norm",
        "l1.gate",
        "l1.experts.0",
        "l1.experts.1",
        "l1.experts.2",
        "l1.experts.3",
        "head",
    ]
    assert merged_order([["embed", "l0"], ["l1", "norm", "head"]]) == ["embed", "l0", "l1", "norm", "head"]  # stages
    assert merged_order([["a", "b"], ["a", "b"]]) == ["a", "b"]  # TP ranks list the same names
