"""``NxDStrategy``: a Lightning ``ParallelStrategy`` whose every collective is an nxdt collective.

It builds (or receives) the Plan, creates one nxdt communicator per planned group, keeps the
data-parallel replicas in step (parameters broadcast once, gradients averaged once per optimizer
step, in one flat bucket), answers Lightning's ``reduce / barrier / broadcast / all_gather`` and
writes atomic directory checkpoints.

Launch modes, all without forking Lightning:

* under ``nxdt train`` or ``torchrun`` the processes exist already (the elastic agent hosts the
  rendezvous store, ``TORCHELASTIC_USE_AGENT_STORE=True``);
* from a plain ``python script.py`` Lightning's subprocess-script launcher re-runs the script once
  per extra rank, and rank 0 hosts the store.
"""

from __future__ import annotations

import logging
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
from nxdt.lightning import checkpoint as ckpt_io
from nxdt.planner import Plan, plan_layout

log = logging.getLogger(__name__)

# Lightning passes reduce ops as strings or torch ReduceOp members; nxdt.comm takes plain names.
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
        self._degrees = {"tp": tensor_parallel_size, "pp": pipeline_parallel_size, "cp": context_parallel_size, "ep": expert_parallel_size}
        self._plan = plan
        self._timeout_s = float(timeout_s)
        self._placement_order = placement_order
        self._num_nodes = 1
        self.world: nxdt.comm.World | None = None
        self.communicators: dict[str, nxdt.comm.Communicator] = {}
        self._grad_buffer: Tensor | None = None
        # stored in every checkpoint's meta.json (e.g. the model shape, checked again on load)
        self.checkpoint_meta = dict(checkpoint_meta or {})
        # called with the temporary directory after a checkpoint's files are written, before it is
        # committed (fault drills kill the process here to prove an interrupted save is harmless)
        self.before_checkpoint_commit: Callable[[Any], None] | None = None

    # ----------------------------------------------------------------------------- topology
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
        return self.communicators["dp"]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        plan = self.plan
        return {"num_replicas": plan.degrees["dp"], "rank": plan.coords(self.global_rank)["dp"]}

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
                tp=self._degrees["tp"], pp=self._degrees["pp"], cp=self._degrees["cp"], ep=self._degrees["ep"],
                order=self._placement_order, ranks_per_node=self.num_processes,
            )
        elif self._plan.world_size != world_size:
            raise RuntimeError(
                f"the plan is for {self._plan.world_size} ranks but Lightning started {world_size} "
                f"(devices={self.num_processes}, num_nodes={self.num_nodes}); make trainer.devices × num_nodes match the plan"
            )
        if any(self._plan.degrees[d] != 1 for d in ("tp", "pp", "cp", "ep")):
            raise NotImplementedError(
                f"NxDStrategy: degrees {self._plan.degrees} — tensor/pipeline/context/expert parallel training is not "
                f"implemented yet in this version; use data parallelism (all sizes 1)")
        env = self.cluster_environment
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.world = nxdt.comm.init_process(
            self.global_rank, world_size, env.main_address, env.main_port,
            timeout_s=self._timeout_s, run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
            store_is_server=(self.global_rank == 0 and not agent_hosts_store),
        )
        self.communicators = {"world": self.world.world}
        for dim in ("tp", "cp", "ep", "dp", "pp"):
            for index, ranks in enumerate(self._plan.groups[dim]):
                comm = self.world.new_communicator(list(ranks), name=f"{dim}{index}")
                if comm is not None:
                    self.communicators[dim] = comm
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
        self._broadcast_parameters()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Make every data-parallel replica start from DP-rank 0's weights, whatever each process seeded."""
        if self.plan.degrees["dp"] == 1:
            return
        tensors = [t for t in list(self.model.parameters()) + list(self.model.buffers()) if t.numel()]
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            self.dp_comm.broadcast(flat, root=0)
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    # ----------------------------------------------------------------------------- gradients
    def _trainable(self) -> list[Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average gradients over the data-parallel group: one flat fp32 bucket, one all-reduce."""
        if self.plan.degrees["dp"] == 1:
            return
        params = self._trainable()
        numel = sum(p.numel() for p in params)
        if self._grad_buffer is None or self._grad_buffer.numel() != numel:
            self._grad_buffer = torch.empty(numel, dtype=torch.float32)
        flat, offset = self._grad_buffer, 0
        for p in params:  # a parameter without a gradient on this rank contributes zeros, consistently
            view = flat[offset:offset + p.numel()]
            view.copy_(p.grad.reshape(-1)) if p.grad is not None else view.zero_()
            offset += p.numel()
        self.dp_comm.all_reduce(flat, op="avg")
        offset = 0
        for p in params:
            view = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = view.to(p.dtype).clone()
            else:
                p.grad.copy_(view)
            offset += p.numel()

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        # The closure runs the last micro-batch's backward; gradients are averaged right after it and
        # before Lightning clips them, so clipping sees the global gradient.
        def closure_then_sync() -> Any:
            result = closure()
            self.sync_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

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
        out = torch.empty((comm.size, *src.shape), dtype=src.dtype)
        comm.all_gather(out.reshape(-1), src.reshape(-1))
        return out

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Data-parallel replicas hold identical state: rank 0 writes (sharded writes come with model parallelism).
        if self.is_global_zero:
            meta = {"degrees": dict(self.plan.degrees), "world_size": self.plan.world_size, **self.checkpoint_meta}
            ckpt_io.save(checkpoint, filepath, meta=meta, before_commit=self.before_checkpoint_commit)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return ckpt_io.load(checkpoint_path, expect_model=self.checkpoint_meta.get("model"))

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt_io.remove(filepath)

    # ----------------------------------------------------------------------------- lifecycle
    def teardown(self) -> None:
        super().teardown()
        if self.world is not None:
            self.world.close()
            self.world = None
            self.communicators = {}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="nxdt: planner-placed ranks, nxdt's own collectives")


if NxDStrategy.strategy_name not in StrategyRegistry:
    NxDStrategy.register_strategies(StrategyRegistry)
