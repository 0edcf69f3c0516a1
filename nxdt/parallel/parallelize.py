"""Apply a plan's model parallelism to one rank's hub model, in the order the pieces compose: layers over TP,
core attention as a ring over CP, experts over EP, then this rank's pipeline stage cut; and the
:class:`~nxdt.parallel.data_parallel.ModelParallel` view the data-parallel runtime composes with.

What the strategy needs afterwards (the pipeline executor, how each TP-sharded parameter enters a global norm,
the TP layout and partial-sum gradients recorded before FSDP could flatten them) is returned as one
:class:`Parallelized` record instead of being left on the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from torch import nn

from nxdt.comm import Communicator
from nxdt.parallel.context_parallel import apply_context_parallel
from nxdt.parallel.data_parallel import ModelParallel
from nxdt.parallel.expert_parallel import apply_expert_parallel
from nxdt.parallel.pipeline import PipelineExecutor, build_chunks
from nxdt.parallel.tensor_parallel import apply_tensor_parallel, norm_weights, partial_grad_names, shard_layout
from nxdt.planner import Dim, Plan


@dataclass
class Parallelized:
    """What applying the plan left for the strategy (all empty when every model-parallel degree is 1)."""

    pipeline: PipelineExecutor | None = None  # PP > 1: runs this rank's stage
    norm_weights: dict[str, float] = field(default_factory=dict)  # TP: how each parameter's gradient enters the global norm
    tp_layout: dict[str, list[int]] | None = None  # TP: the sharded parameters, recorded before FSDP flattens them
    tp_partial_grads: set[str] | None = None  # TP: parameters whose gradients are partial sums over TP


def needs_hub_model(plan: Plan) -> bool:
    """Any model-parallel degree > 1 (then the module's ``model`` must be a hub model)."""
    return max(plan.tp, plan.pp, plan.ep, plan.cp) > 1


def parallelize(
    model: nn.Module, plan: Plan, comms: Mapping[str, Communicator], *, sequence_parallel: bool = False, virtual_pipeline: int = 1
) -> Parallelized:
    """Shard the hub ``model`` in place for this rank (``comms``: its communicator per dimension) and return what the
    strategy keeps of it."""
    if not hasattr(model, "run_layer"):
        raise ValueError(
            "NxDStrategy: tensor/pipeline/expert/context parallelism needs a LightningModule whose `model` is a "
            "model-hub model (embed / run_layer / head), e.g. nxdt.lightning.CausalLMModule"
        )
    out = Parallelized()
    if plan.tp > 1:
        apply_tensor_parallel(model, comms[Dim.TP], sequence_parallel=sequence_parallel)
        out.norm_weights = norm_weights(model, plan.tp)
    if plan.cp > 1:  # each layer's core attention becomes ring attention over the CP group (weights untouched)
        apply_context_parallel(model, comms[Dim.CP])
    if plan.ep > 1:  # after TP: it flags the (TP-sharded) expert parameters it keeps
        apply_expert_parallel(model, comms[Dim.EP])
    if plan.pp > 1:
        pp = comms[Dim.PP]
        chunks = build_chunks(model, pp.rank, plan.pp, virtual=virtual_pipeline)
        out.pipeline = PipelineExecutor(chunks, pp, model.loss_fn, seq_shards=plan.tp if sequence_parallel else 1)
    if plan.tp > 1:  # this stage's TP-sharded parameters, recorded before FSDP could flatten them
        out.tp_layout = shard_layout(model)
        out.tp_partial_grads = partial_grad_names(model)
    return out


def model_parallel(
    plan: Plan, comms: Mapping[str, Communicator], parallelized: Parallelized, *, sequence_parallel: bool = False
) -> ModelParallel:
    """This rank's groups as the data-parallel runtime composes with them (TP/PP/EP only where the degree > 1).
    Under context parallelism the replicas of the weights are DP × CP: gradients are averaged, and ZeRO-1/FSDP
    shard, over that group (CP ranks hold the same weights, as DP ranks do)."""
    split = {dim.value: comms[dim] if plan.degree(dim) > 1 else None for dim in (Dim.TP, Dim.PP, Dim.EP)}
    replicas = comms[Dim.DP_CP] if plan.cp > 1 else comms[Dim.DP]
    return ModelParallel(
        dp=replicas,
        dp_size=plan.dp_cp,
        edp=comms.get(Dim.EDP),
        **split,
        sequence_parallel=sequence_parallel,
        norm_weights=parallelized.norm_weights,
        tp_layout=parallelized.tp_layout,
        tp_partial_grads=parallelized.tp_partial_grads,
    )
