"""Errors raised by nxdt collectives: every one names the group, the op and its sequence number."""


class CommError(RuntimeError):
    """A collective failed; the communicator that raised it is unusable afterwards."""


class CommTimeoutError(CommError):
    """A wait passed its deadline (``comm.timeout_s``); the message names the ranks that did not arrive."""


class CommMismatchError(CommError):
    """Ranks called different collectives (op, dtype, count or root differ) at the same sequence number."""


class PeerDiedError(CommError):
    """A member process of the group exited while the others waited for it."""
