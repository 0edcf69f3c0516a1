"""ZeRO-1: optimizer state sharded over data parallelism, with optional fp32 master weights.

Every trainable parameter of a param group is placed in one contiguous *bucket* (one per param group ×
dtype × device); the model's parameters become views of that buffer. The bucket is padded to a multiple
of the data-parallel size ``DP`` and cut into ``DP`` equal shards; rank ``r`` owns shard ``r`` and keeps
the inner optimizer (AdamW in practice) and its state for that shard only — optimizer memory drops
from ``S`` to ``S / DP`` per rank. One ``step()``::

    grads of the bucket ──reduce-scatter(avg, stream "dp")──▶ owned grad shard (fp32 with master weights)
    [clip_grad_norm_: ‖g‖² of each shard, all-reduced over DP (and TP/PP groups) → one global norm]
    inner optimizer updates the owned shard (the fp32 master copy with ``master_weights=True``)
    owned shard (cast to the parameter dtype) ──all-gather(stream "dp")──▶ the bucket = the parameters

Worked example (inside a spawned world, DP = all ranks)::

    dp = world.world
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = Zero1Optimizer([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                         torch.optim.AdamW, dp, model=model, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))   # edits opt.param_groups
    loss_fn(model(x_local), y_local).backward()       # x_local: this rank's part of the global batch
    opt.clip_grad_norm_(1.0)                          # same value as clip_grad_norm_ on one process
    opt.step(); sched.step(); opt.zero_grad()

Semantics worth knowing:

* Gradients are averaged over DP (each rank's loss must be the mean over its equal share of the batch).
* Expert parallelism (``expert_dp_comm``, ``expert_parallel_size``): the EP ranks of a DP group hold *different*
  experts of the same shapes, so expert parameters get buckets of their own, sharded over the expert-data-parallel
  group (the replicas of the same experts; whole on every rank when DP = EP). Their local gradient is the sum over the
  EP group's losses (``nxdt.parallel.expert_parallel``): summed over that group and divided by DP, as
  ``reduce_expert_gradients`` does. Every element of every expert still lies in exactly one DP rank's shard, so the
  gradient norm is one all-reduce over DP as before. No one rank holds every expert's state, so the live
  ``consolidated_*`` methods refuse; ``consolidate_shard_states`` joins saved shards given one EP rank's replicas', and
  ``load_consolidated_state_dict`` takes this rank's part of a full state (its own experts).
* A trainable parameter whose ``.grad`` is None on some DP rank is refused by name (``reduce_gradients`` raises
  on every rank; the used/unused count is one small all-reduce per reduction), as DDP refuses it by default. With
  ``find_unused_parameters=True`` (DDP's name) a gradient missing on some ranks counts as zero there, and a
  parameter no rank has a gradient for is left untouched by the step — its weights and its part of the inner
  optimizer's state are restored after the flat update, as torch's optimizers skip a parameter whose grad is None
  (the inner optimizer's step counter is per bucket, so a parameter that is used again later is bias-corrected
  with the bucket's count). MoE experts (``nxdt.parallel.expert_parallel.routed_parameters``, sliced by EP or not) are exempt: routing decides per
  step which experts get tokens; a missing expert gradient counts as zero, and an expert none of its replicas has a
  gradient for (no token of the whole batch) is left untouched, as one process skips it. Frozen parameters
  (``requires_grad=False``) are not placed in buckets and never change, as with torch's optimizers.
* ``clip_grad_norm_`` clips the reduced shard gradients that ``step`` uses; the model's ``.grad``
  tensors keep the local, unreduced values — unless ``full_gradients`` is set: then the reduction is one
  all-reduce and every ``.grad`` holds the DP average (before clipping), as under DDP.
* ``overlap_with_backward`` (what ``NxDStrategy`` sets up by default where :func:`~nxdt.parallel.overlap.order_free`
  holds: a DP group of 2, or any size on one host's shm) moves the reduce-scatter into the last backward: DDP's
  buckets of each bucket, from its end, each reduced to the owners of the shards it covers on the ``dp`` stream as its
  gradients arrive (:mod:`nxdt.parallel.overlap`); the shards' gradients are bitwise those of the reduce-scatter.
* ``state_dict()`` is per rank (its shard, its master weights and the layout); ``load_state_dict``
  needs the same layout and DP size, or accepts a consolidated (torch-format) state dict, which
  reshards onto any DP size. ``consolidated_state_dict()`` returns what an unsharded optimizer of the
  same class would return from ``state_dict()`` after the same training; ``consolidate_shard_states``
  computes the same from the saved shards of every DP rank, without processes (checkpoint tools).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nxdt.comm.stream import Work
from nxdt.comm.world import Communicator
from nxdt.parallel import squared_norm
from nxdt.parallel.expert_parallel import expert_of, is_expert_parameter, routed_parameters, take_touched_experts
from nxdt.parallel.overlap import DP_STREAM, BackwardReduction, cap_elements, order_free, plan_buckets

__all__ = ["Zero1Optimizer", "STATE_FORMAT", "consolidate_shard_states", "unused_parameters_message"]

STATE_FORMAT = "nxdt.zero1/v1"


@dataclass
class _Bucket:
    """One contiguous buffer: the trainable params of one group with one dtype on one device."""

    group_index: int
    params: list[nn.Parameter]
    indices: list[int]  # each param's index in a torch-format state dict
    offsets: list[int]  # each param's first element in ``flat``
    numel: int  # elements without padding
    shard_size: int
    flat: torch.Tensor  # the parameters' storage, padded to shard_size × DP
    shard: nn.Parameter  # the owned slice, the tensor the inner optimizer updates (fp32 with master weights)
    comm: Communicator | None  # the group the shards span (None: one shard, the whole bucket)
    rank: int  # the owned shard's index in ``comm``
    experts: bool  # expert parameters: shards over the expert-data-parallel group, gradients summed then / DP
    grad_flat: torch.Tensor | None = None  # the gradients, flattened for the reduce-scatter (kept across steps)

    @property
    def padded(self) -> int:
        return self.flat.numel()

    @property
    def size(self) -> int:
        """How many shards the bucket is cut into."""
        return self.comm.size if self.comm is not None else 1

    def owned_segments(self) -> list[tuple[int, int, int]]:
        """(param position in bucket, first, end) of every param's part inside the owned shard, shard-relative."""
        lo, hi = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        segs = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                segs.append((i, a - lo, b - lo))
        return segs


class Zero1Optimizer(torch.optim.Optimizer):
    """A torch optimizer whose state is sharded over the data-parallel communicator ``dp_comm``.

    ``params``: tensors or param-group dicts, as for any torch optimizer (e.g. decay / no-decay groups).
    ``optimizer_class`` + ``optimizer_kwargs``: the inner optimizer (applied to flat shards, so it must
    be element-wise, like SGD/Adam/AdamW — not one that needs whole tensors such as LBFGS).
    ``dp_comm``: an ``nxdt.comm.Communicator`` over the data-parallel ranks; None (or a group of size 1)
    means no sharding — still useful for ``master_weights``.
    ``model``: optional; when given, every parameter must belong to it (catches a stale parameter list).
    ``master_weights``: keep an fp32 copy of the owned shard (the parameters stay in their compute dtype,
    e.g. bf16); gradients are reduced in fp32, the fp32 shard is updated and cast when gathered back.
    ``find_unused_parameters``: what a parameter without gradient means (module docstring): False refuses it by
    name, True leaves it untouched where no rank has a gradient for it (DDP's option of the same name).
    ``expert_parallel_size`` / ``expert_dp_comm``: under expert parallelism, its degree EP and the group of the
    replicas of this rank's experts (DP / EP ranks; None when DP = EP); module docstring.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        dp_comm: Communicator | None = None,
        *,
        model: nn.Module | None = None,
        master_weights: bool = False,
        master_dtype: torch.dtype = torch.float32,
        find_unused_parameters: bool = False,
        expert_parallel_size: int = 1,
        expert_dp_comm: Communicator | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(
                f"Zero1Optimizer: optimizer_class must be a torch.optim.Optimizer subclass such as "
                f"torch.optim.AdamW (the class, not an instance); got {optimizer_class!r}"
            )
        if optimizer_class is Zero1Optimizer:
            raise TypeError("Zero1Optimizer: optimizer_class cannot be Zero1Optimizer itself")
        if dp_comm is not None and not isinstance(dp_comm, Communicator):
            hint = (
                " (a World: pass world.world or a communicator from world.new_communicator)"
                if hasattr(dp_comm, "new_communicator")
                else ""
            )
            raise TypeError(
                f"Zero1Optimizer: dp_comm must be an nxdt.comm.Communicator over the data-parallel ranks, "
                f"or None for no sharding; got {type(dp_comm).__module__}.{type(dp_comm).__name__}{hint}"
            )
        self.dp_comm = dp_comm
        self.dp_size = dp_comm.size if dp_comm is not None else 1
        self.dp_rank = dp_comm.rank if dp_comm is not None else 0
        self._dp_group = dp_comm if dp_comm is not None and dp_comm.size > 1 else None  # the group the shards span
        self._edp_group = self._expert_group(expert_parallel_size, expert_dp_comm)
        self._edp_rank, self._edp_size = (expert_dp_comm.rank, expert_dp_comm.size) if expert_dp_comm is not None else (0, 1)
        self.master_weights = bool(master_weights)
        self.master_dtype = master_dtype
        self.find_unused_parameters = bool(find_unused_parameters)
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._routed = routed_parameters(model) if model is not None else set()  # MoE experts: never refused as unused
        self._model = model  # its MoE blocks say which experts a step's tokens reached

        groups = self._normalise_groups(params, model)
        experts = [p for g in groups for p in g["params"] if p.requires_grad and is_expert_parameter(p)]
        if experts and expert_parallel_size == 1:
            raise ValueError(
                f"Zero1Optimizer: {len(experts)} parameter(s) are flagged as expert-parallel (apply_expert_parallel) "
                "but expert_parallel_size is 1; pass expert_parallel_size=EP and expert_dp_comm (the replicas of this "
                "rank's experts)"
            )
        self._buckets = self._build_buckets(groups)
        if not self._buckets:
            raise ValueError("Zero1Optimizer: no trainable parameters (every parameter has requires_grad=False)")
        self._check_same_layout_on_every_rank()

        inner_groups = [
            {**{k: v for k, v in groups[b.group_index].items() if k != "params"}, "params": [b.shard]} for b in self._buckets
        ]
        try:
            self.inner = optimizer_class(inner_groups, **optimizer_kwargs)
        except TypeError as exc:
            raise TypeError(f"Zero1Optimizer: could not build {optimizer_class.__name__} with {optimizer_kwargs}: {exc}") from exc

        # The outer param groups hold the model's parameters and the hyper-parameters a user (or an LR
        # scheduler) edits; they are copied into the inner groups before every step.
        self._building = True
        super().__init__(groups, dict(self.inner.defaults))
        self._building = False
        self._grads_reduced = False
        # (bucket, first, end) of the owned shard that no rank has a gradient for: restored after the inner step
        self._untouched: list[tuple[_Bucket, int, int]] = []
        self._nowhere: set[int] = set()  # ids of the parameters no rank had a gradient for at the last reduction
        # reduce with an all-reduce and write the DP average into every parameter's .grad too (what code reading
        # p.grad between reduction and step expects, as under DDP: a Lightning on_before_optimizer_step hook); costs
        # the all-gather half of an all-reduce more than the reduce-scatter alone. Off: .grad keeps local values.
        self.full_gradients = False
        self._reduction: BackwardReduction | None = None  # overlap_with_backward's buckets, when set up
        self._after: list[tuple[_Bucket, int]] = []  # (bucket, parameter position) the overlap leaves to after backward

    # ------------------------------------------------------------------------------ construction
    def _normalise_groups(self, params: Iterable[Any], model: nn.Module | None) -> list[dict[str, Any]]:
        if isinstance(params, torch.Tensor):
            raise TypeError("Zero1Optimizer: params must be an iterable of tensors or of param-group dicts, not one tensor")
        groups = list(params)
        if not groups:
            raise ValueError("Zero1Optimizer: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else None
        seen: dict[int, tuple[int, int]] = {}
        out = []
        for gi, g in enumerate(groups):
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"Zero1Optimizer: param group {gi} must be a dict with a 'params' key; got {type(g).__name__}")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            for pi, p in enumerate(ps):
                where = f"param {pi} of group {gi} (shape {tuple(p.shape) if isinstance(p, torch.Tensor) else '?'})"
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"Zero1Optimizer: {where} is a {type(p).__name__}, not a tensor")
                if not p.is_leaf:
                    raise ValueError(f"Zero1Optimizer: {where} is not a leaf tensor; pass the model's parameters")
                if names is not None and id(p) not in names:
                    raise ValueError(
                        f"Zero1Optimizer: {where} is not a parameter of the given model; build the groups "
                        f"from model.named_parameters() of the model being trained"
                    )
                if id(p) in seen:
                    raise ValueError(
                        f"Zero1Optimizer: {where} appears twice (first as param {seen[id(p)][1]} of group "
                        f"{seen[id(p)][0]}); each parameter may belong to one group only"
                    )
                if p.requires_grad and not p.dtype.is_floating_point:
                    raise TypeError(f"Zero1Optimizer: {where} has dtype {p.dtype}; trainable parameters must be floating point")
                seen[id(p)] = (gi, pi)
            out.append({**g, "params": ps})
        return out

    def _expert_group(self, ep: int, edp: Communicator | None) -> Communicator | None:
        """The expert-data-parallel group the expert buckets' shards span (None: one shard), checked against DP."""
        if not isinstance(ep, int) or ep < 1:
            raise ValueError(f"Zero1Optimizer: expert_parallel_size={ep!r} must be a positive integer")
        if edp is not None and not isinstance(edp, Communicator):
            raise TypeError(f"Zero1Optimizer: expert_dp_comm must be an nxdt.comm.Communicator or None; got {type(edp).__name__}")
        edp_size = edp.size if edp is not None else 1
        if ep > 1 and ep * edp_size != self.dp_size:
            raise ValueError(
                f"Zero1Optimizer: expert_parallel_size={ep} × expert_dp_comm size {edp_size} must equal the data-parallel "
                f"size {self.dp_size} (each DP rank holds one EP rank's experts, replicated over the expert-DP group)"
            )
        return edp if edp is not None and edp_size > 1 else None

    def _build_buckets(self, groups: list[dict[str, Any]]) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        index = 0
        for gi, g in enumerate(groups):
            by_kind: dict[tuple[torch.dtype, torch.device, bool], list[tuple[int, nn.Parameter]]] = {}
            for p in g["params"]:
                if p.requires_grad:
                    by_kind.setdefault((p.dtype, p.device, is_expert_parameter(p)), []).append((index, p))
                index += 1
            for (dtype, device, experts), members in by_kind.items():
                comm = self._edp_group if experts else self._dp_group
                size, rank = (comm.size, comm.rank) if comm is not None else (1, 0)
                offsets, total = [], 0
                for _, p in members:
                    offsets.append(total)
                    total += p.numel()
                shard_size = max(1, math.ceil(total / size))
                flat = torch.zeros(shard_size * size, dtype=dtype, device=device)
                with torch.no_grad():
                    for (_, p), off in zip(members, offsets):
                        flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
                        p.data = flat[off : off + p.numel()].view_as(p)  # the parameter now lives in the bucket
                lo = rank * shard_size
                shard_dtype = self.master_dtype if self.master_weights else dtype
                shard = nn.Parameter(self._buffer(shard_size, shard_dtype, device, comm).copy_(flat[lo : lo + shard_size]))
                buckets.append(
                    _Bucket(
                        gi,
                        [p for _, p in members],
                        [i for i, _ in members],
                        offsets,
                        total,
                        shard_size,
                        flat,
                        shard,
                        comm,
                        rank,
                        experts,
                    )
                )
        self._num_indices = index
        return buckets

    @staticmethod
    def _buffer(numel: int, dtype: torch.dtype, device: torch.device, comm: Communicator | None) -> torch.Tensor:
        """A flat buffer communicated every step over ``comm``: where its peers read it in place (``Communicator.empty``)."""
        if comm is not None and device.type == "cpu":
            return comm.empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=device)

    @property
    def _dp(self) -> Communicator:
        """The data-parallel group, read only where ``dp_size > 1`` (sharded: there is one)."""
        if self._dp_group is None:
            raise RuntimeError("Zero1Optimizer: no data-parallel group to communicate over (dp_size 1)")
        return self._dp_group

    def _layout(self) -> list[tuple[Any, ...]]:
        # an expert bucket's entry ends with "experts" (dense entries keep the format earlier checkpoints were saved in)
        return [
            (b.group_index, str(b.flat.dtype), tuple(b.indices), tuple(tuple(p.shape) for p in b.params), b.shard_size)
            + (("experts",) if b.experts else ())
            for b in self._buckets
        ]

    @property
    def _has_experts(self) -> bool:
        return any(b.experts for b in self._buckets)

    def bucketed(self) -> list[nn.Parameter]:
        """The parameters this optimizer holds in its buckets (its trainable ones): it reduces their gradients."""
        return [p for b in self._buckets for p in b.params]

    def _refuse_experts(self, what: str) -> None:
        if self._has_experts:
            raise ValueError(
                f"Zero1Optimizer.{what}: the expert parameters differ on each expert-parallel rank, so no one rank can "
                "hold the whole state; save and load state_dict() per rank"
            )

    def _check_same_layout_on_every_rank(self) -> None:
        if self.dp_size == 1:
            return
        layouts = self._dp.all_gather_object(self._layout())
        bad = [r for r, lay in enumerate(layouts) if lay != layouts[0]]
        if bad:
            raise ValueError(
                f"Zero1Optimizer: the parameters differ across the data-parallel group '{self._dp.name}': "
                f"group-ranks {bad} have a different set of param groups/shapes/dtypes than group-rank 0 "
                f"(every DP rank must hold the same model replica)"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise NotImplementedError(
                "Zero1Optimizer: parameters are fixed when the shards are built; create a new "
                "Zero1Optimizer with all param groups instead of add_param_group"
            )
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------------ overlap with backward
    def overlap_with_backward(
        self, bucket_cap_mb: float | None = None, order: Sequence[nn.Parameter] = (), after: Collection[int] = ()
    ) -> BackwardReduction | None:
        """Reduce each bucket's gradients during the last backward before the step, in DDP's buckets
        (:mod:`nxdt.parallel.overlap`): every ``bucket_cap_mb`` of a bucket, from its end (backward's order), is
        reduced (averaged) to the owners of the shards it covers (an all-reduce with ``full_gradients``) on the
        ``dp`` stream as soon as its gradients are there. ``order``: the model's parameters in module order (the
        buckets are issued in the order backward completes them; default: the param groups' order). The caller arms
        the returned reduction before that backward (:meth:`BackwardReduction.arm`); None (nothing set up) when the
        pieces would change the summation order (:func:`~nxdt.parallel.overlap.order_free`) or there is no DP.
        ``after``: ids of parameters whose gradients are complete only after backward (TP-partial ones, summed over TP
        first): left out of the pieces and averaged in one all-reduce by :meth:`reduce_gradients` (the same bits per
        element where ``order_free`` holds)."""
        if self._reduction is not None:
            self._reduction.remove()
            self._reduction = None
        if self._dp_group is None or not order_free(self._dp_group, "all_reduce", "reduce_scatter", "reduce"):
            return None
        if self._has_experts:  # reduced over another group, summed: after backward only
            return None
        order = list(order) or [p for g in self.param_groups for p in g["params"]]
        position = {id(p): i for i, p in enumerate(order)}
        place: dict[int, tuple[_Bucket, int]] = {}
        pieces: list[tuple[_Bucket, list[nn.Parameter], int, int]] = []  # (bucket, its parameters, first, end)
        self._after = []
        for b in self._buckets:
            dtype = b.shard.dtype  # fp32 with master weights, as reduce_gradients reduces
            if b.grad_flat is None or b.grad_flat.dtype != dtype:
                b.grad_flat = self._buffer(b.padded, dtype, b.flat.device, b.comm)
            b.grad_flat.zero_()  # the padding stays zero; every parameter's part is filled each step
            self._after += [(b, i) for i, p in enumerate(b.params) if id(p) in after]
            # runs of consecutive hooked parameters, from the bucket's end: each piece a contiguous range of grad_flat
            runs: list[list[int]] = [[]]
            for i in range(len(b.params))[::-1]:
                if id(b.params[i]) in after:
                    runs.append([])
                else:
                    runs[-1].append(i)
            for backward in (run for run in runs if run):
                for cut in plan_buckets(
                    [b.params[i].numel() for i in backward], cap_elements(bucket_cap_mb, b.grad_flat.element_size())
                ):
                    members = [backward[i] for i in cut]  # descending positions in the bucket
                    last = members[0] == len(b.params) - 1  # the padding goes with the bucket's last parameter
                    end = b.padded if last else b.offsets[members[0]] + b.params[members[0]].numel()
                    pieces.append((b, [b.params[i] for i in members], b.offsets[members[-1]], end))
                    place.update({id(b.params[i]): (b, b.offsets[i]) for i in members})
        # issued in the order backward completes them: a piece is complete when its earliest parameter arrives
        pieces.sort(key=lambda piece: -min(position.get(id(p), -1) for p in piece[1]))
        dp = self._dp

        def fill(_: int, p: nn.Parameter) -> None:
            b, off = place[id(p)]
            view = b.grad_flat[off : off + p.numel()]  # type: ignore[index]
            view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()

        def launch(k: int) -> list[Work]:
            b, _, first, end = pieces[k]
            flat = b.grad_flat
            assert flat is not None
            if self.full_gradients:
                works = [dp.all_reduce(flat[first:end], op="avg", stream=DP_STREAM, async_op=True)]
            else:  # each shard's part of the piece to its owner: the reduce-scatter's result, piece by piece
                works = []
                for r in range(self.dp_size):
                    lo, hi = max(first, r * b.shard_size), min(end, (r + 1) * b.shard_size)
                    if lo < hi:
                        works.append(dp.reduce(flat[lo:hi], root=r, op="avg", stream=DP_STREAM, async_op=True))
            return [w for w in works if w is not None]

        self._reduction = BackwardReduction([piece[1] for piece in pieces], fill, launch, dp)
        return self._reduction

    # ------------------------------------------------------------------------------ gradients
    def reduce_gradients(self, *, again: bool = False) -> None:
        """Reduce-scatter (average over DP) every bucket's gradient into its owned shard; idempotent until
        the next ``step``/``zero_grad`` unless ``again`` (new local gradients since: a caller that knows a backward
        ran after the last reduction, e.g. a second optimizer's). Called by ``clip_grad_norm_`` and ``step``.
        Raises ValueError naming the parameters without gradient (see ``find_unused_parameters``)."""
        if self._grads_reduced and not again:
            return
        if self._reduction is not None and self._reduction.finish():  # reduced during the armed backward
            self._check_unused()
            self._reduce_after()
            for b in self._buckets:
                lo = b.rank * b.shard_size
                b.shard.grad = b.grad_flat[lo : lo + b.shard_size]  # type: ignore[index]
            self._write_full_gradients()
            self._grads_reduced = True
            return
        self._check_unused()
        works = []
        for b in self._buckets:
            dtype = b.shard.dtype  # fp32 with master weights: reduce in fp32, never round to bf16 on the way
            if b.grad_flat is None or b.grad_flat.dtype != dtype:
                b.grad_flat = self._buffer(b.padded, dtype, b.flat.device, b.comm)
            flat_grad = b.grad_flat.zero_()
            for p, off in zip(b.params, b.offsets):
                if p.grad is not None:
                    flat_grad[off : off + p.numel()].copy_(p.grad.reshape(-1))
            op = "sum" if b.experts else "avg"  # experts: Σ over their replicas, then / DP (module docstring)
            if b.comm is None:
                b.shard.grad = flat_grad
            elif self.full_gradients:  # the whole average, for the parameters' .grad; the shard reads its slice of it
                works.append(b.comm.all_reduce(flat_grad, op=op, stream=DP_STREAM, async_op=True))
                lo = b.rank * b.shard_size
                b.shard.grad = flat_grad[lo : lo + b.shard_size]
            else:
                b.shard.grad = torch.empty(b.shard_size, dtype=dtype, device=b.flat.device)
                works.append(b.comm.reduce_scatter(b.shard.grad, flat_grad, op=op, stream=DP_STREAM, async_op=True))
        for w in works:
            w.wait()  # type: ignore[union-attr]
        for b in self._buckets:
            if b.experts:
                (b.grad_flat if self.full_gradients or b.comm is None else b.shard.grad).div_(self.dp_size)  # type: ignore[union-attr]
        self._write_full_gradients()
        self._grads_reduced = True

    def _reduce_after(self) -> None:
        """The parameters :meth:`overlap_with_backward` left out (``after``): their gradients, now complete, averaged
        in one all-reduce into every rank's ``grad_flat`` (the owners' shards read their parts of it)."""
        if not self._after:
            return
        for dtype in {b.grad_flat.dtype for b, _ in self._after}:  # type: ignore[union-attr]
            group = [(b, i) for b, i in self._after if b.grad_flat.dtype == dtype]  # type: ignore[union-attr]
            flat = torch.cat([self._grad_of(b.params[i], dtype) for b, i in group])
            self._dp.all_reduce(flat, op="avg", stream=DP_STREAM)
            at = 0
            for b, i in group:
                n = b.params[i].numel()
                b.grad_flat[b.offsets[i] : b.offsets[i] + n].copy_(flat[at : at + n])  # type: ignore[index]
                at += n

    @staticmethod
    def _grad_of(p: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        return p.grad.reshape(-1).to(dtype) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=p.device)

    def _write_full_gradients(self) -> None:
        """``full_gradients``: the DP average (each bucket's ``grad_flat``, all-reduced) into every parameter's .grad."""
        if self.full_gradients and self.dp_size > 1:
            for b in self._buckets:
                for p, off in zip(b.params, b.offsets):
                    if id(p) in self._nowhere:  # no rank has a gradient: grad stays None, as under DDP
                        continue
                    avg = b.grad_flat[off : off + p.numel()].view_as(p)  # type: ignore[index]
                    if p.grad is None:
                        p.grad = avg.to(p.dtype, copy=True)
                    else:
                        p.grad.copy_(avg)

    def _check_unused(self) -> None:
        """Count the ranks holding a gradient for each bucket parameter — over DP, an expert's over its replicas (one
        all-reduce each); refuse or record the parameters some rank lacks one for (module docstring). An expert no
        replica has a gradient for got no token of the whole batch: untouched by the step, as one process skips it."""
        dense = [p for b in self._buckets if not b.experts for p in b.params]
        used = torch.tensor([float(p.grad is not None) for p in dense])
        if self.dp_size > 1:
            self._dp.all_reduce(used, op="sum")
        lacking = [i for i in range(len(dense)) if used[i] < self.dp_size]
        refused = [i for i in lacking if id(dense[i]) not in self._routed]
        if refused and not self.find_unused_parameters:
            names = [self._names.get(id(dense[i]), f"param {i} (shape {tuple(dense[i].shape)})") for i in refused]
            raise ValueError(unused_parameters_message(names))
        nowhere = {id(dense[i]) for i in lacking if used[i] == 0}
        experts = [p for b in self._buckets if b.experts for p in b.params]
        if experts:
            # reached by this rank's tokens: the routing counts where the blocks keep them (an EP rank whose experts got
            # no row runs one on empty rows: a zero gradient that is no token), else a gradient present
            touched = take_touched_experts(self._model) if self._model is not None else {}
            routed = torch.tensor(
                [float(touched.get(expert_of(self._names.get(id(p), "")) or "", p.grad is not None)) for p in experts]
            )
            if self._edp_group is not None:
                self._edp_group.all_reduce(routed, op="sum")
            nowhere |= {id(p) for p, n in zip(experts, routed.tolist()) if n == 0}
        self._nowhere = nowhere
        self._untouched = [(b, a, e) for b in self._buckets for i, a, e in b.owned_segments() if id(b.params[i]) in nowhere]

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        extra_comms: Sequence[Communicator] = (),
        *,
        norm_type: float = 2.0,
        replicated: Callable[[torch.Tensor], bool] | None = None,
        weight: Callable[[torch.Tensor], float] | None = None,
    ) -> torch.Tensor:
        """Clip the DP-averaged gradient by its global norm; return that norm (before clipping).

        Equals ``torch.nn.utils.clip_grad_norm_`` on the single-process model. ``extra_comms``: groups over
        which this rank's parameters are different pieces of the model (TP shards, PP stages); their squared
        norms are summed there too. ``replicated(param) -> True`` marks parameters that are identical copies
        across ``extra_comms`` (e.g. layer norms under TP): they are counted once (on rank 0 of each).
        ``weight(param)`` (2-norm only) scales each parameter's squared norm instead, e.g. 1/TP for a copy
        every TP rank holds (see ``nxdt.parallel.tensor_parallel.norm_weights``). ``norm_type``: 2.0 or inf.
        """
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"Zero1Optimizer.clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type}")
        for c in extra_comms:
            if not isinstance(c, Communicator):
                raise TypeError(
                    f"Zero1Optimizer.clip_grad_norm_: extra_comms must be nxdt.comm.Communicator objects; got {type(c).__name__}"
                )
        self.reduce_gradients()
        count_replicated = all(c.rank == 0 for c in extra_comms)
        # on the shards' device (a rank's GPU: summed there, reduced over NCCL)
        local = torch.zeros((), dtype=torch.float64, device=self._buckets[0].shard.device if self._buckets else None)
        for b in self._buckets:
            g = b.shard.grad
            for i, a, e in b.owned_segments():
                if replicated is not None and not count_replicated and replicated(b.params[i]):
                    continue
                if norm_type == math.inf:
                    local = torch.maximum(local, g[a:e].abs().max().double())
                else:
                    local = local + squared_norm(g[a:e]) * (weight(b.params[i]) if weight is not None else 1.0)
        total = local.float().reshape(1)
        op = "max" if norm_type == math.inf else "sum"
        for c in ([self._dp] if self.dp_size > 1 else []) + list(extra_comms):
            c.all_reduce(total, op)
        norm = total[0] if norm_type == math.inf else total[0].sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # the same coefficient torch computes
        for b in self._buckets:
            b.shard.grad.mul_(coef.to(b.shard.grad.dtype))
        return norm

    def shard_gradients(self) -> list[torch.Tensor]:
        """The reduced gradients ``step`` will use (this rank's shard of each bucket), reduced first if needed."""
        self.reduce_gradients()
        return [b.shard.grad for b in self._buckets if b.shard.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for b in self._buckets:
            b.shard.grad = None
        self._grads_reduced = False
        self._untouched = []

    # ------------------------------------------------------------------------------ step
    def _sync_hyperparameters(self) -> None:
        for b, inner in zip(self._buckets, self.inner.param_groups):
            for k, v in self.param_groups[b.group_index].items():
                if k != "params":
                    inner[k] = v

    def _gather_parameters(self) -> None:
        works = []
        for b in self._buckets:
            src = b.shard.detach()
            if src.dtype != b.flat.dtype:
                src = src.to(b.flat.dtype)  # master fp32 → compute dtype, once per element
            if b.comm is None:
                b.flat.copy_(src)
            else:
                works.append((b.comm.all_gather(b.flat, src, stream=DP_STREAM, async_op=True), src))
        for w, _ in works:
            w.wait()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        self._sync_hyperparameters()
        kept = [
            (b, a, e, b.shard.detach()[a:e].clone(), {k: v[a:e].clone() for k, v in self._per_element_state(b).items()})
            for b, a, e in self._untouched
        ]
        self.inner.step()
        for b, a, e, values, moments in kept:  # no rank had a gradient: as torch skips such a parameter, nothing moves
            b.shard.detach()[a:e].copy_(values)
            for k, v in self._per_element_state(b).items():  # a state this step created reads as never stepped
                v[a:e].copy_(moments[k]) if k in moments else v[a:e].zero_()
        self._untouched = []
        self._gather_parameters()
        for b in self._buckets:
            b.shard.grad = None
        self._grads_reduced = False
        return loss

    def _per_element_state(self, b: _Bucket) -> dict[str, torch.Tensor]:
        """The inner optimizer's state tensors of a bucket's shard that hold one value per element (moments)."""
        state = self.inner.state.get(b.shard, {})
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == b.shard.shape}

    # ------------------------------------------------------------------------------ introspection
    def state_nbytes(self) -> int:
        """Bytes of inner-optimizer state held by this rank (moments, step counters)."""
        return sum(
            v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )

    def master_nbytes(self) -> int:
        """Bytes of the owned master shards (a separate fp32 copy only with master_weights)."""
        return sum(b.shard.numel() * b.shard.element_size() for b in self._buckets)

    def _hyperparameters(self) -> list[dict[str, Any]]:
        start, out = 0, []
        for g in self.param_groups:
            out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return out

    def _all_gather_flat(self, shard: torch.Tensor, b: _Bucket) -> torch.Tensor:
        full = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
        if b.comm is None:
            full.copy_(shard)
        else:
            b.comm.all_gather(full, shard.contiguous(), stream=DP_STREAM)
        return full

    @torch.no_grad()
    def consolidated_master_weights(self, root: int | None = 0) -> dict[int, torch.Tensor] | None:
        """{state-dict index: full tensor} of the weights the optimizer updates (the fp32 masters with
        master_weights). Collective over DP; the result on ``root`` (every rank when None)."""
        self._refuse_experts("consolidated_master_weights")
        out = {}
        for b in self._buckets:
            full = self._all_gather_flat(b.shard.detach(), b)
            for p, idx, off in zip(b.params, b.indices, b.offsets):
                out[idx] = full[off : off + p.numel()].view(p.shape).clone()
        return out if root is None or self.dp_rank == root else None

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: inner optimizer state, master shards and the layout they belong to."""
        return {
            "format": STATE_FORMAT,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "master_weights": self.master_weights,
            "layout": self._layout(),
            "param_groups": self._hyperparameters(),
            "inner": self.inner.state_dict(),
            "shards": [b.shard.detach().clone() for b in self._buckets],
            # which shard of its experts this rank holds (consolidate_shard_states' experts=)
            **({"expert_dp_rank": self._edp_rank, "expert_dp_size": self._edp_size} if self._has_experts else {}),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by ``state_dict`` (same layout and DP size), or a consolidated torch-format
        state dict (any DP size). Collective over DP: the loaded weights are gathered into the parameters."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"Zero1Optimizer.load_state_dict: expected a dict, got {type(state_dict).__name__}")
        if state_dict.get("format") != STATE_FORMAT:
            if "state" in state_dict and "param_groups" in state_dict:
                self.load_consolidated_state_dict(state_dict)
                return
            raise ValueError(
                f"Zero1Optimizer.load_state_dict: not a '{STATE_FORMAT}' shard nor a torch optimizer state dict "
                f"(keys {sorted(state_dict)[:6]})"
            )
        if state_dict["dp_size"] != self.dp_size or state_dict["dp_rank"] != self.dp_rank:
            raise ValueError(
                f"Zero1Optimizer.load_state_dict: the shard was saved by DP rank {state_dict['dp_rank']} of "
                f"{state_dict['dp_size']}, this is DP rank {self.dp_rank} of {self.dp_size}; load the matching "
                f"shard, or a consolidated_state_dict() to change the data-parallel size"
            )
        if list(map(tuple, state_dict["layout"])) != self._layout():
            raise ValueError(
                "Zero1Optimizer.load_state_dict: the saved layout (param groups, shapes, dtypes) does not match "
                "this optimizer's parameters; was the model or its param groups changed?"
            )
        if bool(state_dict["master_weights"]) != self.master_weights:
            raise ValueError(
                f"Zero1Optimizer.load_state_dict: saved with master_weights={state_dict['master_weights']}, "
                f"this optimizer has master_weights={self.master_weights}"
            )
        self._load_hyperparameters(state_dict["param_groups"])
        self.inner.load_state_dict(state_dict["inner"])
        for b, saved in zip(self._buckets, state_dict["shards"]):
            b.shard.copy_(saved)
        self._sync_hyperparameters()
        self._gather_parameters()

    def _load_hyperparameters(self, saved_groups: list[dict[str, Any]]) -> None:
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                f"Zero1Optimizer.load_state_dict: saved param groups have sizes "
                f"{[len(s['params']) for s in saved_groups]}, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}"
            )
        for s, g in zip(saved_groups, self.param_groups):
            g.update({k: v for k, v in s.items() if k != "params"})

    @torch.no_grad()
    def consolidated_state_dict(self, root: int | None = 0) -> dict[str, Any] | None:
        """The full state, in the format (and with the values) of an unsharded ``optimizer_class.state_dict()``.
        Collective over DP; returned on group-rank ``root`` (on every rank when None), None elsewhere."""
        self._refuse_experts("consolidated_state_dict")
        state: dict[int, dict[str, Any]] = {}
        for b in self._buckets:
            per_param: list[dict[str, Any]] = [{} for _ in b.params]
            for key, val in self.inner.state.get(b.shard, {}).items():
                if isinstance(val, torch.Tensor) and val.shape == b.shard.shape:
                    full = self._all_gather_flat(val, b)
                    for i, (p, off) in enumerate(zip(b.params, b.offsets)):
                        per_param[i][key] = full[off : off + p.numel()].view(p.shape).clone()
                else:  # step counters and other per-tensor scalars: the same for every param of the bucket
                    for d in per_param:
                        d[key] = val.clone() if isinstance(val, torch.Tensor) else val
            for idx, d in zip(b.indices, per_param):
                if d:
                    state[idx] = d
        if root is not None and self.dp_rank != root:
            return None
        return {"state": dict(sorted(state.items())), "param_groups": self._hyperparameters()}

    @torch.no_grad()
    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-format (unsharded) state dict on any DP size: each rank keeps its slice. The master
        shards are taken from the current parameters (restore the model's weights first). Collective over DP. Under
        expert parallelism the dict is this rank's optimizer's (its own experts, by its parameter indices: what a
        reshard cuts from the full state by name)."""
        self._load_hyperparameters(state_dict["param_groups"])
        saved = state_dict["state"]
        shapes = {idx: tuple(p.shape) for b in self._buckets for idx, p in zip(b.indices, b.params)}
        for idx, s in saved.items():
            for key, val in s.items():
                if isinstance(val, torch.Tensor) and val.dim() > 0 and idx in shapes and tuple(val.shape) != shapes[idx]:
                    raise ValueError(
                        f"Zero1Optimizer.load_consolidated_state_dict: state '{key}' of parameter {idx} has "
                        f"shape {tuple(val.shape)}, the parameter {shapes[idx]}"
                    )
        self.inner.state.clear()
        for b in self._buckets:
            lo = b.rank * b.shard_size
            present = [saved[i] for i in b.indices if i in saved]
            if not present:
                continue
            new: dict[str, Any] = {}
            for key, val in present[0].items():
                if isinstance(val, torch.Tensor) and val.dim() > 0:
                    full = torch.zeros(b.padded, dtype=b.shard.dtype, device=b.flat.device)
                    for p, idx, off in zip(b.params, b.indices, b.offsets):
                        if idx in saved:
                            full[off : off + p.numel()].copy_(saved[idx][key].reshape(-1))
                    new[key] = full[lo : lo + b.shard_size].clone()
                else:
                    new[key] = val.clone() if isinstance(val, torch.Tensor) else val
            self.inner.state[b.shard] = new
        for b in self._buckets:
            lo = b.rank * b.shard_size
            b.shard.copy_(b.flat[lo : lo + b.shard_size])
        self._sync_hyperparameters()


def unused_parameters_message(names: Sequence[str]) -> str:
    """One line: which parameters got no gradient, and the two ways out (DDP's option of the same name)."""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (
        f"{len(names)} trainable parameter(s) got no gradient on some data-parallel rank before the optimizer step: "
        f"{shown}. Use them in the loss, freeze them (requires_grad=False), or pass find_unused_parameters=True "
        "(NxDStrategy, as DDPStrategy) to leave parameters without gradient untouched"
    )


def consolidate_shard_states(shards: Sequence[dict[str, Any]], experts: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The torch-format (unsharded) state dict from the ``state_dict()`` of every DP rank (any order), without
    collectives — what ``consolidated_state_dict`` returns in the live world. Under expert parallelism ``experts``
    names whose experts: the shards of one expert-parallel rank's replicas (its expert-DP group, any order); the dense
    state still comes from every DP rank's. ValueError when the set is not one complete, consistent DP group."""
    if not shards or any(not isinstance(s, dict) or s.get("format") != STATE_FORMAT for s in shards):
        raise ValueError(f"consolidate_shard_states: expected '{STATE_FORMAT}' shards (Zero1Optimizer.state_dict())")
    by_rank = {int(s["dp_rank"]): s for s in shards}
    size = int(shards[0]["dp_size"])
    if sorted(by_rank) != list(range(size)) or any(int(s["dp_size"]) != size for s in shards):
        raise ValueError(f"consolidate_shard_states: shards of DP ranks {sorted(by_rank)} do not make one DP group of {size}")
    first = by_rank[0]
    layout = [tuple(b) for b in first["layout"]]
    if any([tuple(b) for b in s["layout"]] != layout for s in shards):
        raise ValueError("consolidate_shard_states: the shards were saved with different layouts (param groups, shapes)")
    dense = [by_rank[r] for r in range(size)]
    replicas = _expert_replicas(experts, layout)
    state: dict[int, dict[str, Any]] = {}
    for b, (_, _, indices, shapes, shard_size, *kind) in enumerate(layout):
        inner = [s["inner"]["state"].get(b, {}) for s in (replicas if kind else dense)]
        for key, val in inner[0].items():
            if isinstance(val, torch.Tensor) and val.dim() == 1 and val.numel() == shard_size:
                full = torch.cat([part[key] for part in inner])
                offset = 0
                for idx, shape in zip(indices, shapes):
                    n = math.prod(shape)
                    state.setdefault(idx, {})[key] = full[offset : offset + n].view(shape).clone()
                    offset += n
            else:  # the step counter: one per bucket, the same for each of its parameters
                for idx in indices:
                    state.setdefault(idx, {})[key] = val.clone() if isinstance(val, torch.Tensor) else val
    return {"state": dict(sorted(state.items())), "param_groups": [dict(g) for g in first["param_groups"]]}


def _expert_replicas(experts: Sequence[dict[str, Any]] | None, layout: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """One expert-parallel rank's replicas' shards in expert-DP order (checked complete); [] for a layout without experts."""
    if not any(len(b) > 5 for b in layout):
        return []
    if not experts:
        raise ValueError(
            "consolidate_shard_states: the shards hold expert-parallel buckets (each expert-parallel rank's own experts, "
            "sharded over their replicas); pass experts= the shards of one expert-parallel rank's replicas"
        )
    by_rank = {int(s.get("expert_dp_rank", -1)): s for s in experts}
    size = int(experts[0].get("expert_dp_size", 0))
    if sorted(by_rank) != list(range(size)) or any([tuple(b) for b in s["layout"]] != layout for s in experts):
        raise ValueError(
            f"consolidate_shard_states: the experts' shards (expert-DP ranks {sorted(by_rank)}) do not make one "
            f"expert-data-parallel group of {size} with the DP shards' layout"
        )
    return [by_rank[r] for r in range(size)]
