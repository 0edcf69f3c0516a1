"""Waiting on shared-memory flags without starving the peers we wait for.

With more ranks than cores (4 ranks on 2 cores) a rank that spins holds the core its peer needs
to make progress. So: spin briefly (lowest latency when a core is free), then ``sched_yield``, then
sleep in growing steps up to 1 ms. Every wait has a deadline, and a peer that died is noticed
within a few milliseconds instead of at the deadline.
"""

from __future__ import annotations

import os
import time
from typing import Callable

SPIN_ITERATIONS = 200
YIELD_SECONDS = 0.002
MAX_SLEEP_SECONDS = 0.001


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_until(ready: Callable[[], bool], deadline: float, on_timeout: Callable[[], Exception],
               check_health: Callable[[], None] | None = None) -> None:
    """Return when ``ready()`` is true; raise ``on_timeout()`` after ``deadline`` (time.monotonic)."""
    for _ in range(SPIN_ITERATIONS):
        if ready():
            return
    start = time.monotonic()
    sleep = 20e-6
    checks = 0
    while not ready():
        now = time.monotonic()
        if now - start < YIELD_SECONDS:
            os.sched_yield()
            continue
        checks += 1
        if now > deadline:
            raise on_timeout()
        if check_health is not None and checks % 16 == 0:
            check_health()
        time.sleep(sleep)
        sleep = min(sleep * 2, MAX_SLEEP_SECONDS)
