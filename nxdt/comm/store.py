"""The bootstrap key-value store, served only on the address its clients were told to use, and nxdt's keys in
it signed with the run's secret.

torch's ``TCPStore`` server listens on every interface of the host whatever host name it is given:
during a local run any machine that can reach this one could read and write the job's keys. nxdt
binds the listening socket itself — to the address the clients connect to (127.0.0.1 for local
runs) — and hands it to the store (``master_listen_fd``), so nothing listens anywhere else.

Loopback is still open to every local user, and ``TCPStore`` has no authentication of its own (its wire
protocol carries no credential, and its server accepts inside C++, where nxdt cannot check a peer). So
every value nxdt itself reads back from the store is signed: :class:`SignedKeys` stores ``value ‖
HMAC-SHA256(secret, key ‖ value)`` and a reader accepts only a value whose tag matches, under the key it
asked for (a value cannot be moved to another key or another run). The secret is 32 random bytes made by the
launcher for each launch (``new_secret``) and reaches the workers in ``NXDT_STORE_SECRET`` (hex): the local
launcher writes it to a 0600 file in the private run directory (``nxdt.launch.rundir``), the multi-node
launchers take it from the environment every node shares (Slurm's job script makes one per job). A process
without it can still connect and set keys, but a reader refuses what it wrote: it waits for the genuine value
until its deadline and then says that a value was forged. What remains for such a process is denial of
service (deleting or overwriting keys ends the run with that message), not steering a rank.

That denial of service is closed for local runs (``nxdt train`` on one host): their store is no socket at all but a
torch ``FileStore`` — a file created 0600 in the private (0700) run directory (:func:`create_file_store`), which the
elastic agent and every worker open by path (``NXDT_STORE_FILE``, :func:`connect_store`). Nothing listens, so there
is nothing another process can connect to; the file system is the credential: another user can neither open the file
nor replace it (the launcher refuses a run directory other users may write), and a process of the same user could
read the run's secret and its files anyway. A ``FileStore`` is a full ``dist.Store`` (set, get, wait, check, add,
compare_set, delete_key, multi_get/multi_set, num_keys: what the agent's rank assignment and exit barrier, nxdt's
bootstrap and torch's gloo rendezvous use); its waits poll every 10 ms, which only the bootstrap pays. Several hosts
(torchrun, Slurm) keep the TCP store of torch's documented trusted-network model, with nxdt's keys signed as above.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import torch.distributed as dist

from nxdt.comm.errors import CommError, CommTimeoutError

LOOPBACK = "127.0.0.1"
SECRET_ENV = "NXDT_STORE_SECRET"  # the run's store secret, hex (nxdt's launchers set it for their workers)
STORE_FILE_ENV = "NXDT_STORE_FILE"  # a local run's store: the path of its FileStore (set by nxdt's worker entry)
SECRET_BYTES = 32
_TAG_BYTES = hashlib.sha256().digest_size


class StoreAccessError(CommError):
    """A local run's store file is not private to this user (or its directory is writable by others)."""


class StoreForgeryError(CommError):
    """A key nxdt reads held only values not signed with the run's secret: another process wrote it."""


def new_secret() -> bytes:
    """A fresh per-run secret (the launcher makes one for every launch)."""
    return secrets.token_bytes(SECRET_BYTES)


def secret_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The run's secret from ``NXDT_STORE_SECRET`` (hex, at least 16 bytes), or None when it is unset."""
    value = (os.environ if env is None else env).get(SECRET_ENV)
    if not value:
        return None
    try:
        secret = bytes.fromhex(value.strip())
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise CommError(f"nxdt.comm: {SECRET_ENV} must be at least 32 hex digits (16 random bytes), e.g. `openssl rand -hex 32`")
    return secret


class SignedKeys:
    """nxdt's own keys in a torch ``Store``, each value signed with the run's secret (HMAC-SHA256 over the key and
    the value). ``secret`` None: values are stored as they are (a script under a plain torchrun without
    ``NXDT_STORE_SECRET``: torch's trusted-network model)."""

    def __init__(self, store: dist.Store, secret: bytes | None, timeout_s: float, where: str = "") -> None:
        self.store, self.secret, self.timeout_s, self.where = store, secret, timeout_s, where

    def _tag(self, key: str, value: bytes) -> bytes:
        assert self.secret is not None
        # the key's length first: ("ab", "c") and ("a", "bc") never share a tag
        message = len(key).to_bytes(4, "big") + key.encode() + value
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        self.store.set(key, data if self.secret is None else data + self._tag(key, data))

    def genuine(self, key: str, raw: bytes) -> bytes | None:
        """The value in ``raw`` if its tag is this run's for ``key``, else None."""
        if self.secret is None:
            return raw
        if len(raw) < _TAG_BYTES:
            return None
        value, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
        return value if hmac.compare_digest(tag, self._tag(key, value)) else None

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """The genuine value of ``key``, waiting for it (``timeout_s``, default the store's deadline). A forged value
        is never returned: the reader waits for the writer's genuine one to replace it, and at the deadline raises
        ``StoreForgeryError`` (a forged value was all there was) or ``CommTimeoutError`` (nothing was written)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        forged = False
        while True:
            left = deadline - time.monotonic()
            try:
                self.store.wait([key], timedelta(seconds=max(left, 0.001)))
                value = self.genuine(key, self.store.get(key))
            except RuntimeError as exc:  # the wait's deadline (or the key deleted between wait and get)
                # (a FileStore's timeout is a plain RuntimeError; a lost connection is no timeout)
                if isinstance(exc, dist.DistNetworkError):
                    raise
                if time.monotonic() < deadline:
                    time.sleep(0.01)
                    continue
                if forged:
                    break
                raise CommTimeoutError(f"nxdt.comm: no value for {key!r} in the rendezvous store{self.where}") from exc
            if value is not None:
                return value
            forged = True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        raise StoreForgeryError(
            f"nxdt.comm: the rendezvous store's {key!r} held only values not signed with this run's secret{self.where} "
            f"— another local process wrote it; refused (its value was not used)"
        )


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


def check_store_dir(directory: Path) -> None:
    """``directory`` may hold a store file: it is this user's and nobody else may write it (StoreAccessError)."""
    info = os.stat(directory)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise StoreAccessError(
            f"nxdt: the run directory {directory} (mode {stat.filemode(info.st_mode)}, uid {info.st_uid}) can be written "
            f"by other users, and the run's rendezvous store lives there; `chmod go-w {directory}` or use another directory"
        )


def create_file_store(path: Path, timeout: timedelta) -> dist.FileStore:
    """A local run's store: a new file, 0600, created without following a link (whatever lay at ``path`` — a file
    of an earlier launch that was killed, a link — is removed first, never used), in a directory only this user
    can write."""
    check_store_dir(path.parent)
    path.unlink(missing_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    store = dist.FileStore(str(path), -1)  # -1: no worker count, so no instance deletes the file on its way out
    store.set_timeout(timeout)
    return store


def open_file_store(path: str | Path, timeout: timedelta) -> dist.FileStore:
    """Open a local run's store, only if it is a private regular file of this user in a directory nobody else may
    write (so the file a worker opens is the launcher's: FileStore reopens its path on every operation)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise StoreAccessError(f"nxdt.comm: cannot open the run's store {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise StoreAccessError(
            f"nxdt.comm: the run's store {path} is not a private file of this user (mode {stat.filemode(info.st_mode)}, "
            f"uid {info.st_uid}); refused — start the run again"
        )
    check_store_dir(path.parent)
    store = dist.FileStore(str(path), -1)
    store.set_timeout(timeout)
    return store


def connect_store(addr: str, port: int, timeout: timedelta, env: Mapping[str, str] | None = None) -> dist.Store:
    """A client of the run's store: the local run's file (``NXDT_STORE_FILE``) if set, else the TCP store at
    ``addr:port``."""
    path = (os.environ if env is None else env).get(STORE_FILE_ENV)
    if path:
        return open_file_store(path, timeout)
    return dist.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


class SignedStore(dist.Store):
    """A torch ``Store`` for third-party rendezvous (a torch.distributed process group) whose values are signed as
    :class:`SignedKeys` signs nxdt's own: ``set`` signs, ``get`` returns only a value signed with the run's secret
    (a forged one is waited past, then refused by name). ``add`` counters and key checks pass through unsigned: gloo's
    rendezvous (what ``init_process_group("gloo", store=...)`` does) only sets and gets each rank's address, so a
    process without the secret cannot point a rank at its own socket."""

    def __init__(self, keys: SignedKeys) -> None:
        super().__init__()
        self.keys = keys

    def set(self, key: str, value: str | bytes) -> None:
        self.keys.set(key, value)

    def get(self, key: str) -> bytes:
        return self.keys.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.keys.store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.keys.store.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.keys.store.wait(keys, timeout or timedelta(seconds=self.keys.timeout_s))

    def delete_key(self, key: str) -> bool:
        return self.keys.store.delete_key(key)

    def num_keys(self) -> int:
        return self.keys.store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.keys.timeout_s = timeout.total_seconds()
