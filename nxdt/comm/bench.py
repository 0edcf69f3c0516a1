"""``nxdt comm-test``: an nccom-test / nccl-tests style benchmark of nxdt's collectives.

    nxdt comm-test -r 2 -b 1kb -e 64mb -f 4 --check --baseline gloo allr allg
    nxdt comm-test -N 2 -r 4 --rdzv-endpoint HOST:PORT allr      # on each of 2 nodes: 4 ranks in all, 2 per node

The flags mean what they mean for nccom-test: ``-r`` is the total number of ranks and ``-N`` the number
of nodes, the ranks divided equally across them (``-r 64 -N 2``: 32 on each node).

For each op and size it prints ``size(B) count(elems) type time(us) algbw(GB/s) busbw(GB/s)``, with
nccl-tests' bus-bandwidth factors, the single-thread memcpy bandwidth of this host at that size (the
physical reference) and, with ``--baseline gloo``, torch.distributed's gloo collective on the same
sizes in the same processes and the speed-up. Sizes follow nccl-tests: the total buffer (all-gather:
the output; reduce-scatter: the input).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import torch

# nccom-test's vocabulary, shared with the cost model's `nxdt comm-test --estimate` (which must not import torch)
from nxdt.config.validate import output_path_problem, write_output_file
from nxdt.topology.nccom import (
    OP_TITLES,
    OPS,
    OneLineParser,
    algorithm_bands,
    bus_factor,
    layout_text,
    parse_size,
    ranks_per_node,
    report_json,
    sizes,
)

DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}


class DistAdapter:
    """torch.distributed's collectives (gloo on the CPU, NCCL on GPUs) under nxdt's method names, so one call site
    times both."""

    def __init__(self, dist) -> None:
        self.dist = dist

    def all_reduce(self, t, algorithm: str = "auto") -> None:
        self.dist.all_reduce(t)

    def all_gather(self, out, inp) -> None:  # torch 2.13 renamed these (the old names warn)
        getattr(self.dist, "all_gather_single", self.dist.all_gather_into_tensor)(out, inp)

    def reduce_scatter(self, out, inp) -> None:
        getattr(self.dist, "reduce_scatter_single", self.dist.reduce_scatter_tensor)(out, inp)

    def all_to_all(self, out, inp) -> None:
        self.dist.all_to_all_single(out, inp)

    def broadcast(self, t, root: int) -> None:
        self.dist.broadcast(t, root)

    def reduce(self, t, root: int) -> None:
        self.dist.reduce(t, root)

    def send(self, t, peer: int) -> None:
        self.dist.send(t, peer)

    def recv(self, t, peer: int) -> None:
        self.dist.recv(t, peer)


class _Runner:
    """Buffers and one call of an op, for nxdt or gloo."""

    def __init__(
        self,
        op: str,
        nbytes: int,
        dtype: torch.dtype,
        n: int,
        rank: int,
        arena: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``arena``: a shared tensor (``World.shared_empty``) to carve the input buffer from, as a
        training job keeps its communicated buffers there; None: ordinary tensors, on ``device`` (the CPU when None)."""
        elem = dtype.itemsize
        total = max(n, nbytes // elem // n * n)  # divisible by the group size, as nccl-tests rounds
        self.op, self.n, self.rank, self.dtype = op, n, rank, dtype
        self.count = total
        per = total // n
        a_count = per if op == "allg" else total
        self.a = (
            torch.ones(a_count, dtype=dtype, device=device) if arena is None else arena[: a_count * elem].view(dtype).fill_(1)
        )
        self.b = {"allg": total, "redsct": per, "alltoall": total}.get(op)
        if self.b is not None:
            self.b = torch.empty(self.b, dtype=dtype, device=device)
        self.bytes = total * elem

    @staticmethod
    def arena_bytes(maxbytes: int, dtype: torch.dtype, n: int) -> int:
        return max(n, maxbytes // dtype.itemsize // n * n) * dtype.itemsize

    def run(self, comm, algorithm: str = "auto") -> None:
        """One call of the op on ``comm``: an nxdt Communicator or a :class:`DistAdapter`."""
        op, a, b = self.op, self.a, self.b
        if op == "allr":
            comm.all_reduce(a, algorithm=algorithm)
        elif op == "allg":
            comm.all_gather(b, a)
        elif op == "redsct":
            comm.reduce_scatter(b, a)
        elif op == "alltoall":
            comm.all_to_all(b, a)
        elif op == "bcast":
            comm.broadcast(a, 0)
        elif op == "reduce":
            comm.reduce(a, 0)
        else:
            self._pairs(lambda t, p: comm.send(t, p), lambda t, p: comm.recv(t, p))

    def _peer(self) -> int | None:
        # rank r of the first half sends to r + n/2 (on another host when hosts hold consecutive ranks);
        # an odd last rank idles (nccom-test's sendrecv is a ring permute)
        half = self.n // 2
        if self.rank >= 2 * half:
            return None
        return self.rank + half if self.rank < half else self.rank - half

    def _pairs(self, send, recv) -> None:
        peer = self._peer()
        if peer is None:
            return
        if self.rank < peer:
            send(self.a, peer)
        else:
            recv(self.a, peer)

    def check(self, comm) -> int:
        """Exact check with integer-valued inputs; returns the number of wrong elements."""
        r, n = self.rank, self.n
        fill = float(r + 1)
        t = self.a.fill_(fill)  # the timed buffers themselves (shared or not)
        if self.op == "allr":
            comm.all_reduce(t)
            want = torch.full_like(t, n * (n + 1) / 2)
        elif self.op == "allg":
            comm.all_gather(self.b, t)
            t, want = self.b, torch.arange(1, n + 1, dtype=self.dtype, device=self.a.device).repeat_interleave(self.a.numel())
        elif self.op == "redsct":
            comm.reduce_scatter(self.b, t)
            t, want = self.b, torch.full_like(self.b, n * (n + 1) / 2)
        elif self.op == "alltoall":
            comm.all_to_all(self.b, t)
            t, want = (
                self.b,
                torch.arange(1, n + 1, dtype=self.dtype, device=self.a.device).repeat_interleave(self.a.numel() // n),
            )
        elif self.op == "bcast":
            comm.broadcast(t, 0)
            want = torch.ones_like(t)
        elif self.op == "reduce":
            comm.reduce(t, 0)
            want = torch.full_like(t, n * (n + 1) / 2) if r == 0 else t.clone()
        else:
            self._pairs(lambda x, p: comm.send(x, p), lambda x, p: comm.recv(x, p))
            self._pairs(lambda x, p: comm.send(t, p), lambda x, p: comm.recv(t, p))
            peer = self._peer()
            want = torch.full_like(t, float(peer + 1)) if peer is not None and peer < r else t
        return int((t != want).sum())


def _time(fn, iters: int, warmup: int, sync, done: Callable[[], None] = lambda: None) -> float:
    """Seconds per call of ``fn`` after ``warmup`` calls; ``sync`` lines the ranks up before the clock starts, ``done``
    waits for the work queued (a GPU's) before it stops."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    done()
    return (time.perf_counter() - start) / max(1, iters)


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work (nothing on the CPU, whose ops return done)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def memcpy_gbps(nbytes: int, iters: int = 20, device: torch.device = torch.device("cpu")) -> float:
    """One copy's bandwidth at ``nbytes`` on ``device`` (a CPU core's, or the GPU's device-to-device copy)."""
    src = torch.ones(max(1, nbytes // 4), device=device)
    dst = torch.empty_like(src)
    done = device_sync(device)
    elapsed = _time(lambda: dst.copy_(src), iters, 3, done, done)
    return src.numel() * 4 / elapsed / 1e9


def algorithms_ran(
    comm, ops: list[str], dtype: torch.dtype, nbytes: int, algorithm: str = "auto", device: torch.device | None = None
) -> dict[str, str]:
    """Which algorithm each op runs on ``comm`` at ``nbytes``, as recorded by a Tracer around one call."""
    from nxdt.comm.trace import Tracer

    n, rank = comm.size, comm.rank
    out = {}
    for op in ops:
        tracer = Tracer(rank)
        comm.world.set_tracer(tracer)
        try:
            _Runner(op, nbytes, dtype, n, rank, device=device).run(comm, algorithm)
        finally:
            comm.world.set_tracer(None)
        names = [e["args"].get("algorithm", "") for e in tracer.events() if e.get("ph") == "X"]
        out[op] = "+".join(dict.fromkeys(names)) or "none"
    return out


# Ranks one node may start per CPU core it may run on, unless --force: over-subscription is useful (collectives
# between more processes than cores, as the tests do with 4 ranks on 2 cores), thousands of processes are not
# (-r 5000 forked 1,400 processes and 16 GB in 70 s before the host gave out).
RANKS_PER_CORE = 8


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_process_count(per_node: int, force: bool) -> None:
    """ValueError (one line) when ``per_node`` ranks exceed :data:`RANKS_PER_CORE` × this node's usable cores."""
    cores = usable_cores()
    if per_node > RANKS_PER_CORE * cores and not force:
        raise ValueError(
            f"-r: {per_node} ranks on this node is more than {RANKS_PER_CORE} per usable CPU core "
            f"({cores} cores: at most {RANKS_PER_CORE * cores}); use fewer ranks, more nodes (-N), or --force"
        )


# Buffers one rank holds at the largest size: the input (shared arena or plain), the output (all-gather,
# reduce-scatter, all-to-all) and --check's expected values; the shm transport's slots come on top.
BUFFERS_PER_RANK = 3


def mem_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (as ``nxdt.cli.host_available_bytes``; the comm layer does not
    import the CLI); None where there is none."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(per_node: int, maxbytes: int, force: bool) -> None:
    """ValueError (one line) when ``per_node`` ranks × :data:`BUFFERS_PER_RANK` buffers of ``maxbytes`` exceed this
    node's MemAvailable: ``-e 100gb`` would otherwise fork the ranks and let the OOM killer end them (or the host)."""
    available = mem_available()
    need = per_node * BUFFERS_PER_RANK * maxbytes
    if available is not None and need > available and not force:
        raise ValueError(
            f"-e {maxbytes:,} bytes: {per_node} ranks on this node × {BUFFERS_PER_RANK} buffers of that size need "
            f"{need / 2**30:,.1f} GiB, more than the {available / 2**30:,.1f} GiB available (MemAvailable); "
            f"give a smaller -e, fewer ranks, or --force"
        )


def check_device(device: str, baseline: str | None, per_node: int) -> int:
    """The GPUs of this node for ``--device cuda`` (0 for cpu), counted without a CUDA context (the ranks fork after
    this); ValueError naming the fix when there are none, or when the baseline cannot run where the tensors are."""
    if device == "cpu":
        if baseline == "nccl":
            raise ValueError("--baseline nccl times GPU tensors: add --device cuda, or use --baseline gloo on the CPU")
        return 0
    gpus = torch.cuda.device_count()  # through NVML: no CUDA context in this process, whose ranks fork after this
    if gpus == 0:
        raise ValueError(
            "--device cuda: torch sees no CUDA device here (no GPU, no driver, or a CPU-only torch build); "
            "leave out --device to benchmark CPU tensors"
        )
    if baseline == "gloo":
        raise ValueError("--baseline gloo times CPU tensors: with --device cuda use --baseline nccl")
    if baseline == "nccl" and per_node > gpus:
        raise ValueError(
            f"--baseline nccl: NCCL takes one rank per GPU, and {per_node} ranks per node share this node's {gpus} "
            f"GPU(s); run at most {gpus} rank(s) per node, or leave out --baseline"
        )
    return gpus


def _layout(world) -> str:
    return layout_text(world.host_ids)


def rank_device(world, devices: list[str]) -> torch.device:
    """This rank's device: ``devices`` holds each local rank's (``cpu``, or its GPU as training places ranks: the
    caller's placement, ``nxdt.parallel.devices.node_devices``), the local rank counted from the world's host ids."""
    host = world.host_ids[world.rank]
    local_rank = world.host_ids[: world.rank].count(host)
    return torch.device(devices[local_rank] if devices else "cpu")


def _body(world, args: dict) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)  # a communication benchmark, like nccom-test: no autograd anywhere (both libraries alike)
    n, rank = world.world_size, world.rank
    device = rank_device(world, args.get("devices", []))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    done = device_sync(device)
    transport = args.get("transport", "auto")
    comm = (
        world.world if transport == "auto" else world.new_communicator(list(range(n)), f"bench-{transport}", transport=transport)
    )
    dtype = DTYPES[args["datatype"]]
    baseline = None
    if args["baseline"]:  # gloo on the CPU, nccl on GPUs (main() checked the pairing)
        import torch.distributed as dist

        if not dist.is_initialized():
            store = dist.PrefixStore(f"bench-{args['baseline']}", world.store)
            extra = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(args["baseline"], store=store, rank=rank, world_size=n, **extra)
        baseline = DistAdapter(dist)
    out: dict[str, Any] = {
        "results": [],
        "baseline": [],
        "memcpy": {},
        # a CUDA tensor's transport (nccl; cuda_ipc where ranks share a GPU), else the communicator's own
        "transport": comm.transport_on(device),
        "hosts": len(set(world.host_ids)),
        "layout": _layout(world),
    }
    if device.type == "cuda":  # (a CPU run's report keeps the layout --estimate's shares)
        out["device"] = f"cuda ({len(set(args['devices']))} GPUs a node)"
    if args.get("show_algorithm"):
        out["algorithms"] = {
            nbytes: algorithms_ran(comm, args["ops"], dtype, nbytes, args["algorithm"], device)
            for nbytes in sizes(args["minbytes"], args["maxbytes"], args["stepfactor"])
        }
    slowest = torch.zeros(1, dtype=torch.float64)
    arena = None
    if args.get("buffers", "shared") == "shared" and device.type == "cpu":
        arena = world.shared_empty(_Runner.arena_bytes(args["maxbytes"], dtype, n), torch.uint8)
    out["buffers"] = "shared" if arena is not None else "plain"
    for op in args["ops"]:
        for nbytes in sizes(args["minbytes"], args["maxbytes"], args["stepfactor"]):
            run = _Runner(op, nbytes, dtype, n, rank, arena, device)
            iters = args["iters"] if run.bytes < (16 << 20) else max(2, args["iters"] // 4)
            for name, fn in (
                ("results", lambda: run.run(comm, args["algorithm"])),
                ("baseline", (lambda: run.run(baseline)) if baseline else None),
            ):
                if fn is None:
                    continue
                elapsed = _time(fn, iters, args["warmup_iters"], lambda: (done(), comm.barrier()), done)
                slowest.fill_(elapsed)
                comm.all_reduce(slowest, "max")  # a collective takes as long as its slowest rank
                t = float(slowest)
                algbw = run.bytes / t / 1e9
                row = {
                    "op": op,
                    "size(B)": run.bytes,
                    "count(elems)": run.count,
                    "type": args["datatype"],
                    "time:avg(us)": t * 1e6,
                    "algbw(GB/s)": algbw,
                    "busbw(GB/s)": algbw * bus_factor(op, n),
                }
                if name == "results" and args["check"]:
                    wrong = torch.tensor([run.check(comm)], dtype=torch.int64)
                    comm.all_reduce(wrong)  # every rank's result counts, not only rank 0's
                    row["#wrong"] = int(wrong)
                out[name].append(row)
            if rank == 0 and run.bytes not in out["memcpy"]:
                out["memcpy"][run.bytes] = memcpy_gbps(run.bytes, device=device)
    return out if rank == 0 else {}


def _print_table(report: dict, n: int, transport: str, peer: str = "gloo") -> None:
    base = {(r["op"], r["size(B)"]): r for r in report["baseline"]}
    if report.get("hosts", 1) > 1:
        print(f"# {report['hosts']} hosts: {report['layout']}")
    for op in dict.fromkeys(r["op"] for r in report["results"]):
        rows = [r for r in report["results"] if r["op"] == op]
        where = f", {report['device']}" if report.get("device", "cpu") != "cpu" else ""
        print(f"\n# nxdt {OP_TITLES[op]}: {n} ranks{where}, transport {transport}, {report.get('buffers', 'plain')} buffers")
        if "algorithms" in report:
            print("# algorithm: " + algorithm_bands({int(k): v[op] for k, v in report["algorithms"].items()}))
        header = f"#{'size(B)':>12} {'count(elems)':>13} {'type':>6} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'memcpy(GB/s)':>13} {'bus/memcpy':>11}"
        if base:
            header += f" {peer + '(us)':>10} {peer + ' busbw':>11} {'speed-up':>9}"
        if "#wrong" in rows[0]:
            header += f" {'#wrong':>7}"
        print(header)
        for r in rows:
            mc = report["memcpy"].get(r["size(B)"]) or report["memcpy"].get(str(r["size(B)"]), 0.0)
            line = (
                f" {r['size(B)']:>12} {r['count(elems)']:>13} {r['type']:>6} {r['time:avg(us)']:>10.1f} {r['algbw(GB/s)']:>12.3f} "
                f"{r['busbw(GB/s)']:>12.3f} {mc:>13.2f} {r['busbw(GB/s)'] / mc if mc else 0:>11.2f}"
            )
            g = base.get((op, r["size(B)"]))
            if g:
                line += f" {g['time:avg(us)']:>10.1f} {g['busbw(GB/s)']:>11.3f} {g['time:avg(us)'] / r['time:avg(us)']:>8.1f}x"
            if "#wrong" in r:
                line += f" {r['#wrong']:>7}"
            print(line)
        print(f"# Avg bus bandwidth    : {sum(r['busbw(GB/s)'] for r in rows) / len(rows):.3f}")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="nxdt comm-test", description="Benchmark nxdt's collectives (nccom-test style).")
    p.add_argument("ops", nargs="*", default=["allr"], help=f"operations: {' '.join(OPS)} (default allr)")
    p.add_argument(
        "-r",
        "--nworkers",
        type=int,
        default=2,
        help="total number of ranks (processes) over all nodes, as nccom-test's -r; each node runs r / N (default 2)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help=f"start more than {RANKS_PER_CORE} ranks per usable CPU core on a node, or buffers beyond the node's "
        "available memory (refused otherwise)",
    )
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1kb"), help="smallest size, e.g. 1kb")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64mb"), help="largest size, e.g. 64mb")
    p.add_argument("-f", "--stepfactor", type=float, default=4.0, help="multiply the size by this between rows")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations per size")
    p.add_argument("-d", "--datatype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("-c", "--check", action="store_true", help="verify results exactly after timing (adds a #wrong column)")
    p.add_argument(
        "--algorithm", default="auto", help="all-reduce algorithm: auto, direct, slice, ring, rhd, torus[:RxC], hierarchical"
    )
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "p2p", "gloo"),
        default="auto",
        help="the benchmarked communicator's transport (auto: shm on one host, p2p across hosts; gloo: "
        "torch.distributed's collectives)",
    )
    p.add_argument(
        "--separate-hosts",
        action="store_true",
        help="pretend every rank is on its own host (so p2p crosses hosts over gloo point-to-point)",
    )
    p.add_argument(
        "--buffers",
        choices=("shared", "plain"),
        default="shared",
        help="shared: input buffers in nxdt shared memory (World.shared_empty; peers on this host read them in "
        "place, as FSDP's shards are kept); plain: ordinary tensors (copied through the slot)",
    )
    p.add_argument(
        "--baseline",
        choices=("gloo", "nccl"),
        help="also time torch.distributed's collectives on the same sizes, same run: gloo (CPU tensors) or nccl "
        "(--device cuda, one rank per GPU)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the tensors live: cpu, or cuda (each rank on its GPU as training places ranks; nxdt.comm takes "
        "NCCL, or CUDA IPC where ranks share a GPU; the memcpy column is the GPU's device-to-device copy)",
    )
    p.add_argument("--report-to-json-file", metavar="F", help="write the results as JSON (nccom-test's layout)")
    p.add_argument("--show-algorithm", action="store_true", help="print which algorithm each op ran (per size band)")
    multi = p.add_argument_group("several nodes (run the same command on every node; torch elastic c10d rendezvous)")
    multi.add_argument(
        "-N",
        "--nodes",
        "--nnodes",
        dest="nodes",
        type=int,
        default=1,
        help="nodes, as nccom-test's -N: the -r ranks are divided equally across them (-r 64 -N 2: 32 per node)",
    )
    multi.add_argument(
        "--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every node (default $MASTER_ADDR:$MASTER_PORT)"
    )
    multi.add_argument("--rdzv-id", help="job id, the same on every node (default nxdt-comm-test)")
    multi.add_argument(
        "--node-rank", type=int, help="this node's rank (default $NODE_RANK / $SLURM_NODEID, else rendezvous order)"
    )
    multi.add_argument("--local-addr", help="this node's address (default: the one routing to the rendezvous)")
    multi.add_argument("--join-timeout", type=float, default=300.0, help="seconds to wait for every node to join")
    return p


def main(
    argv: list[str] | None = None,
    multinode: Callable[[argparse.Namespace, dict], int] | None = None,
    fork_here: bool = False,
    place: Callable[[int, int], list[str]] | None = None,
) -> int:
    """``multinode(args, opts)``: runs a ``-N > 1`` benchmark (``nxdt.launch.comm_test.main_multinode``). ``place(ranks
    per node, GPUs)``: each local rank's GPU for ``--device cuda`` (the training placement,
    ``nxdt.parallel.devices.node_devices``, which ``nxdt comm-test`` hands in). ``fork_here``:
    the caller is a process of its own that ran no torch operation (the ``nxdt`` program, or a fork made to run one
    command): its ranks are forks of it where ``spawn.can_fork_here`` allows, not of a fork server that would import
    torch again (≈ 5 CPU-s before the first rank starts)."""
    args = build_parser().parse_args(argv)
    bad = [op for op in args.ops if op not in OPS]
    if bad:
        print(f"nxdt comm-test: unknown operation(s) {bad}; choose from {' '.join(OPS)}", file=sys.stderr)
        return 2
    if args.minbytes > args.maxbytes or args.stepfactor <= 1:
        print("nxdt comm-test: need --minbytes <= --maxbytes and --stepfactor > 1", file=sys.stderr)
        return 2
    problem = args.report_to_json_file and output_path_problem(args.report_to_json_file)
    if problem:  # before anything runs
        print(f"nxdt comm-test: --report-to-json-file {args.report_to_json_file!r} {problem}", file=sys.stderr)
        return 2
    try:
        per_node = ranks_per_node(args.nworkers, args.nodes)
        check_process_count(per_node, args.force)
        if args.device == "cpu":  # GPU buffers live in GPU memory
            check_memory(per_node, args.maxbytes, args.force)
        gpus = check_device(args.device, args.baseline, per_node)
    except ValueError as exc:
        print(f"nxdt comm-test: {exc}", file=sys.stderr)
        return 2
    from nxdt.comm.spawn import RankFailed, can_fork_here, run_local

    host_ids = [f"host{r}" for r in range(args.nworkers)] if args.separate_hosts else None
    opts = {
        k: getattr(args, k)
        for k in (
            "ops",
            "minbytes",
            "maxbytes",
            "stepfactor",
            "iters",
            "warmup_iters",
            "datatype",
            "check",
            "algorithm",
            "baseline",
            "show_algorithm",
            "buffers",
            "transport",
            "device",
        )
    }
    if args.device == "cuda":
        if place is None:  # the placement policy is a higher layer's: `nxdt comm-test` hands it in
            print(
                "nxdt comm-test: --device cuda runs through the launcher: use `nxdt comm-test --device cuda ...`", file=sys.stderr
            )
            return 2
        opts["devices"] = place(per_node, gpus)
    if args.nodes > 1:
        if multinode is None:  # the node agents are the launcher's (a higher layer): `nxdt comm-test` hands them in
            print("nxdt comm-test: -N > 1 runs through the launcher: use `nxdt comm-test -N ...`", file=sys.stderr)
            return 2
        return multinode(args, opts)
    try:
        report = run_local(
            _body,
            args.nworkers,
            opts,
            timeout_s=3600,
            comm_timeout_s=300,
            host_ids=host_ids,
            fork_here=fork_here and can_fork_here(_body),
        )[0]
    except RankFailed as exc:
        print(f"nxdt comm-test: {exc}", file=sys.stderr)
        return 1
    return finish(report, args)


def finish(report: dict, args: argparse.Namespace) -> int:
    n = args.nworkers  # the total, as nccom-test counts it
    _print_table(report, n, report.get("transport", args.transport), args.baseline or "gloo")
    if args.report_to_json_file:
        text = report_json(report, n, args.nodes, report.get("transport", args.transport))
        try:
            write_output_file(args.report_to_json_file, text.encode())
        except (OSError, ValueError) as exc:
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            print(f"nxdt comm-test: --report-to-json-file {args.report_to_json_file!r}: {what}", file=sys.stderr)
            return 2
    wrong = sum(r.get("#wrong", 0) for r in report["results"])
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
