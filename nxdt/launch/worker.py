"""Worker entry point: ``main([RUN_DIR, ...])``, started by the elastic agent (or ``python -m
nxdt.launch.worker RUN_DIR`` under a plain torchrun).

Reads the resolved config and the plan from the run directory (never re-enters Hydra), sends this
rank's output to ``logs/rank<k>.log`` (rank 0 also to the console, unless ``nxdt train -q``; third-party
banners and deprecation warnings reach its log only, see ``nxdt.launch.console``), then trains.

nxdt's agents fork workers from a multiprocessing fork server that has already imported torch and
Lightning (:mod:`nxdt.launch.forking`).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.errors import record

from nxdt.launch.forking import die_with_agent


def _redirect_output(log_path: Path, tee_to_console: bool) -> Callable[[], None]:
    """Point fds 1 and 2 at the rank's log file (through a tee thread for rank 0), so output of
    C++ code and subprocesses is captured too, not only Python's. Returns the function that ends the
    tee: it flushes, lets the tee drain, and leaves fds 1 and 2 on the log file alone."""
    log = open(log_path, "ab", buffering=0)
    sys.stdout.flush()
    sys.stderr.flush()
    if not tee_to_console:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)

        def flush() -> None:
            sys.stdout.flush()
            sys.stderr.flush()

        return flush
    console = os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    done_r, done_w = os.pipe()  # written by drain(): this process writes no more into the pipe

    def copy(chunk: bytes) -> None:
        log.write(chunk)
        os.write(console, chunk)

    def pump() -> None:
        while True:
            ready = select.select([read_end, done_r], [], [])[0]
            if read_end in ready:
                if not (chunk := os.read(read_end, 65536)):
                    return
                copy(chunk)
                continue
            # drain() moved fds 1 and 2 to the log: all this process wrote is in the pipe now. A subprocess that
            # inherited them (W&B's service, ClearML's monitor) may hold the pipe open past this process's end, so
            # copy what is there and stop rather than wait for end-of-file (drain's join sat out its whole timeout)
            os.set_blocking(read_end, False)
            try:
                while chunk := os.read(read_end, 65536):
                    copy(chunk)
            except BlockingIOError:
                pass
            return

    thread = threading.Thread(target=pump, name="nxdt-tee", daemon=True)
    thread.start()

    def drain() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        os.write(done_w, b"x")
        thread.join(timeout=2)

    return drain


def reset_signals() -> None:
    """The dispositions a worker starts from, whoever forked it: the fork server's children get Python's defaults
    (KeyboardInterrupt on SIGINT, the others default), a worker forked by its agent would inherit the agent's
    handlers (torch elastic's, which raise its SignalException). Ctrl-C reaches every process of the terminal's
    group, so both kinds of worker must take it the same way."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def die_on_sigterm() -> None:
    """SIGTERM ends the worker at once, as the signal's default would. The agent sends it to stop the workers
    that outlive a failed peer — those are stuck in a collective or hung — and Lightning's own handler only
    notes it for the next step, so the agent would wait its full 30 s before SIGKILL. Lightning keeps a handler
    that was there before it and calls it after its own."""

    def die(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, die)


def _comm_timeout(exc: BaseException | None) -> BaseException | None:
    """The ``CommTimeoutError`` behind ``exc`` (itself, or in its chain of causes), if any."""
    from nxdt.comm import CommTimeoutError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CommTimeoutError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _stopped_sibling(pid: int) -> int | None:
    """A pidfd of ``pid`` if it is a stopped (SIGSTOP, state T) worker of this job: a child of our own parent
    (the agent's fork server, or the agent) with our user id. The pidfd is opened before the checks and the
    signal goes through it, so the process checked is the process signalled even if ``pid`` is reused."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already, or no pidfd on this platform
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "(comm)", which may hold spaces: state, ppid, ...
        same_user = os.stat(f"/proc/{pid}").st_uid == os.getuid()
        if fields[0] == b"T" and int(fields[1]) == os.getppid() != 1 and same_user:
            return fd
    except (OSError, IndexError, ValueError):
        pass
    os.close(fd)
    return None


def kill_stopped_peers(exc: BaseException, rank: int) -> list[int]:
    """After a collective timed out: SIGKILL the ranks it waited for that are stopped worker processes of this
    job on this host. A stopped process cannot act on the agent's SIGTERM, so the agent would wait its 30 s
    shutdown grace before killing it; killing it now ends the job at ``comm.timeout_s``. Peers that are alive
    but stuck are left to the agent's SIGTERM (they die at once, ``die_on_sigterm``), keeping their own error
    if they get to write one. Returns the ranks killed."""
    timeout = _comm_timeout(exc)
    killed = []
    for peer, pid in sorted(getattr(timeout, "stuck_pids", {}).items()):
        fd = _stopped_sibling(pid)
        if fd is None:
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            killed.append(peer)
            print(
                f"nxdt: rank {rank}: rank {peer} (pid {pid}) is stopped (SIGSTOP) and cannot act on the agent's SIGTERM; "
                f"killed it (SIGKILL) so the job ends now",
                flush=True,
            )  # fds 1 and 2: the rank's log by now
        except OSError:
            pass
        finally:
            os.close(fd)
    return killed


def main(argv: list[str] | None = None) -> None:
    """The agent's entry point: train (``_main``, whose error record is written on the way out), then, if a
    collective timed out because of a stopped peer, kill that peer — after this rank's error is on record,
    so the launcher's headline can say why the peer died."""
    try:
        _main(argv)
    except Exception as exc:
        kill_stopped_peers(exc, int(os.environ.get("RANK", "-1")))
        raise


@record
def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nxdt.launch.worker")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--console-tty", action="store_true", help="the launcher's console is a terminal (live progress bar)")
    parser.add_argument("--local-store", action="store_true", help="the run's store is the run directory's store file")
    parser.add_argument("--node-key", default=None, help="multi-node: this node's order key (JSON), see nxdt.launch.multinode")
    parser.add_argument("--node-key-source", default="rendezvous order")
    parser.add_argument("--plan-digest", default=None, help="multi-node: digest of the plan this node's launcher computed")
    args = parser.parse_args(argv)
    die_with_agent()
    reset_signals()
    die_on_sigterm()
    from nxdt.comm.store import SECRET_ENV, STORE_FILE_ENV
    from nxdt.launch.rundir import STORE_FILE, read_store_secret

    secret = read_store_secret(args.run_dir)  # a local launch's; several nodes share theirs in the environment
    if secret is not None:  # this process's environment only (0400 in /proc): what nxdt.comm and exp_manager read
        os.environ[SECRET_ENV] = secret.hex()
    if args.local_store:  # a local launch: the store is a private file (nxdt.launch.rendezvous), not MASTER_ADDR:PORT
        os.environ[STORE_FILE_ENV] = str(args.run_dir.resolve() / STORE_FILE)
    if args.plan_digest is not None:  # several nodes: take this node's place in the Plan before anything names a rank
        from nxdt.launch.multinode import settle_node

        settle_node(json.loads(args.node_key), args.plan_digest, args.node_key_source, timeout_s=120.0)
    from nxdt.launch import console

    rank = int(os.environ["RANK"])
    log_path = args.run_dir / "logs" / f"rank{rank}.log"
    on_console = rank == 0 and console.mode() != "quiet"
    end_output = _redirect_output(log_path, tee_to_console=on_console)
    log_only = console.worker_output(log_path, console=on_console)
    attempt = os.environ.get("NXDT_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    now = time.time()
    print(
        f"nxdt: rank {rank} attempt {attempt} started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}"
        f".{int(now % 1 * 1000):03d} (pid {os.getpid()}, parent {os.getppid()})",
        file=log_only,
        flush=True,
    )
    try:
        _train(args, rank)
    except Exception:
        # into the rank's log (verbose: also on the console, while rank 0's tee still reaches it); the launcher names
        # the rank that failed first, its error and its log in one line
        traceback.print_exc(file=log_only)
        log_only.flush()
        raise
    finally:
        end_output()  # a forked worker ends without atexit handlers: the tee is drained here


def _train(args: argparse.Namespace, rank: int) -> None:
    if args.plan_digest is not None:
        from nxdt.comm.world import host_identity

        print(
            f"nxdt: rank {rank} is on node {os.environ['GROUP_RANK']} (node order: {args.node_key_source}), "
            f"host {host_identity()}, address {os.environ.get('NXDT_LOCAL_ADDR', '?')}",
            flush=True,
        )
    if args.console_tty and rank == 0:
        os.environ["FORCE_COLOR"] = "1"  # rich: the console at the end of the tee is a terminal
        os.environ["TTY_INTERACTIVE"] = "1"
        os.environ["NXDT_CONSOLE_TTY"] = "1"  # exp_manager: a live progress bar

    import torch

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)  # ranks share this host's cores
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # and Lightning's launcher keeps it (it sets its own if unset)

    from nxdt.config import load_run_config
    from nxdt.lightning.train import run_training
    from nxdt.launch.rundir import CONFIG_FILE, PLAN_FILE
    from nxdt.planner import Plan

    cfg = load_run_config(args.run_dir / CONFIG_FILE)
    plan = Plan.load(args.run_dir / PLAN_FILE)
    run_training(cfg, plan, args.run_dir)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception:  # printed and recorded by main already: exit 1 without a second traceback
        sys.exit(1)
