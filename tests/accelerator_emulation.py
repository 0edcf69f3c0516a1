"""An accelerator emulated on the CPU, to find in CI (no GPU) the code that would mix devices on a GPU.

A tensor on a CUDA device and one in host memory meet in one op only as CUDA allows it: a host *scalar* (0-d) may be an
input of a device op; anything else — a host vector added to a device one, a device value added in place to a host
accumulator, a host batch fed to a device model's embedding, ``cat``/``stack`` of both — is PyTorch's "Expected all
tensors to be on the same device". On the CPU every tensor is on the one device, so those mistakes pass unseen until a
GPU runs them. :class:`EmulatedAccelerator` (a ``TorchFunctionMode``) gives each tensor a place — ``DEVICE`` (made with
``device=EMULATED`` or moved there with ``.to(EMULATED)``, and what device tensors compute), ``HOST`` (made without a
device, or ``.cpu()``), or unknown (made outside the mode, or by autograd: mixes with either) — and raises
:class:`DeviceMixError` where CUDA would. Code under test runs with ``EMULATED`` (``torch.device("cpu", 0)``) as its
device: NxDStrategy(parallel_devices=[EMULATED]) puts the module there as it puts a rank on its GPU.

It sees the calls Python makes into torch (composite functions such as ``F.cross_entropy`` once, at their entry) and
not those inside C++; copies (``copy_``, slice assignment) cross devices as on a GPU. ``EMULATED.type`` is "cpu", so
code that branches on the device type takes its CPU branch here: ZeRO-1's and FSDP's flat buffers are nxdt.comm's
shared host memory (FSDP's optimizer state then reads as the host's: a false alarm, so FSDP is not among the cases),
and what only a GPU branch does is the GPU tests' (tests/gpu/)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

EMULATED = torch.device("cpu", 0)  # the emulated accelerator (a real CPU device: computing there is the CPU's)
DEVICE, HOST = "device", "host"


class DeviceMixError(RuntimeError):
    """An op that a GPU would refuse: its tensors on the device and in host memory."""


def _inplace(name: str) -> bool:
    return (name.endswith("_") and not name.endswith("__")) or name in {"__iadd__", "__isub__", "__imul__", "__itruediv__"}


# ops whose tensors must all be on one device, host scalars included
_SAME_DEVICE_ALL = {"cat", "stack", "concat", "concatenate", "hstack", "vstack", "dstack"}
# ops that move data across devices (a copy), or read it to the host (a Python value)
_CROSSING = {
    "copy_",
    "tolist",
    "item",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "__len__",
    "__repr__",
    "__format__",
    "__str__",
    "numel",
    "dim",
    "size",
    "data_ptr",
    "untyped_storage",
    "element_size",
    "is_contiguous",
    "stride",
    "storage_offset",
    "__hash__",
    "__reduce_ex__",
    "_has_compatible_shallow_copy_type",
}


class EmulatedAccelerator(TorchFunctionMode):
    """Tensors' places, and the ops a GPU would refuse (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.places: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.storages: dict[int, str] = {}  # the newest place of each memory block a placed tensor used
        self.checked = 0  # ops that met both places legally (a host scalar in a device op): the checks ran
        self.device_ops = 0  # ops with a device tensor among their inputs

    def place(self, t: torch.Tensor) -> str | None:
        place = self.places.get(t)
        if place is None and isinstance(t, torch.nn.Parameter):  # nn.Parameter(x) wraps x's memory unseen: x's place
            place = self.storages.get(t.untyped_storage().data_ptr())
        return place

    def put(self, out: Any, place: str | None) -> Any:
        if place is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.places[t] = place
                    self.storages[t.untyped_storage().data_ptr()] = place
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in {"__get__", "__set__"}:  # Tensor properties: .device, .grad, .data
            return self._attribute(func, name, args)
        if name == "__torch_function__":
            return func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        target = self._target(func, name, args, kwargs, tensors)
        if target is not None:  # made on, or moved to, a stated device
            if name == "numpy" and self.place(args[0]) == DEVICE:
                raise DeviceMixError("Tensor.numpy() of a device tensor (CUDA: call .cpu() first)")
            out = func(*args, **kwargs)
            if args and out is args[0] and self.place(out) != target:  # a move the CPU skips: a GPU's copy
                out = out.clone()
            return self.put(out, target)
        places = {id(t): self.place(t) for t in tensors}
        on_device = [t for t in tensors if places[id(t)] == DEVICE]
        on_host = [t for t in tensors if places[id(t)] == HOST]
        self.device_ops += bool(on_device)
        if name == "numpy" and on_device:
            raise DeviceMixError("Tensor.numpy() of a device tensor (CUDA: call .cpu() first)")
        if on_device and on_host and name not in _CROSSING:
            self._check_mix(name, args, on_host, places)
        out = func(*args, **kwargs)
        if name in _CROSSING:
            return out
        return self.put(out, DEVICE if on_device else HOST if on_host else None)

    def _attribute(self, func: Any, name: str, args: tuple) -> Any:
        what = getattr(getattr(func, "__self__", None), "__name__", "")
        tensor = args[0]
        if name == "__set__":  # p.data = x, p.grad = g: the tensor is where its new data is
            func(*args)
            if what in {"data"} and isinstance(args[1], torch.Tensor) and self.place(args[1]) is not None:
                self.put(tensor, self.place(args[1]))
            return None
        if what == "device" and self.place(tensor) == DEVICE:
            return EMULATED
        out = func(*args)
        if isinstance(out, torch.Tensor) and what in {"data", "grad", "T", "mT", "H", "real", "imag"}:
            place = self.place(tensor)
            if place is not None and out is not None:
                self.put(out, place)
        return out

    def _target(self, func: Any, name: str, args: tuple, kwargs: dict, tensors: list) -> str | None:
        """DEVICE/HOST where the call states where its result lives (a factory, ``.to``, ``.cpu``), else None."""
        if name in {"cpu", "pin_memory", "numpy"}:
            return HOST
        if name == "cuda":
            return DEVICE
        device = kwargs.get("device")
        if name == "to":
            other = next((a for a in args[1:] if isinstance(a, torch.Tensor)), kwargs.get("other"))
            if isinstance(other, torch.Tensor):
                return self.place(other)
            device = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})[0]
            if device is None:
                return None
        if device is not None:
            return DEVICE if torch.device(device) == EMULATED else HOST
        if not tensors and name not in _CROSSING:  # a factory (torch.tensor, zeros, arange...) without a device
            return HOST
        return None

    def _check_mix(self, name: str, args: tuple, on_host: list, places: dict) -> None:
        first = args[0] if args else None
        if name == "__setitem__":  # a copy into ``first``; only a device index into a host tensor is refused
            index = tree_flatten(args[1])[0]
            if self.place(first) == HOST and any(isinstance(i, torch.Tensor) and self.place(i) == DEVICE for i in index):
                raise DeviceMixError("a host tensor indexed by a device tensor")
            return
        if name == "__getitem__":  # a device tensor indexed by host indices is fine; the reverse is not
            if self.place(first) == HOST:
                raise DeviceMixError("a host tensor indexed by a device tensor")
            return
        if isinstance(first, torch.Tensor) and self.place(first) == HOST and _inplace(name):
            raise DeviceMixError(f"{name}: a device tensor written into the host tensor {tuple(first.shape)} in place")
        if name in _SAME_DEVICE_ALL:
            shapes = [tuple(t.shape) for t in on_host]
            raise DeviceMixError(f"{name} of device tensors and host tensors {shapes}")
        big = [tuple(t.shape) for t in on_host if t.dim() > 0]
        if big:
            raise DeviceMixError(f"{name} of device tensors and host tensors {big} (only a host 0-d tensor may join)")
        self.checked += 1


def on_device(mode: EmulatedAccelerator, value: Any) -> Any:
    """``value``'s tensors as the emulated device's (a test's own inputs)."""
    return tree_map(lambda t: mode.put(t, DEVICE) if isinstance(t, torch.Tensor) else t, value)
