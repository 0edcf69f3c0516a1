"""``NxDStrategy``: a Lightning ``ParallelStrategy`` whose every collective is an nxdt collective.

It builds (or receives) the Plan, creates one nxdt communicator per planned group, applies tensor,
expert and pipeline parallelism, keeps the data-parallel replicas in step through one data-parallel
runtime (replicated, ZeRO-1 or FSDP: :mod:`nxdt.parallel.data_parallel`; gradients finished once per
optimizer step), answers Lightning's ``reduce / barrier / broadcast / all_gather`` and writes atomic
directory checkpoints.

Launch modes, all without forking Lightning:

* under ``nxdt train`` or ``torchrun`` the processes exist already (the elastic agent hosts the
  rendezvous store, ``TORCHELASTIC_USE_AGENT_STORE=True``);
* from a plain ``python script.py`` Lightning's subprocess-script launcher re-runs the script once
  per extra rank, and rank 0 hosts the store.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

import nxdt.comm
from nxdt.lightning import checkpoint as ckpt_io, reshard
from nxdt.lightning.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_adapter_config, peft_adapter_state
from nxdt.lightning.precision import with_strategy_clipping
from nxdt.parallel.context_parallel import apply_context_parallel, shard_micro_batches
from nxdt.parallel.data_parallel import FSDP_SHARD_MARK, DataParallelRuntime, ModelParallel, data_parallel_runtime
from nxdt.parallel.expert_parallel import apply_expert_parallel
from nxdt.parallel.pipeline import PipelineExecutor, build_chunks, interleaved_one_f_one_b, one_f_one_b
from nxdt.parallel.tensor_parallel import apply_tensor_parallel, gather_shards, norm_weights, partial_grad_names, shard_layout
from nxdt.planner import DIMENSIONS, Dim, Plan, plan_layout

log = logging.getLogger(__name__)

# Lightning passes reduce ops as strings or torch ReduceOp members; nxdt.comm takes plain names.
# a checkpoint whose model file holds the trainable tensors only (LoRA with save_lora_base false): the frozen base
# weights come from the model as built when it is resumed
ADAPTERS_ONLY_KEY = "nxdt_adapters_only"

_REDUCE_OP_NAMES = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min", "prod": "prod", "product": "prod"}


def _op_name(reduce_op: Any) -> str:
    if reduce_op is None:
        return "avg"
    name = str(getattr(reduce_op, "name", reduce_op)).split(".")[-1].lower()
    try:
        return _REDUCE_OP_NAMES[name]
    except KeyError:
        raise ValueError(f"reduce_op {reduce_op!r} is not supported by nxdt; use one of {sorted(_REDUCE_OP_NAMES)}") from None


class NxDStrategy(ParallelStrategy):
    """Data/tensor/pipeline-parallel training over nxdt's own collectives.

    Args:
        tensor_parallel_size, pipeline_parallel_size, context_parallel_size, expert_parallel_size:
            parallel degrees; the data-parallel degree is implied (world / (TP·PP·CP)), as in NxDT.
        plan: a ready Plan (``nxdt train`` passes the one it wrote to ``plan.json``); when given, the
            degrees above are taken from it.
        timeout_s: deadline of every collective wait; a rank that does not arrive is named in the error.
        placement_order: rank order of the dimensions, fastest first.
        emulated_links: ``{dim: (latency_s, bytes_per_s)}`` — every communicator of that dimension emulates
            the link (``comm.emulate``; ``nxdt.planner.links.emulated_links_for(cfg)`` computes it).
        fsdp: shard parameters, gradients and optimizer state over data parallelism (``True``, or a dict of
            :func:`nxdt.parallel.fsdp.apply_fsdp` options: ``prefetch`` none | eager | token_threaded,
            ``prefetch_distance``, ``reduce_scatter_delay``, ``reshard_after_forward``, ``param_dtype``,
            ``param_persistence_threshold``).
        trace_dir: write a Chrome trace per rank there (``rank<k>.json``: compute per FSDP unit, every
            collective with its stream and token); opens in Perfetto.
        async_checkpointing: write checkpoints in a background thread (a snapshot; training continues).
        peft_adapter_in_checkpoints: LoRA — every checkpoint is also a Hugging Face PEFT adapter directory
            (adapter_config.json + adapter_model.safetensors, gathered over TP/FSDP, covered by its checksums).
        comm_transport, comm_algorithm: ``comm.transport`` / ``comm.algorithm`` for every group's communicator
            (:meth:`nxdt.comm.World.new_communicator`); with ``comm_algorithm="auto"`` the plan's algorithms apply.
    """

    strategy_name = "nxdt"

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        *,
        plan: Plan | None = None,
        timeout_s: float = 120.0,
        placement_order: str = "tp-cp-ep-dp-pp",
        checkpoint_meta: dict[str, Any] | None = None,
        virtual_pipeline_size: int = 1,
        sequence_parallel: bool = False,
        zero1: bool = False,
        emulated_links: dict[str, tuple[float, float]] | None = None,
        fsdp: bool | dict[str, Any] = False,
        trace_dir: str | os.PathLike | None = None,
        async_checkpointing: bool = False,
        peft_adapter_in_checkpoints: bool = False,
        comm_transport: str = "auto",
        comm_algorithm: str = "auto",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        for key, value in (("tensor_parallel_size", tensor_parallel_size), ("pipeline_parallel_size", pipeline_parallel_size),
                           ("context_parallel_size", context_parallel_size), ("expert_parallel_size", expert_parallel_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"NxDStrategy({key}={value!r}): must be an integer >= 1")
        self._degrees = {Dim.TP: tensor_parallel_size, Dim.PP: pipeline_parallel_size, Dim.CP: context_parallel_size,
                         Dim.EP: expert_parallel_size}
        self._plan = plan
        self._timeout_s = float(timeout_s)
        self._placement_order = placement_order
        self._virtual = virtual_pipeline_size
        self._sequence_parallel = sequence_parallel
        self._comm_choice = {"transport": comm_transport, "algorithm": comm_algorithm}
        self._emulated_links = {dim: nxdt.comm.EmulatedLink(*figures) for dim, figures in (emulated_links or {}).items()}
        # replicated, ZeRO-1 or FSDP: chosen once here, bound to the groups in setup(), then used without asking
        self._dp: DataParallelRuntime = data_parallel_runtime(zero1=zero1, fsdp=fsdp)
        self._trace_dir = trace_dir
        self._tracer: nxdt.comm.Tracer | None = None
        self._tp_layout: dict[str, list[int]] | None = None  # recorded before FSDP flattens the TP shards
        self._tp_partial_grads: set[str] | None = None  # likewise: gradients that are partial sums over TP
        self._trainable_names: set[str] = set()  # state-dict names of the trainable parameters, recorded before FSDP
        self._norm_weights: dict[str, float] = {}  # TP: how each parameter's gradient enters the global norm
        self._pipeline: PipelineExecutor | None = None  # set in setup() when PP > 1
        self._parallelized: torch.nn.Module | None = None  # the hub model _parallelize sharded (once)
        self._num_nodes = 1
        self.world: nxdt.comm.World | None = None
        self.communicators: dict[str, nxdt.comm.Communicator] = {}
        self._gradients_finished = True  # until a backward produces new local gradients
        # stored in every checkpoint's meta.json (e.g. the model shape, checked again on load)
        self.checkpoint_meta = dict(checkpoint_meta or {})
        # called with the temporary directory after a checkpoint's files are written, before it is
        # committed (fault drills kill the process here to prove an interrupted save is harmless)
        self.before_checkpoint_commit: Callable[[Any], None] | None = None
        self._async_checkpointing = async_checkpointing
        self._peft_adapter_in_checkpoints = peft_adapter_in_checkpoints
        self._async_writer: ckpt_io.AsyncWriter | None = None  # started by the first asynchronous save

    # ----------------------------------------------------------------------------- topology
    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = with_strategy_clipping(Precision(), self)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # clipping must see the whole model's gradient, not this rank's part of it
        self._precision_plugin = None if plugin is None else with_strategy_clipping(plugin, self)

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 1

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("NxDStrategy.plan is available after Trainer.fit() has set up the environment")
        return self._plan

    @property
    def dp_comm(self) -> nxdt.comm.Communicator:
        return self.communicators[Dim.DP]

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a DistributedSampler (with ``distributed_sampler_kwargs``) into every dataloader of
        # a strategy that says it is distributed, exactly as for DDPStrategy; ``use_distributed_sampler=False``
        # and a user's own DistributedSampler are respected by Lightning itself
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over the data-parallel ranks only: ranks of one TP/PP/CP group see the same samples."""
        plan = self.plan
        return {"num_replicas": plan.dp, "rank": plan.coords(self.global_rank).dp}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        world_size = self.world_size
        if self._plan is None:
            self._plan = plan_layout(
                world_size,
                tp=self._degrees[Dim.TP], pp=self._degrees[Dim.PP], cp=self._degrees[Dim.CP], ep=self._degrees[Dim.EP],
                order=self._placement_order, ranks_per_node=self.num_processes,
            )
        elif self._plan.world_size != world_size:
            raise RuntimeError(
                f"the plan is for {self._plan.world_size} ranks but Lightning started {world_size} "
                f"(devices={self.num_processes}, num_nodes={self.num_nodes}); make trainer.devices × num_nodes match the plan"
            )
        if self._plan.cp > 1 and self._plan.ep > 1:
            raise NotImplementedError(
                f"NxDStrategy: degrees {self._plan.degrees} — context parallelism together with expert parallelism is "
                f"not implemented yet; context parallelism trains with data, tensor and pipeline parallelism, ZeRO-1 and FSDP")
        if self.world is None:
            self._connect()
        if self._trace_dir is not None:
            self._tracer = nxdt.comm.Tracer(self.global_rank)
            self.world.set_tracer(self._tracer)

    def _connect(self) -> None:
        """Join the world and open one communicator per planned group (once per strategy: later entry points of
        the same Trainer reuse them)."""
        env, world_size = self.cluster_environment, self.world_size
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.world = nxdt.comm.init_process(
            self.global_rank, world_size, env.main_address, env.main_port,
            timeout_s=self._timeout_s, run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
            store_is_server=(self.global_rank == 0 and not agent_hosts_store),
        )
        self.communicators = {"world": self.world.world}
        dims = DIMENSIONS + ((Dim.EDP,) if self._plan.ep > 1 else ()) + ((Dim.DP_CP,) if self._plan.cp > 1 else ())
        for dim in dims:
            for index, ranks in enumerate(self._plan.groups[dim]):
                comm = self.world.new_communicator(list(ranks), name=f"{dim.value}{index}", link=self._emulated_links.get(dim),
                                                   planned=self._plan.algorithms.get(dim.value), **self._comm_choice)
                if comm is not None:
                    self.communicators[dim.value] = comm
        atexit.register(self.close)  # a forked nxdt worker skips atexit handlers: run_training closes explicitly
        log.info("rank %d: communicators %s", self.global_rank, {k: c.ranks for k, c in self.communicators.items()})

    # ----------------------------------------------------------------------------- model
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelize()
        self._dp.bind(self._model_parallel())
        self._dp.broadcast_parameters(self.lightning_module)
        self._trainable_names = {n for n, p in self.lightning_module.named_parameters() if p.requires_grad}
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            # after the optimizers exist: FSDP's param groups decide its flat buffers and are pointed at the shards
            self._dp.shard_model(self.lightning_module, self.optimizers, precision=self.precision_plugin.precision,
                                 tracer=self._tracer)
        self.setup_precision_plugin()

    def _model_parallel(self) -> ModelParallel:
        """This rank's groups as the data-parallel runtime composes with them (TP/PP/EP only where the degree > 1).
        Under context parallelism the replicas of the weights are DP × CP: gradients are averaged, and ZeRO-1/FSDP
        shard, over that group (CP ranks hold the same weights, as DP ranks do)."""
        plan, comms = self.plan, self.communicators
        split = {dim.value: comms[dim] if plan.degree(dim) > 1 else None for dim in (Dim.TP, Dim.PP, Dim.EP)}
        replicas = comms[Dim.DP_CP] if plan.cp > 1 else comms[Dim.DP]
        return ModelParallel(dp=replicas, dp_size=plan.dp_cp, edp=comms.get(Dim.EDP), **split,
                             sequence_parallel=self._sequence_parallel, norm_weights=self._norm_weights, tp_layout=self._tp_layout,
                             tp_partial_grads=self._tp_partial_grads)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The module's optimizers, each through :meth:`shard_optimizer` (ZeRO-1 shards them; CausalLMModule shards
        its own before building its schedule); the LR schedulers are pointed at the sharded optimizer."""
        super().setup_optimizers(trainer)
        sharded = [self.shard_optimizer(o) for o in self.optimizers]
        for old, new in zip(self.optimizers, sharded):
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is old and new is not old:
                    config.scheduler.optimizer = new  # schedulers edit param_groups; the sharded one's hold the lr
        self.optimizers = sharded

    def _parallelize(self) -> None:
        """Shard the module's ``model`` (a model-hub model): layers over TP, experts over EP, core attention as a ring
        over CP, then cut this rank's pipeline stage."""
        tp, pp, ep, cp = self.plan.tp, self.plan.pp, self.plan.ep, self.plan.cp
        if tp == 1 and pp == 1 and ep == 1 and cp == 1:
            return
        model = getattr(self.lightning_module, "model", None)
        if model is not None and model is self._parallelized:  # fit, then test/predict: sharded already
            return
        if model is None or not hasattr(model, "run_layer"):
            raise ValueError("NxDStrategy: tensor/pipeline/expert/context parallelism needs a LightningModule whose `model` is a "
                             "model-hub model (embed / run_layer / head), e.g. nxdt.lightning.CausalLMModule")
        if tp > 1:
            apply_tensor_parallel(model, self.communicators[Dim.TP], sequence_parallel=self._sequence_parallel)
            self._norm_weights = norm_weights(model, tp)
        if cp > 1:  # each layer's core attention becomes ring attention over the CP group (weights untouched)
            apply_context_parallel(model, self.communicators[Dim.CP])
        if ep > 1:  # after TP: it flags the (TP-sharded) expert parameters it keeps
            apply_expert_parallel(model, self.communicators[Dim.EP])
        if pp > 1:
            pp_comm = self.communicators[Dim.PP]
            chunks = build_chunks(model, pp_comm.rank, pp, virtual=self._virtual)
            objective = getattr(self.lightning_module, "objective", None)  # CausalLMModule's (DPO reads more than labels)
            self._pipeline = PipelineExecutor(chunks, pp_comm, model.loss_fn, seq_shards=tp if self._sequence_parallel else 1,
                                              batch_loss=functools.partial(objective.loss, model) if objective else None)
        if tp > 1:  # this stage's TP-sharded parameters, recorded before FSDP could flatten them
            self._tp_layout = shard_layout(model)
            self._tp_partial_grads = partial_grad_names(model)
        self._parallelized = model

    def forward_backward(self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]]) -> Tensor:
        """Run forward and backward over one global batch's micro-batches; parameter gradients hold the
        gradient of the mean loss afterwards; returns the mean loss (on every pipeline stage). Under context
        parallelism each micro-batch is first cut to this rank's part of the sequence."""
        if self.plan.cp > 1:
            micro_batches = shard_micro_batches(micro_batches, self.communicators[Dim.CP])
        if self._pipeline is None:
            return module._forward_backward(micro_batches)
        pp, m = self.communicators[Dim.PP], len(micro_batches)
        schedule = (interleaved_one_f_one_b(pp.size, pp.rank, m, self._virtual) if self._virtual > 1
                    else one_f_one_b(pp.size, pp.rank, m))
        return torch.as_tensor(self._pipeline.run(schedule, micro_batches), dtype=torch.float64)

    def evaluate(self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]]) -> list[float]:
        """Each micro-batch's loss, forward only (validation); under PP the pipeline runs it and every stage gets them."""
        if self._pipeline is None:
            return module.evaluate_losses(micro_batches)
        return self._pipeline.evaluate(micro_batches)

    def score(self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]], fn: Callable[..., Tensor],
              width: int) -> Tensor:
        """``fn(model, logits, micro_batch)`` ([width] values) of each micro-batch, forward only, on every rank (DPO's
        reference log-probabilities); under PP the pipeline runs it and the last stage's values reach every stage."""
        if self._pipeline is None:
            return module.score_locally(micro_batches, fn)
        return self._pipeline.score(micro_batches, functools.partial(fn, module.model), width)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the step uses: with ZeRO-1 the same optimizer with its state sharded over data parallelism."""
        return self._dp.shard_optimizer(optimizer, self.lightning_module)

    def finish_gradients(self) -> None:
        """After the last backward of a step: the data-parallel runtime's reduction, composed with the TP sums of
        sequence-parallel replicas and the expert reduction (see :mod:`nxdt.parallel.data_parallel`)."""
        self._gradients_finished = True
        self._dp.finish_gradients(self.lightning_module)

    def step_stats(self) -> dict[str, float]:
        """Per-step communication figures for the metrics (FSDP: exposed_comm_s, comm_s, overlap_pct,
        peak_gathered_bytes); empty without FSDP."""
        return self._dp.step_stats()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """Clip every gradient by the norm of the whole model's gradient (all TP shards, all PP stages, all
        DP shards), after finishing the gradients if a backward has run since; returns the norm."""
        if not self._gradients_finished:
            self.finish_gradients()
        return self._dp.clip_grad_norm_(self.lightning_module, max_norm)

    @torch.no_grad()
    def clip_grad_value(self, limit: float) -> None:
        """Clamp every element of the finished gradient (where the optimizer reads it: shards under ZeRO-1/FSDP)."""
        if not self._gradients_finished:
            self.finish_gradients()
        for g in self._dp.shard_gradients(self.lightning_module):
            g.clamp_(-limit, limit)

    @torch.no_grad()
    def parameter_norm(self) -> Tensor:
        """2-norm of the whole model's parameters (all TP shards, EP experts, PP stages, FSDP shards); collective."""
        return self._dp.parameter_norm(self.lightning_module)

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        self._gradients_finished = False  # new local gradients: the next optimizer step must reduce them

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """One gradient path for automatic and manual optimisation: the gradients are finished
        (:meth:`finish_gradients`: TP/SP sums, the data-parallel average or ZeRO-1/FSDP reduce-scatter,
        expert reduction) once, after the step's last backward and before the optimizer uses them."""
        if not self.lightning_module.automatic_optimization:
            # a module that finished them itself (CausalLMModule, to clip first) is not reduced twice
            if not self._gradients_finished:
                self.finish_gradients()
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        # The closure runs the last backward of the step; gradients are finished right after it, before
        # Lightning's on_before_optimizer_step hooks and its clipping (which the precision plugin hands back to
        # clip_grad_norm / clip_grad_value here: see nxdt.lightning.precision).
        def closure_then_finish() -> Any:
            result = closure()
            self.finish_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_finish, model, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield None  # gradients are only reduced once per optimizer step anyway

    # ----------------------------------------------------------------------------- collectives for Lightning
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or self.world is None or self.world_size == 1:
            return tensor
        comm = group if isinstance(group, nxdt.comm.Communicator) else self.world.world
        out = tensor.detach().clone().to(torch.float32 if tensor.is_floating_point() or _op_name(reduce_op) == "avg" else tensor.dtype)
        comm.all_reduce(out.reshape(-1), op=_op_name(reduce_op))
        return out.to(tensor.dtype) if tensor.is_floating_point() else out

    def barrier(self, name: str | None = None) -> None:
        if self.world is not None and self.world_size > 1:
            self.world.world.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.world is None or self.world_size == 1:
            return obj
        return self.world.world.broadcast_object(obj, root=src)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if self.world is None or self.world_size == 1:
            return tensor.unsqueeze(0)
        comm = group if isinstance(group, nxdt.comm.Communicator) else self.world.world
        src = tensor.detach().contiguous()
        wire = src.to(torch.uint8) if src.dtype == torch.bool else src  # nxdt.comm moves numbers, not bools
        out = torch.empty((comm.size, *wire.shape), dtype=wire.dtype)
        comm.all_gather(out.reshape(-1), wire.reshape(-1))
        return out.to(torch.bool) if src.dtype == torch.bool else out

    # ----------------------------------------------------------------------------- checkpoints
    def _shard_files(self) -> tuple[str, str, bool, bool]:
        """(model file, state file, writes model?, writes state?) of this rank. Data-parallel replicas hold
        identical weights, so DP rank 0 of each model-parallel position (TP × PP shard) writes them; the
        trainer/optimizer state is per model-parallel shard too, and per DP rank when the data-parallel runtime
        shards it (ZeRO-1, FSDP). Under context parallelism the replicas are DP × CP (``dp_cp``): the files are
        those of a DP run with DP × CP ranks."""
        plan, coords = self.plan, self.plan.coords(self.global_rank)
        mp = "" if plan.mp == 1 else f"-mp{coords.mp}"
        mp += f"-ep{coords.ep}" if plan.ep > 1 else ""  # each EP rank holds its own experts
        dp = f"-dp{coords.dp_cp}" if self._dp.shards_optimizer_state and plan.dp_cp > 1 else ""
        first = coords.dp_cp < plan.ep  # the first replica of each EP position (CP > 1 only without EP)
        return f"model{mp}.safetensors", f"trainer_state{mp}{dp}.pt", first, first or bool(dp)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # never write non-finite weights: keep_last_k would then delete the last good checkpoint in their favour
        norm = float(self.parameter_norm())  # collective over the groups holding other parts of the model
        if not math.isfinite(norm):
            raise ckpt_io.CheckpointError(f"not writing {filepath}: the parameters are not finite (norm {norm}); the "
                                          "previous checkpoints are kept — lower model.optim.lr or enable gradient clipping")
        model_file, state_file, writes_model, writes_state = self._shard_files()
        adapters_only = self._saves_adapters_only()
        if adapters_only:  # LoRA without save_lora_base: the model file holds the adapters (trainable tensors) alone
            checkpoint = {**checkpoint, ADAPTERS_ONLY_KEY: True,
                          "state_dict": {k: v for k, v in checkpoint["state_dict"].items() if k in self._trainable_names}}
        meta = {**({"adapters_only": True} if adapters_only else {}), "degrees": ckpt_io.checkpoint_degrees(self.plan.degrees), "world_size": self.plan.world_size, **self._dp.checkpoint_flags(),
                "virtual_pipeline": self._virtual, "dp_format": self._dp.dp_format, **self.checkpoint_meta}
        if self.plan.tp > 1:  # how to reassemble full tensors from the TP shards (export, resharding)
            layout = self._tp_layout if self._tp_layout is not None else shard_layout(self.lightning_module.model)
            layouts = self.world.world.all_gather_object(layout)  # every stage's tensors
            meta["tensor_parallel"] = {name: spec for layout in layouts for name, spec in layout.items()}
        checkpoint = reshard.with_param_names(checkpoint, self.optimizers, self.lightning_module)  # lets any layout load it
        flat_layout = self._dp.optimizer_layout(self.optimizers, self.lightning_module)
        if flat_layout is not None:  # FSDP: which parameters each optimizer flat shard holds (to unflatten elsewhere)
            checkpoint[reshard.FSDP_LAYOUT_KEY] = flat_layout
        extra: dict[str, Any] = {ckpt_io.rng_file(self.global_rank): ckpt_io.rng_tensors()}  # every rank's own generators
        if self._peft_adapter_in_checkpoints:  # a collective: every rank gathers, rank 0 writes the adapter files
            adapter = self._peft_adapter_files()
            extra.update(adapter if self.global_rank == 0 else {})
        if self._async_checkpointing:  # copy what this rank writes now; training changes the originals meanwhile
            checkpoint = ckpt_io.snapshot({k: v for k, v in checkpoint.items()
                                           if (writes_model if k == "state_dict" else writes_state or k == "global_step")})
        stream = ckpt_io.ASYNC_STREAM if self._async_checkpointing else "default"
        if self.world_size == 1:
            def write() -> None:
                ckpt_io.save(checkpoint, filepath, meta=meta, before_commit=self.before_checkpoint_commit, extra_files=extra)
        else:
            def write() -> None:
                ckpt_io.save_sharded(checkpoint, filepath, model_file=model_file if writes_model else None,
                                     state_file=state_file if writes_state else None, comm=self.world.world, meta=meta,
                                     before_commit=self.before_checkpoint_commit, extra_files=extra, stream=stream)
        if not self._async_checkpointing:
            return write()
        if self._async_writer is None:
            self._async_writer = ckpt_io.AsyncWriter()
        self._async_writer.submit(write)

    def _peft_adapter_files(self) -> dict[str, Any]:
        """adapter_config.json and adapter_model.safetensors (``nxdt.lightning.peft_export``) of the adapters now."""
        config = getattr(self.lightning_module.model, "lora_config", None)
        if config is None:
            raise ValueError("NxDStrategy(peft_adapter_in_checkpoints=True): the model has no LoRA adapters (apply_peft)")
        state = peft_adapter_state(self.trainable_state_dict())
        return {ADAPTER_WEIGHTS: state, ADAPTER_CONFIG: json.dumps(peft_adapter_config(config), indent=2).encode()}

    def _saves_adapters_only(self) -> bool:
        """The hub model carries a LoRA ``peft_config`` (``nxdt.models.lora.apply_peft``) with save_lora_base false."""
        config = getattr(getattr(self.lightning_module, "model", None), "peft_config", None)
        return config is not None and not getattr(config, "save_lora_base", True)

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The trainable tensors (LoRA: the adapters) unsharded — gathered over FSDP's DP shards and the TP shards —
        by their names in the hub model (no ``model.`` prefix), on every rank. A collective every rank joins; not with
        pipeline parallelism (each stage holds other layers)."""
        if self.plan.pp > 1:
            raise NotImplementedError("NxDStrategy.trainable_state_dict: not with pipeline parallelism yet (each stage holds "
                                      "other layers); export from a checkpoint (nxdt checkpoint consolidate) instead")
        state = self._dp.model_state_dict(self.lightning_module)
        layout, tp = self._tp_layout or {}, self.communicators.get(Dim.TP.value) if self.plan.tp > 1 else None
        out = {}
        for name in sorted(self._trainable_names):
            short = name[len("model."):] if name.startswith("model.") else name
            spec = layout.get(short)
            out[short] = gather_shards(state[name], tp, *spec) if tp is not None and spec is not None else state[name].detach().clone()
        return out

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model file's weights by their original names (under FSDP gathered over DP one unit at a time; a
        collective every rank joins), so the model file is the same for every data-parallel format."""
        return self._dp.model_state_dict(self.lightning_module)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # restore into the parallelised model: it then holds exactly this rank's TP/PP/EP shard (the shapes
        # of the shard files), and FSDP's flat shards exist to receive their slices
        return True

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        adapters_only = bool(checkpoint.get(ADAPTERS_ONLY_KEY))
        if checkpoint.get(reshard.RESHARDED_KEY):  # the full model of another layout: this rank's stage and TP part of it
            keys = [k for k in self._dp.model_state_keys(self.lightning_module) if not adapters_only or k in state]
            state = reshard.local_model_state(state, keys, self.lightning_module, self.plan.coords(self.global_rank).tp)
        if adapters_only:  # the frozen base: the model's own weights as built (its hf_checkpoint, or the same seed)
            live = self._dp.model_state_dict(self.lightning_module)  # a collective under FSDP: every rank loads
            state = {**{k: v for k, v in live.items() if k not in state}, **state}
        try:
            rest = self._dp.load_model_state(self.lightning_module, state)
        except (KeyError, ValueError) as exc:
            raise ckpt_io.CheckpointError(f"checkpoint does not fit this model: {exc.args[0]}") from None
        result = self.lightning_module.load_state_dict(rest, strict=False)
        missing = [k for k in result.missing_keys if FSDP_SHARD_MARK not in k]
        if result.unexpected_keys or missing:
            raise ckpt_io.CheckpointError("checkpoint shard does not match this rank's tensor/pipeline/expert shard "
                                          f"(unexpected {result.unexpected_keys[:3]}, missing {missing[:3]})")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        expect, zero1 = self.checkpoint_meta.get("model"), self._dp.checkpoint_flags()["zero1"]
        degrees = ckpt_io.checkpoint_degrees(self.plan.degrees)  # CP folded into DP: CP ranks are weight replicas
        if ckpt_io.check_layout(checkpoint_path, degrees, zero1, self._virtual, data_parallel_format=self._dp.dp_format):
            log.info("rank %d: resharding %s for this layout %s", self.global_rank, checkpoint_path, self.plan.degrees)
            checkpoint = reshard.load_resharded(checkpoint_path, expect_model=expect)
        else:
            model_file, state_file, _, _ = self._shard_files()
            checkpoint = ckpt_io.load(checkpoint_path, expect_model=expect, model_file=model_file, state_file=state_file)
        ckpt_io.restore_rng(checkpoint_path, self.global_rank,
                            same_layout=ckpt_io.same_world(checkpoint_path, degrees, self.world_size))
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        tp_rank, module = self.plan.coords(self.global_rank).tp, self.lightning_module
        try:  # by parameter name where the checkpoint's layout or order differs; FSDP cuts full states into its shards
            states = self._dp.optimizer_states(
                checkpoint["optimizer_states"], self.optimizers, module, resharded=bool(checkpoint.get(reshard.RESHARDED_KEY)),
                tp_rank=tp_rank, by_name=lambda: reshard.optimizer_states_for(checkpoint, self.optimizers, module, tp_rank))
        except ValueError as exc:
            raise ckpt_io.CheckpointError(f"checkpoint optimizer state does not fit this model: {exc}") from None
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            if self._async_writer is not None:  # only once the newer checkpoint is committed
                self._async_writer.after_success(lambda: ckpt_io.remove(filepath))
            else:
                ckpt_io.remove(filepath)

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._async_writer is not None:  # the last checkpoint is committed (or its error ends the run) before fit returns
            self._async_writer.wait()

    # ----------------------------------------------------------------------------- lifecycle
    def teardown(self) -> None:
        if self._async_writer is not None:  # its collectives need the communicators: finish before closing them
            self._async_writer.close(raise_errors=False)
            self._async_writer = None
        super().teardown()
        if self._tracer is not None:
            os.makedirs(self._trace_dir, exist_ok=True)
            self._tracer.write(os.path.join(self._trace_dir, f"rank{self.global_rank}.json"))
            self._tracer = None
            self.world.set_tracer(None)
        # The communicators stay open, as DDP's process group does: ``trainer.save_checkpoint`` after ``fit`` and
        # the next entry point of the same Trainer (``test``, ``predict``) use them. ``close()`` ends them.

    def close(self) -> None:
        """Close the communicators (shared memory released, store left); every rank calls it. ``nxdt train``
        calls it after ``fit``; in a user's script it runs at interpreter exit unless called earlier."""
        if self.world is not None:
            self.world.close()
            self.world = None
            self.communicators = {}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="nxdt: planner-placed ranks, nxdt's own collectives")


if NxDStrategy.strategy_name not in StrategyRegistry:
    NxDStrategy.register_strategies(StrategyRegistry)
