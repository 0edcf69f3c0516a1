"""nxdt side by side with its peers: the same model, data and recipe, interleaved rounds, one table and one plot.

    python experiments/peers/run.py                      # ≈ 10 min on 2 cores; writes results.json + plot.png
    python experiments/peers/run.py --quick              # 1 round of few steps: checks every variant runs
    python experiments/peers/run.py --only "nxdt DP" "Lightning DDP (gloo)"

Pairs (nxdt first, its peer second; 2 ranks, one intra-op thread per rank, in every variant of the first four):

* NxDStrategy plain DP        vs Lightning's DDPStrategy (gloo), the same CausalLMModule under automatic optimization;
* NxDStrategy ZeRO-1          vs DeepSpeed ZeRO-1 and ZeRO-2 (CPU accelerator, gloo);
* NxDStrategy FSDP (token_threaded prefetch) vs torch FSDP2 (``fully_shard`` per decoder layer + root, gloo) and
  DeepSpeed ZeRO-3. Lightning's FSDPStrategy refuses the CPU, so torch's API is the peer;
* NxDStrategy TP2 + SP        vs torch DTensor tensor parallelism (``parallelize_module``: Colwise/Rowwise for the
  projections, SequenceParallel for the norms, torchtitan's Llama plan, gloo);
* ``nxdt train`` with 2 ranks vs a plain single-process PyTorch loop of the same model and recipe (AdamW, the same
  schedule, clipping 1.0; torch's default threads, i.e. both cores): wall time from launch to exit for the same
  number of steps, and the loss reached. The loop is the floor a second rank has to beat.

Every variant is a fresh process tree (NxDStrategy/DDP the way a user runs a Lightning script; the torch and DeepSpeed
peers under ``torch.distributed.run``), with the model hub's Llama built from the same seed, the same synthetic batches
(``NxDDataModule``, each rank its data-parallel slice), AdamW with nxdt's parameter groups and its warm-up + cosine
schedule (``nxdt.lightning.optim``), no clipping in the strategy pairs. Each rank records its step times (wall time
between consecutive step ends), its own loss per step and its peak RSS (``ru_maxrss``); a pair's losses must agree
step by step within ``LOSS_RTOL`` (asserted), so the times compare equal work. The rounds rotate the order of the
variants (as experiments/harness.py's ``interleaved_runs``), so a slow phase of the shared host hits every variant.
DeepSpeed is not a dependency of nxdt: its rows run when ``import deepspeed`` works in this interpreter, or with
``--deepspeed-path`` (a site-packages directory holding it, e.g. a scratch venv's); otherwise they are skipped with
the reason printed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# the model hub's Llama at a size where a 2-rank step takes ~0.2-1 s on this host: 4 layers, hidden 256, 3.2 M params
MODEL = [
    "model=llama_tiny",
    "model.hidden_size=256",
    "model.ffn_hidden_size=688",
    "model.num_attention_heads=8",
    "model.num_kv_heads=4",
]
SEQ, GLOBAL_BATCH, MICRO = 128, 4, 2
RANKS = 2
# Equal work: every step's loss of the nxdt variant within this relative distance of its peer's. The pairs differ only
# in fp32 summation order (DP/ZeRO/FSDP: the mean of 2 ranks' gradients, exact up to its last bit; TP: matmuls split
# over the hidden or vocabulary dimension, ~1e-7 relative per reduction), which AdamW's normalised updates carry into
# the weights at about lr × (relative gradient difference) per step; over ≤ 30 steps the measured loss gaps stay
# below 1e-5 (results.json, "max_rel_loss_diff"). 1e-4 leaves room for the other host's CPU (another AVX path),
# and a wrong peer (another lr, batch or init) is off by ≥ 1e-2 from the second step.
LOSS_RTOL = 1e-4

# Every 2-rank variant runs under torchrun, the Lightning ones too (Lightning takes torchrun's ranks as they are):
# torchrun starts each rank in a session of its own, and Linux's scheduler (autogroup, on by default) shares the CPU
# fairly between sessions, not threads. Ranks that Lightning's own launcher starts share rank 0's session: on a host
# loaded by other sessions they got half the CPU of torchrun's ranks, the first table's ZeRO-1 / FSDP gap (README).
# ``spawn``: Lightning's launcher instead (diagnostic). ``diagnostic`` variants run only when named with --only.
VARIANTS: dict[str, dict[str, Any]] = {
    "nxdt DP": dict(kind="lightning", strategy="nxdt"),
    "Lightning DDP (gloo)": dict(kind="lightning", strategy="ddp"),
    # plain DP with the reduction after backward (issue 35 item 2: the overlap's effect, same rounds)
    "nxdt DP, reduced after backward": dict(kind="lightning", strategy="nxdt", overlap=False, diagnostic=True),
    "nxdt ZeRO-1": dict(kind="lightning", strategy="nxdt", zero1=True),
    "nxdt ZeRO-1, ranks in one session": dict(kind="lightning", strategy="nxdt", zero1=True, spawn=True, diagnostic=True),
    # NxDStrategy's data-parallel runtime driven by a plain loop, as the DeepSpeed / FSDP2 peers are (no Trainer)
    "nxdt ZeRO-1 (plain loop)": dict(kind="torchrun", peer="nxdt", zero1=True, diagnostic=True),
    "DeepSpeed ZeRO-1": dict(kind="torchrun", peer="deepspeed", stage=1),
    # ZeRO-1 with the reduction after backward (no dp-stream work during backward)
    "nxdt ZeRO-1, reduced after backward": dict(kind="lightning", strategy="nxdt", zero1=True, overlap=False, diagnostic=True),
    "DeepSpeed ZeRO-2": dict(kind="torchrun", peer="deepspeed", stage=2, diagnostic=True),
    "nxdt FSDP token_threaded": dict(kind="lightning", strategy="nxdt", fsdp=True),
    "nxdt FSDP token_threaded (plain loop)": dict(kind="torchrun", peer="nxdt", fsdp=True, diagnostic=True),
    "torch FSDP2 fully_shard (gloo)": dict(kind="torchrun", peer="fsdp2"),
    "DeepSpeed ZeRO-3": dict(kind="torchrun", peer="deepspeed", stage=3, diagnostic=True),
    "nxdt TP2+SP": dict(kind="lightning", strategy="nxdt", tp=2),
    "torch DTensor TP2+SP (gloo)": dict(kind="torchrun", peer="dtensor", tp=2),
    "nxdt train (2 ranks)": dict(kind="cli"),
    # the default is ZeRO-1 (distributed_strategy.zero1: null resolves to on for DP2); this one keeps every rank's
    # full optimizer state and update, the default before 2026-11-30
    "nxdt train (2 ranks, zero1=false)": dict(kind="cli", zero1=False, diagnostic=True),
    "torch loop (1 process)": dict(kind="loop"),
    # the same loop importing only torch, nxdt's model and data classes and its optimizer module: no Lightning
    "torch loop (1 process, no Lightning)": dict(kind="loop", plain=True, diagnostic=True),
}
# (nxdt variant, peer variant, what is compared: step time, or wall time of the whole run)
PAIRS = [
    ("nxdt DP", "Lightning DDP (gloo)", "step"),
    ("nxdt ZeRO-1", "DeepSpeed ZeRO-1", "step"),
    # the overlap's effect: overlapped ÷ reduced after backward (below 1.0: the overlap saves time)
    ("nxdt DP", "nxdt DP, reduced after backward", "step"),
    ("nxdt ZeRO-1", "nxdt ZeRO-1, reduced after backward", "step"),
    ("nxdt ZeRO-1", "DeepSpeed ZeRO-2", "step"),
    ("nxdt ZeRO-1 (plain loop)", "DeepSpeed ZeRO-1", "step"),
    ("nxdt ZeRO-1, ranks in one session", "DeepSpeed ZeRO-1", "step"),
    ("nxdt FSDP token_threaded", "torch FSDP2 fully_shard (gloo)", "step"),
    ("nxdt FSDP token_threaded", "DeepSpeed ZeRO-3", "step"),
    ("nxdt FSDP token_threaded (plain loop)", "torch FSDP2 fully_shard (gloo)", "step"),
    ("nxdt TP2+SP", "torch DTensor TP2+SP (gloo)", "step"),
    ("nxdt train (2 ranks)", "torch loop (1 process)", "wall"),
    ("nxdt train (2 ranks, zero1=false)", "torch loop (1 process)", "wall"),
    ("nxdt train (2 ranks)", "torch loop (1 process, no Lightning)", "wall"),
    ("nxdt train (2 ranks, zero1=false)", "torch loop (1 process, no Lightning)", "wall"),
]


def compose(steps: int, tp: int = 1) -> Any:
    from nxdt.config import compose_config

    return compose_config(
        [
            *MODEL,
            "data=synthetic",
            f"data.seq_length={SEQ}",
            f"data.global_batch_size={GLOBAL_BATCH}",
            f"data.micro_batch_size={MICRO}",
            f"trainer.max_steps={steps}",
            f"trainer.devices={RANKS}",
            f"distributed_strategy.tensor_model_parallel_size={tp}",
        ]
    )


def write_rank(out: Path, rank: int, clock: "Clock", losses: list[float], phases: list | None = None) -> None:
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    import torch

    record = {
        "step_times": clock.times,
        "cpu_times": clock.cpu,
        "losses": losses,
        "peak_rss_mb": rss_mb,
        "threads": torch.get_num_threads(),  # intra-op threads at the end (every strategy variant asks for 1)
        "session": os.getsid(0),  # the scheduler's autogroup (Linux: one per session) this rank's CPU share is set by
    }
    if phases is not None:
        record["phases"] = phases
    Path(f"{out}.rank{rank}").write_text(json.dumps(record))


class Clock:
    """Wall time between consecutive step ends (the first step, which builds everything, is not an interval), and
    the CPU time the process spent in between (every thread: compute, communication threads, waiting that spins)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.last: tuple[float, float] | None = None

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        if self.last is not None:
            self.times.append(now[0] - self.last[0])
            self.cpu.append(now[1] - self.last[1])
        self.last = now


# ---------------------------------------------------------------------------------------------- Lightning variants
def run_lightning(v: dict[str, Any], steps: int, out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from nxdt.lightning import NxDStrategy
    from nxdt.lightning.datamodule import NxDDataModule
    from nxdt.lightning.module import CausalLMModule
    from nxdt.lightning.optim import build_optimizer, build_scheduler

    class DDPPeerModule(CausalLMModule):
        """The same module under Lightning's automatic optimization, as a DDP user writes it: one forward/backward
        of this rank's batch per step (its one micro-batch), DDP averaging gradients in its backward hooks."""

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.automatic_optimization = True

        def training_step(self, batch: dict, batch_idx: int) -> Any:
            loss = self.model.loss_fn(self(batch["input_ids"]), batch["labels"])
            self.step_metrics = {"step": self.trainer.global_step, "loss": float(loss.detach())}
            return loss

        def configure_optimizers(self) -> Any:
            optimizer = build_optimizer(self.model, self.model_cfg.optim)
            scheduler = build_scheduler(optimizer, self.model_cfg.optim.sched)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Record(Callback):
        def __init__(self) -> None:
            self.clock, self.losses = Clock(), []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.clock.tick()
            self.losses.append(float(module.step_metrics["loss"]))

    cfg = compose(steps, v.get("tp", 1))
    pl.seed_everything(cfg.seed, verbose=False)
    if v["strategy"] == "nxdt":
        strategy = NxDStrategy(
            tensor_parallel_size=v.get("tp", 1),
            sequence_parallel=v.get("tp", 1) > 1,
            zero1=v.get("zero1", False),
            overlap_grad_reduce=v.get("overlap", True),
            fsdp={"prefetch": "token_threaded"} if v.get("fsdp") else False,
            torch_process_group=False,  # the module needs no torch.distributed group (as under `nxdt train`)
            trace_dir=os.environ.get("PEERS_TRACE"),  # --trace: every collective of each rank as a Chrome trace
        )
        module = CausalLMModule(cfg.model, GLOBAL_BATCH, SEQ, MICRO, None)
    else:
        strategy = DDPStrategy(process_group_backend="gloo")
        module = DDPPeerModule(cfg.model, GLOBAL_BATCH, SEQ, MICRO)
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[record],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    data = NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True)
    trainer.fit(module, datamodule=data)
    write_rank(out, trainer.global_rank, record.clock, record.losses)


# ---------------------------------------------------------------------------------------------- torch / DeepSpeed peers
def rank_batches(cfg: Any, dp_rank: int, dp_size: int) -> Any:
    """This data-parallel rank's share of each global batch, as NxDStrategy's ranks read it."""
    from nxdt.lightning.datamodule import NxDDataModule

    data = NxDDataModule(cfg.data, seed=cfg.seed, vocab_size=cfg.model.vocab_size, step_batches=True)
    data.setup("fit")
    data.dp_rank, data.dp_size = dp_rank, dp_size
    return data.train_dataloader()


def micro_batches(batch: dict) -> list[tuple[Any, Any]]:
    ids, labels = batch["input_ids"], batch["labels"]
    return [(ids[i : i + MICRO], labels[i : i + MICRO]) for i in range(0, ids.shape[0], MICRO)]


def build_model(cfg: Any) -> Any:
    import torch

    from nxdt.lightning.module import import_architecture

    torch.manual_seed(cfg.seed)  # what pl.seed_everything(seed) does to torch before CausalLMModule builds its model
    return import_architecture(cfg.model.architecture)(cfg.model)


def run_torchrun(v: dict[str, Any], steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from nxdt.lightning.optim import build_optimizer, build_scheduler

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp = v.get("tp", 1)
    cfg = compose(steps, tp)
    model = build_model(cfg)
    clock, losses = Clock(), []
    batches = rank_batches(cfg, rank // tp, world // tp)
    if v["peer"] == "nxdt":
        return run_nxdt_loop(v, cfg, model, batches, steps, out, rank, world)
    if v["peer"] == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=build_optimizer(model, cfg.model.optim),
            lr_scheduler=lambda opt: build_scheduler(opt, cfg.model.optim.sched),
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_accumulation_steps": GLOBAL_BATCH // (MICRO * world),
                "zero_optimization": {"stage": v["stage"]},
                "zero_allow_untested_optimizer": True,  # torch's AdamW with nxdt's groups, as the other variants
                "gradient_clipping": 0.0,  # DeepSpeed 0.19's default is 1.0; the strategy pairs do not clip
                "steps_per_print": 10**9,
            },
        )
        for _, batch in zip(range(steps), batches):
            total = 0.0
            for ids, labels in micro_batches(batch):
                loss = model.loss_fn(engine(ids), labels)
                engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps inside
                engine.step()  # an optimizer step at the accumulation boundary only
                total += float(loss.detach())
            losses.append(total / len(micro_batches(batch)))
            clock.tick()
    else:
        dist.init_process_group("gloo")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        if v["peer"] == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            dtensor_tensor_parallel(model, mesh)
        optimizer = build_optimizer(model, cfg.model.optim)
        scheduler = build_scheduler(optimizer, cfg.model.optim.sched)
        for _, batch in zip(range(steps), batches):
            parts, total = micro_batches(batch), 0.0
            for ids, labels in parts:
                loss = model.loss_fn(model(ids), labels) / len(parts)
                loss.backward()
                total += float(loss.detach())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(total)
            clock.tick()
    write_rank(out, rank, clock, losses)
    dist.destroy_process_group()


class Phases:
    """Per-step wall time of each phase of a plain-loop step on this rank (perf_counter marks between phases)."""

    def __init__(self, tracer: Any = None) -> None:
        self.steps: list[dict[str, float]] = []
        self.now = time.perf_counter()
        self.tracer = tracer  # each phase also as a trace event (row "step"), next to the collectives

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        if self.tracer is not None:
            self.tracer.add(phase, "step", self.now, now)
        if not self.steps:
            self.steps.append({})
        self.steps[-1][phase] = self.steps[-1].get(phase, 0.0) + now - self.now
        self.now = now

    def next_step(self) -> None:
        self.steps.append({})


def run_nxdt_loop(v: dict[str, Any], cfg: Any, model: Any, batches: Any, steps: int, out: Path, rank: int, world: int) -> None:
    """NxDStrategy's parallel pieces without the Trainer: the strategy's world and groups
    (``nxdt.lightning.environment``), its data-parallel runtime (``nxdt.parallel.data_parallel``) called in the order
    NxDStrategy.setup / CausalLMModule.training_step call it (broadcast, shard the optimizer, shard the model; per step
    arm the last backward, forward/backward, finish the gradients, step), in a loop like the torch / DeepSpeed peers'.
    The one thing CausalLMModule adds per step and this loop leaves out is its two small all-reduces (the labelled
    token count for the loss weights, the logged mean loss): the peers do neither (every micro-batch here is full, so
    the weights are the plain mean's). Each rank also records the wall time of each phase, and its collectives as
    nxdt trace events (``--trace DIR``)."""
    from torch import nn

    import nxdt.comm
    from nxdt.lightning import environment
    from nxdt.lightning.optim import build_optimizer, build_scheduler
    from nxdt.parallel.data_parallel import data_parallel_runtime
    from nxdt.parallel.parallelize import Parallelized, model_parallel
    from nxdt.planner import Dim

    nx_world = environment.join_world(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s=120)
    degrees = {Dim.TP: 1, Dim.PP: 1, Dim.CP: 1, Dim.EP: 1}
    plan = environment.run_plan(None, world, degrees=degrees, order="tp-cp-ep-dp-pp", ranks_per_node=world, num_nodes=1)
    comms = environment.open_groups(nx_world, plan, links={}, choice={"transport": "auto", "algorithm": "auto"})
    tracer = nxdt.comm.Tracer(rank) if os.environ.get("PEERS_TRACE") else None
    nx_world.set_tracer(tracer)
    holder = nn.Module()  # what the runtime reads: a module whose ``model`` is the hub model (as CausalLMModule)
    holder.model = model
    dp = data_parallel_runtime(zero1=v.get("zero1", False), fsdp={"prefetch": "token_threaded"} if v.get("fsdp") else False)
    dp.bind(model_parallel(comms, Parallelized()))
    dp.broadcast_parameters(holder)
    optimizer = dp.shard_optimizer(build_optimizer(model, cfg.model.optim), holder)
    scheduler = build_scheduler(optimizer, cfg.model.optim.sched)
    dp.shard_model(holder, [optimizer], tracer=tracer)
    clock, losses, phases = Clock(), [], Phases(tracer)
    for _, batch in zip(range(steps), batches):
        phases.next_step()
        optimizer.zero_grad()
        parts, total = micro_batches(batch), 0.0
        for i, (ids, labels) in enumerate(parts):
            dp.before_backward(i == len(parts) - 1)
            phases.mark("other")
            loss = model.loss_fn(model(ids), labels) / len(parts)
            phases.mark("forward")
            loss.backward()
            phases.mark("backward")
            total += float(loss.detach())
        dp.finish_gradients(holder, optimizer)
        phases.mark("finish_gradients")
        optimizer.step()
        phases.mark("optimizer_step")
        dp.after_step(optimizer)
        scheduler.step()
        phases.mark("other")
        # FSDP: the time compute waited for its gathers / reduce-scatters (exposed_comm_s) and the collectives ran
        phases.steps[-1].update({k: v for k, v in dp.step_stats().items() if k in ("exposed_comm_s", "comm_s")})
        losses.append(total)
        clock.tick()
    write_rank(out, rank, clock, losses, phases=phases.steps)
    if tracer is not None:
        tracer.write(Path(os.environ["PEERS_TRACE"]) / f"rank{rank}.json")
    nx_world.close()


def dtensor_tensor_parallel(model: Any, mesh: Any) -> None:
    """torchtitan's Llama TP+SP plan (torchtitan/models/llama3/infra/parallelize.py, apply_tp) on the hub Llama:
    the embedding's output and the residual stream sharded along the sequence, the norms SequenceParallel, attention
    and MLP inputs gathered (PrepareModuleInput), q/k/v and gate/up column-wise, o/down row-wise back to sequence
    shards. The head gathers full logits (vocabulary 256: the loss is the plain one; nxdt shards it instead)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "input_layernorm": SequenceParallel(),
                # Attention(x, cos, sin, segment_ids, cache): only x is a distributed tensor
                "self_attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None, None),
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


# ---------------------------------------------------------------------------------------------- nxdt train vs a loop
def lightning_free_recipe(cfg: Any) -> tuple[Any, Any, Any]:
    """The loop's model, batches and optimizer module without importing Lightning (which ``nxdt.lightning``'s package
    pulls in: ~9 CPU-s of a start-up on this host): the model class by its dotted path, the synthetic batches as
    NxDDataModule builds them for one rank (``SyntheticTokens`` + ``GlobalBatchSampler``), and nxdt/lightning/optim.py
    loaded by its file path (it imports no Lightning itself). The pair's loss check proves it is the same recipe."""
    import importlib
    import importlib.util

    import torch
    from torch.utils.data import DataLoader

    from nxdt.data.datasets import SyntheticTokens
    from nxdt.data.sampler import GlobalBatchSampler

    module_name, _, class_name = cfg.model.architecture.rpartition(".")
    torch.manual_seed(cfg.seed)
    model = getattr(importlib.import_module(module_name), class_name)(cfg.model)
    data = SyntheticTokens(cfg.data.num_samples, cfg.data.seq_length, cfg.model.vocab_size, cfg.seed)
    batch = cfg.data.global_batch_size
    sampler = GlobalBatchSampler(len(data), batch, batch, dp_rank=0, dp_size=1, consumed_samples=0, seed=cfg.seed, shuffle=True)
    spec = importlib.util.spec_from_file_location("peers_optim", HERE.parents[1] / "nxdt" / "lightning" / "optim.py")
    assert spec is not None and spec.loader is not None
    optim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(optim)
    return model, DataLoader(data, batch_sampler=sampler, num_workers=0), optim


def run_loop(steps: int, out: Path, plain: bool = False) -> None:
    """The tutorial loop: one process, torch's default threads, the whole global batch at once, clipping 1.0
    (``plain``: without importing Lightning, :func:`lightning_free_recipe`)."""
    import torch

    cfg = compose(steps)
    if plain:
        model, batches, optim = lightning_free_recipe(cfg)
        build_optimizer, build_scheduler = optim.build_optimizer, optim.build_scheduler
        assert "lightning" not in sys.modules, "the Lightning-free loop imported Lightning"
    else:
        from nxdt.lightning.optim import build_optimizer, build_scheduler

        model, batches = build_model(cfg), rank_batches(cfg, 0, 1)
    optimizer = build_optimizer(model, cfg.model.optim)
    scheduler = build_scheduler(optimizer, cfg.model.optim.sched)
    clock, losses = Clock(), []
    for _, batch in zip(range(steps), batches):
        loss = model.loss_fn(model(batch["input_ids"]), batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        clock.tick()
    write_rank(out, 0, clock, losses)


def cli_overrides(steps: int, run_dir: Path) -> list[str]:
    return [
        *MODEL,
        "data=synthetic",
        f"data.seq_length={SEQ}",
        f"data.global_batch_size={GLOBAL_BATCH}",
        f"data.micro_batch_size={MICRO}",
        f"trainer.devices={RANKS}",
        f"trainer.max_steps={steps}",
        "exp_manager.create_tensorboard_logger=false",
        "exp_manager.save_last=false",
        f"exp_manager.explicit_log_dir={run_dir}",
    ]


def read_metrics(run_dir: Path) -> dict[str, Any]:
    rows = list(csv.DictReader(open(run_dir / "metrics.csv", newline="")))
    return {
        "step_times": [float(r["step_time_s"]) for r in rows[1:]],
        "losses": [float(r["loss"]) for r in rows],
        "peak_rss_mb": [max(float(r["peak_rss_mb"]) for r in rows)],  # rank 0's (metrics.csv is rank 0's)
    }


# ---------------------------------------------------------------------------------------------- the driver
def launch(name: str, steps: int, work: Path, deepspeed_path: str | None, trace: Path | None = None) -> dict[str, Any]:
    """One variant as its own process tree; its per-rank results merged (losses averaged over ranks: each rank's is
    its own data-parallel share's mean, and the shares hold equal token counts)."""
    v = VARIANTS[name]
    out = work / f"run-{abs(hash(name))}"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        env["PEERS_TRACE"] = str(trace.resolve())
    me = [str(Path(__file__).resolve()), "--variant", name, "--steps", str(steps), "--out", str(out)]
    if v["kind"] == "lightning" and v.get("spawn"):
        cmd = [sys.executable, *me]
    elif v["kind"] in ("torchrun", "lightning"):
        if v.get("peer") == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"
            if deepspeed_path:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [deepspeed_path, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS), *me]
    elif v["kind"] == "loop":
        env.pop("OMP_NUM_THREADS")  # torch's default: every core, as a tutorial's loop runs
        cmd = [sys.executable, *me]
    else:
        run_dir = work / f"cli-{time.monotonic_ns()}"
        zero1 = [f"distributed_strategy.zero1={str(v['zero1']).lower()}"] if "zero1" in v else []
        cmd = [sys.executable, "-m", "nxdt.cli", "train", *cli_overrides(steps, run_dir), *zero1]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"variant {name!r} failed:\n{proc.stderr[-4000:]}")
    if v["kind"] == "cli":
        return {**read_metrics(run_dir), "wall_s": wall}
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob(out.name + ".rank*"))]
    for p in work.glob(out.name + ".rank*"):
        p.unlink()
    return {
        "step_times": ranks[0]["step_times"],
        "cpu_times": [r["cpu_times"] for r in ranks],
        "losses": [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks))],
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "wall_s": wall,
        **({"phases": [r["phases"] for r in ranks]} if "phases" in ranks[0] else {}),
        "sessions": [r.get("session") for r in ranks],
    }


def deepspeed_available(path: str | None) -> str | None:
    """None when DeepSpeed imports (in a child, as its rows will run), else the reason."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"], env=env, capture_output=True, text=True
    )
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"DeepSpeed is not importable ({last}); pip install deepspeed in a scratch venv and pass --deepspeed-path"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help="steps per strategy run (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="step intervals skipped per run (default 3)")
    parser.add_argument("--wall-steps", type=int, default=20, help="steps of the nxdt train / loop pair (default 20)")
    parser.add_argument("--reps", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--quick", action="store_true", help="1 round of 6 steps: checks every variant runs")
    parser.add_argument(
        "--no-warm-up", dest="warm_up", action="store_false", help="skip the unrecorded warm-up launch of each variant"
    )
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), help="run these variants only")
    parser.add_argument("--deepspeed-path", help="a site-packages directory with DeepSpeed (not an nxdt dependency)")
    parser.add_argument("--json", type=Path, default=HERE / "results.json")
    parser.add_argument(
        "--trace", type=Path, help="nxdt variants: each rank's collectives as Chrome traces under DIR/<variant>/<round>/"
    )
    args = parser.parse_args()
    if args.variant:
        v = VARIANTS[args.variant]
        if v["kind"] == "lightning":
            return run_lightning(v, args.steps, args.out)
        if v["kind"] == "torchrun":
            return run_torchrun(v, args.steps, args.out)
        return run_loop(args.steps, args.out, plain=v.get("plain", False))
    if args.quick:
        args.steps, args.warmup, args.wall_steps, args.reps, args.warm_up = 6, 2, 6, 1, False
    names = args.only or [n for n, v in VARIANTS.items() if not v.get("diagnostic")]
    skipped = {}
    if any(VARIANTS[n].get("peer") == "deepspeed" for n in names):
        reason = deepspeed_available(args.deepspeed_path)
        if reason:
            print(f"skipping the DeepSpeed rows: {reason}", flush=True)
            skipped = {n: reason for n in names if VARIANTS[n].get("peer") == "deepspeed"}
            names = [n for n in names if n not in skipped]
    results: dict[str, Any] = {
        "model": MODEL,
        "seq": SEQ,
        "global_batch": GLOBAL_BATCH,
        "micro_batch": MICRO,
        "steps": args.steps,
        "wall_steps": args.wall_steps,
        "warmup": args.warmup,
        "reps": args.reps,
        "warm_up_launches": args.warm_up,
        "skipped": skipped,
        "uptime": [],
        "runs": {n: [] for n in names},
    }
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.warm_up:
            # One unrecorded launch of each variant first: the first launch after a pause reads torch's and Lightning's
            # files from disk, and the rotation would otherwise always hand that cost to the first-named variant.
            for name in names:
                launch(name, 2, work, args.deepspeed_path)
                print(f"  warm-up launch {name} done", flush=True)
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]  # rotated: slow phases hit every variant
            for name in order:
                load = os.getloadavg()[0]
                steps = args.wall_steps if VARIANTS[name]["kind"] in ("cli", "loop") else args.steps
                trace = args.trace / name.replace(" ", "_") / str(rep) if args.trace else None
                run = launch(name, steps, work, args.deepspeed_path, trace)
                run["load_before"] = load
                results["runs"][name].append(run)
                print(
                    f"  round {rep + 1}/{args.reps} {name:<32} wall {run['wall_s']:6.1f} s, median step "
                    f"{statistics.median(run['step_times'][args.warmup :] or run['step_times']) * 1e3:7.1f} ms, "
                    f"last loss {run['losses'][-1]:.5f} (load {load:.1f})",
                    flush=True,
                )
            results["uptime"].append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    results["wall_s"] = time.time() - started
    results["table"] = table(results, args.warmup)
    args.json.write_text(json.dumps(results, indent=1))
    print_table(results)
    plot(results, args.json.with_suffix(".png") if args.json.name != "results.json" else HERE / "plot.png")
    bad = [f"{r['nxdt']} vs {r['peer']}: {r['max_rel_loss_diff']:.2e}" for r in results["table"] if not r["equal_loss"]]
    if bad:
        raise SystemExit("losses differ beyond LOSS_RTOL=%g (not equal work): %s" % (LOSS_RTOL, "; ".join(bad)))


def figure(runs: list[dict], how: str, warmup: int) -> float:
    """A variant's figure over its rounds: the median step (steps after the warm-up, all rounds pooled), or the
    median wall time of its runs."""
    if how == "wall":
        return statistics.median(r["wall_s"] for r in runs)
    return statistics.median(t for r in runs for t in r["step_times"][warmup:])


def cpu_figure(runs: list[dict], warmup: int) -> float | None:
    """CPU seconds per step and rank (every thread of the process), median over the steps after the warm-up."""
    got = [t for r in runs for rank in r.get("cpu_times", []) for t in rank[warmup:]]
    return statistics.median(got) if got else None


def table(results: dict, warmup: int) -> list[dict]:
    rows = []
    runs = results["runs"]
    for ours, peer, how in PAIRS:
        if ours not in runs or peer not in runs:
            continue
        a, b = figure(runs[ours], how, warmup), figure(runs[peer], how, warmup)
        # per round: the ratio of the two runs of that round (same minutes of the host)
        per_round = [figure([x], how, warmup) / figure([y], how, warmup) for x, y in zip(runs[ours], runs[peer])]
        la, lb = runs[ours][0]["losses"], runs[peer][0]["losses"]
        diff = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
        rows.append(
            {
                "nxdt": ours,
                "peer": peer,
                "figure": "wall time of the run (s)" if how == "wall" else "median step (ms)",
                "nxdt_value": a,
                "peer_value": b,
                "ratio": a / b,
                "round_ratios": per_round,
                "nxdt_cpu_s": cpu_figure(runs[ours], warmup) if how == "step" else None,
                "peer_cpu_s": cpu_figure(runs[peer], warmup) if how == "step" else None,
                "nxdt_rss_mb": max(max(r["peak_rss_mb"]) for r in runs[ours]),
                "peer_rss_mb": max(max(r["peak_rss_mb"]) for r in runs[peer]),
                "nxdt_loss": la[-1],
                "peer_loss": lb[-1],
                "max_rel_loss_diff": diff,
                "equal_loss": diff <= LOSS_RTOL and len(la) == len(lb),
            }
        )
    return rows


def print_table(results: dict) -> None:
    print(f"\nhost load: {results['uptime']}")
    for k, v in results["skipped"].items():
        print(f"skipped {k}: {v}")
    print(
        "| nxdt | peer | figure | nxdt | peer | ratio | round ratios | CPU s/step/rank nxdt / peer "
        "| peak RSS/rank nxdt / peer (MB) | last loss nxdt / peer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["table"]:
        cpu = f"{r['nxdt_cpu_s']:.3f} / {r['peer_cpu_s']:.3f}" if r.get("nxdt_cpu_s") and r.get("peer_cpu_s") else "—"
        scale = 1e3 if r["figure"].startswith("median step") else 1
        print(
            f"| {r['nxdt']} | {r['peer']} | {r['figure']} | {r['nxdt_value'] * scale:.1f} | {r['peer_value'] * scale:.1f} "
            f"| **{r['ratio']:.3f}** | {' '.join(f'{x:.3f}' for x in r['round_ratios'])} | {cpu} "
            f"| {r['nxdt_rss_mb']:.0f} / {r['peer_rss_mb']:.0f} | {r['nxdt_loss']:.5f} / {r['peer_loss']:.5f} "
            f"(max rel. diff {r['max_rel_loss_diff']:.1e}) |"
        )


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["table"]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['nxdt']}\nvs {r['peer']}" for r in rows]
    y = range(len(rows))
    axes[0].barh(list(y), [r["ratio"] for r in rows], color=["C2" if r["ratio"] <= 1 else "C3" for r in rows])
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set_yticks(list(y), labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("nxdt time / peer time (step; last row: whole run)")
    axes[1].barh([i - 0.2 for i in y], [r["nxdt_rss_mb"] for r in rows], 0.4, label="nxdt")
    axes[1].barh([i + 0.2 for i in y], [r["peer_rss_mb"] for r in rows], 0.4, label="peer")
    axes[1].set_yticks(list(y), [""] * len(rows))
    axes[1].invert_yaxis()
    axes[1].set_xlabel("peak RSS per rank (MB)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"2 CPU ranks, interleaved rounds; host load {os.getloadavg()[0]:.1f} at the end", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
