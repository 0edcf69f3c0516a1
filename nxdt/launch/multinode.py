"""Beyond one host: one torch elastic agent per node, joined by torch's c10d rendezvous.

Every node runs the same command (``nxdt train ... launcher=torchrun``, or ``python -m
nxdt.launch.node RUN_DIR`` under Slurm's srun). Each node's agent is torch's own
``elastic_launch`` with ``rdzv_backend=c10d``; nothing here re-implements a rendezvous.

What nxdt adds on top, and why:

* **Where a node stands in the Plan.** c10d numbers nodes by their address, not by the hardware, so
  the workers re-number themselves once the rendezvous is complete: every node publishes an order
  key — an explicit node rank (``launcher.node_rank``, ``$PET_NODE_RANK``, ``$NODE_RANK``,
  ``$SLURM_NODEID``) or the UltraServer (server_id, node_id) the Neuron runtime reports — and node k
  of the sorted keys runs the Plan's ranks ``k·ranks_per_node …``. Without keys, rendezvous order.
* **The same Plan everywhere.** Nodes also publish the digest of the plan they computed; a node that
  planned something else stops every worker with one line saying so.
* **Addresses that work with several network interfaces (or namespaces).** This node's address is
  the one that routes to the rendezvous endpoint (not whatever the hostname resolves to), and gloo
  uses that interface unless ``GLOO_SOCKET_IFNAME`` says otherwise.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shlex
import socket
import struct
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Sequence

from nxdt.config.validate import ConfigError

WORKER_MODULE = ["-m", "nxdt.launch.worker"]  # the worker as a command, for torchrun and dry runs
NODE_RANK_ENV = ("PET_NODE_RANK", "NODE_RANK", "SLURM_NODEID")
RDZV_ID_ENV = ("PET_RDZV_ID", "SLURM_JOB_ID")
# the Neuron runtime's UltraServer position (set by the EKS/ParallelCluster init scripts)
TOPOLOGY_ENV = ("NEURON_RT_ULTRASERVER_SERVER_ID", "NEURON_RT_ULTRASERVER_NODE_ID")
TOPOLOGY_SYSFS = Path("/sys/class/neuron_device")


class NodeOrderError(RuntimeError):
    """Nodes disagree on their order or on the plan; ``str()`` is the one line shown to the user."""


@dataclass
class NodeSpec:
    """How this node joins the job: everything the agent needs, resolved before it starts."""

    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str  # host:port
    rdzv_id: str
    node_key: list[Any] | None  # ["rank", k] | ["topo", server_id, node_id] | None (rendezvous order)
    node_key_source: str  # where the key came from, for messages
    local_addr: str
    is_host: bool  # this node hosts the rendezvous store (the endpoint is one of its addresses)
    join_timeout_s: float
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)  # set for the agent and its workers

    @property
    def known_node_rank(self) -> int | None:
        return self.node_key[1] if self.node_key and self.node_key[0] == "rank" else None

    def launch_config(self, log_dir: Path, start_method: str = "spawn") -> Any:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.launcher.api import LaunchConfig

        from nxdt.launch.local import shutdown_grace

        return LaunchConfig(
            min_nodes=self.nnodes,
            max_nodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            run_id=self.rdzv_id,
            rdzv_backend="c10d",
            rdzv_endpoint=self.rdzv_endpoint,
            rdzv_configs={"is_host": self.is_host, "join_timeout": int(self.join_timeout_s)},
            local_addr=self.local_addr,
            max_restarts=self.max_restarts,
            monitor_interval=0.2,
            start_method=start_method,
            logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
            **shutdown_grace(),
        )

    def torchrun_command(self, module_args: Sequence[str]) -> list[str]:
        """The torchrun command line that starts the same agent (shown by dry runs)."""
        return [
            "torchrun",
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf=is_host={int(self.is_host)},join_timeout={int(self.join_timeout_s)}",
            f"--local-addr={self.local_addr}",
            f"--max-restarts={self.max_restarts}",
            *module_args,
        ]


# ------------------------------------------------------------------------------------- resolving
def _first_env(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    for name in names:
        if env.get(name, "") != "":
            return name, env[name]
    return None


def split_endpoint(endpoint: str, default_port: int, key: str = "launcher.rdzv_endpoint") -> tuple[str, int]:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep:
        host, port = endpoint.strip(), str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, endpoint, "write it as HOST:PORT, e.g. 10.0.0.1:29500 (the same on every node)")
    return host, int(port)


def topology_key(env: Mapping[str, str], sysfs: Path = TOPOLOGY_SYSFS) -> list[Any] | None:
    """(server_id, node_id) of an UltraServer node, from the Neuron runtime's variables or sysfs."""
    ids = [env.get(name, "") for name in TOPOLOGY_ENV]
    if all(ids):
        return ["topo", ids[0], ids[1]]
    try:
        server = next(iter(sorted(sysfs.glob("server_id_*"))), None)
        node = next(iter(sorted(sysfs.glob("node_id_*"))), None)
        if server is not None and node is not None:
            return ["topo", server.read_text().strip(), node.read_text().strip()]
    except OSError:
        pass
    return None


def route_source(host: str, port: int) -> str:
    """This node's address on the route to ``host`` (a UDP connect sends nothing)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(
            "launcher.rdzv_endpoint",
            f"{host}:{port}",
            f"cannot resolve {host!r} ({exc.strerror}); give an address or a name every node resolves",
        ) from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sockaddr)
        except OSError as exc:
            raise ConfigError(
                "launcher.rdzv_endpoint",
                f"{host}:{port}",
                f"no route from this node to {host} ({exc.strerror}); check the address or set launcher.local_addr",
            ) from None
        return s.getsockname()[0]


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this node (in this network namespace): it can be bound."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
                return True
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    return True  # it exists here (e.g. only the port is taken)
    return False


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 ``addr`` (for GLOO_SOCKET_IFNAME), or None."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == addr:
                return name
    return None


def resolve_node(
    launcher: Any,
    nnodes: int,
    nproc_per_node: int,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    *,
    rdzv_id_required: bool = True,
) -> NodeSpec:
    """This node's part of a multi-node job from ``launcher.*`` (config first, then the environment).
    Raises ConfigError (one line: key, value, fix) for anything missing or malformed."""
    env = os.environ if env is None else env
    if launcher.rdzv_endpoint:
        endpoint, key = launcher.rdzv_endpoint, "launcher.rdzv_endpoint"
    elif env.get("PET_RDZV_ENDPOINT"):
        endpoint, key = env["PET_RDZV_ENDPOINT"], "$PET_RDZV_ENDPOINT"
    elif env.get("MASTER_ADDR"):
        endpoint, key = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT') or launcher.port}", "$MASTER_ADDR"
    else:
        raise ConfigError(
            "launcher.rdzv_endpoint",
            "",
            "set it to HOST:PORT of one node, the same on every node (or export MASTER_ADDR and MASTER_PORT)",
        )
    host, port = split_endpoint(endpoint, launcher.port, key)

    rdzv_id = launcher.rdzv_id or (_first_env(env, RDZV_ID_ENV) or (None, None))[1]
    if not rdzv_id:
        if rdzv_id_required:
            raise ConfigError(
                "launcher.rdzv_id",
                "",
                "give every node the same job id, e.g. launcher.rdzv_id=run42 (it also names the run directory)",
            )
        rdzv_id = "nxdt"
    if not all(c.isalnum() or c in "-_." for c in str(rdzv_id)):
        raise ConfigError("launcher.rdzv_id", rdzv_id, "use letters, digits, '-', '_' and '.' only")

    if launcher.node_rank is not None:
        node_key, source = ["rank", launcher.node_rank], "launcher.node_rank"
    elif (found := _first_env(env, NODE_RANK_ENV)) is not None:
        name, value = found
        if not value.strip().isdigit():
            raise ConfigError(f"${name}", value, "must be this node's rank, an integer in 0..nnodes-1")
        node_key, source = ["rank", int(value)], f"${name}"
    elif (topo := topology_key(env)) is not None:
        node_key, source = topo, "UltraServer (server_id, node_id)"
    else:
        node_key, source = None, "rendezvous order"
    if node_key and node_key[0] == "rank" and not 0 <= node_key[1] < nnodes:
        raise ConfigError(
            source if source.startswith("$") else "launcher.node_rank",
            node_key[1],
            f"must be in 0..{nnodes - 1} (trainer.num_nodes={nnodes})",
        )

    local_addr = launcher.local_addr or route_source(host, port)
    extra: dict[str, str] = {}
    if not env.get("GLOO_SOCKET_IFNAME"):
        ifname = interface_of(local_addr)
        if ifname:
            extra["GLOO_SOCKET_IFNAME"] = ifname  # gloo would otherwise bind what the hostname resolves to
    return NodeSpec(
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        rdzv_endpoint=f"{host}:{port}",
        rdzv_id=str(rdzv_id),
        node_key=node_key,
        node_key_source=source,
        local_addr=local_addr,
        is_host=is_local_address(host),
        join_timeout_s=float(launcher.join_timeout_s),
        max_restarts=max_restarts,
        env=extra,
    )


def check_launcher(cfg: Any, multirun: bool = False) -> None:
    """Launcher settings that can be checked before anything starts."""
    launcher, nodes = cfg.launcher, cfg.trainer.num_nodes
    if launcher.name not in ("local", "torchrun", "slurm"):
        raise ConfigError("launcher", launcher.name, "must be one of local, torchrun, slurm")
    if launcher.name == "local" and nodes > 1:
        raise ConfigError(
            "trainer.num_nodes",
            nodes,
            "launcher=local runs on this host only; run the same command on every "
            "node with launcher=torchrun, or submit it with launcher=slurm",
        )
    if multirun and (launcher.name != "local" or launcher.dry_run):
        raise ConfigError(
            "launcher",
            launcher.name,
            "sweeps (-m) run with launcher=local and no dry run; start one job per "
            "configuration (`nxdt plan -m` shows every job's plan)",
        )
    if launcher.join_timeout_s <= 0:
        raise ConfigError("launcher.join_timeout_s", launcher.join_timeout_s, "must be > 0")
    if not 0 < launcher.port < 65536:
        raise ConfigError("launcher.port", launcher.port, "must be a TCP port in 1..65535")
    if launcher.gpus_per_node is not None and launcher.gpus_per_node < 0:
        raise ConfigError(
            "launcher.gpus_per_node", launcher.gpus_per_node, "must be >= 0 (0 leaves --gpus-per-node out of job.sbatch)"
        )
    if cfg.instance.accelerator != "cpu":  # GPUs: counted here (instance=gpu), present where the run starts now
        from nxdt.launch.devices import resolve_accelerator, visible_gpus

        resolve_accelerator(cfg, visible_gpus(), runs_here=launcher.name != "slurm" and not launcher.dry_run)


def plan_digest(plan: Any) -> str:
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------- ordering
def node_order(records: list[dict[str, Any]]) -> list[int]:
    """Plan node index of each rendezvous node (``records[g]`` published by the agent with group rank g)."""
    n = len(records)
    digests = {r["digest"] for r in records}
    if len(digests) > 1:
        other = next(g for g, r in enumerate(records) if r["digest"] != records[0]["digest"])
        raise NodeOrderError(
            f"nxdt: nodes planned different jobs (node at {records[other]['addr']} vs {records[0]['addr']}): run the "
            "same command, with the same overrides, on every node"
        )
    keys = [r["key"] for r in records]
    if all(k is None for k in keys):
        return list(range(n))
    if any(k is None for k in keys) or len({k[0] for k in keys}) > 1:
        by = ", ".join(f"{r['addr']}: {r['source']}" for r in records)
        raise NodeOrderError(
            f"nxdt: nodes are ordered by different means ({by}): give every node its node rank "
            "(launcher.node_rank or $NODE_RANK), or none"
        )
    if keys[0][0] == "rank":
        ranks = [k[1] for k in keys]
        if sorted(ranks) != list(range(n)):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise NodeOrderError(
                f"nxdt: node ranks {sorted(ranks)} do not number the {n} nodes 0..{n - 1}"
                f"{f' (rank {dup[0]} is given twice)' if dup else ''}: give each node its own launcher.node_rank"
            )
        return ranks
    order = sorted(range(n), key=lambda g: tuple(str(v).zfill(8) for v in keys[g][1:]))
    if len({tuple(k) for k in keys}) < n:
        raise NodeOrderError(
            "nxdt: two nodes report the same UltraServer (server_id, node_id); set launcher.node_rank on each node"
        )
    position = [0] * n
    for place, g in enumerate(order):
        position[g] = place
    return position


def settle_node(
    node_key: list[Any] | None, digest: str, source: str, timeout_s: float, env: MutableMapping[str, str] | None = None
) -> int:
    """In a worker, once the rendezvous is complete: agree on the node order and the plan through the
    agent's store, then set RANK/GROUP_RANK to this node's place in the Plan. Returns the node index."""
    import torch.distributed as dist

    from nxdt.comm.store import SignedKeys, StoreForgeryError, secret_from_env

    environ: MutableMapping[str, str] = os.environ if env is None else env
    lws, local, group = int(environ["LOCAL_WORLD_SIZE"]), int(environ["LOCAL_RANK"]), int(environ["GROUP_RANK"])
    nnodes = int(environ["WORLD_SIZE"]) // lws
    store = dist.TCPStore(
        environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    # the records are signed with the job's secret (NXDT_STORE_SECRET, the same on every node): a record another
    # process planted is refused, it cannot reorder the nodes or pass a plan digest
    keys = SignedKeys(store, secret_from_env(environ), timeout_s, " (the nodes' order)")
    prefix = f"nxdt/nodes/{environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    mine = f"{prefix}/g{group}/attempt{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if local == 0:  # one record per node and rendezvous round (rounds counted, as restart counts may differ by node)
        round_ = (store.add(f"{prefix}/joined", 1) - 1) // nnodes
        keys.set(
            f"{prefix}/r{round_}/{group}",
            json.dumps({"key": node_key, "digest": digest, "source": source, "addr": environ.get("NXDT_LOCAL_ADDR", "?")}),
        )
        keys.set(mine, str(round_))
    try:
        round_ = int(keys.get(mine).decode())
        records = [json.loads(keys.get(f"{prefix}/r{round_}/{g}").decode()) for g in range(nnodes)]
    except StoreForgeryError as exc:
        raise NodeOrderError(f"nxdt: {exc}") from None
    except Exception as exc:  # the store's own timeout: a node died between the rendezvous and here
        raise NodeOrderError(
            f"nxdt: nodes did not publish their order within {timeout_s:g}s ({str(exc).splitlines()[0]})"
        ) from None
    node = node_order(records)[group]
    environ["NXDT_ATTEMPT"] = str(round_)  # the store namespace and resume key of this round, the same on every node
    environ["GROUP_RANK"] = str(node)
    environ["RANK"] = environ["ROLE_RANK"] = str(node * lws + local)
    return node


# ------------------------------------------------------------------------------------- launching
def worker_args(run_dir: Path, spec: NodeSpec, digest: str, console_tty: bool) -> list[str]:
    """The worker's argv (``nxdt.launch.worker.main``; after ``python -m nxdt.launch.worker`` under torchrun)."""
    args = [
        str(run_dir),
        "--node-key",
        json.dumps(spec.node_key),
        "--node-key-source",
        spec.node_key_source,
        "--plan-digest",
        digest,
    ]
    return args + (["--console-tty"] if console_tty else [])


def describe_node(spec: NodeSpec, run_dir: Path, args: Sequence[str]) -> str:
    """What ``launcher.dry_run=true`` prints for one node: the agent, the command, the environment."""
    known = spec.known_node_rank
    lines = [
        f"nxdt: dry run — nothing started, nothing written; the run directory would be {run_dir}",
        f"node: {'rank ' + str(known) if known is not None else 'rank decided after the rendezvous'} of {spec.nnodes} "
        f"(from {spec.node_key_source}{'' if spec.node_key is None or known is not None else ' ' + str(spec.node_key[1:])}), "
        f"{spec.nproc_per_node} workers, address {spec.local_addr}",
        f"rendezvous: c10d at {spec.rdzv_endpoint}, id {spec.rdzv_id}, "
        f"{'hosted by this node' if spec.is_host else 'hosted by another node'}, join timeout {spec.join_timeout_s:g}s",
        "agent: torch.distributed.launcher.api.elastic_launch, the same agent as:",
        "  " + shlex.join(spec.torchrun_command(WORKER_MODULE + list(args))),
        f"worker command: {shlex.join([sys.executable, *WORKER_MODULE, *args])} (nxdt's agent forks it from a server "
        "that has imported torch and Lightning once)",
        "worker environment (set by the agent): RANK LOCAL_RANK GROUP_RANK WORLD_SIZE="
        + str(spec.nnodes * spec.nproc_per_node)
        + f" LOCAL_WORLD_SIZE={spec.nproc_per_node} MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID={spec.rdzv_id}",
    ]
    if spec.env:
        lines.append("environment set by nxdt: " + " ".join(f"{k}={v}" for k, v in sorted(spec.env.items())))
    return "\n".join(lines)


def launch_node(
    run_dir: Path, spec: NodeSpec, args: Sequence[Any], entrypoint: Any = None, server_preload: list[str] | None = None
) -> Any:
    """Run this node's agent until the job ends. Without ``entrypoint`` the workers train (``args``: the
    worker's argv, see ``worker_args``) and are forked from a pre-imported server; otherwise
    ``entrypoint`` is a picklable function (``args``: its arguments; returns {local rank: value}), started fresh, or
    forked from a server that imported ``server_preload`` first (its first module calls ``die_with_agent``)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    from nxdt.comm.store import SECRET_ENV
    from nxdt.launch.forking import ForkServerError
    from nxdt.launch.local import LaunchFailed, LaunchInterrupted, guarded_agent, root_failure

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.update(spec.env)
    os.environ["NXDT_LOCAL_ADDR"] = spec.local_addr  # for messages naming a node
    if not os.environ.get(SECRET_ENV):  # Slurm's job script makes one; torchrun users export the same on every node
        print(
            f"nxdt: {SECRET_ENV} is not set: nxdt's keys in the rendezvous store are not authenticated (torchrun's "
            f"trusted-network model); export the same random value on every node, e.g. "
            f"`export {SECRET_ENV}=$(openssl rand -hex 32)`",
            file=sys.stderr,
            flush=True,
        )
    where = f"node at {spec.local_addr}"
    log_dir = run_dir / "logs" / "agent"
    try:
        with guarded_agent(None, (), fork_server=entrypoint is None or bool(server_preload)):
            if entrypoint is None:
                from nxdt.launch import worker
                from nxdt.launch.forking import START_METHOD, start_fork_server

                start_fork_server()  # after the environment above is set: the workers inherit the server's
                return elastic_launch(spec.launch_config(log_dir, START_METHOD), entrypoint=worker.main)(list(args))
            if server_preload:
                from nxdt.launch.forking import START_METHOD, start_fork_server

                start_fork_server(server_preload)  # its imports overlap the rendezvous
                return elastic_launch(spec.launch_config(log_dir, START_METHOD), entrypoint=entrypoint)(*args)
            return elastic_launch(spec.launch_config(log_dir), entrypoint=entrypoint)(*args)
    except ForkServerError as exc:
        raise LaunchFailed(str(exc)) from None
    except ChildFailedError as exc:
        local_rank, pid, summary = root_failure(exc, single_host=False, agent_logs=log_dir)
        raise LaunchFailed(
            f"nxdt: {where}: worker {local_rank}{f' (pid {pid})' if pid else ''} failed: {summary} — logs in {run_dir / 'logs'}"
        ) from None
    except RendezvousTimeoutError:
        raise LaunchFailed(
            f"nxdt: {where}: the c10d rendezvous at {spec.rdzv_endpoint} (id {spec.rdzv_id}) did not gather "
            f"{spec.nnodes} nodes within {spec.join_timeout_s:g}s — start the same command on every node "
            "(launcher.join_timeout_s)"
        ) from None
    except RendezvousError as exc:
        raise LaunchFailed(
            f"nxdt: {where}: rendezvous at {spec.rdzv_endpoint} failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'see the other nodes'}"
        ) from None
    except (SignalException, KeyboardInterrupt) as exc:
        raise LaunchInterrupted(
            f"nxdt: interrupted ({getattr(exc, 'sigval', 'SIGINT')}); this node's workers stopped — "
            "restart every node with exp_manager.resume_if_exists=true"
        ) from None


def write_atomically(path: Path, text: str) -> None:
    """Every node writes the same run files to the shared directory: a reader never sees half of one."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
