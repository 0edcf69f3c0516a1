"""Lightning's own checkpoint format next to nxdt's directories: one ``.ckpt`` file that ``torch.load``,
``LightningModule.load_from_checkpoint`` and any strategy (``Trainer(devices=1)`` included) read, as DDP writes it.

Conventions followed: Lightning's FSDPStrategy (``lightning/pytorch/strategies/fsdp.py``) writes one file on rank 0
when its state is gathered (``state_dict_type="full"``) and a directory of shards when it is not ("sharded"); its
DeepSpeedStrategy always writes a directory, and ``lightning.pytorch.utilities.deepspeed``'s
``convert_zero_checkpoint_to_fp32_state_dict(dir, file)`` turns one into a file with the Lightning state kept. Here:

* ``NxDStrategy(checkpoint_format="auto")`` (the default) writes the file wherever no rank's state is a shard: plain
  data parallelism (context-parallel ranks are replicas too), through the strategy's ``CheckpointIO`` on global rank
  0, exactly what DDPStrategy writes. A sharded state — ZeRO-1, FSDP, tensor/pipeline/expert parallelism — stays an
  nxdt directory (every rank writes its own shard, nothing is gathered on one rank), which NxDStrategy resumes on
  any layout; ``"directory"`` asks for the directory everywhere (``nxdt train``: keep_last_k, checksums, resume and
  async writes are built on it); ``"file"`` asks for the file and is refused where the state is sharded.
* :func:`convert_to_lightning_checkpoint` is the one call that turns any nxdt directory into such a file: the full
  model by the module's own names, each optimizer's state unsharded in torch's per-parameter layout and in the order
  the module's optimizer holds its parameters, and the rest of Lightning's dict (loops, callbacks, schedulers,
  hyper-parameters, epoch and global step) as it was saved.
* NxDStrategy loads a file of either origin (its own, DDP's, a converted one) on every layout: the full model and
  the optimizer states by parameter name are what resharding a directory produces, so the same code cuts them for
  this rank.

Reading never unpickles arbitrary objects: files load with ``weights_only=True`` unless the caller of ``fit`` /
``validate`` passed ``weights_only=False`` itself (Lightning's own argument: the user's decision to trust a file).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch

from nxdt.lightning import reshard
from nxdt.lightning.checkpoint import CheckpointError, read_meta, refuse_target_inside_checkpoint
from nxdt.planner import Plan

CHECKPOINT_FORMATS = ("auto", "file", "directory")


def check_format_choice(choice: str) -> str:
    if choice not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"NxDStrategy(checkpoint_format={choice!r}): must be one of {', '.join(CHECKPOINT_FORMATS)} "
            "('auto': one Lightning .ckpt file under plain data parallelism, an nxdt directory where the state is sharded)"
        )
    return choice


def sharding(plan: Plan, dp_format: str) -> str | None:
    """What makes a rank's state a shard (None: every rank holds the whole state, as under DDP)."""
    model_parallel = [f"{d}={n}" for d, n in (("tensor_parallel_size", plan.tp), ("pipeline_parallel_size", plan.pp)) if n > 1]
    model_parallel += [f"expert_parallel_size={plan.ep}"] if plan.ep > 1 else []
    if dp_format != "replicated":
        model_parallel.append(f"{dp_format}=True")
    return ", ".join(model_parallel) or None


def resolve_format(choice: str, plan: Plan, dp_format: str, *, async_writes: bool, peft_adapter: bool) -> str:
    """``"file"`` or ``"directory"`` for this run (see the module docstring); ``"file"`` where it cannot be written
    raises ValueError naming why and the conversion to use instead."""
    sharded = sharding(plan, dp_format)
    directory_only = [k for k, on in (("async_checkpointing", async_writes), ("peft_adapter_in_checkpoints", peft_adapter)) if on]
    if choice == "auto":
        return "file" if sharded is None and not directory_only else "directory"
    if choice == "file" and sharded is not None:
        raise ValueError(
            f"NxDStrategy(checkpoint_format='file'): the state is sharded here ({sharded}), so no rank holds it whole; "
            "use checkpoint_format='auto' (an nxdt directory, which NxDStrategy resumes on any layout) and turn it into "
            "one Lightning file with nxdt.lightning.convert_to_lightning_checkpoint(dir, out)"
        )
    if choice == "file" and directory_only:
        raise ValueError(
            f"NxDStrategy(checkpoint_format='file'): {directory_only[0]}=True writes nxdt directories only; "
            f"drop one of the two (Lightning's AsyncCheckpointIO plugin writes files in the background)"
        )
    return choice


def is_file(path: Any) -> bool:
    """A path Lightning's CheckpointIO reads as one file (nxdt's checkpoints are directories)."""
    return not os.path.isdir(path)


def load_file(path: Any, checkpoint_io: Any, weights_only: bool | None) -> dict[str, Any]:
    """A Lightning checkpoint file through the strategy's CheckpointIO, without unpickling objects unless the user
    asked for it (``weights_only=False``)."""
    try:
        return checkpoint_io.load_checkpoint(path, weights_only=True if weights_only is None else weights_only)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist — pass a .ckpt file or an nxdt checkpoint directory") from None
    except Exception as exc:
        if "weights_only" not in str(exc) and "Weights only" not in str(exc):
            raise
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain data, which nxdt does not unpickle "
            "(weights_only=True); if you trust the file, pass weights_only=False to fit/validate/test"
        ) from None


def as_full_state(checkpoint: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A Lightning file's dict in the form a resharded nxdt directory loads in (:func:`reshard.load_resharded`): the
    full model as it is, each optimizer's state by parameter name — ``names[i]``: the parameters of this run's
    optimizer ``i`` in the order it holds them (recorded before any sharding), the order torch's ``state_dict``
    numbers them in. NxDStrategy then cuts both for this rank, whatever the layout."""
    states = checkpoint.get("optimizer_states")
    out = {**checkpoint, reshard.RESHARDED_KEY: True}
    if states is None:  # a weights-only file (ModelCheckpoint(save_weights_only=True)): the model alone
        return out
    if len(states) != len(names):
        raise CheckpointError(f"the checkpoint holds {len(states)} optimizer states, this run has {len(names)} optimizers")
    out["optimizer_states"] = [reshard.by_name(state, n) for state, n in zip(states, names)]
    return out


def lightning_dict(full: reshard.FullState) -> dict[str, Any]:
    """Lightning's checkpoint dict of a consolidated nxdt state: the keys DDPStrategy writes, none of nxdt's own."""
    trainer = {k: v for k, v in full.trainer.items() if not k.startswith("nxdt_")}
    return {
        **trainer,
        "state_dict": full.model,
        "optimizer_states": [reshard.by_index(o)[0] for o in full.optimizers],
    }


def convert_to_lightning_checkpoint(checkpoint_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the nxdt checkpoint directory ``checkpoint_dir`` (any layout: ZeRO-1, FSDP, TP, PP) as one Lightning
    ``.ckpt`` file ``out``, the file DDPStrategy would have written: ``torch.load(out, weights_only=True)``,
    ``Module.load_from_checkpoint(out)``, ``Trainer(...).fit/validate(ckpt_path=out)`` under any strategy read it.
    The checkpoint's checksums are verified first; ``out`` must not exist yet. Returns ``out``."""
    target = Path(out)
    refuse_target_inside_checkpoint(checkpoint_dir, target)
    if target.exists() or target.is_symlink():
        raise CheckpointError(f"{target} exists — name a new file to write the Lightning checkpoint to")
    meta = read_meta(checkpoint_dir)
    if meta.get("adapters_only"):
        raise CheckpointError(
            f"checkpoint {checkpoint_dir} holds the LoRA adapters only (save_lora_base false), not a model Lightning can "
            "load — export them with `nxdt checkpoint export-hf` (a PEFT adapter directory)"
        )
    checkpoint = lightning_dict(reshard.read_full_state(checkpoint_dir))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, target)  # a reader never sees half a file
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write {target}: {exc.strerror or exc}") from exc
    return target
