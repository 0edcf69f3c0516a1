"""nxdt's own collective-communication library.

Communicators over groups of ranks with all-reduce, all-gather, reduce-scatter, all-to-all (uneven
splits), broadcast, reduce, send/recv and barrier; blocking or async on named streams with
``after=`` ordering; transports behind one interface (:mod:`nxdt.comm.transport`): shared memory on
one host, point-to-point links (torch.distributed across hosts), and torch.distributed's gloo. Every wait has a deadline and names the ranks that did not arrive. Knows nothing of
the planner: it is given ranks and names (and, to rehearse on CPU, an :class:`EmulatedLink` per
communicator). Streams have priorities (TP before FSDP, :mod:`nxdt.comm.stream`); a :class:`Tracer`
records every collective as a Chrome-trace event.
"""

from nxdt.comm.emulate import EmulatedLink
from nxdt.comm.errors import CommError, CommMismatchError, CommTimeoutError, PeerDiedError
from nxdt.comm.shm import cleanup_run, remove_stale_segments
from nxdt.comm.stream import Work
from nxdt.comm.trace import Tracer
from nxdt.comm.transport import Transport, register_transport
from nxdt.comm.world import Communicator, World, host_identity, init_from_env, init_process

__all__ = [
    "CommError",
    "CommMismatchError",
    "CommTimeoutError",
    "PeerDiedError",
    "Communicator",
    "World",
    "Work",
    "EmulatedLink",
    "Tracer",
    "Transport",
    "register_transport",
    "cleanup_run",
    "remove_stale_segments",
    "host_identity",
    "init_from_env",
    "init_process",
]
