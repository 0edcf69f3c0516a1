"""Pipeline parallelism: stages cut from a model's layer list, schedules as generators of typed tasks,
and one executor that runs any schedule over ``nxdt.comm`` send/recv.

Three pieces, each usable on its own:

* **stages** — :func:`split_layers` assigns layer indices to *model chunks*; with ``virtual`` chunks
  per stage (interleaving), global chunk ``g`` lives on stage ``g % num_stages`` as its local chunk
  ``g // num_stages``. :func:`build_chunks` turns a full model into this stage's
  :class:`PipelineChunk` modules (embedding on the first global chunk, final norm + head on the last)
  and drops every layer the stage does not own.
* **schedules** — :func:`gpipe`, :func:`one_f_one_b` and :func:`interleaved_one_f_one_b` yield, for one
  stage, the :class:`Forward` / :class:`Backward` compute tasks interleaved with the
  ``Recv*``/``Send*`` tasks that move activations and gradients, in execution order. They are pure, so
  :func:`simulate` can run every stage's task stream together and prove that neighbours agree on
  the order of messages and that nothing deadlocks.
* **executor** — :class:`PipelineExecutor` dispatches each task type to a method. Sends are
  asynchronous (each directed pair and message kind has its own comm stream, so a send never waits
  behind a receive); receives block just before the compute that needs them.

Worked example (2 stages, 4 layers, 2 chunks per stage, 4 micro-batches; on every rank)::

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)                       # same seed → same weights on every rank
    chunks = build_chunks(model, pp.rank, pp.size, virtual=2)
    # stage 0 owns layers [0] and [2] (+ embedding), stage 1 owns [1] and [3] (+ norm, lm_head)
    ex = PipelineExecutor(chunks, pp, LlamaForCausalLM.loss_fn)
    loss = ex.run(interleaved_one_f_one_b(pp.size, pp.rank, 4, 2), [(ids, labels), ...])
    # parameter .grad now equals the single-process gradient of the mean loss; loss is on every stage

``list(one_f_one_b(2, 0, 3))`` is, for stage 0 of 2 with 3 micro-batches::

    F0 sendA0 | F1 sendA1 recvG0 B0 | F2 sendA2 recvG1 B1 | recvG2 B2        (warm-up | steady | cool-down)

A mixture-of-experts model's load-balancing loss (``model.load_balancing()``, duck-typed: ``models/mixtral.py``) runs
over the router logits of every layer, so it is not a sum of per-stage terms until every stage's expert counts are
known. Each chunk's router statistics (counts, probability sums, rows) travel forward with its activation (stream
kind ``moe``); the last chunk stages the whole term, which the model's ``loss_fn`` adds as it does unsharded; the
totals travel back with the gradient (``moe_grad``; zero counts when the objective left the term out) and every
earlier chunk backpropagates its own share, scaled as the loss is (token share, ``loss_weight``, 1/m). Loss and
gradients equal the single-process model's. An objective whose term counts real tokens only (TRL's DPO and ORPO:
``LoadBalancing.padding_masked``, set by the strategy from the objective) has every chunk's statistics taken over the
rows its layers marked real (the model's ``run_layer`` tells each MoE block); scoring (validation) stages the term
for the objective's score function as training does.

Tied word embeddings across stages are not supported: :func:`build_chunks` raises
"tie_word_embeddings with PP>1 is not supported" (with one stage the tied weight is one Parameter).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from nxdt.models.attention import SequenceLayout  # the hub's layout type (models sit on parallel's layer)
from nxdt.parallel.context_parallel import weight_by_token_share

__all__ = [
    "split_layers",
    "PipelineChunk",
    "build_chunks",
    "chunk_parameters",
    "TaskType",
    "Task",
    "Forward",
    "Backward",
    "SendActivation",
    "RecvActivation",
    "SendGrad",
    "RecvGrad",
    "gpipe",
    "one_f_one_b",
    "interleaved_one_f_one_b",
    "simulate",
    "SimulationResult",
    "PipelineDeadlock",
    "PipelineExecutor",
]


# ---------------------------------------------------------------------------------------------- stages
def split_layers(num_layers: int, num_stages: int, virtual: int = 1, cuts: Sequence[int] | None = None) -> list[list[int]]:
    """Layer indices of each global model chunk (``num_stages * virtual`` chunks, in model order).

    Even split by default (earlier chunks take one extra layer when it does not divide), or explicit
    ``cuts``: the first layer index of every chunk after the first, e.g. ``split_layers(6, 2, cuts=[4])``
    → ``[[0, 1, 2, 3], [4, 5]]``."""
    for name, value in (("num_layers", num_layers), ("num_stages", num_stages), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline: {name}={value!r} must be a positive integer")
    num_chunks = num_stages * virtual
    if num_chunks > num_layers:
        what = f"{num_stages} stages" + (f" × {virtual} virtual chunks" if virtual > 1 else "")
        raise ValueError(
            f"pipeline: {what} = {num_chunks} model chunks but the model has only {num_layers} layers; "
            f"every chunk needs at least one layer (use at most {num_layers} chunks)"
        )
    if cuts is None:
        base, extra = divmod(num_layers, num_chunks)
        sizes = [base + (1 if c < extra else 0) for c in range(num_chunks)]
        bounds = [sum(sizes[:c]) for c in range(num_chunks + 1)]
    else:
        cuts = list(cuts)
        if len(cuts) != num_chunks - 1:
            raise ValueError(
                f"pipeline: cuts={cuts} must give the first layer of each chunk after the first: "
                f"{num_chunks - 1} values for {num_chunks} chunks, got {len(cuts)}"
            )
        bounds = [0, *cuts, num_layers]
        for a, b in zip(bounds, bounds[1:]):
            if not isinstance(b, int) or b <= a:
                raise ValueError(
                    f"pipeline: cuts={cuts} must be strictly increasing integers in 1..{num_layers - 1} "
                    f"so every chunk of the {num_layers} layers is non-empty"
                )
    return [list(range(bounds[c], bounds[c + 1])) for c in range(num_chunks)]


def embedding_names(model: nn.Module) -> list[str]:
    """The attribute names of the modules the model's ``embed`` runs (``embedding_modules()``; else ``embed_tokens``)."""
    wanted = {id(m) for m in (model.embedding_modules() if hasattr(model, "embedding_modules") else [model.embed_tokens])}
    return [name for name, child in model.named_children() if id(child) in wanted]


class PipelineChunk(nn.Module):
    """One model chunk: a contiguous slice of ``model.layers`` (+ embedding if first, + norm/head if last).

    Parameters keep the full model's names (``layers.2.mlp.up_proj.weight``, ``embed_tokens.weight``)
    so they map to checkpoints and to the single-process model. The forward runs the model's public
    pieces ``embed`` → ``run_layer`` → ``head``; the model itself is held unregistered (it is shared by
    the stage's chunks and only supplies those methods and the rotary tables)."""

    def __init__(self, model: nn.Module, layer_indices: Sequence[int], *, is_first: bool, is_last: bool, index: int = 0) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: its other parts belong to other chunks
        self.layer_indices = list(layer_indices)
        self.is_first, self.is_last, self.index = is_first, is_last, index
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_indices})
        if is_first:  # every table ``embed`` reads (GPT's learned positions too), under the model's own names
            for name in embedding_names(model):
                setattr(self, name, getattr(model, name))
        if is_last:
            self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, x: torch.Tensor, layout: Any = None) -> torch.Tensor:
        """Token ids [B, S] (first chunk) or hidden states [B, S, H] → hidden states, or logits (last chunk);
        ``layout``: the micro-batch's positions and segments (the model's ``SequenceLayout``), on every stage."""
        if self.is_first:
            x = self.model.embed(x, layout)
        for i in self.layer_indices:
            x = self.model.run_layer(self.layers[str(i)], x, layout)
        return self.model.head(x) if self.is_last else x

    def extra_repr(self) -> str:
        return f"index={self.index}, layers={self.layer_indices}, first={self.is_first}, last={self.is_last}"


def build_chunks(
    model: nn.Module, stage: int, num_stages: int, virtual: int = 1, cuts: Sequence[int] | None = None
) -> list[PipelineChunk]:
    """This stage's chunks (local chunk ``v`` = global chunk ``v * num_stages + stage``) from a full model.

    Build the model with the same seed on every rank so weights match the single-process model; the
    layers (and embedding / head) this stage does not own are dropped from ``model`` to free memory,
    so afterwards ``model`` is only a shell for the returned chunks (its own ``forward`` no longer works
    when ``num_stages > 1``)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"pipeline: stage={stage} must be in 0..{num_stages - 1}")
    if num_stages > 1 and getattr(model, "tied", False):
        raise ValueError(
            "pipeline: tie_word_embeddings with PP>1 is not supported "
            "(the embedding and lm_head live on different stages); set model.tie_word_embeddings=false"
        )
    groups = split_layers(len(model.layers), num_stages, virtual, cuts)
    total = len(groups)
    mine = list(range(stage, total, num_stages))
    chunks = [PipelineChunk(model, groups[g], is_first=g == 0, is_last=g == total - 1, index=v) for v, g in enumerate(mine)]
    owned = {i for g in mine for i in groups[g]}
    for i in range(len(model.layers)):
        if i not in owned:
            model.layers[i] = nn.Module()  # an empty placeholder keeps the other layers' indices (and names)
    if not any(c.is_first for c in chunks):
        for name in embedding_names(model):
            setattr(model, name, None)
    if not any(c.is_last for c in chunks):
        model.norm = model.lm_head = None
    return chunks


def chunk_parameters(chunks: Iterable[nn.Module]) -> dict[str, nn.Parameter]:
    """Name → parameter over a stage's chunks (full-model names; a Parameter shared by two chunks once)."""
    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[name] = p
    return out


# ---------------------------------------------------------------------------------------------- tasks
class TaskType(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    SEND_ACTIVATION = "send_activation"
    RECV_ACTIVATION = "recv_activation"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"


@dataclass(frozen=True)
class Task:
    """``microbatch`` index and *local* ``chunk`` index on the executing stage."""

    microbatch: int
    chunk: int
    type: ClassVar[TaskType]  # set by each concrete subclass (a class attribute, not a field)


@dataclass(frozen=True)
class Forward(Task):
    type = TaskType.FORWARD


@dataclass(frozen=True)
class Backward(Task):
    type = TaskType.BACKWARD


@dataclass(frozen=True)
class _Comm(Task):
    peer_stage: int


@dataclass(frozen=True)
class SendActivation(_Comm):
    """Send the output of Forward(microbatch, chunk) to the stage holding the next global chunk."""

    type = TaskType.SEND_ACTIVATION


@dataclass(frozen=True)
class RecvActivation(_Comm):
    """Receive the input of Forward(microbatch, chunk) from the stage holding the previous global chunk."""

    type = TaskType.RECV_ACTIVATION


@dataclass(frozen=True)
class SendGrad(_Comm):
    """Send d loss / d input of Backward(microbatch, chunk) to the stage holding the previous chunk."""

    type = TaskType.SEND_GRAD


@dataclass(frozen=True)
class RecvGrad(_Comm):
    """Receive d loss / d output of Forward(microbatch, chunk) from the stage holding the next chunk."""

    type = TaskType.RECV_GRAD


def _with_communication(num_stages: int, stage: int, num_chunks: int, compute: Iterable[tuple[str, int, int]]) -> Iterator[Task]:
    """Wrap an ordered list of (F|B, microbatch, local chunk) with the receives just before and the
    (asynchronous) sends just after each compute task. Global chunk g = chunk · P + stage; its
    neighbours g ± 1 live on stages stage ± 1 (wrapping around between virtual chunks)."""
    last_global = num_stages * num_chunks - 1
    nxt, prev = (stage + 1) % num_stages, (stage - 1) % num_stages
    for kind, mb, v in compute:
        g = v * num_stages + stage
        if kind == "F":
            if g > 0:
                yield RecvActivation(mb, v, prev)
            yield Forward(mb, v)
            if g < last_global:
                yield SendActivation(mb, v, nxt)
        else:
            if g < last_global:
                yield RecvGrad(mb, v, nxt)
            yield Backward(mb, v)
            if g > 0:
                yield SendGrad(mb, v, prev)


def forward_only(num_stages: int, stage: int, num_microbatches: int, num_chunks: int = 1) -> Iterator[Task]:
    """Evaluation: every micro-batch's forward through every chunk, in micro-batch order, no backward. Each
    forward waits only on an earlier global chunk of the same micro-batch (sends are asynchronous): no cycle."""
    _check(num_stages, stage, num_microbatches, num_chunks)
    return _with_communication(
        num_stages, stage, num_chunks, (("F", mb, v) for mb in range(num_microbatches) for v in range(num_chunks))
    )


def _check(num_stages: int, stage: int, num_microbatches: int, num_chunks: int = 1) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches), ("num_chunks", num_chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline schedule: {name}={value!r} must be a positive integer")
    if not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"pipeline schedule: stage={stage!r} must be in 0..{num_stages - 1}")


def gpipe(num_stages: int, stage: int, num_microbatches: int, num_chunks: int = 1) -> Iterator[Task]:
    """All forwards, then all backwards (reverse order): the simple reference; keeps every
    micro-batch's activations alive at once."""
    _check(num_stages, stage, num_microbatches, num_chunks)
    fwd = [("F", mb, v) for v in range(num_chunks) for mb in range(num_microbatches)]
    bwd = [("B", mb, v) for v in reversed(range(num_chunks)) for mb in range(num_microbatches)]
    yield from _with_communication(num_stages, stage, num_chunks, fwd + bwd)


def one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> Iterator[Task]:
    """1F1B (PipeDream-flush): ``num_stages - stage - 1`` warm-up forwards, then alternate one forward
    and one backward, then drain the backwards. At most ``num_stages - stage`` micro-batches are in
    flight on a stage (GPipe: all of them)."""
    _check(num_stages, stage, num_microbatches)
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", mb, 0) for mb in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    order += [("B", mb, 0) for mb in range(num_microbatches - warmup, num_microbatches)]
    yield from _with_communication(num_stages, stage, 1, order)


def interleaved_one_f_one_b(num_stages: int, stage: int, num_microbatches: int, num_chunks: int) -> Iterator[Task]:
    """Megatron's interleaved 1F1B: each stage holds ``num_chunks`` model chunks; micro-batches advance in
    groups of ``num_stages`` through chunk 0, then chunk 1, ...; backwards mirror this from the last
    chunk. Shrinks the pipeline bubble by ``num_chunks`` for the same number of micro-batches.
    Requires ``num_microbatches % num_stages == 0``."""
    _check(num_stages, stage, num_microbatches, num_chunks)
    if num_microbatches % num_stages:
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches divisible by num_stages: got num_microbatches="
            f"{num_microbatches}, num_stages={num_stages} (use a multiple of {num_stages})"
        )
    group = num_stages * num_chunks  # virtual steps per round of num_stages micro-batches through all chunks
    total = num_microbatches * num_chunks

    def step(k: int, forward: bool) -> tuple[int, int]:
        v = (k % group) // num_stages
        return (k // group) * num_stages + k % num_stages, (v if forward else num_chunks - 1 - v)

    if num_microbatches == num_stages:  # nothing to overlap: warm-up runs all forwards (as Megatron does)
        warmup = total
    else:
        warmup = min((num_stages - stage - 1) * 2 + (num_chunks - 1) * num_stages, total)
    order = [("F", *step(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", *step(warmup + k, True)), ("B", *step(k, False))]
    order += [("B", *step(k, False)) for k in range(total - warmup, total)]
    yield from _with_communication(num_stages, stage, num_chunks, order)


# ---------------------------------------------------------------------------------------------- simulator
class PipelineDeadlock(RuntimeError):
    """Raised by :func:`simulate` when no stage can make progress, or a message arrives out of order."""


@dataclass
class SimulationResult:
    steps: int  # scheduler rounds until every stage finished
    peak_in_flight: list[int]  # per stage: max micro-batch·chunk activations held (forwards not yet backwarded)
    tasks: list[list[Task]]  # per stage: the task stream executed


def simulate(schedules: Sequence[Iterable[Task]], num_chunks: int = 1, send_capacity: int | None = None) -> SimulationResult:
    """Run every stage's task stream together with blocking receives, in process, without tensors.

    A message channel is (kind, src stage, dst stage), FIFO like an nxdt.comm stream. A receive blocks
    until its channel has a message and checks that message is the one it expects (same micro-batch,
    from the neighbouring global chunk): a mismatch means the executor would read the wrong tensor.
    ``send_capacity=None`` models the executor's asynchronous sends (never block); ``0`` is rendezvous
    (a send completes only when the receiver takes it); ``k`` allows k queued messages per channel.
    Also checks that compute respects data dependencies and counts activations in flight."""
    streams = [list(s) for s in schedules]
    num_stages = len(streams)
    pos = [0] * num_stages
    channels: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    pending_send: dict[int, bool] = {}  # rendezvous: stage whose send is posted and waiting to be taken
    in_flight, peak = [0] * num_stages, [0] * num_stages
    done_fwd: list[set] = [set() for _ in range(num_stages)]
    have_act: list[set] = [set() for _ in range(num_stages)]
    have_grad: list[set] = [set() for _ in range(num_stages)]
    last_global = num_stages * num_chunks - 1
    steps = 0
    while any(pos[s] < len(streams[s]) for s in range(num_stages)):
        steps += 1
        progressed = False
        for s in range(num_stages):
            while pos[s] < len(streams[s]):
                t = streams[s][pos[s]]
                g = t.chunk * num_stages + s
                if isinstance(t, (SendActivation, SendGrad)):
                    kind = "act" if isinstance(t, SendActivation) else "grad"
                    key = (kind, s, t.peer_stage)
                    queue = channels.setdefault(key, [])
                    if not pending_send.get(s):
                        queue.append((t.microbatch, g))
                        pending_send[s] = True
                    # the send completes once the channel holds at most `capacity` messages (taken ones left)
                    if send_capacity is not None and len(queue) > send_capacity:
                        break
                    pending_send[s] = False
                elif isinstance(t, (RecvActivation, RecvGrad)):
                    kind = "act" if isinstance(t, RecvActivation) else "grad"
                    arrived = channels.get((kind, t.peer_stage, s))
                    if not arrived:
                        break
                    mb, src_g = arrived.pop(0)
                    want = g - 1 if kind == "act" else g + 1
                    if (mb, src_g) != (t.microbatch, want) or src_g % num_stages != t.peer_stage:
                        raise PipelineDeadlock(
                            f"stage {s} {t} received {kind} of micro-batch {mb} from global chunk "
                            f"{src_g}; expected micro-batch {t.microbatch} from chunk {want}"
                        )
                    (have_act if kind == "act" else have_grad)[s].add((t.microbatch, t.chunk))
                elif isinstance(t, Forward):
                    if g > 0 and (t.microbatch, t.chunk) not in have_act[s]:
                        raise PipelineDeadlock(f"stage {s} runs {t} before receiving its input")
                    done_fwd[s].add((t.microbatch, t.chunk))
                    in_flight[s] += 1
                    peak[s] = max(peak[s], in_flight[s])
                elif isinstance(t, Backward):
                    if (t.microbatch, t.chunk) not in done_fwd[s]:
                        raise PipelineDeadlock(f"stage {s} runs {t} before its forward")
                    if g < last_global and (t.microbatch, t.chunk) not in have_grad[s]:
                        raise PipelineDeadlock(f"stage {s} runs {t} before receiving its output gradient")
                    in_flight[s] -= 1
                else:
                    raise TypeError(f"unknown task {t!r}")
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = {s: streams[s][pos[s]] for s in range(num_stages) if pos[s] < len(streams[s])}
            raise PipelineDeadlock(f"deadlock: every unfinished stage is blocked: {blocked}")
    leftover = {k: v for k, v in channels.items() if v}
    if leftover:
        raise PipelineDeadlock(f"messages sent but never received: {leftover}")
    return SimulationResult(steps, peak, streams)


# ---------------------------------------------------------------------------------------------- executor
def micro_batch_weight(mb: Any) -> torch.Tensor | None:
    """A micro-batch mapping's ``loss_weight`` (its loss is scaled by it), or None."""
    return mb.get("loss_weight") if isinstance(mb, Mapping) else None


def unpack_microbatch(mb: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(input_ids, labels, layout) of a micro-batch given as (ids, labels) or as a mapping with ``input_ids``,
    ``labels`` and optional ``position_ids`` / ``segment_ids`` (layout None when it has neither)."""
    if isinstance(mb, Mapping):
        positions, segments = mb.get("position_ids"), mb.get("segment_ids")
        return mb["input_ids"], mb["labels"], SequenceLayout.of(positions, segments)
    ids, labels = mb
    return ids, labels, None


class PipelineExecutor:
    """Runs one stage's task stream over all micro-batches of a global batch.

    ``chunks``: this stage's :class:`PipelineChunk` list (local index = task ``chunk``); ``pp_comm``: the
    pipeline communicator, group rank = stage; ``loss_fn(logits, labels) -> scalar``. Each directed
    (kind, src → dst) pair gets its own comm stream ``pp.<kind>.<src>to<dst>``: sends are issued
    asynchronously on it and receives block on it, so FIFO order per pair matches the schedule (what
    :func:`simulate` verifies) and a pending send never holds up a receive. ``batch_loss(logits, micro_batch)``, if
    given, replaces ``loss_fn`` for mapping micro-batches: an objective that reads more of the micro-batch than its
    labels (DPO's reference log-probabilities)."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        pp_comm: Any,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        hidden_size: int | None = None,
        dtype: torch.dtype | None = None,
        seq_shards: int = 1,
        batch_loss: Callable[[torch.Tensor, Mapping[str, Any]], torch.Tensor] | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.batch_loss = batch_loss
        self._score: Callable[[torch.Tensor, Any], torch.Tensor] | None = None  # set by score()
        self.seq_shards = seq_shards  # sequence parallelism: activations between stages hold S / TP positions
        self.comm = pp_comm
        self.loss_fn = loss_fn
        self.num_stages = pp_comm.size if pp_comm is not None else 1
        self.stage = pp_comm.rank if pp_comm is not None else 0
        first = next(iter(self.chunks[0].parameters()))
        self.dtype = dtype or first.dtype
        self.device = first.device
        if hidden_size is None:
            model = getattr(self.chunks[0], "model", None)
            hidden_size = getattr(getattr(model, "cfg", None), "hidden_size", None)
        if hidden_size is None:
            raise ValueError("PipelineExecutor: pass hidden_size= (activation shape is [micro_batch, seq, hidden])")
        self.hidden_size = hidden_size
        # a MoE model's load-balancing loss across stages (module docstring); None for a dense model
        make_balance = getattr(getattr(self.chunks[0], "model", None), "load_balancing", None)
        self.balance: Any = make_balance() if make_balance is not None else None  # models.mixtral.LoadBalancing
        self.dispatch: dict[TaskType, Callable[[Any], None]] = {
            TaskType.FORWARD: self._forward,
            TaskType.BACKWARD: self._backward,
            TaskType.SEND_ACTIVATION: self._send_activation,
            TaskType.RECV_ACTIVATION: self._recv_activation,
            TaskType.SEND_GRAD: self._send_grad,
            TaskType.RECV_GRAD: self._recv_grad,
        }

    # state of one run(): keyed by (microbatch, local chunk)
    def _reset(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.microbatches = list(microbatches)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activations (require grad)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # chunk outputs, or scaled losses on the last chunk
        self.out_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.in_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.pending: list[Any] = []  # async send handles
        self.loopback: dict[str, list[torch.Tensor]] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.losses: dict[int, torch.Tensor] = {}  # each micro-batch's unscaled loss (last chunk)
        self.scores: dict[int, torch.Tensor] = {}  # score(): each micro-batch's values (last chunk)
        # MoE: router statistics received with an activation / sent on with it / this chunk's probability sums (with
        # gradient) / the totals of all layers, from the last chunk, for the backward
        self.aux_in: dict[tuple[int, int], torch.Tensor] = {}
        self.aux_through: dict[tuple[int, int], torch.Tensor] = {}
        self.aux_sums: dict[tuple[int, int], torch.Tensor] = {}
        self.aux_totals: dict[tuple[int, int], torch.Tensor] = {}
        if self.balance is not None:  # nothing staged by a run that raised
            self.balance.stage(None)

    def _global(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage

    def _stream(self, kind: str, src: int, dst: int) -> str:
        return f"pp.{kind}.{src}to{dst}"

    def _shape(self, mb: int) -> tuple[int, ...]:
        b, s = unpack_microbatch(self.microbatches[mb])[0].shape[:2]
        return (b, s // self.seq_shards, self.hidden_size)

    def _scaled(self, loss: torch.Tensor, mb: int) -> torch.Tensor:
        """A micro-batch's loss term as the backward takes it: this rank's share of the sequence's token mean (context
        parallelism; unchanged without), times its ``loss_weight``, over the number of micro-batches."""
        loss = weight_by_token_share(loss, self.microbatches[mb])
        weight = micro_batch_weight(self.microbatches[mb])
        if weight is not None:  # the micro-batch's share of the global batch's labelled tokens
            loss = loss * weight.to(loss.dtype)
        return loss

    def run(
        self, schedule: Iterable[Task], microbatches: Sequence[Any], before_backward: Callable[[bool], None] | None = None
    ) -> float:
        """Execute ``schedule`` over ``microbatches`` (a list of (input_ids, labels), or of mappings with
        ``input_ids``, ``labels`` and optional ``position_ids`` / ``segment_ids``; the same on every stage: the
        first chunk reads the ids, every chunk the layout, the last the labels). Gradients accumulate into ``.grad``
        (zero them before); each micro-batch's loss is scaled by 1/len(microbatches), so they equal the
        single-process mean-loss gradients. Returns the mean loss, on every stage.

        ``before_backward(last)`` is told before each backward task whether it is the last to touch this stage's
        parameters (a data-parallel runtime may then reduce their gradients while it runs,
        :mod:`nxdt.parallel.overlap`): with one chunk per stage, the last micro-batch's; with virtual chunks never (the
        last micro-batch's backwards of the chunks interleave with earlier micro-batches' of other chunks)."""
        self._reset(microbatches)
        last_microbatch = len(self.microbatches) - 1 if len(self.chunks) == 1 else -1
        try:
            for task in schedule:
                if task.chunk >= len(self.chunks) or task.microbatch >= len(self.microbatches):
                    raise ValueError(
                        f"pipeline: {task} does not fit {len(self.chunks)} chunks × "
                        f"{len(self.microbatches)} micro-batches on stage {self.stage}"
                    )
                if before_backward is not None and task.type is TaskType.BACKWARD:
                    before_backward(task.microbatch == last_microbatch)
                self.dispatch[task.type](task)
            for work in self.pending:
                work.wait()
        finally:
            self.pending = []
        left = [k for k in self.outputs]
        if left:
            raise RuntimeError(f"pipeline: schedule ended with forwards never run backward: {sorted(left)}")
        owns_loss = any(getattr(c, "is_last", False) for c in self.chunks)
        loss = torch.tensor([float(self.loss_sum) / len(self.microbatches) if owns_loss else 0.0], dtype=torch.float64)
        if self.num_stages > 1:
            # the last global chunk always lives on the last stage
            self.comm.broadcast(loss, root=self.num_stages - 1, stream="pp")
        return float(loss)

    def evaluate(self, microbatches: Sequence[Any]) -> list[float]:
        """Forward only (no gradients, nothing kept for backward): each micro-batch's loss, on every stage."""
        self._forward_only(microbatches)
        losses = torch.tensor([float(self.losses.get(i, 0.0)) for i in range(len(self.microbatches))], dtype=torch.float64)
        if self.num_stages > 1:
            self.comm.broadcast(losses, root=self.num_stages - 1, stream="pp")
        return losses.tolist()

    def score(self, microbatches: Sequence[Any], fn: Callable[[torch.Tensor, Any], torch.Tensor], width: int) -> torch.Tensor:
        """Forward only: ``fn(logits, micro_batch)`` (a [width] tensor, e.g. per-row sequence log-probabilities) of every
        micro-batch, computed by the last stage; returns them as [len(microbatches), width] float64 on every stage."""
        self._score = fn
        try:
            self._forward_only(microbatches)
        finally:
            self._score = None
        out = torch.zeros(len(self.microbatches), width, dtype=torch.float64, device=self.device)  # where the scores are
        for i, values in self.scores.items():
            out[i] = values
        if self.num_stages > 1:
            self.comm.broadcast(out.reshape(-1), root=self.num_stages - 1, stream="pp")
        return out

    def _forward_only(self, microbatches: Sequence[Any]) -> None:
        self._reset(microbatches)
        try:
            with torch.no_grad():
                for task in forward_only(self.num_stages, self.stage, len(self.microbatches), len(self.chunks)):
                    self.dispatch[task.type](task)
                    if task.type is TaskType.SEND_ACTIVATION or (
                        task.type is TaskType.FORWARD and getattr(self.chunks[task.chunk], "is_last", False)
                    ):
                        self.outputs.pop((task.microbatch, task.chunk))  # sent on (or scored): not needed again
                        self.inputs.pop((task.microbatch, task.chunk), None)
                for work in self.pending:
                    work.wait()
        finally:
            self.pending, self.outputs, self.inputs = [], {}, {}

    # ---- compute
    def _forward(self, t: Forward) -> None:
        key = (t.microbatch, t.chunk)
        chunk = self.chunks[t.chunk]
        ids, labels, layout = unpack_microbatch(self.microbatches[t.microbatch])
        x = ids if self._global(t.chunk) == 0 else self.inputs[key]
        out = chunk(x, layout)
        aux = self._router_statistics(key, chunk)
        last = getattr(chunk, "is_last", False)
        if last and aux is not None:  # the whole load-balancing term: this chunk's sums with gradient, earlier ones as numbers
            totals, received, sums = aux
            e = self.balance.num_experts
            parts = [
                self.balance.loss(p, totals) for p in (None if received is None else received[e : 2 * e], sums) if p is not None
            ]
            self.balance.stage(torch.stack(parts).sum())
        if last and self._score is not None:  # scoring (validation's) may take the term as the training loss does
            self.scores[t.microbatch] = self._score(out, self.microbatches[t.microbatch]).detach().double().reshape(-1)
            if aux is not None:
                self.balance.stage(None)
        elif last:
            mb = self.microbatches[t.microbatch]
            loss = (
                self.batch_loss(out, mb) if self.batch_loss is not None and isinstance(mb, Mapping) else self.loss_fn(out, labels)
            )
            if aux is not None:  # the earlier chunks' shares count only where the objective took the term
                if not self.balance.taken:
                    totals = torch.cat([torch.zeros_like(totals[:e]), totals[e:]])
                self.balance.stage(None)
                self.aux_totals[key] = totals
            self.losses[t.microbatch] = loss.detach().double()
            loss = self._scaled(loss, t.microbatch)
            self.loss_sum += loss.detach().double()
            out = loss / len(self.microbatches)
        elif aux is not None:
            self.aux_through[key] = aux[0]
        self.outputs[key] = out

    def _router_statistics(
        self, key: tuple[int, int], chunk: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """A MoE model's router statistics through this chunk (received plus its own), the received ones, and this
        chunk's probability sums (with gradient; kept for the backward of a chunk before the last); None for a dense
        model."""
        if self.balance is None:
            return None
        received = self.aux_in.pop(key, None)
        taken = self.balance.take(chunk.layers.values())
        if taken is None:  # no MoE layer in this chunk: pass the statistics on
            through = (
                received if received is not None else torch.zeros(self.balance.width, dtype=torch.float64, device=self.device)
            )
            return through, received, None
        mine, sums = taken
        if torch.is_grad_enabled() and not getattr(chunk, "is_last", False):
            self.aux_sums[key] = sums
        return (mine if received is None else received + mine), received, sums

    def _backward(self, t: Backward) -> None:
        key = (t.microbatch, t.chunk)
        out = self.outputs.pop(key)
        if out.dim() == 0:  # the scaled loss of the last chunk
            out.backward()
        else:
            outputs, grads = [out], [self.out_grads.pop(key)]
            sums = self.aux_sums.pop(key, None)
            if sums is not None:  # this chunk's share of the load-balancing loss, with the totals from the last chunk
                share = self.balance.coef * self.balance.loss(sums, self.aux_totals[key])
                outputs.append(self._scaled(share, t.microbatch) / len(self.microbatches))
                grads.append(None)
            torch.autograd.backward(outputs, grads)
        inp = self.inputs.pop(key, None)
        if inp is not None:
            self.in_grads[key] = inp.grad

    # ---- communication
    def _send(self, kind: str, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.detach().contiguous()  # the handle's closure keeps it alive until sent
        if peer == self.stage:  # one stage holding consecutive chunks (PP=1 with virtual chunks): hand over locally
            self.loopback.setdefault(kind, []).append(tensor)
            return
        work = self.comm.send(tensor, peer, stream=self._stream(kind, self.stage, peer), async_op=True)
        self.pending.append(work)

    def _recv(self, kind: str, mb: int, peer: int) -> torch.Tensor:
        if peer == self.stage:
            return self.loopback[kind].pop(0).clone()
        if kind.startswith("moe"):  # router statistics: float64, one vector
            buf = torch.empty(self.balance.width, dtype=torch.float64, device=self.device)
        else:
            buf = torch.empty(self._shape(mb), dtype=self.dtype, device=self.device)
        self.comm.recv(buf, peer, stream=self._stream(kind, peer, self.stage))
        return buf

    def _send_activation(self, t: SendActivation) -> None:
        key = (t.microbatch, t.chunk)
        self._send("act", self.outputs[key], t.peer_stage)
        if self.balance is not None:  # the router statistics of every layer so far
            self._send("moe", self.aux_through.pop(key), t.peer_stage)

    def _recv_activation(self, t: RecvActivation) -> None:
        key = (t.microbatch, t.chunk)
        self.inputs[key] = self._recv("act", t.microbatch, t.peer_stage).requires_grad_(True)
        if self.balance is not None:
            self.aux_in[key] = self._recv("moe", t.microbatch, t.peer_stage)

    def _send_grad(self, t: SendGrad) -> None:
        key = (t.microbatch, t.chunk)
        self._send("grad", self.in_grads.pop(key), t.peer_stage)
        if self.balance is not None:
            self._send("moe_grad", self.aux_totals.pop(key), t.peer_stage)

    def _recv_grad(self, t: RecvGrad) -> None:
        key = (t.microbatch, t.chunk)
        self.out_grads[key] = self._recv("grad", t.microbatch, t.peer_stage)
        if self.balance is not None:
            self.aux_totals[key] = self._recv("moe_grad", t.microbatch, t.peer_stage)
