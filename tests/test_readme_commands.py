"""Every shell command of the README's (and docs/migrating-from-nxdt.md's) ```bash blocks runs as written, or is
skipped here by name with the reason (issues 31 and 39). A command the docs gain that is in neither list fails
``test_every_documented_command_is_run_or_skipped``, so it is run or consciously skipped.

The rules, applied to the command as the docs spell it:

- ``<run>`` is the one placeholder filled in: the run directory the previous training command of the same chain
  printed (``outputs/<name>/<timestamp>``); ``<timestamp>`` of a sweep likewise. Optional ``[...]`` arguments are
  left out. Every other placeholder (``<...>``, ``path/to/``, ``/path/to/``, ``DIR``, ``...``, ``$VAR``) is skipped.
- Short-run suffix: a training command (``nxdt train`` that starts workers) that names ``trainer.max_steps`` runs
  as written (the docs keep such runs at 30 steps or fewer); any other gets ``trainer.max_steps=N`` appended, N
  its ``exp_manager.checkpoint_every_n_steps`` (so the checkpoint it is about is written once) or else 2.
- Commands run in a temporary directory holding a link ``tests`` to this repository's ``tests/`` (the docs' NxDT
  config examples name ``tests/nxdt_configs``, as run from the repository root). Commands that start no workers
  (plan, topo, --help, comm-test --estimate, runs) run in-process through ``nxdt.cli.main``; training and the
  checkpoint commands after it run as the ``nxdt`` program, chained in the docs' order, each a fork of a pre-imported
  process (``tests/warm_cli.py``: the same argv through ``nxdt.cli.main``; a fresh interpreter's start-up is
  test_fresh_install.py's and test_first_output.py's).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import warm_cli

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "migrating-from-nxdt.md"]

PLACEHOLDER = re.compile(r"<(?!run>|timestamp>)[^>]*>|path/to/|\bDIR\b|\.\.\.|\$")
OPTIONAL = re.compile(r"\s*\[[^\]]*\]")  # an optional argument of a usage line: left out


def placeholder(command: str) -> bool:
    return bool(PLACEHOLDER.search(OPTIONAL.sub("", command)))


# command (as normalised by documented_commands) -> why it is not run here
SKIPPED = {
    "pip install -e .": "installs the package: tests/test_fresh_install.py installs it into a fresh virtualenv",
    "nxdt train": "the default run (50 steps): shared_runs.py's everyday_runs launches it (30 steps) for "
    "tests/test_train_e2e.py::test_default_run_learns_on_the_sample_text_and_fills_the_run_dir",
    "pip install -e .[test]": "installs the package with its test extras: tests/test_fresh_install.py",
    "python -m pytest -q -n 2 --dist loadgroup": "the whole suite, this file included",
    "nxdt comm-test --calibrate": "measures the host for about a minute on 2 ranks and writes the per-host cache "
    "(read only when a plan asks: --calibration auto); no test runs it",
    "nxdt plan --calibration auto": "needs the per-host file --calibrate writes (skipped above): "
    "tests/test_calibration.py runs it on a crafted calibration in that place",
    "tensorboard --logdir outputs/llama_tiny/<run>/tensorboard": "TensorBoard's server, not nxdt; it does not exit",
    "nxdt train trainer.num_nodes=4 trainer.devices=2 distributed_strategy.tensor_model_parallel_size=2 "
    "data.micro_batch_size=2 data.global_batch_size=16 launcher=slurm launcher.partition=cpu "
    'launcher.sbatch_args=["--constraint=efa"]': "submits a Slurm job; tests/test_multinode.py runs Slurm "
    "where slurm-wlm is installed",
}
# placeholders: listed so that a new placeholder command is seen too (the reason is the placeholder)
PLACEHOLDER_SKIPS = {
    "nxdt train trainer.devices=4 distributed_strategy.zero1=true "
    "exp_manager.resume_from_checkpoint=<a TP2×DP2 step-10>": "tests/test_reshard.py resumes across layouts",
    "nxdt train model.hf_checkpoint=path/to/hf-llama ...": "tests/test_hf_interop.py starts from HF weights",
    "WANDB_MODE=offline nxdt train exp_manager.create_wandb_logger=true +exp_manager.wandb_logger_kwargs.project=<project>": "tests/"
    "test_trackers.py trains with W&B offline (and MLflow) and resumes it",
    "nxdt train exp_manager.create_mlflow_logger=true +exp_manager.mlflow_logger_kwargs.tracking_uri=http://mlflow.example:5000 "
    "...": "a tracking server; tests/test_trackers.py logs to a file store and refuses an unreachable server",
    "nxdt eval perplexity path/to/run/checkpoints/step-10 --data held_out.txt --seq-length 128 [--ranks 2]": "tests/"
    "test_eval.py evaluates a shared run's checkpoint and its HF export",
    "nxdt eval generate path/to/hf-export --data val.jsonl --max-new-tokens 64": "tests/test_eval.py",
    "nxdt generate path/to/hf-export --prompt What is 2 + 3? --prompt Name a prime. --max-new-tokens 32": "tests/"
    "test_generate_cmd.py samples from a transformers-saved tiny Llama",
    "nxdt generate path/to/run/checkpoints/step-10 --prompts prompts.jsonl --temperature 0.7 --top-p 0.9 --seed 1 "
    "--out completions.jsonl": "tests/test_generate_cmd.py",
    "nxdt train +recipe=sft data.train_dir=train.jsonl data.val_dir=val.jsonl data.tokenizer=path/to/hf-tokenizer-dir "
    "model_alignment_strategy.sft.packing=false trainer.val_check_interval=20": "tests/test_sft_e2e.py",
    "nxdt train +recipe=sft exp_manager.resume_from_checkpoint=<pretraining run>/checkpoints/step-500 "
    "model.weight_init_only=true": "tests/test_sft_e2e.py starts SFT from a checkpoint's weights",
    "nxdt train trainer.num_nodes=2 trainer.devices=2 data.micro_batch_size=2 launcher=torchrun "
    "launcher.rdzv_endpoint=10.0.0.1:29500 launcher.rdzv_id=llama-run1 launcher.node_rank=$NODE_RANK": "two hosts: "
    "tests/test_multinode.py",
    "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NODE_RANK=1 nxdt train trainer.num_nodes=2 launcher=torchrun "
    "launcher.rdzv_id=llama-run1 ...": "two hosts: tests/test_multinode.py",
    "nxdt train ... launcher=torchrun ... launcher.dry_run=true": "tests/test_multinode.py",
    "nxdt train ... launcher=slurm launcher.dry_run=true": "tests/test_multinode.py",
    "nxdt train ... launcher=slurm launcher.wait=true": "tests/test_multinode.py",
    "nxdt comm-test -N 2 -r 4 --rdzv-endpoint 10.0.0.1:29500 --node-rank $NODE_RANK --show-algorithm --check "
    "--baseline gloo allr allg redsct alltoall bcast reduce sendrecv": "two hosts: tests/test_multinode.py",
    "nxdt plan --config-path conf --config-name hf_llama3_8B_config instance=trn1.32xlarge "
    "model.model_config=/path/to/Meta-Llama-3-8B/config.json": "your config: the README's form on tests/nxdt_configs is run",
    "nxdt train --config-path conf --config-name hf_llama3_8B_config instance=cpu trainer.devices=2 "
    "trainer.num_nodes=1 distributed_strategy.tensor_model_parallel_size=2 "
    "model.model_config=/path/to/Meta-Llama-3-8B/config.json model.num_layers=2 model.hidden_size=64 "
    "model.num_attention_heads=4 model.num_kv_heads=2 model.ffn_hidden_size=128 model.vocab_size=256 "
    "model.encoder_seq_length=32 data.global_batch_size=4 trainer.max_steps=10 "
    "data.train_dir=/path/to/tokenized_dataset": "your config and data: the README's form on the shipped sample is run",
}

# no workers: run in-process, each in its own temporary directory
IN_PROCESS = [
    "nxdt train --help",
    "nxdt plan trainer.devices=8 distributed_strategy.tensor_model_parallel_size=2",
    "nxdt plan --config-path tests/nxdt_configs --config-name hf_llama3_8B_config instance=trn1.32xlarge",
    "nxdt plan --config-name nxdt/hf_llama3_8B_config instance=trn1.32xlarge",
    "nxdt topo trn1.32xlarge",
    "nxdt plan instance=trn1.32xlarge trainer.num_nodes=4 model=llama3_8b distributed_strategy.tensor_model_parallel_size=8 "
    "data.micro_batch_size=1 data.global_batch_size=128",
    "nxdt plan distributed_strategy=auto instance=trn1.32xlarge trainer.num_nodes=16 model=llama3_70b "
    "precision.type=mixed_precision distributed_strategy.zero1=true data.micro_batch_size=1 data.global_batch_size=1024",
    "nxdt comm-test --estimate --instance trn1.2xlarge -b 1kb -e 1gb -d bf16 allr",
    "nxdt train instance=p5.48xlarge launcher.dry_run=true",  # a dry run starts nothing, on a host without GPUs too
    "nxdt comm-test --estimate --instance trn1.32xlarge -N 2 -r 64 -b 8 -e 1gb -f 2 --show-algorithm "
    "--report-to-json-file e.json allr",
]

# workers: subprocesses, each chain in order in one temporary directory
CHAINS = {
    "pretraining": [
        "nxdt train model=llama_tiny data=synthetic trainer.devices=4 trainer.max_steps=10",
        "nxdt runs",
        "nxdt report outputs/llama_tiny/<run> [outputs/llama_tiny/<other> ...] [-o DIR]",
    ],
    "checkpoints": [
        "nxdt train trainer.max_steps=10 data.global_batch_size=16 data.micro_batch_size=2 "
        "exp_manager.checkpoint_every_n_steps=5",
        "nxdt checkpoint inspect outputs/llama_tiny/<run>/checkpoints/step-10",
        "nxdt checkpoint consolidate outputs/llama_tiny/<run>/checkpoints/step-10 full-10",
        "nxdt checkpoint export-hf outputs/llama_tiny/<run>/checkpoints/step-10 hf-out [--dtype bf16]",
        "nxdt train exp_manager.resume_if_exists=true trainer.max_steps=15",
    ],
    "layouts": [
        "nxdt train trainer.devices=4 distributed_strategy.tensor_model_parallel_size=2 "
        "distributed_strategy.sequence_parallel=true distributed_strategy.pipeline_model_parallel_size=2 "
        "data.micro_batch_size=2",
        "nxdt train exp_manager.max_restarts=2 exp_manager.checkpoint_every_n_steps=5",
        "nxdt train exp_manager.async_checkpointing=true exp_manager.checkpoint_every_n_steps=5",
    ],
    "fine-tuning": [
        "nxdt train +recipe=sft",
        "nxdt train +recipe=lora",
    ],
    "fsdp": [
        "nxdt train trainer.devices=4 distributed_strategy.fsdp.enabled=true",
        "nxdt train trainer.devices=4 distributed_strategy.tensor_model_parallel_size=2 "
        "distributed_strategy.sequence_parallel=true distributed_strategy.fsdp.enabled=true "
        "distributed_strategy.fsdp.prefetch=token_threaded exp_manager.trace=true",
        "nxdt plan --against outputs/<run>",
        "nxdt train trainer.devices=2 distributed_strategy.fsdp.enabled=true comm.emulate=trn1.32xlarge "
        "comm.emulate_slowdown=400",
    ],
    "sweep": [
        "nxdt train -m trainer.devices=1,2 trainer.max_steps=10",
        "nxdt sweep-report outputs/multirun/llama_tiny/<timestamp>",
    ],
    "collectives": ["nxdt comm-test -r 2 -b 1kb -e 16mb -f 4 --check --baseline gloo allr allg"],
    "nxdt-config": [
        "nxdt train --config-name nxdt/hf_llama3_8B_config instance=cpu trainer.devices=2 "
        "trainer.num_nodes=1 distributed_strategy.tensor_model_parallel_size=2 model.num_layers=2 "
        "model.hidden_size=64 model.num_attention_heads=4 model.num_kv_heads=2 model.ffn_hidden_size=128 "
        "model.vocab_size=256 model.encoder_seq_length=32 data.global_batch_size=4 trainer.max_steps=10 "
        "data.train_dir=tests/nxdt_configs/tokenized_sample",
    ],
}


def documented_commands() -> list[str]:
    """The commands of every ```bash block: continuation lines joined, comments dropped, ``a && b`` split; each
    normalised by shlex (quotes removed) so the tables above can spell it plainly."""
    found = []
    for path in DOCUMENTS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                while words:
                    cut = words.index("&&") if "&&" in words else len(words)
                    found.append(" ".join(words[:cut]))
                    words = words[cut + 1 :]
    return found


def test_every_documented_command_is_run_or_skipped():
    documented = documented_commands()
    covered = {**SKIPPED, **PLACEHOLDER_SKIPS}.keys() | set(IN_PROCESS) | {c for chain in CHAINS.values() for c in chain}
    neither = [c for c in documented if c not in covered]
    assert not neither, "documented commands neither run nor skipped in this file:\n" + "\n".join(neither)
    stale = sorted(covered - set(documented))
    assert not stale, "listed here but no longer in the docs:\n" + "\n".join(stale)
    for command in PLACEHOLDER_SKIPS:
        assert placeholder(command), f"skipped as a placeholder but has none: {command}"
    for command in [*IN_PROCESS, *(c for chain in CHAINS.values() for c in chain)]:
        assert not placeholder(command), f"run here but has a placeholder: {command}"


def workdir(tmp_path: Path) -> Path:
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    return tmp_path


@pytest.mark.parametrize("command", IN_PROCESS)
def test_command_without_workers_runs_as_written(command, tmp_path, monkeypatch, capsys):
    from nxdt.cli import main

    monkeypatch.chdir(workdir(tmp_path))
    argv = shlex.split(command)
    assert argv[0] == "nxdt"
    code = main(argv[1:])
    out = capsys.readouterr()
    assert code == 0, f"{command}: exit {code}\n{out.out[-2000:]}\n{out.err[-2000:]}"


def short_run(argv: list[str]) -> list[str]:
    """The short-run suffix (module docstring)."""
    if argv[:2] != ["nxdt", "train"] or any(a.startswith("trainer.max_steps=") for a in argv):
        return argv
    every = [a.split("=", 1)[1] for a in argv if a.startswith("exp_manager.checkpoint_every_n_steps=")]
    return [*argv, f"trainer.max_steps={every[-1] if every else 2}"]


def filled(command: str, cwd: Path) -> list[str]:
    """``<run>``: the newest run directory under outputs/llama_tiny; ``<timestamp>``: the newest sweep; ``[...]``
    optional arguments left out."""
    command = OPTIONAL.sub("", command)
    if "<run>" in command:
        runs = sorted((cwd / "outputs" / "llama_tiny").iterdir(), key=lambda p: p.stat().st_mtime)
        run = f"outputs/llama_tiny/{runs[-1].name}"  # the docs write outputs/llama_tiny/<run> or outputs/<run>
        command = command.replace("outputs/llama_tiny/<run>", run).replace("outputs/<run>", run)
    if "<timestamp>" in command:
        sweeps = sorted((cwd / "outputs" / "multirun" / "llama_tiny").iterdir(), key=lambda p: p.stat().st_mtime)
        command = command.replace("<timestamp>", sweeps[-1].name)
    return short_run(shlex.split(command))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("chain", list(CHAINS))
def test_training_commands_run_as_written(chain, tmp_path):
    cwd = workdir(tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for command in CHAINS[chain]:
        argv = filled(command, cwd)
        result = warm_cli.run(argv[1:], cwd=cwd, env=env, timeout=400)
        assert result.returncode == 0, (
            f"{' '.join(argv)}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
