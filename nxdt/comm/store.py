"""The bootstrap key-value store, served only on the address its clients were told to use.

torch's ``TCPStore`` server listens on every interface of the host whatever host name it is given:
during a local run any machine that can reach this one could read and write the job's keys. nxdt
binds the listening socket itself — to the address the clients connect to (127.0.0.1 for local
runs) — and hands it to the store (``master_listen_fd``), so nothing listens anywhere else.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``'s address only (``port`` 0: any free port), listening."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(host: str, port: int, world_size: int | None, timeout: timedelta) -> dist.TCPStore:
    """A ``TCPStore`` server reachable at ``host:port`` and nowhere else (port 0: a free one, see ``.port``)."""
    sock = listening_socket(host, port)
    bound_port = sock.getsockname()[1]
    # the store owns the descriptor from here on (it closes it when the server stops)
    return dist.TCPStore(
        host, bound_port, world_size, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach()
    )
