"""Imported first by a fork server (``run_local``'s: ``nxdt.comm.spawn.GC_PAUSED``; nxdt's agents' and ``nxdt comm-test
-N``'s import it at their top): pauses Python's cyclic garbage collector while the server imports torch, torch._dynamo
and Lightning. Those imports create millions of objects, and the collector, triggered by the allocations, walked the
growing heap again and again — a third of the import time. :mod:`nxdt.comm.frozen`, imported last, moves what the
server holds to the permanent generation and resumes the collector, so the forked ranks and workers collect as usual
and never walk the imports. Cycles made while importing stay uncollected: a few thousand objects (the training
server's collections of generation 1 and 2 over its whole import freed 3,137, measured with ``gc.callbacks``).

Measured on the 2-core development host, three alternating pairs, the README's install: ``import nxdt.lightning.train``
8.9-9.9 s with the collector running, 6.1-6.4 s paused (5.4-5.5 user CPU-s against 8.1-9.2)."""

import gc

gc.disable()
