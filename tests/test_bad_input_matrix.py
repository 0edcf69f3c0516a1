"""Bad input, everywhere a user can cause it (configs, CLI arguments, data paths, instances, checkpoints):
each case exits with code 2 and one clear line naming what was wrong, starts no worker, creates no run
directory and leaves no process or shared-memory segment behind. The CLI runs in-process here (the same
code path as the `nxdt` script minus interpreter start-up; test_config_cli.py covers real subprocesses)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch

from nxdt.cli import main
from nxdt.lightning import checkpoint as ckpt_io

LLAMA_TINY_SHAPE = {"vocab_size": 256, "hidden_size": 128, "num_layers": 4, "num_attention_heads": 4, "num_kv_heads": 2,
                    "ffn_hidden_size": 344}


def _checkpoint(root: Path, name: str, damage: str | None = None, model: dict | None = None, **layout) -> Path:
    path = root / name
    state = {"state_dict": {"model.w": torch.ones(4)}, "global_step": 3, "optimizer_states": []}
    meta = {"degrees": {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 2, **layout.pop("degrees", {})}, "world_size": 2, "zero1": False,
            "model": model or LLAMA_TINY_SHAPE, **layout}
    ckpt_io.save(state, path, meta=meta)
    if damage == "no-done":
        (path / "done").unlink()
    elif damage == "truncated":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:-8])
    elif damage == "garbage-state":
        (path / "trainer_state.pt").write_bytes(b"not a zip")
    return path


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    text = tmp / "notes.txt"
    text.write_text("hello")
    return [
        # config values and keys
        (["train", "trainer.max_steps=-1"], "trainer.max_steps"),
        (["train", "trainer.devices=abc"], "trainer.devices"),
        (["train", "trainer.devcies=2"], "did you mean"),
        (["train", "model=llama_huge"], "unknown model"),
        (["train", "data=parquet"], "unknown data"),
        (["train", "precision.type=fp8"], "precision.type"),
        (["train", "model.optim.name=sgd"], "model.optim.name"),
        (["train", "model.architecture=os.system"], "model.architecture"),
        (["train", "distributed_strategy.placement_order=tp-dp"], "placement_order"),
        # parallel layouts
        (["train", "trainer.devices=4", "distributed_strategy.tensor_model_parallel_size=3"], "tensor_model_parallel_size"),
        (["train", "distributed_strategy.pipeline_model_parallel_size=8", "trainer.devices=8", "data.global_batch_size=8",
          "data.micro_batch_size=1"], "pipeline_model_parallel_size"),
        (["train", "model=mixtral_tiny", "trainer.devices=4", "distributed_strategy.expert_model_parallel_size=4",
          "model.moe.num_experts=6", "data.global_batch_size=8", "data.micro_batch_size=2"], "num_experts"),
        (["train", "data.global_batch_size=6"], "data.global_batch_size"),
        (["train", "trainer.devices=2", "distributed_strategy.fsdp.enabled=true", "distributed_strategy.pipeline_model_parallel_size=2"], "fsdp"),
        (["train", "distributed_strategy.fsdp.enabled=true", "distributed_strategy.zero1=true"], "zero1"),
        (["train", "distributed_strategy.context_parallel_size=2"], "context_parallel_size"),
        # data
        (["train", "data.train_dir=/no/such/corpus.txt"], "data.train_dir"),
        (["train", "data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer"),
        (["train", "data.seq_length=100000"], "data.seq_length"),
        # instances and topology
        (["train", "instance=trn1.32xlarg"], "did you mean"),
        (["train", "instance=trn1.2xlarge", "trainer.num_nodes=2"], "multi-node"),
        (["train", "instance=trn1.32xlarge", "trainer.lnc=2"], "logical-NeuronCore"),
        (["plan", "instance=inf2.48xlarge", "distributed_strategy.tensor_model_parallel_size=4", "model=llama3_8b",
          "data.micro_batch_size=1", "data.global_batch_size=96"], "not consecutive"),
        # CLI arguments
        (["train", "--fast"], "unknown option"),
        (["train", "notakeyvalue"], "key=value"),
        (["launch"], "unknown command"),
        (["checkpoint", "show"], "usage"),
        # checkpoints
        (["train", f"exp_manager.resume_from_checkpoint={tmp / 'nowhere'}"], "does not exist"),
        (["train", f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'a', 'no-done')}"], "incomplete"),
        (["train", f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'b', 'truncated')}"], "truncated"),
        (["train", f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'c', 'garbage-state')}"], "damaged"),
        (["train", f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'd', model={'hidden_size': 64})}"], "another model"),
        (["train", f"exp_manager.resume_from_checkpoint={text}"], "not a directory"),
        (["checkpoint", "inspect", str(tmp / "nowhere")], "does not exist"),
        # resuming on another layout where resharding cannot help
        (["train", f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'e', degrees={'ep': 2})}"], "resharding expert-parallel"),
        (["train", f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'f', degrees={'tp': 2, 'dp': 1}, format_version=1)}"],
         "older nxdt"),
        (["checkpoint", "consolidate", str(tmp / "a")], "usage"),
        (["checkpoint", "consolidate", str(_checkpoint(tmp, "g")), str(tmp)], "not an empty directory"),
        (["checkpoint", "consolidate", str(_checkpoint(tmp, "h", degrees={"ep": 2})), str(tmp / "out")], "expert-parallel"),
    ]


def _children() -> set[int]:
    pids = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        pids |= {int(p) for p in Path(path).read_text().split()}
    return pids


def test_every_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inputs").mkdir()
    cases = _cases(tmp_path / "inputs")
    assert len(cases) >= 25
    segments, children = set(glob.glob("/dev/shm/nxdt-*")), _children()
    failures = []
    for argv, needle in cases:
        code = main(argv)
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        if code != 2 or len(lines) != 1 or needle not in lines[0] or "Traceback" in captured.err:
            failures.append(f"{argv}: exit {code}, stderr {lines}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "outputs").exists()  # no run directory: nothing was launched
    assert set(glob.glob("/dev/shm/nxdt-*")) <= segments and _children() <= children
