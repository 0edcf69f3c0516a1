"""The rendezvous of a one-host run: torch elastic's handler interface, a private store file, no pickle.

torch's ``c10d`` rendezvous (what torchrun uses) keeps its state in the store as a pickled object and
unpickles whatever it reads back; its ``TCPStore`` and the bootstrap store the agent opens for the
workers listen on every interface. For a job whose ranks all live on this host none of that is
needed: one node, rank 0, a fixed world. ``nxdt-local`` is registered with torch's own handler registry
(the documented extension point) and opens a single store — a ``FileStore`` in the private run directory
(``rdzv_configs["store_file"]``, :func:`nxdt.comm.store.create_file_store`), no socket — which is both the
agent's store and the workers' bootstrap store (they open the same file: ``NXDT_STORE_FILE``). Nothing read
from it is unpickled — by nxdt or by the agent, which only exchanges plain keys with it on this path.
The workers' ``MASTER_ADDR``/``MASTER_PORT`` are 127.0.0.1 and 0: no TCP store exists to connect to.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from nxdt.comm.store import LOOPBACK, create_file_store

BACKEND = "nxdt-local"


class LocalRendezvous(RendezvousHandler):
    """One node (this host), one store file; the same store across the agent's restarts."""

    def __init__(self, run_id: str, timeout_s: float, store_file: Path) -> None:
        self._run_id = run_id
        self._timeout = timedelta(seconds=timeout_s)
        self._store_file = store_file
        self._store: Store | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store (TORCHELASTIC_USE_AGENT_STORE=True) instead of hosting one

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = create_file_store(self._store_file, self._timeout)
        return RendezvousInfo(PrefixStore(self._run_id, self._store), 0, 1, RendezvousStoreInfo(LOOPBACK, 0))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node, never more

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._store = None
        self._store_file.unlink(missing_ok=True)
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous serves one node, not {params.max_nodes}")
    store_file = params.config.get("store_file")
    if not store_file:
        raise ValueError(f"the {BACKEND} rendezvous needs rdzv_configs['store_file'] (its store's path in the run directory)")
    return LocalRendezvous(params.run_id, float(params.config.get("timeout", 600)), Path(store_file))


def register() -> None:
    """Make ``rdzv_backend="nxdt-local"`` known to torch elastic (idempotent)."""
    try:
        rendezvous_handler_registry.register(BACKEND, _create)
    except ValueError:  # registered already (a second launch in this process)
        pass
