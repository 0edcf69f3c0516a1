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
import logging
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

import nxdt.comm
from nxdt.config.hf_model import spec_of_class
from nxdt.lightning import collectives, environment, lightning_checkpoint
from nxdt.lightning.precision import with_strategy_clipping
from nxdt.lightning.sharded_checkpoint import RankGroups, ShardedCheckpointer
from nxdt.parallel.context_parallel import sequence_means, shard_micro_batches
from nxdt.parallel.data_parallel import DataParallelRuntime, data_parallel_runtime
from nxdt.parallel.devices import attention_kernels
from nxdt.parallel.parallelize import Parallelized, model_parallel, needs_hub_model, parallelize
from nxdt.parallel.pipeline import interleaved_one_f_one_b, one_f_one_b
from nxdt.parallel.sync_batchnorm import convert_sync_batchnorm, revert_sync_batchnorm
from nxdt.planner import Dim, Plan

log = logging.getLogger(__name__)


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
        find_unused_parameters: DDPStrategy's option: by default a trainable parameter without gradient at its
            optimizer's step stops training with its name; True leaves one no rank has a gradient for untouched (and
            counts a gradient missing on some ranks as zero there), as DDP does.
        broadcast_buffers: DDP's option, honoured: while fitting, DP rank 0's module buffers (BatchNorm's running
            statistics) are broadcast to every replica before a forward whenever DDP does it — before the first one,
            and before each one that follows a training forward whose gradients are reduced (not one inside
            ``block_backward_sync``, gradient accumulation's earlier micro-batches; not one under no_grad).
        process_group_backend: DDPStrategy's option: the backend of the torch.distributed default process group
            NxDStrategy initialises beside its communicators for third-party code (torchmetrics, samplers, a user's
            ``torch.distributed`` calls); "gloo", the only one on CPU (None: gloo).
        torch_process_group: initialise torch.distributed's default (gloo) group at the first entry point, for code that
            calls torch.distributed itself; it stays after ``fit`` (as DDP's does) until :meth:`close`. gloo listens on a socket of its own per rank (loopback on one host) whose
            connections it does not authenticate (its rendezvous through the run's store is signed); ``nxdt train``
            turns it off — its module needs no such group, and the store stays the only listener.
        overlap_grad_reduce: reduce the data-parallel gradients (plain DP's average, ZeRO-1's reduce-scatter) in DDP's
            buckets during the last backward before each step, on the communication stream, as DDP overlaps them
            (:mod:`nxdt.parallel.overlap`; the same bits as after backward). Where it cannot keep a semantic the
            reduction runs after backward instead (``NxDStrategy.overlap_off`` says why: a DP group of more than 2
            across hosts, several optimizers, an interleaved pipeline; also a manual-optimization loop that calls
            ``manual_backward`` itself, which does not say which backward is the last). False: always after.
        bucket_cap_mb: DDP's option, honoured: the bucket size of that overlap in MiB (None: DDP's 25).
        static_graph, gradient_as_bucket_view: DDP's options, accepted (so a script written for DDPStrategy runs) and
            without effect: nxdt's buckets are filled by copying, and its hooks need no static graph.
        checkpoint_format: ``"auto"`` (one Lightning ``.ckpt`` file, as DDP writes, under plain data parallelism; an
            nxdt directory where the state is sharded: ZeRO-1, FSDP, TP/PP/EP), ``"file"`` or ``"directory"``.
            ``nxdt.lightning.convert_to_lightning_checkpoint(dir, out)`` turns a directory into the file; ``fit`` and
            ``validate`` read either (:mod:`nxdt.lightning.lightning_checkpoint`).

    Several optimizers (a GAN's generator and discriminator) each have their own gradient path: an optimizer's
    gradients are reduced (and clipped, by their own norm) before its step, once per backward that produced them.
    """

    strategy_name = "nxdt"
    # Lightning's own attributes this class assigns (Lightning is not type-checked here: see [tool.mypy])
    _precision_plugin: Precision | None
    optimizers: list[torch.optim.Optimizer]
    model: Any  # sync_batchnorm's layer sync may hand back another module

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
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        process_group_backend: str | None = None,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        overlap_grad_reduce: bool = True,
        torch_process_group: bool = True,
        checkpoint_format: str = "auto",
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
        self._degrees = environment.checked_degrees(
            {
                Dim.TP: tensor_parallel_size,
                Dim.PP: pipeline_parallel_size,
                Dim.CP: context_parallel_size,
                Dim.EP: expert_parallel_size,
            }
        )
        environment.check_ddp_options(
            broadcast_buffers=broadcast_buffers,
            process_group_backend=process_group_backend,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            bucket_cap_mb=bucket_cap_mb,
        )
        self._broadcast_buffers = broadcast_buffers
        self._process_group_backend = process_group_backend or "gloo"
        self._torch_process_group = torch_process_group
        self._torch_groups = 0  # torch.distributed default groups this strategy has made (each under its own key prefix)
        self._owns_torch_group = False  # the current default group is this strategy's: teardown destroys it
        # DDP's buffer sync, while fitting: broadcast before the next forward (DDP's require_forward_param_sync)
        self._fitting = False
        self._sync_buffers_next = False
        self._no_sync = False  # inside block_backward_sync: the forward's gradients are not reduced
        self._plan = plan
        self._timeout_s = float(timeout_s)
        self._placement_order = placement_order
        self._virtual = virtual_pipeline_size
        self._sequence_parallel = sequence_parallel
        self._comm_choice = {"transport": comm_transport, "algorithm": comm_algorithm}
        self._emulated_links = {dim: nxdt.comm.EmulatedLink(*figures) for dim, figures in (emulated_links or {}).items()}
        # replicated, ZeRO-1 or FSDP: chosen once here, bound to the groups in setup(), then used without asking
        if not isinstance(overlap_grad_reduce, bool):
            raise ValueError(f"NxDStrategy(overlap_grad_reduce={overlap_grad_reduce!r}): must be True or False")
        self._dp: DataParallelRuntime = data_parallel_runtime(
            zero1=zero1,
            fsdp=fsdp,
            find_unused_parameters=find_unused_parameters,
            overlap_grad_reduce=overlap_grad_reduce,
            bucket_cap_mb=bucket_cap_mb,
        )
        self._backwards_left: int | None = None  # forward_backward: backwards still to come before the step
        self._checkpoints = ShardedCheckpointer(
            self._dp,
            virtual_pipeline=virtual_pipeline_size,
            async_writes=async_checkpointing,
            peft_adapter=peft_adapter_in_checkpoints,
            checkpoint_format=checkpoint_format,
        )
        self._trace_dir = trace_dir
        self._tracer: nxdt.comm.Tracer | None = None
        self._parallel = Parallelized()  # what applying TP/CP/EP/PP left (the pipeline executor, TP layout, norm weights)
        self._parallelized: torch.nn.Module | None = None  # the hub model parallelize() sharded (once)
        self._num_nodes = 1
        self.world: nxdt.comm.World | None = None
        self.communicators: dict[str, nxdt.comm.Communicator] = {}
        # ids of the optimizers whose gradients a backward has changed since they were last finished
        self._unfinished: set[int] = set()
        # stored in every checkpoint's meta.json (e.g. the model shape, checked again on load)
        self.checkpoint_meta = dict(checkpoint_meta or {})
        # called with the temporary directory after a checkpoint's files are written, before it is
        # committed (fault drills kill the process here to prove an interrupted save is harmless)
        self.before_checkpoint_commit: Callable[[Any], None] | None = None

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
        # CUDA parallel_devices (Lightning's accelerator="cuda", or nxdt train's device policy, which may give two
        # ranks one GPU) place each rank on its own entry, as DDPStrategy does; anything else computes on the CPU
        devices = self.parallel_devices
        # (a CPU device with an index is kept as given: the tests' emulated accelerator, tests/accelerator_emulation.py)
        if devices and (devices[0].type == "cuda" or devices[0].index is not None):
            return devices[self.local_rank]
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
        # always, as DDPStrategy: where processes are started externally (torchrun, a rank Lightning started) the
        # launcher starts none, but still gives each process cpus // processes intra-op threads when OMP_NUM_THREADS
        # is unset (without it a script's rank 1 kept every core's threads: DDP's numbers differed by ulps)
        assert self.cluster_environment is not None
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
        self._plan = environment.run_plan(
            self._plan,
            self.world_size,
            degrees=self._degrees,
            order=self._placement_order,
            ranks_per_node=self.num_processes,
            num_nodes=self.num_nodes,
        )
        if self.world is None:  # once per strategy: later entry points of the same Trainer reuse the communicators
            env = self.cluster_environment
            assert env is not None
            self.world = environment.join_world(
                self.global_rank,
                self.world_size,
                env.main_address,
                env.main_port,
                timeout_s=self._timeout_s,
                node_rank=self.node_rank,
                ranks_per_node=self.num_processes,
            )
            self.communicators = environment.open_groups(
                self.world, self._plan, links=self._emulated_links, choice=self._comm_choice
            )
            atexit.register(self.close)  # a forked nxdt worker skips atexit handlers: run_training closes explicitly
            log.info("rank %d: communicators %s", self.global_rank, {k: c.ranks for k, c in self.communicators.items()})
        made = self._torch_process_group and environment.init_torch_distributed(
            self.world, self._process_group_backend, self._torch_groups
        )
        if made:
            self._torch_groups += 1
            self._owns_torch_group = True
        if self._trace_dir is not None:
            self._tracer = nxdt.comm.Tracer(self.global_rank)
            self.world.set_tracer(self._tracer)

    # ----------------------------------------------------------------------------- model
    def _sync_layers(self, module: Any) -> Any:
        """``Trainer(sync_batchnorm=True)``: BatchNorm layers synced over data parallelism with nxdt's all-reduce
        (torch's SyncBatchNorm refuses CPU tensors); another LayerSync plugin is applied as it is."""
        assert self._layer_sync is not None
        if isinstance(self._layer_sync, TorchSyncBatchNorm):
            return convert_sync_batchnorm(module, self.communicators[Dim.DP])
        return self._layer_sync.apply(module)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
            if self._dp.dp_format == "fsdp":
                # FSDP's flat units own the layers' weights (their modules hold views of them), so the synced layers
                # could not be swapped back after fit as DDPStrategy.teardown does
                raise NotImplementedError(
                    "NxDStrategy(fsdp=True) with Trainer(sync_batchnorm=True) is not supported: FSDP holds the BatchNorm "
                    "weights in its flat shards; use zero1=True (optimizer state sharded) or plain data parallelism"
                )
            self.model = self._sync_layers(self.model)  # as DDPStrategy.setup: for fitting, before the precision
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelize()
        self._dp.bind(model_parallel(self.communicators, self._parallel, sequence_parallel=self._sequence_parallel))
        self._dp.broadcast_parameters(self.lightning_module)
        trainable = frozenset(n for n, p in self.lightning_module.named_parameters() if p.requires_grad)  # before FSDP
        self._checkpoints.bind(
            RankGroups.of(self.plan, self.global_rank, self.communicators, self._parallel.tp_layout, trainable),
            self.lightning_module,
        )
        self._fitting = trainer.state.fn == TrainerFn.FITTING
        self._sync_buffers_next = self._fitting and self._broadcast_buffers  # DDP syncs before its first forward
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._checkpoints.record_optimizers(self.optimizers, self.lightning_module)  # before FSDP renames them
            # after the optimizers exist: FSDP's param groups decide its flat buffers and are pointed at the shards
            self._dp.shard_model(
                self.lightning_module, self.optimizers, precision=self.precision_plugin.precision, tracer=self._tracer
            )
            if self._parallel.pipeline is not None and self._dp.compute_dtype is not None:
                self._parallel.pipeline.dtype = self._dp.compute_dtype  # what the stages send each other
            hooks = [self.lightning_module, *trainer.callbacks]
            if any(is_overridden("on_before_optimizer_step", h) for h in hooks):
                # a hook reads p.grad after the reduction (gradient-norm logging): it must see the DP average, as under DDP
                self._dp.show_reduced_gradients()
            if len(self.optimizers) > 1 and (self.plan.tp > 1 or self.plan.ep > 1):
                # the TP sums of partial gradients and the expert reduction run once per backward over the whole model
                raise NotImplementedError(
                    f"NxDStrategy: {len(self.optimizers)} optimizers with tensor or expert parallelism "
                    f"(tp={self.plan.tp}, ep={self.plan.ep}) are not supported; use one optimizer (param groups) there"
                )
        self.setup_precision_plugin()

    def shard_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy of the hub model (taken after TP, before FSDP: in ``configure_optimizers``) laid out over data
        parallelism as the trained model is — under FSDP sharded in units of its own, gathered per forward (GRPO's
        reference model); otherwise unchanged. Every rank calls it, after :meth:`setup`."""
        return self._dp.shard_frozen(model, precision=self.precision_plugin.precision)

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
        """Shard the module's hub ``model`` for this rank (:func:`nxdt.parallel.parallelize.parallelize`), once."""
        model = getattr(self.lightning_module, "model", None)
        sharded_already = model is not None and model is self._parallelized  # fit, then test / predict
        if not needs_hub_model(self.communicators) or sharded_already:
            return
        objective = getattr(self.lightning_module, "objective", None)  # CausalLMModule's (DPO reads more than labels)
        # a model family's TP/SP plan is its spec's (by the exact class path); any other model declares its own
        family = spec_of_class(type(model))
        tp_plan = None
        if family is not None and model is not None and not hasattr(model, "tensor_parallel_plan"):
            tp_plan = family.tensor_parallel_plan(model.cfg)
        self._parallel = parallelize(
            model,
            self.communicators,
            sequence_parallel=self._sequence_parallel,
            virtual_pipeline=self._virtual,
            batch_loss=functools.partial(objective.loss, model) if objective else None,
            tensor_parallel_plan=tp_plan,
            expert_blocks=None if family is None else family.parallel.experts,
        )
        balance = getattr(self._parallel.pipeline, "balance", None)  # a MoE model's term across the stages
        if balance is not None and getattr(objective, "aux_real_tokens", False):
            balance.padding_masked = True
        self._parallelized = model

    def forward_backward(self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]]) -> Tensor:
        """Run forward and backward over one global batch's micro-batches; parameter gradients hold the
        gradient of the mean loss afterwards; returns the mean loss (on every pipeline stage). Under context
        parallelism each micro-batch is first cut to this rank's part of the sequence."""
        half = str(self.precision_plugin.precision).startswith(("bf16", "16"))
        with attention_kernels(self.root_device.type, half):  # CUDA in bf16: flash / efficient / cuDNN (parallel.devices)
            return self._run_micro_batches(module, micro_batches)

    def _cp_parts(self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """This CP rank's part of each micro-batch (:func:`shard_micro_batches`); a preference objective's pairs without
        a token share: it adds each sequence up over the CP group itself (``sequence_total``)."""
        objective = getattr(module, "objective", None)
        pairs = bool(getattr(objective, "pairs", False))
        return shard_micro_batches(micro_batches, self.communicators[Dim.CP], token_share=not pairs)

    def _run_micro_batches(self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]]) -> Tensor:
        if self.plan.cp == 1:
            return self._run_parts(micro_batches, module)
        parts = self._cp_parts(module, micro_batches)
        cut = [set(part) for part in parts]
        loss = self._run_parts(parts, module)
        for whole, part, before in zip(micro_batches, parts, cut):  # what the loss recorded (DPO's metric sums)
            whole.update({key: part[key] for key in part.keys() - before})
        return loss

    def _run_parts(self, micro_batches: list[dict[str, Tensor]], module: pl.LightningModule) -> Tensor:
        if self._parallel.pipeline is None:
            self._backwards_left = len(micro_batches)  # the last one's gradients may be reduced while it runs
            try:
                return module._forward_backward(micro_batches)
            finally:
                self._backwards_left = None
        pp, m = self.communicators[Dim.PP], len(micro_batches)
        schedule = (
            interleaved_one_f_one_b(pp.size, pp.rank, m, self._virtual) if self._virtual > 1 else one_f_one_b(pp.size, pp.rank, m)
        )
        arm = lambda last: self._dp.before_backward(last and not self._no_sync)  # noqa: E731
        return torch.as_tensor(self._parallel.pipeline.run(schedule, micro_batches, arm), dtype=torch.float64)

    def evaluate(self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]]) -> list[float]:
        """Each micro-batch's loss, forward only (validation); under PP the pipeline runs it and every stage gets them.
        Under context parallelism each micro-batch is cut as for training and the ring runs forward; the CP ranks'
        means over their own tokens combine into the whole sequence's token mean (``sequence_means``)."""
        if self.plan.cp > 1:
            parts = self._cp_parts(module, micro_batches)
            return sequence_means(self._evaluate_parts(module, parts), parts, self.communicators[Dim.CP])
        return self._evaluate_parts(module, micro_batches)

    def _evaluate_parts(self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]]) -> list[float]:
        if self._parallel.pipeline is None:
            return module.evaluate_losses(micro_batches)
        return self._parallel.pipeline.evaluate(micro_batches)

    def score(
        self, module: pl.LightningModule, micro_batches: list[dict[str, Tensor]], fn: Callable[..., Tensor], width: int
    ) -> Tensor:
        """``fn(model, logits, micro_batch)`` ([width] values) of each micro-batch, forward only, on every rank (DPO's
        reference log-probabilities); under PP the pipeline runs it and the last stage's values reach every stage. Under
        context parallelism each micro-batch is cut as for training and ``fn`` adds its sequences up over the CP group
        (``sequence_total``)."""
        if self.plan.cp > 1:
            micro_batches = shard_micro_batches(micro_batches, self.communicators[Dim.CP], token_share=False)
        if self._parallel.pipeline is None:
            return module.score_locally(micro_batches, fn)
        return self._parallel.pipeline.score(micro_batches, functools.partial(fn, module.model), width)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the step uses: with ZeRO-1 the same optimizer with its state sharded over data parallelism."""
        return self._dp.shard_optimizer(optimizer, self.lightning_module)

    def finish_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """After the last backward before ``optimizer``'s step (every optimizer's when None): the data-parallel
        runtime's reduction of its gradients, composed with the TP sums of sequence-parallel replicas and the expert
        reduction (see :mod:`nxdt.parallel.data_parallel`)."""
        optimizer = _unwrapped(optimizer)
        self._dp.finish_gradients(self.lightning_module, optimizer)
        if optimizer is None:
            self._unfinished.clear()
        else:
            self._unfinished.discard(id(optimizer))

    def _finish_if_needed(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Finish ``optimizer``'s gradients (every optimizer's when None) unless done since the last backward."""
        optimizer = _unwrapped(optimizer)
        if (optimizer is None and self._unfinished) or id(optimizer) in self._unfinished:
            self.finish_gradients(optimizer)

    def step_stats(self) -> dict[str, float]:
        """Per-step communication figures for the metrics (FSDP: exposed_comm_s, comm_s, overlap_pct,
        peak_gathered_bytes); empty without FSDP."""
        return self._dp.step_stats()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """Clip ``optimizer``'s gradients (every optimizer's when None) by their norm over the whole model (all TP
        shards, all PP stages, all DP shards), as Lightning clips ``optimizer.param_groups``, after finishing them if a
        backward has run since; returns the norm."""
        self._finish_if_needed(optimizer)
        return self._dp.clip_grad_norm_(self.lightning_module, max_norm, _unwrapped(optimizer))

    @torch.no_grad()
    def gradient_norm(self, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        """2-norm of the reduced gradient of ``optimizer``'s parameters (of every parameter with a gradient when None)
        over the whole model, the same on every rank: what ``lightning.pytorch.utilities.grad_norm(module)["..._total"]``
        gives under DDPStrategy, for every data-parallel runtime (under FSDP a module's parameters are its flat
        shards, so ``grad_norm`` totals this rank's slice, as under Lightning's FSDPStrategy). A collective: call it
        on every rank (``on_before_optimizer_step``)."""
        self._finish_if_needed(optimizer)
        return self._dp.gradient_norm(self.lightning_module, _unwrapped(optimizer))

    @torch.no_grad()
    def clip_grad_value(self, limit: float, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Clamp every element of ``optimizer``'s finished gradient (where it reads it: shards under ZeRO-1/FSDP)."""
        self._finish_if_needed(optimizer)
        for g in self._dp.shard_gradients(self.lightning_module, _unwrapped(optimizer)):
            g.clamp_(-limit, limit)

    @torch.no_grad()
    def parameter_norm(self) -> Tensor:
        """2-norm of the whole model's parameters (all TP shards, EP experts, PP stages, FSDP shards); collective."""
        return self._dp.parameter_norm(self.lightning_module)

    @property
    def overlap_off(self) -> str | None:
        """Why the data-parallel gradients are reduced after backward rather than during it (None: during it)."""
        off = getattr(self._dp, "overlap_off", None)
        if off is None and self._parallel.pipeline is not None and self._virtual > 1:
            return "interleaved pipeline (virtual stages): no backward is the last of every chunk on a stage"
        return off

    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        # the last backward before the step may reduce its gradients while it runs: automatic optimization's outside
        # block_backward_sync (DDP's no_sync), forward_backward's last micro-batch. A manual loop of its own does not
        # say which backward is its last (GRPO's micro-batches): reduced after backward, not once per backward
        if self._backwards_left is not None:
            self._backwards_left -= 1
            last = self._backwards_left == 0
        else:
            last = self.lightning_module.automatic_optimization
        self._dp.before_backward(last and not self._no_sync)

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)
        # new local gradients: each optimizer's next step must reduce its own
        self._unfinished = {id(o) for o in self.optimizers}

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """One gradient path for automatic and manual optimisation: the optimizer's gradients are finished
        (:meth:`finish_gradients`: TP/SP sums, the data-parallel average or ZeRO-1/FSDP reduce-scatter,
        expert reduction) once, after the last backward before its step and before it uses them."""
        optimizer = _unwrapped(optimizer)
        if not self.lightning_module.automatic_optimization:
            # a module that finished them itself (CausalLMModule, to clip first) is not reduced twice
            self._finish_if_needed(optimizer)
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            # The closure runs the last backward of the step; gradients are finished right after it, before
            # Lightning's on_before_optimizer_step hooks and its clipping (which the precision plugin hands back to
            # clip_grad_norm / clip_grad_value here: see nxdt.lightning.precision).
            def closure_then_finish() -> Any:
                result = closure()
                self._finish_if_needed(optimizer)
                return result

            result = super().optimizer_step(optimizer, closure_then_finish, model, **kwargs)
        self._dp.after_step(optimizer)
        return result

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # the backward inside accumulates: it is not armed (pre_backward), and DDP's buffer sync reads the flag
        self._no_sync = True
        try:
            yield None
        finally:
            self._no_sync = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().training_step, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(super().validation_step, *args, **kwargs)

    def _forward(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A step as DDP's forward runs it while fitting (the only time DDPStrategy wraps the module): DP rank 0's
        buffers broadcast first when the previous forward was a training one with its gradients reduced (DDP's
        ``require_forward_param_sync``: a forward under no_grad or ``no_sync`` clears it, one with grad sets it)."""
        if not self._fitting or not self._broadcast_buffers:
            return step(*args, **kwargs)
        if self._sync_buffers_next:
            self._dp.broadcast_buffers(self.lightning_module)
        result = step(*args, **kwargs)
        self._sync_buffers_next = torch.is_grad_enabled() and not self._no_sync
        return result

    # ----------------------------------------------------------------------------- collectives for Lightning
    def _group(self, group: Any) -> nxdt.comm.Communicator | None:
        """The communicator a Lightning collective runs over (a given nxdt group, else the world); None alone."""
        if self.world is None or self.world_size == 1:
            return None
        return group if isinstance(group, nxdt.comm.Communicator) else self.world.world

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        comm = self._group(group)
        return collectives.reduce(comm, tensor, reduce_op) if comm is not None and isinstance(tensor, Tensor) else tensor

    def barrier(self, name: str | None = None) -> None:
        if (comm := self._group(None)) is not None:
            comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        comm = self._group(None)
        return obj if comm is None else comm.broadcast_object(obj, root=src)

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        comm = self._group(group)
        return tensor.unsqueeze(0) if comm is None else collectives.all_gather(comm, tensor)

    # ----------------------------------------------------------------------------- checkpoints (this rank's files)
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._checkpoints.writes_file:  # Lightning's one file, written as DDPStrategy writes it (global rank 0)
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self._checkpoints.save(
            checkpoint,
            filepath,
            self.lightning_module,
            self.optimizers,
            meta=self.checkpoint_meta,
            before_commit=self.before_checkpoint_commit,
        )

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The trainable tensors (LoRA: the adapters) unsharded — gathered over FSDP's DP shards and the TP shards —
        by their names in the hub model (no ``model.`` prefix), on every rank. A collective every rank joins; not with
        pipeline parallelism (each stage holds other layers)."""
        return self._checkpoints.trainable_state_dict(self.lightning_module)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model file's weights by their original names (under FSDP gathered over DP one unit at a time; a
        collective every rank joins), in the module's own order, so the model file is the same for every data-parallel
        format, and a Lightning file's ``state_dict`` is the one DDP writes."""
        return self._checkpoints.in_module_order(self._dp.model_state_dict(self.lightning_module))

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # restore into the parallelised model: it then holds exactly this rank's TP/PP/EP shard (the shapes
        # of the shard files), and FSDP's flat shards exist to receive their slices
        return True

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if lightning_checkpoint.is_file(checkpoint_path):  # a Lightning .ckpt (ours, DDP's, converted): any layout
            return self._checkpoints.load_file(checkpoint_path, self.checkpoint_io, weights_only)
        return self._checkpoints.load(checkpoint_path, expect_model=self.checkpoint_meta.get("model"))

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._checkpoints.load_model_state(checkpoint, self.lightning_module)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = self._checkpoints.optimizer_states(checkpoint, self.optimizers, self.lightning_module)
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

    def remove_checkpoint(self, filepath: Any) -> None:
        if lightning_checkpoint.is_file(filepath):
            return super().remove_checkpoint(filepath)
        if self.is_global_zero:
            self._checkpoints.remove(filepath)

    def on_train_end(self) -> None:
        super().on_train_end()
        self._checkpoints.wait()  # the last checkpoint is committed (or its error ends the run) before fit returns

    # ----------------------------------------------------------------------------- lifecycle
    def teardown(self) -> None:
        self._checkpoints.close()  # its collectives need the communicators: finish before closing them
        module = self.lightning_module
        if self._fitting and self._layer_sync is not None and module is not None:  # as DDPStrategy.teardown
            self.model = (
                revert_sync_batchnorm(module)
                if isinstance(self._layer_sync, TorchSyncBatchNorm)
                else self._layer_sync.revert(module)
            )
        self._fitting = False
        super().teardown()
        if self._tracer is not None and self._trace_dir is not None and self.world is not None:
            os.makedirs(self._trace_dir, exist_ok=True)
            self._tracer.write(os.path.join(self._trace_dir, f"rank{self.global_rank}.json"))
            self._tracer = None
            self.world.set_tracer(None)
        # The communicators and the torch.distributed group stay, as DDPStrategy.teardown leaves its process group:
        # ``trainer.save_checkpoint`` after ``fit``, the next entry point of the same Trainer (``test``, ``predict``)
        # and a user's ``torch.distributed`` call after ``fit`` use them. ``close()`` ends both.

    def close(self) -> None:
        """Close the communicators (shared memory released, store left); every rank calls it. ``nxdt train``
        calls it after ``fit``; in a user's script it runs at interpreter exit unless called earlier."""
        self._destroy_torch_group()
        self._dp.close()
        if self.world is not None:
            self.world.close()
            self.world = None
            self.communicators = {}

    def _destroy_torch_group(self) -> None:
        """The torch.distributed default group this strategy made, destroyed (:meth:`close`; a group nxdt did not make
        — a user's, DDPStrategy's — is left as it is)."""
        if self._owns_torch_group:
            self._owns_torch_group = False
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="nxdt: planner-placed ranks, nxdt's own collectives")


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer behind a LightningOptimizer (what ``self.optimizers()`` hands a module)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


if NxDStrategy.strategy_name not in StrategyRegistry:
    NxDStrategy.register_strategies(StrategyRegistry)
