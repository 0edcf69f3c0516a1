"""The device policy and the GPU seams, checked on a CPU host (issue 37): which device each rank gets, the formats and
kernels per device, which transport a communicator takes for which tensors, what a p5.48xlarge dry run prints, and
the one-line refusal of a GPU instance on a host without CUDA. Nothing here needs a GPU (tests/gpu/ does)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from nxdt.comm.transport import transport_name
from nxdt.comm.world import _flat
from nxdt.config import compose_config
from nxdt.config.validate import ConfigError
from nxdt.launch.cluster import describe_local
from nxdt.launch.devices import device_lines, resolve_accelerator
from nxdt.lightning.optim import build_optimizer, decayed_rate, parameter_groups
from nxdt.lightning.strategy import NxDStrategy
from nxdt.lightning.train import rank_devices
from nxdt.parallel.devices import (
    adamw_options,
    device_index,
    export_worker_environment,
    node_devices,
    policy_for,
    sdpa_backends,
    worker_environment,
)
from nxdt.planner import plan

P5_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1", "NCCL_P2P_PXN_LEVEL": "2"}


def test_one_rank_per_gpu_follows_the_planner_and_neighbours_share_when_ranks_outnumber_gpus():
    assert node_devices("cuda", 8, 8) == [f"cuda:{i}" for i in range(8)]
    assert node_devices("cuda", 2, 1) == ["cuda:0", "cuda:0"]
    assert node_devices("cuda", 3, 2) == ["cuda:0", "cuda:0", "cuda:1"]
    assert node_devices("cuda", 16, 8)[:4] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert node_devices("cpu", 4, 0) == ["cpu"] * 4
    # the catalogue's GPU instances: the device a rank gets is the one the plan placed it on
    p = plan(compose_config(["instance=p5.48xlarge", "trainer.devices=4"]))
    assert [f"cuda:{p.place(r)['device']}" for r in range(4)] == node_devices("cuda", 4, 8)
    with pytest.raises(ValueError, match="no GPU"):
        device_index(0, 1, 0)


@pytest.mark.parametrize(
    "precision, params, autocast",
    [
        ("fp32", torch.float32, None),
        ("bf16", torch.bfloat16, None),
        ("bf16SR", torch.bfloat16, None),
        ("mixed_precision", torch.float32, torch.bfloat16),  # fp32 master weights, bf16 compute
        ("mixed_precisionSR", torch.float32, torch.bfloat16),
    ],
)
def test_formats_follow_precision_type_on_either_device(precision, params, autocast):
    for accelerator in ("cpu", "cuda"):
        policy = policy_for(accelerator, 0, 1, 1, precision)
        assert (policy.param_dtype, policy.autocast_dtype) == (params, autocast)


def test_kernels_per_device():
    cpu, gpu = policy_for("cpu", 0, 2, 0), policy_for("cuda", 1, 2, 2)
    assert (cpu.device, gpu.device, gpu.torch_device) == ("cpu", "cuda:1", torch.device("cuda", 1))
    assert cpu.adamw_options() == adamw_options("cpu") == gpu.adamw_options() == {"fused": True}
    assert cpu.sdpa_backends == sdpa_backends("cpu", True) == ()  # torch's own choice on the CPU
    assert gpu.sdpa_backends == ()  # fp32: flash and cuDNN take no fp32; torch picks (GQA may need the math kernel)
    bf16 = policy_for("cuda", 0, 1, 1, "mixed_precision")
    assert bf16.half and "MATH" not in bf16.sdpa_backends and "FLASH_ATTENTION" in bf16.sdpa_backends
    with pytest.raises(ValueError, match="instance.accelerator='tpu'"):
        policy_for("tpu", 0, 1, 1)


def test_cpu_optimizer_is_the_fused_kernel_and_equals_the_loop_within_its_rounding():
    """The CPU AdamW is torch's fused kernel (Hugging Face Trainer's default, transformers/training_args.py:
    ``default_optim = "adamw_torch_fused"`` for torch >= 2.8), and its steps equal torch's per-parameter loop (torch's
    CPU default) up to rounding. Bound: both evaluate the same formula in fp32 in another operation order, so each step
    may leave a parameter one rounding of its own size apart (2^-24 |p| for the final add, the update itself being
    computed to a few 2^-24 of its size, which is below lr); over k steps with fixed gradients the gaps add (the decay
    factor 1 - lr*wd < 1 only shrinks them): |fused - loop| <= k * 2^-23 * (|p| + lr). A wrong moment, bias correction
    or decay would be off by a sizeable fraction of lr at the first step."""
    optim = compose_config(["model.optim.weight_decay=0.1"]).model.optim
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 32))
    loop_model = copy.deepcopy(model)
    start = copy.deepcopy(model)
    fused = build_optimizer(model, optim)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    loop = torch.optim.AdamW(
        parameter_groups(loop_model, decayed_rate(optim)), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, foreach=False
    )
    generator = torch.Generator().manual_seed(1)
    steps = 4
    for _ in range(steps):
        for p, q in zip(model.parameters(), loop_model.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        fused.step()
        loop.step()
    for p, q, p0 in zip(model.parameters(), loop_model.parameters(), start.parameters(), strict=True):
        assert ((p - p0).abs().max() > optim.lr / 2).item()  # AdamW moves each tensor by ~lr a step: the steps ran
        bound = steps * 2.0**-23 * (q.detach().abs() + optim.lr)
        assert ((p - q).abs() <= bound).all(), (p - q).abs().max()


def test_instance_env_fills_what_the_environment_lacks():
    env = {"FI_PROVIDER": "tcp"}
    assert worker_environment(P5_ENV, env) == {k: v for k, v in P5_ENV.items() if k != "FI_PROVIDER"}
    assert export_worker_environment(P5_ENV, env)["NCCL_P2P_PXN_LEVEL"] == "2"
    assert env["FI_PROVIDER"] == "tcp"  # the user's own value wins


def test_transport_per_device_and_placement():
    one, two = ["a", "a"], ["a", "b"]
    assert transport_name("cpu", "auto", one) == "shm"
    assert transport_name("cpu", "auto", two) == "p2p"
    assert transport_name("cpu", "gloo", one) == "gloo"
    # CUDA tensors take NCCL whatever comm.transport chose for the CPU; members sharing a GPU (NCCL refuses them) stage
    assert transport_name("cuda", "shm", one, ["a/0", "a/1"]) == "nccl"
    assert transport_name("cuda", "auto", two, ["a/0", "b/0"]) == "nccl"
    assert transport_name("cuda", "auto", one, ["a/0", "a/0"]) == "cuda_ipc"
    with pytest.raises(ValueError, match="tensors on mps have no transport"):
        transport_name("mps", "auto", one)
    with pytest.raises(ValueError, match="nxdt.comm works on CPU tensors and on cuda tensors"):
        _flat(torch.empty(2, device="meta"), "all_reduce tensor")


def test_strategy_root_device_is_the_ranks_entry():
    assert NxDStrategy().root_device == torch.device("cpu")
    shared = NxDStrategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 0)])
    assert shared.root_device == torch.device("cuda", 0)


def test_trainer_devices_cpu_unchanged_gpu_per_rank():
    cpu = compose_config([])
    assert rank_devices(cpu, plan(cpu), 0) is None  # Lightning's CPU accelerator, as before
    p5 = compose_config(["instance=p5.48xlarge"])
    assert rank_devices(p5, plan(p5), 8) == [torch.device("cuda", i) for i in range(8)]


def test_p5_dry_run_shows_every_ranks_device_and_the_nccl_settings(tmp_path):
    cfg = compose_config(["instance=p5.48xlarge", f"exp_manager.exp_dir={tmp_path}", "launcher.dry_run=true"])
    text = describe_local(cfg, plan(cfg), console_tty=False)
    devices = next(line for line in text.splitlines() if line.startswith("devices: "))
    assert all(f"rank {r} → cuda:{r}" in devices for r in range(8))
    env = next(line for line in text.splitlines() if line.startswith("NCCL/EFA environment"))
    # each setting exported, or named as kept where this environment sets it already
    assert all(f"{k}={v}" in env or (k in os.environ and k in env.partition("kept")[2]) for k, v in P5_ENV.items())
    assert not device_lines(compose_config([]), 2)  # a CPU run's dry run is as before


def test_dry_run_flag_is_the_launcher_key_and_starts_nothing(tmp_path, monkeypatch, capsys):
    """``nxdt train instance=p5.48xlarge --dry-run`` (the flag other launchers spell it with) prints what
    ``launcher.dry_run=true`` prints — every rank's GPU and the NCCL settings — on a host without GPUs, and starts
    nothing; an unknown flag is still one line."""
    from nxdt.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "instance=p5.48xlarge", "--dry-run"]) == 0
    flag = capsys.readouterr().out
    assert "dry run — nothing started" in flag and "rank 7 → cuda:7" in flag and "NCCL/EFA environment" in flag
    assert cli_main(["train", "instance=p5.48xlarge", "launcher.dry_run=true"]) == 0
    key = capsys.readouterr().out

    def same(text: str) -> list[str]:  # the run directory's name carries the second it was chosen
        return [line.split(" run directory ")[0] for line in text.splitlines() if "/outputs/" not in line]

    assert same(flag) == same(key)
    assert not (tmp_path / "outputs").exists()
    assert cli_main(["train", "--dry-runs"]) == 2
    assert "unknown option '--dry-runs'" in capsys.readouterr().err


def test_slurm_job_of_a_gpu_instance_asks_for_its_gpus_and_shows_each_nodes_devices(tmp_path, monkeypatch, capsys):
    """A GPU job on Slurm asks for the GPUs it places ranks on (where Slurm manages GPUs as a generic resource, a job
    that asks for none sees none); ``launcher.gpus_per_node`` sets another count, 0 leaves the option out; the dry run
    shows each node's local ranks on their GPUs and the NCCL settings, as a local dry run does."""
    from nxdt.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    job = ["train", "instance=p4d.24xlarge", "trainer.num_nodes=2", "launcher=slurm", "--dry-run"]
    assert cli_main(job) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --gpus-per-node=8\n" in out
    assert "devices: local rank 0 → cuda:0" in out and "local rank 7 → cuda:7" in out and "NCCL/EFA environment" in out
    assert cli_main([*job, "launcher.gpus_per_node=0"]) == 0
    assert "--gpus-per-node" not in capsys.readouterr().out
    assert cli_main([*job, "launcher.gpus_per_node=4"]) == 0
    assert "#SBATCH --gpus-per-node=4\n" in capsys.readouterr().out
    assert cli_main([*job, "launcher.gpus_per_node=-1"]) == 2
    assert "launcher.gpus_per_node=-1: must be >= 0" in capsys.readouterr().err
    assert cli_main(["train", "trainer.num_nodes=2", "launcher=slurm", "--dry-run"]) == 0  # a CPU job asks for none
    assert "--gpus-per-node" not in capsys.readouterr().out
    assert not (tmp_path / "outputs").exists()


def test_gpu_instance_without_cuda_is_one_line_before_anything_starts():
    cfg = compose_config(["instance=gpu"])
    with pytest.raises(ConfigError) as err:
        resolve_accelerator(cfg, 0, runs_here=True)
    assert str(err.value).startswith("config error: instance='gpu': ") and "instance=cpu" in str(err.value)
    assert "\n" not in str(err.value)
    resolve_accelerator(cfg, 0, runs_here=False)  # a dry run or a submission shows the plan
    resolve_accelerator(cfg, 4, runs_here=True)
    assert cfg.instance.devices == 4  # instance=gpu: the GPUs found
    p5 = compose_config(["instance=p5.48xlarge"])
    with pytest.raises(ConfigError, match=r"instance.devices=8: p5.48xlarge places 8 ranks on 8 GPUs, but this host has 2"):
        resolve_accelerator(p5, 2, runs_here=True)


def test_plain_loop_peer_runs_on_cpu_tiny(tmp_path):
    """experiments/gpu/plain_loop.py (the plain PyTorch peer check.sh times against nxdt on a GPU) trains the model
    the planner counts, from the loss of a uniform guess, on the CPU at the tiny size; --profile writes steps 8-10's
    report in nxdt's own format."""
    import importlib.util
    import math
    from pathlib import Path

    from nxdt.planner.estimate import model_numbers

    path = Path(__file__).resolve().parents[1] / "experiments" / "gpu" / "plain_loop.py"
    spec = importlib.util.spec_from_file_location("plain_loop", path)
    assert spec is not None and spec.loader is not None
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    out = loop.train(loop.TINY, device="cpu", steps=10, warmup=1, precision="fp32", profile=str(tmp_path / "plain"))
    assert out["parameters"] == model_numbers(compose_config(loop.TINY).model)["total"]
    # normal(0, 0.02) weights give near-uniform logits over the 256 byte tokens at step 1
    assert out["losses"][0] == pytest.approx(math.log(256), abs=0.05)
    assert out["adamw"] == {"fused": True} and out["tokens_per_s"] > 0
    report = (tmp_path / "plain.txt").read_text()
    assert report.startswith("plain loop, steps 8-10 (cpu): ") and "aten::" in report
    assert (tmp_path / "plain.json").stat().st_size > 0


def test_host_memory_check_leaves_gpu_state_to_the_gpu():
    """A GPU run keeps its weights, gradients and optimizer state in GPU memory: the host-memory refusal (right for
    CPU workers) must not stop it. 70 B parameters: ~1.1 TB of training state, beyond any host this suite runs on."""
    from nxdt.cli import _check_model_fits, host_available_bytes

    big = ["model=llama3_70b", "trainer.devices=1"]
    _check_model_fits(compose_config(["instance=gpu", *big]))  # nothing raised
    if host_available_bytes():  # a host that reports MemAvailable refuses the same model on CPU workers
        with pytest.raises(ConfigError, match="training state takes"):
            _check_model_fits(compose_config(["instance=cpu", *big]))


def test_lightning_precision_and_the_policy_agree_on_every_format():
    """train.py hands Lightning a precision string per precision.type; the policy (what the plain loop and the GPU
    checks use) must describe the same formats: autocast iff Lightning's '-mixed', bf16 compute iff 'bf16'."""
    from nxdt.lightning.train import PRECISION

    for kind, lightning in PRECISION.items():
        policy = policy_for("cuda", 0, 1, 1, kind)
        assert (policy.autocast_dtype is not None) == lightning.endswith("-mixed"), kind
        assert policy.half == lightning.startswith("bf16"), kind


def test_reductions_on_device_tensors_take_the_torch_path():
    """nxdt.comm's native kernels read host addresses: a reduction over device tensors (the CUDA IPC transport
    reduces its members' GPU buffers with reduce_into) must take the torch path, whose bits the CPU's equal."""
    from nxdt.comm.reduce import reduce_into

    parts = [torch.empty(8, device="meta") for _ in range(3)]
    out = torch.empty(8, device="meta")
    reduce_into(out, parts, "sum", 3)  # the native kernel would dereference meta's null data pointers
    half = [torch.empty(8, device="meta", dtype=torch.bfloat16) for _ in range(2)]
    reduce_into(torch.empty(8, device="meta", dtype=torch.bfloat16), half, "avg", 2)
