"""The native fast path of the ``shm`` transport (``nxdt/comm/_native.c``) and its switch.

The C extension is built by ``pip install`` when a C compiler is present (``setup.py``, an optional
extension). It runs the hot loop of a channel on plain addresses: progress-word waits (spin → yield →
futex, returning to Python every 20 ms so deadlines and peer liveness stay checked here), progress stores,
the reduction kernels (fp16/bf16 accumulated in fp32, rounded once; AVX-512/AVX2 picked at run time) and
one whole step of the direct or the slice all-reduce (copy in, publish, wait, reduce, [copy the peers'
reduced slices out,] done) in one call. Results are bit-identical to the torch fallback of
:mod:`nxdt.comm.reduce`, so the two may even mix across ranks (tests/comm/test_native.py does).

``lib`` is the module, or None: not built (a one-line notice at the first ``init_process``), or switched
off with ``init_process(native=False)`` — the test/debug knob that forces the torch fallback (process-wide:
one World per process).
"""

from __future__ import annotations

import sys

import numpy as np

VERSION = 2  # _native.c's VERSION: a build of older source (another operand order) is not used

try:
    from nxdt.comm import _native as _built
except ImportError:  # no compiler at install time, or not Linux: the torch fallback
    _built = None
if _built is not None and getattr(_built, "VERSION", 0) != VERSION:
    print(
        f"nxdt.comm: the native kernels were built from older source (version {getattr(_built, 'VERSION', 1)}, "
        f"want {VERSION}); using the torch fallback — rebuild with `pip install -e .`",
        file=sys.stderr,
    )
    _built = None

lib = _built
_noticed = False

# channel context words (the C_* enum of _native.c)
C_N, C_ME, C_SLOT_BYTES, C_SPIN_NS, C_SPIN_BASE_NS, C_YIELDS, C_SPIN_EXTRA_NS, C_FUTEX, C_HEADERS = range(9)
MAX_MEMBERS = 63  # members as bits of one signed 64-bit mask (and the C side holds up to 64 operands)
SPIN_NS_PER_CHECK = 100  # a WaitPolicy's spin_checks, as time: what that many flag checks cost in Python
# step statuses of all_reduce_step
DONE, PENDING_SLOT, PENDING_DATA, PEER_SHARED, PENDING_REDUCED, MISMATCH = 0, 1, 2, 3, 4, -1


def use(enabled: bool | None = None) -> None:
    """Process-wide: the native path when built (None/True), or the torch fallback (False)."""
    global lib, _noticed
    lib = None if enabled is False else _built
    if enabled is not False and _built is None and not _noticed:
        _noticed = True
        print(
            "nxdt.comm: native kernels not built (no C compiler at install time?); using the slower torch fallback",
            file=sys.stderr,
        )


def context(n: int, me: int, slot_bytes: int, header_addresses, data_addresses, policy) -> np.ndarray:
    """The int64 words a channel hands to every native call (kept alive by the channel; the spin budget
    word adapts in place)."""
    ctx = np.zeros(C_HEADERS + 2 * n, dtype=np.int64)
    base = policy.spin_checks * SPIN_NS_PER_CHECK
    ctx[[C_N, C_ME, C_SLOT_BYTES, C_SPIN_NS, C_SPIN_BASE_NS, C_YIELDS]] = (n, me, slot_bytes, base, base, policy.yields)
    ctx[C_SPIN_EXTRA_NS] = int(policy.spin_s * 1e9)
    ctx[C_FUTEX] = int(policy.futex)
    ctx[C_HEADERS : C_HEADERS + n] = header_addresses
    ctx[C_HEADERS + n :] = data_addresses
    return ctx


def mask(members) -> int:
    m = 0
    for i in members:
        m |= 1 << i
    return m
