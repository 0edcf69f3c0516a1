"""Python's cyclic garbage collector, paused where nxdt allocates much and frees little.

Importing torch, ``torch._dynamo`` and Lightning creates millions of objects; the collector, triggered by the
allocations, walked the growing heap again and again — a third of the import time (``import nxdt.lightning.train``,
the README's install, three alternating pairs on the 2-core development host: 8.9-9.9 s with it running, 6.1-6.4 s
paused). And a collection that starts while a chat template renders walks the whole process — in a long-lived process,
seconds charged to the template's time budget. So:

* the fork servers (nxdt's agents' ``nxdt.launch.fork_server``, ``nxdt comm-test -N``'s, ``run_local``'s) import
  :mod:`nxdt.gc_paused` first — importing it pauses the collector — and :mod:`nxdt.comm.frozen` last, which freezes
  what the server holds and resumes it: what is forked from them collects as usual and never walks the imports;
* the launcher's imports and checks (``nxdt train``) and each chat template's render run inside :func:`paused`.

Cycles made while paused stay until the next collection (or, in a fork server, forever: a few thousand objects — the
training server's collections of generations 1 and 2 over its whole import freed 3,137, measured with
``gc.callbacks``)."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused() -> Iterator[None]:
    """The collector paused for the block, then as it was (a caller that paused it itself keeps it paused)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
