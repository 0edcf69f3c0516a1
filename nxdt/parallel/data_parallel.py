"""The data-parallel runtime protocol: what a training strategy asks of data parallelism, answered by plain
replication, ZeRO-1 and FSDP alike.

A strategy picks one runtime once (:func:`data_parallel_runtime`, from its options), binds it to the
rank's groups (:meth:`DataParallelRuntime.bind`, a :class:`ModelParallel`) and then calls it without
asking which one it has:

===================  ==============================  ===============================  ===============================
                     :class:`ReplicatedRuntime`      :class:`Zero1Runtime`            :class:`FSDPRuntime`
===================  ==============================  ===============================  ===============================
finish_gradients     fp32 all-reduces (avg): DDP's   reduce-scatter into the shards   the last reduce-scatters
  (per optimizer)    buckets during backward, else   (per DDP bucket to its owners    (all flats, in backward)
                     one flat one after it           during backward, else after)
clip / shard grads   the optimizer's ``p.grad``      the optimizer's shard gradients  the optimizer's flat shards
parameter_norm       the replica's parameters        the replica's parameters         the flat shards (over DP)
model state          ``module.state_dict()``         ``module.state_dict()``          full weights gathered over DP
optimizer state      one per replica                 one shard per DP rank            one flat shard per DP rank
``dp_format``        ``replicated``                  ``zero1``                        ``fsdp``
===================  ==============================  ===============================  ===============================

Each optimizer has its own gradient path: ``finish_gradients(module, optimizer)`` reduces what that optimizer's step
reads (with the trainable parameters no optimizer holds), and the strategy calls it once per backward and optimizer;
``None`` means every optimizer (CausalLMModule's single one). A trainable parameter without gradient is refused by
name, or with ``find_unused_parameters`` left untouched (:class:`ReplicatedRuntime`).

Under FSDP the module's own ``state_dict()`` / ``load_state_dict()`` keep DDP's view (its names, its order, full
tensors; gathered over DP, a collective) through the hooks of :class:`~nxdt.parallel.fsdp.OriginalStateDict` on every
module; nxdt's checkpoint code reads the flat shards as stored.

With ``overlap_grad_reduce`` (the default) the replicated and ZeRO-1 reductions of the last backward before a step run
during it, bucket by bucket (:mod:`nxdt.parallel.overlap`; the strategy says which backward is the last through
``before_backward``), with the same bits as after it; ``overlap_off`` names what keeps a run on the after-backward path.

Frozen parameters (``requires_grad=False``: a LoRA model's base) are held by no optimizer and reduced by no runtime:
the replicated runtime's all-reduce and ZeRO-1's buckets take the trainable ones only, FSDP shards the frozen ones
in flats of their own (no gradient, no reduce-scatter, no optimizer state), and norms count the trainable ones.

Tensor, pipeline and expert parallelism compose with each of them through :class:`ModelParallel`: the
TP sum of partial gradients (sequence-parallel replicas', LoRA's replicated halves'), the expert reduction over the expert-data-parallel
group and the per-parameter norm weights that make a sum over TP/PP/EP shards the whole model's norm.
A runtime holds no checkpoint-format code: checkpoint names and by-name resharding stay with the caller
(``nxdt.lightning``), which hands them in where a runtime needs them.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from nxdt.comm.stream import Work
from nxdt.comm.world import Communicator
from nxdt.parallel import foreach_squared_norm, scale_, squared_norm
from nxdt.parallel.expert_parallel import is_expert_parameter, reduce_expert_gradients, routed_parameters
from nxdt.parallel.fsdp import FullyShardedDataParallel, OriginalStateDict, apply_fsdp
from nxdt.parallel.overlap import DP_STREAM, BackwardReduction, cap_elements, order_free, plan_buckets
from nxdt.parallel.tensor_parallel import partial_grad_names, shard_spec, sync_replicated_grads
from nxdt.parallel.zero1 import Zero1Optimizer, unused_parameters_message

FSDP_SHARD_MARK = "fsdp_shard_"  # state-dict names of FSDP's flat shards (never part of a checkpoint's model)


@dataclass
class ModelParallel:
    """One rank's groups and how a model replica is split over TP / PP / EP — what every DP runtime composes with.

    ``tp``, ``pp``, ``ep``, ``edp`` are None when that degree is 1; ``dp`` is always the rank's DP group."""

    dp: Communicator
    dp_size: int = 1
    tp: Communicator | None = None
    pp: Communicator | None = None
    ep: Communicator | None = None
    edp: Communicator | None = None  # the replicas of the same experts (EP > 1)
    sequence_parallel: bool = False
    norm_weights: dict[str, float] = field(default_factory=dict)  # TP: how each parameter enters a global norm
    tp_layout: dict[str, list[int]] | None = None  # TP-sharded parameters, recorded before FSDP flattens them
    # parameters whose gradients are partial sums over TP (SP's replicated ones, LoRA's replicated halves), by name;
    # recorded before FSDP flattens them (None: ask the model)
    tp_partial_grads: set[str] | None = None

    def sync_replicated_grads(self, module: nn.Module) -> None:
        """TP × sequence parallelism: sum the replicated parameters' gradients over TP (full gradients)."""
        if self.tp is not None:
            sync_replicated_grads(module.model, self.tp)

    def reduce_expert_grads(self, module: nn.Module, skip: Collection[int] = ()) -> None:
        """EP: expert gradients → the DP-mean loss's, over the expert-data-parallel group (``skip``: ids of the
        expert parameters a ZeRO-1 optimizer reduces in its own buckets)."""
        if self.ep is not None:
            edp = self.edp if self.edp is not None and self.edp.size > 1 else None
            reduce_expert_gradients(module.model, self.dp_size, edp, skip)

    def global_norm(self, module: nn.Module, named: Sequence[tuple[str, Tensor]]) -> Tensor:
        """2-norm of one model replica's tensors (parameters or their gradients, by the module's parameter
        names), which this rank holds a TP shard / EP slice / PP stage of; each weighted as in ``norm_weights``."""
        prefix = "model."
        device = named[0][1].device if named else None
        # [dense, experts], on the tensors' device (a rank's GPU: summed there, reduced over NCCL)
        squares = torch.zeros(2, dtype=torch.float64, device=device)
        experts = {n for n, p in module.named_parameters() if is_expert_parameter(p)}
        # (weight, dense 0 / experts 1, tensor)
        weighted = [
            (self.norm_weights.get(name[len(prefix) :] if name.startswith(prefix) else name, 1.0), int(name in experts), t)
            for name, t in named
        ]
        if device is None or device.type == "cpu":  # per tensor, float64 throughout: what the sharded runtimes add up to
            for w, part, t in weighted:
                squares[part] += w * squared_norm(t)
        else:  # a GPU: a few foreach kernels per weight and part instead of five per tensor
            parts: dict[tuple[float, int], list[Tensor]] = {}
            for w, part, t in weighted:
                parts.setdefault((w, part), []).append(t)
            for (w, part), tensors in parts.items():
                squares[part] += w * foreach_squared_norm(tensors)
        if self.ep is not None:  # each EP rank holds different experts: add their parts
            expert_part = squares[1:].clone()
            self.ep.all_reduce(expert_part, op="sum")
            squares[1] = expert_part[0]
        squares = squares.sum().reshape(1)
        for comm in (self.tp, self.pp):  # shards of one replica live on these groups: add their parts
            if comm is not None:
                comm.all_reduce(squares, op="sum")
        return squares.sqrt().reshape(()).float()


@runtime_checkable
class DataParallelRuntime(Protocol):
    """What a strategy asks of data parallelism. ``module`` is the LightningModule (or any module whose
    ``model`` attribute, when present, is the parallelised hub model)."""

    dp_format: str  # a checkpoint's meta "dp_format": "replicated" | "zero1" | "fsdp"
    shards_optimizer_state: bool  # each DP rank writes its own trainer-state file
    # the dtype the model computes its activations in when the runtime sets it (FSDP's bf16 gathers: the embedding's
    # output and so the residual stream are bf16), what a pipeline stage receives; None: the model's own
    compute_dtype: torch.dtype | None

    def bind(self, mp: ModelParallel) -> None:
        """Attach the rank's groups (after TP/EP/PP have been applied)."""

    def broadcast_parameters(self, module: nn.Module) -> None:
        """Make every DP replica start from DP rank 0's weights (before any sharding)."""

    def broadcast_buffers(self, module: nn.Module) -> None:
        """DP rank 0's module buffers (BatchNorm's running statistics) to every DP replica: DDP's ``broadcast_buffers``."""

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
        """The optimizer the step uses (ZeRO-1: the same optimizer over state shards; otherwise unchanged)."""

    def shard_model(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, precision: str = "32-true", tracer: Any = None
    ) -> None:
        """After the optimizers exist (FSDP: flatten and shard the parameters, point the optimizers at the shards)."""

    def shard_frozen(self, model: nn.Module, *, precision: str = "32-true") -> nn.Module:
        """A frozen copy of the hub model (every parameter ``requires_grad=False``, already laid out over TP as the
        trained one; GRPO's reference) laid out over DP as the trained model is: FSDP shards it in units of its own
        (gathered for each forward, no optimizer); replicated and ZeRO-1 keep it whole. Every DP rank calls it."""

    def finish_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """After the last backward before ``optimizer``'s step: its parameters' gradients (and those of trainable
        parameters no optimizer holds) reduced over DP (and TP/EP) where the optimizer reads them; every optimizer's
        when None. Raises ValueError naming trainable parameters without gradient (unless ``find_unused_parameters``)."""

    def before_backward(self, last: bool) -> None:
        """Before each backward: ``last`` when it is the last before the optimizer step (not gradient accumulation's
        earlier micro-batches), whose gradients may then be reduced while it runs (:mod:`nxdt.parallel.overlap`)."""

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer``'s step: parameters no rank had a gradient for are put back (``find_unused_parameters``)."""

    def show_reduced_gradients(self) -> None:
        """From now on every parameter's ``.grad`` holds the DP average after the reduction (ZeRO-1: an all-reduce instead
        of the reduce-scatter), for hooks that read it; FSDP's parameters are its flat shards, whose gradients are this
        rank's slice of the average (as under Lightning's FSDPStrategy)."""

    def clip_grad_norm_(self, module: nn.Module, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """Clip ``optimizer``'s gradients (every optimizer's when None) by their norm over the whole model (finished
        gradients, all shards), as Lightning clips ``optimizer.param_groups``; returns the norm."""

    def gradient_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """2-norm of the finished gradients of ``optimizer``'s parameters (of every parameter with one when None) over
        the whole model, sharded or not: what Lightning's ``grad_norm(module)`` totals under DDP. A collective."""

    def shard_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[Tensor]:
        """``optimizer``'s finished gradients (every optimizer's when None) as it reads them (element-wise clipping)."""

    def parameter_norm(self, module: nn.Module) -> Tensor:
        """2-norm of the whole model's parameters (a collective over the groups holding other parts)."""

    def step_stats(self) -> dict[str, float]:
        """Per-step communication figures for the metrics (empty when there are none)."""

    def checkpoint_flags(self) -> dict[str, bool]:
        """The meta.json flags ``zero1`` and ``fsdp`` (older readers' view of ``dp_format``)."""

    def optimizer_layout(self, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module) -> Any | None:
        """What a checkpoint records to unflatten this rank's optimizer state by name (FSDP), else None."""

    def close(self) -> None:
        """The strategy's communicators are closed (FSDP: the module's state_dict() can no longer gather)."""

    def model_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """The model file's tensors: unsharded weights by their original names (a collective under FSDP)."""

    def model_state_keys(self, module: nn.Module) -> list[str]:
        """The state-dict names this rank's module holds (its stage; FSDP's parameters by their own names)."""

    def load_model_state(self, module: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Load the part of ``state`` the runtime owns (FSDP: its slices of every sharded parameter); returns the
        rest for ``module.load_state_dict``. Raises KeyError / ValueError for a tensor that does not fit."""

    def optimizer_states(
        self,
        states: list[dict[str, Any]],
        optimizers: Sequence[torch.optim.Optimizer],
        module: nn.Module,
        *,
        resharded: bool,
        tp_rank: int,
        by_name: Callable[[], list[dict[str, Any]]],
    ) -> list[dict[str, Any]]:
        """What each optimizer's ``load_state_dict`` gets from a checkpoint's ``states`` (``resharded``: by-name full
        states of another layout). ``by_name()`` is the caller's mapping of replicated/ZeRO-1 states by
        parameter name. Raises ValueError for a state that does not fit."""


def _hub(module: nn.Module) -> nn.Module:
    """The module whose parameter names the parallel layers use: a hub model (``.model``) or ``module`` itself."""
    model = getattr(module, "model", None)
    return model if isinstance(model, nn.Module) else module


@torch.no_grad()
def broadcast_flat(tensors: list[Tensor], comm: Communicator) -> None:
    """Broadcast tensors from the group's rank 0, one flat buffer per dtype."""
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        comm.broadcast(flat, root=0)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class ReplicatedRuntime:
    """Plain data parallelism: every DP rank holds the whole replica; gradients averaged in DDP's buckets during the last
    backward (:meth:`before_backward`), or in one flat all-reduce after it.

    Each optimizer's gradients are reduced before its own step (several optimizers: a GAN's generator and
    discriminator), together with those of trainable parameters no optimizer holds (as DDP reduces every parameter's
    after each backward; re-averaging equal values changes nothing). A trainable parameter without gradient on some
    rank is refused by name, as DDP refuses it; with ``find_unused_parameters`` it counts as zero where missing, and
    one no rank has a gradient for keeps ``grad`` None, so the optimizer skips it (DDP's semantics)."""

    dp_format = "replicated"
    shards_optimizer_state = False
    compute_dtype: torch.dtype | None = None
    _reduction_ops: tuple[str, ...] = ("all_reduce",)  # the after-backward path's and the buckets' collectives

    def __init__(
        self, find_unused_parameters: bool = False, *, overlap_grad_reduce: bool = True, bucket_cap_mb: float | None = None
    ) -> None:
        self._mp: ModelParallel | None = None
        self._grad_buffer: Tensor | None = None
        self.find_unused_parameters = find_unused_parameters
        self.optimizers: list[torch.optim.Optimizer] = []  # the step's optimizers (shard_model)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.bucket_cap_mb = bucket_cap_mb  # DDP's option: None = its 25 MiB
        self.overlap_off: str | None = "not set up yet"  # why gradients are reduced after backward (None: overlapped)
        self._reductions: list[BackwardReduction] = []  # one per flat gradient store the hooks fill
        self._after: list[tuple[str, nn.Parameter]] = []  # overlapped: the TP-partial ones, reduced after their TP sum
        self._buckets: list[tuple[list[tuple[str, nn.Parameter]], Tensor]] = []  # replicated: (params, flat) each
        self._order: dict[int, int] = {}  # parameter id -> its place in the module (error messages list in that order)
        self._routed: set[int] = set()  # MoE experts' parameters: a rank may lack their gradient (never refused)

    def bind(self, mp: ModelParallel) -> None:
        self._mp = mp

    @property
    def mp(self) -> ModelParallel:
        """The rank's groups (:meth:`bind`)."""
        if self._mp is None:
            raise RuntimeError(f"{type(self).__name__}: bind() the rank's groups before using the runtime")
        return self._mp

    def broadcast_parameters(self, module: nn.Module) -> None:
        self._broadcast(list(module.parameters()) + list(module.buffers()))

    def broadcast_buffers(self, module: nn.Module) -> None:
        self._broadcast(list(module.buffers()))

    @torch.no_grad()
    def _broadcast(self, tensors: list[Tensor]) -> None:
        if self.mp.dp_size == 1:
            return
        tensors = [t for t in tensors if t.numel()]
        experts = [t for t in tensors if is_expert_parameter(t)]  # different experts on each EP rank: not over DP
        dense = [t for t in tensors if not is_expert_parameter(t)]
        for comm, group in ((self.mp.dp, dense), (self.mp.edp, experts)):
            if comm is not None and group:
                broadcast_flat(group, comm)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
        return optimizer

    def shard_model(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, precision: str = "32-true", tracer: Any = None
    ) -> None:
        self.optimizers = list(optimizers)
        self._routed = routed_parameters(module)
        for r in self._reductions:  # set up again (a second fit): the earlier hooks go
            r.remove()
        self._reductions, self._buckets, self._after = [], [], []
        self.overlap_off = self._overlap_blocker(module)
        if self.overlap_off is None:
            self._overlap(module)

    def shard_frozen(self, model: nn.Module, *, precision: str = "32-true") -> nn.Module:
        return model  # every replica holds the whole model (ZeRO-1 shards optimizer state only)

    # ------------------------------------------------------------------------------------ overlap with backward
    def _overlap_blocker(self, module: nn.Module) -> str | None:
        """Why this run reduces its gradients after backward instead of during it (None: nothing stops the overlap).
        Each case keeps a semantic the hooks could not: the same bits, TP sums before the DP average, one reduction
        per optimizer."""
        if not self.overlap_grad_reduce:
            return "overlap_grad_reduce is off"
        if self.mp.dp_size == 1:
            return "no data parallelism"
        if not order_free(self.mp.dp, *self._reduction_ops):
            return (
                f"a data-parallel group of {self.mp.dp_size} on the {self.mp.dp.transport} transport with algorithms "
                f"{self.mp.dp.algorithms or 'auto'}: bucket boundaries would change the summation order (bits); a group "
                "of 2, or one host's shm with its direct algorithms, keeps it"
            )
        if len(self.optimizers) > 1:
            return f"{len(self.optimizers)} optimizers, each reduced before its own step"
        if any(p.requires_grad and p.device.type != "cpu" for p in module.parameters()):
            return "parameters off the CPU"
        return None

    def _tp_partial(self, module: nn.Module) -> set[int]:
        """Ids of the parameters whose gradients are partial sums over TP after backward (sequence parallelism's
        replicated ones, LoRA's replicated halves): :meth:`ModelParallel.sync_replicated_grads` completes them after
        backward, so their DP average cannot start during it."""
        if self.mp.tp is None:
            return set()
        hub = _hub(module)
        partial = self.mp.tp_partial_grads if self.mp.tp_partial_grads is not None else partial_grad_names(hub)
        return {id(p) for n, p in hub.named_parameters() if n in partial}

    def _overlap(self, module: nn.Module) -> None:
        """DDP's buckets over the trainable dense parameters, in reverse module order (:mod:`nxdt.parallel.overlap`):
        each one flat fp32 buffer of its gradients then one 1/0 per parameter, as :meth:`sync_gradients`' single one.
        TP-partial gradients stay out of the buckets: one flat all-reduce after their TP sum (:meth:`reduce_gradients`);
        per element the same bits (``order_free``: the order does not depend on which buffer an element is in)."""
        every = [(n, p) for n, p in self._stepped(module, None) if not is_expert_parameter(p)]
        self._order = {id(p): i for i, (_, p) in enumerate(every)}
        partial = self._tp_partial(module)
        self._after = [(n, p) for n, p in every if id(p) in partial]
        named = [(n, p) for n, p in every if id(p) not in partial]
        backward = named[::-1]
        groups = plan_buckets([p.numel() for _, p in backward], cap_elements(self.bucket_cap_mb, 4))
        self._buckets = [
            (
                [backward[i] for i in g],
                self.mp.dp.empty(sum(backward[i][1].numel() for i in g) + len(g), torch.float32, backward[g[0]][1].device),
            )
            for g in groups
        ]
        place: dict[int, tuple[int, int]] = {}  # parameter id -> (its first element, its flag) in its bucket's flat
        for params, flat in self._buckets:
            numel = flat.numel() - len(params)
            at = 0
            for k, (_, p) in enumerate(params):
                place[id(p)] = (at, numel + k)
                at += p.numel()
        dp = self.mp.dp

        def fill(b: int, p: nn.Parameter) -> None:
            at, flag = place[id(p)]
            flat = self._buckets[b][1]
            view = flat[at : at + p.numel()]  # a parameter without a gradient on this rank contributes zeros
            view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
            flat[flag] = float(p.grad is not None)

        def launch(b: int) -> list[Work]:
            work = dp.all_reduce(self._buckets[b][1], op="avg", stream=DP_STREAM, async_op=True)
            assert work is not None  # async_op: always a Work
            return [work]

        self._reductions = [BackwardReduction([[p for _, p in params] for params, _ in self._buckets], fill, launch, dp)]

    def before_backward(self, last: bool) -> None:
        for r in self._reductions:
            r.arm() if last else r.disarm()

    # ------------------------------------------------------------------------------------ gradients
    def _stepped(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, nn.Parameter]]:
        """The trainable parameters whose gradients ``optimizer``'s step reduces: its own and those no optimizer holds
        (every trainable one when None). FSDP's flat shards are reduced by FSDP."""
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and FSDP_SHARD_MARK not in n]
        if optimizer is None:
            return named
        own = {id(p) for g in optimizer.param_groups for p in g["params"]}
        held = {id(p) for o in self.optimizers for g in o.param_groups for p in g["params"]}
        return [(n, p) for n, p in named if id(p) in own or id(p) not in held]

    def finish_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.mp.sync_replicated_grads(module)
        self.reduce_gradients(module, optimizer)
        self.mp.reduce_expert_grads(module)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # a parameter no rank had a gradient for kept grad None: the optimizer skipped it

    def show_reduced_gradients(self) -> None:
        pass  # every .grad is the average already (FSDP: its shards' gradients are)

    def reduce_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """The data-parallel reduction proper (after the TP sums, before the expert reduction): the buckets the armed
        backward reduced, else one all-reduce now."""
        if self._reductions and self._reductions[0].finish():
            after = self._reduce_flat(self._after)
            self._write_averages(self._buckets + ([after] if after is not None else []))
            return
        self.sync_gradients(self._stepped(module, optimizer))

    @torch.no_grad()
    def sync_gradients(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Average the parameters' gradients over the data-parallel group: one flat fp32 bucket, one all-reduce
        (expert parameters are reduced over their own group). The bucket ends with one 1/0 per parameter (a gradient
        on this rank or not), so the same all-reduce tells every rank who lacks one."""
        reduced = self._reduce_flat(named)
        if reduced is not None:
            self._write_averages([reduced])

    @torch.no_grad()
    def _reduce_flat(self, named: Sequence[tuple[str, nn.Parameter]]) -> tuple[list[tuple[str, nn.Parameter]], Tensor] | None:
        """The dense parameters of ``named`` and their gradients then 1/0 flags in one flat fp32 buffer, averaged over
        DP (None: nothing to reduce)."""
        params = [(n, p) for n, p in named if not is_expert_parameter(p)]
        if self.mp.dp_size == 1 or not params:
            return None
        numel = sum(p.numel() for _, p in params)
        if self._grad_buffer is None or self._grad_buffer.numel() != numel + len(params):
            # kept: peers read it in place (shm); a CUDA model's buffer is on its GPU (nccl)
            self._grad_buffer = self.mp.dp.empty(numel + len(params), torch.float32, params[0][1].device)
        flat, offset = self._grad_buffer, 0
        for _, p in params:  # a parameter without a gradient on this rank contributes zeros
            view = flat[offset : offset + p.numel()]
            view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
            offset += p.numel()
        flat[numel:].copy_(torch.tensor([float(p.grad is not None) for _, p in params]))
        self.mp.dp.all_reduce(flat, op="avg")
        return params, flat

    @torch.no_grad()
    def _write_averages(self, reduced: Sequence[tuple[Sequence[tuple[str, nn.Parameter]], Tensor]]) -> None:
        """Each (parameters, flat) averaged over DP — their gradients, then one share of ranks with a gradient per
        parameter — into the parameters' ``.grad``; refuses parameters some rank lacks a gradient for, by name."""
        lacking: list[tuple[int, str]] = []
        for params, flat in reduced:
            numel = flat.numel() - len(params)
            # the share of ranks with a gradient: exactly 1.0 (k/k) where all have one
            lacking += [
                (self._order.get(id(p), 0), n)
                for (n, p), u in zip(params, flat[numel:].tolist())
                if u < 1.0 and id(p) not in self._routed  # a MoE expert: a rank may have routed it no token
            ]
        if lacking and not self.find_unused_parameters:
            raise ValueError(f"NxDStrategy: {unused_parameters_message([n for _, n in sorted(lacking, key=lambda x: x[0])])}")
        for params, flat in reduced:
            numel = flat.numel() - len(params)
            offset = 0
            for (_, p), u in zip(params, flat[numel:].tolist()):
                view = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if u == 0.0:  # no rank has one: grad stays None and the optimizer skips the parameter, as under DDP
                    continue
                if p.grad is None:
                    p.grad = view.to(p.dtype).clone()
                else:
                    p.grad.copy_(view)

    def _clipped(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, Tensor]]:
        """(name, gradient) of what clipping ``optimizer`` scales: its parameters' (every optimizer's when None)."""
        held = {
            id(p)
            for o in ([optimizer] if optimizer is not None else self.optimizers)
            for g in o.param_groups
            for p in g["params"]
        }
        every = optimizer is None and not self.optimizers  # no optimizer known (a runtime used on its own): all
        return [
            (n, p.grad)
            for n, p in module.named_parameters()
            if p.requires_grad and p.grad is not None and (every or id(p) in held)
        ]

    @torch.no_grad()
    def clip_grad_norm_(self, module: nn.Module, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        named = self._clipped(module, optimizer)
        norm = self.mp.global_norm(module, named)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # fp32, as torch.nn.utils.clip_grad_norm_ computes it
        scale_([g for _, g in named], coef)
        return norm

    def shard_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[Tensor]:
        return [g for _, g in self._clipped(module, optimizer)]

    @torch.no_grad()
    def gradient_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        sharded, in_shards = self._sharded_norm(module, optimizer)
        own = None if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
        rest = [
            (n, p.grad)
            for n, p in module.named_parameters()
            if p.grad is not None and FSDP_SHARD_MARK not in n and id(p) not in in_shards and (own is None or id(p) in own)
        ]
        return (sharded.double().square() + self.mp.global_norm(module, rest).double().square()).sqrt().float()

    def _sharded_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Tensor, set[int]]:
        """The norm of the gradients a sharding runtime holds for ``optimizer`` (all when None), and the ids of the
        parameters it covers (none here: every gradient is a parameter's .grad)."""
        return torch.zeros(()), set()

    @torch.no_grad()
    def parameter_norm(self, module: nn.Module) -> Tensor:
        return self.mp.global_norm(module, [(n, p) for n, p in module.named_parameters() if p.requires_grad])

    def step_stats(self) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------------------------------ checkpoints
    def checkpoint_flags(self) -> dict[str, bool]:
        return {"zero1": self.dp_format == "zero1", "fsdp": self.dp_format == "fsdp"}

    def optimizer_layout(self, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module) -> Any | None:
        return None

    def close(self) -> None:
        pass

    def model_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        return module.state_dict()

    def model_state_keys(self, module: nn.Module) -> list[str]:
        return [k for k in module.state_dict() if FSDP_SHARD_MARK not in k]

    def load_model_state(self, module: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return state

    def optimizer_states(
        self,
        states: list[dict[str, Any]],
        optimizers: Sequence[torch.optim.Optimizer],
        module: nn.Module,
        *,
        resharded: bool,
        tp_rank: int,
        by_name: Callable[[], list[dict[str, Any]]],
    ) -> list[dict[str, Any]]:
        return by_name()


class Zero1Runtime(ReplicatedRuntime):
    """ZeRO-1: replicated weights, optimizer state (and the reduced gradients) sharded over DP by
    :class:`~nxdt.parallel.zero1.Zero1Optimizer`, one per optimizer (each reduces, clips and steps its own buckets).
    Until an optimizer is sharded it behaves as replicated."""

    dp_format = "zero1"
    shards_optimizer_state = True
    _reduction_ops = ("all_reduce", "reduce_scatter", "reduce")  # Zero1Optimizer's, after and during backward

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> torch.optim.Optimizer:
        if isinstance(optimizer, Zero1Optimizer):
            return optimizer
        groups = [dict(g) for g in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer).__init__).parameters  # defaults may hold derived flags
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return Zero1Optimizer(
            groups,
            type(optimizer),
            self.mp.dp,
            model=_hub(module),
            find_unused_parameters=self.find_unused_parameters,
            expert_parallel_size=self.mp.ep.size if self.mp.ep is not None else 1,
            expert_dp_comm=self.mp.edp,
            **kwargs,
        )

    def finish_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.mp.sync_replicated_grads(module)
        self.reduce_gradients(module, optimizer)
        # the experts in ZeRO-1's buckets were reduced there, over their own group
        self.mp.reduce_expert_grads(module, skip={id(p) for o in self._sharded(None) for p in o.bucketed()})

    def show_reduced_gradients(self) -> None:
        for o in self._sharded(None):
            o.full_gradients = True

    def _overlap_blocker(self, module: nn.Module) -> str | None:
        blocker = super()._overlap_blocker(module)
        if blocker is None and self.mp.ep is not None:
            return "expert parallelism (expert gradients are reduced after the dense ones)"
        if blocker is None and not self._sharded(None):
            return "no ZeRO-1 optimizer"
        return blocker

    def _overlap(self, module: nn.Module) -> None:
        """Each ZeRO-1 optimizer reduces its buckets to the shards' owners in DDP's buckets during backward."""
        order = [p for p in _hub(module).parameters()]
        partial = self._tp_partial(module)
        found = [o.overlap_with_backward(self.bucket_cap_mb, order, partial) for o in self._sharded(None)]
        self._reductions = [r for r in found if r is not None]
        if not self._reductions:
            self.overlap_off = "nothing to reduce during backward"

    def reduce_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        sharded = self._sharded(optimizer)
        for o in sharded:
            o.reduce_gradients(again=True)  # the strategy calls this once per backward: new local gradients
        in_buckets = {id(p) for o in sharded for g in o.param_groups for p in g["params"]}
        self.sync_gradients([(n, p) for n, p in self._stepped(module, optimizer) if id(p) not in in_buckets])

    def _sharded(self, optimizer: torch.optim.Optimizer | None) -> list[Zero1Optimizer]:
        """The ZeRO-1 optimizers one step concerns: ``optimizer`` itself, or every one (None)."""
        chosen = [optimizer] if optimizer is not None else self.optimizers
        return [o for o in chosen if isinstance(o, Zero1Optimizer)]

    @torch.no_grad()
    def clip_grad_norm_(self, module: nn.Module, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        sharded = self._sharded(optimizer)
        if not sharded:
            return super().clip_grad_norm_(module, max_norm, optimizer)
        if len(sharded) > 1:
            raise ValueError("NxDStrategy(zero1=True): name the optimizer to clip (there are several)")
        weights = self.mp.norm_weights  # the reduced gradients live in the optimizer's shards
        by_param = {id(p): weights.get(n, 1.0) for n, p in _hub(module).named_parameters()}
        extra = [c for c in (self.mp.tp, self.mp.pp) if c is not None]
        return sharded[0].clip_grad_norm_(max_norm, extra, weight=lambda p: by_param.get(id(p), 1.0))

    def shard_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[Tensor]:
        sharded = self._sharded(optimizer)
        if not sharded:
            return super().shard_gradients(module, optimizer)
        return [g for o in sharded for g in o.shard_gradients()]

    def _sharded_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Tensor, set[int]]:
        sharded = self._sharded(optimizer)
        weights = self.mp.norm_weights
        by_param = {id(p): weights.get(n, 1.0) for n, p in _hub(module).named_parameters()}
        extra = [c for c in (self.mp.tp, self.mp.pp) if c is not None]
        # max_norm inf: the coefficient is exactly 1, nothing is scaled
        norms = [o.clip_grad_norm_(math.inf, extra, weight=lambda p: by_param.get(id(p), 1.0)) for o in sharded]
        squares = sum(
            (n.double().square() for n in norms), torch.zeros((), dtype=torch.float64, device=norms[0].device if norms else None)
        )
        return squares.sqrt(), {id(p) for o in sharded for g in o.param_groups for p in g["params"]}


class FSDPRuntime(ReplicatedRuntime):
    """FSDP: parameters, gradients and optimizer state sharded over DP in flat units
    (:class:`~nxdt.parallel.fsdp.FullyShardedDataParallel`, built by :meth:`shard_model`); ``options`` are
    :func:`~nxdt.parallel.fsdp.apply_fsdp`'s. Until the model is sharded it behaves as replicated."""

    dp_format = "fsdp"
    shards_optimizer_state = True

    def __init__(self, options: dict[str, Any] | None = None, find_unused_parameters: bool = False) -> None:
        super().__init__(find_unused_parameters, overlap_grad_reduce=False)
        self.overlap_off = "FSDP reduce-scatters its units during backward itself"
        self.options = dict(options or {})
        self.fsdp: FullyShardedDataParallel | None = None
        self.frozen: list[FullyShardedDataParallel] = []  # shard_frozen's models (their stats are reset with the step's)
        self.prefix = ""  # FSDP names parameters relative to the units' owner; checkpoints from the module
        self._routed_names: set[str] = set()  # MoE experts' parameters (FSDP entry names): never refused as unused
        self._original: OriginalStateDict | None = None  # every module's own state_dict(), as before FSDP
        # (optimizer, shard, first, end, values, moments) of parameters no rank had a gradient for: put back after the step
        self._untouched: list[tuple[torch.optim.Optimizer, Tensor, int, int, Tensor, dict[str, Tensor]]] = []

    def shard_model(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, precision: str = "32-true", tracer: Any = None
    ) -> None:
        model = getattr(module, "model", None)
        owner: nn.Module = model if hasattr(model, "fsdp_units") else module  # a hub model (its fsdp_units) or the module
        options = dict(self.options)
        if self.mp.pp is not None:  # micro-batches' forwards and backwards interleave: gathered once per step
            options["gather_per_step"] = True
        if precision == "bf16-mixed":  # gather bf16 copies of the fp32 shards
            options.setdefault("param_dtype", torch.bfloat16)
        original = OriginalStateDict(module)  # each module's own order, before FSDP moves its parameters
        routed = routed_parameters(module)  # MoE experts, by the names FSDP's entries keep
        self._routed_names = {n for n, p in owner.named_parameters() if id(p) in routed}
        self.fsdp = apply_fsdp(owner, self.mp.dp, optimizers, tracer=tracer, **self._expert_option(), **options)
        self.compute_dtype = self.fsdp.param_dtype
        self.optimizers = list(optimizers)
        self.prefix = "" if owner is module else next(name for name, m in module.named_modules() if m is owner) + "."
        # every module's own state_dict() / load_state_dict() keep DDP's names and full tensors (a collective, as
        # torch's FSDP with its default FULL_STATE_DICT): a user's hook, or code after fit, sees what it sees under DDP
        original.attach(self.fsdp)
        self._original = original

    def shard_frozen(self, model: nn.Module, *, precision: str = "32-true") -> nn.Module:
        if self.fsdp is None:  # the trained model is not sharded either
            return model
        if any(p.requires_grad for p in model.parameters()):
            raise ValueError("FSDPRuntime.shard_frozen: the model has trainable parameters; freeze it first")
        options = dict(self.options)
        if precision == "bf16-mixed":  # the same gathered dtype as the trained model's forward
            options.setdefault("param_dtype", torch.bfloat16)
        # no optimizer: every parameter in frozen flats
        self.frozen.append(apply_fsdp(model, self.mp.dp, [], **self._expert_option(), **options))
        return model

    def _expert_option(self) -> dict[str, Any]:
        """Under expert parallelism each rank's experts are sharded over their replicas (``edp``), not over DP."""
        return {"expert_comm": self.mp.edp} if self.mp.ep is not None else {}

    def broadcast_parameters(self, module: nn.Module) -> None:
        if self.fsdp is None:
            return super().broadcast_parameters(module)
        # sharded already (test / predict after fit): each rank's flat shards are its own — rank 0's would overwrite
        # the others' slices; what FSDP does not hold is still replicated
        shards = {id(f.shard) for fsdp in (self.fsdp, *self.frozen) for f in fsdp.flats()}
        self._broadcast([p for p in module.parameters() if id(p) not in shards] + list(module.buffers()))

    def close(self) -> None:
        if self._original is not None:
            self._original.closed = True

    def _stored_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """``module.state_dict()`` as the module holds it (FSDP's flat shards), for nxdt's own checkpoint code."""
        return self._original.stored(module) if self._original is not None else module.state_dict()

    # ------------------------------------------------------------------------------------ gradients
    def _index(self, optimizer: torch.optim.Optimizer | None) -> int | None:
        """The position FSDP's flats record for ``optimizer`` (None: every optimizer)."""
        if optimizer is None:
            return None
        found = [i for i, o in enumerate(self.optimizers) if o is optimizer]
        if not found:
            raise ValueError("FSDP: this optimizer is not one the model was sharded for (NxDStrategy's optimizers)")
        return found[0]

    def before_backward(self, last: bool) -> None:
        if self.fsdp is None:
            return super().before_backward(last)
        self.fsdp.before_backward(last)  # under PP its step's gradients are reduced from the last backward on

    def finish_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.fsdp is None:
            return super().finish_gradients(module, optimizer)
        self.fsdp.finish_gradients()
        if self.mp.tp is not None:  # TP sums of partial gradients on the shards: the full gradients are gone
            partial = self.mp.tp_partial_grads if self.mp.tp_partial_grads is not None else partial_grad_names(_hub(module))
            if partial:
                self.fsdp.sum_replicated_grads(self.mp.tp, lambda name: name not in partial)
        index = self._index(optimizer)
        lacking, nowhere = self.fsdp.unused_entries(index)
        lacking = [n for n in lacking if n not in self._routed_names]  # a MoE expert a rank routed no token to
        if lacking and not self.find_unused_parameters:
            raise ValueError(f"NxDStrategy: {unused_parameters_message([self.prefix + n for n in lacking])}")
        owner = {id(p): o for o in self.optimizers for g in o.param_groups for p in g["params"]}
        self._untouched = []
        for flat, a, b in nowhere:  # their moments and weights as they are now, before the step
            opt = owner[id(flat.shard)]
            state = opt.state.get(flat.shard, {})
            moments = {k: v[a:b].clone() for k, v in state.items() if isinstance(v, Tensor) and v.shape == flat.shard.shape}
            self._untouched.append((opt, flat.shard, a, b, flat.shard.detach()[a:b].clone(), moments))
        # trainable parameters FSDP does not hold (in no optimizer): averaged as the replicated runtime does
        self.sync_gradients(self._stepped(module, optimizer))

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Put back the parts of ``optimizer``'s shards that no rank had a gradient for (``find_unused_parameters``): a
        flat shard steps as a whole, where torch's optimizers skip such a parameter."""
        for opt, shard, a, b, values, moments in self._untouched:
            if opt is not optimizer:
                continue
            shard.detach()[a:b].copy_(values)
            for k, v in opt.state.get(shard, {}).items():
                if isinstance(v, Tensor) and v.shape == shard.shape:  # a state this step created reads as never stepped
                    v[a:b].copy_(moments[k]) if k in moments else v[a:b].zero_()
        self._untouched = [u for u in self._untouched if u[0] is not optimizer]

    @torch.no_grad()
    def clip_grad_norm_(self, module: nn.Module, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        if self.fsdp is None:
            return super().clip_grad_norm_(module, max_norm, optimizer)
        # each DP rank holds a different part of every gradient, each TP rank and PP stage other parameters
        return self.fsdp.clip_grad_norm_(max_norm, self._model_comms(), self.mp.norm_weights, self._index(optimizer))

    def _model_comms(self) -> list[Communicator]:
        """The groups whose ranks hold other parts of one model replica (TP shards, PP stages): a norm sums over them."""
        return [c for c in (self.mp.tp, self.mp.pp) if c is not None]

    def shard_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[Tensor]:
        if self.fsdp is None:
            return super().shard_gradients(module, optimizer)
        return self.fsdp.shard_gradients(self._index(optimizer))

    def _sharded_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[Tensor, set[int]]:
        if self.fsdp is None:
            return super()._sharded_norm(module, optimizer)
        # max_norm inf: nothing is scaled
        return self.fsdp.clip_grad_norm_(math.inf, self._model_comms(), self.mp.norm_weights, self._index(optimizer)), set()

    @torch.no_grad()
    def parameter_norm(self, module: nn.Module) -> Tensor:
        if self.fsdp is None:
            return super().parameter_norm(module)
        weights = self.mp.norm_weights  # each DP rank holds a different slice of every flat unit
        flats = self.fsdp.flats()
        squares = torch.zeros(1, dtype=torch.float64, device=flats[0].shard.device if flats else None)
        for flat in flats:
            if not flat.trainable:  # as the replicated runtime: the norm of what training updates
                continue
            for entry, a, b in flat.counted_segments():
                squares += weights.get(entry.name, 1.0) * squared_norm(flat.shard[a:b])
        for comm in (self.fsdp.comm, *self._model_comms()):
            if comm is not None and comm.size > 1:
                comm.all_reduce(squares, op="sum")
        return squares.sqrt().reshape(()).float()

    def step_stats(self) -> dict[str, float]:
        for frozen in self.frozen:  # not counted: the figures are the trained model's units
            frozen.reset_stats()
        return self.fsdp.step_stats() if self.fsdp is not None else {}

    # ------------------------------------------------------------------------------------ checkpoints
    def optimizer_layout(self, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module) -> Any | None:
        return self.fsdp.flat_layout(optimizers, self.prefix) if self.fsdp is not None else None

    def model_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """The unsharded weights by their original names (gathered over DP one unit at a time; a collective every
        rank joins), so the model file is the same as without FSDP."""
        if self.fsdp is None:
            return super().model_state_dict(module)
        state = {k: v for k, v in self._stored_state_dict(module).items() if FSDP_SHARD_MARK not in k}
        state.update(self.fsdp.full_state_dict(prefix=self.prefix))
        return state

    def model_state_keys(self, module: nn.Module) -> list[str]:
        if self.fsdp is None:
            return super().model_state_keys(module)
        keys = [k for k in self._stored_state_dict(module) if FSDP_SHARD_MARK not in k]
        return keys + [self.prefix + n for f in self.fsdp.flats() for e in f.entries for n in e.names]

    def load_model_state(self, module: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.fsdp.load_full_state_dict(state, prefix=self.prefix) if self.fsdp is not None else state

    def optimizer_states(
        self,
        states: list[dict[str, Any]],
        optimizers: Sequence[torch.optim.Optimizer],
        module: nn.Module,
        *,
        resharded: bool,
        tp_rank: int,
        by_name: Callable[[], list[dict[str, Any]]],
    ) -> list[dict[str, Any]]:
        """Flat shards: this run's own shards load as they are, full states (``resharded``) are cut into them."""
        if self.fsdp is None:
            return super().optimizer_states(states, optimizers, module, resharded=resharded, tp_rank=tp_rank, by_name=by_name)
        if not resharded:
            return states

        def localize(name: str, t: Tensor) -> Tensor:
            spec = shard_spec(module, name)
            return spec.slice(t, tp_rank) if spec is not None else t

        return [self.fsdp.optimizer_state_from_named(s, o, self.prefix, localize) for s, o in zip(states, optimizers)]


def data_parallel_runtime(
    *,
    zero1: bool = False,
    fsdp: bool | dict[str, Any] = False,
    find_unused_parameters: bool = False,
    overlap_grad_reduce: bool = True,
    bucket_cap_mb: float | None = None,
) -> DataParallelRuntime:
    """The runtime for a strategy's options: ``fsdp`` (True or :func:`~nxdt.parallel.fsdp.apply_fsdp` options),
    ``zero1``, else plain replication; ``find_unused_parameters`` as DDP's (see :class:`ReplicatedRuntime`);
    ``overlap_grad_reduce`` / ``bucket_cap_mb``: the replicated and ZeRO-1 reductions in DDP's buckets during the last
    backward (:mod:`nxdt.parallel.overlap`; FSDP overlaps its own reduce-scatters)."""
    if fsdp and zero1:
        raise ValueError("NxDStrategy(fsdp=..., zero1=True): FSDP shards the optimizer state already; choose one")
    if fsdp:
        return FSDPRuntime(fsdp if isinstance(fsdp, dict) else {}, find_unused_parameters)
    return (Zero1Runtime if zero1 else ReplicatedRuntime)(
        find_unused_parameters, overlap_grad_reduce=overlap_grad_reduce, bucket_cap_mb=bucket_cap_mb
    )
