"""Objects between ranks without pickle: plain data and tensors, encoded as JSON plus raw tensor bytes.

Bytes that arrive from another process — over a socket across hosts, or through a shared segment —
are data, never code: unpickling them would run whatever a forged payload names. The codec accepts
exactly what ranks exchange (None, bool, int, float, str, bytes, paths, lists, tuples, dicts with
such keys, torch tensors and dtypes) and refuses anything else by type, on the sender's side.

Layout: an 8-byte little-endian header length, the JSON header, then every tensor's bytes back to back.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path, PurePath
from typing import Any

import torch

_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


class ObjectCodecError(TypeError):
    """An object that cannot be exchanged between ranks, or bytes that are not a valid encoding."""


def encode(obj: Any) -> bytes:
    """``obj`` as bytes (see the module docstring for what is accepted)."""
    blobs: list[bytes] = []

    def walk(x: Any) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return {"int": str(x)}  # arbitrary size, exact
        if isinstance(x, float):
            return {"float": x.hex()}  # exact, NaN and inf included
        if isinstance(x, (list, tuple)):
            return {"list" if isinstance(x, list) else "tuple": [walk(v) for v in x]}
        if isinstance(x, dict):
            return {"dict": [[walk(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, bytes):
            return {"bytes": base64.b64encode(x).decode()}
        if isinstance(x, PurePath):
            return {"path": str(x)}
        if isinstance(x, torch.dtype):
            return {"dtype": str(x)}
        if isinstance(x, torch.Tensor):
            if str(x.dtype) not in _DTYPES:
                raise ObjectCodecError(f"nxdt.comm: a {x.dtype} tensor cannot be sent between ranks")
            t = x.detach().to("cpu").contiguous()
            blobs.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return {"tensor": [str(t.dtype), list(t.shape), len(blobs) - 1, len(blobs[-1])]}
        raise ObjectCodecError(
            f"nxdt.comm: an object of type {type(x).__qualname__} cannot be sent between ranks; "
            "send plain data (numbers, strings, lists, dicts) and tensors"
        )

    header = json.dumps(walk(obj), separators=(",", ":")).encode()
    return struct.pack("<Q", len(header)) + header + b"".join(blobs)


def decode(data: bytes) -> Any:
    """The object ``encode`` turned into ``data``; malformed bytes raise :class:`ObjectCodecError`."""
    try:
        (length,) = struct.unpack_from("<Q", data, 0)
        tree = json.loads(data[8 : 8 + length])
    except (struct.error, ValueError) as exc:
        raise ObjectCodecError(f"nxdt.comm: received bytes are not an encoded object ({exc})") from None
    blob_at = 8 + length

    def walk(x: Any) -> Any:
        nonlocal blob_at
        if x is None or isinstance(x, (bool, str)):
            return x
        if not isinstance(x, dict) or len(x) != 1:
            raise ObjectCodecError(f"nxdt.comm: malformed object encoding near {str(x)[:60]!r}")
        ((kind, value),) = x.items()
        if kind == "int":
            return int(value)
        if kind == "float":
            return float.fromhex(value)
        if kind in ("list", "tuple"):
            items = [walk(v) for v in value]
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            return {walk(k): walk(v) for k, v in value}
        if kind == "bytes":
            return base64.b64decode(value)
        if kind == "path":
            return Path(value)
        if kind == "dtype" and value in _DTYPES:
            return _DTYPES[value]
        if kind == "tensor":
            dtype_name, shape, _, nbytes = value
            if dtype_name not in _DTYPES or blob_at + nbytes > len(data):
                raise ObjectCodecError("nxdt.comm: malformed tensor in a received object")
            raw = bytearray(data[blob_at : blob_at + nbytes])
            blob_at += nbytes
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(_DTYPES[dtype_name]).reshape(shape)
        raise ObjectCodecError(f"nxdt.comm: unknown kind {kind!r} in a received object")

    try:
        return walk(tree)
    except (ValueError, TypeError, RuntimeError) as exc:
        if isinstance(exc, ObjectCodecError):
            raise
        raise ObjectCodecError(f"nxdt.comm: malformed object encoding ({exc})") from None
