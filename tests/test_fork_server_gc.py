"""The fork servers import torch and Lightning with Python's garbage collector paused (``nxdt.gc_paused``), then freeze
what they hold and resume it (``nxdt.comm.frozen``): the ranks and workers forked from them collect as usual."""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import nxdt
from nxdt.comm.spawn import FROZEN, GC_PAUSED, run_local

LAUNCH = Path(nxdt.__file__).resolve().parent / "launch"


def _collector(world) -> tuple[bool, bool]:
    return gc.isenabled(), gc.get_freeze_count() > 0


def test_ranks_forked_from_run_locals_server_collect_and_skip_its_imports():
    assert run_local(_collector, 2, timeout_s=60) == [(True, True), (True, True)]


def _imports(path: Path) -> list[str]:
    """The modules a fork server's source imports at its top level, in order."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_every_fork_server_pauses_the_collector_first_and_resumes_it_last():
    for server in ("fork_server.py", "comm_fork_server.py"):
        names = _imports(LAUNCH / server)
        assert names[0] == GC_PAUSED and names[-1] == FROZEN, (server, names)


def test_the_pause_and_the_resume_are_what_they_say():
    """In a fork (this process's collector untouched): importing the pair leaves the collector running, with what was
    held before frozen."""
    import os
    import sys

    pid = os.fork()
    if pid == 0:  # pragma: no cover (the forked child)
        code = 1
        try:
            for name in (GC_PAUSED, FROZEN):
                sys.modules.pop(name, None)
            __import__(GC_PAUSED)
            paused = not gc.isenabled()
            __import__(FROZEN)
            code = 0 if paused and gc.isenabled() and gc.get_freeze_count() > 0 else 1
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert gc.isenabled()
