"""Apply a plan's model parallelism to one rank's hub model, in the order the pieces compose: layers over TP,
core attention as a ring over CP, experts over EP, then this rank's pipeline stage cut; and the
:class:`~nxdt.parallel.data_parallel.ModelParallel` view the data-parallel runtime composes with.

What the strategy needs afterwards (the pipeline executor, how each TP-sharded parameter enters a global norm,
the TP layout and partial-sum gradients recorded before FSDP could flatten them) is returned as one
:class:`Parallelized` record instead of being left on the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import Tensor, nn

from nxdt.comm import Communicator
from nxdt.parallel.context_parallel import apply_context_parallel
from nxdt.parallel.data_parallel import ModelParallel
from nxdt.parallel.expert_parallel import apply_expert_parallel
from nxdt.parallel.pipeline import PipelineExecutor, build_chunks
from nxdt.parallel.tensor_parallel import apply_tensor_parallel, norm_weights, partial_grad_names, shard_layout

# ``comms`` below: this rank's communicator of every planned group, keyed by dimension name (the planner's ``Dim``
# values); each degree is its group's size, so this layer needs the communicators only, not the plan.


def degree(comms: Mapping[str, Communicator], dim: str) -> int:
    """The size of this rank's group along ``dim`` (1 where the plan has no such group)."""
    comm = comms.get(dim)
    return comm.size if comm is not None else 1


@dataclass
class Parallelized:
    """What applying the plan left for the strategy (all empty when every model-parallel degree is 1)."""

    pipeline: PipelineExecutor | None = None  # PP > 1: runs this rank's stage
    norm_weights: dict[str, float] = field(default_factory=dict)  # TP: how each parameter's gradient enters the global norm
    tp_layout: dict[str, list[int]] | None = None  # TP: the sharded parameters, recorded before FSDP flattens them
    tp_partial_grads: set[str] | None = None  # TP: parameters whose gradients are partial sums over TP


def needs_hub_model(comms: Mapping[str, Communicator]) -> bool:
    """Any model-parallel degree > 1 (then the module's ``model`` must be a hub model)."""
    return max(degree(comms, dim) for dim in ("tp", "pp", "ep", "cp")) > 1


def parallelize(
    model: nn.Module,
    comms: Mapping[str, Communicator],
    *,
    sequence_parallel: bool = False,
    virtual_pipeline: int = 1,
    batch_loss: Callable[[Tensor, Mapping[str, Any]], Tensor] | None = None,
    tensor_parallel_plan: dict[str, str] | None = None,
    expert_blocks: str | None = None,
) -> Parallelized:
    """Shard the hub ``model`` in place for this rank (``comms``: its communicator per dimension) and return what the
    strategy keeps of it. ``batch_loss(logits, micro_batch)``: the last pipeline stage's loss when the objective reads
    more than the labels (DPO's pairs and reference log-probabilities); default the model's ``loss_fn``.
    ``tensor_parallel_plan``: the TP/SP plan (a model family's, from its spec); default the model's own declaration;
    ``expert_blocks``: the pattern of the MoE blocks EP slices (the spec's); default every module shaped as one."""
    if not hasattr(model, "run_layer"):
        raise ValueError(
            "NxDStrategy: tensor/pipeline/expert/context parallelism needs a LightningModule whose `model` is a "
            "model-hub model (embed / run_layer / head), e.g. nxdt.lightning.CausalLMModule"
        )
    out = Parallelized()
    tp, cp, ep, pp = (degree(comms, dim) for dim in ("tp", "cp", "ep", "pp"))
    if tp > 1:
        apply_tensor_parallel(model, comms["tp"], sequence_parallel=sequence_parallel, plan=tensor_parallel_plan)
        out.norm_weights = norm_weights(model, tp)
    if cp > 1:  # each layer's core attention becomes ring attention over the CP group (weights untouched)
        apply_context_parallel(model, comms["cp"])
    if ep > 1:  # after TP: it flags the (TP-sharded) expert parameters it keeps
        apply_expert_parallel(model, comms["ep"], blocks=expert_blocks)
    if pp > 1:
        chunks = build_chunks(model, comms["pp"].rank, pp, virtual=virtual_pipeline)
        out.pipeline = PipelineExecutor(
            chunks, comms["pp"], model.loss_fn, seq_shards=tp if sequence_parallel else 1, batch_loss=batch_loss
        )
    if tp > 1:  # this stage's TP-sharded parameters, recorded before FSDP could flatten them
        out.tp_layout = shard_layout(model)
        out.tp_partial_grads = partial_grad_names(model)
    return out


def model_parallel(
    comms: Mapping[str, Communicator], parallelized: Parallelized, *, sequence_parallel: bool = False
) -> ModelParallel:
    """This rank's groups as the data-parallel runtime composes with them (TP/PP/EP only where the degree > 1).
    Under context parallelism the replicas of the weights are DP × CP: gradients are averaged, and ZeRO-1/FSDP
    shard, over that group (CP ranks hold the same weights, as DP ranks do); an expert's replicas likewise EDP × CP."""
    split = {dim: comms[dim] if degree(comms, dim) > 1 else None for dim in ("tp", "pp", "ep")}
    replicas = comms["dp_cp"] if degree(comms, "cp") > 1 else comms["dp"]
    return ModelParallel(
        dp=replicas,
        dp_size=replicas.size,
        edp=comms.get("edp_cp", comms.get("edp")),  # the replicas of this rank's experts: over CP too
        **split,
        sequence_parallel=sequence_parallel,
        norm_weights=parallelized.norm_weights,
        tp_layout=parallelized.tp_layout,
        tp_partial_grads=parallelized.tp_partial_grads,
    )
