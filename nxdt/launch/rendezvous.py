"""The rendezvous of a one-host run: torch elastic's handler interface, a store on loopback, no pickle.

torch's ``c10d`` rendezvous (what torchrun uses) keeps its state in the store as a pickled object and
unpickles whatever it reads back; its ``TCPStore`` and the bootstrap store the agent opens for the
workers listen on every interface. For a job whose ranks all live on this host none of that is
needed: one node, rank 0, a fixed world. ``nxdt-local`` is registered with torch's own handler registry
(the documented extension point) and serves a single store, bound to 127.0.0.1 only, which is both the
agent's store and the workers' bootstrap store. Nothing read from it is unpickled — by nxdt or by the
agent, which only exchanges plain keys with it on this path.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from nxdt.comm.store import LOOPBACK, serve_store

BACKEND = "nxdt-local"


class LocalRendezvous(RendezvousHandler):
    """One node (this host), one store on loopback; the same store across the agent's restarts."""

    def __init__(self, run_id: str, timeout_s: float) -> None:
        self._run_id = run_id
        self._timeout = timedelta(seconds=timeout_s)
        self._store: Store | None = None
        self._port = 0
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store (TORCHELASTIC_USE_AGENT_STORE=True) instead of hosting one

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = serve_store(LOOPBACK, 0, None, self._timeout)
            self._port = self._store.port
        return RendezvousInfo(PrefixStore(self._run_id, self._store), 0, 1, RendezvousStoreInfo(LOOPBACK, self._port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node, never more

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._store = None  # the last reference: the server stops and its socket closes
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous serves one node, not {params.max_nodes}")
    return LocalRendezvous(params.run_id, float(params.config.get("timeout", 600)))


def register() -> None:
    """Make ``rdzv_backend="nxdt-local"`` known to torch elastic (idempotent)."""
    try:
        rendezvous_handler_registry.register(BACKEND, _create)
    except ValueError:  # registered already (a second launch in this process)
        pass
