"""``CausalLMModule``: the LightningModule ``nxdt train`` drives — a model-hub model, next-token loss,
optimizer and schedule from ``model.optim``.

One Lightning step is one global batch, as in NxDT: the batch is this rank's share of it, split into
``micro_batch_size`` pieces inside the step. The step's loss — its ``objective`` (:mod:`nxdt.lightning.objective`;
``nxdt.lightning.registry`` picks it from ``model_alignment_strategy``): the mean over every labelled token of the global batch, whichever micro-batch and
data-parallel rank holds it — is published in ``step_metrics`` for the experiment manager; after a validation
(``data.val_dir``), ``val_metrics`` holds ``val_loss``, token-weighted over the whole validation set (DPO/ORPO: the mean
over its pairs, with the objective's metrics as ``val_<name>``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import functools
import math
from typing import Any, Iterator

import torch
import lightning.pytorch as pl
from torch.utils.data import Dataset, Subset, default_collate

from nxdt.config.validate import ALLOWED_MODEL_PREFIX
from nxdt.lightning.datamodule import EpochLimit
from nxdt.lightning.hf import load_hf_weights
from nxdt.data.preferences import pair_rows
from nxdt.lightning.objective import (
    CAUSAL_LM,
    Objective,
    label_count,
    pair_means,
    pair_scores_and_aux,
    pair_sums,
    sequence_log_prob_sums,
    token_weights,
)
from nxdt.lightning.optim import build_optimizer, build_scheduler
from nxdt.models.lora import adapters_disabled, apply_peft
from nxdt.parallel import squared_norm
from nxdt.parallel.context_parallel import shard_micro_batches, weight_by_token_share
from nxdt.parallel.expert_parallel import copy_expert_marks


def import_architecture(path: str) -> type:
    """Import a model class by its dotted path; only the model hub may be named (a config is not code)."""
    if not path.startswith(ALLOWED_MODEL_PREFIX):
        raise ValueError(f"model.architecture={path!r}: only classes under {ALLOWED_MODEL_PREFIX} may be named")
    module_name, _, class_name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model.architecture={path!r} cannot be imported ({exc})") from exc


def read_checkpoint_weights(path: str, expect_model: dict[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The full model tensors of an nxdt checkpoint of any layout by hub-model name, and its LoRA kind
    (:func:`nxdt.lightning.lora_checkpoint.lora_kind`); a merged checkpoint's names are the plain model's."""
    from nxdt.lightning.lora_checkpoint import lora_kind, plain_names
    from nxdt.lightning.reshard import MODULE_PREFIX, read_full_state

    full = read_full_state(path, optimizer=False, expect_model=expect_model).model
    state = {name[len(MODULE_PREFIX) :]: tensor for name, tensor in full.items() if name.startswith(MODULE_PREFIX)}
    kind = lora_kind(path)
    return (plain_names(state) if kind == "merged" else state), kind


def load_checkpoint_weights(
    model: torch.nn.Module,
    path: str,
    expect_model: dict[str, Any] | None = None,
    *,
    state: dict[str, torch.Tensor] | None = None,
    adapters_only: bool = False,
) -> None:
    """``model.weight_init_only``: the model weights of an nxdt checkpoint of any layout (consolidated on every
    rank; parallelism slices them later, as for Hugging Face weights) — no optimizer state, no step. ``state``: the
    tensors already read (:func:`read_checkpoint_weights`); ``adapters_only``: they are a LoRA model's adapters alone
    (the base is the model's own weights as built), every adapter of the model must be among them."""
    if state is None:
        state, _ = read_checkpoint_weights(path, expect_model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if not (n == "lm_head.weight" and getattr(model, "tied", False))]
    if adapters_only:
        missing = [n for n in missing if ".lora_A." in n or ".lora_B." in n]
    if missing or unexpected:
        raise ValueError(
            f"exp_manager.resume_from_checkpoint={path}: its model does not match this one (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]})"
        )


def split_micro_batches(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """This rank's share of a global batch cut into micro-batches of ``size`` rows, every tensor field alike
    (``input_ids``, ``labels`` and whatever else the data carries: ``position_ids``, ``segment_ids``, ...)."""
    fields = {name: value.split(size) for name, value in batch.items() if isinstance(value, torch.Tensor)}
    count = len(fields["input_ids"])
    return [{name: parts[i] for name, parts in fields.items()} for i in range(count)]


NAN_POLICIES = ("stop", "skip_step")
MAX_CONSECUTIVE_SKIPS = 10  # skip_step: a run whose every update is non-finite stops instead of spinning forever


class NonFiniteLossError(RuntimeError):
    """The step's loss or gradient norm is NaN/inf and ``exp_manager.nan_policy`` says stop (or too many skips)."""


class CausalLMModule(pl.LightningModule):
    """Next-token training of a model-hub model with manual optimization: each Lightning batch is this
    rank's share of one global batch; the step splits it into micro-batches, lets the strategy run
    forward and backward over them (a plain loop, or a pipeline schedule under PP), finishes the
    gradients (data-parallel reduction, clipping by the global norm), and steps the optimizer once."""

    def __init__(
        self,
        model_cfg: Any,
        global_batch_size: int,
        seq_length: int,
        micro_batch_size: int,
        gradient_clip_val: float | None = None,
        *,
        log_gradient_norm: bool = False,
        log_parameter_norm: bool = False,
        nan_policy: str = "stop",
        precision: str = "fp32",
        seed: int = 0,
        objective: Objective = CAUSAL_LM,
        init_checkpoint: str | None = None,
        peft: Any = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False  # one optimizer step per global batch, whatever the schedule
        self.model_cfg = model_cfg
        self.model = import_architecture(model_cfg.architecture)(model_cfg)
        if getattr(model_cfg, "hf_checkpoint", None):  # every rank loads the full weights; parallelism slices them later
            load_hf_weights(self.model, model_cfg.hf_checkpoint, model_cfg.architecture)
        init_state, init_kind = read_checkpoint_weights(init_checkpoint) if init_checkpoint is not None else (None, None)
        has_adapters = init_kind in ("with_base", "adapters_only")
        if init_checkpoint is not None and not has_adapters:  # model.weight_init_only: another run's weights, step 0
            load_checkpoint_weights(self.model, init_checkpoint, state=init_state)
        if peft is not None:  # LoRA (NxDT's peft keys: nxdt.models.lora.PeftConfig) on the full model, before any parallelism
            apply_peft(self.model, peft)
        # fresh adapters (B = 0): the starting weights are the base alone, which the policy computes with its adapters
        # switched off — DPO's reference without a frozen copy (TRL's for a PEFT model)
        self._fresh_adapters = peft is not None and not has_adapters
        if init_checkpoint is not None and has_adapters:  # load_lora_from_ckpt: a LoRA run's adapters (and base, unless
            if peft is None:  # it saved the adapters alone)
                raise ValueError(
                    f"exp_manager.resume_from_checkpoint={init_checkpoint} holds LoRA adapters: configure "
                    "model_alignment_strategy.peft to continue from them"
                )
            load_checkpoint_weights(self.model, init_checkpoint, state=init_state, adapters_only=init_kind == "adapters_only")
        # the loss each micro-batch contributes: the run's objective spec's (nxdt.lightning.registry), pretraining's by default
        self.objective = objective
        # a preference sample is a pair: two sequences
        self.tokens_per_step = global_batch_size * seq_length * (2 if self.objective.pairs else 1)
        self.micro_batch_size = micro_batch_size
        self.gradient_clip_val = gradient_clip_val
        self.log_gradient_norm, self.log_parameter_norm = log_gradient_norm, log_parameter_norm
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy={nan_policy!r}: use one of {NAN_POLICIES}")
        self.nan_policy = nan_policy
        self.precision_type, self.seed = precision, seed  # the optimizer's kind (bf16SR: stochastic rounding) and its key
        self.skipped_steps = 0  # consecutive updates skipped for a non-finite loss or gradient norm
        self.inject_nan = False  # set by exp_manager.fault_injection.kind=nan: this step's loss becomes NaN
        self.step_metrics: dict[str, float] = {}
        self.val_metrics: dict[str, float] = {}  # after each validation: val_loss (token-weighted over data.val_dir)
        self._val_sums = self._no_val_sums()  # this rank's validation sums (:meth:`_no_val_sums`)
        self._host_label_counts: list[int] | None = None  # the next training batch's, per micro-batch (host memory)
        # a frozen copy of the starting weights (DPO without precomputed reference log-probabilities, GRPO with beta),
        # held outside the module tree (a list): in no checkpoint, no state_dict, no optimizer; a resume takes it from
        # the starting weights again (registry.Reference)
        self._reference: list[torch.nn.Module] = []

    @property
    def reference(self) -> torch.nn.Module | None:
        return self._reference[0] if self._reference else None

    @contextlib.contextmanager
    def reference_scope(self) -> Iterator[torch.nn.Module]:
        """The model that scores as the starting weights, in eval mode and without gradients: the frozen copy, or with
        fresh LoRA adapters the policy with its adapters off."""
        model = self.reference
        scope: Any = contextlib.nullcontext()
        if model is None:
            model, scope = self.model, adapters_disabled(self.model)
        training = model.training
        model.eval()
        try:
            with scope, torch.no_grad():
                yield model
        finally:
            model.train(training)

    def wants_frozen_reference(self) -> bool:
        """Whether the objective scores with a frozen copy of the starting weights during training (DPO with
        ``precompute_ref_log_probs: false``, unless fresh LoRA adapters make the policy with its adapters off that
        reference; GRPO's own rule in its module)."""
        return self.objective.online_reference and not self._fresh_adapters

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        strategy = self.trainer.strategy
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        micro_batches = self._weigh(self._lay_out(split_micro_batches(batch, self.micro_batch_size)))
        optimizer.zero_grad()
        run = getattr(strategy, "forward_backward", None)
        loss = run(self, micro_batches) if run else self._forward_backward(micro_batches)
        if self.inject_nan:  # a drill: this rank's loss overflowed
            loss, self.inject_nan = torch.full_like(loss, math.nan), False
        finish = getattr(strategy, "finish_gradients", None)
        if finish:
            finish()
        extra: dict[str, float] = {}
        grad_norm = None
        if self.gradient_clip_val or self.log_gradient_norm:
            clip = getattr(strategy, "clip_grad_norm", None)
            params = [p for p in self.model.parameters() if p.grad is not None]
            limit = self.gradient_clip_val or math.inf  # inf: measure the norm, clip nothing
            grad_norm = clip(limit) if clip else torch.nn.utils.clip_grad_norm_(params, limit)
        if self.log_parameter_norm:
            norm = getattr(strategy, "parameter_norm", None)
            extra["param_norm"] = float(
                norm() if norm else torch.stack([squared_norm(p) for p in self.model.parameters()]).sum().sqrt()
            )
        # the mean over every rank: NaN anywhere is NaN everywhere, so all ranks take the same branch below
        step_loss = strategy.reduce(loss.detach().to(torch.float32, copy=True), reduce_op="mean")  # in place, as DDP's
        # the host reads both once, here (on a GPU: waiting for the backward, as the NaN policy must before the update)
        # and never again this step: a second read after optimizer.step() would wait for the update too, leaving the
        # GPU idle while the host prepares the next step
        loss_value = float(step_loss)
        norm_value = None if grad_norm is None else float(grad_norm)
        if self.log_gradient_norm and norm_value is not None:
            extra["grad_norm"] = norm_value
        if not self._finite_step(loss_value, norm_value, loss):
            optimizer.zero_grad()
            return step_loss
        lr = optimizer.param_groups[0]["lr"]  # the rate this step applies (the schedule steps after it)
        optimizer.step()
        scheduler.step()
        stats = getattr(strategy, "step_stats", None)  # e.g. FSDP's exposed communication and gathered memory
        self.step_metrics = {
            "step": self.trainer.global_step,
            "loss": loss_value,
            "lr": lr,
            **extra,
            **(stats() if stats else {}),
            **self._objective_metrics(micro_batches),
        }
        # for callbacks (callback_metrics["loss"]); on the progress bar only when one is shown: Lightning reads every
        # progress-bar value on the host each step (shown or not), which on a GPU waits for the update to finish
        bar = self.trainer.progress_bar_callback
        self.log("loss", step_loss, prog_bar=bar is not None and bar.is_enabled, logger=False)
        return step_loss

    def _finite_step(self, step_loss: float, grad_norm: float | None, local_loss: torch.Tensor) -> bool:
        """Whether this step's update may be applied (``exp_manager.nan_policy``): a NaN/inf loss or global
        gradient norm stops the run (``stop``) or skips the update (``skip_step``, at most
        ``MAX_CONSECUTIVE_SKIPS`` in a row). Both values are global, so every rank decides alike."""
        bad = {
            name: value
            for name, value in (("loss", step_loss), ("gradient norm", grad_norm))
            if value is not None and not math.isfinite(value)
        }
        if not bad:
            self.skipped_steps = 0
            return True
        step = self.trainer.global_step + 1
        # which ranks' own losses went non-finite (every rank is in this branch: the gather is collective)
        flags = self.trainer.strategy.all_gather(torch.isfinite(local_loss.detach().float()).reshape(1))
        sources = [r for r, ok in enumerate(flags.reshape(-1).tolist()) if not ok]
        where = f"rank{'s' if len(sources) > 1 else ''} {', '.join(map(str, sources))}" if sources else "the gradients"
        what = " and ".join(f"{name} {value}" for name, value in bad.items())
        self.skipped_steps += 1
        if self.nan_policy == "skip_step" and self.skipped_steps <= MAX_CONSECUTIVE_SKIPS:
            if self.trainer.is_global_zero:
                print(f"nxdt: step {step}: {what} (from {where}) — update skipped (exp_manager.nan_policy=skip_step)", flush=True)
            return False
        reason = (
            f"{MAX_CONSECUTIVE_SKIPS} consecutive steps were skipped"
            if self.nan_policy == "skip_step"
            else "exp_manager.nan_policy=stop"
        )
        raise NonFiniteLossError(
            f"non-finite {what} at step {step} (from {where}; {reason}); the newest "
            "checkpoint holds the last finite state — lower model.optim.lr, set "
            "trainer.gradient_clip_val, or use exp_manager.nan_policy=skip_step"
        )

    def _forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Gradient of the mean loss over the micro-batches (one process, no model parallelism); each micro-batch's
        loss scaled by its ``loss_weight`` (:meth:`_weigh`)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # where the losses are (CPU or this rank's GPU)
        for mb in micro_batches:
            logits = self.model(mb["input_ids"], mb.get("position_ids"), mb.get("segment_ids"))
            loss = self.objective.loss(self.model, logits, mb)
            # context parallelism: this rank's share of the sequence's token mean (unchanged without CP)
            loss = weight_by_token_share(loss, mb)
            if "loss_weight" in mb:  # the micro-batch's share of the global batch's labelled tokens
                loss = loss * mb["loss_weight"].to(loss.dtype)
            loss = loss / len(micro_batches)
            self.manual_backward(loss)
            total += loss.detach().double()
        return total

    # --- preference objectives (DPO, ORPO) -----------------------------------------------------------------
    def _lay_out(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Preference pairs as the model reads them (chosen rows, then rejected rows); other data unchanged."""
        if not self.objective.pairs:
            return micro_batches
        laid_out = [pair_rows(mb) for mb in micro_batches]
        if self.objective.reference and any("ref_logps" not in mb for mb in laid_out):
            if self.reference is None and not (self.objective.online_reference and self._fresh_adapters):
                raise RuntimeError(
                    f"the {self.objective.name.upper()} objective needs the reference model's log-probabilities "
                    "in every batch: fit with NxDDataModule on preference data (on_fit_start precomputes them)"
                )
            for mb in laid_out:
                mb["ref_logps"] = self._reference_log_probs(mb)
        return laid_out

    def _reference_log_probs(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[pairs, 2]: each pair's chosen and rejected log π_ref(y|x) under the starting weights, forward only — what
        :meth:`precompute_reference` stores, computed for this micro-batch (``precompute_ref_log_probs: false``): by
        the frozen copy, or with fresh LoRA adapters by the policy with its adapters off, in eval mode. Under CP the
        attention is the ring: this rank's chunks are scored and the sums add up over the group."""
        part = micro_batch
        cp = getattr(self.trainer.strategy, "communicators", {}).get("cp")
        if cp is not None and cp.size > 1:
            part = shard_micro_batches([micro_batch], cp, token_share=False)[0]
        with self.reference_scope() as reference, self.trainer.precision_plugin.val_step_context():
            logits = reference(part["input_ids"], part.get("position_ids"), part.get("segment_ids"))
            sums = sequence_log_prob_sums(reference, logits, part).double()
        pairs = sums.shape[0] // 2
        return torch.stack([sums[:pairs], sums[pairs:]], dim=1)

    def _objective_metrics(self, micro_batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """The objective's metrics (DPO/ORPO: rewards/...) as means over every pair of the global batch: the micro-batches'
        sums added over all ranks (TP copies and pipeline stages without the loss count alike in sums and pairs)."""
        names = self.objective.metrics
        if not names:
            return {}
        sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.device)  # where metric_sums are
        for mb in micro_batches:
            if "metric_sums" in mb:  # only where the loss was computed (PP: the last stage)
                sums += mb["metric_sums"]
        sums = self.trainer.strategy.reduce(sums, reduce_op="sum").double()
        pairs = float(sums[-1])
        # a NaN metric has no value on this model (aux_loss of a dense one): an empty column, as GRPO's
        means = {name: float(value) / pairs for name, value in zip(names, sums[:-1])} if pairs else {}
        return {name: value for name, value in means.items() if not math.isnan(value)}

    def on_fit_start(self) -> None:
        shard = getattr(self.trainer.strategy, "shard_frozen", None)
        if self._reference and shard is not None:  # the frozen copy laid out over DP as the policy (FSDP: its own units)
            self._reference[0] = shard(self._reference[0])
        if self.objective.reference and not self.objective.online_reference:
            self.precompute_reference()

    def precompute_reference(self) -> None:
        """DPO's reference: the per-sequence log-probabilities of every training and validation pair under the weights
        the run starts from (the initial model; a resumed run's checkpoint is restored only after this hook), computed
        once by this very model — sharded like the policy on every layout — forward only. A held-out split
        (``data.val_split``) shares its dataset with training: that dataset is scored once, whole."""
        datamodule = getattr(self.trainer, "datamodule", None)
        datasets: list[Dataset] = []
        for dataset in (getattr(datamodule, "dataset", None), getattr(datamodule, "val_dataset", None)):
            base = dataset.dataset if isinstance(dataset, Subset) else dataset
            if base is not None and all(base is not d for d in datasets):
                datasets.append(base)
        if not datasets or not all(hasattr(d, "set_reference_log_probs") for d in datasets):
            raise RuntimeError(
                "DPO precomputes the reference log-probabilities of the training pairs: fit with "
                "NxDDataModule and data.source=preferences"
            )
        for dataset in datasets:
            self._store_reference(dataset)

    def _store_reference(self, dataset: Any) -> None:
        """Each data-parallel rank scores an equal slice of ``dataset``'s pairs (the last padded with pair 0, whose scores
        are dropped, so every rank runs the same forwards); the table [pairs, 2] is summed over data parallelism (each
        pair scored by one rank, zeros elsewhere) and stored in the dataset, which attaches each pair's row to its
        samples in any order."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"rank": 0, "num_replicas": 1}
        rank, size, b = int(kwargs["rank"]), int(kwargs["num_replicas"]), self.micro_batch_size
        n = len(dataset)
        per_rank = -(-(-(-n // size)) // b) * b  # ceil(n / size), rounded up to whole micro-batches
        indices = list(range(rank * per_rank, (rank + 1) * per_rank))
        micro_batches = [
            {
                k: v.to(self.device)
                for k, v in pair_rows(default_collate([dataset[i if i < n else 0] for i in indices[k : k + b]])).items()
            }
            for k in range(0, per_rank, b)
        ]
        training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.trainer.precision_plugin.val_step_context():
            scores = self.sequence_scores(micro_batches)  # [micro-batches, 2b]: chosen rows then rejected rows
        self.model.train(training)
        scores = scores.cpu()  # the table lives with the dataset, in host memory: one copy from the device
        table = torch.zeros(n, 2, dtype=torch.float64)
        for k, row in enumerate(scores):
            for j, i in enumerate(indices[k * b : (k + 1) * b]):
                if i < n:
                    table[i] = torch.stack([row[j], row[b + j]])
        dataset.set_reference_log_probs(self._data_parallel_sum(table))

    def sequence_scores(
        self, micro_batches: list[dict[str, torch.Tensor]], fn: Any = sequence_log_prob_sums, per_row: int = 1
    ) -> torch.Tensor:
        """Forward only: ``fn(model, logits, micro_batch)`` of each micro-batch, ``per_row`` values per row flattened
        (default: every row's summed label log-probability), [len(micro_batches), per_row · rows]; the strategy runs it
        (a pipeline: the last stage scores, every stage gets the result)."""
        run = getattr(self.trainer.strategy, "score", None)
        width = micro_batches[0]["input_ids"].shape[0] * per_row
        flat = functools.partial(_flattened, fn)
        if run:
            return run(self, micro_batches, flat, width)
        return self.score_locally(micro_batches, flat)

    def score_locally(self, micro_batches: list[dict[str, torch.Tensor]], fn: Any) -> torch.Tensor:
        """``fn(model, logits, micro_batch)`` of each micro-batch, forward only on this rank's model (no pipeline)."""
        rows = []
        with torch.no_grad():
            for mb in micro_batches:
                logits = self.model(mb["input_ids"], mb.get("position_ids"), mb.get("segment_ids"))
                rows.append(fn(self.model, logits, mb).double())
        return torch.stack(rows)

    # --- loss weighting and validation -------------------------------------------------------------------
    def _data_parallel_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the data-parallel group (ranks of one TP/PP group hold the same batch)."""
        strategy = self.trainer.strategy
        group = getattr(strategy, "communicators", {}).get("dp")
        if group is None:  # another strategy: every rank a data-parallel replica
            return strategy.reduce(values, reduce_op="sum")
        out = values.clone()
        if group.size > 1:
            group.all_reduce(out.reshape(-1), op="sum")  # in the values' own dtype (float64 sums stay exact-ish)
        return out

    def _data_parallel_size(self) -> int:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        return int(kwargs["num_replicas"]) if kwargs else 1

    @property
    def _token_weighted(self) -> bool:
        """Whether each micro-batch's loss is weighted by its labelled tokens (:meth:`_weigh`)."""
        return self.objective.token_weighted and getattr(self.model_cfg, "loss_averaging", "tokens") != "micro_batches"

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count each training micro-batch's labelled tokens (:meth:`_weigh`) while the batch is still in host memory:
        counted on a GPU, the count would make the host wait for the previous step's update before it could queue
        this step's forward."""
        self._host_label_counts = None
        if (
            self.trainer.training
            and self._token_weighted
            and isinstance(batch, dict)
            and isinstance(batch.get("labels"), torch.Tensor)
        ):
            if batch["labels"].device.type == "cpu":
                self._host_label_counts = [label_count(part) for part in batch["labels"].split(self.micro_batch_size)]
        return batch

    def _weigh(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Give every micro-batch its ``loss_weight`` (a 0-d tensor): its share of the global batch's labelled
        tokens, so the step's loss is the token mean over the whole global batch (nxdt.lightning.objective).
        ``model.loss_averaging: micro_batches`` leaves them unweighted: the plain mean of the micro-batches' token
        means over micro-batches and DP ranks, NxD Training's loss. A token-mean term of a preference objective (ORPO's
        NLL, DPO's sft): its ``nll_scale`` (micro-batches × DP ranks / the global batch's tokens of that term)."""
        count = self.objective.token_count
        if count is not None:  # ORPO's NLL, DPO's sft: token means over the global batch
            tokens = sum(count(mb) for mb in micro_batches)
            total = int(self._data_parallel_sum(torch.tensor([tokens], dtype=torch.int64))[0])
            scale = len(micro_batches) * self._data_parallel_size() / max(total, 1)
            for mb in micro_batches:
                mb["nll_scale"] = torch.tensor(scale, dtype=torch.float64)
        if not self._token_weighted:
            return micro_batches
        counts, self._host_label_counts = self._host_label_counts, None
        if counts is None or len(counts) != len(micro_batches):
            counts = [label_count(mb["labels"]) for mb in micro_batches]
        total = int(self._data_parallel_sum(torch.tensor([sum(counts)], dtype=torch.int64))[0])
        for mb, weight in zip(micro_batches, token_weights(counts, total, self._data_parallel_size())):
            mb["loss_weight"] = torch.tensor(weight, dtype=torch.float64)
        return micro_batches

    def evaluate_losses(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[float]:
        """Each micro-batch's token-mean loss, forward only (one process or TP; PP: ``NxDStrategy.evaluate``)."""
        losses = []
        with torch.no_grad():
            for mb in micro_batches:
                logits = self.model(mb["input_ids"], mb.get("position_ids"), mb.get("segment_ids"))
                losses.append(float(self.objective.loss(self.model, logits, mb)))
        return losses

    def _no_val_sums(self) -> torch.Tensor:
        """Validation sums before the first batch: (loss · tokens, tokens); pairs (DPO/ORPO): (loss · pairs, each
        metric · pairs, NLL sum, NLL tokens, pairs) — :func:`~nxdt.lightning.objective.pair_sums`."""
        return torch.zeros(len(self.objective.metrics) + 4 if self.objective.pairs else 2, dtype=torch.float64)

    def on_validation_epoch_start(self) -> None:
        self._val_sums = self._no_val_sums()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if self.objective.pairs:
            self._validate_pairs(batch)
            return
        micro_batches = split_micro_batches(batch, self.micro_batch_size)
        run = getattr(self.trainer.strategy, "evaluate", None)
        losses = run(self, micro_batches) if run else self.evaluate_losses(micro_batches)
        for mb, loss in zip(micro_batches, losses):
            count = label_count(mb["labels"])
            if count:  # a padding-only micro-batch's loss is 0/0
                self._val_sums += torch.tensor([loss * count, count], dtype=torch.float64)

    def _validate_pairs(self, batch: dict[str, torch.Tensor]) -> None:
        """Preference pairs: every row's summed log-probability, forward only (the strategy runs it; PP: the last stage
        scores and every stage gets the values), then the objective of each micro-batch's real pairs (the
        padding pairs of the last batch left out), added up as sums over pairs."""
        micro_batches = self._lay_out(split_micro_batches(batch, self.micro_batch_size))
        scores = self.sequence_scores(micro_batches, pair_scores_and_aux, per_row=4)
        objective = self.objective
        assert objective.pair_loss is not None  # every pair objective has one
        for mb, row in zip(micro_batches, scores):
            self._val_sums += pair_sums(objective.pair_loss, objective.metrics, objective.token_metric, row.reshape(4, -1), mb)

    def on_validation_epoch_end(self) -> None:
        """val_loss: the token-weighted mean over every validation token of every data-parallel rank; DPO/ORPO: the
        mean over every validation pair, and each metric's (``val_rewards/accuracies``: the fraction of pairs)."""
        if self.objective.pairs:
            sums = self._data_parallel_sum(self._val_sums.clone()).tolist()
            means = pair_means(self.objective.metrics, self.objective.token_metric, sums)
            self.val_metrics = {"step": self.trainer.global_step, **means, "val_pairs": int(sums[-1])}
            return
        loss_tokens, tokens = self._data_parallel_sum(self._val_sums.clone()).tolist()
        self.val_metrics = {
            "step": self.trainer.global_step,
            "val_loss": loss_tokens / tokens if tokens else math.nan,
            "val_tokens": int(tokens),
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """LoRA ``merge_lora``: the checkpoint's model tensors (this rank's shards) with scaling·B·A folded into each
        adapted base weight, the adapters left out (``nxdt.lightning.lora_checkpoint``)."""
        peft = getattr(self.model, "peft_config", None)
        if peft is not None and peft.merge_lora:
            from nxdt.lightning.lora_checkpoint import merged_state_dict

            checkpoint["state_dict"] = merged_state_dict(checkpoint["state_dict"], self.model.lora_config.scaling)

    def configure_callbacks(self) -> list[pl.Callback]:
        """``trainer.max_epochs`` counted in :class:`~nxdt.lightning.datamodule.NxDDataModule` epochs (its stream is
        endless, so Lightning alone never ends one)."""
        return [EpochLimit()]

    def configure_optimizers(self) -> dict[str, Any]:
        if self.wants_frozen_reference() and not self._reference:
            # taken here: NxDStrategy calls this after laying the model out over TP (the copy's TP shards are this
            # rank's) and before FSDP flattens it, and before any checkpoint is restored (on_fit_start lays the copy out
            # over DP); the communicators (TP layers and hooks hold theirs) are shared with the copy, not copied
            shared = {id(c): c for c in getattr(self.trainer.strategy, "communicators", {}).values()}
            frozen = copy_expert_marks(self.model, copy.deepcopy(self.model, memo=shared))  # EP: its experts stay marked
            self._reference.append(frozen.eval().requires_grad_(False))
        optimizer = build_optimizer(self.model, self.model_cfg.optim, precision=self.precision_type, seed=self.seed)
        shard = getattr(self.trainer.strategy, "shard_optimizer", None) if self._trainer is not None else None
        if shard:
            optimizer = shard(optimizer)  # ZeRO-1: each data-parallel rank keeps only its part of the state
        scheduler = build_scheduler(optimizer, self.model_cfg.optim.sched)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _flattened(fn: Any, model: Any, logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``fn``'s values of a micro-batch as one row (what the pipeline's ``score`` carries)."""
    return fn(model, logits, micro_batch).reshape(-1)
