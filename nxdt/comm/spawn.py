"""``run_local``: run a function in N fresh processes joined into one nxdt World.

Used by the tests, the benchmark and anyone who wants a quick multi-rank run without a launcher.
A rank that raises makes ``run_local`` raise an error naming that rank and its exception; ranks
still running are killed; the run's shared-memory segments are removed in every case. The ranks' store is a
private ``FileStore`` in a fresh 0700 directory (:mod:`nxdt.comm.store`): nothing listens.

Ranks are forked from multiprocessing's fork server, which imports torch, torch._dynamo, nxdt.comm and the
module of the first call's ``fn`` once for the life of the calling process (``PRELOAD``, ``_context``): a rank
then starts in milliseconds instead of re-importing them (≈ 4 CPU-s each, serialised when ranks outnumber cores). As with ``spawn``, ``fn`` and its
arguments must be picklable and a script must guard its entry with ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

from nxdt.comm.errors import CommError
from nxdt.comm.shm import cleanup_run
from nxdt.comm.store import create_file_store, new_secret


class RankFailed(CommError):
    def __init__(self, rank: int, message: str, details: str = "") -> None:
        self.rank, self.message, self.details = rank, message, details
        super().__init__(f"rank {rank} failed: {message}")


# torch, torch.distributed and the library: what every rank imports. And torch._dynamo: torch imports it lazily on the
# first call of any function it wraps in ``_disable_dynamo`` (torch/_compile.py), which includes every optimizer's
# ``__init__`` and ``step``; that import (sympy, torch.fx's symbolic shapes, ...) cost each rank ≈ 2.5 CPU-s, five times
# what a tiny model's whole test run computes.
PRELOAD = ["nxdt.comm.world", "torch._dynamo"]
# Imported last by the fork server: it moves what the server holds to the collector's permanent generation, so a rank's
# collections never walk (and so never copy, page by page) the objects it shares with the server (nxdt.comm.frozen).
FROZEN = "nxdt.comm.frozen"
# Imported first by the fork server: the collector paused for its imports, until FROZEN (nxdt.gc_paused).
GC_PAUSED = "nxdt.gc_paused"


def _context(fn: Callable[..., Any], preload: Sequence[str] = (), fork_here: bool = False) -> Any:
    """The fork server's context. Its preload takes effect when this process first starts the server: ``PRELOAD``,
    the caller's ``preload`` and the module of that first ``fn``, which every rank imports anyway to unpickle ``fn``
    (for the suite: pytest, Hydra's config, the models): imported once, not by each rank of every later call
    (≈ 0.6 CPU-s a rank). ``__main__`` is left out: the server does not re-run a script.

    ``fork_here``: ranks forked from this very process instead (:func:`can_fork_here`), which has imported what they
    run: the server would only import torch again (≈ 5 CPU-s before the first rank starts)."""
    if fork_here:
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    module = getattr(fn, "__module__", None)
    ctx.set_forkserver_preload([GC_PAUSED, *PRELOAD, *preload, *([module] if module and module != "__main__" else []), FROZEN])
    return ctx


def can_fork_here(fn: Callable[..., Any]) -> bool:
    """Whether ranks may be forks of this process: it runs one Python thread (a fork copies only the calling thread,
    and a lock another thread held stays locked in the child) and has imported torch, the library and ``fn``'s module
    already, so a fork starts ranks in milliseconds. The caller must not have run a multi-threaded torch operation
    (an OpenMP pool does not survive a fork): true of a command that only parsed its arguments, such as
    ``nxdt comm-test`` (``nxdt.launch.forking.start_method`` is the launcher's version of this rule)."""
    import threading

    module = getattr(fn, "__module__", None)
    needed = ["torch", "nxdt.comm.world", *([module] if module else [])]
    return threading.active_count() == 1 and all(name in sys.modules for name in needed)


def free_port() -> int:
    """A free TCP port on loopback (the experiments' side-by-side runs of other libraries need one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, store_file, run_id, host_id, timeout_s, results, args, kwargs, init_options, secret) -> None:
    import torch

    from nxdt.comm.world import init_process

    torch.set_num_threads(1)  # ranks share the cores: one intra-op thread each
    world = None
    try:
        world = init_process(
            rank,
            world_size,
            "127.0.0.1",
            0,
            timeout_s=timeout_s,
            run_id=run_id,
            host_id=host_id,
            secret=secret,
            store_file=store_file,
            **(init_options or {}),
        )
        value = fn(world, *args, **kwargs)
        results.put((rank, True, value, ""))
    except BaseException as exc:  # reported to the parent with the rank
        results.put((rank, False, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        if world is not None:
            try:
                world.close()
            except Exception:
                pass


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    comm_timeout_s: float | None = None,
    init_options: dict[str, Any] | None = None,
    host_ids: list[str] | None = None,
    preload: Sequence[str] = (),
    fork_here: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(world, *args, **kwargs)`` in ``world_size`` processes; return the per-rank results.
    ``init_options`` go to :func:`init_process` (e.g. ``slot_bytes``, ``wait_policy``). ``preload``: modules ``fn``
    imports, imported by the fork server beside ``PRELOAD`` when this call is the one that starts it (once, instead of
    by every rank). ``fork_here``: fork the ranks from this process, which :func:`can_fork_here` must allow."""
    if fork_here and not can_fork_here(fn):
        raise ValueError("run_local(fork_here=True) needs one thread and torch, nxdt.comm.world and fn's module imported")
    ctx = _context(fn, preload, fork_here)
    results = ctx.Queue()
    run_id = f"t{uuid.uuid4().hex[:10]}"
    secret = new_secret()  # the ranks' store keys are signed with it (nxdt.comm.store); handed over, never in argv
    # the ranks' store: a private file in a fresh 0700 directory (no port for another local user to connect to)
    store_dir = Path(tempfile.mkdtemp(prefix="nxdt-store-"))
    store_file = store_dir / "store"
    create_file_store(store_file, timedelta(seconds=comm_timeout_s or timeout_s))
    comm_timeout_s = comm_timeout_s or timeout_s
    procs = [
        ctx.Process(
            target=_entry,
            args=(
                fn,
                r,
                world_size,
                str(store_file),
                run_id,
                host_ids[r] if host_ids else None,
                comm_timeout_s,
                results,
                args,
                kwargs,
                init_options,
                secret,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    if fork_here:  # a fork copies this process's unwritten output buffers: the ranks would print them again at exit
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # the ranks' collections skip what they share with this process (as the fork server's: FROZEN)
    for p in procs:
        p.start()
    if fork_here:
        gc.unfreeze()  # this process collects as before; its forks keep their frozen copy
    values: dict[int, Any] = {}
    failure: RankFailed | None = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size and failure is None:
            try:
                rank, ok, value, details = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    failure = RankFailed(dead[0], f"process exited with code {procs[dead[0]].exitcode}")
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in values]
                    failure = RankFailed(missing[0], f"no result within {timeout_s}s (ranks {missing} still running)")
                continue
            if ok:
                values[rank] = value
            else:
                failure = RankFailed(rank, value, details)
    finally:
        grace = time.monotonic() + (2.0 if failure else 10.0)
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        cleanup_run(run_id)
        shutil.rmtree(store_dir, ignore_errors=True)
    if failure is not None:
        raise failure
    return [values[r] for r in range(world_size)]
