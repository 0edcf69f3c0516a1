"""One rank's part of nxdt's directory checkpoints, as :class:`NxDStrategy` saves and restores them.

:mod:`nxdt.lightning.checkpoint` is the file format (atomic directory, checksums, async writer) and
:mod:`nxdt.lightning.reshard` turns any layout's files into one full state; this module decides what *this*
rank writes and reads: which shard files are its own, what goes into them (parameter names for resharding,
FSDP's flat layout, the TP layout, its RNG streams, LoRA's adapters alone or as a PEFT directory), and how a
loaded state is fitted back into the parallelised model and its (possibly sharded) optimizers.

Why not Lightning's ``CheckpointIO`` plugin: its contract is storage of one dict, called on global rank 0
only (``Strategy.save_checkpoint`` / ``remove_checkpoint`` gate on ``is_global_zero``), and restoring the model
and optimizers stays in the strategy's ``load_*_state_dict`` hooks. Here every rank writes its own shard, the
commit is agreed over the world communicator, and half of the job needs the plan, the data-parallel runtime
and the module — so :class:`ShardedCheckpointer` is a small object the strategy delegates its checkpoint hooks
to, bound to this rank's groups once they exist.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from nxdt.comm import Communicator
from nxdt.lightning import checkpoint as ckpt_io, lightning_checkpoint, reshard
from nxdt.lightning.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_adapter_config, peft_adapter_state
from nxdt.parallel.data_parallel import FSDP_SHARD_MARK, DataParallelRuntime
from nxdt.parallel.tensor_parallel import gather_shards, shard_layout
from nxdt.planner import Dim, Plan

log = logging.getLogger(__name__)

# a checkpoint whose model file holds the trainable tensors only (LoRA with save_lora_base false): the frozen base
# weights come from the model as built when it is resumed
ADAPTERS_ONLY_KEY = "nxdt_adapters_only"


class ShardFiles(NamedTuple):
    """This rank's files of a checkpoint and whether it writes them."""

    model: str
    state: str
    writes_model: bool
    writes_state: bool


def shard_files(plan: Plan, rank: int, shards_optimizer_state: bool) -> ShardFiles:
    """Data-parallel replicas hold identical weights, so DP rank 0 of each model-parallel position (TP × PP shard)
    writes them; the trainer/optimizer state is per model-parallel shard too, and per DP rank when the
    data-parallel runtime shards it (ZeRO-1, FSDP). Under context parallelism the replicas are DP × CP
    (``dp_cp``): the files are those of a DP run with DP × CP ranks."""
    coords = plan.coords(rank)
    mp = "" if plan.mp == 1 else f"-mp{coords.mp}"
    mp += f"-ep{coords.ep}" if plan.ep > 1 else ""  # each EP rank holds its own experts
    dp = f"-dp{coords.dp_cp}" if shards_optimizer_state and plan.dp_cp > 1 else ""
    first = coords.edp == 0 and coords.cp == 0  # the first replica of each EP position (over DP and CP)
    return ShardFiles(f"model{mp}.safetensors", f"trainer_state{mp}{dp}.pt", first, first or bool(dp))


def saves_adapters_only(module: nn.Module) -> bool:
    """The hub model carries a LoRA ``peft_config`` (``nxdt.models.lora.apply_peft``) with save_lora_base false."""
    config = getattr(getattr(module, "model", None), "peft_config", None)
    return config is not None and not getattr(config, "save_lora_base", True)


@dataclass(frozen=True)
class RankGroups:
    """What the checkpointer needs of this rank once the strategy has set it up."""

    plan: Plan
    rank: int
    world: Communicator
    tp: Communicator | None  # TP > 1 only
    pp: Communicator | None  # PP > 1 only
    tp_layout: dict[str, list[int]] | None  # this stage's TP-sharded parameters, recorded before FSDP flattens them
    trainable: frozenset[str]  # state-dict names of the trainable parameters, recorded before FSDP

    @classmethod
    def of(
        cls,
        plan: Plan,
        rank: int,
        comms: Mapping[str, Communicator],
        tp_layout: dict[str, list[int]] | None,
        trainable: frozenset[str],
    ) -> RankGroups:
        """From the strategy's communicators by dimension (``"world"``, ``"tp"``, ...)."""
        tp, pp = (comms.get(dim) if plan.degree(dim) > 1 else None for dim in (Dim.TP, Dim.PP))
        return cls(plan, rank, comms["world"], tp, pp, tp_layout, trainable)


class ShardedCheckpointer:
    """Saves, loads and removes this rank's part of a directory checkpoint (every method a collective every rank
    joins unless it says otherwise).

    Args:
        dp: the strategy's data-parallel runtime (replicated, ZeRO-1 or FSDP): its model state and optimizer layout.
        virtual_pipeline: virtual pipeline stages (recorded in meta.json, checked on load).
        async_writes: write in a background thread (a snapshot; training continues).
        peft_adapter: every checkpoint is also a Hugging Face PEFT adapter directory.
        checkpoint_format: ``auto`` | ``file`` | ``directory`` (:mod:`nxdt.lightning.lightning_checkpoint`): whether a
            save is Lightning's one file (written by the strategy's CheckpointIO) or this class's directory.
    """

    def __init__(
        self,
        dp: DataParallelRuntime,
        *,
        virtual_pipeline: int = 1,
        async_writes: bool = False,
        peft_adapter: bool = False,
        checkpoint_format: str = "directory",
    ) -> None:
        self._dp = dp
        self._virtual = virtual_pipeline
        self._async = async_writes
        self._peft_adapter = peft_adapter
        self._format_choice = lightning_checkpoint.check_format_choice(checkpoint_format)
        self.writes_file = False  # resolved by bind(): the layout decides what "auto" means
        self._groups: RankGroups | None = None
        self._writer: ckpt_io.AsyncWriter | None = None  # started by the first asynchronous save
        self._state_order: dict[str, int] = {}  # the module's state-dict names in its own order, before FSDP
        self._optimizer_names: list[list[str]] | None = None  # each optimizer's parameters as it holds them, before FSDP

    def bind(self, groups: RankGroups, module: nn.Module) -> None:
        """This rank's groups; records ``module``'s state-dict order the first time (FSDP renames its parameters)."""
        self._groups = groups
        self.writes_file = (
            lightning_checkpoint.resolve_format(
                self._format_choice, groups.plan, self._dp.dp_format, async_writes=self._async, peft_adapter=self._peft_adapter
            )
            == "file"
        )
        if not self._state_order:
            self._state_order = {k: i for i, k in enumerate(module.state_dict())}

    def record_optimizers(self, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module) -> None:
        """Each optimizer's parameter names in the order it holds them, before FSDP points it at flat shards: the
        order torch numbers a Lightning file's optimizer state in (written into FSDP directories for the conversion)."""
        self._optimizer_names = [reshard.param_names(o, module) for o in optimizers]

    def in_module_order(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` in the module's own state-dict order (FSDP's full state lists its gathered parameters last)."""
        last = len(self._state_order)
        return dict(sorted(state.items(), key=lambda kv: self._state_order.get(kv[0], last)))

    @property
    def groups(self) -> RankGroups:
        if self._groups is None:
            raise RuntimeError("NxDStrategy: checkpoints are saved and loaded after Trainer.fit() has set up the strategy")
        return self._groups

    def files(self) -> ShardFiles:
        return shard_files(self.groups.plan, self.groups.rank, self._dp.shards_optimizer_state)

    # ----------------------------------------------------------------------------- save
    def save(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        meta: dict[str, Any],
        before_commit: Callable[[Any], None] | None = None,
    ) -> None:
        """Write ``checkpoint`` (Lightning's dict) as this rank's files of ``path``; ``meta`` goes into meta.json;
        ``before_commit`` runs with the temporary directory once the files are written."""
        self._check_finite(path, module)
        adapters_only = saves_adapters_only(module)
        checkpoint = self._contents(checkpoint, module, optimizers, adapters_only)
        meta = {**({"adapters_only": True} if adapters_only else {}), **self._layout_meta(module), **meta}
        extra = self._extra_files(module)
        if not self._async:
            return self._write(checkpoint, path, meta, extra, before_commit)
        # copy what this rank writes now; training changes the originals meanwhile
        files = self.files()
        mine = {
            k: v
            for k, v in checkpoint.items()
            if (files.writes_model if k == "state_dict" else files.writes_state or k == "global_step")
        }
        snapshot = ckpt_io.snapshot(mine)
        if self._writer is None:
            self._writer = ckpt_io.AsyncWriter()
        self._writer.submit(lambda: self._write(snapshot, path, meta, extra, before_commit))

    def _check_finite(self, path: Any, module: nn.Module) -> None:
        """Never write non-finite weights: keep_last_k would then delete the last good checkpoint in their favour."""
        norm = float(self._dp.parameter_norm(module))  # collective over the groups holding other parts of the model
        if not math.isfinite(norm):
            raise ckpt_io.CheckpointError(
                f"not writing {path}: the parameters are not finite (norm {norm}); the previous "
                "checkpoints are kept — lower model.optim.lr or enable gradient clipping"
            )

    def _contents(
        self, checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], adapters_only: bool
    ) -> dict[str, Any]:
        """Lightning's dict as nxdt stores it: every optimizer state index named (any layout can load it), FSDP's flat
        layout, and under LoRA without save_lora_base the trainable tensors (the adapters) alone."""
        if adapters_only:
            state = {k: v for k, v in checkpoint["state_dict"].items() if k in self.groups.trainable}
            checkpoint = {**checkpoint, ADAPTERS_ONLY_KEY: True, "state_dict": state}
        checkpoint = reshard.with_param_names(checkpoint, list(optimizers), module)
        checkpoint[reshard.STATE_ORDER_KEY] = list(checkpoint["state_dict"])  # the module's order (a converted file keeps it)
        flat_layout = self._dp.optimizer_layout(optimizers, module)
        if flat_layout is not None:  # FSDP: which parameters each optimizer flat shard holds (to unflatten elsewhere)
            checkpoint[reshard.FSDP_LAYOUT_KEY] = flat_layout
            if self._optimizer_names is not None:  # and the order the user's optimizers hold them in (flats reorder)
                checkpoint[reshard.PARAM_ORDER_KEY] = self._optimizer_names
        return checkpoint

    def _extra_files(self, module: nn.Module) -> dict[str, Any]:
        """This rank's RNG streams; with ``peft_adapter`` (a collective: every rank gathers) rank 0's adapter files."""
        extra: dict[str, Any] = {ckpt_io.rng_file(self.groups.rank): ckpt_io.rng_tensors()}
        if self._peft_adapter:
            adapter = self._peft_adapter_files(module)
            extra.update(adapter if self.groups.rank == 0 else {})
        return extra

    def _write(
        self,
        checkpoint: dict[str, Any],
        path: Any,
        meta: dict[str, Any],
        extra: dict[str, Any],
        before_commit: Callable[[Any], None] | None,
    ) -> None:
        g, files = self.groups, self.files()
        if g.plan.world_size == 1:
            ckpt_io.save(checkpoint, path, meta=meta, before_commit=before_commit, extra_files=extra)
            return
        ckpt_io.save_sharded(
            checkpoint,
            path,
            model_file=files.model if files.writes_model else None,
            state_file=files.state if files.writes_state else None,
            comm=g.world,
            meta=meta,
            before_commit=before_commit,
            extra_files=extra,
            stream=ckpt_io.ASYNC_STREAM if self._async else "default",
        )

    def _layout_meta(self, module: nn.Module) -> dict[str, Any]:
        """meta.json's description of the layout the files are cut to (checked, or resharded from, on load)."""
        plan = self.groups.plan
        meta = {
            "degrees": ckpt_io.checkpoint_degrees(plan.degrees),
            "world_size": plan.world_size,
            **self._dp.checkpoint_flags(),
            "virtual_pipeline": self._virtual,
            "dp_format": self._dp.dp_format,
        }
        if plan.tp > 1:  # how to reassemble full tensors from the TP shards (export, resharding)
            layout = self.groups.tp_layout if self.groups.tp_layout is not None else shard_layout(module.model)
            layouts = self.groups.world.all_gather_object(layout)  # every stage's tensors
            meta["tensor_parallel"] = {name: spec for layout in layouts for name, spec in layout.items()}
        return meta

    def _peft_adapter_files(self, module: nn.Module) -> dict[str, Any]:
        """adapter_config.json and adapter_model.safetensors (``nxdt.lightning.peft_export``) of the adapters now."""
        config = getattr(getattr(module, "model", None), "lora_config", None)
        if config is None:
            raise ValueError("NxDStrategy(peft_adapter_in_checkpoints=True): the model has no LoRA adapters (apply_peft)")
        state = peft_adapter_state(self.trainable_state_dict(module))
        # PEFT's base_model_name_or_path: the Hugging Face directory the base weights came from (model.hf_checkpoint),
        # so PeftModel / AutoPeftModel find the base; None when the base was not a Hugging Face model
        base = getattr(getattr(module, "model_cfg", None), "hf_checkpoint", None)
        base_path = str(Path(base).expanduser().resolve()) if base else None
        return {ADAPTER_WEIGHTS: state, ADAPTER_CONFIG: json.dumps(peft_adapter_config(config, base_path), indent=2).encode()}

    def trainable_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """The trainable tensors (LoRA: the adapters) unsharded — gathered over FSDP's DP shards, the TP shards and the
        pipeline stages (each holds its own layers, under their global names) — by their names in the hub model (no
        ``model.`` prefix), on every rank."""
        g = self.groups
        state = self._dp.model_state_dict(module)
        layout = g.tp_layout or {}
        out = {}
        for name in sorted(g.trainable):
            short = name[len(reshard.MODULE_PREFIX) :] if name.startswith(reshard.MODULE_PREFIX) else name
            spec = layout.get(short)
            out[short] = (
                gather_shards(state[name], g.tp, *spec) if g.tp is not None and spec is not None else state[name].detach().clone()
            )
        if g.pp is not None:  # tensors travel as tensors (nxdt.comm.objects), never pickled
            out = dict(sorted((name, t) for stage in g.pp.all_gather_object(out) for name, t in stage.items()))
        return out

    # ----------------------------------------------------------------------------- load
    def load(self, path: Any, expect_model: dict[str, Any] | None) -> dict[str, Any]:
        """This rank's checkpoint dict: its own shard files when the layout is the one saved, else the full state
        resharded (:mod:`nxdt.lightning.reshard`); restores the RNG streams. Not a collective."""
        g = self.groups
        degrees = ckpt_io.checkpoint_degrees(g.plan.degrees)  # CP folded into DP: CP ranks are weight replicas
        if ckpt_io.check_layout(
            path, degrees, self._dp.checkpoint_flags()["zero1"], self._virtual, data_parallel_format=self._dp.dp_format
        ) or self._other_padding(path):
            log.info("rank %d: resharding %s for this layout %s", g.rank, path, g.plan.degrees)
            checkpoint = reshard.load_resharded(path, expect_model=expect_model)
        else:
            files = self.files()
            checkpoint = ckpt_io.load(path, expect_model=expect_model, model_file=files.model, state_file=files.state)
        ckpt_io.restore_rng(path, g.rank, same_layout=ckpt_io.same_world(path, degrees, g.plan.world_size))
        return checkpoint

    def load_file(self, path: Any, checkpoint_io: Any, weights_only: bool | None) -> dict[str, Any]:
        """A Lightning ``.ckpt`` file (this strategy's, DDP's, a converted directory): the full state every layout
        cuts its part of, as from a resharded directory. Not a collective."""
        checkpoint = lightning_checkpoint.load_file(path, checkpoint_io, weights_only)
        if self._optimizer_names is None:  # validate / test / predict: the model alone is restored
            return {**checkpoint, reshard.RESHARDED_KEY: True}
        return lightning_checkpoint.as_full_state(checkpoint, self._optimizer_names)

    def _other_padding(self, path: Any) -> bool:
        """The same TP degree, but a vocabulary padded to another length (model.make_vocab_size_divisible_by changed):
        the shards have other shapes, the full state (trimmed) does not — resharding fits it to this run's padding."""
        saved = ckpt_io.read_meta(path).get("tensor_parallel") or {}
        return any(saved.get(name) not in (None, spec) for name, spec in (self.groups.tp_layout or {}).items())

    def load_model_state(self, checkpoint: dict[str, Any], module: nn.Module) -> None:
        """Fit the checkpoint's model state into this rank's (parallelised, possibly FSDP-sharded) module."""
        state = checkpoint["state_dict"]
        adapters_only = bool(checkpoint.get(ADAPTERS_ONLY_KEY))
        if checkpoint.get(reshard.RESHARDED_KEY):  # the full model of another layout: this rank's stage and TP part of it
            keys = [k for k in self._dp.model_state_keys(module) if not adapters_only or k in state]
            state = reshard.local_model_state(state, keys, module, self.groups.plan.coords(self.groups.rank).tp)
        if adapters_only:  # the frozen base: the model's own weights as built (its hf_checkpoint, or the same seed)
            live = self._dp.model_state_dict(module)  # a collective under FSDP: every rank loads
            state = {**{k: v for k, v in live.items() if k not in state}, **state}
        try:
            rest = self._dp.load_model_state(module, state)
        except (KeyError, ValueError) as exc:
            raise ckpt_io.CheckpointError(f"checkpoint does not fit this model: {exc.args[0]}") from None
        result = module.load_state_dict(rest, strict=False)
        missing = [k for k in result.missing_keys if FSDP_SHARD_MARK not in k]
        if result.unexpected_keys or missing:
            raise ckpt_io.CheckpointError(
                "checkpoint shard does not match this rank's tensor/pipeline/expert shard "
                f"(unexpected {result.unexpected_keys[:3]}, missing {missing[:3]})"
            )

    def optimizer_states(
        self, checkpoint: dict[str, Any], optimizers: Sequence[torch.optim.Optimizer], module: nn.Module
    ) -> list[dict[str, Any]]:
        """The state each of this rank's optimizers loads: by parameter name where the checkpoint's layout or order
        differs; FSDP cuts full states into its shards."""
        tp_rank, optimizers = self.groups.plan.coords(self.groups.rank).tp, list(optimizers)
        try:
            return self._dp.optimizer_states(
                checkpoint["optimizer_states"],
                optimizers,
                module,
                resharded=bool(checkpoint.get(reshard.RESHARDED_KEY)),
                tp_rank=tp_rank,
                by_name=lambda: reshard.optimizer_states_for(checkpoint, optimizers, module, tp_rank),
            )
        except ValueError as exc:
            raise ckpt_io.CheckpointError(f"checkpoint optimizer state does not fit this model: {exc}") from None

    # ----------------------------------------------------------------------------- remove, finish
    def remove(self, path: Any) -> None:
        """Delete a checkpoint (one rank calls it): after the newer checkpoint is committed when writing asynchronously."""
        if self._writer is not None:
            self._writer.after_success(lambda: ckpt_io.remove(path))
        else:
            ckpt_io.remove(path)

    def wait(self) -> None:
        """The last checkpoint is committed (or its error raised)."""
        if self._writer is not None:
            self._writer.wait()

    def close(self) -> None:
        """Stop the background writer (its collectives need the communicators: before they close)."""
        if self._writer is not None:
            self._writer.close(raise_errors=False)
            self._writer = None
