"""Bad input, everywhere a user can cause it (configs, CLI arguments, data paths, instances, checkpoints):
each case exits with code 2 and one clear line naming what was wrong, starts no worker, creates no run
directory and leaves no process or shared-memory segment behind. The CLI runs in-process here (the same
code path as the `nxdt` script minus interpreter start-up; test_config_cli.py covers real subprocesses)."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np
import torch

from nxdt.cli import main
from nxdt.data import SAMPLE_INSTRUCTIONS
from nxdt.lightning import checkpoint as ckpt_io

LLAMA_TINY_SHAPE = {
    "vocab_size": 256,
    "hidden_size": 128,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 344,
}


def _checkpoint(root: Path, name: str, damage: str | None = None, model: dict | None = None, **layout) -> Path:
    path = root / name
    state = {"state_dict": {"model.w": torch.ones(4)}, "global_step": 3, "optimizer_states": []}
    meta = {
        "degrees": {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 2, **layout.pop("degrees", {})},
        "world_size": 2,
        "zero1": False,
        "model": model or LLAMA_TINY_SHAPE,
        **layout,
    }
    ckpt_io.save(state, path, meta=meta)
    if damage == "no-done":
        (path / "done").unlink()
    elif damage == "truncated":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[:-8])
    elif damage == "garbage-state":
        (path / "trainer_state.pt").write_bytes(b"not a zip")
    return path


WRONG_FIELDS = '{"prompt": "2+2", "answer": "4"}'
EMPTY_CHOSEN = '{"prompt": "2+2", "chosen": "4", "rejected": "5"}\n{"prompt": "2+3", "chosen": "", "rejected": "6"}'
NO_REJECTED = '{"prompt": "2+2", "chosen": "4"}'


def _jsonl(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text + ("\n" if text else ""))
    return directory / name


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
        (["train", "exp_manager.nan_policy=ignore"], "exp_manager.nan_policy"),
        (["train", "model.optim.name=sgd"], "model.optim.name"),
        (["train", "model.architecture=os.system"], "model.architecture"),
        (["train", "distributed_strategy.placement_order=tp-dp"], "placement_order"),
        # parallel layouts
        (["train", "trainer.devices=4", "distributed_strategy.tensor_model_parallel_size=3"], "tensor_model_parallel_size"),
        (
            [
                "train",
                "distributed_strategy.pipeline_model_parallel_size=8",
                "trainer.devices=8",
                "data.global_batch_size=8",
                "data.micro_batch_size=1",
            ],
            "pipeline_model_parallel_size",
        ),
        (
            [
                "train",
                "model=mixtral_tiny",
                "trainer.devices=4",
                "distributed_strategy.expert_model_parallel_size=4",
                "model.moe.num_experts=6",
                "data.global_batch_size=8",
                "data.micro_batch_size=2",
            ],
            "num_experts",
        ),
        (["train", "data.global_batch_size=6"], "data.global_batch_size"),
        (["train", "distributed_strategy.fsdp.enabled=true", "distributed_strategy.zero1=true"], "zero1"),
        (
            ["train", "trainer.devices=2", "distributed_strategy.context_parallel_size=2", "data.seq_length=126"],
            "must split into 2·CP = 4 equal chunks",
        ),
        # data
        (["train", "data.train_dir=/no/such/corpus.txt"], "data.train_dir"),
        (["train", "data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer"),
        (["train", "data.seq_length=100000"], "data.seq_length"),
        # fine-tuning data (instruction records: checked in the launcher, before any worker)
        (
            ["train", "+recipe=sft", f"data.train_dir={_jsonl(tmp, 'fields.jsonl', WRONG_FIELDS)}"],
            "record 0: needs 'input' and 'output'",
        ),
        (
            ["train", "+recipe=sft", f"data.train_dir={_jsonl(tmp / 'empty', 'train.jsonl', '')}"],
            "no record left to train on (0 read",
        ),
        (["train", "+recipe=sft", f"data.val_dir={_jsonl(tmp, 'val.jsonl', 'not json')}"], "data.val_dir"),
        (["train", "+recipe=sft", "data.source=text"], "model_alignment_strategy.sft trains on instruction records"),
        (["train", "data.source=instructions"], "add model_alignment_strategy.sft"),
        (["train", f"data.train_dir={SAMPLE_INSTRUCTIONS}"], "is JSON lines, which data.source=text would train on as raw text"),
        (["train", "model.weight_init_only=true"], "model.weight_init_only"),
        # preference data (DPO / ORPO): checked in the launcher, before any worker
        (
            ["train", "+recipe=dpo", f"data.train_dir={_jsonl(tmp, 'empty_chosen.jsonl', EMPTY_CHOSEN)}"],
            "record 1: 'chosen' must be a non-empty string",
        ),
        (
            ["train", "+recipe=orpo", f"data.train_dir={_jsonl(tmp, 'no_rejected.jsonl', NO_REJECTED)}"],
            "record 0: a preference record needs 'prompt', 'chosen' and 'rejected'; missing ['rejected']",
        ),
        (
            ["train", "+recipe=dpo", "model_alignment_strategy.dpo.loss_type=hinj"],
            "model_alignment_strategy.dpo.loss_type='hinj'",
        ),
        (["train", "+recipe=dpo", "model_alignment_strategy.dpo.loss_type=[sigmoid,aot]"], "dpo.loss_type='aot': it sorts"),
        (
            [
                "train",
                "+recipe=dpo",
                "model_alignment_strategy.dpo.loss_type=[sigmoid,sft]",
                "model_alignment_strategy.dpo.loss_weights=[1.0]",
            ],
            "model_alignment_strategy.dpo.loss_weights=[1.0]: has 1 weight(s) for loss_type ['sigmoid', 'sft']",
        ),
        (
            [
                "train",
                "+recipe=dpo",
                "model_alignment_strategy.dpo.loss_type=robust",
                "model_alignment_strategy.dpo.label_smoothing=0.5",
            ],
            "model_alignment_strategy.dpo.label_smoothing=0.5: must lie in [0, 0.5) for robust",
        ),
        (
            ["train", "+recipe=dpo", "model_alignment_strategy.dpo.loss_type=exo_pair"],
            "label_smoothing=0.0: must lie in (0, 1) for exo_pair",
        ),
        (
            [
                "train",
                "+recipe=dpo",
                "model_alignment_strategy.dpo.loss_type=nca_pair",
                "model_alignment_strategy.dpo.f_divergence_type=js_divergence",
            ],
            "f_divergence_type='js_divergence': is defined only for losses of the chosen − rejected score",
        ),
        (
            ["train", "+recipe=orpo", "model_alignment_strategy.orpo.nll_mean=mean"],
            "model_alignment_strategy.orpo.nll_mean='mean'",
        ),
        (
            [
                "train",
                "+recipe=dpo",
                "model_alignment_strategy.dpo.precompute_ref_log_probs=false",
                "distributed_strategy.pipeline_model_parallel_size=2",
            ],
            "model_alignment_strategy.dpo.precompute_ref_log_probs=False: with pipeline parallelism",
        ),
        (["train", "+recipe=dpo", "data.source=instructions"], "model_alignment_strategy.dpo trains on preference records"),
        (["train", "data.source=preferences"], "add model_alignment_strategy.dpo or .orpo"),
        # LoRA (model_alignment_strategy.peft): targets checked on the model built on the meta device
        (
            ["train", "+recipe=lora", "model_alignment_strategy.peft.target_modules=[qkv]"],
            "model_alignment_strategy.peft.target_modules: LoRA target_modules ['qkv']: unknown",
        ),
        (
            ["train", "+recipe=lora", "model=gpt_tiny", "model_alignment_strategy.peft.target_modules=[gate_up_proj]"],
            "GPTForCausalLM has no nn.Linear named ['gate_proj', 'up_proj']",
        ),
        (
            ["train", "+recipe=lora", "model_alignment_strategy.peft.merge_lora=true"],
            "model_alignment_strategy.peft.merge_lora=True",
        ),
        (["train", "trainer.limit_val_batches=2.5"], "trainer.limit_val_batches"),
        (["train", "data.val_split=1.0"], "data.val_split"),
        (["train", "data.val_dir=/no/such/validation.txt"], "data.val_dir"),
        # instances and topology
        (["train", "instance=trn1.32xlarg"], "did you mean"),
        (["train", "instance=trn1.2xlarge", "trainer.num_nodes=2"], "multi-node"),
        (["train", "instance=trn1.32xlarge", "trainer.lnc=2"], "logical-NeuronCore"),
        (
            [
                "plan",
                "instance=inf2.48xlarge",
                "distributed_strategy.tensor_model_parallel_size=4",
                "model=llama3_8b",
                "data.micro_batch_size=1",
                "data.global_batch_size=96",
            ],
            "not consecutive",
        ),
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
        (
            ["train", f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'e', degrees={'tp': 2, 'dp': 1})}"],
            "records no tensor-parallel layout",
        ),
        (
            [
                "train",
                f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'f', degrees={'tp': 2, 'dp': 1}, format_version=1)}",
            ],
            "older nxdt",
        ),
        (
            [
                "train",
                f"exp_manager.resume_from_checkpoint={_checkpoint(tmp, 'w', degrees={'ep': 2}, dp_format='fsdp')}",
                "model.weight_init_only=true",
            ],
            "model-ep0.safetensors is missing",  # before any worker starts
        ),
        (["checkpoint", "consolidate", str(tmp / "a")], "usage"),
        (["checkpoint", "consolidate", str(_checkpoint(tmp, "g")), str(tmp)], "not an empty directory"),
        # an EP2 checkpoint consolidates from each EP rank's files: here they are missing (written without EP)
        (
            ["checkpoint", "consolidate", str(_checkpoint(tmp, "h", degrees={"ep": 2})), str(tmp / "out")],
            "model-ep0.safetensors is missing",
        ),
        *((["train", override], needle) for override, needle in RANGE_CASES),
        *((["train", *overrides], needle) for overrides, needle in RANGE_COMBINED),
        *((["train", *overrides], needle) for overrides, needle in _launch_cases(tmp / "launch")),
    ]


LOOPING_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"


def _chat_tokenizer(directory: Path, template: str) -> Path:
    """A word-level tokenizer directory (8 ids: within llama_tiny's 256) with an EOS token and ``template``."""
    import tokenizers

    directory.mkdir(parents=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "user", "assistant", "a", "b", "c", "d"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))
    return directory


def _hardening_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """Issue 38, items 3, 4 and 6: data that would take the host down (devices, FIFOs, endless lines, a template that
    never ends, a model or adapter or process count the host cannot hold), text that would become shell lines or run
    files in system directories, and refusals that named the wrong key or none (or were accepted silently)."""
    tmp.mkdir()
    fifo = tmp / "fifo.jsonl"
    os.mkfifo(fifo)  # opening it to read blocked the launcher until a writer came
    os.mkfifo(tmp / "fifo.txt")
    (tmp / "fifo_dir").mkdir()
    os.mkfifo(tmp / "fifo_dir" / "a.txt")  # skipped: only regular *.txt files are text
    long_line = tmp / "long_line.jsonl"
    with open(long_line, "wb") as fh:  # one 17 MiB "record": a single endless line is what /dev/zero is
        fh.write(b'{"input": "' + b"a" * (17 << 20))
    same = _jsonl(
        tmp, "same.jsonl", '{"prompt": "p", "chosen": "x", "rejected": "x"}\n{"prompt": "q", "chosen": "y", "rejected": "y"}'
    )
    one = _jsonl(tmp, "one.jsonl", '{"input": "2+2", "output": "4"}')
    index_file = tmp / "index_cache_file"
    index_file.write_text("")
    (tmp / "scalar.yaml").write_text("5\n")
    (tmp / "broken.yaml").write_text("trainer:\n  max_steps: [1\n")
    open_dir = tmp / "open_dir"  # a run directory others may write (the run's store file would live in it)
    open_dir.mkdir()
    open_dir.chmod(0o777)
    looping = _chat_tokenizer(tmp / "looping_tokenizer", LOOPING_TEMPLATE)
    broken = _chat_tokenizer(tmp / "broken_tokenizer", "{% for m in messages %}{{ m.content }}")  # no endfor
    cases = [
        # data that takes down the host
        (["train", "data.train_dir=/dev/zero"], "data.train_dir='/dev/zero': is a character device, not a regular file"),
        (["train", "+recipe=sft", "data.train_dir=/dev/zero"], "/dev/zero is a character device, not a regular file"),
        (["train", f"data.train_dir={tmp / 'fifo.txt'}"], "fifo.txt': is a FIFO (named pipe), not a regular file"),
        (["train", "+recipe=sft", f"data.train_dir={fifo}"], "fifo.jsonl is a FIFO (named pipe), not a regular file"),
        (["train", "+recipe=dpo", f"data.train_dir={fifo}"], "fifo.jsonl is a FIFO (named pipe), not a regular file"),
        (["train", f"data.train_dir={tmp / 'fifo_dir'}"], "holds no *.txt file"),
        (["train", "+recipe=sft", f"data.train_dir={long_line}"], "long_line.jsonl:1: a line longer than 16 MiB"),
        (["train", "+recipe=sft", f"data.tokenizer={looping}"], "data.tokenizer="),
        (["train", "+recipe=sft", f"data.tokenizer={looping}"], "chat template: rendering took more than 1 s"),
        (["train", "model.num_layers=100000", "model.ffn_hidden_size=34400"], "model.num_layers=100000: a model of 1,325.9 B"),
        (
            ["train", "+recipe=lora", "model_alignment_strategy.peft.lora_rank=100000"],
            "model_alignment_strategy.peft.lora_rank: LoRA rank=100000 is larger than",
        ),
        (["comm-test", "-r", "5000"], "5000 ranks on this node is more than 8 per usable CPU core"),
        # text that becomes shell lines; run files in system directories
        (["train", "launcher.partition=a\nrm -rf x"], "launcher.partition='a\\nrm -rf x': contains a control character"),
        (
            ["train", "launcher=slurm", "launcher.partition=${oc.env:NXDT_TEST_RUN_NAME}"],
            "launcher.partition='run\\n1': contains a control character",
        ),
        (
            ["train", "launcher=slurm", "launcher.sbatch_args=[${oc.env:NXDT_TEST_RUN_NAME}]"],
            "launcher.sbatch_args[0]='run\\n1': contains a control character",
        ),
        (["train", "launcher=slurm", "launcher.sbatch_args=[rm]"], "launcher.sbatch_args[0]='rm': is not an sbatch option"),
        (["train", "exp_manager.explicit_log_dir=/etc"], "exp_manager.explicit_log_dir='/etc': is the system directory /etc"),
        (["train", "exp_manager.explicit_log_dir=/usr/lib/run"], "is inside the system directory /usr"),
        (["train", "exp_manager.exp_dir=/"], "exp_manager.exp_dir='/': is the shared directory / itself"),
        # refusals that named the wrong key or none
        (["train", "instance=../model/llama_tiny"], "instance='../model/llama_tiny': unknown instance"),
        (["train", "model=null"], "model='null': unknown model"),
        (["train", "model.hidden_size=${foo"], "model.hidden_size='${foo': is not a value Hydra's override grammar accepts"),
        (["train", "model.hidden_size=${oc.env:NXDT_TEST_UNSET}"], "model.hidden_size: "),
        (["train", "model.hidden_size=${model.nope}"], "model.hidden_size: Interpolation key 'model.nope' not found"),
        (
            ["train", "+recipe=sft", f"data.tokenizer={broken}"],
            f"data.tokenizer={str(broken)!r}: chat template does not compile",
        ),
        (["train", "data.splits_string=abc"], "data.splits_string='abc': is not a list of numbers"),
        # accepted silently before
        (["train", "+hydra.callbacks.x._target_=os.system"], "hydra.callbacks.x._target_='os.system': nxdt composes"),
        (["train", "hydra.run.dir=/tmp/elsewhere"], "hydra.run.dir='/tmp/elsewhere': nxdt composes"),
        # Hydra's delete: a schema key cannot be deleted (OmegaConf's words), a section was silently reset to defaults
        (["train", "~trainer.max_steps"], "trainer.max_steps: is a Hydra delete (~key), which nxdt does not take"),
        (["train", "~exp_manager"], "exp_manager: is a Hydra delete (~key), which nxdt does not take"),
        (["train", "+recipe=dpo", f"data.train_dir={same}"], "every record has 'chosen' equal to 'rejected' (2 of 2)"),
        (
            ["train", "+recipe=dpo", "model_alignment_strategy.dpo.max_prompt_length=64"],
            "model_alignment_strategy.dpo.max_prompt_length=64: is not below data.seq_length=64",
        ),
        (["train", f"data.index_mapping_dir={index_file}"], "data.index_mapping_dir="),
        (
            ["train", f"data.index_mapping_dir={index_file}/sub"],
            f"data.index_mapping_dir='{index_file}/sub': cannot be created or written: {index_file} is not a directory",
        ),
        (["train", "data.splits_string=980,10,10"], "data.splits_string='980,10,10': is a comma-separated list"),
        # an NxDT config file that is not a mapping, or not YAML: named with its line, not OmegaConf's or YAML's words
        (
            ["train", "--config-path", str(tmp), "--config-name", "scalar", "instance=trn1.32xlarge"],
            "scalar.yaml: holds a single value (int), not a mapping of config keys",
        ),
        (
            ["train", "--config-path", str(tmp), "--config-name", "broken", "instance=trn1.32xlarge"],
            "broken.yaml: not valid YAML: expected ',' or ']', but got '<stream end>' (line 3, column 1)",
        ),
        (["train", f"exp_manager.explicit_log_dir={open_dir}"], "is writable by other users (mode 0o777)"),
        (["train", "+recipe=sft", f"data.train_dir={one}"], "fewer than one global batch (data.global_batch_size=8)"),
    ]
    if os.geteuid() == 0:  # a directory of another user's (only root can make one here)
        theirs = tmp / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        cases.append((["train", f"exp_manager.explicit_log_dir={theirs}"], "exists and belongs to uid 65534, not to you"))
    return cases


def _crafted_file_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """Issue 38 probes written outside the matrix (round three): checkpoint metadata that is a FIFO or oversized
    (``checkpoint inspect`` read meta.json with read_text: a hang, or all of it into memory), a FIFO planted as a model
    file (``export-hf`` read its safetensors header before verifying: a hang), buffers larger than the host
    (``comm-test -e`` forked the ranks and left them to the OOM killer), and a FIFO given to ``data convert-megatron``
    ("no such file")."""
    tmp.mkdir()
    fifo_meta = _checkpoint(tmp, "fifo_meta")
    (fifo_meta / "meta.json").unlink()
    os.mkfifo(fifo_meta / "meta.json")
    huge_meta = _checkpoint(tmp, "huge_meta")
    with open(huge_meta / "meta.json", "r+b") as fh:
        fh.truncate(17 << 20)  # sparse: costs no disk
    fifo_model = _checkpoint(tmp, "fifo_model")
    (fifo_model / "model.safetensors").unlink()
    os.mkfifo(fifo_model / "model.safetensors")
    os.mkfifo(tmp / "fifo.txt")
    (tmp / "docs.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')  # record 2 fails after record 1 was written
    return [
        (
            ["data", "convert-megatron", str(tmp / "docs.jsonl"), "--output-prefix", str(tmp / "corpus")],
            "docs.jsonl:2: no string field 'text'",
        ),
        (["checkpoint", "inspect", str(fifo_meta)], "meta.json is missing or unreadable (not a regular file"),
        (["checkpoint", "inspect", str(huge_meta)], "meta.json (more than the 16 MiB nxdt reads of a checkpoint's metadata)"),
        (["checkpoint", "export-hf", str(fifo_model), str(tmp / "hf")], "model.safetensors is not a regular file"),
        (["comm-test", "-e", "10000gb"], "more than the"),  # 2 ranks × 3 buffers of 10 TB: no host has 60 TB available
        (["data", "convert-megatron", str(tmp / "fifo.txt"), "--output-prefix", str(tmp / "c")], "is a FIFO (named pipe)"),
        # sizes the parameter count did not see: RoPE tables of 10**9 positions (8 GB and climbing in the launcher's
        # model check before), a synthetic set's per-rank shuffled order of 10**15 samples (a hang); and a model made
        # large by its feed-forward width was blamed on model.num_layers=4
        (["train", "model.max_position_embeddings=1000000000"], "model.max_position_embeddings=1000000000: its RoPE tables"),
        (["train", "data=synthetic", "data.num_samples=1000000000000000"], "data.num_samples=1000000000000000: every rank"),
        (["train", "model.ffn_hidden_size=1000000000"], "model.ffn_hidden_size=1000000000: a model of 1,536.0 B"),
    ]


def _output_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """Issue 38 probes, round three: every command that writes a file the user names (``report -o``, ``eval --out``,
    ``generate --out``, ``comm-test --report-to-json-file``, ``comm-test --calibrate -o``) refuses a system directory
    (as explicit_log_dir does: nxdt.config.validate.output_path_problem) and a symbolic link at the last component,
    before anything runs; and files the user hands in are read size-capped (a 300 MB config.json was read whole) and
    without following a link (a calibration file)."""
    tmp.mkdir()
    run = tmp / "run"  # a finished run for `nxdt report`
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  max_steps: 2\n")
    (run / "plan.json").write_text("{}")
    (run / "metrics.csv").write_text("step,loss\n1,3.0\n2,2.5\n")
    (tmp / "elsewhere").mkdir()
    (tmp / "victim.json").write_text("keep")
    (tmp / "link.json").symlink_to(tmp / "victim.json")
    (tmp / "link_dir").symlink_to(tmp / "elsewhere")
    (tmp / "data.txt").write_text("some text to score")
    huge = tmp / "huge_hf"
    huge.mkdir()
    with open(huge / "config.json", "wb") as fh:
        fh.truncate(300 << 20)  # sparse: costs no disk; read whole before, 300 MB of memory
    estimate = ["comm-test", "--estimate", "--instance", "trn1.32xlarge"]
    checkpoint = _checkpoint(tmp, "ck")
    os.mkfifo(tmp / "fifo.txt")
    return [
        (["checkpoint", "export-hf", str(checkpoint), "/etc/nxdt-probe-hf"], "inside the system directory /etc"),
        (["checkpoint", "consolidate", str(checkpoint), "/usr/nxdt-probe-full"], "inside the system directory /usr"),
        (["data", "convert-megatron", str(tmp / "data.txt"), "--output-prefix", "/etc/nxdt-probe"], "system directory /etc"),
        # refused before torch is imported (a minute on a loaded host before): a MODEL that is no model, a FIFO --data
        (["generate", str(tmp / "elsewhere"), "--prompt", "hi"], "neither an nxdt checkpoint (meta.json) nor"),
        (["eval", "perplexity", str(checkpoint), "--data", str(tmp / "fifo.txt")], "is a FIFO (named pipe), not a regular"),
        (["eval", "perplexity", str(checkpoint), "--data", str(tmp / "data.txt"), "--ranks", "100000"], "--ranks 100000 must"),
        (["eval", "perplexity", str(checkpoint), "--data", str(tmp / "data.txt"), "--ranks", "0"], "--ranks 0 must be"),
        (["report", str(run), "-o", "/etc/nxdt-probe-report"], "inside the system directory /etc"),
        (["report", str(run), "-o", str(tmp / "link_dir")], "is a symbolic link"),
        (
            ["eval", "perplexity", str(tmp), "--data", str(tmp / "data.txt"), "--out", "/usr/nxdt-probe.json"],
            "system directory /usr",
        ),
        (
            ["generate", str(tmp), "--prompt", "hi", "--out", str(tmp / "link.json")],
            "--out " + str(tmp / "link.json") + " is a symbolic link",
        ),
        (["generate", str(tmp), "--prompt", "hi", "--seed", "-1"], "--seed -1 is out of range"),
        (["comm-test", "-r", "2", "--report-to-json-file", "/proc/nxdt-probe.json"], "inside the system directory /proc"),
        ([*estimate, "--report-to-json-file", "/etc/nxdt-probe.json"], "inside the system directory /etc"),
        ([*estimate, "--report-to-json-file", str(tmp / "link.json")], "is a symbolic link"),
        ([*estimate, "-r", "1000000000"], "-r 1000000000: one job holds at most 1,048,576 ranks"),  # named trainer.devices
        (
            ["comm-test", "--calibrate", "-o", "/etc/nxdt-probe-calibration.json"],
            "-o '/etc/nxdt-probe-calibration.json' is inside",
        ),
        (["plan", "--calibration", str(tmp / "fifo.txt")], "not a regular file (a FIFO, device or directory)"),
        (["train", f"model.hf_checkpoint={huge}"], "more than the 16 MiB nxdt reads of such a file"),
    ]


def test_argparse_refusals_are_one_line(capsys):
    """Issue 38 probe: every argparse-parsed command refuses a bad flag in one line (convert-megatron, topo and
    comm-test --estimate / --calibrate printed argparse's usage block first), exit 2."""
    import pytest

    for argv in (
        ["data", "convert-megatron", "--bogus"],
        ["data", "convert-megatron", "in.txt", "--output-prefix", "p", "--eod-id", "x"],
        ["topo", "trn1.32xlarge", "--lnc", "q"],
        ["comm-test", "--estimate"],
        ["comm-test", "--calibrate", "--bogus"],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exit_.value.code == 2 and len(err) == 1 and "--help lists the options" in err[0], (argv, err)


def _launch_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """What only the workers used to find (with tracebacks): training files, tokenizer, hf_checkpoint headers, the
    model class, host memory — each checked cheaply in the launcher (tests/test_launch_checks.py has the details)."""
    import pyarrow as pa
    import pyarrow.ipc  # noqa: F401
    import tokenizers
    from safetensors.torch import save_file

    tmp.mkdir()
    for name in ("empty_dir", "empty_file", "not_utf8", "saved", "no_input_ids", "not_arrow", "bad_state"):
        (tmp / name).mkdir()
    (tmp / "empty_file" / "a.txt").write_bytes(b"")
    (tmp / "not_utf8" / "a.txt").write_bytes(bytes(range(128, 256)) * 4)
    (tmp / "nul.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00" * 64)
    (tmp / "short.txt").write_text("too short")
    (tmp / "saved" / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    (tmp / "no_input_ids" / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    table = pa.table({"text": ["a", "b"]})
    with pa.ipc.new_stream(str(tmp / "no_input_ids" / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    (tmp / "not_arrow" / "state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    (tmp / "not_arrow" / "data-00000-of-00001.arrow").write_bytes(b"PAR1" * 100)
    (tmp / "bad_state" / "state.json").write_text('{"_data_files": [')
    (tmp / "tokenizer_garbage.json").write_bytes(b"\x00\x01 not json")
    from nxdt.data.megatron import write_indexed

    write_indexed(tmp / "corpus", [list(range(200))] * 4, np.uint16)  # a valid indexed dataset, byte-level ids
    write_indexed(tmp / "wide_corpus", [[300] * 200], np.uint16)  # ids beyond llama_tiny's 256
    (tmp / "no_idx.bin").write_bytes(b"")
    wide = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    wide.save(str(tmp / "tokenizer_1000.json"))

    # llama_tiny's parameters (HF names), then damaged copies; no config.json, so only the headers can tell
    shapes = {"model.embed_tokens.weight": (256, 128), "model.norm.weight": (128,), "lm_head.weight": (256, 128)}
    for i in range(4):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (128,),
                p + "post_attention_layernorm.weight": (128,),
                p + "self_attn.q_proj.weight": (128, 128),
                p + "self_attn.k_proj.weight": (64, 128),
                p + "self_attn.v_proj.weight": (64, 128),
                p + "self_attn.o_proj.weight": (128, 128),
                p + "mlp.gate_proj.weight": (344, 128),
                p + "mlp.up_proj.weight": (344, 128),
                p + "mlp.down_proj.weight": (128, 344),
            }
        )

    def checkpoint(name: str, **changes: torch.Tensor | None) -> Path:
        tensors = {k: torch.zeros(v) for k, v in shapes.items()}
        for key, value in changes.items():
            key = key.replace("__", ".")
            if value is None:
                del tensors[key]
            else:
                tensors[key] = value
        (tmp / name).mkdir()
        save_file(tensors, str(tmp / name / "model.safetensors"))
        return tmp / name

    truncated = checkpoint("hf_truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-1000])
    corrupt = checkpoint("hf_corrupt_header") / "model.safetensors"
    data = bytearray(corrupt.read_bytes())
    data[8:24] = b"\xff" * 16
    corrupt.write_bytes(bytes(data))
    wrong_length = checkpoint("hf_wrong_length") / "model.safetensors"
    wrong_length.write_bytes((1 << 40).to_bytes(8, "little") + wrong_length.read_bytes()[8:])
    wrong_shape = checkpoint("hf_wrong_shape", model__embed_tokens__weight=torch.zeros(512, 128))
    wrong_dtype = checkpoint("hf_wrong_dtype", lm_head__weight=torch.zeros(256, 128, dtype=torch.int8))
    missing = checkpoint("hf_missing", model__norm__weight=None)
    return [
        # data.train_dir (text): sampled, first KB of each file
        ([f"data.train_dir={tmp / 'empty_dir'}"], "holds no *.txt file"),
        ([f"data.train_dir={tmp / 'empty_file'}"], "a.txt is empty"),
        ([f"data.train_dir={tmp / 'not_utf8'}"], "a.txt is not UTF-8 text"),
        ([f"data.train_dir={tmp / 'nul.txt'}"], "is binary"),
        ([f"data.train_dir={tmp / 'short.txt'}"], "too few for one sample of data.seq_length=128"),
        ([f"data.train_dir={tmp / 'saved'}"], "set data.source=hf_dataset"),
        # data.train_dir (hf_dataset): JSON files and Arrow schema, no rows
        (["data.source=hf_dataset", f"data.train_dir={tmp / 'empty_dir'}"], "not a Hugging Face datasets directory"),
        (["data.source=hf_dataset", f"data.train_dir={tmp / 'bad_state'}"], "not what save_to_disk writes"),
        (["data.source=hf_dataset", f"data.train_dir={tmp / 'no_input_ids'}"], "has no input_ids column (has text)"),
        (["data.source=hf_dataset", f"data.train_dir={tmp / 'not_arrow'}"], "is not an Arrow stream"),
        (["data.source=hf_dataset", f"data.train_dir={tmp / 'short.txt'}"], "is a file"),
        # data.data_prefix (megatron): weights and prefixes, the .idx/.bin pair, token ids
        (["data.source=megatron", f"data.data_prefix=[1.0,{tmp / 'corpus'},2.0]"], "has 3 entries; give pairs"),
        (["data.source=megatron", f"data.data_prefix=[heavy,{tmp / 'corpus'}]"], "weight 'heavy'"),
        (["data.source=megatron", f"data.data_prefix=[1.0,{tmp / 'no_idx'}]"], "no no_idx.idx beside it"),
        (
            ["data.source=megatron", f"data.data_prefix=[1.0,{tmp / 'wide_corpus'}]"],
            "token id 300 is outside model.vocab_size=256",
        ),
        (["data.source=megatron"], "data.data_prefix: data.source=megatron reads Megatron indexed datasets"),
        # data.tokenizer
        ([f"data.tokenizer={tmp / 'tokenizer_garbage.json'}"], "not a valid tokenizer.json"),
        ([f"data.tokenizer={tmp / 'tokenizer_1000.json'}"], "has 1000 token ids, model.vocab_size=256"),
        # model.hf_checkpoint: safetensors headers against the configured model's parameters
        ([f"model.hf_checkpoint={truncated.parent}"], "truncated"),
        ([f"model.hf_checkpoint={corrupt.parent}"], "header is not JSON"),
        ([f"model.hf_checkpoint={wrong_length.parent}"], "does not start with a safetensors header"),
        ([f"model.hf_checkpoint={wrong_shape}"], "has shape [512, 128], the configured model expects [256, 128]"),
        ([f"model.hf_checkpoint={wrong_dtype}"], "lm_head.weight is I8, not floating-point weights"),
        ([f"model.hf_checkpoint={missing}"], "missing tensors model.norm.weight"),
        # model.architecture: a hub model class, not any attribute of a hub module
        (["model.architecture=nxdt.models.llama.rope_tables"], "is a function, not a torch.nn.Module model class"),
        (["model.architecture=nxdt.models.llama.math"], "is a module, not a torch.nn.Module model class"),
        (["model.architecture=nxdt.models.llama.RMSNorm"], "not a causal language model"),
        (["model.architecture=nxdt.models.llama.DEFAULT_IMPL"], "is a str"),
        # host memory: the plan's estimate × ranks on this host against MemAvailable
        (["model=llama3_70b", "trainer.devices=8", "data.global_batch_size=32"], "available (MemAvailable)"),
    ]


# Range checks: every numeric key refused outside what its consumer accepts (NaN, inf, negative, absurd sizes), and a
# run name that would leave exp_manager.exp_dir; (override, text the one line must hold: the key and the value shown).
RANGE_CASES = [
    # optimizer
    ("model.optim.lr=inf", "model.optim.lr=inf"),
    ("model.optim.lr=nan", "model.optim.lr=nan"),
    ("model.optim.lr=-0.001", "model.optim.lr=-0.001"),
    ("model.optim.lr=1e400", "model.optim.lr=inf"),
    ("model.optim.weight_decay=nan", "model.optim.weight_decay=nan"),
    ("model.optim.weight_decay=inf", "model.optim.weight_decay=inf"),
    ("model.optim.weight_decay=-0.1", "model.optim.weight_decay=-0.1"),
    ("model.optim.eps=0", "model.optim.eps=0.0"),
    ("model.optim.eps=-1e-8", "model.optim.eps=-1e-08"),
    ("model.optim.eps=nan", "model.optim.eps=nan"),
    ("model.optim.eps=inf", "model.optim.eps=inf"),
    ("model.optim.betas=[1.0,0.95]", "model.optim.betas[0]=1.0"),
    ("model.optim.betas=[0.9,1.0]", "model.optim.betas[1]=1.0"),
    ("model.optim.betas=[-0.1,0.95]", "model.optim.betas[0]=-0.1"),
    ("model.optim.betas=[0.9,-0.5]", "model.optim.betas[1]=-0.5"),
    ("model.optim.betas=[0.9,nan]", "model.optim.betas[1]=nan"),
    ("model.optim.betas=[0.9]", "model.optim.betas=[0.9]"),
    ("model.optim.betas=[0.9,0.95,0.99]", "model.optim.betas"),
    # learning-rate schedule
    ("model.optim.sched.warmup_steps=-1", "model.optim.sched.warmup_steps=-1"),
    ("model.optim.sched.max_steps=0", "model.optim.sched.max_steps=0"),
    ("model.optim.sched.max_steps=-5", "model.optim.sched.max_steps=-5"),
    ("model.optim.sched.constant_steps=-1", "model.optim.sched.constant_steps=-1"),
    ("model.optim.sched.min_lr=-1e-5", "model.optim.sched.min_lr=-1e-05"),
    ("model.optim.sched.min_lr=nan", "model.optim.sched.min_lr=nan"),
    ("model.optim.sched.min_lr=inf", "model.optim.sched.min_lr=inf"),
    ("model.optim.sched.min_lr=0.5", "model.optim.sched.min_lr=0.5"),  # above the peak lr
    # trainer
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1.0"),
    ("trainer.gradient_clip_val=nan", "trainer.gradient_clip_val=nan"),
    ("trainer.gradient_clip_val=inf", "trainer.gradient_clip_val=inf"),
    ("trainer.devices=100000", "trainer.devices=100000"),
    ("trainer.devices=5000", "trainer.devices=5000"),
    ("trainer.devices=0", "trainer.devices=0"),
    ("trainer.num_nodes=0", "trainer.num_nodes=0"),
    ("trainer.num_nodes=10000000", "trainer.num_nodes=10000000"),
    ("trainer.max_steps=1e23", "trainer.max_steps"),
    ("trainer.max_steps=1.5", "trainer.max_steps"),
    ("trainer.max_steps=100000000000000000000000", "trainer.max_steps=100000000000000000000000"),
    ("trainer.max_steps=4611686018427387905", "trainer.max_steps=4611686018427387905"),
    ("trainer.max_steps=0", "trainer.max_steps=0"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0"),
    ("trainer.max_epochs=-2", "trainer.max_epochs=-2"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0"),
    # model
    ("model.norm_eps=0", "model.norm_eps=0.0"),
    ("model.norm_eps=-1e-5", "model.norm_eps=-1e-05"),
    ("model.norm_eps=nan", "model.norm_eps=nan"),
    ("model.norm_eps=inf", "model.norm_eps=inf"),
    ("model.rope_theta=0", "model.rope_theta=0.0"),
    ("model.rope_theta=-10000", "model.rope_theta=-10000.0"),
    ("model.rope_theta=nan", "model.rope_theta=nan"),
    ("model.rope_theta=inf", "model.rope_theta=inf"),
    ("model.init_method_std=-0.02", "model.init_method_std=-0.02"),
    ("model.init_method_std=nan", "model.init_method_std=nan"),
    ("model.init_method_std=inf", "model.init_method_std=inf"),
    ("model.hidden_size=0", "model.hidden_size=0"),
    ("model.moe.num_experts=-1", "model.moe.num_experts=-1"),
    ("model.moe.router_aux_loss_coef=-0.1", "model.moe.router_aux_loss_coef=-0.1"),
    ("model.moe.router_aux_loss_coef=nan", "model.moe.router_aux_loss_coef=nan"),
    # seed: what numpy and torch accept
    ("seed=-1", "seed=-1"),
    ("seed=4294967296", "seed=4294967296"),
    ("seed=18446744073709551616", "seed=18446744073709551616"),
    # collectives and launcher
    ("comm.timeout_s=nan", "comm.timeout_s=nan"),
    ("comm.timeout_s=inf", "comm.timeout_s=inf"),
    ("comm.timeout_s=0", "comm.timeout_s=0.0"),
    ("comm.timeout_s=-5", "comm.timeout_s=-5.0"),
    ("comm.emulate_slowdown=inf", "comm.emulate_slowdown=inf"),
    ("comm.emulate_slowdown=nan", "comm.emulate_slowdown=nan"),
    ("launcher.join_timeout_s=nan", "launcher.join_timeout_s=nan"),
    # run name: one directory under exp_manager.exp_dir, after interpolation
    ("name=", "name: is empty"),
    ("name=' '", "name=' '"),
    ("name=a/b", "name='a/b'"),
    ("name=/etc", "name='/etc'"),
    ("name=..", "name='..'"),
    ("name=.", "name='.'"),
    ("name='a/../../escape'", "name='a/../../escape'"),
    ("name=a\\b", "name='a\\\\b'"),
    ("name=a\tb", "name='a\\tb'"),
    ("name='a\x1bb'", "name='a\\x1bb'"),
    ("name=${oc.env:HOME}", f"name={os.environ.get('HOME', '/')!r}"),
    ("name=${oc.env:NXDT_TEST_RUN_NAME}", "control character"),  # the test sets it to a name with a newline
    ("name=" + "x" * 300, "300 bytes"),
    # data
    ("data.micro_batch_size=0", "data.micro_batch_size=0"),
    ("data.global_batch_size=-8", "data.global_batch_size=-8"),
    ("data.seq_length=0", "data.seq_length=0"),
    ("data.num_samples=0", "data.num_samples=0"),
    # exp_manager
    ("exp_manager.keep_last_k=0", "exp_manager.keep_last_k=0"),
    ("exp_manager.checkpoint_every_n_steps=0", "exp_manager.checkpoint_every_n_steps=0"),
    ("exp_manager.max_restarts=-1", "exp_manager.max_restarts=-1"),
    ("exp_manager.fault_injection.step=0", "exp_manager.fault_injection.step=0"),
    ("exp_manager.fault_injection.step=51", "exp_manager.fault_injection.step=51"),  # beyond trainer.max_steps=50
    ("exp_manager.fault_injection.attempt=-1", "exp_manager.fault_injection.attempt=-1"),
    # instance (the catalogue's values can be overridden too)
    ("instance.devices=0", "instance.devices=0"),
    ("instance.cores_per_device=0", "instance.cores_per_device=0"),
    ("instance.compute_efficiency=0", "instance.compute_efficiency=0.0"),
    ("instance.compute_efficiency=1.5", "instance.compute_efficiency=1.5"),
    ("instance.link_efficiency=nan", "instance.link_efficiency=nan"),
    ("instance.memory_GiB=-1", "instance.memory_GiB=-1.0"),
    ("instance.peak_tflops_fp32=inf", "instance.peak_tflops_fp32=inf"),
    ("instance.intra_device.bandwidth_GBps=-1", "instance.intra_device.bandwidth_GBps=-1.0"),
    ("instance.inter_node.latency_us=nan", "instance.inter_node.latency_us=nan"),
    ("instance.compute_efficiency_fp32=1.5", "instance.compute_efficiency_fp32=1.5"),
    ("instance.nvls_efficiency=2", "instance.nvls_efficiency=2.0"),
    ("instance.memory_bandwidth_GBps=-1", "instance.memory_bandwidth_GBps=-1.0"),
    ("instance.inter_node.message_us=nan", "instance.inter_node.message_us=nan"),
    ("instance.network_protocols=[ll256]", "instance.network_protocols[0]='ll256': an NCCL protocol"),
    ("distributed_strategy.kv_replicator=0", "distributed_strategy.kv_replicator=0"),
]
# cases that need more than one override
RANGE_COMBINED = [
    (["model=mixtral_tiny", "model.moe.top_k=0"], "model.moe.top_k=0"),
    (["model=mixtral_tiny", "model.moe.top_k=5"], "model.moe.top_k=5"),  # more than its 4 experts
    (["exp_manager.fault_injection.step=5", "exp_manager.fault_injection.attempt=1"], "exp_manager.fault_injection.attempt=1"),
    (["launcher=torchrun", "launcher.join_timeout_s=inf"], "launcher.join_timeout_s=inf"),
]


def _children() -> set[int]:
    pids = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        pids |= {int(p) for p in Path(path).read_text().split()}
    return pids


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def _creator(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            return int.from_bytes(f.read(16)[8:16], "little", signed=True)  # header word 1: the creator's pid
    except OSError:
        return None  # already removed


def _left_behind(before: set[str]) -> set[str]:
    """New segments this test could have left: not those of another job running on this host at the same time (a
    run whose segments include one with a live creator outside this process tree, or one still being created)."""
    runs: dict[str, list[str]] = {}
    for path in glob.glob("/dev/shm/nxdt-*"):
        runs.setdefault(os.path.basename(path)[len("nxdt-") :].split("-")[0], []).append(path)
    left = set()
    for paths in runs.values():
        creators = [_creator(p) for p in paths]
        foreign = any(
            c is not None and (c <= 0 or (Path(f"/proc/{c}").exists() and os.getpid() not in _ancestors(c))) for c in creators
        )
        if not foreign:
            left |= {p for p, c in zip(paths, creators) if c is not None and p not in before}
    return left


def _assert_each_refused(cases: list[tuple[list[str], str]], tmp_path: Path, capsys) -> None:
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
    assert not _left_behind(segments) and _children() <= children


def test_every_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NXDT_TEST_RUN_NAME", "run\n1")
    (tmp_path / "inputs").mkdir()
    cases = _cases(tmp_path / "inputs")
    assert len(cases) >= 100
    _assert_each_refused(cases, tmp_path, capsys)


def test_hostile_inputs_are_one_line_exit_2_within_seconds_and_leave_nothing(tmp_path, capsys, monkeypatch):
    """The cases of issue 38 (items 3, 4, 6) in their own test: each is refused in seconds (the looping template
    after its 1 s budget), so the whole set fits one test's timeout beside the matrix above."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NXDT_TEST_RUN_NAME", "run\n1")
    monkeypatch.delenv("NXDT_TEST_UNSET", raising=False)
    outputs = tmp_path / "outputs_probe"
    cases = _hardening_cases(tmp_path / "inputs") + _crafted_file_cases(tmp_path / "crafted") + _output_cases(outputs)
    _assert_each_refused(cases, tmp_path, capsys)
    assert (outputs / "victim.json").read_text() == "keep" and not list((outputs / "elsewhere").iterdir())
    assert not glob.glob("/etc/nxdt-probe*") and not glob.glob("/usr/nxdt-probe*")
    assert not (tmp_path / "crafted" / "hf").exists()
    assert not list((tmp_path / "crafted").glob("corpus*"))  # no half-written .bin left by the failed conversion
    assert not list(Path("/etc").glob("plan.json"))  # explicit_log_dir=/etc wrote nothing there
