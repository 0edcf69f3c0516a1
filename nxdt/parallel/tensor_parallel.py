"""Megatron-style tensor parallelism (TP) and sequence parallelism (SP) over an ``nxdt.comm`` Communicator.

A linear layer ``y = x Wᵀ`` is split over the ``tp`` ranks of a group in one of two ways:

* column-parallel: every rank holds a block of W's *rows* (output features) and computes its slice of y
  from the full x. Backward sums the partial input gradients of all ranks (copy-to-region).
* row-parallel: every rank holds a block of W's *columns* (input features), gets the matching slice of x
  (the output of a column-parallel layer) and produces a partial y; an all-reduce sums the parts
  (reduce-from-region).

A column layer followed by a row layer (attention q/k/v → o, MLP gate/up → down) costs one all-reduce
forward and one backward, provided the column layers that read the same input enter the region once:
a block declared ``input_region`` enters it with its first input, and its column-parallel layers do
not enter it again (otherwise q, k and v would each all-reduce their input gradient, five all-reduces
backward per Llama layer instead of two; with SP, five all-gathers forward).

With sequence parallelism the activations *between* those pairs (norms, residual adds) are split along
the sequence instead of replicated: the all-reduce becomes a reduce-scatter along the sequence after the
row layer and an all-gather before the next column layer, the same bytes on the wire but 1/tp of the
activation memory outside the attention/MLP cores.

The embedding and the output head are split along the vocabulary; the loss is computed on vocab-sharded
logits without ever gathering them (:func:`vocab_parallel_cross_entropy`). Any vocabulary splits: both are padded
with zero rows to a multiple of ``make_vocab_size_divisible_by`` × TP (Megatron's rule, the style's ``:<n>``), the
padding logits are -inf, and every full tensor (gathered, exported, consolidated) is trimmed back to the true
vocabulary, so checkpoints reshard between TP degrees that pad differently.

Every collective runs on the communicator's stream named ``"tp"``.

Which module becomes what is declared, not guessed here: a plan (``plan=``; a model family's comes from its spec,
``nxdt.config.hf_model.ModelSpec.tensor_parallel_plan``, a model of one's own may declare ``tensor_parallel_plan()``)
maps submodule names (``fnmatch`` patterns) to styles::

    {"embed_tokens": "vocab_embedding",
     "layers.*.self_attn": "input_region",          # q, k and v share one entry (one input-gradient all-reduce)
     "layers.*.self_attn.q_proj": "colwise:8",      # whole heads of 8 rows
     "layers.*.self_attn.k_proj": "colwise_kv:8",   # KV heads; replicated when fewer heads than ranks
     "layers.*.self_attn.o_proj": "rowwise:8",
     "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
     "lm_head": "vocab_head"}

Worked example (two ranks, same seed everywhere, so every rank slices the same full weights)::

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model = apply_tensor_parallel(model, tp_comm, sequence_parallel=True, plan=tensor_parallel_plan_of(model))
    loss = model.loss_fn(model(ids), labels)        # the vocab-parallel head computes the loss
    loss.backward()
    sync_replicated_grads(model, tp_comm)           # norm weights under SP: sum the sequence shards' grads
    optimizer.step()
    full = gather_full_state_dict(model, tp_comm)   # unsharded weights, e.g. for export

Gradient synchronisation, in short:

* KV projections replicated over several ranks (grouped-query attention with fewer KV heads than ranks)
  sum their replicas' weight gradients *inside the autograd graph*: each replica sees only the query heads
  of its own rank, and the single-process gradient is the sum over all of them.
* Parameters that are not sharded (norm weights, row-parallel biases) get identical gradients on every rank
  without SP; with SP each rank saw only its sequence shard, so :func:`sync_replicated_grads` must be
  called after backward (it is a no-op for models parallelised without SP).
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

TP_STREAM = "tp"
SEQ_DIM = 1  # activations are [batch, sequence, hidden]


# ---------------------------------------------------------------------------------------------- raw collectives
def _all_reduce(x: torch.Tensor, comm: Any, op: str = "sum") -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # never reduce in place into a tensor autograd saved
    comm.all_reduce(out, op, stream=TP_STREAM)
    return out


def _all_gather(x: torch.Tensor, comm: Any, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (comm gathers along the flat dim 0, so move ``dim`` first)."""
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((comm.size * front.shape[0],) + tuple(front.shape[1:]))
    comm.all_gather(out, front, stream=TP_STREAM)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, comm: Any, dim: int) -> torch.Tensor:
    """Sum over ranks, keep block ``rank`` of ``dim``."""
    if x.shape[dim] % comm.size:
        raise ValueError(
            f"sequence parallelism splits dim {dim} (length {x.shape[dim]}) over {comm.size} tensor-parallel "
            f"ranks: make the sequence length a multiple of the tensor-parallel size"
        )
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // comm.size,) + tuple(front.shape[1:]))
    comm.reduce_scatter(out, front, stream=TP_STREAM)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, comm: Any, dim: int) -> torch.Tensor:
    if x.shape[dim] % comm.size:
        raise ValueError(f"cannot split dim {dim} of length {x.shape[dim]} over {comm.size} tensor-parallel ranks")
    return x.chunk(comm.size, dim)[comm.rank].contiguous()


# ---------------------------------------------------------------------------------------------- autograd regions
class _CopyToRegion(torch.autograd.Function):
    """Identity forward; backward sums the input gradients of all ranks (each saw only its weight shard)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm), None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward (sum of the row-parallel partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter backward (the ranks' partial gradients of the
    full sequence are summed, each keeps its own shard)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, comm, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm, SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter(x, comm, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, SEQ_DIM), None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the feature dim forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, comm, x.ndim - 1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.comm, grad.ndim - 1), None


class _SumOverReplicas(torch.autograd.Function):
    """Identity on a weight shard held by several ranks; backward sums the gradients of the ranks that hold
    the same shard (each computed it from its own query heads only) so every replica gets the full gradient."""

    @staticmethod
    def forward(ctx, weight, spec, comm):
        ctx.spec, ctx.comm = spec, comm
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        spec, comm = ctx.spec, ctx.comm
        # one slot per distinct shard; the replicas of a shard add into the same slot
        slots = grad.new_zeros((comm.size // spec.replicas,) + tuple(grad.shape))
        slots[spec.group(comm.rank)] = grad
        comm.all_reduce(slots, stream=TP_STREAM)
        return slots[spec.group(comm.rank)].clone(), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return _CopyToRegion.apply(x, comm)


def reduce_from_tensor_parallel_region(x: torch.Tensor, comm: Any) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, comm)


def gather_from_sequence_parallel_region(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """[B, S/tp, H] → [B, S, H]."""
    return _GatherFromSequence.apply(x, comm)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """[B, S, H] partial sums → [B, S/tp, H] summed."""
    return _ReduceScatterToSequence.apply(x, comm)


def enter_region(x: torch.Tensor, comm: Any, sequence_parallel: bool) -> torch.Tensor:
    """The input of column-parallel layers: copy-to-region, or with SP the all-gather of the sequence shards."""
    return gather_from_sequence_parallel_region(x, comm) if sequence_parallel else copy_to_tensor_parallel_region(x, comm)


def gather_from_tensor_parallel_region(x: torch.Tensor, comm: Any) -> torch.Tensor:
    """[..., F/tp] → [..., F] (e.g. vocab-sharded logits → full logits)."""
    return _GatherLastDim.apply(x, comm)


class _GatherTokens(torch.autograd.Function):
    """Rows [T/tp, ...] of every rank → [T, ...]; backward reduce-scatters (the ranks' partial gradients)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, comm, 0)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm, 0), None


class _ReduceScatterTokens(torch.autograd.Function):
    """Partial sums [T, ...] → this rank's rows [T/tp, ...] summed; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter(x, comm, 0)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, 0), None


class _GatherTokensForReplicated(torch.autograd.Function):
    """Rows of every rank → [T, ...] for a computation every rank repeats identically; backward keeps
    this rank's rows of the (identical) gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, comm, 0)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.comm, 0), None


class TokenRegion:
    """The tensor-parallel region of a block that runs *several* sharded layers on token rows [T, hidden]
    (a mixture-of-experts block: router → experts with column-parallel w1/w3 and partial-output row-parallel
    w2 → weighted sum). The block calls, in order::

        logits_for_loss = region.replicated(router_logits)   # all tokens on every rank (aux loss)
        x, w = region.enter(x), region.enter(weights)         # copy-to (SP: all-gather the ranks' tokens)
        ids = region.gather_ids(expert_ids)                    # the routing of those tokens (no gradient)
        ... experts on x, outputs weighted by w and summed per token: partial sums over the TP ranks
        y = region.exit(out)                                   # all-reduce (SP: reduce-scatter back to own rows)

    so the whole block costs one reduction forward, instead of one per expert. Entering *after* the router
    keeps the router outside the region: its input gradient is the same on every rank (no double count),
    while the partial gradients of the expert inputs and of the routing weights are summed by ``enter``'s
    backward. Without SP the router sees every token on every rank; with SP each rank routes its own
    sequence shard (the router weight is then a replicated parameter whose gradients
    :func:`sync_replicated_grads` sums)."""

    def __init__(self, comm: Any, sequence_parallel: bool) -> None:
        _check_comm(comm)
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def replicated(self, rows: torch.Tensor) -> torch.Tensor:
        return _GatherTokensForReplicated.apply(rows, self.comm) if self.sequence_parallel else rows

    def enter(self, rows: torch.Tensor) -> torch.Tensor:
        return _GatherTokens.apply(rows, self.comm) if self.sequence_parallel else copy_to_tensor_parallel_region(rows, self.comm)

    def gather_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return _all_gather(ids.contiguous(), self.comm, 0) if self.sequence_parallel else ids

    def exit(self, partial: torch.Tensor) -> torch.Tensor:
        return (
            _ReduceScatterTokens.apply(partial, self.comm)
            if self.sequence_parallel
            else reduce_from_tensor_parallel_region(partial, self.comm)
        )


class _EnterRegionHook:
    """Forward pre-hook of an ``input_region`` block: its first positional input enters the TP region
    (copy-to; SP: all-gather along the sequence) once, for every column-parallel layer inside."""

    def __init__(self, comm: Any, sequence_parallel: bool, what: str) -> None:
        self.comm, self.sequence_parallel, self.what = comm, sequence_parallel, what

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                f"tensor-parallel plan: {self.what} is an 'input_region' block, so its input must be its first "
                f"positional argument (a tensor); it was called with {len(args)} positional argument(s)"
            )
        return (enter_region(args[0], self.comm, self.sequence_parallel), *args[1:])


@contextmanager
def sequence_parallel_paused(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s tensor-parallel layers without sequence parallelism inside the block (decoding: a step feeds one
    token per row, a length no TP degree splits), as they are restored after it. Each layer then copies its input
    into the region and all-reduces its partial output where SP all-gathers and reduce-scatters along the sequence:
    the same sums laid out differently (Korthikanti et al. 2022, §4.2.2), so the logits agree up to fp32 summation
    order. Forward only: the layers' backward would follow the other layout."""
    switches: list[Any] = []
    for module in model.modules():
        if isinstance(module, TensorParallelModule) and module.sequence_parallel:
            switches.append(module)
        region = getattr(module, "tensor_parallel_region", None)
        if isinstance(region, TokenRegion) and region.sequence_parallel:
            switches.append(region)
        switches += [h for h in module._forward_pre_hooks.values() if isinstance(h, _EnterRegionHook) and h.sequence_parallel]
    for switch in switches:
        switch.sequence_parallel = False
    try:
        yield
    finally:
        for switch in switches:
            switch.sequence_parallel = True


# ---------------------------------------------------------------------------------------------- sharding layout
class ShardSpec:
    """How a full tensor's ``dim`` (length ``full``) is cut into blocks of ``block`` rows and dealt to ``size``
    ranks: evenly when the blocks divide among the ranks; with ``replicate=True`` and fewer blocks than ranks
    (``size`` a multiple of the block count), each block is held by ``replicas`` consecutive ranks.

    With ``pad=True`` (the vocabulary of an embedding or head) the dimension is first padded with zero rows to
    ``padded``, the next multiple of ``block × size`` — Megatron's ``_vocab_size_with_padding`` with ``block`` its
    ``make_vocab_size_divisible_by`` — so any length splits evenly; the last rank(s) hold the padding rows. Slicing
    pads, gathering trims: the full tensor (export, checkpoint consolidation, resharding) is always ``full`` long."""

    def __init__(
        self,
        dim: int,
        full: int,
        size: int,
        *,
        block: int = 1,
        replicate: bool = False,
        pad: bool = False,
        what: str = "tensor",
    ) -> None:
        if block < 1 or (full % block and not pad):
            raise ValueError(f"{what}: dimension of length {full} is not made of whole blocks of {block}")
        self.padded = -(-full // (block * size)) * block * size if pad else full
        blocks = self.padded // block
        if blocks % size == 0:
            per_rank, self.replicas = blocks // size, 1
        elif replicate and size % blocks == 0:
            per_rank, self.replicas = 1, size // blocks
        else:
            how = "divide, or the tensor-parallel size must be a multiple of" if replicate else "divide"
            raise ValueError(
                f"{what}: {blocks} block(s) of {block} along dim {dim} cannot be split over {size} tensor-parallel "
                f"ranks (the block count must {how} the tensor-parallel size); choose a tensor-parallel size "
                f"that fits"
            )
        self.dim, self.full, self.size, self.local = dim, full, size, per_rank * block

    def group(self, rank: int) -> int:
        """Index of the shard ``rank`` holds (ranks that replicate one shard share the index)."""
        return rank // self.replicas

    def slice(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's shard of the (unpadded) full tensor; padding rows are zeros."""
        if full.shape[self.dim] != self.full:
            raise ValueError(f"expected {self.full} rows along dim {self.dim}, got a tensor of shape {tuple(full.shape)}")
        start = self.group(rank) * self.local
        if self.padded > self.full:
            pad = [0, 0] * (full.dim() - 1 - self.dim) + [0, self.padded - self.full]  # F.pad lists the last dim first
            full = F.pad(full.detach(), pad)
        return full.narrow(self.dim, start, self.local).detach().clone().contiguous()

    def gather(self, local: torch.Tensor, comm: Any) -> torch.Tensor:
        """Reassemble the full tensor on every rank (one copy of each replicated shard, padding trimmed)."""
        return gather_shards(local, comm, *self.layout())

    def layout(self) -> list[int]:
        """A checkpoint's ``tensor_parallel`` entry: ``[dim, replicas]``, plus the true and the padded length when
        padded (the padded one tells a resume on the same TP whether its shards have this run's shape)."""
        return [self.dim, self.replicas] + ([self.full, self.padded] if self.padded > self.full else [])


def trim_padding(full: torch.Tensor, dim: int, length: int | None) -> torch.Tensor:
    """The padded tensor's first ``length`` rows along ``dim`` (the true vocabulary); None: nothing to trim."""
    return full if length is None else full.narrow(dim, 0, length).contiguous()


def gather_shards(
    local: torch.Tensor, comm: Any, dim: int, replicas: int = 1, full: int | None = None, padded: int | None = None
) -> torch.Tensor:
    """The full tensor from every TP rank's shard along ``dim`` (``replicas`` consecutive ranks hold each shard,
    ``full`` the true length of a vocabulary padded to ``padded`` rows: a checkpoint's ``tensor_parallel`` layout
    entry); a collective, every rank gets it."""
    every = _all_gather(local.detach(), comm, dim)
    shards = every.chunk(comm.size, dim)[::replicas]
    return trim_padding(torch.cat(shards, dim), dim, full).contiguous()


def _check_comm(comm: Any) -> None:
    if comm is None or not hasattr(comm, "size") or not hasattr(comm, "rank"):
        raise TypeError(f"expected the tensor-parallel Communicator, got {comm!r} (None means this rank is not a member)")


class TensorParallelModule(nn.Module):
    """Base of the parallel layers: ``shard_specs`` names each sharded parameter's layout (parameters not
    listed are replicated over the TP group)."""

    shard_specs: dict[str, ShardSpec]
    sequence_parallel: bool


# ---------------------------------------------------------------------------------------------- layers
class ColumnParallelLinear(TensorParallelModule):
    """``y = x Wᵀ + b`` with W's output rows split over the group: the output is this rank's feature slice
    (or the full features with ``gather_output``). With ``sequence_parallel`` the input is a sequence shard
    [B, S/tp, in] and is all-gathered first. ``block`` keeps whole heads together; ``replicate`` allows fewer
    blocks than ranks (KV heads of grouped-query attention), whose gradients are summed over the replicas."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Any,
        *,
        bias: bool = False,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        block: int = 1,
        replicate: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        what: str = "ColumnParallelLinear",
        input_in_region: bool = False,
        pad: bool = False,
    ) -> None:
        super().__init__()
        _check_comm(comm)
        self.comm, self.in_features, self.out_features = comm, in_features, out_features
        self.sequence_parallel, self.gather_output = sequence_parallel, gather_output
        # the caller already entered the TP region (a TokenRegion: several experts share one entry)
        self.input_in_region = input_in_region
        spec = ShardSpec(0, out_features, comm.size, block=block, replicate=replicate, pad=pad, what=what)
        if gather_output and spec.padded != out_features:
            raise ValueError(f"{what}: gather_output needs an even split, not padded shards")
        if gather_output and spec.replicas > 1:
            raise ValueError(f"{what}: gather_output needs an even split, not replicated shards")
        self.weight = nn.Parameter(torch.empty(spec.local, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(spec.local, dtype=dtype, device=device)) if bias else None
        self.shard_specs = {"weight": spec, **({"bias": spec} if bias else {})}

    @classmethod
    def from_full(cls, linear: nn.Linear, comm: Any, **kwargs: Any) -> "ColumnParallelLinear":
        """This rank's slice of a full ``nn.Linear`` (same seed on every rank → the shards tile it exactly)."""
        return _sliced_linear(cls, linear, comm, **kwargs)

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        return (
            f"in={self.in_features}, out={self.out_features} (local {spec.local}, replicas {spec.replicas}), "
            f"tp={self.comm.size}, sequence_parallel={self.sequence_parallel}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = enter_region(x, self.comm, self.sequence_parallel)
        spec = self.shard_specs["weight"]
        weight = _SumOverReplicas.apply(self.weight, spec, self.comm) if spec.replicas > 1 else self.weight
        bias = self.bias
        if bias is not None and spec.replicas > 1:
            bias = _SumOverReplicas.apply(bias, spec, self.comm)
        y = F.linear(x, weight, bias)
        return gather_from_tensor_parallel_region(y, self.comm) if self.gather_output else y


class RowParallelLinear(TensorParallelModule):
    """``y = x Wᵀ + b`` with W's input columns split over the group; ``x`` is this rank's feature slice (the
    output of a column-parallel layer). The partial outputs are all-reduced, or with ``sequence_parallel``
    reduce-scattered along the sequence ([B, S, out] partial → [B, S/tp, out]). The bias is replicated and
    added once, after the reduction."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Any,
        *,
        bias: bool = False,
        sequence_parallel: bool = False,
        block: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        what: str = "RowParallelLinear",
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        _check_comm(comm)
        self.comm, self.in_features, self.out_features = comm, in_features, out_features
        self.sequence_parallel = sequence_parallel
        # False: return this rank's partial sum; the caller reduces once for several layers (a TokenRegion)
        self.reduce_output = reduce_output
        if bias and not reduce_output:
            raise ValueError(f"{what}: a bias needs the reduced output (it is added once, after the reduction)")
        spec = ShardSpec(1, in_features, comm.size, block=block, what=what)
        self.weight = nn.Parameter(torch.empty(out_features, spec.local, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.shard_specs = {"weight": spec}

    @classmethod
    def from_full(cls, linear: nn.Linear, comm: Any, **kwargs: Any) -> "RowParallelLinear":
        return _sliced_linear(cls, linear, comm, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (local {self.shard_specs['weight'].local}), out={self.out_features}, "
            f"tp={self.comm.size}, sequence_parallel={self.sequence_parallel}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if not self.reduce_output:
            return partial
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.comm)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.comm)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding table split along the vocabulary: each rank looks up the ids in its range, zeros the others,
    and the ranks' rows are summed (all-reduce, or reduce-scatter to sequence shards with SP)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: Any,
        *,
        sequence_parallel: bool = False,
        block: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        what: str = "VocabParallelEmbedding",
    ) -> None:
        super().__init__()
        _check_comm(comm)
        self.comm, self.num_embeddings, self.embedding_dim = comm, num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        # padded to a multiple of block × tp (zero rows no id looks up): any vocabulary splits
        spec = ShardSpec(0, num_embeddings, comm.size, block=block, pad=True, what=f"{what} (vocab size {num_embeddings})")
        self.vocab_start = comm.rank * spec.local
        self.weight = nn.Parameter(torch.empty(spec.local, embedding_dim, dtype=dtype, device=device))
        self.shard_specs = {"weight": spec}

    @classmethod
    def from_full(cls, embedding: nn.Embedding, comm: Any, **kwargs: Any) -> "VocabParallelEmbedding":
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding.from_full: padding_idx / max_norm are not supported")
        mod = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            comm,
            dtype=embedding.weight.dtype,
            device=embedding.weight.device,
            **kwargs,
        )
        _load_slices(mod, embedding, comm.rank)
        return mod

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        local = spec.local
        return (
            f"vocab={self.num_embeddings} (padded {spec.padded}; rows {self.vocab_start}..{self.vocab_start + local - 1}), "
            f"dim={self.embedding_dim}, "
            f"tp={self.comm.size}, sequence_parallel={self.sequence_parallel}"
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(rows, self.comm)
        return reduce_from_tensor_parallel_region(rows, self.comm)


class SequenceShardedEmbedding(TensorParallelModule):
    """A replicated lookup table whose rows are *added* to the token embeddings (GPT's learned positions).
    Without SP it is the plain table. With SP the token embeddings arrive as this rank's sequence shard
    ([B, S/tp, H], :class:`VocabParallelEmbedding`'s reduce-scatter), so the rows are cut to the same shard
    (Megatron adds the positions before scattering; adding each rank's shard after it is the same sum). Each
    rank's weight gradient then covers its own positions only: a replicated parameter under SP, summed over
    the group by :func:`sync_replicated_grads`."""

    def __init__(self, embedding: nn.Embedding, comm: Any, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        _check_comm(comm)
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("SequenceShardedEmbedding: padding_idx / max_norm are not supported")
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = embedding.weight  # the same Parameter: replicated, nothing to slice
        self.shard_specs = {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        return _split(rows, self.comm, rows.ndim - 2) if self.sequence_parallel else rows


class VocabParallelHead(ColumnParallelLinear):
    """Output projection hidden → vocab split along the vocabulary. Its logits stay vocab-sharded
    ([..., V_padded/tp]); the model computes the loss through :meth:`cross_entropy`.

    The vocabulary is padded as :class:`VocabParallelEmbedding`'s (same ``block``). The padding columns'
    logits are -inf: they get no probability in the softmax, the loss, preference log-probabilities or
    sampling, and no gradient reaches their (zero) weight rows, so the model computes exactly what the
    unpadded one does."""

    shards_vocab = True  # the model's loss asks this before choosing the loss

    def __init__(self, in_features: int, out_features: int, comm: Any, **kwargs: Any) -> None:
        kwargs.setdefault("what", f"VocabParallelHead (vocab size {out_features})")
        super().__init__(in_features, out_features, comm, pad=True, **kwargs)
        start = comm.rank * self.shard_specs["weight"].local
        self.vocab_start = start
        # this rank's columns past the true vocabulary (none on most ranks)
        self.padding_columns = max(
            0, min(self.shard_specs["weight"].local, start + self.shard_specs["weight"].local - out_features)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.padding_columns:
            local = logits.shape[-1]
            pad = torch.arange(local, device=logits.device) >= local - self.padding_columns
            logits = logits.masked_fill(pad, float("-inf"))
        return logits

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.comm, ignore_index=ignore_index)

    def token_log_probs(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Per-token log-probability of the label (0 where it is ``ignore_index``), fp32, from vocab-sharded logits:
        the negated per-token cross-entropy, so preference objectives (DPO, ORPO) need no gathered logits either."""
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"token_log_probs: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must agree "
                f"on every dim but the last (vocab)"
            )
        per_token = _VocabParallelCrossEntropy.apply(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), self.comm, ignore_index
        )
        return -per_token.reshape(labels.shape)


def is_adapter(module: nn.Module) -> bool:
    """A low-rank adapter around a linear layer, by the protocol the model hub's LoRA declares
    (``nxdt.models.lora.LoRALinear``): ``base_layer``, ``lora_A`` [r, in], ``lora_B`` [out, r] (``nn.Linear``),
    ``lora_dropout`` and ``scaling``; ``y = base_layer(x) + scaling · lora_B(lora_A(lora_dropout(x)))``."""
    return (
        all(isinstance(getattr(module, part, None), nn.Linear) for part in ("base_layer", "lora_A", "lora_B"))
        and hasattr(module, "scaling")
        and hasattr(module, "lora_dropout")
    )


class LoRAParallelLinear(TensorParallelModule):
    """A LoRA adapter whose A/B split follows its base layer's (same submodule names as the unsharded adapter,
    so checkpoints and exports find every tensor by name):

    * ``column`` (base split by output rows): ``lora_B`` is split like the base (same head blocks, KV replicas
      as the base), ``lora_A`` is replicated and reads the input inside the TP region. Each rank's ``lora_A``
      gradient is then a *partial* sum (it saw only its rows of B's output gradient): it is declared in
      ``partial_grads`` and summed over TP after backward (:func:`sync_replicated_grads`). The input gradient
      through A is partial too and joins the base's in the region's one all-reduce. No extra collective.
    * ``row`` (base split by input columns): ``lora_A`` is split like the base by input columns, ``lora_B`` is
      replicated. B is linear, so ``B·Σ_r(A_r x_r) = Σ_r B·A_r x_r``: the adapter's partial output joins the
      base's partial output *before* the one reduction (all-reduce, or reduce-scatter along the sequence with
      SP) — no extra collective; ``lora_B``'s gradient is a partial sum, declared and summed like A's above.

    The math equals the unsharded adapter's exactly (up to fp32 summation order). Dropout draws from each rank's
    RNG: equal seeds keep the replicated input's mask equal over TP (column); a row layer's slices get
    per-slice masks."""

    def __init__(
        self,
        adapter: nn.Module,
        mode: str,
        comm: Any,
        *,
        sequence_parallel: bool = False,
        block: int = 1,
        replicate: bool = False,
        what: str = "LoRA adapter",
    ) -> None:
        super().__init__()
        _check_comm(comm)
        if mode not in ("column", "row"):
            raise ValueError(f"{what}: LoRA tensor-parallel mode {mode!r}: use 'column' or 'row'")
        base = adapter.base_layer
        self.comm, self.mode, self.sequence_parallel = comm, mode, sequence_parallel
        self.in_features, self.out_features = base.in_features, base.out_features
        self.scaling, self.lora_dropout = adapter.scaling, adapter.lora_dropout
        self.rank, self.alpha = getattr(adapter, "rank", adapter.lora_A.out_features), getattr(adapter, "alpha", None)
        self.input_in_region = False  # column: set when the enclosing block entered the region already
        self.adapter_enabled = True  # False: the base layer alone (models.lora.adapters_disabled)
        if mode == "column":
            self.base_layer = ColumnParallelLinear.from_full(
                base, comm, sequence_parallel=sequence_parallel, block=block, replicate=replicate, input_in_region=True, what=what
            )
            self.lora_A = _replicated_copy(adapter.lora_A)
            self.lora_B = ColumnParallelLinear.from_full(
                adapter.lora_B, comm, block=block, replicate=replicate, input_in_region=True, what=f"{what} lora_B"
            )
            self.partial_grads = {"lora_A.weight"}
        else:
            self.base_layer = RowParallelLinear.from_full(base, comm, sequence_parallel=sequence_parallel, block=block, what=what)
            self.lora_A = RowParallelLinear.from_full(
                adapter.lora_A, comm, block=block, reduce_output=False, what=f"{what} lora_A"
            )
            self.lora_B = _replicated_copy(adapter.lora_B)
            self.partial_grads = {"lora_B.weight"}
        self.shard_specs = {}  # its parameters live in the submodules (their own shard_specs)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, in={self.in_features}, out={self.out_features}, scaling={self.scaling:g}, tp={self.comm.size}"

    def delta_weight(self) -> torch.Tensor:
        """This rank's part of scaling·B·A (column: its rows; row: its columns), in the base weight's dtype."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (delta * self.scaling).to(self.base_layer.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "column":
            if not self.input_in_region:
                x = enter_region(x, self.comm, self.sequence_parallel)
            if not self.adapter_enabled:
                return self.base_layer(x)
            return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        base = self.base_layer
        partial = F.linear(x, base.weight)
        if self.adapter_enabled:
            partial = partial + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.comm)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.comm)
        return y + base.bias if base.bias is not None else y


def _replicated_copy(linear: nn.Linear) -> nn.Linear:
    """A separate ``nn.Linear`` with the same weights (every TP rank holds all of it)."""
    weight = linear.weight
    copy = nn.Linear(
        linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=weight.dtype, device=weight.device
    )
    copy.load_state_dict(linear.state_dict())
    copy.requires_grad_(linear.weight.requires_grad)
    return copy


def _sliced_linear(cls: Any, linear: nn.Linear, comm: Any, **kwargs: Any) -> Any:
    """This rank's ``cls`` (a column- or row-parallel layer) cut from a full ``nn.Linear``: in its dtype, on its device."""
    mod = cls(
        linear.in_features,
        linear.out_features,
        comm,
        bias=linear.bias is not None,
        dtype=linear.weight.dtype,
        device=linear.weight.device,
        **kwargs,
    )
    _load_slices(mod, linear, comm.rank)
    return mod


def _load_slices(mod: TensorParallelModule, full: nn.Module, rank: int) -> None:
    with torch.no_grad():
        for name, param in mod.named_parameters(recurse=False):
            source = getattr(full, name)
            spec = mod.shard_specs.get(name)
            param.copy_(spec.slice(source, rank) if spec is not None else source.detach())
            param.requires_grad_(source.requires_grad)  # a frozen weight (LoRA's base) stays frozen


# ---------------------------------------------------------------------------------------------- loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token -log softmax(logits)[label] over logits split along the vocab: the max, the sum of exps and
    the target logit are all-reduced, so nothing of size vocab crosses the wire."""

    @staticmethod
    def forward(ctx, logits, labels, comm, ignore_index):
        local_vocab = logits.shape[-1]
        start = comm.rank * local_vocab
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, "max", stream=TP_STREAM)  # the same shift on every rank
        shifted = logits - row_max.unsqueeze(-1)
        local_label = labels - start
        mine = (local_label >= 0) & (local_label < local_vocab)
        local_label = torch.where(mine, local_label, 0)
        # where, not a product: on a rank holding only vocabulary padding the gathered logit is -inf, and -inf·0 is nan
        target = torch.where(mine, shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), target])  # one all-reduce for both
        comm.all_reduce(sums, stream=TP_STREAM)
        sum_exp, target = sums[0], sums[1]
        valid = labels != ignore_index
        loss = torch.where(valid, sum_exp.log() - target, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, reused in place for the gradient
        ctx.save_for_backward(exp, local_label, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_label, hit, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_label.unsqueeze(-1), -hit.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, comm: Any, *, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over tokens whose label is not ``ignore_index``, in fp32, from logits [..., V/tp]
    holding this rank's contiguous vocab block (rank r: ids r·V/tp .. (r+1)·V/tp - 1); labels [...] are full
    vocab ids, the same on every rank. Equal to ``F.cross_entropy(full_logits, labels, ignore_index=...)``
    (NaN when every label is ignored, as there)."""
    _check_comm(comm)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
            f"must agree on every dim but the last (vocab)"
        )
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    per_token = _VocabParallelCrossEntropy.apply(flat_logits, flat_labels, comm, ignore_index)
    return per_token.sum() / (flat_labels != ignore_index).sum()


# ---------------------------------------------------------------------------------------------- applying a plan
def _parse_style(style: str) -> tuple[str, int]:
    name, _, block = style.partition(":")
    if name not in STYLES:
        raise ValueError(
            f"tensor-parallel style {style!r} unknown; use one of {sorted(STYLES)} (colwise/rowwise/colwise_kv "
            f"take an optional ':<block rows>', e.g. 'colwise:64' for heads of 64)"
        )
    try:
        return name, int(block) if block else 1
    except ValueError:
        raise ValueError(f"tensor-parallel style {style!r}: the block after ':' must be an integer") from None


def _build(style: str, module: nn.Module, comm: Any, sequence_parallel: bool, what: str) -> TensorParallelModule:
    name, block = _parse_style(style)
    if name in ("colwise_in_region", "rowwise_partial"):  # inside a TokenRegion: it does the collectives
        if not isinstance(module, nn.Linear):
            raise TypeError(f"tensor-parallel plan: {what} is a {type(module).__name__}; style {style!r} needs a torch.nn.Linear")
        if name == "rowwise_partial":
            return RowParallelLinear.from_full(module, comm, block=block, reduce_output=False, what=f"{what} ({style})")
        return ColumnParallelLinear.from_full(module, comm, block=block, input_in_region=True, what=f"{what} ({style})")
    if is_adapter(module):  # LoRA: A/B split by the base layer's style
        if name not in ("colwise", "colwise_kv", "rowwise"):
            raise TypeError(
                f"tensor-parallel plan: {what} is a LoRA adapter; style {style!r} cannot split one (adapters "
                f"follow colwise, colwise_kv or rowwise layers)"
            )
        return LoRAParallelLinear(
            module,
            "row" if name == "rowwise" else "column",
            comm,
            sequence_parallel=sequence_parallel,
            block=block,
            replicate=name == "colwise_kv",
            what=f"{what} ({style}, LoRA)",
        )
    expected = nn.Embedding if name in ("vocab_embedding", "sequence_embedding") else nn.Linear
    if not isinstance(module, expected):
        raise TypeError(
            f"tensor-parallel plan: {what} is a {type(module).__name__}; style {style!r} needs a torch.nn.{expected.__name__} "
            f"(was the model already parallelised?)"
        )
    what = f"{what} ({style})"
    if name == "sequence_embedding":
        return SequenceShardedEmbedding(module, comm, sequence_parallel=sequence_parallel)
    if name == "vocab_embedding":
        return VocabParallelEmbedding.from_full(module, comm, sequence_parallel=sequence_parallel, block=block, what=what)
    if name == "vocab_head":
        return VocabParallelHead.from_full(module, comm, sequence_parallel=sequence_parallel, block=block, what=what)
    if name == "rowwise":
        return RowParallelLinear.from_full(module, comm, sequence_parallel=sequence_parallel, block=block, what=what)
    return ColumnParallelLinear.from_full(
        module, comm, sequence_parallel=sequence_parallel, block=block, replicate=name == "colwise_kv", what=what
    )


STYLES = {
    "colwise": "output features split (whole blocks of ':<n>' rows, e.g. attention heads)",
    "colwise_kv": "key/value heads of grouped-query attention: split like colwise, or replicated when the tensor-parallel "
    "size is a multiple of the head count",
    "rowwise": "input features split; outputs all-reduced (reduce-scattered along the sequence with SP)",
    "vocab_embedding": "embedding table split along the vocabulary, padded with zero rows to a multiple of "
    "':<n>' × TP (Megatron's make_vocab_size_divisible_by; default 1)",
    "vocab_head": "output head split along the vocabulary (padded as vocab_embedding, padding logits -inf); the loss "
    "runs on vocab-sharded logits",
    "sequence_embedding": "a replicated table added to the token embeddings (learned positions): with SP each rank "
    "keeps the rows of its sequence shard",
    "token_region": "a block running sharded layers on token rows (mixture of experts): the module keeps its class and "
    "gets a TokenRegion in its `tensor_parallel_region` attribute",
    "input_region": "a block whose column-parallel layers all read its first input (attention q/k/v, MLP gate/up): the "
    "input enters the region once for all of them",
    "colwise_in_region": "colwise inside a token_region block (no collective of its own)",
    "head_norm": "a norm applied to every attention head alike (Qwen3's q/k RMSNorm) on the heads a rank holds: the "
    "module stays replicated, its gradient is a partial sum over the group (summed by sync_replicated_grads)",
    "rowwise_partial": "rowwise inside a token_region block: returns partial sums, the region reduces them once",
}


def apply_tensor_parallel(
    model: nn.Module, tp_comm: Any, *, sequence_parallel: bool = False, plan: dict[str, str] | None = None
) -> nn.Module:
    """Swap ``model``'s modules for tensor-parallel ones as ``plan`` declares (default: ``model.tensor_parallel_plan()``)
    and return it. Every rank must hold the same full weights (same seed): each keeps its slice. Modules outside the plan
    stay replicated. Weights shared by two planned modules (tied embeddings) stay shared when both are cut
    the same way. With ``sequence_parallel`` everything between a row-parallel and the next column-parallel
    module runs on [B, S/tp, H]; call :func:`sync_replicated_grads` after each backward."""
    _check_comm(tp_comm)
    if plan is None:
        plan_fn = getattr(model, "tensor_parallel_plan", None)
        if plan_fn is None:
            raise TypeError(
                f"{type(model).__name__} declares no tensor_parallel_plan() and no plan= was given (a model family's: "
                f"nxdt.config.hf_model.tensor_parallel_plan_of); map submodule names to styles {sorted(STYLES)}"
            )
        plan = plan_fn()
    for style in plan.values():
        _parse_style(style)
    matched = {pattern: 0 for pattern in plan}
    shared: dict[tuple[int, str], nn.Parameter] = {}  # (id of a full weight, how it is cut) → the shard built from it
    regions: list[str] = []  # input_region blocks: their column-parallel layers must not enter again
    for name, module in list(model.named_modules()):
        patterns = [p for p in plan if fnmatch.fnmatchcase(name, p)]
        if not patterns:
            continue
        if len(patterns) > 1:
            raise ValueError(f"tensor-parallel plan: module {name!r} matches several entries {patterns}; make them disjoint")
        style = plan[patterns[0]]
        matched[patterns[0]] += 1
        if style == "input_region":
            module.register_forward_pre_hook(_EnterRegionHook(tp_comm, sequence_parallel, name))
            regions.append(name)
            continue
        if style == "head_norm":
            module.partial_grads_over_tp = tuple(n for n, _ in module.named_parameters())
            continue
        if style == "token_region":
            if not hasattr(module, "tensor_parallel_region"):
                raise TypeError(
                    f"tensor-parallel plan: {name} ({type(module).__name__}) has no `tensor_parallel_region` "
                    f"attribute; style 'token_region' is for blocks that call a TokenRegion"
                )
            module.tensor_parallel_region = TokenRegion(tp_comm, sequence_parallel)
            continue
        parallel = _build(style, module, tp_comm, sequence_parallel, name)
        holder = parallel.base_layer if isinstance(parallel, LoRAParallelLinear) else parallel  # the layer owning the weight
        full_weight = module.base_layer.weight if holder is not parallel else module.weight
        kind, block = _parse_style(style)  # a tied table: embedding and head cut (and padded) alike share one shard
        key = (id(full_weight), f"vocab:{block}" if kind in ("vocab_embedding", "vocab_head") else style)
        if key in shared:
            holder.weight = shared[key]  # tied weights: one shard, two users
        else:
            shared[key] = holder.weight
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, parallel)
    unused = [p for p, n in matched.items() if n == 0]
    if unused:
        raise ValueError(f"tensor-parallel plan entries {unused} match no module of {type(model).__name__}")
    for name in regions:
        columns = [
            m
            for m in model.get_submodule(name).modules()
            if isinstance(m, ColumnParallelLinear) or (isinstance(m, LoRAParallelLinear) and m.mode == "column")
        ]
        if not columns:
            raise ValueError(
                f"tensor-parallel plan: {name} is an 'input_region' block but holds no column-parallel layer; "
                f"declare its layers colwise or drop the entry"
            )
        for m in columns:
            m.input_in_region = True
    return model


# ---------------------------------------------------------------------------------------------- gradients, export
def _owner_spec(model: nn.Module, name: str) -> ShardSpec | None:
    path, _, attr = name.rpartition(".")
    owner = model.get_submodule(path)
    return owner.shard_specs.get(attr) if isinstance(owner, TensorParallelModule) else None


def shard_spec(model: nn.Module, name: str) -> ShardSpec | None:
    """The ShardSpec of parameter ``name`` of ``model`` (any module containing the parallel layers; names
    relative to it), None when the parameter is replicated over the TP group."""
    return _owner_spec(model, name)


def uses_sequence_parallel(model: nn.Module) -> bool:
    return any(isinstance(m, TensorParallelModule) and m.sequence_parallel for m in model.modules())


def partial_grad_names(model: nn.Module) -> set[str]:
    """Parameters (by name in ``model``) whose gradient after backward is a partial sum over the TP group, to be
    summed by :func:`sync_replicated_grads`: with sequence parallelism every replicated one (each rank saw its
    sequence shard), and always the ones a parallel layer declares in ``partial_grads`` (LoRA's replicated
    half, :class:`LoRAParallelLinear`) and those of ``head_norm`` modules (each rank normed its own heads)."""
    declared = {
        f"{prefix}.{rel}" if prefix else rel
        for prefix, m in model.named_modules()
        for rel in (
            *(getattr(m, "partial_grads", ()) if isinstance(m, TensorParallelModule) else ()),
            *getattr(m, "partial_grads_over_tp", ()),  # 'head_norm' modules
        )
    }
    sequence_parallel = uses_sequence_parallel(model)
    return {
        name
        for name, _ in model.named_parameters()
        if name in declared or (sequence_parallel and _owner_spec(model, name) is None)
    }


def sync_replicated_grads(model: nn.Module, tp_comm: Any) -> int:
    """After backward: sum over the TP group the gradients that are partial sums over it
    (:func:`partial_grad_names`: replicated parameters under sequence parallelism — each rank saw only its
    sequence shard — and LoRA's replicated half). Without sequence parallelism and adapters nothing is sent.
    Returns the number of tensors synchronised (the same on every rank). One all-reduce per dtype."""
    partial = partial_grad_names(model)
    if not partial:
        return 0
    replicated = [p for name, p in model.named_parameters() if p.grad is not None and name in partial]
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in replicated:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        tp_comm.all_reduce(flat, stream=TP_STREAM)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()
    return len(replicated)


def shard_layout(model: nn.Module) -> dict[str, list[int]]:
    """``{parameter name: [dim, replicas(, full, padded)]}`` for every tensor-parallel-sharded parameter (what a
    checkpoint needs to reassemble full tensors from the TP ranks' files: concatenate along ``dim``, one copy per
    ``replicas`` consecutive ranks, then keep the first ``full`` of a padded vocabulary's ``padded`` rows)."""
    layout = {}
    for name, _ in model.named_parameters(remove_duplicate=False):  # tied weights: every name that holds a shard
        spec = _owner_spec(model, name)
        if spec is not None:
            layout[name] = spec.layout()
    return layout


def norm_weights(model: nn.Module, tp_size: int) -> dict[str, float]:
    """Per parameter, the factor that makes ``Σ_ranks Σ_params weight·‖grad‖²`` over the TP group the squared
    norm of the full model's gradient: 1 for a shard held once, 1/replicas for a shard several ranks hold,
    1/tp for a parameter every rank holds."""
    weights = {}
    for name, _ in model.named_parameters():
        spec = _owner_spec(model, name)
        weights[name] = 1.0 / (spec.replicas if spec is not None else tp_size)
    return weights


def _full(model: nn.Module, name: str, tensor: torch.Tensor, tp_comm: Any) -> torch.Tensor:
    spec = _owner_spec(model, name)
    return spec.gather(tensor, tp_comm) if spec is not None else tensor.detach().clone()


def gather_full_state_dict(model: nn.Module, tp_comm: Any) -> dict[str, torch.Tensor]:
    """The unsharded state dict (same keys as the model before :func:`apply_tensor_parallel`) on every rank.
    Collective: every rank of the TP group calls it."""
    return {name: _full(model, name, value, tp_comm) for name, value in model.state_dict().items()}


def gather_full_grads(model: nn.Module, tp_comm: Any) -> dict[str, torch.Tensor]:
    """Unsharded gradients by parameter name, on every rank (call after :func:`sync_replicated_grads`)."""
    return {name: _full(model, name, p.grad, tp_comm) for name, p in model.named_parameters() if p.grad is not None}
