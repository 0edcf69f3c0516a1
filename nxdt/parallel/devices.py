"""The device policy: where a rank computes and in which formats, as one pure function of the run's settings.

``instance.accelerator`` (``cpu`` | ``cuda``), the rank's local rank, the ranks per node, the GPUs of the node and
``precision.type`` decide everything the training stack places or picks per device:

* the rank's device: ``cpu``, or ``cuda:N`` with the node's ranks in contiguous blocks over its GPUs (one rank per
  GPU: local rank N → cuda:N, the planner's ``Plan.place(rank)["device"]``; more ranks than GPUs: neighbours share);
* the formats: ``precision.type`` names them already (fp32 | bf16 | bf16SR | mixed_precision[SR]: fp32 master
  weights, bf16 compute under autocast); the policy gives the parameters' dtype and autocast's, on either device;
* the optimizer kernel: torch's fused AdamW on CUDA and on the CPU (one kernel for every parameter;
  ``torch.optim.AdamW(fused=True)`` as torchtitan's ``build_optimizers`` and Hugging Face's Trainer choose it);
* the attention kernels ``scaled_dot_product_attention`` may use: on CUDA in bf16, flash, memory-efficient and cuDNN
  only (a call none of them runs is an error, never a silent fall back to the math kernel that holds the s×s
  scores); in fp32 and on the CPU torch's own choice (its fused flash kernel on the CPU, ``models/attention.py``).

Nothing here touches a GPU: the module imports no CUDA-only code and every function is pure, so the CPU suite
tests it (``tests/test_devices.py``) and the launcher's dry run prints what each rank would get.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, MutableMapping

import torch

ACCELERATORS = ("cpu", "cuda")
# precision.type → (parameter dtype, autocast dtype or None); the schema's PrecisionConfig describes each
_FORMATS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "bf16SR": (torch.bfloat16, None),
    "mixed_precision": (torch.float32, torch.bfloat16),
    "mixed_precisionSR": (torch.float32, torch.bfloat16),
}
# the SDPBackend members a CUDA rank allows (torch.nn.attention); the math kernel is left out on purpose
CUDA_SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def device_index(local_rank: int, ranks_per_node: int, gpus: int) -> int:
    """The GPU of ``local_rank`` among ``gpus``: ceil(ranks / gpus) neighbouring ranks per GPU."""
    if gpus < 1:
        raise ValueError(f"no GPU to place local rank {local_rank} on (gpus={gpus})")
    if not 0 <= local_rank < ranks_per_node:
        raise ValueError(f"local rank {local_rank} is not one of this node's {ranks_per_node} ranks")
    per_gpu = -(-ranks_per_node // gpus)
    return local_rank // per_gpu


@dataclass(frozen=True)
class DevicePolicy:
    """What one rank computes on and with (see the module's docstring)."""

    accelerator: str  # cpu | cuda
    device: str  # "cpu" | "cuda:N"
    precision: str  # precision.type

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def param_dtype(self) -> torch.dtype:
        return _FORMATS[self.precision][0]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _FORMATS[self.precision][1]

    @property
    def lightning_accelerator(self) -> str:
        return self.accelerator  # Lightning's names: "cpu", "cuda"

    def adamw_options(self) -> dict[str, Any]:
        return adamw_options(self.accelerator)

    @property
    def half(self) -> bool:
        """The matmuls and attention compute in bf16 (bf16 weights, or bf16 autocast over fp32 master weights)."""
        return (self.autocast_dtype or self.param_dtype) == torch.bfloat16

    @property
    def sdpa_backends(self) -> tuple[str, ...]:
        return sdpa_backends(self.accelerator, self.half)


def adamw_options(device_type: str) -> dict[str, Any]:
    """Keyword arguments of ``torch.optim.AdamW`` for parameters on ``device_type``: torch's fused kernel on the CPU
    and CUDA alike — what Hugging Face's Trainer runs by default (``optim="adamw_torch_fused"`` with torch ≥ 2.8).
    On the CPU it takes 0.22x the time of torch's own CPU default, the per-parameter loop (17.6 against 78.6 ms for
    15.6 M parameters, one core), whose results it equals but for the last bit of about 1 % of the elements per step
    (a named difference: docs/migrating-from-nxdt.md, "What differs")."""
    return {"fused": True}


def sdpa_backends(device_type: str, half: bool) -> tuple[str, ...]:
    """SDPBackend member names attention may use on ``device_type`` when it computes in bf16/fp16 (``half``) or
    not; () = torch's own choice. Only CUDA in half precision is restricted: the flash and cuDNN kernels take no
    fp32, so an fp32 run keeps torch's choice (the memory-efficient kernel, or the math one where that cannot run:
    grouped-query heads)."""
    return CUDA_SDPA_BACKENDS if device_type == "cuda" and half else ()


@contextlib.contextmanager
def attention_kernels(device_type: str, half: bool) -> Iterator[None]:
    """Around a forward/backward on ``device_type``: restrict ``scaled_dot_product_attention`` to
    :func:`sdpa_backends` (nothing changes on the CPU or in fp32). A call none of them runs — grouped-query heads
    with a packed-sequence mask — fails with torch's "No available kernel" and its reasons."""
    names = sdpa_backends(device_type, half)
    if not names:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, name) for name in names]):
        yield


def policy_for(accelerator: str, local_rank: int, ranks_per_node: int, gpus: int, precision: str = "fp32") -> DevicePolicy:
    """The policy of ``local_rank`` on a node of ``ranks_per_node`` ranks and ``gpus`` GPUs (ignored on the CPU)."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"instance.accelerator={accelerator!r}: use one of {', '.join(ACCELERATORS)}")
    if precision not in _FORMATS:
        raise ValueError(f"precision.type={precision!r}: use one of {', '.join(_FORMATS)}")
    if accelerator == "cpu":
        return DevicePolicy("cpu", "cpu", precision)
    return DevicePolicy("cuda", f"cuda:{device_index(local_rank, ranks_per_node, gpus)}", precision)


def node_devices(accelerator: str, ranks_per_node: int, gpus: int) -> list[str]:
    """Every local rank's device, in local-rank order (what a dry run prints, what the strategy is handed)."""
    return [policy_for(accelerator, r, ranks_per_node, gpus).device for r in range(ranks_per_node)]


def worker_environment(instance_env: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``instance.env`` a worker sets: those the environment does not hold already (the user's
    own value wins, as NCCL's documentation expects of a site's settings)."""
    return {str(k): str(v) for k, v in instance_env.items() if str(k) not in environ}


def export_worker_environment(instance_env: Mapping[str, Any], environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set :func:`worker_environment` in ``environ`` (a worker's ``os.environ``, before its first NCCL group);
    returns what was set."""
    added = worker_environment(instance_env, environ)
    environ.update(added)
    return added
