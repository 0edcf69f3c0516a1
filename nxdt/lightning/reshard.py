"""Resharding: a checkpoint of any layout ⇄ one consolidated full state ⇄ the shards of another layout.

Everything goes through :class:`FullState` — the whole model (full tensors by Lightning state-dict name),
each optimizer's state by *parameter name* (unsharded tensors; torch's state-dict format with names in
place of indices) and the rest of the trainer state (loops, schedulers, data position, callbacks)::

    shards (TP × PP × DP/ZeRO-1) ──read_full_state──▶ FullState ──▶ consolidate: one-rank checkpoint (`nxdt checkpoint consolidate`)
                                                               ──▶ export-hf: the model tensors, HF names
                                                               ──▶ resume on another layout: load_resharded + optimizer_state_for

Reading, per model-parallel position K (mp rank = tp rank + TP · pp stage):

* the position's data-parallel format says how its optimizer state is stored; its reader returns it as if
  unsharded over DP (a :class:`PositionShard`): ``replicated`` (DP rank 0 wrote it) or ``zero1`` (the flat
  shards of every DP rank, joined by ``nxdt.parallel.zero1.consolidate_shard_states``) or ``fsdp`` (the
  model file gathered at save; optimizer flat shards cut back into parameters by the recorded flat layout).
  Another DP sharding plugs in by adding its reader to ``DP_FORMATS`` and naming it in meta.json's ``dp_format``;
* TP pieces are concatenated along the dimension meta.json's ``tensor_parallel`` layout records (one copy per
  ``replicas`` ranks) — optimizer moments exactly like their parameters; PP stages merge by name (parameters
  keep their full-model names on every stage). A padded vocabulary (the entry's third number, the true length)
  is trimmed there, so the full state — consolidated, exported, resharded — always holds the true vocabulary,
  and a new TP degree (or the same one with another ``make_vocab_size_divisible_by``: the fourth number, the padded
  length, differs) pads it its own way when it slices.

Loading on the new layout (NxDStrategy restores after parallelising): each full tensor of this stage is cut
by its TP ``ShardSpec`` for this rank (FSDP then takes its DP slice); the optimizer state is sliced the same
way for each live parameter and put in the order this rank's optimizer holds its parameters; ZeRO-1
(``Zero1Optimizer.load_state_dict`` of a torch-format dict) and FSDP (``optimizer_state_from_named``) slice
it over the new DP group themselves.
The data position is global (consumed samples), so it is right for any DP degree; random state: see
:mod:`nxdt.lightning.checkpoint`. Every rank reads the whole checkpoint — fine for what nxdt trains on
CPU hosts; a large model would read only its slices (safetensors ``get_slice``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from torch import nn

from nxdt.config.validate import Dim
from nxdt.lightning.checkpoint import (
    CheckpointError,
    dp_format,
    opened_regular,
    read_meta,
    refuse_target_inside_checkpoint,
    rng_file,
    save,
    verify,
)
from nxdt.parallel.tensor_parallel import shard_spec, trim_padding
from nxdt.parallel.zero1 import STATE_FORMAT as ZERO1_FORMAT, consolidate_shard_states

NAMES_KEY = "nxdt_optimizer_param_names"  # trainer state: per optimizer, the parameter name of each state index
RESHARDED_KEY = "nxdt_resharded"  # marks a checkpoint dict built by load_resharded (full model, optimizers by name)
MODULE_PREFIX = "model."  # CausalLMModule holds the hub model as `model`; TP layouts are relative to it


@dataclass
class FullState:
    model: dict[str, torch.Tensor]  # Lightning state-dict name → full tensor
    optimizers: list[dict[str, Any]]  # {"state": {param name: {...}}, "param_groups": [{..., "params": [names]}]}
    trainer: dict[str, Any]  # the rest of the Lightning checkpoint (global_step, loops, lr_schedulers, datamodule, ...)
    meta: dict[str, Any]  # the source's meta.json


@dataclass
class PositionShard:
    """One model-parallel position (a TP rank of a PP stage), unsharded over data parallelism."""

    model: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]  # by parameter name, tensors as this TP rank holds them
    trainer: dict[str, Any]


# ---------------------------------------------------------------------------------------------- names ⇄ indices
def param_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """The parameter name behind each index of ``optimizer.state_dict()`` (param groups flattened in order)."""
    by_id = {id(p): n for n, p in module.named_parameters()}
    try:
        return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]
    except KeyError:
        raise ValueError(
            "the optimizer holds a tensor that is not a parameter of the module; build it from module.parameters()"
        ) from None


def with_param_names(checkpoint: dict[str, Any], optimizers: list[torch.optim.Optimizer], module: nn.Module) -> dict[str, Any]:
    """The checkpoint dict plus the names that let any layout map its optimizer state back to parameters."""
    return {**checkpoint, NAMES_KEY: [param_names(o, module) for o in optimizers]}


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Torch-format optimizer state (indices) → the same with parameter names."""
    count = sum(len(g["params"]) for g in state["param_groups"])
    if count != len(names):
        raise CheckpointError(
            f"optimizer state has {count} parameters but {len(names)} recorded names — the checkpoint is damaged"
        )
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**_hyper(g), "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def by_index(state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """By-name optimizer state → (torch format with indices in param-group order, the name of each index)."""
    names = [n for g in state["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    groups, start = [], 0
    for g in state["param_groups"]:
        groups.append({**_hyper(g), "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    numbered = sorted(
        ((index[n], v) for n, v in state["state"].items()), key=lambda kv: kv[0]
    )  # in index order, as torch's state_dict
    return {"state": dict(numbered), "param_groups": groups}, names


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


# ---------------------------------------------------------------------------------------------- reading shards
def _files(meta: dict[str, Any], mp: int, ep: int = 0) -> tuple[str, Callable[[int], str]]:
    """(model file, DP rank → trainer-state file) of model-parallel position ``mp`` and expert-parallel rank ``ep``
    (see sharded_checkpoint.shard_files)."""
    deg = meta.get("degrees", {})
    suffix = "" if deg.get(Dim.TP, 1) * deg.get(Dim.PP, 1) == 1 else f"-mp{mp}"
    suffix += f"-ep{ep}" if deg.get(Dim.EP, 1) > 1 else ""
    sharded_state = dp_format(meta) in ("zero1", "fsdp") and deg.get(Dim.DP, 1) > 1
    return f"model{suffix}.safetensors", lambda dp: f"trainer_state{suffix}{f'-dp{dp}' if sharded_state else ''}.pt"


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"checkpoint {file.parent}: shard {file.name} is missing — the checkpoint is incomplete")
    try:
        with opened_regular(file) as opened:  # never through a link planted in the checkpoint
            return load_file(opened)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {file} is unreadable ({type(exc).__name__}: {exc}) — use an earlier checkpoint"
        ) from None


def _state(file: Path, loaded: dict[Path, Any] | None = None) -> dict[str, Any]:
    """A trainer-state file's dict; ``loaded``: the files read so far by this consolidation (each read once; callers
    copy a dict before changing it)."""
    if loaded is not None:
        if file not in loaded:
            loaded[file] = _state(file)
        return loaded[file]
    if not file.is_file():
        raise CheckpointError(f"checkpoint {file.parent}: shard {file.name} is missing — the checkpoint is incomplete")
    try:
        with opened_regular(file) as opened:
            return torch.load(opened, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {file} is unreadable ({type(exc).__name__}: {exc}) — use an earlier checkpoint"
        ) from None


def _take_names(state: dict[str, Any], file: Path) -> list[list[str]]:
    names = state.pop(NAMES_KEY, None)
    if state.get("optimizer_states") and names is None:
        raise CheckpointError(
            f"checkpoint file {file} records no optimizer parameter names (written by an older nxdt) — "
            "resume it on its original layout"
        )
    return names or []


def _read_replicated(
    root: Path, meta: dict[str, Any], mp: int, optimizer: bool, ep: int = 0, loaded: dict[Path, Any] | None = None
) -> PositionShard:
    model_file, state_file = _files(meta, mp, ep)
    model = _tensors(root / model_file)
    if not optimizer:
        return PositionShard(model, [], {})
    state = dict(_state(root / state_file(0), loaded))
    names = _take_names(state, root / state_file(0))
    opts = [by_name(s, n) for s, n in zip(state.pop("optimizer_states", []), names)]
    return PositionShard(model, opts, state)


def _read_zero1(
    root: Path, meta: dict[str, Any], mp: int, optimizer: bool, ep: int = 0, loaded: dict[Path, Any] | None = None
) -> PositionShard:
    model_file, _ = _files(meta, mp, ep)
    model = _tensors(root / model_file)
    if not optimizer:
        return PositionShard(model, [], {})
    deg = meta["degrees"]
    eps = deg.get(Dim.EP, 1)
    # each DP rank's file carries the EP suffix of the experts it holds: the dense state is sharded over every DP rank
    # (context parallelism's replicas folded in), the experts over the replicas of the same experts (its EP rank's files)
    owner = [next((e for e in range(eps) if (root / _files(meta, mp, e)[1](d)).is_file()), 0) for d in range(deg.get(Dim.DP, 1))]
    states = [_state(root / _files(meta, mp, e)[1](d), loaded) for d, e in enumerate(owner)]
    replicas = [s for s, e in zip(states, owner) if e == ep]
    first = owner.index(ep) if ep in owner else 0
    names = _take_names(dict(states[first]), root / _files(meta, mp, ep)[1](first))
    opts = []
    for i, n in enumerate(names):
        shards = [s["optimizer_states"][i] for s in states]
        if any(s.get("master_weights") for s in shards):
            raise CheckpointError(
                f"checkpoint {root}: ZeRO-1 shards with fp32 master weights cannot be resharded yet — "
                "resume on the original layout"
            )
        try:
            experts = [s["optimizer_states"][i] for s in replicas] if eps > 1 else None
            opts.append(by_name(consolidate_shard_states(shards, experts), n))
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {root}: {exc}") from None
    trainer = dict(states[first])  # this EP rank's own (its experts' names in the module's order)
    trainer.pop("optimizer_states", None)
    trainer.pop(NAMES_KEY, None)
    return PositionShard(model, opts, trainer)


FSDP_LAYOUT_KEY = "nxdt_fsdp_flat_layout"  # trainer state under FSDP: FullyShardedDataParallel.flat_layout()
# trainer state under FSDP: per optimizer, its parameter names in the order it held them before FSDP pointed it at
# flat shards (the order a Lightning file numbers them in: nxdt.lightning.lightning_checkpoint)
PARAM_ORDER_KEY = "nxdt_optimizer_param_order"
# trainer state: the model file's tensor names in the module's state-dict order (safetensors sorts them by name)
STATE_ORDER_KEY = "nxdt_state_dict_order"


def _read_fsdp(
    root: Path, meta: dict[str, Any], mp: int, optimizer: bool, ep: int = 0, loaded: dict[Path, Any] | None = None
) -> PositionShard:
    """FSDP: the model file is already unsharded over DP (gathered at save); each optimizer state index is one
    flat shard — joined over the DP ranks (an expert flat: over the replicas of expert-parallel rank ``ep``'s experts,
    in the shard order each file records) and cut back into parameters by the recorded flat layout."""
    model_file, _ = _files(meta, mp, ep)
    model = _tensors(root / model_file)
    if not optimizer:
        return PositionShard(model, [], {})
    deg = meta["degrees"]
    eps = deg.get(Dim.EP, 1)
    # each DP rank's file carries the EP suffix of the experts it holds (as under ZeRO-1)
    owner = [next((e for e in range(eps) if (root / _files(meta, mp, e)[1](d)).is_file()), 0) for d in range(deg.get(Dim.DP, 1))]
    states = [_state(root / _files(meta, mp, e)[1](d), loaded) for d, e in enumerate(owner)]
    first = owner.index(ep) if ep in owner else 0
    replicas = [s for s, e in zip(states, owner) if e == ep]
    layouts = states[first].get(FSDP_LAYOUT_KEY)  # this EP rank's: its experts' names
    orders = states[first].get(PARAM_ORDER_KEY)
    if layouts is None:
        raise CheckpointError(
            f"checkpoint {root}: {_files(meta, mp, ep)[1](first)} records no FSDP flat layout — resume it on its original layout"
        )
    opts = []
    for i, flats in enumerate(layouts):
        named: dict[str, Any] = {}
        for j, flat in enumerate(flats):
            holders = states
            if flat.get("expert"):  # sharded over the replicas of these experts, in their recorded shard order
                holders = sorted(replicas, key=lambda st: st[FSDP_LAYOUT_KEY][i][j]["rank"])
            entries = [st["optimizer_states"][i]["state"].get(j) for st in holders][: flat.get("dp", len(holders))]
            if any(e is None for e in entries):
                continue  # never stepped
            for key, value in entries[0].items():
                if isinstance(value, torch.Tensor) and value.dim():
                    full = torch.cat([e[key] for e in entries])
                    for name, offset, numel, shape in flat["entries"]:
                        named.setdefault(name, {})[key] = full[offset : offset + numel].view(shape).clone()
                else:  # the flat's step counter: one copy per parameter (torch's Adam increments it in place)
                    for name, *_ in flat["entries"]:
                        named.setdefault(name, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
        order = orders[i] if orders is not None and i < len(orders) else []
        position = {name: k for k, name in enumerate(order)}  # absent (older checkpoints): the flats' order
        groups = [
            {
                **_hyper(g),
                "params": sorted(
                    (name for j in g["params"] for name, *_ in flats[j]["entries"]), key=lambda n: position.get(n, len(position))
                ),
            }
            for g in states[first]["optimizer_states"][i]["param_groups"]
        ]
        opts.append({"state": named, "param_groups": groups})
    trainer = dict(states[first])
    for key in ("optimizer_states", FSDP_LAYOUT_KEY, NAMES_KEY, PARAM_ORDER_KEY):
        trainer.pop(key, None)
    return PositionShard(model, opts, trainer)


# How the state of one model-parallel position is stored over data parallelism → its reader.
DP_FORMATS: dict[str, Callable[..., PositionShard]] = {
    "replicated": _read_replicated,
    "zero1": _read_zero1,
    "fsdp": _read_fsdp,
}


def _layout_name(meta: dict[str, Any]) -> str:
    d = meta.get("degrees", {})
    return (
        f"TP{d.get('tp', 1)}×PP{d.get('pp', 1)}×EP{d.get('ep', 1)}×DP{d.get('dp', 1)}"
        f"{' with ZeRO-1' if meta.get('zero1') else ''}{' with FSDP' if meta.get('fsdp') else ''}"
    )


def check_reshardable(path: str | os.PathLike, meta: dict[str, Any], degrees: dict[str, int], zero1: bool) -> None:
    """Raise CheckpointError (one line naming the change) when this checkpoint cannot be resharded to ``degrees``."""
    saved = meta.get("degrees", {})
    here = _layout_name(meta)
    there = _layout_name({"degrees": degrees, "zero1": zero1})
    if meta.get("format_version", 1) < 2:
        raise CheckpointError(
            f"checkpoint {path} was saved at {here} by an older nxdt (format {meta.get('format_version', 1)}) that did not record "
            f"optimizer parameter names, so it cannot be resharded to {there} — resume it on its original layout"
        )
    if dp_format(meta) not in DP_FORMATS:
        raise CheckpointError(
            f"checkpoint {path} holds {dp_format(meta)} shards, which cannot be resharded yet "
            f"(supported: {', '.join(DP_FORMATS)}) — resume it on its original layout {here}"
        )
    if saved.get(Dim.TP, 1) > 1 and not meta.get("tensor_parallel"):
        raise CheckpointError(
            f"checkpoint {path}: meta.json records no tensor-parallel layout — resume it on its original layout {here}"
        )


def _merge(name: str, pieces: dict[int, torch.Tensor], layout: dict[str, list[int]], tp: int, root: Path) -> torch.Tensor:
    """The full tensor from the pieces of every TP rank."""
    if len(pieces) != tp:
        raise CheckpointError(f"checkpoint {root}: {name} has {len(pieces)} of {tp} tensor-parallel shards")
    spec = layout.get(name[len(MODULE_PREFIX) :] if name.startswith(MODULE_PREFIX) else name)
    if spec is not None:
        dim, replicas, *full = spec  # full[0]: the true length of a padded vocabulary (padding rows trimmed)
        return trim_padding(torch.cat([pieces[r] for r in range(0, tp, replicas)], dim=dim), dim, full[0] if full else None)
    first = pieces[0]
    if first.dim() and any(not torch.equal(first, p) for p in pieces.values()):
        raise CheckpointError(
            f"checkpoint {root}: {name} differs between tensor-parallel ranks but meta.json records no layout "
            "for it — resume on the original layout"
        )
    return first


def check_consolidatable(root: Path, meta: dict[str, Any]) -> None:
    """Raise CheckpointError, one line, where :func:`read_full_state` cannot consolidate the checkpoint (``nxdt train``
    checks it before any worker starts: ``model.weight_init_only``)."""
    if dp_format(meta) not in DP_FORMATS:
        raise CheckpointError(f"checkpoint {root} holds {dp_format(meta)} shards, which cannot be consolidated yet")
    deg = meta.get("degrees", {})
    for mp in range(deg.get(Dim.TP, 1) * deg.get(Dim.PP, 1)):  # every model file the reader will open
        for ep in range(deg.get(Dim.EP, 1)):
            name = _files(meta, mp, ep)[0]
            if not (root / name).is_file():
                raise CheckpointError(f"checkpoint {root}: shard {name} is missing — the checkpoint is incomplete")


def read_full_state(path: str | os.PathLike, *, optimizer: bool = True, expect_model: dict[str, Any] | None = None) -> FullState:
    """The consolidated full state of a complete checkpoint of any supported layout (``optimizer=False``: the
    model only, e.g. for export)."""
    root = Path(path)
    verify(root, expect_model)
    meta = read_meta(root)
    check_consolidatable(root, meta)
    deg = meta.get("degrees", {})
    tp, pp, ep = deg.get(Dim.TP, 1), deg.get(Dim.PP, 1), deg.get(Dim.EP, 1)
    reader = DP_FORMATS[dp_format(meta)]
    layout = meta.get("tensor_parallel", {})
    # every (TP × PP position, EP rank): EP ranks hold the same dense tensors and each its own experts (global names)
    # each EP rank's read needs every DP rank's trainer state of its position: each file loaded once (left unchanged)
    loaded: dict[Path, Any] = {}
    positions = [(k, reader(root, meta, k, optimizer, e, loaded)) for k in range(tp * pp) for e in range(ep)]
    del loaded

    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for k, pos in positions:
        for name, tensor in pos.model.items():
            pieces.setdefault(name, {})[k % tp] = tensor
    model = {name: _merge(name, by_tp, layout, tp, root) for name, by_tp in pieces.items()}
    # the module's order where recorded: each position lists its own names in it (a stage's, an EP rank's experts)
    order = {name: i for i, name in enumerate(merged_order([pos.trainer.pop(STATE_ORDER_KEY, []) for _, pos in positions]))}
    model = dict(sorted(model.items(), key=lambda kv: order.get(kv[0], len(order))))

    optimizers = []
    for i in range(len(positions[0][1].optimizers) if optimizer else 0):
        first = positions[0][1].optimizers[i]["param_groups"]
        groups: list[dict[str, Any]] = [
            {**_hyper(g), "params": merged_order([pos.optimizers[i]["param_groups"][j]["params"] for _, pos in positions])}
            for j, g in enumerate(first)
        ]
        state_pieces: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        for k, pos in positions:
            opt = pos.optimizers[i]
            for n, entry in opt["state"].items():
                for key, value in entry.items():
                    state_pieces.setdefault(n, {}).setdefault(key, {})[k % tp] = value
        state = {}
        for n, entry in state_pieces.items():
            state[n] = {
                key: (_merge(n, by_tp, layout, tp, root) if isinstance(by_tp[0], torch.Tensor) and by_tp[0].dim() else by_tp[0])
                for key, by_tp in entry.items()
            }
        optimizers.append({"state": state, "param_groups": groups})
    return FullState(model=model, optimizers=optimizers, trainer=positions[0][1].trainer, meta=meta)


def merged_order(lists: list[list[str]]) -> list[str]:
    """One order of the names of every list that keeps each list's own order: a run of names the merge has not seen
    goes before the list's next name it has (an EP rank's experts 2, 3 after rank 0's experts 0, 1 and before the
    layer's next tensor), or at the end (a later pipeline stage's layers)."""
    merged: list[str] = []
    for names in lists:
        known = set(merged)
        run: list[str] = []
        for name in names:
            if name not in known:
                run.append(name)
                continue
            if run:
                at = merged.index(name)
                merged[at:at] = run
                known.update(run)
                run = []
        merged += run
    return merged


# ---------------------------------------------------------------------------------------------- writing one full state
ONE_RANK = {"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1}


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """``nxdt checkpoint consolidate``: write the full state of ``path`` as a one-rank checkpoint directory
    ``out`` (model.safetensors, trainer_state.pt with the unsharded optimizer state, rank 0's RNG states),
    which a one-rank run loads directly and any other layout reshards."""
    out = Path(out)
    refuse_target_inside_checkpoint(path, out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(
            f"{out} exists and is not an empty directory — name a new directory to write the consolidated checkpoint to"
        )
    full = read_full_state(path)
    indexed = [by_index(o) for o in full.optimizers]
    checkpoint = {
        **full.trainer,
        "state_dict": full.model,
        "optimizer_states": [s for s, _ in indexed],
        NAMES_KEY: [n for _, n in indexed],
        STATE_ORDER_KEY: list(full.model),  # the module's order (safetensors sorts the model file's names)
    }
    kept = {k: v for k, v in full.meta.items() if k not in ("format_version", "step", "tensor_parallel", "dp_format")}
    meta = {
        **kept,
        "degrees": dict(ONE_RANK),
        "world_size": 1,
        "zero1": False,
        "fsdp": False,
        "virtual_pipeline": 1,
        "consolidated_from": {
            "path": str(Path(path)),
            "degrees": full.meta.get("degrees"),
            "zero1": bool(full.meta.get("zero1")),
        },
    }
    rng = Path(path) / rng_file(0)
    extra = {rng_file(0): load_file(str(rng))} if rng.is_file() else None
    return save(checkpoint, out, meta=meta, extra_files=extra, write_latest=False)


# ---------------------------------------------------------------------------------------------- loading on a new layout
def load_resharded(path: str | os.PathLike, expect_model: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Lightning checkpoint dict for a run on another layout: the full model (the strategy cuts this rank's
    part, :func:`local_model_state`), optimizer states by name (see :func:`optimizer_states_for`)."""
    full = read_full_state(path, expect_model=expect_model)
    return {**full.trainer, "state_dict": full.model, "optimizer_states": full.optimizers, RESHARDED_KEY: True}


def local_model_state(
    full: dict[str, torch.Tensor], wanted: list[str], module: nn.Module, tp_rank: int
) -> dict[str, torch.Tensor]:
    """This rank's part of a full model state: the tensors named in ``wanted`` (this stage's, by state-dict name
    relative to ``module``), each cut by its TP ShardSpec."""
    missing = [name for name in wanted if name not in full]
    if missing:
        raise CheckpointError(f"the checkpoint has no tensor {missing[0]} ({len(missing)} missing) — it is from another model")
    out = {}
    for name in wanted:
        spec = shard_spec(module, name)
        out[name] = spec.slice(full[name], tp_rank).contiguous() if spec is not None else full[name]
    return out


def optimizer_states_for(
    checkpoint: dict[str, Any], optimizers: list[torch.optim.Optimizer], module: nn.Module, tp_rank: int
) -> list[dict[str, Any]]:
    """What each live optimizer's ``load_state_dict`` gets: a resharded checkpoint's state sliced for this rank;
    a same-layout checkpoint's own state, re-ordered by name where its order differs (a consolidated checkpoint)."""
    saved = checkpoint["optimizer_states"]
    if len(saved) != len(optimizers):
        raise CheckpointError(f"the checkpoint holds {len(saved)} optimizer states, this run has {len(optimizers)} optimizers")
    if checkpoint.get(RESHARDED_KEY):
        return [optimizer_state_for(s, o, module, tp_rank) for s, o in zip(saved, optimizers)]
    names = checkpoint.get(NAMES_KEY)
    out = []
    for i, (state, opt) in enumerate(zip(saved, optimizers)):
        if names is None or state.get("format") == ZERO1_FORMAT or names[i] == param_names(opt, module):
            out.append(state)
        else:
            out.append(optimizer_state_for(by_name(state, names[i]), opt, module, None))
    return out


def optimizer_state_for(
    saved: dict[str, Any], optimizer: torch.optim.Optimizer, module: nn.Module, tp_rank: int | None
) -> dict[str, Any]:
    """A by-name (full) optimizer state → torch format for ``optimizer`` on this rank: its parameters' states in
    its index order, each tensor sliced by the parameter's TP ShardSpec for ``tp_rank`` (None: no slicing)."""
    live = param_names(optimizer, module)
    params = dict(module.named_parameters())
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this run's "
            f"{len(optimizer.param_groups)} — resume with the same optimizer setup"
        )
    group_of = {n: g for g, group in enumerate(saved["param_groups"]) for n in group["params"]}
    state, groups, index = {}, [], 0
    for g, group in enumerate(optimizer.param_groups):
        indices = []
        for _ in group["params"]:
            name = live[index]
            if group_of.get(name) != g:
                raise CheckpointError(
                    f"the checkpoint's optimizer has no state for {name} in param group {g} — "
                    "it is from another model or optimizer setup"
                )
            entry = saved["state"].get(name)
            if entry is not None:
                state[index] = {key: _local(name, key, value, params[name], module, tp_rank) for key, value in entry.items()}
            indices.append(index)
            index += 1
        groups.append({**_hyper(saved["param_groups"][g]), "params": indices})
    return {"state": state, "param_groups": groups}


def _local(name: str, key: str, value: Any, param: torch.Tensor, module: nn.Module, tp_rank: int | None) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:  # step counters: never shared between parameters, since
        return value.clone() if isinstance(value, torch.Tensor) else value  # torch's Adam increments them in place
    spec = shard_spec(module, name) if tp_rank is not None else None
    if spec is not None and tp_rank is not None:
        value = spec.slice(value, tp_rank)
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointError(
            f"optimizer state '{key}' of {name} has shape {list(value.shape)} here, the parameter "
            f"{list(param.shape)} — the checkpoint is from another model"
        )
    return value
