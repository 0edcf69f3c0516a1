"""Waiting on shared-memory words without starving the peers we wait for.

With more ranks than cores (4 ranks on 2 cores) a rank that spins holds the core its peer needs to
make progress. So a wait goes through three phases:

1. spin a few hundred checks (≈10-30 µs; lowest latency when the peer has a core of its own);
2. ``sched_yield`` a few times (releases the GIL and the core, still no sleep);
3. block in the kernel with ``futex(FUTEX_WAIT)`` on the 32-bit word itself (the low half of the
   int64 progress word in the shared segment; no ``FUTEX_PRIVATE_FLAG``, so it works across the
   processes that map the file). Writers call :func:`wake` after every store, which costs ≈1 µs,
   cheaper than any scheme that tracks sleepers without atomic instructions.

The futex sleeps in slices of at most ``SLICE_S`` so the deadline and the peer's health are checked
regularly: every wait raises at its deadline, and a peer that died is noticed within milliseconds.
Where futex is unavailable (non-Linux), phase 3 sleeps in growing steps up to 1 ms instead.

Memory ordering: x86 keeps stores in order, but large copies may use non-temporal stores, which are
not ordered with the flag store that follows. :func:`fence` (an uncontended lock round trip, a
``lock``-prefixed instruction, ≈0.15 µs) drains them before a flag is published.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from dataclasses import dataclass
from typing import Callable

SLICE_S = 0.005

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())


def _libc_syscall() -> Callable[..., int] | None:
    """libc's ``syscall()`` returning a C long, or None where there is none."""
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return None
    syscall.restype = ctypes.c_long
    return syscall


_syscall = _libc_syscall()
HAVE_FUTEX = _syscall is not None and _SYS_FUTEX is not None and os.name == "posix"


@dataclass(frozen=True)
class WaitPolicy:
    """How a wait spends its time before the deadline (``init_process(wait_policy=...)``).

    spin_checks: flag checks before yielding (adapts between 16 and 4× this while running);
    spin_s: then keep checking for up to this long — for ranks that have a core each (see
    :func:`policy_for`), where a peer's wake-up from the futex costs far more than spinning;
    yields: ``sched_yield`` calls before sleeping; futex: sleep in the kernel on the flag word
    (False: poll with growing sleeps — kept for comparison, see experiments/collectives-cpu/waiting.py).
    """

    spin_checks: int = 300
    spin_s: float = 0.0
    yields: int = 4
    futex: bool = True


DEFAULT_WAIT = WaitPolicy()
# A rank with a core to itself spins this long before sleeping. A peer sleeping in the futex
# costs a wake syscall plus the scheduler's wake-up latency (≈50-150 µs on the 2-core VM), more
# than copying a megabyte; a millisecond covers the copy of a 4 MB step, and is wasted only when
# a peer is genuinely late (a straggler), where the core would be idle anyway. Only the main
# thread spins that long: a stream thread spinning holds the GIL the computing main thread needs.
OWN_CORE_SPIN_S = 1e-3
STREAM_THREAD_CHECKS = 16
_MAIN = threading.main_thread()


def policy_for(local_ranks: int) -> WaitPolicy:
    """The default policy for ``local_ranks`` ranks on this host: spin long only when each has a core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return WaitPolicy(spin_s=OWN_CORE_SPIN_S) if local_ranks <= cores else DEFAULT_WAIT


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (see the module docstring)."""
    _fence_lock.acquire()
    _fence_lock.release()


def wake(address: int) -> None:
    """Wake every process sleeping on the 32-bit word at ``address``."""
    if HAVE_FUTEX and _syscall is not None:
        _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _futex_wait(address: int, expected: int, seconds: float) -> None:
    assert _syscall is not None, "futex wait without HAVE_FUTEX"  # callers check HAVE_FUTEX
    ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
    # returns at once (EAGAIN) when the word no longer holds ``expected``; ctypes releases the GIL
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, 0)


class _SchedAttr(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
    ]


_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "arm64": 274}.get(platform.machine())
_SCHED_FLAG_KEEP_POLICY = 0x08
STREAM_THREAD_SLICE_S = 100e-6


def request_short_slice(seconds: float = STREAM_THREAD_SLICE_S) -> bool:
    """Ask the kernel for a short scheduling slice for the calling thread (Linux >= 6.12, EEVDF's per-task
    slice; unprivileged, priority and nice unchanged). A stream thread sleeps on the emulated wire or a
    futex and then has a few microseconds of work; with the default slice (1.4 ms on a 2-core host) it
    can wait that long and more for the core its own rank's compute holds, and every collective behind it
    in the FIFO slips (FSDP traces showed 2-4 ms stalls between chained gathers). A short slice lets it
    preempt on wake-up.
    Older kernels ignore the field; returns False where the call is unavailable or refused."""
    if _syscall is None or _SYS_SCHED_SETATTR is None:
        return False
    attr = _SchedAttr(
        ctypes.sizeof(_SchedAttr),
        0,
        _SCHED_FLAG_KEEP_POLICY,
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
        0,
        int(seconds * 1e9),
        0,
        0,
    )
    return _syscall(_SYS_SCHED_SETATTR, 0, ctypes.byref(attr), 0) == 0


def pid_alive(pid: int) -> bool:
    """Is ``pid`` a running process? A zombie (exited, not yet reaped by its parent) is not: the elastic
    agent reaps a failed job's workers one by one, and a peer waiting for an exited but unreaped rank
    would otherwise wait until the agent's 30 s SIGKILL."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:  # no procfs (or it just went away): the signal probe answered
        return True
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]  # the field after "(comm)", which may hold spaces
    return state not in (b"Z", b"X")


class SpinBudget:
    """Adaptive spin length: doubles while spinning pays off (a free core), halves while it does not
    (more runnable processes than cores, where every spin steals the peer's time)."""

    __slots__ = ("checks", "policy")
    MIN = 16

    def __init__(self, policy: WaitPolicy = DEFAULT_WAIT) -> None:
        self.policy = policy
        self.checks = policy.spin_checks

    def hit(self) -> None:
        self.checks = min(4 * self.policy.spin_checks, self.checks * 2)

    def miss(self) -> None:
        self.checks = max(self.MIN, self.checks // 2)


def wait_word(
    words,
    index: int,
    target: int,
    address: int,
    deadline: float,
    on_timeout: Callable[[], Exception],
    check_health: Callable[[], None] | None,
    budget: SpinBudget,
    sleep_flag=None,
) -> None:
    """Return when ``words[index] >= target`` (an int64 numpy view of shared memory whose element
    ``index`` lives at ``address``); raise ``on_timeout()`` after ``deadline`` (time.monotonic).

    ``sleep_flag = (flags, i, value)``: store ``value`` in ``flags[i]`` (shared memory the writer
    reads) while blocked in the futex and 0 after, so writers can skip the wake syscall when
    nobody sleeps (see :func:`should_wake`). Store flag, fence, re-read the word — against the
    writer's store word, fence, read flag — means one of the two always sees the other."""
    main = threading.current_thread() is _MAIN
    # a stream thread spinning in Python holds the GIL the main thread's compute needs between kernels:
    # it checks a few times, then yields and sleeps (its ops are asynchronous; compute hides their latency)
    for _ in range(budget.checks if main else STREAM_THREAD_CHECKS):
        if words[index] >= target:
            if main:
                budget.hit()
            return
    if main:
        budget.miss()
    policy = budget.policy
    if policy.spin_s and main:
        until = time.perf_counter() + policy.spin_s
        while time.perf_counter() < until:
            for _ in range(32):
                if words[index] >= target:
                    return
            os.sched_yield()  # a peer queued behind us on this core (a loaded host) runs now, not after our slice
    for _ in range(policy.yields):
        os.sched_yield()
        if words[index] >= target:
            return
    sleep = 20e-6
    slices = 0
    use_futex = HAVE_FUTEX and policy.futex
    flagged = False
    try:
        while True:
            value = int(words[index])
            if value >= target:
                return
            now = time.monotonic()
            if now > deadline:
                raise on_timeout()
            slices += 1
            if check_health is not None and slices % 8 == 0:
                check_health()
            if use_futex:
                if sleep_flag is not None and not flagged:
                    sleep_flag[0][sleep_flag[1]] = sleep_flag[2]
                    flagged = True
                    fence()
                    value = int(words[index])  # re-read after announcing (see the docstring)
                    if value >= target:
                        return
                _futex_wait(address, value, min(SLICE_S, max(1e-4, deadline - now)))
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, 1e-3)
    finally:
        if flagged:
            sleep_flag[0][sleep_flag[1]] = 0


def wait_until(
    ready: Callable[[], bool],
    deadline: float,
    on_timeout: Callable[[], Exception],
    check_health: Callable[[], None] | None = None,
    policy: WaitPolicy = DEFAULT_WAIT,
) -> None:
    """Polling wait for conditions that are not one word (e.g. either of two mailboxes)."""
    for _ in range(policy.spin_checks // 4):
        if ready():
            return
    sleep = 10e-6
    checks = 0
    while not ready():
        checks += 1
        if checks < policy.yields:
            os.sched_yield()
            continue
        if time.monotonic() > deadline:
            raise on_timeout()
        if check_health is not None and checks % 64 == 0:
            check_health()
        time.sleep(sleep)
        sleep = min(sleep * 2, 2e-4)
