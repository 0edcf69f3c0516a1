"""Errors raised by nxdt collectives: every one names the group, the op and its sequence number."""

from __future__ import annotations


class CommError(RuntimeError):
    """A collective failed; the communicator that raised it is unusable afterwards."""


class CommTimeoutError(CommError):
    """A wait passed its deadline (``comm.timeout_s``); the message names the ranks that did not arrive.

    ``stuck_pids``: rank -> process id of those ranks where the transport knows it (members on this host,
    from their shared-memory headers), so a launcher can deal with a peer that cannot stop by itself.
    ``missing_ranks``: the ranks that never joined, when the wait was the join itself (``init_process``)."""

    def __init__(self, message: str, stuck_pids: dict[int, int] | None = None, missing_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.stuck_pids = {rank: pid for rank, pid in (stuck_pids or {}).items() if pid > 0}
        self.missing_ranks = list(missing_ranks or [])


class CommMismatchError(CommError):
    """Ranks called different collectives (op, dtype, count or root differ) at the same sequence number."""


class PeerDiedError(CommError):
    """A member process of the group exited while the others waited for it."""
