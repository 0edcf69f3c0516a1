"""The ``nxdt`` command: ``train``, ``plan``, ``comm-test``, ``sweep-report``.

Bad input is one line on stderr with exit code 2, before any worker starts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence
from pathlib import Path

from nxdt.collector import paused as collector_paused

USAGE = """usage: nxdt <command> [args]

commands:
  train [-m] [-q|-v] [--dry-run] [overrides...]
                              compose + validate the config, plan, launch the workers, train
                              (-m / --multirun: one complete run per combination of key=a,b,... values;
                              -q: banner and summary only; -v: every line, third-party ones included;
                              --dry-run: launcher.dry_run=true, print what would start and start nothing)
  train|plan --config-path DIR --config-name NAME [overrides]
                              a config written for NxD Training, as it is (docs/migrating-from-nxdt.md);
                              instance=<name> names the instance NxDT configs leave out
  plan [--json] [-m] [--calibration PATH|auto] [overrides]
                              print the plan without starting anything: placement, groups, collectives with
                              their algorithms and estimated times, step time and memory per device
                              (distributed_strategy=auto ranks every valid TP/PP/DP layout)
  plan --against RUN_DIR [--json] [--warmup N] [--calibration PATH|auto]
                              the plan of a finished run's config beside what it measured: step time
                              (metrics.csv) and each collective (its trace, exp_manager.trace=true), with ratios
  topo NAME [--lnc N] [--json]
                              device table and graph of an instance type, like neuron-ls --topology
  comm-test [options] OPS     nccom-test-style benchmark of nxdt's collectives (see nxdt comm-test --help);
                              --estimate --instance NAME predicts the table for an instance, --calibrate
                              measures this host for the cpu instance's plans (used when asked: --calibration auto)
  runs [DIR] [--json]         the runs under DIR (default outputs/): status, layout, steps, loss, tokens/s, checkpoint
  report RUN [RUN ...] [-o DIR]
                              loss, lr, tokens/s (and val_loss, exposed comm) against step, every run overlaid, one PNG
                              per figure, and a text summary
  sweep-report DIR            table and loss plot of a multirun directory
  checkpoint inspect DIR      step, layout, model and tensors of a checkpoint (checks it is whole)
  checkpoint verify DIR       every file's size and SHA-256 against the checkpoint's checksums.json: one line per
                              problem and a summary; exit 0 if good, 1 if damaged
  checkpoint export-hf DIR OUT [--merge] [--base HF_DIR] [--dtype fp32|bf16]
                              a Hugging Face model directory from a (sharded) checkpoint: safetensors (fp32 unless
                              --dtype bf16), the family's config.json, generation_config.json, the run's tokenizer files;
                              import with model.hf_checkpoint=DIR.
                              A LoRA checkpoint exports as a PEFT adapter directory; --merge: a full model with the adapters
                              merged (--base: the Hugging Face model an adapters-only checkpoint merges into)
  checkpoint consolidate DIR OUT [--lightning]
                              one full-state checkpoint (model, optimizer, trainer state) from a sharded one: a one-rank
                              run resumes it directly, any other layout reshards it (exp_manager.resume_from_checkpoint=OUT);
                              --lightning: OUT is one Lightning .ckpt file, as DDP writes it (load_from_checkpoint reads it)

  data convert-megatron INPUT... --output-prefix PREFIX [--tokenizer PATH]
                              Megatron's indexed dataset (PREFIX.bin/.idx, what data.data_prefix names) from JSONL or text
  eval perplexity MODEL --data FILE [--seq-length N] [--ranks N] [--out F.json]
  eval generate MODEL --data FILE.jsonl [--max-new-tokens N] [--out F.json]
                              perplexity of a checkpoint or HF directory (non-overlapping windows), or exact match and
                              ROUGE of its greedy answers to SFT records; JSON and a table (nxdt eval for details)
  generate MODEL --prompt TEXT [--prompt TEXT ...] | --prompts FILE.jsonl [--max-new-tokens N] [--temperature T]
           [--top-p P] [--top-k K] [--seed N] [--no-chat-template] [--out F.jsonl]
                              completions of the prompts by a checkpoint or HF directory (KV cache; greedy unless a
                              sampling flag is given; the tokenizer's chat template applied when it has one)

`nxdt train --help` lists every config group and key with its documentation; `nxdt --version` prints the version.
"""


class UsageError(Exception):
    pass


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def train_help() -> str:
    from nxdt.config import available_options, field_docs

    lines = [
        "usage: nxdt train [-m] [-q|-v] [--dry-run] [group=option ...] [key=value ...]",
        "       nxdt train --config-path DIR --config-name NAME [instance=NAME] [key=value ...]   (an NxDT config file; "
        "docs/migrating-from-nxdt.md)",
        "",
        "config groups:",
    ]
    for group in ("model", "data", "instance", "launcher"):
        lines.append(f"  {group}: {', '.join(available_options(group))}")
    lines.append(f"  +recipe: {', '.join(available_options('recipe'))}   (fine-tuning recipes: add with +recipe=NAME)")
    lines.append(f"  --config-name {EXAMPLES}/NAME: examples in NxDT's config format: {', '.join(example_names())}")
    lines += ["", "keys (default) — description:"]
    for key, default, doc in field_docs():
        lines.append(f"  {key} ({default}) — {doc}")
    lines += [
        "",
        "examples:",
        "  nxdt train model=llama_tiny data=synthetic trainer.devices=4",
        "  nxdt train -m trainer.devices=1,2 trainer.max_steps=20",
        "  nxdt train launcher=torchrun trainer.num_nodes=2 launcher.rdzv_endpoint=HOST:29500 launcher.rdzv_id=run1   (on every node)",
        "  nxdt train launcher=slurm trainer.num_nodes=2 launcher.dry_run=true",
    ]
    return "\n".join(lines)


RUN_FILES_UMASK = 0o077  # run files are private to their user: config, plan, logs, metrics, checkpoints


@contextmanager
def _private_run_files() -> Iterator[None]:
    """Files and processes started inside get the run files' umask (workers inherit it from their fork server)."""
    previous_umask = os.umask(RUN_FILES_UMASK)
    try:
        yield
    finally:
        os.umask(previous_umask)


CONFIG_SOURCE_FLAGS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name"}


def _config_source(argv: list[str]) -> tuple[tuple[str, str] | None, list[str]]:
    """``--config-path DIR --config-name NAME`` (Hydra's flags, as NxDT's train.sh passes them): an NxDT config."""
    found, rest, args = {}, [], iter(argv)
    for a in args:
        flag, eq, value = a.partition("=")
        if flag not in CONFIG_SOURCE_FLAGS:
            rest.append(a)
            continue
        if not eq:
            following = next(args, None)
            if following is None:
                raise UsageError(f"nxdt: {flag} needs a value")
            value = following
        found[CONFIG_SOURCE_FLAGS[flag]] = value
    if not found:
        return None, rest
    if set(found) == {"name"} and found["name"].startswith(f"{EXAMPLES}/"):
        return _example(found["name"][len(EXAMPLES) + 1 :]), rest
    if len(found) != 2:
        raise UsageError(
            "nxdt: --config-path DIR and --config-name NAME go together (an NxDT config file DIR/NAME.yaml); "
            f"the examples in NxDT's format need no path: --config-name {EXAMPLES}/NAME ({', '.join(example_names()[:3])}, ...)"
        )
    return (found["path"], found["name"]), rest


EXAMPLES = "nxdt"  # --config-name nxdt/NAME: one of nxdt's examples in NxDT's config format (conf/nxdt/)


def examples_dir() -> Path:
    """nxdt's examples in NxDT's config format, as the package installs them (``conf/nxdt/``, as ``nxdt/conf/nxdt``), with
    the Hugging Face config.json files their ``model.model_config`` names and a tokenized sample dataset."""
    import importlib.util

    spec = importlib.util.find_spec("nxdt.conf")  # without importing nxdt.config (Hydra): the first line comes first
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / EXAMPLES


def example_names() -> list[str]:
    return sorted(p.stem for p in examples_dir().glob("*.yaml"))


def _example(name: str) -> tuple[str, str]:
    if name not in example_names():
        import difflib

        close = difflib.get_close_matches(name, example_names(), n=1)
        hint = f"did you mean {EXAMPLES}/{close[0]}? " if close else ""
        raise UsageError(
            f"nxdt: --config-name {EXAMPLES}/{name}: no such example config; {hint}the examples: {', '.join(example_names())}"
        )
    return str(examples_dir()), name


def _composer(source: tuple[str, str] | None, *, paths: bool = True) -> Any:
    """overrides → validated Config, from nxdt's config tree or an NxDT file; NxDT warnings printed once."""
    from nxdt.config import compose_config, compose_nxdt_config

    if source is None:
        return lambda overrides: compose_config(overrides, paths=paths)
    shown: set[str] = set()

    def compose(overrides: list[str]) -> Any:
        cfg, warnings = compose_nxdt_config(*source, overrides, paths=paths)
        for line in warnings:
            if line not in shown:
                shown.add(line)
                print(line, file=sys.stderr)
        return cfg

    return compose


DRY_RUN_FLAG = "--dry-run"  # nxdt train: launcher.dry_run=true (print what would start: workers, devices, NCCL settings)


def _split_flags(argv: list[str], flags: set[str]) -> tuple[set[str], list[str]]:
    found = {a for a in argv if a in flags}
    rest = [a for a in argv if a not in flags]
    for a in rest:
        if a.startswith("-"):
            raise UsageError(f"nxdt: unknown option {a!r}; overrides are key=value (see --help)")
        if "=" not in a and not a.startswith("~"):  # ~key: compose refuses it naming the key
            raise UsageError(f"nxdt: argument {a!r} is not a key=value override (see --help)")
    return found, rest


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Hydra's basic-sweeper expansion: key=a,b → one override list per combination."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


def check_resume_checkpoint(cfg: Any, the_plan: Any) -> None:
    """A checkpoint named by the user must be whole, of this model and of this layout — checked before any
    worker starts."""
    path = cfg.exp_manager.resume_from_checkpoint
    if path is None:
        return
    from nxdt.config import ConfigError
    from nxdt.config.validate import MODEL_SHAPE_FIELDS
    from nxdt.launch.rundir import check_checkpoint_run
    from nxdt.lightning.checkpoint import CheckpointError, check_layout, checkpoint_degrees, verify
    from nxdt.lightning.registry import check_resume_reference

    ds = cfg.distributed_strategy
    try:
        verify(path, {k: getattr(cfg.model, k) for k in MODEL_SHAPE_FIELDS})
        check_lora_checkpoint(cfg, path)
        if cfg.model.weight_init_only:  # only its model weights, consolidated on every rank (reshard.read_full_state)
            from nxdt.lightning.checkpoint import read_meta
            from nxdt.lightning.reshard import check_consolidatable

            check_checkpoint_run(cfg, path)  # the model keys only: a new run starts from the weights
            check_consolidatable(Path(path), read_meta(path))
            return
        check_resume_reference(cfg, path)  # DPO's, GRPO's (beta != 0) reference model: the objective's spec
        check_checkpoint_run(cfg, path)  # after the reference's check: its line names the reference, the more precise fix
        dp_format = "fsdp" if ds.fsdp.enabled else ("zero1" if ds.zero1 else "replicated")
        if check_layout(
            path,
            checkpoint_degrees(the_plan.degrees),
            ds.zero1,
            ds.virtual_pipeline_model_parallel_size,
            data_parallel_format=dp_format,
        ):
            print(
                f"nxdt: {path} was saved on another layout; every rank reshards it for {the_plan.degrees}"
                f"{' with ZeRO-1' if ds.zero1 else ''}{' with FSDP' if ds.fsdp.enabled else ''}",
                flush=True,
            )
    except CheckpointError as exc:
        raise ConfigError("exp_manager.resume_from_checkpoint", path, str(exc)) from None


def check_lora_checkpoint(cfg: Any, path: str) -> None:
    """The LoRA adapters of the checkpoint to resume or start from (or their absence) fit the peft block: NxDT's
    ``load_lora_from_ckpt`` (nxdt.lightning.lora_checkpoint), checked before any worker starts."""
    from nxdt.config import ConfigError
    from nxdt.lightning.lora_checkpoint import check_adapters_fit, lora_kind
    from nxdt.models.lora import resolve_targets

    peft, init_only, key = cfg.model_alignment_strategy.peft, cfg.model.weight_init_only, "exp_manager.resume_from_checkpoint"
    from_ckpt = "model_alignment_strategy.peft.load_lora_from_ckpt"
    kind = lora_kind(path)
    if kind == "merged" and (not init_only or (peft is not None and peft.load_lora_from_ckpt)):
        raise ConfigError(
            key,
            path,
            "holds a LoRA run's adapters merged into its base (merge_lora), which cannot resume "
            "LoRA training: start from it with model.weight_init_only=true (and load_lora_from_ckpt=false: "
            "fresh adapters on the merged weights)",
        )
    if kind in ("none", "merged"):
        if peft is not None and peft.load_lora_from_ckpt:
            raise ConfigError(
                from_ckpt,
                True,
                f"{path} holds no LoRA adapters; set it false to train fresh adapters on its "
                "weights (with model.weight_init_only=true)",
            )
        if peft is not None and not init_only:
            raise ConfigError(
                key,
                path,
                "holds a model without LoRA adapters, which cannot resume a LoRA run: start "
                "adapters on its weights with model.weight_init_only=true",
            )
        return
    if peft is None:
        raise ConfigError(
            key,
            path,
            "holds LoRA adapters: add model_alignment_strategy.peft with load_lora_from_ckpt=true "
            "(its lora_rank, lora_alpha, target_modules), or export-hf --merge it and start from the merged model",
        )
    if init_only and not peft.load_lora_from_ckpt:
        raise ConfigError(
            from_ckpt,
            False,
            f"{path} holds LoRA adapters: set it true to continue from them (or export-hf "
            "--merge the checkpoint and start fresh adapters on the merged model)",
        )
    if init_only and kind == "adapters_only" and cfg.model.hf_checkpoint is None:
        raise ConfigError(
            key, path, "holds the LoRA adapters alone (save_lora_base false): name their base model with model.hf_checkpoint"
        )
    if init_only and kind == "with_base" and cfg.model.hf_checkpoint is not None:
        raise ConfigError(
            "model.hf_checkpoint",
            cfg.model.hf_checkpoint,
            f"and {path} (which holds its base weights, save_lora_base) both name the base; keep one of them",
        )
    problem = check_adapters_fit(path, peft.lora_rank, peft.lora_alpha, resolve_targets(peft.target_modules))
    if problem is not None:
        name, value, reason = problem
        raise ConfigError(f"model_alignment_strategy.peft.{name}", value, reason)


def check_data(cfg: Any) -> None:
    """What the workers would otherwise find wrong only after they start, checked cheaply in the launcher: the model
    class and an ``hf_checkpoint``'s headers (:func:`_check_model`), the tokenizer, the training files (a sample of
    each text file; a Hugging Face dataset's layout and Arrow schema, then its rows: length, vocabulary) and, for
    a local run on this host, the plan's memory estimate against the host's available memory."""
    from nxdt.config import ConfigError

    # arithmetic first: model.num_layers=100000 is refused in a second, before the meta-device build below
    # (411 s and 3.9 GB for that model) or anything else is allocated
    _check_model_fits(cfg)
    _check_model(cfg)
    data = cfg.data
    if data.source == "text":
        from nxdt.data import SAMPLE_TEXT
        from nxdt.data.datasets import TextSourceError, check_text_files
        from nxdt.data.tokenizers import TokenizerFileError, check_tokenizer

        if data.tokenizer is not None:
            try:
                check_tokenizer(data.tokenizer, cfg.model.vocab_size)
            except TokenizerFileError as exc:
                raise ConfigError("data.tokenizer", data.tokenizer, exc.fix) from None
        for key, path in (("data.train_dir", data.train_dir or SAMPLE_TEXT), ("data.val_dir", data.val_dir)):
            try:
                if path is not None:
                    text_bytes = check_text_files(path, data.seq_length, byte_level=data.tokenizer is None)
                    _check_host_memory(cfg, data_key=key, data_bytes=TEXT_BYTES_IN_MEMORY * text_bytes)
            except TextSourceError as exc:
                raise ConfigError(key, path, exc.fix) from None
    elif data.source == "hf_dataset":
        from nxdt.data.hf_dataset import DatasetDirError, SavedHFDataset, check_saved_dataset

        for key, path in (("data.train_dir", data.train_dir), ("data.val_dir", data.val_dir)):
            try:
                if path is not None:
                    check_saved_dataset(path)  # JSON files and Arrow schemas only
                    SavedHFDataset(path, data.seq_length, cfg.model.vocab_size)
            except DatasetDirError as exc:
                raise ConfigError(key, path, exc.fix) from None
    elif data.source == "megatron":
        from nxdt.data.megatron import IndexedDataError, check_data_prefix

        if data.val_dir is not None:
            raise ConfigError(
                "data.val_dir",
                data.val_dir,
                "data.source=megatron validates on held-out samples: set data.val_dir=null and data.val_split (e.g. 0.01)",
            )
        try:
            check_data_prefix(data.data_prefix, cfg.model.vocab_size)
        except IndexedDataError as exc:
            raise ConfigError("data.data_prefix", _plain(data.data_prefix), exc.fix) from None
    from nxdt.config.validate import TOKEN_SOURCES, alignment_recipes

    if data.source not in TOKEN_SOURCES or [name for name in alignment_recipes(cfg) if name != "peft"]:
        # an objective's records (SFT's, DPO/ORPO's, GRPO's): its spec checks them (nxdt.lightning.registry); plain
        # pretraining has nothing more to check and its launcher never imports Lightning
        from nxdt.lightning.registry import check_launch

        check_launch(cfg)
    _check_host_memory(cfg)


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _check_model(cfg: Any) -> None:
    """``model.architecture`` names a hub model class (an ``nn.Module`` with the hooks nxdt drives) that accepts the
    config — built on the ``meta`` device, no memory — and an ``hf_checkpoint``'s safetensors headers match its
    parameters (names, shapes, dtypes), read without the tensor data."""
    import importlib

    import torch  # the launcher has it already (nxdt.comm); nxdt.lightning (Lightning: seconds) is not imported here

    # the launcher's checks are small: one thread keeps them off the cores the workers are about to take, and leaves
    # no OpenMP team behind in a launcher that forks its workers itself (nxdt.launch.forking.start_method)
    torch.set_num_threads(1)

    from nxdt.config import ConfigError
    from nxdt.config.validate import ALLOWED_MODEL_PREFIX

    model_cfg, arch = cfg.model, cfg.model.architecture
    module_name, _, class_name = arch.rpartition(".")
    if not arch.startswith(ALLOWED_MODEL_PREFIX) or not module_name:  # validate() says so too: never import other code
        raise ConfigError("model.architecture", arch, f"only model classes under {ALLOWED_MODEL_PREFIX} may be named")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            "model.architecture",
            arch,
            f"cannot be imported ({str(exc).splitlines()[0]}); name a model class, e.g. nxdt.models.llama.LlamaForCausalLM",
        ) from None
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        kind = "a class" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise ConfigError(
            "model.architecture",
            arch,
            f"is {kind}, not a torch.nn.Module model class; name a hub model class, e.g. nxdt.models.llama.LlamaForCausalLM",
        )
    hooks = [h for h in ("embed", "run_layer", "head", "loss_fn") if not callable(getattr(cls, h, None))]
    if hooks:
        raise ConfigError(
            "model.architecture",
            arch,
            f"is a torch module but not a causal language model of the hub "
            f"(no {', '.join(hooks)}); name a hub model class, e.g. nxdt.models.llama.LlamaForCausalLM",
        )
    from nxdt.config.hf_model import HFConfigError, family_of_architecture

    try:  # the planner, the export and the Hugging Face import ask the family's spec
        family_of_architecture(arch)
    except HFConfigError as exc:
        raise ConfigError("model.architecture", arch, str(exc).split(": ", 1)[-1]) from None
    try:
        from nxdt.models.meta import shapes_only

        with shapes_only():  # no parameter memory, no initialisation cost
            model = cls(model_cfg)
    except (ValueError, TypeError, KeyError) as exc:  # the class's own config rules
        raise ConfigError(
            "model.architecture",
            arch,
            f"refuses this model config: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
        ) from None
    except Exception:  # e.g. an operation meta tensors do not support: the workers build it for real
        return
    peft = cfg.model_alignment_strategy.peft
    if peft is not None:  # LoRA: the targets exist in this model, the values are in range (before apply_peft in the workers)
        from nxdt.models.lora import LoRAArgumentError, PeftConfig, check_peft

        try:
            check_peft(model, PeftConfig.pick(peft))
        except LoRAArgumentError as exc:  # apply_lora's argument → NxDT's key (rank → lora_rank, target_modules as is)
            key = exc.arg if exc.arg in ("target_modules", "merge_lora") else f"lora_{exc.arg}"
            raise ConfigError(f"model_alignment_strategy.peft.{key}", "", str(exc)) from None
    if model_cfg.hf_checkpoint is not None:
        from nxdt.lightning.hf import HFCheckpointError, check_hf_checkpoint

        expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
        try:
            check_hf_checkpoint(model_cfg.hf_checkpoint, expected, bool(getattr(model, "tied", False)), arch)
        except HFCheckpointError as exc:
            raise ConfigError("model.hf_checkpoint", model_cfg.hf_checkpoint, exc.fix) from None
        except ValueError as exc:  # HFConfigError: the architecture is no family's hub class
            raise ConfigError("model.hf_checkpoint", model_cfg.hf_checkpoint, str(exc)) from None


HOST_MEMORY_FRACTION = 0.9  # a local CPU run whose estimate exceeds this share of MemAvailable is refused


def host_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none: not Linux, a restricted container)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# A training text in memory on every rank, per byte of its files: byte-level, the bytes are the tokens (1×) and
# several files are concatenated (2× while both exist); a subword tokenizer's ids take fewer bytes than its text.
TEXT_BYTES_IN_MEMORY = 2


def _check_host_memory(cfg: Any, data_key: str | None = None, data_bytes: int = 0) -> None:
    """A run of worker processes on this host (instance graph ``host``, local launcher) whose planned memory —
    per rank × ranks on the node — clearly exceeds the host's available memory would be killed by the OOM killer
    mid-run; refused here, naming both figures and the fix. With ``data_key``, only the training text that every
    rank holds (``data_bytes`` per rank) is checked: a 20 GB text is refused by its key before any rank reads it."""
    if cfg.instance.graph != "host" or cfg.launcher.name != "local":
        return
    available = host_available_bytes()
    if not available:
        return
    from nxdt.config import ConfigError

    if data_key is not None:
        from nxdt.config.validate import devices_per_node

        ranks = devices_per_node(cfg)
        if data_bytes * ranks > HOST_MEMORY_FRACTION * available:
            raise ConfigError(
                data_key,
                _get_path(cfg, data_key),
                f"every rank holds the text in memory: {_size(data_bytes)} × {ranks} ranks = {_size(data_bytes * ranks)}, "
                f"this host has {_size(available)} available (MemAvailable); convert it to Megatron indexed data "
                "(nxdt data convert-megatron, memory-mapped) and set data.source=megatron",
            )
        return
    if cfg.instance.accelerator != "cpu":  # the planned state and activations live in GPU memory, not the host's
        return
    from nxdt.planner import plan

    the_plan = plan(cfg)
    per_rank = sum(the_plan.estimate.get("memory_per_rank_bytes", {}).values())
    needed = per_rank * the_plan.ranks_per_node
    if needed > HOST_MEMORY_FRACTION * available:
        raise ConfigError(
            "trainer.devices",
            cfg.trainer.devices,
            f"the plan estimates {_size(per_rank)} per rank × "
            f"{the_plan.ranks_per_node} ranks = {_size(needed)}, this host has {_size(available)} available "
            "(MemAvailable); use fewer trainer.devices, a smaller model, a smaller data.micro_batch_size "
            "or data.seq_length, or zero1 / fsdp",
        )


def _check_model_fits(cfg: Any) -> None:
    """The model's training state (weights, and without LoRA its gradients and optimizer state: bytes per parameter by
    precision, ``planner.estimate.bytes_per_parameter``) over all of this host's ranks, however they shard it, against
    the host's available memory: arithmetic on the config, before the model is built even on the meta device. The
    full check (activations, ranks per node: :func:`_check_host_memory`) needs the plan and comes after the data."""
    # a GPU run keeps this state in GPU memory (the plan's memory per device), not the host's
    if cfg.instance.graph != "host" or cfg.launcher.name != "local" or cfg.instance.accelerator != "cpu":
        return
    available = host_available_bytes()
    if not available:
        return
    from nxdt.config import ConfigError
    from nxdt.config.hf_model import HFConfigError, family_of_architecture
    from nxdt.config.hf_model import spec_of
    from nxdt.planner.estimate import bytes_per_parameter, head_width, model_numbers

    try:  # the count is the family's (its spec); an architecture that is none is named by _check_model next
        family_of_architecture(cfg.model.architecture)
    except HFConfigError:
        return

    n = model_numbers(cfg.model)
    per_param = bytes_per_parameter(cfg)
    stored = per_param["params"] + (
        0 if cfg.model_alignment_strategy.peft is not None else per_param["grads"] + per_param["moments"] + per_param["master"]
    )
    state = n["total"] * stored
    if state > HOST_MEMORY_FRACTION * available:
        key = _largest_model_key(cfg.model, n)
        raise ConfigError(
            key,
            _get_path(cfg, key),
            f"a model of {n['total'] / 1e9:,.1f} B parameters: its training state takes {_size(state)} "
            f"({stored} bytes per parameter), more than this host's {_size(available)} available (MemAvailable) "
            "however its ranks shard it; use a smaller model (fewer layers, a smaller hidden_size)",
        )

    # what every rank (and the launcher's meta-device check) builds beside the parameters: RoPE's cos/sin tables of
    # max_position_embeddings rows, computed in fp64 (models/llama.py rope_tables: positions, angles, their concatenation
    # and cos in fp64, then two fp32 tables, ~24 bytes per entry at the peak); a synthetic data set's epoch order, a
    # shuffled list of every sample index in every rank (nxdt/data/sampler.py: int64 randperm then a Python list)
    ranks = cfg.trainer.devices + 1
    if not spec_of(cfg.model).block.learned_positions:
        rope = ROPE_TABLE_PEAK_BYTES * cfg.model.max_position_embeddings * head_width(cfg.model) * ranks
        if rope > HOST_MEMORY_FRACTION * available:
            raise ConfigError(
                "model.max_position_embeddings",
                cfg.model.max_position_embeddings,
                f"its RoPE tables take {_size(rope)} over this host's {ranks} processes (the ranks and the launcher), "
                f"more than the {_size(available)} available (MemAvailable); give the context length the model is used at",
            )
    if cfg.data.source == "synthetic":
        order = SAMPLER_BYTES_PER_SAMPLE * cfg.data.num_samples * cfg.trainer.devices
        if order > HOST_MEMORY_FRACTION * available:
            raise ConfigError(
                "data.num_samples",
                cfg.data.num_samples,
                f"every rank holds the shuffled order of all samples ({SAMPLER_BYTES_PER_SAMPLE} bytes each): "
                f"{_size(order)}, more than the {_size(available)} available (MemAvailable); give fewer data.num_samples "
                "(the synthetic set repeats in epochs)",
            )


ROPE_TABLE_PEAK_BYTES = 24  # per (position, head_dim) entry while rope_tables builds the cos/sin tables
SAMPLER_BYTES_PER_SAMPLE = 44  # one epoch's order: an int64 (randperm) + a list slot (8) + a Python int (28)


def _largest_model_key(model: Any, n: dict[str, float]) -> str:
    """The key a too-large model is refused by: the one that made it large (a layer count, a feed-forward or hidden
    width, the vocabulary), so the line names what to change."""
    if n["per_layer"] * model.num_layers < n["total"] / 2:
        return "model.vocab_size"
    if model.num_layers > 256:  # deeper than any published decoder (Llama 3.1 405B: 126 layers)
        return "model.num_layers"
    if model.ffn_hidden_size > 8 * model.hidden_size:  # published decoders use ~2.7-4× (dense) of the hidden size
        return "model.ffn_hidden_size"
    return "model.hidden_size" if model.hidden_size > 16384 else "model.num_layers"


def _get_path(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def cmd_train(argv: list[str], start_workers_early: bool = False, fork_workers: bool = False) -> int:
    """``start_workers_early``: this is the ``nxdt`` program (its process started at the user's Enter), not a caller.
    ``fork_workers``: see :func:`main`."""
    if "--help" in argv or "-h" in argv:
        print(train_help())
        return 0
    source, argv = _config_source(argv)
    from nxdt.launch.console import MODE_FLAGS, STARTED_ENV, first_line, process_started_at, set_mode

    # the workers' "ready" line and the summary count from here (the program: from its process's start)
    os.environ[STARTED_ENV] = repr(process_started_at() if start_workers_early else time.time())

    flags, overrides = _split_flags(argv, {"-m", "--multirun", DRY_RUN_FLAG, *MODE_FLAGS})
    if DRY_RUN_FLAG in flags:  # the launcher group's own key, spelled as other launchers' flag
        flags.discard(DRY_RUN_FLAG)
        overrides.append("launcher.dry_run=true")
    modes = {MODE_FLAGS[f] for f in flags if f in MODE_FLAGS}
    if len(modes) > 1:
        raise UsageError("nxdt train: -q (quiet) and -v (verbose) exclude each other")
    set_mode(modes.pop() if modes else None)  # the workers inherit it (nxdt.launch.console)
    flags -= set(MODE_FLAGS)
    # the fork server's environment is the workers': everything they inherit is set above this line
    server_first = start_workers_early and not any(_names_launcher(o) for o in overrides)
    if server_first:
        _start_fork_server()
    source_args = ["--config-path", source[0], "--config-name", source[1]] if source else []
    from nxdt.config import ConfigError
    from nxdt.config.validate import check_trainable, ineffective_settings
    from nxdt.config.trackers import check_trackers

    try:
        with collector_paused():  # the launcher's imports (Hydra, numpy, torch) and checks (nxdt.collector)
            jobs = expand_sweep(overrides) if flags else [overrides]
            compose = _composer(source)
            configs = [compose(job) for job in jobs]  # every job is validated before the first starts
            for cfg in configs:
                check_trainable(cfg)
            if configs[0].launcher.name == "local" and not configs[0].launcher.dry_run:
                # Hydra's compose is all that ran: the planner (numpy), torch and Lightning are imported after this line
                print(first_line(configs[0], len(configs), source), flush=True)
            from nxdt.launch.multinode import check_launcher
            from nxdt.planner import plan

            if start_workers_early and not server_first:
                _start_fork_server_early(configs[0])
            plans = []
            for cfg in configs:
                check_data(cfg)
                check_trackers(cfg)  # W&B / MLflow: package, arguments, a server that answers
                check_launcher(cfg, multirun=bool(flags))
                plans.append(plan(cfg))
                check_resume_checkpoint(cfg, plans[-1])
    except ConfigError as exc:
        return _fail(str(exc))
    except UsageError:  # its own one line (the fork server's)
        raise
    except Exception as exc:  # Hydra's override grammar errors
        return _fail(f"config error: {str(exc).splitlines()[0]}")
    # settings that cannot take effect: said before a job's workers start, once its run directory is accepted (a refused
    # resume is one error line, nothing else)
    warnings = [ineffective_settings(cfg) for cfg in configs]
    sweep_dir = None
    if flags:
        first = configs[0]
        sweep_dir = (
            Path(first.exp_manager.exp_dir).expanduser().resolve() / "multirun" / first.name / time.strftime("%Y-%m-%d_%H-%M-%S")
        )
    with _private_run_files():  # config, plan, logs, metrics, checkpoints
        if configs[0].launcher.name != "local" or configs[0].launcher.dry_run:  # beyond this host, or only show what would run
            from nxdt.launch.cluster import launch

            if not configs[0].launcher.dry_run:
                _warn(warnings[0])
            code = launch(configs[0], plans[0], jobs[0], sys.stdout.isatty())
            if configs[0].launcher.dry_run and code == 0:  # after what would run (a refusal stays the only line)
                _warn(warnings[0])
            return code
        return _train_locally(jobs, configs, plans, sweep_dir, source_args, warnings, fork_workers)


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr, flush=True)


def _names_launcher(override: str) -> bool:
    """Whether a command-line override sets the launcher group or one of its keys (``launcher=slurm``,
    ``launcher.dry_run=true``, ``+launcher.x=...``). Nothing else in nxdt's config tree or an NxDT config sets it, so a
    command without one launches on this host (``conf/config.yaml``: ``launcher: local``, not a dry run)."""
    key = override.lstrip("+~").partition("=")[0]
    return key == "launcher" or key.startswith("launcher.")


def _start_fork_server() -> None:
    """A run on this host forks its workers from a server that imports torch and Lightning first (6-9 s of CPU,
    :mod:`nxdt.launch.fork_server`); those imports are the longest part of a launch, so the server starts as soon as
    the program knows it will launch here: before the config is composed when no override names the launcher
    (:func:`_names_launcher`), else once the composed config says so (:func:`_start_fork_server_early`). Its imports
    then run while this process composes, imports torch, checks the data and the model, and plans. If a check fails,
    the program exits and the server dies with it (:func:`nxdt.launch.forking.die_with_agent`, its first statement).
    It gets the run files' private umask now, because the workers inherit the server's umask, not this process's."""
    from nxdt.launch.forking import ForkServerError, start_fork_server  # no torch: the server starts before our imports

    with _private_run_files():
        try:
            start_fork_server()
        except ForkServerError as exc:
            raise UsageError(str(exc)) from None


def _start_fork_server_early(cfg: Any) -> None:
    """The fork server for a command that names the launcher, once its composed config is a run on this host."""
    if cfg.launcher.name != "local" or cfg.launcher.dry_run:
        return
    _start_fork_server()


def _train_locally(
    jobs: list[list[str]],
    configs: list[Any],
    plans: list[Any],
    sweep_dir: Path | None,
    source_args: Sequence[str] = (),
    warnings: Sequence[list[str]] = (),
    fork_workers: bool = False,
) -> int:
    from nxdt.config import ConfigError
    from nxdt.launch import console
    from nxdt.launch.local import LaunchFailed, LaunchInterrupted, launch_local
    from nxdt.comm.shm import remove_stale_segments
    from nxdt.launch.rundir import (
        RunDirBusy,
        check_resume,
        check_same_run,
        choose_run_dir,
        lock_run_dir,
        resume_lines,
        write_run_dir,
    )

    remove_stale_segments()  # shared memory left by a run whose processes were all killed (its launcher too)
    status = 0
    for num, (job, cfg, the_plan) in enumerate(zip(jobs, configs, plans)):
        if sweep_dir is not None:
            cfg.exp_manager.explicit_log_dir = str(sweep_dir / str(num))
        try:
            run_dir = choose_run_dir(cfg)
            check_same_run(cfg, run_dir)  # a refused change leaves the directory untouched (not even .lock written)
            lock = lock_run_dir(run_dir)  # held until this job ends: one writer per run directory
        except ConfigError as exc:
            return _fail(str(exc))
        except RunDirBusy as exc:
            return _fail(str(exc))
        except OSError as exc:
            return _fail(
                f"nxdt: cannot create the run directory {exc.filename or ''}: {exc.strerror or exc} — "
                "check exp_manager.exp_dir / exp_manager.explicit_log_dir"
            )
        try:
            changes = check_same_run(cfg, run_dir)  # again, now that this process holds the directory
            notes = check_resume(cfg, run_dir)  # the newest checkpoint's checksums, before any worker starts
            entry = write_run_dir(run_dir, cfg, the_plan, job)  # config.yaml, overrides.txt, config-history/<n>-<time>/
            if changes is not None:  # a launch into a run directory that held a run: what changed, in one line
                notes = [*resume_lines(run_dir, changes, entry, cfg.data.source == "megatron"), *notes]
            for line in notes:
                print(line, flush=True)
            _warn(list(warnings[num]) if num < len(warnings) else [])
        except ConfigError as exc:
            lock.close()
            return _fail(str(exc))
        except OSError as exc:
            lock.close()
            return _fail(
                f"nxdt: cannot write the run directory {run_dir}: {exc.strerror or exc} — check its permissions "
                "and free space, or point exp_manager.exp_dir elsewhere"
            )
        label = f"[job {num}: {' '.join(job)}] " if sweep_dir is not None else ""
        launched_at = console.job_started(run_dir, the_plan, cfg, label, job, list(source_args), first=num == 0)
        outcome, reason, code = "failed", "the launcher stopped", 1
        try:
            launch_local(
                run_dir,
                the_plan,
                console_tty=sys.stdout.isatty(),
                max_restarts=cfg.exp_manager.max_restarts,
                fork_workers=fork_workers,
            )
            outcome, reason, code = "finished", "", 0
        except LaunchFailed as exc:
            outcome, reason = "failed", str(exc)
            print(str(exc), file=sys.stderr)
            status = 1
            if sweep_dir is None:
                break
        except LaunchInterrupted as exc:
            outcome, reason, code = "interrupted", str(exc), 130
            print(str(exc), file=sys.stderr)
            return 130
        except KeyboardInterrupt:
            outcome, reason, code = "interrupted", "Ctrl-C", 130
            raise
        finally:
            console.job_ended(run_dir, outcome, reason, launched_at, job, list(source_args), code)  # status.json, summary
            lock.close()
    return status


def _plan_one(compose: Any, overrides: list[str], calibration_file: str | None) -> "tuple[Any, Any]":
    from nxdt.planner import node_topology, plan
    from nxdt.planner.calibration import load_calibration

    cfg = compose(overrides)
    topo = node_topology(cfg)
    calibration = load_calibration(calibration_file) if topo.graph == "host" else None
    return plan(cfg, calibration), topo


def _take_value(argv: list[str], flag: str, what: str) -> tuple[str | None, list[str]]:
    """``flag VALUE`` removed from argv: (VALUE, the rest); (None, argv) when absent."""
    if flag not in argv:
        return None, argv
    i = argv.index(flag)
    if i + 1 >= len(argv):
        raise UsageError(f"nxdt plan: {flag} needs {what}")
    return argv[i + 1], argv[:i] + argv[i + 2 :]


def _plan_against(run_dir: str, calibration_file: str | None, warmup: str | None, rest: list[str]) -> int:
    """``nxdt plan --against RUN_DIR``: the plan of the run's own config beside what the run measured."""
    from nxdt.config import ConfigError
    from nxdt.launch.against import compare, render
    from nxdt.planner.calibration import load_calibration

    flags, overrides = _split_flags(rest, {"--json"})
    if overrides:
        return _fail(f"nxdt plan --against: {overrides[0]}: the run's own config.yaml is planned; drop the overrides")
    try:
        steps = int(warmup) if warmup is not None else 1
    except ValueError:
        return _fail(f"nxdt plan --against: --warmup {warmup}: a number of steps, e.g. --warmup 2")
    try:
        report = compare(run_dir, load_calibration(calibration_file), warmup=steps)
    except ConfigError as exc:
        return _fail(str(exc))
    print(json.dumps(report, indent=1) if "--json" in flags else render(report))
    return 0


def cmd_plan(argv: list[str]) -> int:
    calibration_file, argv = _take_value(
        argv, "--calibration", "a file written by `nxdt comm-test --calibrate`, or auto (this host's)"
    )
    against, argv = _take_value(argv, "--against", "a run directory (written by `nxdt train`)")
    warmup, argv = _take_value(argv, "--warmup", "a number of steps")
    if against is not None:
        return _plan_against(against, calibration_file, warmup, argv)
    if warmup is not None:
        raise UsageError("nxdt plan: --warmup goes with --against RUN_DIR")
    source, argv = _config_source(argv)
    flags, overrides = _split_flags(argv, {"--json", "-m", "--multirun"})
    from nxdt.config import ConfigError
    from nxdt.planner.report import render_plan

    compose = _composer(source, paths=False)  # a plan needs no data or weight files here
    auto = "distributed_strategy=auto" in overrides
    overrides = [o for o in overrides if o != "distributed_strategy=auto"]
    try:
        if auto:
            from nxdt.planner.auto import auto_layouts, render_ranking

            ranking = auto_layouts(overrides, compose=compose)
            print(json.dumps(ranking, indent=1) if "--json" in flags else render_ranking(ranking))
            return 0 if ranking["layouts"] else 1
        jobs = expand_sweep(overrides) if flags & {"-m", "--multirun"} else [overrides]
        plans = [_plan_one(compose, job, calibration_file) for job in jobs]
    except ConfigError as exc:
        return _fail(str(exc))
    except Exception as exc:  # Hydra's override grammar errors
        return _fail(f"config error: {str(exc).splitlines()[0]}")
    for job, (the_plan, topo) in zip(jobs, plans):
        if len(jobs) > 1:
            print(f"\n### {' '.join(job)}")
        grid = topo.grid if topo.graph in ("torus2d", "torus3d") else None
        print(the_plan.to_json() if "--json" in flags else render_plan(the_plan, grid))
    return 0


def cmd_topo(argv: list[str]) -> int:
    from nxdt.topology.nccom import OneLineParser

    parser = OneLineParser(
        prog="nxdt topo", description="Device table and graph of an instance type (like neuron-ls --topology)."
    )
    parser.add_argument("name", help="instance type, e.g. trn1.32xlarge (see `nxdt train --help` for the catalogue)")
    parser.add_argument("--lnc", type=int, default=None, help="logical NeuronCore size (Trn2/Trn3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table and picture")
    args = parser.parse_args(argv)
    from nxdt.config import ConfigError, compose_config
    from nxdt.topology import TopologyError, topology_of
    from nxdt.topology.render import device_table, picture, topo_json

    try:
        instance = compose_config([f"instance={args.name}"], check=False).instance
        topo = topology_of(instance, args.lnc)
    except ConfigError as exc:
        return _fail(str(exc))
    except TopologyError as exc:
        return _fail(f"config error: --lnc={args.lnc}: {exc}")
    if args.json:
        print(topo_json(topo, instance))
        return 0
    print(f"instance-type: {instance.name} — {instance.description}")
    print(device_table(topo, instance))
    print()
    print(picture(topo))
    guesses = sorted(k for k, v in instance.provenance.items() if v.guess)
    if guesses:
        print(f"\nguessed values (tunable defaults, no source states them): {', '.join(guesses)}")
    return 0


def cmd_comm_test(argv: list[str], fork_ranks: bool = False) -> int:
    """``fork_ranks``: the ranks may be forks of this process (``nxdt.comm.bench.main``'s ``fork_here``)."""
    if "--estimate" in argv:
        return _comm_test_estimate([a for a in argv if a != "--estimate"])
    if "--calibrate" in argv:
        return _comm_test_calibrate([a for a in argv if a != "--calibrate"])
    from nxdt.comm.bench import main as bench_main
    from nxdt.launch.comm_test import main_multinode
    from nxdt.parallel.devices import node_devices

    def place(ranks_per_node: int, gpus: int) -> list[str]:
        return node_devices("cuda", ranks_per_node, gpus)

    return bench_main(argv, multinode=main_multinode, fork_here=fork_ranks, place=place)


def _comm_test_estimate(argv: list[str]) -> int:
    """The nccom-test table the cost model predicts for an instance (nothing runs). The flags mean what they mean
    for a measured run and for nccom-test (-r total ranks, -N nodes); the table and the JSON have the same layout."""

    from nxdt.config import ConfigError, compose_config
    from nxdt.config.validate import (
        MAX_WORLD_SIZE,
        devices_per_node,
        fill_instance_defaults,
        output_path_problem,
        validate,
        write_output_file,
    )
    from nxdt.planner import node_topology
    from nxdt.planner.calibration import BENCH_OPS, estimate_table, load_calibration

    # the table's vocabulary without torch: nothing runs, so neither torch nor nxdt.comm is imported (was 20-31 s)
    from nxdt.topology.nccom import (
        DTYPE_BYTES,
        OP_TITLES,
        OneLineParser,
        algorithm_bands,
        layout_text,
        parse_size,
        ranks_per_node,
        report_json,
        sizes,
    )

    p = OneLineParser(prog="nxdt comm-test --estimate", description="Predict an nccom-test table with the cost model.")
    p.add_argument("ops", nargs="*", default=["allr"], help=f"operations: {' '.join(BENCH_OPS)}")
    p.add_argument("--instance", required=True, help="instance type, e.g. trn1.32xlarge")
    p.add_argument(
        "-r",
        "--nworkers",
        type=int,
        default=None,
        help="total number of ranks over all nodes, as nccom-test's -r; each node runs r / N (default: every core of every node)",
    )
    p.add_argument(
        "-N",
        "--nodes",
        "--nnodes",
        dest="nodes",
        type=int,
        default=1,
        help="nodes, as nccom-test's -N: the -r ranks are divided equally across them (-r 64 -N 2: 32 per node)",
    )
    p.add_argument("--lnc", type=int, default=None, help="logical NeuronCore size (Trn2/Trn3)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1kb"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64mb"))
    p.add_argument("-f", "--stepfactor", type=float, default=4.0)
    p.add_argument("-n", "--iters", type=int, default=20, help="accepted as in a measured run (nothing runs)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="accepted as in a measured run (nothing runs)")
    p.add_argument("-d", "--datatype", choices=sorted(DTYPE_BYTES), default="fp32")
    p.add_argument("-c", "--check", action="store_true", help="refused: an estimate has nothing to check")
    p.add_argument("--report-to-json-file", metavar="F", help="write the predicted rows as JSON, in a measured run's layout")
    p.add_argument(
        "--show-algorithm", action="store_true", help="print the algorithm the cost model picks (per size band and row)"
    )
    p.add_argument(
        "--calibration", default=None, help="PATH|auto: a calibration for the cpu instance (auto: this host's, from --calibrate)"
    )
    args = p.parse_args(argv)
    if args.check:
        return _fail(
            "nxdt comm-test --estimate: --check: an estimate has nothing to check (nothing runs); drop --check, "
            "or drop --estimate to measure"
        )
    bad = [op for op in args.ops if op not in BENCH_OPS]
    if bad:
        return _fail(f"nxdt comm-test: --estimate covers {' '.join(BENCH_OPS)}; not {bad}")
    if args.minbytes > args.maxbytes or args.stepfactor <= 1:
        return _fail("nxdt comm-test: need --minbytes <= --maxbytes and --stepfactor > 1")
    problem = args.report_to_json_file and output_path_problem(args.report_to_json_file)
    if problem:
        return _fail(f"nxdt comm-test: --report-to-json-file {args.report_to_json_file!r} {problem}")
    try:
        rpn = ranks_per_node(args.nworkers, args.nodes) if args.nworkers is not None else None
    except ValueError as exc:
        return _fail(f"nxdt comm-test: {exc}")
    overrides = [f"instance={args.instance}", f"trainer.num_nodes={args.nodes}"]
    overrides += [f"trainer.devices={rpn}"] if rpn else []
    overrides += [f"trainer.lnc={args.lnc}"] if args.lnc else []
    try:
        cfg = compose_config(overrides, check=False)
        fill_instance_defaults(cfg)
        cfg.data.micro_batch_size, cfg.data.global_batch_size = 1, None  # one micro-batch per rank: no training here
        validate(cfg, paths=False)
        topo = node_topology(cfg)
        calibration = load_calibration(args.calibration) if topo.graph == "host" else None
    except ConfigError as exc:
        if rpn and exc.key == "trainer.devices":  # the user typed -r, not trainer.devices
            return _fail(f"nxdt comm-test: -r {args.nworkers} over -N {args.nodes} nodes is {rpn} ranks per node: {exc.fix}")
        if rpn and exc.key == "trainer.num_nodes" and args.nworkers > MAX_WORLD_SIZE:  # nor num_nodes × devices
            return _fail(f"nxdt comm-test: -r {args.nworkers}: one job holds at most {MAX_WORLD_SIZE:,} ranks; give fewer")
        return _fail(str(exc))
    rpn = devices_per_node(cfg)
    group = list(range(rpn * args.nodes))
    element = DTYPE_BYTES[args.datatype]
    results: list[dict[str, Any]] = []
    algorithms: dict[int, dict[str, str]] = {}
    for op in args.ops:
        rows = estimate_table(
            BENCH_OPS[op],
            sizes(args.minbytes, args.maxbytes, args.stepfactor),
            group,
            topo,
            cfg.instance,
            rpn,
            element,
            calibration,
        )
        print(
            f"\n# estimated {OP_TITLES[op]} on {args.nodes} × {cfg.instance.name} ({len(group)} ranks, {rpn} per node) "
            "— cost model, nothing ran"
        )
        if args.show_algorithm:
            print("# algorithm: " + algorithm_bands({r["size(B)"]: r["algorithm"] for r in rows}))
        print(
            f"#{'size(B)':>12} {'count(elems)':>13} {'type':>6} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
            + ("  algorithm" if args.show_algorithm else "")
        )
        for r in rows:
            print(
                f" {r['size(B)']:>12} {r['count(elems)']:>13} {args.datatype:>6} {r['time:avg(us)']:>10.2f} {r['algbw(GB/s)']:>12.2f} "
                f"{r['busbw(GB/s)']:>12.2f}" + (f"  {r['algorithm']}" if args.show_algorithm else "")
            )
            results.append(
                {
                    "op": op,
                    "size(B)": r["size(B)"],
                    "count(elems)": r["count(elems)"],
                    "type": args.datatype,
                    "time:avg(us)": r["time:avg(us)"],
                    "algbw(GB/s)": r["algbw(GB/s)"],
                    "busbw(GB/s)": r["busbw(GB/s)"],
                }
            )
            algorithms.setdefault(r["size(B)"], {})[op] = r["algorithm"]
        print(f"# Avg bus bandwidth    : {sum(r['busbw(GB/s)'] for r in rows) / len(rows):.3f}")
    if args.report_to_json_file:  # a measured run's layout; nothing was allocated, timed or copied
        report: dict[str, Any] = {
            "results": results,
            "baseline": [],
            "memcpy": {},
            "transport": "estimate",
            "hosts": args.nodes,
            "layout": layout_text([r // rpn for r in group]),
            "buffers": None,
            "estimate": {
                "instance": cfg.instance.name,
                "lnc": cfg.trainer.lnc,
                "ranks_per_node": rpn,
                "calibration": args.calibration,
                "source": "nxdt cost model; nothing ran",
            },
        }
        if args.show_algorithm:
            report["algorithms"] = algorithms
        try:
            write_output_file(args.report_to_json_file, report_json(report, len(group), args.nodes, "estimate").encode())
        except (OSError, ValueError) as exc:
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            return _fail(f"nxdt comm-test: --report-to-json-file {args.report_to_json_file!r}: {what}")
    return 0


def _comm_test_calibrate(argv: list[str]) -> int:

    import shlex

    from nxdt.config.validate import output_path_problem
    from nxdt.planner.calibration import fit_calibration, save_calibration
    from nxdt.topology.nccom import OneLineParser, parse_size

    p = OneLineParser(prog="nxdt comm-test --calibrate", description="Measure this host for plans on the cpu instance.")
    p.add_argument("-r", "--nworkers", type=int, default=2, help="ranks to measure with (as in training)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64mb"))
    p.add_argument("-o", "--output", default=None, help="calibration file (default: the per-host cache file)")
    args = p.parse_args(argv)
    if args.nworkers < 2:
        return _fail("nxdt comm-test --calibrate: need --nworkers >= 2")
    problem = args.output and output_path_problem(args.output)
    if problem:  # before the minute of measuring
        return _fail(f"nxdt comm-test --calibrate: -o {args.output!r} {problem}")
    from nxdt.comm.spawn import RankFailed
    from nxdt.launch.calibrate import measure

    print(f"nxdt: calibrating collectives and compute with {args.nworkers} ranks (about a minute)…", flush=True)
    try:
        raw = measure(args.nworkers, args.maxbytes)
    except RankFailed as exc:
        return _fail(f"nxdt comm-test --calibrate: {exc}")
    data = fit_calibration(raw["reports"], raw["flops_per_s"], flops_ranks=args.nworkers)
    path = save_calibration(data, args.output)
    for op, fits in data["ops"].items():
        for n, (a, b) in fits.items():
            print(f"  {op:<15} n={n}: {a * 1e6:8.1f} µs + {b * 1e9:.3f} ns/byte ({1 / b / 1e9 if b else 0:.2f} GB/s)")
    print(f"  compute: {data['flops_per_s'] / 1e9:.2f} GFLOP/s per rank (small Llama forward+backward)")
    use = "auto" if args.output is None else shlex.quote(str(path))
    print(f"nxdt: wrote {path}; plans on instance=cpu use it when asked: nxdt plan --calibration {use}")
    return 0


def cmd_sweep_report(argv: list[str]) -> int:
    if len(argv) != 1:
        raise UsageError("usage: nxdt sweep-report DIR")
    from nxdt.launch.sweep_report import SweepReportError, report

    try:
        return report(Path(argv[0]))
    except SweepReportError as exc:
        return _fail(str(exc))


CHECKPOINT_USAGE = (
    "usage: nxdt checkpoint inspect DIR | nxdt checkpoint verify DIR | nxdt checkpoint export-hf DIR OUT "
    "[--merge] [--base HF_DIR] [--dtype fp32|bf16] | "
    "nxdt checkpoint consolidate DIR OUT [--lightning]   (DIR: a checkpoints/step-<N> directory; OUT: a new directory "
    "to write, or with --lightning a new .ckpt file)"
)


def _size(n: float) -> str:
    unit = "B"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            break
        n /= 1024
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


def checkpoint_verify(path: str) -> int:
    """``nxdt checkpoint verify DIR``: one line per problem, then a summary; 0 good, 1 damaged, 2 not a directory."""
    from nxdt.lightning.checkpoint import CHECKSUMS_FILE, DONE_MARKER, check, missing_checkpoint

    root = Path(path)
    if not root.is_dir():
        return _fail(f"nxdt checkpoint: {missing_checkpoint(root)}")
    if not any((root / name).exists() for name in (DONE_MARKER, "meta.json", CHECKSUMS_FILE)):
        return _fail(
            f"nxdt checkpoint: {path} is not a checkpoint directory (no {DONE_MARKER}, meta.json or {CHECKSUMS_FILE}) — "
            "pass a checkpoints/step-<N> directory"
        )
    result = check(path)
    for problem in result.problems:
        print(f"{path}: {problem}")
    if result.problems:
        print(
            f"nxdt: checkpoint {path} is damaged: {len(result.problems)} problem{'s' if len(result.problems) > 1 else ''} — "
            "resume from an earlier checkpoint"
        )
        return 1
    if result.checksummed:
        print(f"nxdt: checkpoint {path} is good: {result.files} files ({_size(result.size)}) match their SHA-256")
    else:
        print(
            f"nxdt: checkpoint {path} is unverified: written by an older nxdt without checksums; its structure is whole "
            f"({result.files} files, {_size(result.size)})"
        )
    return 0


def cmd_checkpoint(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "verify":
        return checkpoint_verify(argv[1])
    merge, base, dtype = False, None, "fp32"
    lightning = argv[:1] == ["consolidate"] and "--lightning" in argv
    argv = [a for a in argv if a != "--lightning"] if lightning else argv
    if argv and argv[0] == "export-hf":  # LoRA: --merge, --base HF_DIR; --dtype fp32|bf16
        merge, rest = "--merge" in argv, [a for a in argv if a != "--merge"]
        if "--base" in rest:
            at = rest.index("--base")
            if at + 1 >= len(rest):
                raise UsageError(CHECKPOINT_USAGE)
            base, rest = rest[at + 1], rest[:at] + rest[at + 2 :]
        if "--dtype" in rest:
            at = rest.index("--dtype")
            if at + 1 >= len(rest) or rest[at + 1] not in ("fp32", "bf16"):
                raise UsageError(CHECKPOINT_USAGE)
            dtype, rest = rest[at + 1], rest[:at] + rest[at + 2 :]
        argv = rest
    if not ((len(argv) == 2 and argv[0] == "inspect") or (len(argv) == 3 and argv[0] in ("export-hf", "consolidate"))):
        raise UsageError(CHECKPOINT_USAGE)
    from nxdt.lightning.checkpoint import CheckpointError, describe
    from nxdt.lightning.hf import export_hf
    from nxdt.lightning.lightning_checkpoint import convert_to_lightning_checkpoint
    from nxdt.lightning.reshard import consolidate

    try:
        if argv[0] == "inspect":
            print(describe(argv[1]))
        elif argv[0] == "consolidate" and lightning:
            print(f"nxdt: wrote {convert_to_lightning_checkpoint(argv[1], argv[2])} (one Lightning .ckpt file)")
        elif argv[0] == "consolidate":
            print(f"nxdt: wrote {consolidate(argv[1], argv[2])} (one rank; resume it on any layout)")
        else:
            print(f"nxdt: wrote {export_hf(argv[1], argv[2], merge=merge, base=base, dtype=dtype)}")
    except CheckpointError as exc:
        return _fail(f"nxdt checkpoint: {exc}")
    return 0


def cmd_runs(argv: list[str]) -> int:
    from nxdt.launch.runs import cmd_runs as runs

    return runs(argv)


def cmd_report(argv: list[str]) -> int:
    from nxdt.launch.report import cmd_report as report

    return report(argv)


def cmd_data(argv: list[str]) -> int:
    if not argv or argv[0] != "convert-megatron":
        raise UsageError(
            "usage: nxdt data convert-megatron INPUT... --output-prefix PREFIX [--tokenizer PATH] [--json-key KEY] [--eod-id N]"
        )
    from nxdt.data.megatron import main as convert_megatron
    from nxdt.topology.nccom import OneLineParser

    return convert_megatron(argv[1:], OneLineParser)


def cmd_eval(argv: list[str], fork_ranks: bool = False) -> int:
    """``fork_ranks``: ``--ranks N`` may fork its ranks from this process (``nxdt.launch.evaluate.perplexity``)."""
    from nxdt.launch.evaluate import main as evaluate  # imports torch and the model hub only when run

    return evaluate(argv, fork_ranks=fork_ranks)


def cmd_generate(argv: list[str]) -> int:
    from nxdt.launch.generate import main as generate  # imports torch and the model hub only when run

    return generate(argv)


COMMANDS = {
    "train": cmd_train,
    "checkpoint": cmd_checkpoint,
    "plan": cmd_plan,
    "topo": cmd_topo,
    "comm-test": cmd_comm_test,
    "sweep-report": cmd_sweep_report,
    "runs": cmd_runs,
    "report": cmd_report,
    "data": cmd_data,
    "eval": cmd_eval,
    "generate": cmd_generate,
}


def main(argv: list[str] | None = None, *, fork_workers: bool = False) -> int:
    """The ``nxdt`` program (``argv`` None: from ``sys.argv``), or a caller's command line run in its own process.
    Only the program starts ``nxdt train``'s fork server while it still checks the config: it ends at a failed check
    and takes the server along, where a calling process would keep a server it never asked for. ``fork_workers``: a
    caller that has imported nxdt's Lightning layer and runs one thread asks ``nxdt train`` to fork its workers from
    this process rather than from a fork server that would import it all again (:func:`nxdt.launch.forking.start_method`)."""
    if argv is not None:
        return _run_command(list(argv), program=False, fork_workers=fork_workers)
    import atexit

    ending: dict[str, int] = {}
    # before the command runs: at exit, after every handler it registers (LIFO); the last of all only if the
    # environment registered none before it (coverage.py's data, a site hook's cleanup: never skipped)
    last = getattr(atexit, "_ncallbacks", lambda: 1)() == 0
    atexit.register(_end_the_program, ending, last)
    ending["status"] = status = _run_command(sys.argv[1:], program=True, fork_workers=fork_workers)
    return status


def _end_the_program(ending: dict[str, int], last: bool) -> None:
    """The ``nxdt`` program's exit handler, after every one its command registered (multiprocessing's, logging's,
    weakref finalizers). Where it is also the last (``last``: nothing was registered before the program started), its
    output is flushed here and what is left is the interpreter tearing down torch's, Hydra's and the elastic agent's
    modules object by object, which nothing needs (nxdt's files are closed, the memory goes back with the process):
    a command that returned its status exits at once. `nxdt train`'s last line to the shell prompt took 0.3 s more in
    teardown (strace of the peers' whole run, the README's install, 2026-11-30); before gc.freeze() at exit, which
    still guards the other ways out, 3.0-3.5 s. A command that raised ends as Python ends it (the traceback printed,
    exit status 1), as does every command where earlier handlers wait, both without the final collection over what
    the command imported (frozen)."""
    import gc

    if "status" not in ending or not last:
        gc.freeze()
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: what could not be written is lost either way
            pass
    os._exit(int(ending["status"] or 0) & 0xFF)  # as sys.exit(status) would end it


def _run_command(argv: list[str], *, program: bool, fork_workers: bool) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv == ["--version"]:  # what a newcomer types first (was "unknown command '--version'")
        from nxdt import __version__

        print(f"nxdt {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        return _fail(f"nxdt: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}")
    try:
        if command is cmd_train:
            return cmd_train(argv[1:], start_workers_early=program, fork_workers=fork_workers)
        if command is cmd_comm_test:  # a process of its own (not a caller's): its ranks may be its forks
            return cmd_comm_test(argv[1:], fork_ranks=program or fork_workers)
        if command is cmd_eval:  # likewise
            return cmd_eval(argv[1:], fork_ranks=program or fork_workers)
        return command(argv[1:])
    except UsageError as exc:
        return _fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
