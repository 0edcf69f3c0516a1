"""Importing this pauses Python's garbage collector: the first import of a fork server, whose last,
:mod:`nxdt.comm.frozen`, resumes it (why: :mod:`nxdt.collector`). Lives outside any package with an ``__init__`` that
imports torch, so nothing heavy is imported before the pause."""

import gc

gc.disable()
