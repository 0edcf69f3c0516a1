"""Device placement without a GPU: every objective's one-rank run (``run_training``, loggers and callbacks included)
under :class:`~accelerator_emulation.EmulatedAccelerator`, which refuses what CUDA refuses — a host batch into a device
model, a host vector in a device op, a device value added into a host accumulator, ``cat`` of both. These are the
mistakes only a GPU run showed before (DPO's reference pass and GRPO's scoring batch were built in host memory: the
H200 check of 2026-11-30 failed on them, this test fails the same way without their fixes); then two ranks under
torchrun (``emulated_ranks.py``) for the layouts' own device code. The rules themselves are checked first, against
what CUDA does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelerator_emulation import EMULATED, DeviceMixError, EmulatedAccelerator

pytestmark = pytest.mark.timeout(180)


def test_the_emulation_refuses_what_cuda_refuses_and_allows_what_it_allows():
    mode = EmulatedAccelerator()
    with mode:
        device = torch.arange(4.0, device=EMULATED)
        host = torch.ones(4)
        scalar = torch.tensor(2.0)  # a host 0-d tensor: CUDA takes it as an operand
        assert device.device == EMULATED and host.device == torch.device("cpu")
        assert mode.place(device * scalar) == "device" and mode.place(torch.zeros(2, device=device.device)) == "device"
        for refused in (
            lambda: device + host,  # "Expected all tensors to be on the same device"
            lambda: scalar.add_(device.sum()),  # a device value into a host accumulator
            lambda: torch.cat([device, host]),
            lambda: torch.stack([device.sum(), scalar]),  # cat/stack take no host scalar
            lambda: host[device.long()],
            lambda: torch.nn.functional.embedding(host.long(), torch.zeros(8, 2, device=EMULATED)),
        ):
            with pytest.raises(DeviceMixError):
                refused()
        moved = device.cpu()  # an explicit copy to the host, and back
        assert mode.place(moved) == "host" and mode.place(moved.to(EMULATED)) == "device"
        assert mode.place(device) == "device"  # .cpu() of it was a copy, not the tensor itself
        host.copy_(device)  # copies cross devices
        host[:2] = device[:2]
        assert float(device[host.long()].sum()) == 6.0  # a device tensor indexed by host indices
        layer = torch.nn.Linear(4, 1).to(EMULATED)
        layer(device).sum().backward()
        assert mode.place(layer.weight) == "device" and mode.place(layer.weight.grad) == "device"
        with pytest.raises(DeviceMixError):
            layer.weight.grad + torch.ones(1, 4)
    assert mode.checked > 0


TINY = ["model.num_layers=1", "trainer.devices=1", "trainer.max_steps=2", "exp_manager.save_last=false"]
PAIRS = ["data.dev_choose_samples=12", "data.global_batch_size=4", "data.micro_batch_size=2", "data.val_split=0.25"]
CASES = {
    # pretraining with validation and the end-of-run checkpoint
    "pretraining": [
        "data.global_batch_size=4",
        "data.micro_batch_size=2",
        "data.val_split=0.1",
        "trainer.limit_val_batches=1",
        "exp_manager.save_last=true",
    ],
    "sft": [
        "+recipe=sft",
        "data.global_batch_size=4",
        "data.micro_batch_size=2",
        "data.val_split=0.1",
        "trainer.limit_val_batches=1",
    ],
    "dpo": ["+recipe=dpo", *PAIRS],  # the reference log-probabilities precomputed before training
    # scored during training by a frozen copy, with a token-mean term
    "dpo_online_mixed": [
        "+recipe=dpo",
        *PAIRS,
        "model_alignment_strategy.dpo.precompute_ref_log_probs=false",
        "model_alignment_strategy.dpo.loss_type=[sigmoid,ipo,sft]",
    ],
    "orpo": ["+recipe=orpo", *PAIRS],
    # sampling on the device, the KL reference (LoRA's adapters off), a generation reused for a second step
    "grpo_lora": [
        "+recipe=grpo",
        "data.global_batch_size=8",
        "data.micro_batch_size=4",
        "trainer.max_steps=3",
        "model_alignment_strategy.grpo.beta=0.04",
        "model_alignment_strategy.grpo.num_iterations=2",
        "model_alignment_strategy.peft.lora_rank=4",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_objective_keeps_its_tensors_on_the_device(case, tmp_path):
    from nxdt.config import compose_config
    from nxdt.lightning.train import run_training
    from nxdt.planner import plan

    cfg = compose_config([*TINY, *CASES[case]])
    mode = EmulatedAccelerator()
    with mode:
        module = run_training(cfg, plan(cfg), tmp_path, devices=[EMULATED])
    assert module.step_metrics["step"] == cfg.trainer.max_steps  # the run finished, no op mixed devices
    assert mode.device_ops > 1000  # the model computed on the emulated device (a forward is hundreds of ops)
    if cfg.data.val_split:
        assert module.val_metrics["step"] == cfg.trainer.max_steps


# layouts whose GPU code only ranks on separate devices run: a pipeline's scores (DPO's validation), a tensor-parallel
# LoRA layer's replicated adapter half, GRPO's sampling and scoring under TP with SP and a LoRA reference
LAYOUT_CASES = [
    "+recipe=dpo data.dev_choose_samples=16 data.global_batch_size=4 data.micro_batch_size=1 data.val_split=0.25 "
    "distributed_strategy.pipeline_model_parallel_size=2",
    "+recipe=lora data.global_batch_size=4 data.micro_batch_size=1 distributed_strategy.tensor_model_parallel_size=2",
    "+recipe=grpo data.global_batch_size=8 data.micro_batch_size=4 distributed_strategy.tensor_model_parallel_size=2 "
    "distributed_strategy.sequence_parallel=true model_alignment_strategy.grpo.beta=0.04 model_alignment_strategy.peft.lora_rank=4",
]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_parallel_layouts_keep_their_tensors_on_each_ranks_device(tmp_path):
    """Two ranks under torchrun, each on the emulated accelerator: the layouts' own device code (before these ran,
    DPO's validation under PP indexed the pipeline's host scores with device masks, and TP's LoRA built its
    replicated adapter half on the host)."""
    from test_lightning_api import shell_environment

    cases = tmp_path / "cases.txt"
    common = "model.num_layers=2 trainer.max_steps=2 exp_manager.save_last=false"
    cases.write_text("".join(f"{common} {case}\n" for case in LAYOUT_CASES))
    script = Path(__file__).resolve().parent / "emulated_ranks.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(cases),
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=shell_environment(), cwd=tmp_path)
    mixes = [line for line in done.stdout.splitlines() if line.startswith("DEVICE-MIX")]
    assert not mixes and done.returncode == 0, (mixes, done.stdout[-2000:], done.stderr[-3000:])
    assert [line for line in done.stdout.splitlines() if line.startswith("ok ")] == [f"ok {n}" for n in range(1, 4)]
