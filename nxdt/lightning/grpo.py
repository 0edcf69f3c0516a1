"""GRPO (``model_alignment_strategy.grpo``, ``+recipe=grpo``): online RL with the user's reward functions, TRL's
GRPOTrainer semantics and names. Everything GRPO-specific lives here — its pre-launch checks, its prompt data, its
step, its metrics — and its spec in the objective registry (``nxdt.lightning.registry.GRPO``) names them; the pure math is
``nxdt.models.objectives`` (``grpo_advantages``, ``grpo_loss``) and sampling ``nxdt.models.generate``.

**A step** (one global batch = ``data.global_batch_size`` completions = that / ``num_generations`` prompts; each
data-parallel rank holds whole prompts): every rank samples ``num_generations`` completions of each of its prompts
with the KV cache (``temperature``, ``top_p``, ``top_k``, at most ``max_completion_length`` tokens, stopping at EOS)
from a generator seeded by (seed, step, rank) — so a resumed run samples what the uninterrupted one did — scores them
with every reward function, gathers the rewards of all ranks for the advantages (group-normalised, ``scale_rewards``),
then runs forward and backward over its completions in ``micro_batch_size`` rows at a time with the clipped surrogate
and, when ``beta`` != 0, the k3 KL to the reference (the starting weights: a frozen copy, or with fresh LoRA adapters
the policy with its adapters off; scored once per generation). Each micro-batch's
loss is scaled so the rank's sum is TRL's per-process loss, and the data-parallel mean of the gradients is TRL's.
The logits the loss scores are divided by ``temperature``, as TRL does. With ``num_iterations`` = μ > 1 (TRL's), a
generation serves μ steps (the prompt stream advances every μ steps): its first step is as above and keeps each
micro-batch's log-probabilities, the next μ − 1 train on the same completions and advantages with the probability
ratio to those (the policy that sampled them; TRL takes them from a separate forward before its first step: the same
values up to the forward's rounding), so the clipping acts. A run resumed inside a generation's steps samples anew, as
TRL's does. A mixture-of-experts policy with a non-zero
``model.moe.router_aux_loss_coef`` adds, as TRL's GRPOTrainer, that weight times the load-balancing loss of each
micro-batch's forward over its real tokens (prompt and completion; padding left out, as transformers' attention mask
does) divided by the number of micro-batches (TRL's gradient-accumulation steps); logged as ``aux_loss``.

**Reward functions are your own code**, named in your own config as ``module:function`` (importable from the
launching environment: installed, or on ``PYTHONPATH``), like a training script; they run in every worker.
Nothing named by a checkpoint, a data file or anything fetched is ever imported. Signature: TRL's
``f(prompts, completions, **kwargs) -> list[float]`` (``completion_ids`` and the prompt records' other columns
arrive as keyword lists, one value per completion; ``None`` = not scored by this function). The launcher imports
each and checks it can be called so before any worker starts; a wrong count or a non-finite value stops the step
with the function's name.

**Layouts:** data parallelism (any number of ranks), tensor parallelism with or without sequence parallelism, context
and expert parallelism, ZeRO-1 and FSDP; PP is refused by name (sampling through the stages is not built). Under CP
every rank of a CP group samples the whole completions (the KV-cache path attends over the cache locally, not through
the ring; the generator is the data-parallel rank's, so the group draws the same tokens), then scores its two
load-balanced chunks of every row through the ring: its loss is its tokens' share of the rows' (``grpo_loss``'s
``row_tokens``: each row's whole count), × CP so that the DP×CP gradient average adds the shares up; the clip and KL
token sums add up over the group. A CP2 run samples and trains as one rank (``tests/test_grpo_train.py``). Under FSDP every
decoding step's forward gathers each unit's weights (its all-gathers chained in the same order on every rank), and
under EP every decoding step's MoE layers exchange the ranks' tokens by all-to-all, so the DP ranks decode the same
number of steps: after each, one all-reduce says whether any rank still has a row decoding, and a rank whose
rows have ended runs a one-token idle forward (no random draw) until none has; the reference is a frozen copy taken
before FSDP flattens the policy and sharded in FSDP units of its own (``NxDStrategy.shard_frozen``). An FSDP run
samples what plain DP samples. Under TP every rank of a TP group
samples the same tokens: the vocabulary-parallel head's logits are gathered (:class:`FullVocabLogits`), decoding runs
with SP paused (one new token per row splits over no TP degree), and the generator's seed depends on the
data-parallel rank only; the scoring batch is padded to a multiple of the TP degree for SP. A TP2×DP2 run samples
what plain DP2 samples (``tests/test_grpo_train.py``).

**Prompts:** ``data.source=prompts``, JSONL/``save_to_disk`` records whose ``prompt`` is a string (encoded as it is; the
shipped set: nxdt/data/samples/arithmetic.jsonl) or, conversational, a list of ``{"role", "content"}`` messages:
rendered with the tokenizer's chat template and its generation prompt as TRL does (the plain template when the
tokenizer has none), and the reward functions then receive each completion as ``[{"role": "assistant", "content":
text}]`` and the prompts as the records' message lists (TRL's convention).
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from nxdt.data import SAMPLE_ARITHMETIC
from nxdt.data.instructions import build_chat_tokenizer, is_message_list, read_instruction_records, render_generation_prompt
from nxdt.lightning.datamodule import chat_tokenizer_dir
from nxdt.parallel.context_parallel import shard_micro_batches
from nxdt.lightning.module import CausalLMModule
from nxdt.lightning.objective import router_aux_weight
from nxdt.models.generate import PAD_ID, completion_batch, generate
from nxdt.parallel.tensor_parallel import gather_from_tensor_parallel_region, sequence_parallel_paused
from nxdt.models.objectives import GRPO_LOSS_TYPES, SCALE_REWARDS, grpo_advantages, grpo_loss, nanstd

KEY = "model_alignment_strategy.grpo"
BASE_METRICS = (
    "reward",
    "reward_std",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/max_length",
    "aux_loss",  # a mixture-of-experts policy's load-balancing loss (TRL's name); empty for a dense model
)


class GRPOConfigError(ValueError):
    """A GRPO setting a user can fix: ``key`` names it, ``str()`` says the problem and the fix."""

    def __init__(self, key: str, value: Any, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={value!r}: {fix}")


def reward_name(spec: str) -> str:
    """The metric name of a reward function: its function name (TRL's ``reward_func_names``)."""
    return spec.rpartition(":")[2]


def metric_names(grpo: Any) -> tuple[str, ...]:
    """metrics.csv / TensorBoard columns of a GRPO run (TRL's names)."""
    per_func = tuple(f"rewards/{reward_name(s)}/{stat}" for s in grpo.reward_funcs for stat in ("mean", "std"))
    return BASE_METRICS + per_func


def load_reward_function(spec: Any, index: int, columns: Sequence[str] = ()) -> Callable[..., Any]:
    """Import ``module:function`` (the user's own code, named in the user's config) and check it can be called as
    TRL calls it: ``f(prompts=, completions=, completion_ids=, <each other column>=)``."""
    key = f"{KEY}.reward_funcs[{index}]"
    module_name, sep, attr = str(spec).partition(":")
    if not isinstance(spec, str) or not sep or not module_name or not attr:
        raise GRPOConfigError(key, spec, "name a reward function as module:function (e.g. nxdt.data.arithmetic:exact_answer)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module failed to import: say which and why
        raise GRPOConfigError(
            key, spec, f"cannot import {module_name} ({type(exc).__name__}: {exc}); install it or put its folder on PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise GRPOConfigError(key, spec, f"{module_name} has no function {attr}")
    names = ["prompts", "completions", "completion_ids", *columns]
    try:
        inspect.signature(fn).bind(**{n: [] for n in names})
    except TypeError as exc:
        raise GRPOConfigError(
            key, spec, f"must accept f(prompts, completions, **kwargs) (TRL's signature; called with {', '.join(names)}): {exc}"
        ) from None
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass
    return fn


def prompt_records(data: Any) -> list[dict[str, Any]]:
    """``data.train_dir``'s records (None: the shipped arithmetic set), each with a ``prompt``: a non-empty string
    (plain text) or, in every record alike, a non-empty list of ``{"role", "content"}`` messages (conversational)."""
    path = data.train_dir or SAMPLE_ARITHMETIC
    records = read_instruction_records(path, data.dev_choose_samples)
    if not records:
        raise GRPOConfigError("data.train_dir", str(path), "no records: GRPO needs records with a prompt field")
    first = None
    for i, record in enumerate(records):
        prompt = record.get("prompt")
        kind = "a message list" if is_message_list(prompt) else "a string" if isinstance(prompt, str) and prompt else None
        if kind is None:
            raise GRPOConfigError(
                "data.train_dir",
                str(path),
                f'record {i} has no \'prompt\': a non-empty string or a list of {{"role": ..., "content": ...}} messages '
                f"(got {type(prompt).__name__})",
            )
        first = first or kind
        if kind != first:
            raise GRPOConfigError(
                "data.train_dir", str(path), f"record 0's prompt is {first}, record {i}'s {kind}: one kind per data set"
            )
    return records


def is_conversational(records: Sequence[dict[str, Any]]) -> bool:
    """Whether the prompts are message lists (:func:`prompt_records` makes them all one kind), TRL's
    ``is_conversational({"prompt": prompts[0]})``."""
    return bool(records) and is_message_list(records[0]["prompt"])


def encode_prompts(
    records: Sequence[dict[str, Any]], tokenizer: Any, max_prompt_length: int, vocab_size: int, tokenizer_name: Any = None
) -> list[list[int]]:
    """Each record's prompt as token ids, keeping its last ``max_prompt_length`` tokens (TRL truncates on the left).
    A string is encoded as it is; messages are rendered with the tokenizer's chat template and the generation prompt,
    as TRL's GRPOTrainer does (``apply_chat_template(prompts, add_generation_prompt=True, tokenize=True)`` in
    ``_tokenize_prompts``: the template writes the special tokens, nothing is added), or the plain template without
    one (:func:`nxdt.data.instructions.render_generation_prompt`)."""
    out = []
    for i, record in enumerate(records):
        prompt = record["prompt"]
        try:
            text = prompt if isinstance(prompt, str) else render_generation_prompt(tokenizer, prompt)
        except ValueError as exc:  # the template refused these messages (raise_exception, a syntax error)
            raise GRPOConfigError("data.tokenizer", tokenizer_name, f"record {i}: {str(exc).splitlines()[0]}") from None
        ids = list(tokenizer.encode(text))[-max_prompt_length:]
        if not ids or max(ids) >= vocab_size:
            raise GRPOConfigError(
                "data.tokenizer", tokenizer_name, f"record {i}'s prompt encodes to ids outside model.vocab_size={vocab_size}"
            )
        out.append(ids)
    return out


def completion_values(texts: Sequence[str], conversational: bool) -> list[Any]:
    """What reward functions receive as ``completions``: the decoded texts, or for conversational prompts each as one
    assistant message, ``[{"role": "assistant", "content": text}]`` (TRL's GRPOTrainer, ``_generate_and_score_completions``
    without a response parser)."""
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts)


# what sampling is not built on yet: a pipeline (every stage would take part in each decoding step)
REFUSED_LAYOUTS = (("distributed_strategy.pipeline_model_parallel_size", lambda ds: ds.pipeline_model_parallel_size > 1),)
LAYOUTS = "GRPO samples on data, tensor (with or without SP), context and expert parallelism, ZeRO-1 and FSDP (PP not built)"


def check(cfg: Any, data_parallel_size: int) -> list[Callable[..., Any]]:
    """Everything about a GRPO run that can be known before workers start (raises :class:`GRPOConfigError`);
    returns the imported reward functions."""
    grpo, data, ds = cfg.model_alignment_strategy.grpo, cfg.data, cfg.distributed_strategy
    for key, refused in REFUSED_LAYOUTS:
        if refused(ds):
            raise GRPOConfigError(key, _value(cfg, key), LAYOUTS)
    if data.source != "prompts":
        raise GRPOConfigError("data.source", data.source, "GRPO reads prompt records: set data.source=prompts (+recipe=grpo)")
    if grpo.loss_type not in GRPO_LOSS_TYPES:
        raise GRPOConfigError(f"{KEY}.loss_type", grpo.loss_type, f"use one of {', '.join(GRPO_LOSS_TYPES)}")
    if grpo.scale_rewards not in SCALE_REWARDS:
        raise GRPOConfigError(f"{KEY}.scale_rewards", grpo.scale_rewards, f"use one of {', '.join(SCALE_REWARDS)}")
    if grpo.num_generations < 2:
        raise GRPOConfigError(f"{KEY}.num_generations", grpo.num_generations, "needs >= 2 completions per prompt (a group)")
    if isinstance(grpo.num_iterations, bool) or not isinstance(grpo.num_iterations, int) or grpo.num_iterations < 1:
        raise GRPOConfigError(
            f"{KEY}.num_iterations", grpo.num_iterations, "must be an integer >= 1 (1: a fresh generation every step)"
        )
    batch = data.global_batch_size
    if batch is None or batch % grpo.num_generations:
        raise GRPOConfigError(
            "data.global_batch_size", batch, f"must be a multiple of {KEY}.num_generations={grpo.num_generations} (whole groups)"
        )
    if (batch // grpo.num_generations) % data_parallel_size:
        raise GRPOConfigError(
            "data.global_batch_size",
            batch,
            f"{batch // grpo.num_generations} prompts per step must split evenly over {data_parallel_size} data-parallel ranks",
        )
    for name, low, value in (
        ("max_completion_length", 1, grpo.max_completion_length),
        ("max_prompt_length", 1, grpo.max_prompt_length),
    ):
        if value < low:
            raise GRPOConfigError(f"{KEY}.{name}", value, f"must be >= {low}")
    if not grpo.temperature > 0:
        raise GRPOConfigError(f"{KEY}.temperature", grpo.temperature, "must be > 0")
    if not 0 < grpo.top_p <= 1 or grpo.top_k < 0:
        raise GRPOConfigError(f"{KEY}.top_p", grpo.top_p, "top_p must be in (0, 1] and top_k >= 0")
    if grpo.max_prompt_length + grpo.max_completion_length > cfg.model.max_position_embeddings:
        raise GRPOConfigError(
            f"{KEY}.max_completion_length",
            grpo.max_completion_length,
            f"max_prompt_length + max_completion_length must fit model.max_position_embeddings={cfg.model.max_position_embeddings}",
        )
    if not grpo.reward_funcs:
        raise GRPOConfigError(f"{KEY}.reward_funcs", [], "name at least one reward function as module:function")
    if grpo.reward_weights is not None and len(grpo.reward_weights) != len(grpo.reward_funcs):
        raise GRPOConfigError(
            f"{KEY}.reward_weights", list(grpo.reward_weights), f"give one weight per reward function ({len(grpo.reward_funcs)})"
        )
    records = prompt_records(data)
    try:
        tokenizer = build_chat_tokenizer(chat_tokenizer_dir(data.tokenizer))
    except (ValueError, OSError, RuntimeError) as exc:
        raise GRPOConfigError("data.tokenizer", data.tokenizer, str(exc)) from None
    encode_prompts(records, tokenizer, grpo.max_prompt_length, cfg.model.vocab_size, data.tokenizer)  # as workers will
    columns = sorted({k for r in records for k in r if k != "prompt"})
    return [load_reward_function(spec, i, columns) for i, spec in enumerate(grpo.reward_funcs)]


def _value(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def score(
    funcs: Sequence[Callable[..., Any]],
    names: Sequence[str],
    records: Sequence[dict[str, Any]],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """[completions, functions] rewards (NaN where a function returned None), each function called once as TRL
    calls it (``prompts``: the records' prompts, strings or message lists; ``completions``: :func:`completion_values`);
    a wrong count or a non-finite value is an error naming the function."""
    columns = sorted({k for r in records for k in r if k != "prompt"})
    kwargs = {c: [r.get(c) for r in records] for c in columns}
    prompts = [r["prompt"] for r in records]
    out = torch.empty(len(completions), len(funcs), dtype=torch.float32)
    for j, (fn, name) in enumerate(zip(funcs, names)):
        values = fn(prompts=prompts, completions=list(completions), completion_ids=[list(c) for c in completion_ids], **kwargs)
        if values is None or len(values) != len(completions):
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"{KEY}.reward_funcs: {name} returned {got} for {len(completions)} completions")
        for i, v in enumerate(values):
            if v is None:
                out[i, j] = math.nan
                continue
            if not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                raise ValueError(f"{KEY}.reward_funcs: {name} returned {v!r} for completion {i}: rewards must be finite numbers")
            out[i, j] = float(v)
    return out


class PromptSteps(IterableDataset):
    """This rank's prompt indices for each step, from the step the run is at (``start()``, read when iteration
    starts: 0, or the restored checkpoint's step): step k belongs to generation g = k // ``iterations`` (TRL's
    num_iterations: each generation's prompts serve that many steps), which takes prompts [g·P, (g+1)·P) of an
    endless stream of seeded permutations of the records, rank r the r-th of ``dp_size`` equal slices. A function of
    (seed, step), so a resumed run reads what the uninterrupted one did."""

    def __init__(
        self, count: int, per_step: int, seed: int, rank: int, dp_size: int, start: Callable[[], int], iterations: int = 1
    ) -> None:
        self.count, self.per_step, self.seed, self.rank, self.dp_size, self.start = count, per_step, seed, rank, dp_size, start
        self.iterations = iterations

    def _order(self, epoch: int) -> list[int]:
        return torch.randperm(self.count, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        step, share = self.start(), self.per_step // self.dp_size
        orders: dict[int, list[int]] = {}
        while True:
            first = (step // self.iterations) * self.per_step + self.rank * share
            picked = []
            for position in range(first, first + share):
                epoch = position // self.count
                if epoch not in orders:
                    orders = {epoch: self._order(epoch)}  # one permutation held at a time
                picked.append(orders[epoch][position % self.count])
            yield {"indices": torch.tensor(picked)}
            step += 1


class PromptDataModule(pl.LightningDataModule):
    """GRPO's data: the prompt records (``data.source=prompts``) and, per step, this rank's prompt indices."""

    def __init__(self, data: Any, grpo: Any, seed: int) -> None:
        super().__init__()
        self.records = prompt_records(data)
        self.per_step = data.global_batch_size // grpo.num_generations
        self.seed = seed
        self.iterations = grpo.num_iterations

    def train_dataloader(self) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"rank": 0, "num_replicas": 1}
        trainer = self.trainer
        steps = PromptSteps(
            len(self.records),
            self.per_step,
            self.seed,
            int(kwargs["rank"]),
            int(kwargs["num_replicas"]),
            lambda: trainer.global_step,
            self.iterations,
        )
        return DataLoader(steps, batch_size=None)


class FullVocabLogits(torch.nn.Module):
    """``model``'s logits over its whole vocabulary, what sampling draws from: under tensor parallelism the
    vocabulary-parallel head's shards gathered over its group (identical on every rank) and the padding columns
    dropped; a plain model's logits unchanged."""

    def __init__(self, model: torch.nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.model, self.vocab_size = model, vocab_size

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        logits = self.model(input_ids, **kwargs)
        head = getattr(self.model, "lm_head", None)
        if not getattr(head, "shards_vocab", False):
            return logits
        assert head is not None  # shards_vocab
        return gather_from_tensor_parallel_region(logits, head.comm)[..., : self.vocab_size]


def pad_columns(batch: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """A scoring batch widened with padding columns (segment 0, position 0, label -100: attended by nothing, scored
    by nothing) to a multiple of ``multiple`` — sequence parallelism splits the width over the TP ranks."""
    width = batch["input_ids"].shape[1]
    extra = -width % multiple
    if not extra:
        return batch
    fill = {"input_ids": PAD_ID, "position_ids": 0, "segment_ids": 0, "labels": -100}
    return {k: torch.cat([v, v.new_full((v.shape[0], extra), fill[k])], dim=1) for k, v in batch.items()}


@dataclass
class Generation:
    """One generation's completions on this rank and what the steps trained on it share: the DP group's rewards
    (``everyone`` per function, ``rewards`` weighted), this rank's advantages, the scoring batch in micro-batches
    (``parts``: :meth:`GRPOModule._scoring_parts`) and its token counts, each micro-batch's reference log-probabilities
    (``ref``; None without KL); with num_iterations > 1 also its log-probabilities under the policy that sampled it
    (``old``), recorded by the generation's first step."""

    index: int  # global_step // num_iterations
    completions: list[list[int]]
    everyone: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    parts: list[tuple[slice, dict[str, torch.Tensor], torch.Tensor]]
    local_tokens: int
    global_tokens: int
    ref: list[torch.Tensor | None]
    old: list[torch.Tensor] = field(default_factory=list)


class GRPOModule(CausalLMModule):
    """:class:`CausalLMModule` (model, optimizer, schedule, gradient finishing, NaN policy) with GRPO's step."""

    def __init__(self, *args: Any, grpo: Any, data: Any, reward_funcs: Sequence[Callable[..., Any]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grpo = grpo
        self.records = prompt_records(data)
        self.tokenizer = build_chat_tokenizer(chat_tokenizer_dir(data.tokenizer))
        self.prompt_ids = encode_prompts(
            self.records, self.tokenizer, grpo.max_prompt_length, self.model_cfg.vocab_size, data.tokenizer
        )
        self.conversational = is_conversational(self.records)
        self.reward_funcs = list(reward_funcs)
        self.reward_names = [reward_name(s) for s in grpo.reward_funcs]
        weights = grpo.reward_weights if grpo.reward_weights is not None else [1.0] * len(self.reward_funcs)
        self.reward_weights = torch.tensor([float(w) for w in weights])
        self.metric_names = metric_names(grpo)
        self._generation: Generation | None = None  # the generation the current steps train on (num_iterations)

    def wants_frozen_reference(self) -> bool:
        """beta != 0: the k3 KL to a frozen copy of the starting weights (CausalLMModule takes and lays it out), unless
        fresh LoRA adapters make the policy with its adapters off that reference."""
        return self.grpo.beta != 0.0 and not self._fresh_adapters

    def configure_callbacks(self) -> list[pl.Callback]:
        return []  # trainer.max_steps ends a GRPO run (its prompt stream is endless)

    def _sample(self, prompt_rows: list[list[int]]) -> list[list[int]]:
        g, step = self.grpo, self.trainer.global_step
        # the data-parallel rank: the ranks of one TP group draw the same tokens, and a layout's draws are plain DP's
        rank = self._data_parallel_rank()
        # on the model's device (a GPU draws there; its stream differs from the CPU's, reproducible on that device)
        generator = torch.Generator(self.device).manual_seed((self.seed * 1_000_003 + step) * 65_537 + rank)
        # every DP rank runs the same number of decoding forwards (FSDP gathers each unit's weights in every one, in the
        # same order on every rank): until no rank has a row decoding, a rank whose rows ended runs idle ones
        keep_going = self._any_rank_decoding if self._data_parallel_size() > 1 else None
        training = self.model.training
        self.model.eval()
        with torch.no_grad(), self.trainer.precision_plugin.val_step_context(), sequence_parallel_paused(self.model):
            completions = generate(
                FullVocabLogits(self.model, self.model_cfg.vocab_size),
                prompt_rows,
                g.max_completion_length,
                eos_id=self.tokenizer.eos_id,
                do_sample=True,
                temperature=g.temperature,
                top_k=g.top_k,
                top_p=g.top_p,
                generator=generator,
                keep_going=keep_going,
            )
        self.model.train(training)
        return completions

    def _data_parallel_rank(self) -> int:
        return int((getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"rank": 0})["rank"])

    def _any_rank_decoding(self, mine: bool) -> bool:
        return bool(self._data_parallel_sum(torch.tensor([float(mine)]))[0] > 0)

    def _group(self, name: str) -> Any:
        """The strategy's communicator of a dimension (None without one: Lightning's own strategies)."""
        return getattr(self.trainer.strategy, "communicators", {}).get(name)

    def _group_size(self, name: str) -> int:
        group = self._group(name)
        return 1 if group is None else int(group.size)

    def _logps(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(mb["input_ids"], mb["position_ids"], mb["segment_ids"])
        return model.token_log_probs(logits.float() / self.grpo.temperature, mb["labels"])

    def _generate(self, batch: dict[str, torch.Tensor]) -> Generation:
        """Sample this rank's completions of its prompts, score them and take their advantages (the DP group's rewards
        gathered, groups whole); the scoring batch padded for SP."""
        g, strategy = self.grpo, self.trainer.strategy
        rank = self._data_parallel_rank()
        indices = [i for i in batch["indices"].tolist() for _ in range(g.num_generations)]
        records = [self.records[i] for i in indices]
        prompt_rows = [self.prompt_ids[i] for i in indices]
        completions = self._sample(prompt_rows)
        eos = self.tokenizer.eos_id
        # decoded without EOS (TRL: batch_decode(skip_special_tokens=True); a tokenizer.json's decode skips special tokens)
        texts = [self.tokenizer.decode([t for t in c if t != eos]) for c in completions]  # type: ignore[misc]
        values = completion_values(texts, self.conversational)
        local = score(self.reward_funcs, self.reward_names, records, values, completions)
        # over the data-parallel group, in its rank order (TP ranks hold the same rewards): groups stay whole
        everyone = strategy.all_gather(local, group=self._group("dp")).reshape(-1, len(self.reward_funcs))
        advantages_all, rewards_all, _ = grpo_advantages(everyone, self.reward_weights, g.num_generations, g.scale_rewards)
        n = len(completions)
        # SP splits the width over TP; CP cuts it into 2·CP chunks, each rank's two then split over TP
        cp = self._group_size("cp")
        width = self._group_size("tp") * (2 * cp if cp > 1 else 1)
        full = pad_columns(completion_batch(prompt_rows, completions, self.device), width)
        local_tokens = int((full["labels"] != -100).sum())
        global_tokens = int(self._data_parallel_sum(torch.tensor([local_tokens], dtype=torch.int64))[0])
        parts = self._scoring_parts(full, n)
        ref: list[torch.Tensor | None] = [None] * len(parts)
        if g.beta != 0.0:  # the reference is frozen: scored once per generation, before any update
            with self.reference_scope() as reference:
                ref = [self._logps(reference, mb) for _, mb, _ in parts]
        return Generation(
            self.trainer.global_step // g.num_iterations,
            completions,
            everyone,
            rewards_all,
            advantages_all[rank * n : (rank + 1) * n].to(self.device),
            parts,
            local_tokens,
            global_tokens,
            ref,
        )

    def _scoring_parts(self, full: dict[str, torch.Tensor], n: int) -> list[tuple[slice, dict[str, torch.Tensor], torch.Tensor]]:
        """The scoring batch ``micro_batch_size`` rows at a time: each micro-batch's rows, what this rank scores of them
        (under CP its two load-balanced chunks of every row, global positions: the ring attends over the rest) and each
        row's whole token count."""
        cp, parts = self._group("cp"), []
        for start in range(0, n, self.micro_batch_size):
            rows = slice(start, min(start + self.micro_batch_size, n))
            mb = {k: v[rows] for k, v in full.items()}
            row_tokens = (mb["labels"] != -100).sum(-1)
            if cp is not None and cp.size > 1:
                mb = shard_micro_batches([mb], cp, token_share=False)[0]
            parts.append((rows, mb, row_tokens))
        return parts

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        g, strategy = self.grpo, self.trainer.strategy
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        dp = self._data_parallel_size()
        # TRL's num_iterations: a generation serves that many steps; its later steps score it against the policy that
        # sampled it (old log-probabilities, kept from its first step). A run resumed inside a generation's steps
        # samples anew, as TRL's does (its buffered generation is not in the checkpoint either).
        generation = self._generation
        if generation is None or generation.index != self.trainer.global_step // g.num_iterations:
            generation = self._generation = self._generate(batch)
        reuse = bool(generation.old)
        completions, everyone, rewards_all = generation.completions, generation.everyone, generation.rewards
        advantages = generation.advantages
        local_tokens, global_tokens = generation.local_tokens, generation.global_tokens
        n = len(completions)
        cp = self._group("cp")
        cp_size = 1 if cp is None else int(cp.size)

        optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # where the losses are
        sums = torch.zeros(5, dtype=torch.float64)  # kl, clip low, high, region (token sums), tokens
        aux_coef = router_aux_weight(self.model)  # a MoE model's; 0: no term
        micro_batches, aux_sum = len(generation.parts), torch.zeros((), dtype=torch.float64, device=self.device)
        for index, (rows, mb, row_tokens) in enumerate(generation.parts):
            mb_mask = mb["labels"] != -100
            ref = generation.ref[index]
            loss_type, items, processes, scale = g.loss_type, None, 1, (rows.stop - rows.start) / n
            if g.loss_type == "bnpo":  # TRL: a token mean over this rank's whole batch
                loss_type, items, scale = "dapo", local_tokens, 1.0
            elif g.loss_type == "dapo":  # TRL: the global token count / processes, the DP mean finishing it
                items, processes, scale = global_tokens, dp, 1.0
            logps = self._logps(self.model, mb)
            if g.num_iterations > 1 and not reuse:  # the sampling policy's log-probabilities, for the later steps
                generation.old.append(logps.detach())
            # TRL: the policy forward's load-balancing loss (attention-masked), / the gradient-accumulation steps
            aux = self.model.aux_loss(padding_masked=True) if aux_coef else None
            loss, metrics = grpo_loss(
                logps,
                mb_mask,
                advantages[rows],
                old_per_token_logps=generation.old[index] if reuse else None,
                ref_per_token_logps=ref,
                beta=g.beta,
                epsilon=g.epsilon,
                epsilon_high=g.epsilon_high,
                loss_type=loss_type,
                max_completion_length=g.max_completion_length,
                num_items_in_batch=items,
                num_processes=processes,
                row_tokens=row_tokens,
            )
            # under CP: this rank's tokens' share of the loss, × CP so that the DP×CP gradient average adds the shares
            loss = loss * scale * cp_size
            if aux is not None:
                loss = loss + aux_coef * aux / micro_batches
                aux_sum += aux.detach().double()
            self.manual_backward(loss)
            total += loss.detach().double()
            tokens = float(mb_mask.sum())
            names = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
            sums += torch.tensor([float(metrics.get(k, 0.0)) * tokens for k in names] + [tokens], dtype=torch.float64)
        finish = getattr(strategy, "finish_gradients", None)
        if finish:
            finish()
        grad_norm = None
        if self.gradient_clip_val or self.log_gradient_norm:
            params = [p for p in self.model.parameters() if p.grad is not None]
            clip = getattr(strategy, "clip_grad_norm", None)
            limit = self.gradient_clip_val or math.inf
            grad_norm = clip(limit) if clip else torch.nn.utils.clip_grad_norm_(params, limit)
        step_loss = strategy.reduce(total.detach().to(torch.float32, copy=True), reduce_op="mean")  # in place, as DDP's
        loss_value, norm_value = float(step_loss), None if grad_norm is None else float(grad_norm)
        if not self._finite_step(loss_value, norm_value, total):
            optimizer.zero_grad()
            return step_loss
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        sums = self._data_parallel_sum(sums)
        if cp_size > 1:  # each CP rank counted its own tokens
            cp.all_reduce(sums, op="sum")
        lengths = torch.tensor([float(len(c)) for c in completions])
        length_stats = self._data_parallel_sum(torch.tensor([float(lengths.sum()), float(n)], dtype=torch.float64))
        longest = strategy.all_gather(lengths.max()).max()
        tokens = max(float(sums[4]), 1.0)
        stats = getattr(strategy, "step_stats", None)  # FSDP: exposed communication (sampling's gathers included)
        self.step_metrics = {
            "step": self.trainer.global_step,
            "loss": loss_value,
            "lr": lr,
            **({"grad_norm": norm_value} if norm_value is not None and self.log_gradient_norm else {}),
            **(stats() if stats else {}),
            "reward": float(torch.nanmean(rewards_all)),
            "reward_std": float(nanstd(rewards_all)),
            "clip_ratio/low_mean": float(sums[1]) / tokens,
            "clip_ratio/high_mean": float(sums[2]) / tokens,
            "clip_ratio/region_mean": float(sums[3]) / tokens,
            "completions/mean_length": float(length_stats[0] / length_stats[1]),
            "completions/max_length": float(longest),
        }
        if g.beta != 0.0:
            self.step_metrics["kl"] = float(sums[0]) / tokens
        if aux_coef:  # the mean over this step's micro-batches and the data-parallel ranks
            self.step_metrics["aux_loss"] = float(self._data_parallel_sum(aux_sum.reshape(1))[0]) / (micro_batches * dp)
        for j, name in enumerate(self.reward_names):
            self.step_metrics[f"rewards/{name}/mean"] = float(torch.nanmean(everyone[:, j]))
            self.step_metrics[f"rewards/{name}/std"] = float(nanstd(everyone[:, j]))
        self.log("loss", step_loss, prog_bar=True, logger=False)
        self.log("reward", float(torch.nanmean(rewards_all)), prog_bar=True, logger=False)
        return step_loss
