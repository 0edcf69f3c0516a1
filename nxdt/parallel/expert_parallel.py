"""Expert parallelism: each rank of an EP group holds E/EP experts of every MoE layer; tokens travel to
their experts and back with two uneven all-to-alls.

EP subdivides data parallelism: every EP rank runs the *whole* model (attention, router, norms, embeddings
replicated) on its *own* tokens; only the experts are split. Rank r of an EP group of size EP keeps the
experts ``[r·E/EP, (r+1)·E/EP)`` of a full model built with the same seed (so slicing equals initialising
the slice), keeping their global names (``experts.5.w1.weight`` stays ``experts.5.w1.weight``).

One MoE layer, per rank (rows = (token, top-k slot) pairs sorted by global expert id)::

    counts[E]        ──all_to_all (equal splits)──▶ recv_counts[EP, E/EP]   how many rows each source sends
    rows[N, h]       ──all_to_all (uneven: Σ counts per owner → Σ recv_counts per source)──▶ received
    received, regrouped by local expert ──experts──▶ outputs, put back in (source, expert) order
    outputs          ──reverse all_to_all──▶ the rows' expert outputs, in the order they were sent

Both data all-to-alls are autograd Functions whose backward is the reverse all-to-all, so gradients of
the experts land on their owner and gradients of the rows return to the rank that owns the tokens.

Example (inside a spawned world; world = one EP group = the data-parallel group)::

    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)                       # full model, same seed on every rank
    ep = world.new_communicator(list(range(world.world_size)), "ep")
    apply_expert_parallel(model, ep)                      # keeps experts [r·E/EP, (r+1)·E/EP)
    loss = model.loss_fn(model(my_ids), my_labels)        # my_ids: this rank's own tokens
    loss.backward()
    dense, experts = split_expert_parameters(model)
    for p in dense: dp.all_reduce(p.grad, "avg")          # as plain data parallelism
    reduce_expert_gradients(model, data_parallel_size=dp.size)   # expert grads: see below

**Gradient reduction, exactly.** Let D be the data-parallel degree (number of replicas of the dense
parameters, EP | D), rank r's loss L_r the mean over its own tokens, and the trained loss
L = (1/D)·Σ_r L_r (what data parallelism's *average* implements). After ``L_r.backward()`` on every rank:

* a dense parameter holds ∂L_r/∂θ → all-reduce **avg** over the D data-parallel ranks gives ∂L/∂θ;
* an expert parameter, on its owner, holds Σ_{r in its EP group} ∂L_r/∂W (every rank's tokens routed to
  it sent their gradient back through the all-to-all), so ∂L/∂W = (1/D)·Σ over the D/EP *expert-data-
  parallel* replicas of that sum: all-reduce **sum** over the expert-DP group (ranks with the same EP
  rank in different EP groups; None when D = EP) and **divide by D** — ``reduce_expert_gradients``.

Expert parameters must never enter the dense DP all-reduce: ranks of one EP group hold *different* experts
of identical shape, so averaging them would be silently wrong. They carry ``param.expert_parallel = True``;
``split_expert_parameters`` separates them. With that reduction, EP training equals a single process
training on the concatenated batch (tests/parallel/test_moe.py checks gradients and 5 optimizer steps).

The model side is duck-typed (this layer does not import the model hub): an MoE block is any module with
``num_experts``, ``experts`` (ModuleDict keyed by global expert id), ``expert_ids``,
``run_experts(rows, counts, expert_ids)`` and a replaceable ``dispatcher(block, rows, counts)`` —
``nxdt.models.mixtral.SparseMoeBlock``.
"""

from __future__ import annotations

import fnmatch

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from nxdt.comm.world import Communicator

__all__ = [
    "apply_expert_parallel",
    "ExpertParallelDispatcher",
    "all_to_all_rows",
    "split_expert_parameters",
    "is_expert_parameter",
    "reduce_expert_gradients",
    "moe_blocks",
    "routed_parameters",
    "copy_expert_marks",
    "take_touched_experts",
    "expert_of",
]


class _AllToAllRows(torch.autograd.Function):
    """Rows of a 2-D tensor exchanged with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, comm: Communicator, output_splits: list[int], input_splits: list[int], stream: str
    ) -> torch.Tensor:
        ctx.comm, ctx.output_splits, ctx.input_splits, ctx.stream = comm, output_splits, input_splits, stream
        out = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
        comm.all_to_all(out, rows.contiguous(), output_splits, input_splits, stream=stream)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        ctx.comm.all_to_all(back, grad.contiguous(), ctx.input_splits, ctx.output_splits, stream=ctx.stream)
        return back, None, None, None, None


def all_to_all_rows(
    rows: torch.Tensor, comm: Communicator, output_splits: list[int], input_splits: list[int], stream: str = "default"
) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0: ``input_splits[d]`` rows go to group rank d,
    ``output_splits[s]`` rows arrive from group rank s (concatenated in source order)."""
    return _AllToAllRows.apply(rows, comm, list(output_splits), list(input_splits), stream)


class ExpertParallelDispatcher:
    """A MoE block's ``dispatcher`` under expert parallelism (see the module docstring for the exchange)."""

    def __init__(self, comm: Communicator, num_experts: int, stream: str = "default") -> None:
        self.comm, self.num_experts, self.stream = comm, num_experts, stream
        self.local = num_experts // comm.size

    def __call__(self, block: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.comm.size, self.local
        counts = counts.to(torch.int64).contiguous()
        recv_counts = torch.empty_like(counts)  # [EP sources × local experts]
        self.comm.all_to_all(recv_counts, counts, stream=self.stream)
        recv_matrix = recv_counts.view(ep, local)
        send_splits = counts.view(ep, local).sum(1).tolist()  # rows are sorted by expert, so owners are contiguous
        recv_splits = recv_matrix.sum(1).tolist()
        received = all_to_all_rows(rows, self.comm, recv_splits, send_splits, self.stream)
        # received is ordered (source, local expert); the experts want (local expert, source)
        expert_of_row = torch.arange(local, device=recv_counts.device).repeat(ep).repeat_interleave(recv_counts)
        by_expert = torch.argsort(expert_of_row, stable=True)
        outputs = block.run_experts(received[by_expert], recv_matrix.sum(0).tolist(), block.expert_ids)
        outputs = outputs[torch.argsort(by_expert)]  # back to (source, local expert) order
        return all_to_all_rows(outputs, self.comm, send_splits, recv_splits, self.stream)


def _is_moe_block(module: nn.Module) -> bool:
    return (
        isinstance(getattr(module, "experts", None), nn.ModuleDict)
        and hasattr(module, "dispatcher")
        and hasattr(module, "num_experts")
    )


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _is_moe_block(m)]


def routed_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters of every MoE block's experts (sliced by EP or not): a token reaches an expert only where
    the router sends it, so an expert may get no gradient on a data-parallel rank — or on any — in a step as a matter of
    course. Data-parallel runtimes never refuse them as unused: a missing gradient counts as zero in the average, and
    an expert no rank has one for got no token of the whole batch and is left untouched, as one process's optimizer
    skips a parameter whose gradient is None."""
    return {id(p) for block in moe_blocks(model) for p in block.experts.parameters()}


def apply_expert_parallel(
    model: nn.Module, ep_comm: Communicator | None, stream: str = "default", blocks: str | None = None
) -> nn.Module:
    """Keep experts ``[rank·E/EP, (rank+1)·E/EP)`` of every MoE block of ``model`` (a full model built with
    the same seed on every rank) and route tokens over ``ep_comm`` with all-to-all. Returns ``model``
    (modified in place). ``ep_comm`` None or of size 1: nothing changes. ``blocks``: the blocks' module name pattern
    (a model family's spec names it: ``ModelSpec.parallel.experts``); default every module shaped as one."""
    if ep_comm is None or ep_comm.size == 1:
        return model
    if blocks is None:
        found = moe_blocks(model)
    else:
        found = [m for name, m in model.named_modules() if fnmatch.fnmatchcase(name, blocks)]
        wrong = [type(m).__name__ for m in found if not _is_moe_block(m)]
        if wrong:
            raise ValueError(f"apply_expert_parallel: {blocks} matches {wrong[0]}, no MoE block (experts + dispatcher)")
    if not found:
        raise ValueError(
            f"apply_expert_parallel: {type(model).__name__} has no MoE block (a module with an "
            f"'experts' ModuleDict and a 'dispatcher'); expert parallelism needs a mixture-of-experts model"
        )
    ep, rank = ep_comm.size, ep_comm.rank
    for block in found:
        experts = block.num_experts
        if experts % ep:
            raise ValueError(
                f"apply_expert_parallel: model.moe.num_experts={experts} is not divisible by "
                f"expert_model_parallel_size={ep}; use a degree that divides it"
            )
        if block.expert_ids != list(range(experts)):
            raise ValueError(
                "apply_expert_parallel: the model already holds a subset of its experts "
                f"({block.expert_ids}); apply it once, to the full model"
            )
        lo, hi = rank * experts // ep, (rank + 1) * experts // ep
        for key in list(block.experts.keys()):
            if not lo <= int(key) < hi:
                del block.experts[key]
        for p in block.experts.parameters():
            p.expert_parallel = True  # owner-local: excluded from the dense data-parallel reduction
        block.dispatcher = ExpertParallelDispatcher(ep_comm, experts, stream)
    return model


def is_expert_parameter(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def take_touched_experts(model: nn.Module) -> dict[str, bool]:
    """Whether each expert this rank holds ran on any token row in a forward with gradients since the last call, by
    its module's name prefix in ``model`` (``layers.0.block_sparse_moe.experts.5.``); the counts start again. What a
    data-parallel runtime asks instead of gradient presence: an EP rank whose experts received no row runs one of them
    on the empty rows (the all-to-all's backward needs the path), which gives that expert a zero gradient where one
    process, whose every token reaches some expert here, gives it none. Blocks without counts (``rows_seen``) are
    left out (gradient presence decides for them)."""
    touched: dict[str, bool] = {}
    for name, block in model.named_modules():
        seen = getattr(block, "rows_seen", None)
        if not _is_moe_block(block) or seen is None:
            continue
        for e in block.expert_ids:
            touched[f"{name}.experts.{e}." if name else f"experts.{e}."] = seen.get(e, 0) > 0
        seen.clear()
    return touched


def expert_of(name: str) -> str | None:
    """The expert module prefix of a parameter name (``...experts.5.w1.weight`` → ``...experts.5.``), None if none."""
    head, sep, tail = name.rpartition("experts.")
    if not sep or (head and not head.endswith(".")):
        return None
    number = tail.split(".", 1)[0]
    return f"{head}{sep}{number}." if number.isdigit() else None


def copy_expert_marks(source: nn.Module, copy: nn.Module) -> nn.Module:
    """Flag ``copy``'s expert parameters as ``source``'s are (a ``copy.deepcopy`` of a model drops the flag, a tensor
    attribute: a frozen reference model sharded by FSDP must still shard its experts over their replicas). Returns
    ``copy``."""
    for (name, p), (other, q) in zip(source.named_parameters(), copy.named_parameters(), strict=True):
        if name != other:
            raise ValueError(f"copy_expert_marks: {other} where the source has {name}; pass a copy of the same model")
        if is_expert_parameter(p):
            q.expert_parallel = True
    return copy


def split_expert_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense parameters — replicated, reduce over DP; expert parameters — owner-local, see
    ``reduce_expert_gradients``), each in ``model.parameters()`` order."""
    dense: list[nn.Parameter] = []
    experts: list[nn.Parameter] = []
    for p in model.parameters():
        (experts if is_expert_parameter(p) else dense).append(p)
    return dense, experts


@torch.no_grad()
def reduce_expert_gradients(
    model: nn.Module,
    data_parallel_size: int,
    expert_dp_comm: Communicator | None = None,
    skip: Collection[int] = (),
) -> None:
    """Turn each expert parameter's local gradient (Σ over its EP group's per-rank losses) into the gradient
    of the data-parallel *mean* loss: all-reduce sum over ``expert_dp_comm`` (the D/EP replicas of the
    same experts; None when D = EP), then divide by ``data_parallel_size`` D. A None gradient counts as
    zero when other replicas have one; an expert no replica's tokens reached (its block's routing counts,
    :func:`take_touched_experts`; a gradient present where a block keeps none) got no token of the whole batch and
    keeps None (the optimizer skips it, as it would in one process). ``skip``: ids of expert parameters reduced
    elsewhere (a ZeRO-1 optimizer's buckets)."""
    if data_parallel_size < 1:
        raise ValueError(f"reduce_expert_gradients: data_parallel_size={data_parallel_size} must be >= 1")
    experts = [p for p in split_expert_parameters(model)[1] if id(p) not in skip]
    if not experts:
        return
    touched = take_touched_experts(model)
    names = {id(p): n for n, p in model.named_parameters()}
    # 1 where this rank's tokens reached the expert (its routing counts; without them, a gradient present)
    routed_here = [
        float(touched.get(expert_of(names[id(p)]) or "", p.grad is not None)) if id(p) in names else float(p.grad is not None)
        for p in experts
    ]
    if expert_dp_comm is not None and expert_dp_comm.size > 1:
        # the gradients, then one 1/0 per parameter: the same all-reduce tells which no replica has
        flat = torch.cat(
            [
                p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                for p in experts
            ]
            + [torch.tensor(routed_here, dtype=experts[0].dtype, device=experts[0].device)]
        )
        expert_dp_comm.all_reduce(flat, "sum")
        offset, routed = 0, flat[-len(experts) :].tolist()
        for p, n in zip(experts, routed):
            if n == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            else:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    else:
        for p, n in zip(experts, routed_here):
            if n == 0:  # no token here and no replica: untouched, as one process skips it
                p.grad = None
    for p in experts:
        if p.grad is not None:
            p.grad.div_(data_parallel_size)
