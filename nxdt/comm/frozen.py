"""Imported last by ``run_local``'s fork server (``nxdt.comm.spawn.FROZEN``), after everything its ranks need; imported
nowhere else.

It moves every object the server holds to the garbage collector's permanent generation, then resumes the collector
(:mod:`nxdt.gc_paused` paused it for the server's imports). A rank is a fork of the server: without this, its first
collections walk the imported modules' objects, and writing their headers copies each page they sit on
(copy-on-write) — most of torch's and Lightning's heap, in every rank. A warm ``nxdt train``
launch of one step on 2 ranks forked this way took 3.0 CPU-s, 1.6 frozen (docs/architecture.md §9, "Budget").
"""

import gc

gc.freeze()
gc.enable()  # paused by nxdt.gc_paused while the server imported (a no-op where nothing paused it)
