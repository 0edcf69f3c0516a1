"""FSDP: parameters, gradients and optimizer state sharded over data parallelism, with token-threaded
all-gather prefetch.

A model is cut into *units* (``model.fsdp_units()``: the embedding, each transformer block, the final
norm + head; one unit for a module without that method). Each unit's trainable parameters are
flattened into one buffer per optimizer param group and dtype (a :class:`FlatShard`), padded to a
multiple of DP and cut into DP equal shards; rank ``r`` keeps shard ``r`` as the ``nn.Parameter`` the
optimizer updates. The original parameters disappear from the modules; while a unit is *gathered*
they are views of one full buffer, filled by an all-gather of every rank's shard::

    unit i forward:  wait gather(i) ─▶ params = views of full(i) ─▶ compute ─▶ free full(i)  (reshard_after_forward)
    unit i backward: wait gather(i) again ─▶ compute ─▶ grad of full(i) ─reduce-scatter(avg)─▶ shard(i).grad

Parameters tied across units (a tied embedding and head) put those units in one *resident* unit that
stays gathered from its first use in forward to the end of backward, as torch's FSDP does with the
root module.

A unit is gathered with one collective per pass: its largest flat is sharded, and its other flats
(other param groups, e.g. the norm weights of a no-weight-decay group) that hold fewer than
``param_persistence_threshold`` elements are kept whole on every rank (DeepSpeed ZeRO-3's
*persistence threshold*, applied to the flats that ride along a sharded one). Their gradients are
summed locally over the micro-batches and averaged over DP in one all-reduce per step
(:meth:`FullyShardedDataParallel.finish_gradients`) instead of one reduce-scatter per unit and
micro-batch. They are not counted as gathered bytes.

Frozen parameters (``requires_grad=False``, e.g. a LoRA model's base weights, in no optimizer) are
sharded like the others, in flats of their own (group ``FROZEN``): gathered with their unit, freed with it,
never given a gradient, never reduce-scattered, and held by no optimizer. Their unit's backward may still
need them (a frozen weight's input gradient) after its trainable flats' gradients have arrived, so a unit
holding sharded frozen flats is freed in backward only once its input's gradient has been computed too
(an identity on the unit's first input that reports its backward) — or, when that input needs no
gradient, once its trainable flats' gradients arrived (every frozen weight's backward then feeds one).

Under pipeline parallelism (``gather_per_step``) the micro-batches' forwards and backwards interleave (1F1B: a
stage runs micro-batch m+1's forward before m's backward), so a unit cannot be freed after its forward or its gradient
reduced per backward. There each unit stays gathered from its first use in a step to :meth:`finish_gradients`, with one
autograd leaf per flat for the whole step: the micro-batches' gradients accumulate unsharded in it and are
reduce-scattered once, during the backward the strategy arms as the step's last for this stage
(:meth:`FullyShardedDataParallel.before_backward`; with virtual pipeline chunks none is, and they go in
:meth:`~FullyShardedDataParallel.finish_gradients`). torch's FSDP2 does the same under ``torch.distributed.pipelining``
(``reshard_after_forward=False``, gradient sync on the last backward only): a stage holds its own layers whole for the
step (1/PP of the model) and gathers each once per step instead of twice per micro-batch. A forward-only pass outside
a step (validation, scoring) frees each unit after its use.

Prefetch policies (``prefetch``):

* ``none``: gather(i) is issued when unit i starts and waited for at once; reduce-scatters are waited
  for at once too. No overlap: the reference point.
* ``eager``: every gather of the step is issued at its start, on the tensor-parallel stream ``"tp"`` (what
  a naive scheduler does): tensor-parallel collectives queue behind them and every unit stays resident
  until the step ends.
* ``token_threaded``: when unit i starts, gather(i+d) is issued on the ``"fsdp"`` stream with
  ``after=`` the completion token of gather(i+d-1) (``d = prefetch_distance``) — a daisy chain, so
  layer i+1's parameters arrive while layer i computes and at most d+1 units are gathered at once.
  Backward mirrors it (gather(i-d) issued when unit i's backward starts) and issues unit i's
  reduce-scatter ``reduce_scatter_delay`` units late, behind the next prefetch, so a gradient never
  delays parameters compute needs sooner. The ``"fsdp"`` stream yields at chunk boundaries while a
  ``"tp"`` collective of the same rank runs (:mod:`nxdt.comm.stream`).

Worked example (inside a spawned world of 2 ranks, DP = both)::

    model = LlamaForCausalLM(cfg)                       # identical weights on both ranks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fsdp = apply_fsdp(model, world.world, [opt], prefetch="token_threaded")
    loss_fn(model(x_local), y_local).backward()         # gathers, prefetches, reduce-scatters
    fsdp.finish_gradients()                             # every reduce-scatter landed in the shards' .grad
    opt.step()                                          # AdamW on this rank's shards only
    full = fsdp.full_state_dict()                       # collective: the unsharded weights by name

Each step records ``exposed_comm_s`` (time compute waited for FSDP communication), ``comm_s`` (time
the FSDP collectives ran), ``overlap_pct`` and ``peak_gathered_bytes`` (:meth:`step_stats`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from nxdt.comm.stream import Work
from nxdt.parallel import scale_, squared_norm
from nxdt.parallel.expert_parallel import expert_of, is_expert_parameter, take_touched_experts

__all__ = ["FSDP_STREAM", "POLICIES", "FlatShard", "FSDPUnit", "FullyShardedDataParallel", "OriginalStateDict", "apply_fsdp"]

FSDP_STREAM = "fsdp"
TP_STREAM = "tp"
POLICIES = ("none", "eager", "token_threaded")
FROZEN = None  # the ``group`` of a flat of frozen parameters (no optimizer holds them)


@dataclass
class _Entry:
    """One original parameter inside a flat buffer; ``owners``: every (module, attribute) it was reachable by,
    ``names``: their qualified names (a tied weight has several)."""

    name: str
    owners: list[tuple[nn.Module, str]]
    names: list[str]
    shape: torch.Size
    offset: int
    numel: int


@dataclass
class FlatShard:
    """The parameters of one unit in one optimizer param group (one dtype), flattened and sharded."""

    unit: int
    group: tuple[int, int] | None  # (optimizer index, param-group index); FROZEN for frozen parameters
    entries: list[_Entry]
    numel: int  # without padding
    shard_size: int
    shard: nn.Parameter  # this rank's slice: what the optimizer updates
    full: torch.Tensor  # the gathered buffer; its storage is freed while the unit is resharded
    leaf: torch.Tensor | None = None  # the autograd leaf of the current gather (its .grad = full gradient)
    send: torch.Tensor | None = None  # the shard cast to the gather dtype (mixed precision)
    replicated: bool = False  # kept whole on every rank (below the persistence threshold): never gathered or freed
    parts: int = 1  # shards the flat buffer is cut into: the DP size, 1 when replicated
    local_grad: torch.Tensor | None = None  # replicated: this rank's gradient summed over the step's micro-batches
    comm: Any = None  # the group its shards span: the DP group, or for experts the replicas of the same experts
    rank: int = 0  # this rank's shard of it (its rank in ``comm``)
    expert: bool = False  # expert-parallel parameters: gradients summed over ``comm`` and divided by DP
    pending: torch.Tensor | None = None  # per step, sharded: the full gradient summed over the micro-batches so far

    @property
    def trainable(self) -> bool:
        return self.group is not FROZEN

    def offset(self, dp_rank: int) -> int:
        """Where shard ``dp_rank`` starts in the flat buffer (a replicated flat's "shard" is all of it)."""
        return 0 if self.replicated else dp_rank * self.shard_size

    def segments(self, dp_rank: int) -> Iterable[tuple[_Entry, int, int]]:
        """(entry, first, end) of every parameter's part inside shard ``dp_rank``, shard-relative."""
        lo = self.offset(dp_rank)
        hi = lo + self.shard_size
        for e in self.entries:
            a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
            if a < b:
                yield e, a - lo, b - lo

    def counted_segments(self) -> Iterable[tuple[_Entry, int, int]]:
        """This rank's segments as a sum over the DP group (a norm) counts them: a replicated flat once, on its group's
        rank 0 (every element of every flat then lies in exactly one DP rank's count: an expert flat's group holds the
        replicas of one EP rank's experts, and the DP group every EP rank once per replica)."""
        return self.segments(self.rank) if not self.replicated or self.rank == 0 else ()

    def mine(self) -> Iterable[tuple[_Entry, int, int]]:
        """The segments of this rank's own shard."""
        return self.segments(self.rank)


@dataclass
class FSDPUnit:
    index: int
    name: str
    modules: list[nn.Module]
    flats: list[FlatShard] = field(default_factory=list)
    resident: bool = False  # tied across units: gathered from first use to the end of backward
    gather_work: Work | None = None
    gathered: bool = False  # storage allocated and the gather issued (complete once gather_work is done)
    grads_pending: int = 0  # flats whose gradient (or the input's, see frozen flats) has not arrived in this backward

    @property
    def nbytes(self) -> int:
        """Bytes gathered for this unit (its replicated flats are held all the time and not counted)."""
        return sum(f.full.numel() * f.full.element_size() for f in self.flats if not f.replicated)


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


class FullyShardedDataParallel:
    """The runtime of FSDP on one model (see the module docstring). Built by :func:`apply_fsdp`."""

    def __init__(
        self,
        model: nn.Module,
        dp_comm: Any,
        units: Sequence[Sequence[nn.Module]],
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        prefetch: str = "token_threaded",
        prefetch_distance: int = 1,
        reduce_scatter_delay: int = 1,
        reshard_after_forward: bool = True,
        gather_per_step: bool = False,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        param_persistence_threshold: int = 32768,
        expert_comm: Any = None,
        tracer: Any = None,
    ) -> None:
        if prefetch not in POLICIES:
            raise ValueError(f"FSDP prefetch={prefetch!r}: choose one of {', '.join(POLICIES)}")
        if not isinstance(prefetch_distance, int) or prefetch_distance < 1:
            raise ValueError(f"FSDP prefetch_distance={prefetch_distance!r}: must be an integer >= 1")
        if not isinstance(reduce_scatter_delay, int) or reduce_scatter_delay < 0:
            raise ValueError(f"FSDP reduce_scatter_delay={reduce_scatter_delay!r}: must be an integer >= 0")
        if not isinstance(param_persistence_threshold, int) or param_persistence_threshold < 0:
            raise ValueError(
                f"FSDP param_persistence_threshold={param_persistence_threshold!r}: must be an integer >= 0 "
                "(elements; 0 shards every flat)"
            )
        self.persistence_threshold = param_persistence_threshold
        self.model, self.comm = model, dp_comm
        self.dp_size, self.dp_rank = dp_comm.size, dp_comm.rank
        self.expert_comm = expert_comm  # expert parallelism: the replicas of this rank's experts (DP / EP, over CP too)
        self.policy, self.distance, self.delay = prefetch, prefetch_distance, reduce_scatter_delay
        self.reshard_after_forward = reshard_after_forward and prefetch != "eager"
        self.per_step = gather_per_step  # pipeline parallelism: gathered and accumulated per step (module docstring)
        self._step_open = False  # per_step: a forward with gradients ran since the last finish_gradients
        self._last_backward = False  # per_step: the backward running now is the step's last for this stage
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.tracer = tracer
        self.stream = TP_STREAM if prefetch == "eager" else FSDP_STREAM
        self.units = self._build_units(model, units, optimizers)
        self._rewire_optimizers(optimizers)
        self._install_hooks()
        self._in_backward = False
        self._grads_expected = 0
        self._last_gather: Work | None = None  # the token the next gather chains after
        self._exit_order: list[int] = []  # units in the order their forward ended: backward runs it in reverse
        self._backward_started = 0  # units whose backward has started in this backward pass
        self._rs_queue: list[tuple[int, FlatShard, torch.Tensor]] = []  # (ready at, flat, gradient) to reduce-scatter
        self._rs_inflight: list[tuple[FlatShard, torch.Tensor, Work]] = []
        # id(flat) → (its shard's .grad, that tensor's version) when a backward ended with its gradient still on the way
        self._marks: dict[int, tuple[torch.Tensor, int]] = {}
        self._eager_issued = False
        self._used: set[int] = set()  # ids of the entries whose view got a gradient since their flat was last checked
        self._gathered_bytes = 0  # bytes of the gathered buffers allocated right now
        self.peak_gathered_bytes = 0  # the most gathered at once since reset_stats()
        self.reset_stats()

    # ------------------------------------------------------------------------------------ construction
    def _build_units(
        self, model: nn.Module, unit_modules: Sequence[Sequence[nn.Module]], optimizers: Sequence[torch.optim.Optimizer]
    ) -> list[FSDPUnit]:
        names = _module_names(model)
        group_of: dict[int, tuple[int, int]] = {}
        for oi, opt in enumerate(optimizers):
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) in group_of:
                        raise ValueError("FSDP: a parameter appears in two optimizer param groups")
                    group_of[id(p)] = (oi, gi)
        # which units reach each sharded parameter, trainable or frozen (a tied weight reaches two)
        units_of: dict[int, list[int]] = {}
        for ui, mods in enumerate(unit_modules):
            for m in mods:
                for p in m.parameters():
                    if _sharded(p, group_of) and ui not in units_of.setdefault(id(p), []):
                        units_of[id(p)].append(ui)
        # merge units that share a parameter into one resident unit (union-find over unit indices)
        parent = list(range(len(unit_modules)))

        def root(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for us in units_of.values():
            for u in us[1:]:
                parent[root(u)] = root(us[0])
        merged: dict[int, list[int]] = {}
        for ui in range(len(unit_modules)):
            merged.setdefault(root(ui), []).append(ui)
        missing = set(group_of) - set(units_of)
        if missing:
            raise ValueError(
                f"FSDP: {len(missing)} optimized parameter(s) belong to no unit; the units must cover every "
                "module with trainable parameters"
            )
        units: list[FSDPUnit] = []
        for members in sorted(merged.values(), key=min):  # forward order of their first member
            mods = [m for ui in members for m in unit_modules[ui]]
            unit = FSDPUnit(
                len(units), "+".join(names.get(id(m), type(m).__name__) or "model" for m in mods), mods, resident=len(members) > 1
            )
            unit.flats = self._flatten(unit, mods, group_of)
            units.append(unit)
        return units

    @torch.no_grad()
    def _flatten(self, unit: FSDPUnit, modules: list[nn.Module], group_of: dict[int, tuple[int, int]]) -> list[FlatShard]:
        names = _module_names(self.model)
        by_key: dict[tuple, list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]]] = {}
        seen: dict[int, tuple[list[tuple[nn.Module, str]], list[str]]] = {}
        for top in modules:
            for m in top.modules():
                for attr, p in list(m._parameters.items()):
                    if p is None or not _sharded(p, group_of):
                        continue
                    qual = f"{names[id(m)]}.{attr}" if names.get(id(m)) else attr
                    if id(p) in seen:  # tied: one entry, several owners
                        seen[id(p)][0].append((m, attr))
                        seen[id(p)][1].append(qual)
                        continue
                    owners, quals = seen[id(p)] = ([(m, attr)], [qual])
                    key = (group_of.get(id(p), FROZEN), p.dtype, is_expert_parameter(p))
                    by_key.setdefault(key, []).append((p, owners, quals))
        flats = []
        gather_dtype = self.param_dtype
        sizes = {key: sum(p.numel() for p, _, _ in params) for key, params in by_key.items()}
        # per group the shards span (DP; the experts' replicas): its largest flat is sharded
        largest = {
            expert: max((k for k in sizes if k[2] == expert), key=lambda k: sizes[k], default=None) for expert in (False, True)
        }
        for (group, dtype, expert), params in by_key.items():
            numel = sizes[(group, dtype, expert)]
            comm = self.expert_comm if expert else self.comm
            if comm is None:
                raise ValueError(
                    "FSDP: the model has expert-parallel parameters (apply_expert_parallel); pass expert_comm= the "
                    "communicator of the replicas of this rank's experts"
                )
            size, rank = comm.size, comm.rank
            # small flats riding along the unit's sharded one: kept whole, so the unit costs one collective per pass
            replicated = size > 1 and (group, dtype, expert) != largest[expert] and numel < self.persistence_threshold
            parts = 1 if replicated else size
            shard_size = -(-numel // parts)
            flat = torch.zeros(shard_size * parts, dtype=dtype, device=params[0][0].device)  # where the model is
            entries, offset = [], 0
            for p, owners, quals in params:
                flat[offset : offset + p.numel()].copy_(p.reshape(-1))
                entries.append(_Entry(quals[0], owners, quals, p.shape, offset, p.numel()))
                offset += p.numel()
            lo = 0 if replicated else rank * shard_size
            shard = nn.Parameter(self._shard_buffer(comm, flat[lo : lo + shard_size]), requires_grad=group is not FROZEN)
            full = torch.empty(flat.numel(), dtype=gather_dtype or dtype, device=flat.device)
            if not replicated:
                full.untyped_storage().resize_(0)  # resharded until first gathered
            flats.append(
                FlatShard(
                    unit.index,
                    group,
                    entries,
                    numel,
                    shard_size,
                    shard,
                    full,
                    replicated=replicated,
                    parts=parts,
                    comm=comm,
                    rank=rank,
                    expert=expert,
                )
            )
        for f in flats:  # the modules lose their parameters: the shard is what they own now
            for e in f.entries:
                for m, attr in e.owners:
                    del m._parameters[attr]
        for k, f in enumerate(flats):
            modules[0].register_parameter(f"fsdp_shard_{k}", f.shard)
        return flats

    @staticmethod
    def _shard_buffer(comm: Any, values: torch.Tensor) -> torch.Tensor:
        """A copy of ``values`` to own as a shard, kept where ``comm``'s peers read it in place when gathering
        (``Communicator.empty``); the optimizer updates it in place."""
        return comm.empty(values.numel(), values.dtype, values.device).copy_(values)

    def _rewire_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Each param group now updates the shards of its parameters (same group dicts: schedulers that
        edit ``lr`` keep working)."""
        for oi, opt in enumerate(optimizers):
            if opt.state:
                raise ValueError("FSDP must be applied before the optimizer's first step (its state is not empty)")
            for gi, group in enumerate(opt.param_groups):
                group["params"] = [f.shard for u in self.units for f in u.flats if f.group == (oi, gi)]

    def _install_hooks(self) -> None:
        for unit in self.units:
            unit.modules[0].register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u, args))
            unit.modules[-1].register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))

    # ------------------------------------------------------------------------------------ gathering
    def _gather(self, unit: FSDPUnit) -> None:
        """Issue unit's all-gathers (async, chained after the previous gather's token)."""
        if unit.gathered:
            return
        tokens = []
        for f in unit.flats:
            if f.replicated:  # held whole: this pass's values are the (possibly just updated) shard itself
                f.full.copy_(f.shard.detach())
                continue
            f.full.untyped_storage().resize_(f.full.numel() * f.full.element_size())
            src = f.shard.detach()
            if f.full.dtype != src.dtype:
                f.send = src.to(f.full.dtype)
                src = f.send
            after = self._last_gather if self.policy == "token_threaded" and self._last_gather is not None else None
            work = f.comm.all_gather(f.full, src, stream=self.stream, async_op=True, after=after)
            self._last_gather = unit.gather_work = work
            self._step_comm_works.append(work)
            tokens.append(work.id)
        unit.gathered = True
        if self.tracer is not None and unit.gather_work is not None:  # which collective carries which unit
            now = time.perf_counter()
            self.tracer.add("issue gather", "fsdp schedule", now, now, unit=unit.index, tokens=tokens, backward=self._in_backward)
        self._gathered_bytes += unit.nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)

    def _wait_gathered(self, unit: FSDPUnit) -> None:
        """Make unit's parameters usable: issue its gather if nobody has, wait for it (exposed time)."""
        self._gather(unit)
        work = unit.gather_work
        if work is not None:
            if not work.is_completed():
                start = time.perf_counter()
                work.wait()
                end = time.perf_counter()
                self.exposed_comm_s += end - start
                if self.tracer is not None:
                    self.tracer.add("wait gather", "compute", start, end, unit=unit.index)
            else:
                work.wait()  # raises the gather's error, if any
            unit.gather_work = None
            for f in unit.flats:
                f.send = None

    def _free(self, unit: FSDPUnit) -> None:
        if not unit.gathered:
            return
        for f in unit.flats:
            if not f.replicated:
                f.full.untyped_storage().resize_(0)
        unit.gathered = False
        self._gathered_bytes -= unit.nbytes

    def _set_views(self, unit: FSDPUnit, need_grad: bool) -> None:
        """A fresh autograd leaf over each gathered buffer, and the modules' parameters as views of it. A leaf
        that will receive a gradient is kept until its gradient arrives (and counted as expected)."""
        for f in unit.flats:
            # a separate tensor over the same storage: re-gathering into ``full`` for backward must not bump the
            # version counter of the tensors autograd saved from the leaf's views
            leaf = torch.empty(0, dtype=f.full.dtype, device=f.full.device).set_(f.full.untyped_storage(), 0, (f.full.numel(),))
            # the shard's requires_grad: Lightning's toggle_optimizer switches it off for the other optimizers' shards
            grad = need_grad and f.trainable and f.shard.requires_grad
            if grad:
                leaf.requires_grad_(True)
                leaf.register_post_accumulate_grad_hook(lambda t, u=unit, fl=f: self._on_grad(u, fl))
                f.leaf = leaf
                if not self.per_step:  # per step: one leaf takes every micro-batch's gradient, nothing is counted
                    unit.grads_pending += 1
                    self._grads_expected += 1
            # one split into every entry (and the shard padding): its backward concatenates the pieces' gradients
            # once, where a slice per entry would each return a zero-filled full-size gradient for autograd to add
            # into the leaf (O(entries × flat size) per unit per backward; the same sums, so the same bits)
            pad = f.full.numel() - f.numel
            pieces = leaf.split([e.numel for e in f.entries] + ([pad] if pad else []))
            for e, piece in zip(f.entries, pieces):  # entries lie back to back from offset 0 (_flatten)
                view = piece.view(e.shape)
                if grad:  # which parameters the loss used: the leaf's gradient is dense, zeros for an unused one
                    view.register_hook(lambda g, key=id(e): self._used.add(key))
                for m, attr in e.owners:
                    setattr(m, attr, view)

    # ------------------------------------------------------------------------------------ hooks
    def _prefetch_forward(self, unit: FSDPUnit) -> None:
        if self.policy == "eager" and not self._eager_issued:
            self._eager_issued = True
            for u in self.units:
                self._gather(u)
        elif self.policy == "token_threaded":
            for j in range(unit.index + 1, min(len(self.units), unit.index + 1 + self.distance)):
                self._gather(self.units[j])

    def _pre_forward(self, unit: FSDPUnit, args: tuple) -> tuple | None:
        if self.per_step:
            self._pre_forward_per_step(unit)
            return None
        if self._in_backward:  # activation-checkpoint recompute: the views exist, the storage must be filled
            self._wait_gathered(unit)
            return None
        if unit.index == 0:  # a new forward pass: the previous backward's reduce-scatters have had their time
            self._exit_order = []
            self._drop_cleared()
            self._drain_reduce_scatters()
        self._gather(unit)
        self._prefetch_forward(unit)
        self._wait_gathered(unit)
        if all(f.leaf is None for f in unit.flats):  # (a resident unit keeps its leaves across the pass)
            self._set_views(unit, need_grad=torch.is_grad_enabled())
        if self.tracer is not None:
            self._unit_start = time.perf_counter()
        return self._watch_input(unit, args)

    def _pre_forward_per_step(self, unit: FSDPUnit) -> None:
        """Gathered once per step; the leaves of a step's first forward with gradients serve every micro-batch."""
        self._gather(unit)
        self._prefetch_forward(unit)
        self._wait_gathered(unit)
        grad = torch.is_grad_enabled()
        self._step_open = self._step_open or grad
        if not any(f.leaf is not None for f in unit.flats):
            self._set_views(unit, need_grad=grad)
        if self.tracer is not None:
            self._unit_start = time.perf_counter()

    def _watch_input(self, unit: FSDPUnit, args: tuple) -> tuple | None:
        """A unit with sharded frozen flats: its first input passes an identity whose backward reports that the
        unit's backward is over (so the frozen weights it used may be freed); counted as one pending gradient."""
        if not (
            torch.is_grad_enabled()
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].requires_grad
            and any(not f.trainable and not f.replicated for f in unit.flats)
        ):
            return None
        unit.grads_pending += 1
        self._grads_expected += 1
        return (_ReportBackward.apply(args[0], lambda: self._on_input_grad(unit)), *args[1:])

    def _post_forward(self, unit: FSDPUnit, out: Any) -> Any:
        if self.per_step:
            if self.tracer is not None:
                self.tracer.add("forward", "compute", self._unit_start, time.perf_counter(), unit=unit.index, module=unit.name)
            if not self._step_open and not unit.resident:  # a forward-only pass outside a step: nothing kept for it
                self._free(unit)
            return out
        if self._in_backward:
            return out
        if self.tracer is not None:
            self.tracer.add("forward", "compute", self._unit_start, time.perf_counter(), unit=unit.index, module=unit.name)
        self._exit_order.append(unit.index)
        if torch.is_grad_enabled():
            tensors = (
                [out]
                if isinstance(out, torch.Tensor)
                else [t for t in (out if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
            )
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(lambda g, u=unit: self._pre_backward(u))
                    break
        # backward starts with the last units: keep the last one (token_threaded: the last d+1, the ones backward
        # would prefetch first) instead of freeing and re-gathering them — still at most d+1 units held
        keep = self.distance if self.policy == "token_threaded" else 0
        if self.reshard_after_forward and not unit.resident and unit.index < len(self.units) - 1 - keep:
            self._free(unit)
        return out

    def _prefetch_backward(self, unit: FSDPUnit) -> None:
        if self.policy == "token_threaded":
            order = self._exit_order[::-1]  # backward order
            if unit.index in order:
                k = order.index(unit.index)
                for j in order[k + 1 : k + 1 + self.distance]:
                    self._gather(self.units[j])

    def _pre_backward(self, unit: FSDPUnit) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._last_gather = None
            self._backward_started = 0
        self._backward_started += 1
        self._gather(unit)
        self._prefetch_backward(unit)
        # behind the prefetch: gradients that have waited reduce_scatter_delay units
        self._issue_reduce_scatters(min_age=self.delay if self.policy == "token_threaded" else 0)
        self._wait_gathered(unit)
        if self.tracer is not None:
            self._unit_start = time.perf_counter()

    def before_backward(self, last: bool) -> None:
        """Per step (pipeline parallelism): whether the backward about to run is the step's last for this stage's units
        (their gradients are then complete as it reaches them, and reduced while the rest of it runs)."""
        self._last_backward = last

    def _on_grad(self, unit: FSDPUnit, flat: FlatShard) -> None:
        leaf = flat.leaf
        assert leaf is not None, "FSDP: a gradient hook fired for a flat that is not gathered"  # registered on the live leaf
        if self.per_step:  # summed over the step's micro-batches here; reduced once, from the step's last backward on
            grad, leaf.grad = leaf.grad, None
            if grad is not None and flat.replicated:
                self._queue_grad(flat, grad)
            elif grad is not None:  # in the reduce dtype, as torch's FSDP2 accumulates without a gradient sync
                if flat.pending is None:
                    flat.pending = grad if grad.dtype == self.reduce_dtype else grad.to(self.reduce_dtype)
                else:
                    flat.pending.add_(grad)
            if self._last_backward:
                self._release_pending(flat)
                self._issue_reduce_scatters()
            return
        grad, leaf.grad, flat.leaf = leaf.grad, None, None
        if grad is not None:
            self._queue_grad(flat, grad)
        self._unit_grad_arrived(unit)

    def _release_pending(self, flat: FlatShard) -> None:
        """Per step: the gradient ``flat`` summed over the step's micro-batches, queued for its reduce-scatter."""
        if flat.pending is not None:
            self._rs_queue.append((self._backward_started, flat, flat.pending))
            flat.pending = None

    def _queue_grad(self, flat: FlatShard, grad: torch.Tensor) -> None:
        if flat.replicated:  # summed here over micro-batches, averaged over DP once per step
            if flat.local_grad is None:
                flat.local_grad = grad.to(self.reduce_dtype, copy=True)
            else:
                flat.local_grad.add_(grad)
        else:
            self._rs_queue.append((self._backward_started, flat, grad))

    def _on_input_grad(self, unit: FSDPUnit) -> None:
        """The gradient of a unit's input is computed: every backward op of the unit (its frozen weights') ran."""
        self._unit_grad_arrived(unit)

    def _unit_grad_arrived(self, unit: FSDPUnit) -> None:
        unit.grads_pending -= 1
        self._grads_expected -= 1
        if unit.grads_pending == 0:
            if self.tracer is not None:
                self.tracer.add("backward", "compute", self._unit_start, time.perf_counter(), unit=unit.index, module=unit.name)
            # the first unit is the next micro-batch's first need: kept until finish_gradients
            if self.policy != "eager" and unit.index != 0:
                self._free(unit)
        if self.policy == "none":
            self._issue_reduce_scatters()
            self._drain_reduce_scatters()
        elif self._grads_expected == 0 or (self.policy == "token_threaded" and self.delay == 0):
            self._issue_reduce_scatters()  # the last gradient of this backward: nothing comes later to wait behind
        if self._grads_expected == 0:
            self._in_backward = False
            self._last_gather = None
            self._mark_pending()

    def _mark_pending(self) -> None:
        """At the end of a backward: each shard whose gradient is still on its way (a reduce-scatter in flight, a
        replicated flat's local sum) gets its ``.grad`` now (zeros if it has none), noted with its version, so that a
        ``zero_grad`` before it lands is seen (:meth:`_drop_cleared`). Under DDP the gradient is in ``p.grad`` when
        backward returns, and Lightning zeroes it before validation (``on_validation_model_zero_grad``): a manual
        loop's accumulated-but-not-stepped gradient is gone, and so must the one still travelling here be."""
        pending = {id(f): f for f, _, _ in self._rs_inflight}
        pending.update({id(f): f for f in self.flats() if f.local_grad is not None})
        for key, f in pending.items():
            if f.shard.grad is None:
                f.shard.grad = torch.zeros_like(f.shard)
            self._marks[key] = (f.shard.grad, f.shard.grad._version)

    def _drop_cleared(self) -> None:
        """Before the gradients still on their way land: drop those of shards whose ``.grad`` was cleared (set to None,
        replaced or zeroed in place) since the backward that produced them. Every rank clears alike (Lightning's hook,
        a user's ``zero_grad``), so every rank drops the same ones."""
        marks, self._marks = self._marks, {}
        cleared = {
            id(f)
            for f in self.flats()
            if id(f) in marks and (f.shard.grad is not marks[id(f)][0] or f.shard.grad._version != marks[id(f)][1])
        }
        if not cleared:
            return
        for flat, _, work in self._rs_inflight:
            if id(flat) in cleared:
                work.wait()  # the collective completes on every rank; its result is not wanted
        self._rs_inflight = [item for item in self._rs_inflight if id(item[0]) not in cleared]
        self._rs_queue = [item for item in self._rs_queue if id(item[1]) not in cleared]
        for f in self.flats():
            if id(f) in cleared:
                f.local_grad = None

    # ------------------------------------------------------------------------------------ gradients
    def _issue_reduce_scatters(self, min_age: int = 0) -> None:
        """Issue queued reduce-scatters whose gradient arrived at least ``min_age`` unit-backwards ago."""
        if not self._rs_queue:
            return
        ready = [item for item in self._rs_queue if self._backward_started - item[0] >= min_age]
        self._rs_queue = [item for item in self._rs_queue if self._backward_started - item[0] < min_age]
        for _, flat, grad in ready:
            grad = grad.to(self.reduce_dtype) if grad.dtype != self.reduce_dtype else grad
            out = torch.empty(flat.shard_size, dtype=self.reduce_dtype, device=grad.device)
            # an expert's gradient is its EP group's sum: summed over its replicas, divided by DP when it lands
            op = "sum" if flat.expert else "avg"
            work = flat.comm.reduce_scatter(out, grad, op, stream=self.stream, async_op=True)
            self._step_comm_works.append(work)
            self._rs_inflight.append((flat, out, work))

    def _drain_reduce_scatters(self) -> None:
        """Wait for issued reduce-scatters and add them into the shards' gradients (exposed time)."""
        if not self._rs_inflight:
            return
        start = time.perf_counter()
        for flat, out, work in self._rs_inflight:
            work.wait()
            if flat.expert:
                out.div_(self.dp_size)
            shard = flat.shard
            g = out.to(shard.dtype) if out.dtype != shard.dtype else out
            if shard.grad is None:
                shard.grad = g
            else:
                shard.grad.add_(g)
        self._rs_inflight = []
        end = time.perf_counter()
        self.exposed_comm_s += end - start
        if self.tracer is not None:
            self.tracer.add("wait reduce_scatter", "compute", start, end)

    def _reduce_replicated(self) -> None:
        """Average the replicated flats' summed gradients over DP: one all-reduce per group and dtype (an expert flat's:
        summed over the replicas of its experts, divided by DP), exposed time."""
        replicated = [f for f in self.flats() if f.replicated]
        if not any(f.local_grad is not None for f in replicated):
            return
        start = time.perf_counter()
        by_group: dict[tuple[bool, torch.dtype], list[FlatShard]] = {}
        for f in replicated:  # every rank sends the same flats (a parameter without gradient contributes zeros)
            if f.local_grad is None:
                f.local_grad = torch.zeros(f.numel, dtype=self.reduce_dtype, device=f.shard.device)
            by_group.setdefault((f.expert, f.local_grad.dtype), []).append(f)
        for (expert, _), flats in by_group.items():
            summed = torch.cat([f.local_grad for f in flats])
            work = flats[0].comm.all_reduce(summed, "sum" if expert else "avg", stream=self.stream, async_op=True)
            self._step_comm_works.append(work)
            work.wait()
            if expert:
                summed.div_(self.dp_size)
            for f, g in zip(flats, summed.split([f.numel for f in flats])):
                g = g.to(f.shard.dtype) if g.dtype != f.shard.dtype else g
                if f.shard.grad is None:
                    f.shard.grad = g.clone()
                else:
                    f.shard.grad.add_(g)
                f.local_grad = None
        end = time.perf_counter()
        self.exposed_comm_s += end - start
        if self.tracer is not None:
            self.tracer.add("wait all_reduce", "compute", start, end, what="replicated flats")

    def finish_gradients(self) -> None:
        """After the last backward of a step: every gradient reduced into its shard, every unit resharded."""
        if self.per_step:  # what no armed backward took (virtual pipeline chunks: none is the last of every chunk)
            for f in self.flats():
                self._release_pending(f)
        self._drop_cleared()
        self._issue_reduce_scatters()
        self._drain_reduce_scatters()
        self._reduce_replicated()
        for unit in self.units:
            self._free(unit)
            unit.grads_pending = 0
            for f in unit.flats:
                f.leaf = None
                f.local_grad = None
                f.pending = None
        self._in_backward = False
        self._grads_expected = 0
        self._last_gather = None
        self._eager_issued = False
        self._step_open = self._last_backward = False

    def unused_entries(self, optimizer_index: int | None = None) -> tuple[list[str], list[tuple[FlatShard, int, int]]]:
        """The parameters of optimizer ``optimizer_index``'s flats (every trainable flat when None) that got no gradient
        since they were last checked, counted over the group holding them (DP; an expert's replicas), one all-reduce
        each: (names lacking one on some rank, this rank's shard segments of those lacking one on every rank).
        Collective; every rank checks the same flats."""
        flats = [f for f in self._of(optimizer_index) if f.trainable]
        lacking: list[str] = []
        nowhere: set[int] = set()
        for expert in (False, True):
            entries = [e for f in flats if f.expert == expert for e in f.entries]
            if not entries:
                continue
            comm = self.expert_comm if expert else self.comm
            # an expert: whether this rank's tokens reached it (its block's routing counts, where kept: an EP rank whose
            # experts got no row runs one on empty rows, a gradient without a token), else whether it got a gradient
            touched = take_touched_experts(self.model) if expert else {}
            used = torch.tensor([float(touched.get(expert_of(e.name) or "", id(e) in self._used)) for e in entries])
            if comm.size > 1:
                comm.all_reduce(used, op="sum")
            lacking += [e.name for e, u in zip(entries, used.tolist()) if u < comm.size]
            nowhere |= {id(e) for e, u in zip(entries, used.tolist()) if u == 0}
        self._used -= {id(e) for f in flats for e in f.entries}
        segments = [(f, a, b) for f in flats for e, a, b in f.mine() if id(e) in nowhere]
        return lacking, segments

    # ------------------------------------------------------------------------------------ stats
    def reset_stats(self) -> None:
        self.exposed_comm_s = 0.0
        self.peak_gathered_bytes = self._gathered_bytes
        self._step_comm_works: list[Work] = []

    def step_stats(self) -> dict[str, float]:
        """This step's exposed communication, total FSDP communication time, overlap and peak gathered bytes
        (call after :meth:`finish_gradients`); resets the counters."""
        spans = sorted((w.start_s, w.end_s) for w in self._step_comm_works if w.start_s is not None and w.end_s is not None)
        busy = 0.0  # the union of the collectives' running intervals
        current: tuple[float, float] | None = None
        for a, b in spans:
            if current is None or a > current[1]:
                busy += current[1] - current[0] if current is not None else 0.0
                current = (a, b)
            else:
                current = (current[0], max(current[1], b))
        busy += current[1] - current[0] if current is not None else 0.0
        stats = {
            "exposed_comm_s": self.exposed_comm_s,
            "comm_s": busy,
            "overlap_pct": 100.0 * max(0.0, 1.0 - self.exposed_comm_s / busy) if busy > 0 else 0.0,
            "peak_gathered_bytes": float(self.peak_gathered_bytes),
        }
        self.reset_stats()
        return stats

    # ------------------------------------------------------------------------------------ state
    def flats(self) -> list[FlatShard]:
        return [f for u in self.units for f in u.flats]

    @torch.no_grad()
    def gathered(self, f: FlatShard) -> torch.Tensor:
        """The whole flat buffer of ``f`` in its shards' dtype (a collective over the DP group unless replicated)."""
        if f.replicated:
            return f.shard.detach()
        full = torch.empty(f.shard_size * f.parts, dtype=f.shard.dtype, device=f.shard.device)
        f.comm.all_gather(full, f.shard.detach(), stream=FSDP_STREAM)
        return full

    @torch.no_grad()
    def load_entry(self, f: FlatShard, e: _Entry, value: torch.Tensor) -> None:
        """Copy this rank's part of one parameter (``e`` of ``f``) from its full tensor ``value``."""
        lo = f.offset(f.rank)
        for entry, a, b in f.mine():
            if entry is e:
                start = lo + a - e.offset
                f.shard.detach()[a:b].copy_(value.reshape(-1)[start : start + b - a])  # bumps the shard's version

    @torch.no_grad()
    def full_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Every sharded parameter unsharded, by its original name (a collective over the DP group; all
        ranks get it). Units are gathered one at a time, so only one unit's buffer is extra."""
        out: dict[str, torch.Tensor] = {}
        for f in self.flats():
            full = self.gathered(f)
            for e in f.entries:
                value = full[e.offset : e.offset + e.numel].view(e.shape).clone()
                for name in e.names:  # a tied weight under each of its names, one tensor (as state_dict() has it)
                    out[prefix + name] = value
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
        """Copy this rank's part of every sharded parameter from unsharded tensors (``full_state_dict``'s
        format); returns the entries it did not use (buffers, unsharded parameters). Raises KeyError /
        ValueError naming a missing or misshapen tensor."""
        used: set[str] = set()
        for f in self.flats():
            lo = f.offset(f.rank)
            for e, a, b in f.mine():
                key = prefix + e.name
                if key not in state:
                    raise KeyError(f"FSDP: the state dict has no tensor {key!r}")
                value = state[key]
                if tuple(value.shape) != tuple(e.shape):
                    raise ValueError(f"FSDP: tensor {key!r} has shape {tuple(value.shape)}, the model has {tuple(e.shape)}")
                start = lo + a - e.offset
                f.shard.data[a:b].copy_(value.reshape(-1)[start : start + b - a])
            for e in f.entries:
                used.update(prefix + n for n in e.names)
        return {k: v for k, v in state.items() if k not in used}

    def flat_layout(self, optimizers: Sequence[torch.optim.Optimizer], prefix: str = "") -> list[list[dict[str, Any]]]:
        """Per optimizer, per state index (its flat shards in param-group order): which parameters the flat buffer
        holds where — what a checkpoint records so its per-DP-rank optimizer shards can be unflattened by name."""
        owner = {id(f.shard): f for f in self.flats()}
        return [
            [
                {
                    "shard_size": owner[id(p)].shard_size,
                    "dp": owner[id(p)].parts,  # the shards it is cut into (1: whole on every rank)
                    "expert": owner[id(p)].expert,  # sharded over the replicas of the same experts, not over DP
                    "rank": owner[id(p)].rank,  # which of them this rank's file holds
                    "entries": [[prefix + e.names[0], e.offset, e.numel, list(e.shape)] for e in owner[id(p)].entries],
                }
                for g in opt.param_groups
                for p in g["params"]
            ]
            for opt in optimizers
        ]

    def optimizer_state_from_named(
        self, saved: dict[str, Any], optimizer: torch.optim.Optimizer, prefix: str = "", localize: Any = None
    ) -> dict[str, Any]:
        """A by-name, unsharded optimizer state (``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``,
        e.g. from a checkpoint of another layout) → torch format for ``optimizer`` over this rank's flat shards:
        each parameter's moments (``localize(name, tensor)`` cuts its TP part) laid out as in the flat buffer, then
        this rank's slice. Raises ValueError naming a parameter the saved state lacks."""
        owner = {id(f.shard): f for f in self.flats()}
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(
                f"the saved optimizer has {len(saved['param_groups'])} param groups, this one {len(optimizer.param_groups)}"
            )
        state, groups, index = {}, [], 0
        for g, group in enumerate(optimizer.param_groups):
            indices = []
            for p in group["params"]:
                f = owner[id(p)]
                lo = f.offset(f.rank)
                entry_states = []
                for e in f.entries:
                    name = prefix + e.names[0]
                    if name not in saved["state"]:
                        if any(name in sg["params"] for sg in saved["param_groups"]):
                            continue  # a parameter without state yet (never stepped)
                        raise ValueError(f"the saved optimizer has no parameter {name!r}")
                    entry_states.append((e, saved["state"][name]))
                if entry_states:
                    out: dict[str, Any] = {}
                    for key, value in entry_states[0][1].items():
                        if not isinstance(value, torch.Tensor) or value.dim() == 0:  # the step counter: the same for every
                            out[key] = value.clone() if isinstance(value, torch.Tensor) else value  # parameter; one copy each
                            continue
                        full = torch.zeros(f.shard_size * f.parts, dtype=value.dtype, device=f.shard.device)
                        for e, st in entry_states:
                            t = localize(prefix + e.names[0], st[key]) if localize is not None else st[key]
                            if tuple(t.shape) != tuple(e.shape):
                                raise ValueError(
                                    f"optimizer state {key!r} of {prefix + e.names[0]} has shape {tuple(t.shape)}, "
                                    f"the parameter {tuple(e.shape)}"
                                )
                            full[e.offset : e.offset + e.numel].copy_(t.reshape(-1))
                        out[key] = full[lo : lo + f.shard_size].clone()
                    state[index] = out
                indices.append(index)
                index += 1
            groups.append({**{k: v for k, v in saved["param_groups"][g].items() if k != "params"}, "params": indices})
        return {"state": state, "param_groups": groups}

    def _of(self, optimizer_index: int | None) -> list[FlatShard]:
        """The flats optimizer ``optimizer_index`` updates (every flat when None)."""
        return [f for f in self.flats() if optimizer_index is None or (f.group is not None and f.group[0] == optimizer_index)]

    def grad_norm_squared(self, weights: dict[str, float] | None = None, optimizer_index: int | None = None) -> torch.Tensor:
        """Σ weight·g² over this rank's shard gradients (float64) of optimizer ``optimizer_index`` (all when None);
        ``weights`` by parameter name (default 1)."""
        flats = self._of(optimizer_index)
        total = torch.zeros((), dtype=torch.float64, device=flats[0].shard.device if flats else None)
        for f in flats:
            g = f.shard.grad
            if g is None or (f.replicated and f.rank != 0):  # a replicated flat counts once over DP
                continue
            if not weights:
                total += squared_norm(g)
                continue
            for e, a, b in f.mine():
                total += weights.get(e.name, 1.0) * squared_norm(g[a:b])
        return total

    def shard_gradients(self, optimizer_index: int | None = None) -> list[torch.Tensor]:
        return [f.shard.grad for f in self._of(optimizer_index) if f.shard.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        comms: Sequence[Any] = (),
        weights: dict[str, float] | None = None,
        optimizer_index: int | None = None,
    ) -> torch.Tensor:
        """Clip the shard gradients by the norm of the whole model's gradient: this rank's Σ weight·g², summed
        over the DP group and ``comms`` (e.g. TP, whose ranks hold other parts; ``weights``: 1/replicas for
        parameters several of them hold). ``optimizer_index``: only that optimizer's gradients (as Lightning clips
        one optimizer's parameters). Returns the norm (the same on every rank)."""
        squares = self.grad_norm_squared(weights, optimizer_index).reshape(1)
        for comm in (self.comm, *comms):
            if comm is not None and comm.size > 1:
                comm.all_reduce(squares, op="sum")
        norm = squares.sqrt().reshape(()).float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # fp32, as torch.nn.utils.clip_grad_norm_ computes it
        scale_(self.shard_gradients(optimizer_index), coef)
        return norm

    @torch.no_grad()
    def sum_replicated_grads(self, tp_comm: Any, is_tp_sharded: Any) -> int:
        """FSDP × TP: parameters whose gradients are partial sums over TP (``is_tp_sharded(name)`` False: under
        sequence parallelism every replicated one, each rank saw its sequence shard; LoRA's replicated halves) —
        sum their parts of the shard gradients over TP, in one all-reduce (the TP ranks' flat layouts are
        identical). Returns how many segments were summed."""
        parts = [
            f.shard.grad[a:b]
            for f in self.flats()
            if f.shard.grad is not None
            for e, a, b in f.mine()
            if not is_tp_sharded(e.name)
        ]
        if parts:
            summed = torch.cat(parts)
            tp_comm.all_reduce(summed, stream=TP_STREAM)
            for part, value in zip(parts, summed.split([p.numel() for p in parts])):
                part.copy_(value)
        return len(parts)


class OriginalStateDict:
    """Every module's own ``state_dict()`` / ``load_state_dict()`` as before FSDP (its parameters' names, its order,
    full tensors), through torch's state-dict hooks on every module of ``root``: FSDP moved each unit's parameters
    into flat shards (``fsdp_shard_<k>`` on the unit's first module), so a module's post-hook drops the shards
    registered on it and puts back its own parameters, gathered (a collective over DP: every rank calls it, as
    torch's FSDP with its default ``FULL_STATE_DICT``); its load pre-hook copies this rank's slice of each of its
    parameters into the shards. A flat is gathered once per outermost ``state_dict()`` call. ``stored()`` reads the
    shards as they are (checkpoints); after :meth:`close` (the communicators are gone) gathering is refused by name.
    Build it before :class:`FullyShardedDataParallel` moves the parameters; :meth:`attach` once it has."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        # each module's own state-dict entries in their order (parameters, then persistent buffers), before FSDP
        self._order = {
            id(m): [n for n, p in m._parameters.items() if p is not None]
            + [n for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set]
            for m in root.modules()
        }
        self.fsdp: FullyShardedDataParallel | None = None
        self._owned: dict[int, list[tuple[str, FlatShard, _Entry]]] = {}  # module → its parameters now in flats
        self._holds: dict[int, list[str]] = {}  # module → the shard attributes registered on it
        # flats gathered during the current outermost call, with their shard's version (a step or a load since: stale)
        self._cache: dict[int, tuple[int, torch.Tensor]] = {}
        self._depth = 0
        self._raw = False
        self.closed = False

    def attach(self, fsdp: FullyShardedDataParallel) -> None:
        self.fsdp = fsdp
        for f in fsdp.flats():
            for e in f.entries:
                for m, attr in e.owners:
                    self._owned.setdefault(id(m), []).append((attr, f, e))
        for m in self.root.modules():
            held = [n for n in m._parameters if n.startswith("fsdp_shard_")]
            if held:
                self._holds[id(m)] = held
            # torch marks a registered hook object (functools.partial takes the attribute; a bound method would not)
            m.register_state_dict_pre_hook(functools.partial(OriginalStateDict._enter, self))
            m.register_state_dict_post_hook(functools.partial(OriginalStateDict._exit, self))
            if id(m) in self._owned or id(m) in self._holds:
                m.register_load_state_dict_pre_hook(functools.partial(OriginalStateDict._load, self))

    def stored(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` as the modules hold it (the flat shards)."""
        self._raw = True
        try:
            return module.state_dict()
        finally:
            self._raw = False

    def _enter(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._depth == 0:
            self._cache.clear()  # an outermost call: gather afresh
        self._depth += 1

    def _exit(self, module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        self._depth -= 1
        try:
            if not self._raw:
                self._restore(module, state, prefix)
        finally:
            if self._depth <= 0:
                self._depth = 0
                self._cache.clear()

    @torch.no_grad()
    def _restore(self, module: nn.Module, state: dict[str, Any], prefix: str) -> None:
        owned, held = self._owned.get(id(module), []), self._holds.get(id(module), [])
        if not owned and not held:
            return
        if self.closed:
            raise RuntimeError(
                f"{type(module).__name__}.state_dict() under NxDStrategy(fsdp=True) after strategy.close(): its "
                "parameters are flat shards (fsdp_shard_<k>) and the communicators that gather them are closed — call "
                "state_dict() on every rank before close(), or save a checkpoint and turn it into one file with "
                "nxdt.lightning.convert_to_lightning_checkpoint(dir, out)"
            )
        assert self.fsdp is not None
        tail = {k: state.pop(k) for k in [k for k in state if k.startswith(prefix)]}  # this module's: the dict's tail
        for name in held:
            tail.pop(prefix + name, None)
        for attr, f, e in owned:
            cached = self._cache.get(id(f))
            if cached is None or cached[0] != f.shard._version:
                cached = self._cache[id(f)] = (f.shard._version, self.fsdp.gathered(f))
            tail[prefix + attr] = cached[1][e.offset : e.offset + e.numel].view(e.shape).clone()
        own = [prefix + n for n in self._order.get(id(module), [])]
        for k in own:  # the module's own entries first, in their order; its children's after them, as they came
            if k in tail:
                state[k] = tail.pop(k)
        state.update(tail)

    @torch.no_grad()
    def _load(
        self,
        module: nn.Module,
        state: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing: list,
        unexpected: list,
        errors: list,
    ) -> None:
        assert self.fsdp is not None
        for attr, f, e in self._owned.get(id(module), []):
            value = state.pop(prefix + attr, None)
            if value is None:
                continue
            if tuple(value.shape) != tuple(e.shape):
                errors.append(
                    f"size mismatch for {prefix}{attr}: copying a param with shape {tuple(value.shape)}, the model has {tuple(e.shape)}"
                )
                continue
            self.fsdp.load_entry(f, e, value)
        for name in self._holds.get(id(module), []):  # the shards now hold what was given: they load as they are
            state.setdefault(prefix + name, module._parameters[name].detach())


def _sharded(p: nn.Parameter, group_of: dict[int, tuple[int, int]]) -> bool:
    """FSDP shards a parameter an optimizer holds, or a frozen one (in no optimizer, ``requires_grad=False``)."""
    return id(p) in group_of or not p.requires_grad


class _ReportBackward(torch.autograd.Function):
    """Identity; its backward calls ``report()`` (the gradient of a unit's input is complete)."""

    @staticmethod
    def forward(ctx, x, report):
        ctx.report = report
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.report()
        return grad, None


def default_units(model: nn.Module) -> list[list[nn.Module]]:
    """``model.fsdp_units()`` (the model hub's: embedding, layers, head), else each child module that holds
    parameters (a user's module; parameters held by ``model`` itself could not be gathered before use)."""
    if hasattr(model, "fsdp_units"):  # a pipeline stage's shell lacks the other stages' modules: no units for them
        units = [[m for m in unit if m is not None and any(True for _ in m.parameters())] for unit in model.fsdp_units()]
        return [unit for unit in units if unit]
    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError(
            f"FSDP: {type(model).__name__} holds parameters directly; put them in child modules (each child "
            "becomes one FSDP unit) or define fsdp_units()"
        )
    return [[child] for child in model.children() if any(True for _ in child.parameters())]


def apply_fsdp(
    model: nn.Module,
    dp_comm: Any,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    units: Sequence[Sequence[nn.Module]] | None = None,
    **options: Any,
) -> FullyShardedDataParallel:
    """Shard ``model``'s optimized parameters over ``dp_comm`` (every member calls it, with identical weights)
    and point ``optimizers`` at the shards. ``units`` default to :func:`default_units`. ``options``: see
    :class:`FullyShardedDataParallel`. Returns the runtime (stats, state)."""
    return FullyShardedDataParallel(model, dp_comm, default_units(model) if units is None else units, optimizers, **options)
