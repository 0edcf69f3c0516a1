"""LoRA (low-rank adaptation) as a model converter: ``apply_lora(model, ...) -> model``.

Each targeted ``nn.Linear`` becomes a :class:`LoRALinear` — the original layer, frozen, as ``base_layer`` plus
two small trainable linears, ``lora_A`` [r, in] and ``lora_B`` [out, r]::

    y = base_layer(x) + scaling · lora_B(lora_A(dropout(x))),   scaling = alpha / r

``lora_A`` starts like PEFT's (kaiming-uniform, a=√5: torch's own ``nn.Linear`` init) and ``lora_B`` at zero,
so a fresh adapter leaves the model's outputs unchanged. Every other parameter of the model is frozen
(``requires_grad=False``); an optimizer built from the trainable parameters (``nxdt.lightning.optim``,
ZeRO-1, FSDP all skip frozen ones) holds the adapters only.

Module names follow PEFT's (``q_proj.base_layer``, ``q_proj.lora_A``, ``q_proj.lora_B``), so an adapter
parameter's name is PEFT's key without the adapter name and the export is a prefix away
(``nxdt.lightning.peft_export``). The base weights' names gain ``.base_layer``; load base checkpoints
(``model.hf_checkpoint``) *before* applying LoRA, or map names with :func:`base_state_dict`.

Targets (``target_modules``) use NxD Training's names — ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj`` — or Hugging Face's (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``, ``o_proj``,
``down_proj``). The hub's Llama keeps q/k/v and gate/up as separate projections (HF's layout), so
``qkv_proj`` adapts q_proj, k_proj and v_proj with one adapter each (as NxDT's LoRA on its fused layer
is exported for HF: one A/B pair per projection).

Tensor parallelism (``nxdt.parallel.tensor_parallel.LoRAParallelLinear``): ``apply_tensor_parallel`` finds
the adapter at the base layer's entry of the tensor-parallel plan and splits it by the base's style, keeping
the submodule names (so checkpoints, :func:`lora_state_dict` and the export see the same names):

* column-parallel base (q/k/v, gate/up: output rows split): ``lora_B`` is split like the base by output
  rows (same head blocks; KV replicas as the base), ``lora_A`` is replicated; A's gradient is a partial sum
  over the TP ranks (each sees only its rows of B), summed after backward with the sequence-parallel ones.
* row-parallel base (o_proj, down_proj: input columns split): ``lora_A`` is split like the base by input
  columns, ``lora_B`` is replicated; the adapter's partial output joins the base's before its one reduction
  (B is linear), and B's gradient is the partial sum summed after backward.

The adapters are small (r·(in+out) per layer); the only new communication is one all-reduce per step of
their replicated halves' gradients over TP. Any module with ``base_layer``, ``lora_A``, ``lora_B`` and
``delta_weight()`` is an adapter here (:func:`lora_layers`), the tensor-parallel one included: merging and
the adapter state work on this rank's shards.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

# NxD Training's target names → the hub's (Hugging Face's) projection names
NXDT_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
HF_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VALID_TARGETS: tuple[str, ...] = tuple(dict.fromkeys((*NXDT_TARGETS, *HF_TARGETS)))
DEFAULT_TARGETS: tuple[str, ...] = ("qkv_proj",)
BIAS_MODES: tuple[str, ...] = ("none", "all", "lora_only")


@dataclass(frozen=True)
class LoRAConfig:
    """What :func:`apply_lora` was called with; ``hf_target_modules`` are the resolved projection names."""

    rank: int
    alpha: float
    dropout: float
    bias: str
    target_modules: tuple[str, ...]
    hf_target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    """``base_layer(x) + scaling · lora_B(lora_A(dropout(x)))`` around a frozen ``nn.Linear`` (see the module
    docstring for how tensor parallelism splits it: column-parallel base → B by output rows, A replicated;
    row-parallel base → A by input columns, B replicated)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear wraps a torch.nn.Linear, got {type(base).__name__}")
        self.base_layer = base
        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.adapter_enabled = True  # False: the base layer alone (adapters_disabled)
        self.reset_lora_parameters()

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        """PEFT's default init: A kaiming-uniform (a=√5), B zero — the adapter starts as the identity change."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        """scaling · B·A, [out, in] (computed in fp32, returned in the base weight's dtype)."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (delta * self.scaling).to(self.base_layer.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return self.base_layer(x)
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}"


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Every LoRA layer of ``model`` (any with an ``adapter_enabled`` switch: this module's and the tensor-parallel
    ones) computes its base layer alone inside the block — PEFT's ``disable_adapter()``: with fresh adapters (B = 0) the
    model's starting weights, what DPO's reference is (TRL scores its reference so for a PEFT model)."""
    layers = [m for m in model.modules() if getattr(m, "adapter_enabled", None) is True]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.adapter_enabled = True


class LoRAArgumentError(ValueError):
    """A bad :func:`apply_lora` argument; ``arg`` names it (rank, alpha, dropout, bias, target_modules)."""

    def __init__(self, arg: str, message: str) -> None:
        super().__init__(message)
        self.arg = arg


def _check_args(
    rank: object, alpha: object, dropout: object, bias: object, target_modules: Iterable[str] | str
) -> tuple[str, ...]:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise LoRAArgumentError("rank", f"LoRA rank={rank!r}: must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise LoRAArgumentError("alpha", f"LoRA alpha={alpha!r}: must be a positive number")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise LoRAArgumentError("dropout", f"LoRA dropout={dropout!r}: must be in [0, 1)")
    if bias not in BIAS_MODES:
        raise LoRAArgumentError("bias", f"LoRA bias={bias!r}: use one of {', '.join(BIAS_MODES)}")
    targets = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
    if not targets:
        raise LoRAArgumentError("target_modules", f"LoRA target_modules is empty; name some of {', '.join(VALID_TARGETS)}")
    unknown = [t for t in targets if t not in VALID_TARGETS]
    if unknown:
        raise LoRAArgumentError(
            "target_modules",
            f"LoRA target_modules {unknown}: unknown; valid targets are {', '.join(VALID_TARGETS)} "
            f"(NxD Training's qkv_proj/o_proj/gate_up_proj/down_proj or Hugging Face's projection names)",
        )
    return targets


def resolve_targets(target_modules: Iterable[str] | str) -> tuple[str, ...]:
    """The hub's projection names (HF's) that ``target_modules`` (NxDT or HF names) adapt, in canonical order."""
    targets = _check_args(1, 1, 0.0, "none", target_modules)
    wanted = {leaf for t in targets for leaf in NXDT_TARGETS.get(t, (t,))}
    return tuple(name for name in HF_TARGETS if name in wanted)


def is_adapter(module: nn.Module) -> bool:
    """A LoRA adapter by the protocol :class:`LoRALinear` (and its tensor-parallel form) declares."""
    return all(isinstance(getattr(module, part, None), nn.Module) for part in ("base_layer", "lora_A", "lora_B")) and callable(
        getattr(module, "delta_weight", None)
    )


def has_lora(model: nn.Module) -> bool:
    return any(is_adapter(m) for m in model.modules())


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    bias: str = "none",
    target_modules: Iterable[str] | str = DEFAULT_TARGETS,
) -> nn.Module:
    """Replace ``model``'s targeted ``nn.Linear`` layers by :class:`LoRALinear` in place, freeze every other
    parameter, and return ``model`` (with ``model.lora_config``). ``bias``: ``none`` (all biases frozen),
    ``lora_only`` (the adapted layers' biases trainable), ``all`` (every bias trainable), as PEFT.
    Adapters are initialised from torch's global RNG (equal seeds → equal adapters on every rank)."""
    targets = _check_args(rank, alpha, dropout, bias, target_modules)
    if has_lora(model):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters; merge_lora it first")
    leaves = resolve_targets(targets)
    found = _targeted_linears(model, targets, leaves)
    _check_rank(found, rank)
    model.requires_grad_(False)
    for name, linear in found:
        parent_name, _, child = name.rpartition(".")
        layer = LoRALinear(linear, rank, float(alpha), float(dropout))
        setattr(model.get_submodule(parent_name), child, layer)
        if bias == "lora_only" and linear.bias is not None:
            linear.bias.requires_grad_(True)
    if bias == "all":
        for pname, p in model.named_parameters():
            if pname.rpartition(".")[2] == "bias":
                p.requires_grad_(True)
    model.lora_config = LoRAConfig(rank, float(alpha), float(dropout), bias, targets, leaves)
    return model


def _targeted_linears(model: nn.Module, targets: tuple[str, ...], leaves: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in leaves
    ]
    missing = [leaf for leaf in leaves if not any(name.rpartition(".")[2] == leaf for name, _ in found)]
    if missing:
        raise LoRAArgumentError(
            "target_modules", f"LoRA target_modules {list(targets)}: {type(model).__name__} has no nn.Linear named {missing}"
        )
    return found


def _check_rank(found: list[tuple[str, nn.Linear]], rank: int) -> None:
    """B·A of rank r adds nothing over a full update once r reaches min(in, out) of the layer it adapts: a larger
    rank only multiplies the adapter's memory and time (rank 100000 on hidden 128: minutes of training that
    could not learn more). Refused, naming the narrowest targeted layer."""
    name, linear = min(found, key=lambda f: min(f[1].in_features, f[1].out_features))
    widest = min(linear.in_features, linear.out_features)
    if rank > widest:
        raise LoRAArgumentError(
            "rank",
            f"LoRA rank={rank} is larger than {name} ({linear.in_features} → {linear.out_features}) can use: an adapter's "
            f"rank is at most min(in, out) = {widest}; a LoRA rank is usually 8-64",
        )


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every adapter of ``model`` (:class:`LoRALinear`, or its tensor-parallel form) by module name."""
    return [(name, m) for name, m in model.named_modules() if is_adapter(m)]


def _trainable_bias_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad and name.rpartition(".")[2] == "bias"]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only (``…lora_A.weight``, ``…lora_B.weight``, and the trainable biases when
    ``bias`` is not ``none``), detached, by their names in ``model``."""
    if not has_lora(model):
        raise ValueError(f"{type(model).__name__} has no LoRA adapters (apply_lora first)")
    names = {f"{prefix}.{part}.weight" for prefix, _ in lora_layers(model) for part in ("lora_A", "lora_B")}
    names.update(_trainable_bias_names(model))
    return {name: t.detach() for name, t in model.state_dict(keep_vars=True).items() if name in names}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights under the names of the model without adapters (``.base_layer`` dropped,
    adapter tensors left out): what ``save_lora_base`` or an HF export of the frozen base writes."""
    adapters = set(lora_state_dict(model)) - set(_trainable_bias_names(model))
    return {name.replace(".base_layer.", "."): t.detach() for name, t in model.state_dict().items() if name not in adapters}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold scaling·B·A into each adapted base weight and put the plain ``nn.Linear`` back; returns ``model``.
    Parameters keep their ``requires_grad`` (frozen) — ``model.requires_grad_(True)`` to train them all."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to merge")
    for name, layer in layers:
        base = layer.base_layer
        base.weight.add_(layer.delta_weight())  # tensor-parallel: this rank's rows / columns of B·A, as the base's
        if hasattr(layer, "input_in_region"):  # a column-parallel base enters the TP region as its adapter did
            base.input_in_region = layer.input_in_region
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, base)
    for attr in ("lora_config", "peft_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model


@torch.no_grad()
def merge_lora_state(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """:func:`merge_lora` on full (unsharded) tensors by name — e.g. gathered from a tensor-parallel / FSDP run or
    read from a consolidated checkpoint: each ``X.base_layer.weight`` becomes ``X.weight`` + scaling·B·A (fp32
    product, the base's dtype), the adapter tensors are dropped and ``.base_layer.`` leaves every other name, so
    the result loads into the model without adapters."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        prefix, sep, rest = name.partition(".base_layer.")
        if not sep:
            out[name] = tensor
            continue
        if rest == "weight":
            a, b = state.get(f"{prefix}.lora_A.weight"), state.get(f"{prefix}.lora_B.weight")
            if a is None or b is None:
                raise ValueError(f"merge_lora_state: {name} has no lora_A / lora_B tensors beside it")
            tensor = tensor + ((b.float() @ a.float()) * scaling).to(tensor.dtype)
        out[f"{prefix}.{rest}"] = tensor
    return out


# ---------------------------------------------------------------------------------------------- NxDT's peft keys
@dataclass(frozen=True)
class PeftConfig:
    """NxD Training's ``model_alignment_strategy.peft`` keys that shape the model and its checkpoints (NxDT's
    defaults). ``save_lora_base``: checkpoints hold the base weights too (False: the adapters alone; resuming
    takes the base from the model as built, e.g. ``model.hf_checkpoint``). ``merge_lora`` (with save_lora_base):
    checkpoints hold each adapted weight with scaling·B·A folded in and no adapters — a model to deploy or start
    from, not a LoRA run to resume (``nxdt.lightning.lora_checkpoint``)."""

    lora_rank: int = 16
    lora_alpha: float = 32
    lora_dropout: float = 0.05
    lora_bias: str = "none"
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    save_lora_base: bool = False
    merge_lora: bool = False

    @classmethod
    def of(cls, config: "PeftConfig | Mapping[str, Any] | Any") -> "PeftConfig":
        """From a PeftConfig, a mapping (a YAML block, OmegaConf included) or any object with these attributes;
        keys it does not know are refused by name."""
        if isinstance(config, cls):
            return config
        known = {f.name for f in fields(cls)}
        if isinstance(config, Mapping) or hasattr(config, "items"):
            values = dict(config.items())
        else:
            values = {k: getattr(config, k) for k in known if hasattr(config, k)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"peft: unknown key(s) {unknown}; known keys are {sorted(known)}")
        if "target_modules" in values:
            targets = values["target_modules"]
            values["target_modules"] = (targets,) if isinstance(targets, str) else tuple(targets)
        return cls(**values)

    @classmethod
    def pick(cls, block: "Mapping[str, Any] | Any") -> "PeftConfig":
        """The model-shaping keys of a fuller block — NxDT's whole ``model_alignment_strategy.peft`` (a mapping or an
        object with attributes): its other keys (lora_verbose, the export and merge switches) belong to the trainer."""
        get = block.get if isinstance(block, Mapping) or hasattr(block, "items") else (lambda k, d: getattr(block, k, d))
        missing = object()
        return cls.of({f.name: v for f in fields(cls) if (v := get(f.name, missing)) is not missing})


def check_peft(model: nn.Module, peft_config: "PeftConfig | Mapping[str, Any] | Any") -> PeftConfig:
    """Everything :func:`apply_peft` would refuse, without changing ``model`` — for validation before workers start
    (build the model on ``torch.device("meta")``: no memory, same module names). Returns the parsed config."""
    config = PeftConfig.of(peft_config)
    targets = _check_args(config.lora_rank, config.lora_alpha, config.lora_dropout, config.lora_bias, config.target_modules)
    _check_merge(config)
    _check_rank(_targeted_linears(model, targets, resolve_targets(targets)), config.lora_rank)
    return config


def _check_merge(config: PeftConfig) -> None:
    if config.merge_lora and not config.save_lora_base:
        raise LoRAArgumentError(
            "merge_lora",
            "LoRA merge_lora=True folds the adapters into the saved base weights: it needs "
            "save_lora_base=True (with save_lora_base=False checkpoints hold the adapters alone)",
        )


def apply_peft(model: nn.Module, peft_config: "PeftConfig | Mapping[str, Any] | Any") -> nn.Module:
    """The one entry point a training module calls right after building ``model`` (and loading its base weights),
    before any parallelism: LoRA on NxDT's ``target_modules`` with NxDT's keys (:class:`PeftConfig`), every other
    parameter frozen. Returns ``model`` with ``model.peft_config`` set (checkpoints read ``save_lora_base`` from it).
    Bad input — an unknown key, a bad value, a target module the model does not have — is a ValueError naming it."""
    config = PeftConfig.of(peft_config)
    _check_merge(config)
    apply_lora(
        model,
        rank=config.lora_rank,
        alpha=config.lora_alpha,
        dropout=config.lora_dropout,
        bias=config.lora_bias,
        target_modules=config.target_modules,
    )
    model.peft_config = config
    return model
