"""The objective registry: one :class:`ObjectiveSpec` per training objective, the one place that knows which
``model_alignment_strategy`` block selects it and everything that follows from that choice.

A spec owns its config block (``key``), the data it reads (``data_sources``, the dataset or data module it builds),
the loss ``CausalLMModule`` trains with (``objective``, :mod:`nxdt.lightning.objective`) or its own module class
(GRPO's), its metric names (metrics.csv / TensorBoard columns, and its part of the console's step line), whether it
keeps a reference model (:class:`Reference`: the meta.json key naming the weights it was taken from, checked on a
resume) and its pre-launch data check. ``nxdt train`` asks it (``cli.check_data``, ``cli.check_resume_checkpoint``,
``train.run_training``, ``exp_manager.build_callbacks``); nothing else branches on which objective runs.

Adding an objective = one spec in :data:`OBJECTIVES` (with its config block in ``nxdt/config/schema.py``) + its loss or
module + tests; ``tests/test_objective_registry.py`` checks every spec is complete and that the specs' keys are the
config's blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from nxdt.config import ConfigError
from nxdt.config.validate import TOKEN_SOURCES
from nxdt.lightning import grpo
from nxdt.lightning.checkpoint import CheckpointError, read_meta
from nxdt.lightning.datamodule import NxDDataModule, build_preference_dataset, build_sft_dataset, chat_tokenizer_dir
from nxdt.lightning.module import CausalLMModule
from nxdt.lightning.objective import CAUSAL_LM, Objective, dpo_objective, orpo_objective

ALIGNMENT = "model_alignment_strategy"


@dataclass(frozen=True)
class Reference:
    """A frozen reference model: the weights the run starts from (``model.weight_init_only``'s checkpoint, else
    ``model.hf_checkpoint``, else the seeded random initialisation: :func:`starting_weights`), taken before any
    checkpoint is restored. ``meta_key``: where a checkpoint's meta.json names them, so a resume that would start from
    other weights (a different reference: every reward and the loss change meaning) is refused before launch.
    ``needed(block)``: whether this run keeps one (GRPO: ``beta`` != 0)."""

    meta_key: str
    needed: Callable[[Any], bool]


@dataclass(frozen=True)
class ObjectiveSpec:
    """One training objective. ``key``: the ``model_alignment_strategy.<key>`` block that selects it (None:
    pretraining, chosen when no block is set); ``recipe``: the ``+recipe=`` that sets the block up."""

    name: str
    key: str | None
    recipe: str | None
    data_sources: tuple[str, ...]  # data.source values it reads
    objective: Callable[[Any], Objective]  # block → the loss CausalLMModule trains with
    metrics: Callable[[Any], tuple[str, ...]]  # block → its metrics.csv columns beyond the common ones (val_<name> too)
    console: Callable[[dict[str, Any]], str | None]  # a logged row → its part of the console's step line
    check: Callable[[Any], None]  # cfg → the pre-launch data check (ConfigError), as every worker will build the data
    datamodule: Callable[[Any, Any], pl.LightningDataModule]  # (cfg, block) → the data module
    module: type[CausalLMModule] = CausalLMModule  # the LightningModule class
    module_kwargs: Callable[[Any, int], dict[str, Any]] = lambda cfg, dp: {}  # (cfg, DP size) → its own arguments
    reference: Reference | None = None

    def block(self, cfg: Any) -> Any:
        """This objective's config block of ``cfg`` (None for pretraining)."""
        return None if self.key is None else getattr(cfg.model_alignment_strategy, self.key)

    def keeps_reference(self, cfg: Any) -> bool:
        return self.reference is not None and self.reference.needed(self.block(cfg))

    def build_module(self, cfg: Any, data_parallel_size: int, *args: Any, **kwargs: Any) -> CausalLMModule:
        """The LightningModule of a run: ``args`` / ``kwargs`` are ``CausalLMModule``'s (model config, batch sizes,
        ...), this objective's loss and its own arguments added."""
        own: dict[str, Any] = {"objective": self.objective(self.block(cfg)), **self.module_kwargs(cfg, data_parallel_size)}
        module: Callable[..., CausalLMModule] = self.module
        return module(*args, **kwargs, **own)

    def build_datamodule(self, cfg: Any) -> pl.LightningDataModule:
        return self.datamodule(cfg, self.block(cfg))


# --- data ------------------------------------------------------------------------------------------------------------
def _token_datamodule(cfg: Any, block: Any, dataset: Callable[..., Any] | None = None) -> NxDDataModule:
    """The global-batch data module; ``dataset(data_cfg, block, path, vocab_size, limit) -> (dataset, report)`` builds
    an objective's records (None: pretraining's token sources)."""
    return NxDDataModule(
        cfg.data,
        seed=cfg.seed,
        vocab_size=cfg.model.vocab_size,
        step_batches=True,
        limit_val_batches=cfg.trainer.limit_val_batches,
        dataset=None if dataset is None else functools.partial(_records_dataset, dataset, cfg.data, block, cfg.model.vocab_size),
    )


def _records_dataset(
    build: Callable[..., Any], data: Any, block: Any, vocab_size: int, path: str | None, validation: bool
) -> Dataset:
    """An objective's records at ``path`` (training: the first ``data.dev_choose_samples``), its report logged once."""
    dataset, report = build(data, block, path, vocab_size, None if validation else getattr(data, "dev_choose_samples", None))
    rank_zero_info(f"data: {report(dataset.stats, 'validation' if validation else 'train')}")
    return dataset


def _sft_records(data: Any, block: Any, path: str | None, vocab_size: int, limit: int | None) -> tuple[Any, Callable[..., str]]:
    from nxdt.data.instructions import sft_report

    return build_sft_dataset(data, block, path, vocab_size, limit=limit), sft_report


def _preference_records(
    data: Any, block: Any, path: str | None, vocab_size: int, limit: int | None
) -> tuple[Any, Callable[..., str]]:
    from nxdt.data.preferences import preference_report

    return build_preference_dataset(data, block, path, vocab_size, limit=limit), preference_report


# --- pre-launch checks -------------------------------------------------------------------------------------------------
def _no_check(cfg: Any) -> None:
    """Pretraining's token sources are checked by source in ``cli.check_data`` (files, tokenizer, memory)."""


def _check_chat_tokenizer(cfg: Any) -> None:
    from nxdt.data.instructions import build_chat_tokenizer

    try:
        build_chat_tokenizer(chat_tokenizer_dir(cfg.data.tokenizer))
    except (ValueError, OSError, RuntimeError) as exc:
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, str(exc)) from None


def _records_or_config_error(cfg: Any, key: str, path: Any, build: Callable[[], Any]) -> Any:
    from nxdt.data.instructions import ChatTemplateError

    try:
        return build()
    except ChatTemplateError as exc:  # the tokenizer's template is at fault, not the records
        raise ConfigError("data.tokenizer", cfg.data.tokenizer, str(exc)) from None
    except (ValueError, OSError, RuntimeError) as exc:
        raise ConfigError(key, path, str(exc)) from None


def check_one_global_batch(cfg: Any, key: str, path: Any, samples: int, what: str) -> None:
    """Fewer samples than one global batch: every step would hold some of them several times (the sampler's epochs
    follow each other inside a batch), which no one asking for that batch size means."""
    if samples < cfg.data.global_batch_size:
        raise ConfigError(
            key,
            path,
            f"holds {samples} {what}, fewer than one global batch (data.global_batch_size={cfg.data.global_batch_size}): "
            "every step would repeat them; give more data or a data.global_batch_size of at most "
            f"{samples} (a multiple of micro_batch_size × data-parallel ranks)",
        )


def _check_instructions(cfg: Any) -> None:
    """Instruction records (SFT) are read and built here as every worker will (tokenized, masked, packed or padded,
    truncated), so a bad record, a tokenizer without EOS or an empty file is one line before any worker starts, and
    the user hears once how many records were cut or dropped."""
    from nxdt.data.instructions import sft_report

    data, sft = cfg.data, cfg.model_alignment_strategy.sft
    _check_chat_tokenizer(cfg)
    for key, path, limit in (("data.train_dir", data.train_dir, data.dev_choose_samples), ("data.val_dir", data.val_dir, None)):
        if path is None and key == "data.val_dir":
            continue
        dataset = _records_or_config_error(
            cfg, key, path, lambda: build_sft_dataset(data, sft, path, cfg.model.vocab_size, limit=limit)
        )
        if key == "data.train_dir":
            check_one_global_batch(cfg, key, path, len(dataset), "sequences after packing" if sft.packing else "records")
        print(f"nxdt: {sft_report(dataset.stats, 'train' if key == 'data.train_dir' else 'validation')}", flush=True)


def _check_preferences(key: str) -> Callable[[Any], None]:
    def check(cfg: Any) -> None:
        """Preference records (DPO, ORPO) are read, tokenized and truncated here as every worker will, so a record
        with a missing or empty prompt/chosen/rejected is one line before any worker starts; the counts printed once."""
        from nxdt.data.preferences import preference_report

        data, block = cfg.data, getattr(cfg.model_alignment_strategy, key)
        _check_chat_tokenizer(cfg)
        dataset = _records_or_config_error(
            cfg,
            "data.train_dir",
            data.train_dir,
            lambda: build_preference_dataset(data, block, data.train_dir, cfg.model.vocab_size, limit=data.dev_choose_samples),
        )
        check_one_global_batch(cfg, "data.train_dir", data.train_dir, len(dataset), "preference pairs")
        print(f"nxdt: {preference_report(dataset.stats)}", flush=True)

    return check


def _check_grpo(cfg: Any) -> None:
    """GRPO (``grpo.check``): layout, batch and sampling settings, the prompt records, and each reward function — the
    user's own code named in the config — imported and its signature checked."""
    from nxdt.planner import plan

    try:
        grpo.check(cfg, plan(cfg).dp)
    except grpo.GRPOConfigError as exc:
        raise ConfigError(exc.key, exc.value, exc.fix) from None


# --- console ----------------------------------------------------------------------------------------------------------
def _no_console(row: dict[str, Any]) -> str | None:
    return None


def _pair_console(row: dict[str, Any]) -> str | None:
    if row.get("rewards/accuracies") is None:  # a step whose pairs all fell on other ranks' stages: nothing to show
        return None
    return f"reward acc {row['rewards/accuracies']:.2f} margin {row['rewards/margins']:.4f}"


def _grpo_console(row: dict[str, Any]) -> str | None:
    if row.get("completions/mean_length") is None:
        return None
    kl = f" kl {row['kl']:.4f}" if row.get("kl") is not None else ""
    return f"reward {row['reward']:.3f} ± {row['reward_std']:.3f}{kl} len {row['completions/mean_length']:.1f}"


def _grpo_module_kwargs(cfg: Any, data_parallel_size: int) -> dict[str, Any]:
    """GRPO's module arguments: its block, the prompt data and the reward functions, imported again in every worker
    (the launcher imported and checked them; nothing else names code)."""
    return {"grpo": cfg.model_alignment_strategy.grpo, "data": cfg.data, "reward_funcs": grpo.check(cfg, data_parallel_size)}


def _none(block: Any) -> tuple[str, ...]:
    return ()


PRETRAINING = ObjectiveSpec(
    name="pretraining",
    key=None,
    recipe=None,
    data_sources=TOKEN_SOURCES,
    objective=lambda block: CAUSAL_LM,
    metrics=_none,
    console=_no_console,
    check=_no_check,
    datamodule=_token_datamodule,
)
SFT = ObjectiveSpec(
    name="sft",
    key="sft",
    recipe="sft",
    data_sources=("instructions",),
    objective=lambda block: CAUSAL_LM,  # the same token mean; the records mask prompts with -100
    metrics=_none,
    console=_no_console,
    check=_check_instructions,
    datamodule=functools.partial(_token_datamodule, dataset=_sft_records),
)
DPO = ObjectiveSpec(
    name="dpo",
    key="dpo",
    recipe="dpo",
    data_sources=("preferences",),
    objective=dpo_objective,
    metrics=lambda block: dpo_objective(block).metrics,
    console=_pair_console,
    check=_check_preferences("dpo"),
    datamodule=functools.partial(_token_datamodule, dataset=_preference_records),
    # "dpo_reference": the name DPO checkpoints have carried since DPO was added (they stay resumable)
    reference=Reference("dpo_reference", lambda block: True),
)
ORPO = ObjectiveSpec(
    name="orpo",
    key="orpo",
    recipe="orpo",
    data_sources=("preferences",),
    objective=orpo_objective,
    metrics=lambda block: orpo_objective(block).metrics,
    console=_pair_console,
    check=_check_preferences("orpo"),
    datamodule=functools.partial(_token_datamodule, dataset=_preference_records),
)
GRPO = ObjectiveSpec(
    name="grpo",
    key="grpo",
    recipe="grpo",
    data_sources=("prompts",),
    objective=lambda block: CAUSAL_LM,  # unused by GRPOModule's own step; sizes tokens_per_step as one sequence a sample
    metrics=grpo.metric_names,
    console=_grpo_console,
    check=_check_grpo,
    datamodule=lambda cfg, block: grpo.PromptDataModule(cfg.data, block, cfg.seed),
    module=grpo.GRPOModule,
    module_kwargs=_grpo_module_kwargs,
    reference=Reference("grpo_reference", lambda block: block.beta != 0.0),
)

OBJECTIVES: tuple[ObjectiveSpec, ...] = (PRETRAINING, SFT, DPO, ORPO, GRPO)


def objective_spec(cfg: Any) -> ObjectiveSpec:
    """The objective ``cfg.model_alignment_strategy`` selects: the spec whose block is set (``peft`` adapts any of
    them and selects none), pretraining when none is; two blocks set is a :class:`ConfigError` naming both."""
    alignment = getattr(cfg, ALIGNMENT, None)
    chosen = [s for s in OBJECTIVES if s.key is not None and getattr(alignment, s.key, None) is not None]
    if len(chosen) > 1:
        raise ConfigError(
            f"{ALIGNMENT}.{chosen[1].key}",
            "",
            f"{ALIGNMENT}.{chosen[0].key} is set too; one objective per run (remove one block)",
        )
    return chosen[0] if chosen else PRETRAINING


def check_launch(cfg: Any) -> ObjectiveSpec:
    """Before any worker starts: the objective reads ``data.source`` (else one line naming the objective that
    does, or the sources this one reads), then its own data check. Returns the spec."""
    spec = objective_spec(cfg)
    source = cfg.data.source
    if source not in spec.data_sources:
        owner = next((s for s in OBJECTIVES if source in s.data_sources), None)
        if owner is not None and owner.key is not None:
            raise ConfigError(
                "data.source",
                source,
                f"{source} records are read by {owner.name.upper()}: add {ALIGNMENT}.{owner.key} (+recipe={owner.recipe})",
            )
        reads = " | ".join(spec.data_sources)
        raise ConfigError("data.source", source, f"{ALIGNMENT}.{spec.key} reads {reads} records: set data.source={reads}")
    spec.check(cfg)
    return spec


# --- the reference model across resumes ---------------------------------------------------------------------------------
def starting_weights(cfg: Any) -> str:
    """The weights a run starts from, in words: ``model.weight_init_only``'s checkpoint, else ``model.hf_checkpoint``,
    else the random initialisation its seed and init scale determine — a reference model is exactly these weights."""
    em, model = cfg.exp_manager, cfg.model
    if model.weight_init_only and em.resume_from_checkpoint is not None:
        return f"checkpoint {Path(em.resume_from_checkpoint).expanduser().resolve()}"
    if model.hf_checkpoint is not None:
        return f"hf_checkpoint {Path(model.hf_checkpoint).expanduser().resolve()}"
    return f"random initialisation (seed {cfg.seed}, model.init_method_std {model.init_method_std})"


def reference_meta(cfg: Any) -> dict[str, str]:
    """What the run's checkpoints record of its reference model (meta.json), {} without one."""
    spec = objective_spec(cfg)
    if not spec.keeps_reference(cfg):
        return {}
    assert spec.reference is not None  # keeps_reference
    return {spec.reference.meta_key: starting_weights(cfg)}


def check_resume_reference(cfg: Any, path: str | Path) -> None:
    """A run with a reference model resuming ``path`` (not ``weight_init_only``) takes the reference from the weights it
    starts from as configured, which must be those the checkpoint's run took it from; otherwise every reward and the
    loss change meaning silently. One line naming both (CheckpointError)."""
    spec = objective_spec(cfg)
    if not spec.keeps_reference(cfg) or cfg.model.weight_init_only:
        return
    assert spec.reference is not None  # keeps_reference
    name = spec.name.upper()
    theirs, mine = read_meta(path).get(spec.reference.meta_key), starting_weights(cfg)
    if theirs == mine:
        return
    if theirs is None:
        raise CheckpointError(
            f"checkpoint {path} is not a {name} run's with a reference model, so it cannot be resumed as one ({name}'s "
            f"reference model would be this run's {mine}); start {name} from its weights with model.weight_init_only=true"
        )
    raise CheckpointError(
        f"checkpoint {path} was trained by {name} against the reference {theirs}; resumed here, the reference would be "
        f"{mine}: continue that run where it ran (exp_manager.resume_if_exists=true in its run directory), or start "
        "this run from its weights with model.weight_init_only=true (a new reference)"
    )
