"""What a run directory tells about its run, read from its files alone: ``nxdt runs``, the launcher's summary
and ``nxdt report`` share it.

The launcher writes ``status.json`` when a job starts (``running``, its pid, the command) and when it ends
(``finished``, ``failed`` or ``interrupted`` with the reason). A run whose status still says ``running`` is
running only while that launcher lives and holds the run's ``.lock``; if the launcher was killed (SIGKILL,
a host going down) the run is shown ``interrupted``. Directories without ``status.json`` (another launcher,
an older nxdt) are ``finished`` when ``metrics.csv`` reached ``trainer.max_steps``, else ``unknown``.

Pure Python (csv, json, yaml): listing runs imports neither torch nor Lightning.
"""

from __future__ import annotations

import collections
import csv
import json
import os
import re
import socket
import stat
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from nxdt.data.throughput import run_step_time_s, run_tokens_per_s

STATUS_FILE, METRICS_FILE, LOCK_FILE = "status.json", "metrics.csv", ".lock"
STATES = ("running", "finished", "failed", "interrupted", "unknown")
# sub-directories of a run directory that never hold runs (not walked when listing)
_RUN_PARTS = {"checkpoints", "logs", "tensorboard", "trace", "report"}
# The most nxdt reads of one run file: a run's own status.json, plan.json and config.yaml are a few KB, its
# metrics.csv ~100 bytes a logged step (64 MiB: over 500,000 steps). A larger file is someone else's, not read.
RUN_FILE_LIMIT = 64 << 20
# one entry per launch into a run directory, ``<n>-<time>`` (written by nxdt.launch.rundir.record_history)
HISTORY_DIR, STAMP = "config-history", "%Y-%m-%d_%H-%M-%S"


class RunFileError(OSError):
    """A run file nxdt will not read: a link, not a regular file (a FIFO would block the reader), or too large."""


def read_run_file(path: Path, limit: int = RUN_FILE_LIMIT) -> bytes:
    """The bytes of a small regular file in a run directory, opened without following a link at its last
    component (O_NOFOLLOW) and without blocking on a FIFO (O_NONBLOCK, then fstat of what was opened: no race
    between a check and the open), at most ``limit`` bytes. Run directories can be crafted by anyone who can
    write there (a shared exp_dir); what ``nxdt runs`` / ``report`` read from them must not hang, follow a link
    out of the run, or fill memory. Raises :class:`RunFileError` (an OSError) for what it refuses."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RunFileError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise RunFileError(f"{path} is {info.st_size} bytes, more than the {limit} nxdt reads of a run file")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # grew since fstat
            raise RunFileError(f"{path} is more than the {limit} bytes nxdt reads of a run file")
        return data
    finally:
        os.close(fd)


def read_run_text(path: Path, limit: int = RUN_FILE_LIMIT) -> str:
    """:func:`read_run_file` decoded as UTF-8 (undecodable bytes replaced: a binary file reads as garbage text,
    which the parsers then refuse, never as a traceback)."""
    return read_run_file(path, limit).decode("utf-8", errors="replace")


def open_out_dir(path: Path) -> int:
    """A descriptor of directory ``path`` (created if missing) for :func:`write_into`; a link at its last
    component is refused (RunFileError), whether crafted in a run (``report/`` → elsewhere) or not."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # ELOOP: a link; ENOTDIR: a file
        what = "a symbolic link" if path.is_symlink() else "not a directory"
        raise RunFileError(f"{path} is {what}; nxdt writes only into a real directory") from exc


def write_into(dir_fd: int, name: str, data: bytes) -> None:
    """File ``name`` in the directory open as ``dir_fd`` holds ``data``: written to a new file (O_EXCL and
    O_NOFOLLOW: never through a planted link) renamed over ``name``. The rename replaces a link or a hard link
    that stood there instead of writing through it into the file it names."""
    tmp = f".{name}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


# C0 and C1 control characters, DEL and the ANSI escape sequences they start (CSI, OSC): what a crafted
# status.json could use to move the cursor, retitle the terminal or hide text
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(value: Any, limit: int = 500) -> str:
    """``value`` as text safe for a terminal: escape sequences and control characters (newline and tab
    included) shown as ``?``, at most ``limit`` characters. Every string nxdt prints from a run file goes
    through it."""
    text = _CONTROL.sub("?", str(value)).replace("\n", " ").replace("\t", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b`` of a Config object or of the mapping loaded from config.yaml."""
    for part in dotted.split("."):
        if cfg is None:
            return default
        cfg = cfg.get(part) if isinstance(cfg, dict) else getattr(cfg, part, None)
    return default if cfg is None else cfg


# ---------------------------------------------------------------- status.json


def write_status(run_dir: Path, status: str, **fields: Any) -> None:
    """Record the job's state in ``status.json`` (atomically: a reader never sees half a file). ``running``
    starts a new record (this launcher's pid, start time); the other states complete it."""
    run_dir = Path(run_dir)
    path = run_dir / STATUS_FILE
    record: dict[str, Any] = {}
    if status != "running":
        record = read_status(run_dir) or {}
    else:
        record = {
            "started": _iso(time.time()),
            "started_at": round(time.time(), 3),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
    record.update(status=status, **fields)
    if status != "running":
        record["ended"] = _iso(time.time())
        record["ended_at"] = round(time.time(), 3)
    tmp = path.with_name(f".{STATUS_FILE}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(read_run_text(Path(run_dir) / STATUS_FILE, 1 << 20))
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def pid_alive(pid: int) -> bool:
    """A running process (a zombie, exited but not reaped, is not). nxdt.comm.waiting has the same check;
    it is repeated here so that listing runs does not import torch."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def lock_held(run_dir: Path) -> bool | None:
    """Whether some process holds the run's ``.lock`` (``/proc/locks``); None when that cannot be told."""
    try:
        inode = (Path(run_dir) / LOCK_FILE).stat().st_ino
        locks = Path("/proc/locks").read_text()
    except OSError:
        return None
    for line in locks.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(inode):
            return True
    return False


def run_state(run_dir: Path, record: dict[str, Any] | None, last_step: int | None, max_steps: int | None) -> tuple[str, str]:
    """(status, detail) of a run: see the module doc."""
    if record and record.get("status") in STATES:
        state = record["status"]
        if state != "running":
            return state, printable(record.get("reason") or "")
        pid = record.get("pid")
        # a pid is a positive C int (os.kill raises OverflowError beyond it: 2**80 in a crafted file)
        valid_pid = isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31
        here = record.get("host", socket.gethostname()) == socket.gethostname()
        alive = isinstance(pid, int) and valid_pid and here and pid_alive(pid)
        if alive and lock_held(run_dir) is not False:
            return "running", f"launcher pid {pid}"
        if record.get("host") not in (None, socket.gethostname()):
            return "unknown", f"launched on {printable(record['host'], 80)}"
        shown = pid if valid_pid else printable(pid, 40)
        return "interrupted", f"the launcher (pid {shown}) is gone without recording an end: killed?"
    if last_step is not None and max_steps and last_step >= max_steps:
        return "finished", "no status.json: metrics.csv reached trainer.max_steps"
    return "unknown", "no status.json"


# ---------------------------------------------------------------- metrics, checkpoints, layout


# metrics.csv is streamed, never read whole: the most bytes read of it (~10 million logged steps), and the most
# rows kept in memory. Beyond METRICS_ROWS_KEPT rows, rows are thinned evenly (every 2nd, 4th, ... row of each
# kind: rows with the same filled columns, so the sparse validation rows are thinned among themselves, not lost),
# the first and the last row always kept: a 1M-row file then costs ~10 MB and a few seconds, not ~1 GB and 30 s.
METRICS_LIMIT = 1 << 30
METRICS_ROWS_KEPT = 20_000
_LINE_LIMIT = 1 << 20  # characters read per line at most: a file without newlines never becomes one huge string


def _metric_lines(fh: Any, limit: int) -> Iterator[str]:
    """Lines of ``fh`` (each at most _LINE_LIMIT characters, NUL bytes dropped: they would stop the csv module on a
    binary file, whose rows are garbage either way) until ``limit`` characters have been read."""
    read = 0
    while read < limit:
        line = fh.readline(_LINE_LIMIT)
        if not line:
            return
        read += len(line)
        yield line.replace("\x00", "")


def read_metrics(run_dir: Path, keep: int = METRICS_ROWS_KEPT) -> list[dict[str, float]]:
    """metrics.csv as numbers, in step order: blank cells (FSDP columns of other runs) are left out, a torn last
    line (a crash mid-write) and rows that are not numbers are skipped. Streamed with bounded memory (at most
    ``keep`` rows kept, thinned evenly beyond that: METRICS_ROWS_KEPT); opened as :func:`read_run_file` opens
    (no link followed, no FIFO blocked on)."""
    path = Path(run_dir) / METRICS_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    with open(fd, encoding="utf-8", errors="replace", newline="") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        reader = csv.reader(_metric_lines(fh, METRICS_LIMIT))
        header: list[str] = []
        stride, seen = 1, dict[tuple[bool, ...], int]()  # rows seen per kind (which cells are filled)
        kept: list[tuple[int, dict[str, float]]] = []
        tail: collections.deque[list[str]] = collections.deque(maxlen=8)  # the last row: the newest that parses
        try:
            header = next(reader, [])
            for raw in reader:
                tail.append(raw)
                kind = tuple(map(bool, raw))
                n = seen.get(kind, 0)
                seen[kind] = n + 1
                if n % stride:  # converted only when kept: most rows of a long file are only counted
                    continue
                row = _metric_row(header, raw)
                if row is not None:
                    kept.append((n, row))
                    if len(kept) > keep:
                        stride *= 2
                        kept = [(i, r) for i, r in kept if i % stride == 0]
        except csv.Error:  # e.g. a field over the csv module's limit: the rows read so far stand
            pass
    rows = [r for _, r in kept]
    last = next((r for r in map(lambda raw: _metric_row(header, raw), reversed(tail)) if r is not None), None)
    if last is not None and (not rows or rows[-1] != last):
        rows.append(last)
    return rows


def _metric_row(header: list[str], raw: list[str]) -> dict[str, float] | None:
    """One metrics.csv row as {column: number} (blank cells left out); None unless every cell is a number and the
    row has a finite step."""
    try:
        row = {k: float(v) for k, v in zip(header, raw) if k and v != ""}
    except ValueError:
        return None
    return row if "step" in row and _finite_step(row["step"]) else None


def _finite_step(step: float) -> bool:
    return step == step and abs(step) < 2**53


def launch_starts(run_dir: Path) -> list[float]:
    """When each launch into the run directory began (epoch seconds, from its config history's entry names; whole
    seconds, rounded down: still before that launch's first step). Empty without a history."""
    starts = []
    try:
        entries = [p.name for p in (Path(run_dir) / HISTORY_DIR).iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
    for name in entries:
        number, _, stamp = name.partition("-")
        try:
            if number.isdigit():
                starts.append(time.mktime(time.strptime(stamp, STAMP)))
        except (ValueError, OverflowError):
            continue
    return sorted(starts)


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``checkpoints/step-<N>`` (``done`` marker; damaged ones moved aside and temporary
    directories are none)."""
    found = []
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    for p in root.iterdir():
        if p.name.startswith("step-") and ".damaged" not in p.name and (p / "done").is_file():
            try:
                found.append((int(p.name.split("-", 1)[1]), p))
            except ValueError:
                continue
    return max(found)[1] if found else None


def load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:  # libyaml's parser when PyYAML has it (the same safe rules, ~10x faster: every launch's summary reads one)
        data = yaml.load(read_run_text(Path(path), 8 << 20), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def load_plan(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_run_text(Path(run_dir) / "plan.json", 8 << 20))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def fsdp_text(cfg: Any) -> str:
    if not get(cfg, "distributed_strategy.fsdp.enabled", False):
        return "FSDP off"
    return f"FSDP {get(cfg, 'distributed_strategy.fsdp.prefetch', '?')}"


def layout_line(plan: Any, cfg: Any) -> str:
    """The whole layout in one line: world, every degree, FSDP policy, ZeRO-1, instance, precision."""
    d = get(plan, "degrees", {}) or {}
    world, nodes = get(plan, "world_size", "?"), get(plan, "num_nodes", 1)
    where = f"{nodes} × {get(plan, 'instance', '?')}" if nodes != 1 else f"{get(plan, 'instance', '?')}"
    degrees = " ".join(f"{k.upper()}{d.get(k, 1)}" for k in ("tp", "pp", "dp", "cp", "ep"))
    extras = [fsdp_text(cfg)]
    if get(cfg, "distributed_strategy.zero1", False):
        extras.append("ZeRO-1")
    if get(cfg, "distributed_strategy.sequence_parallel", False) and d.get("tp", 1) > 1:
        extras.append("SP")
    precision = get(cfg, "precision.type")
    return " · ".join([f"{world} ranks on {where}", degrees, *extras, *([precision] if precision else [])])


def layout_short(plan: Any, cfg: Any) -> str:
    """The layout for a table cell: world × instance and the degrees above 1 (``2×cpu DP2``)."""
    d = get(plan, "degrees", {}) or {}
    if not d:
        return "?"
    parts = [f"{get(plan, 'world_size', '?')}×{get(plan, 'instance', '?')}"]
    parts += [f"{k.upper()}{d[k]}" for k in ("tp", "pp", "dp", "cp", "ep") if d.get(k, 1) > 1]
    if get(cfg, "distributed_strategy.fsdp.enabled", False):
        parts.append("FSDP")
    elif get(cfg, "distributed_strategy.zero1", False):
        parts.append("ZeRO-1")
    return " ".join(parts)


def median(rows: list[dict[str, float]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------- one run, and all runs under a directory


@dataclass
class Run:
    path: Path
    name: str
    config: dict[str, Any]
    plan: dict[str, Any]
    rows: list[dict[str, float]]
    record: dict[str, Any] | None
    status: str = "unknown"
    detail: str = ""
    checkpoint: Path | None = None
    overrides: list[str] = field(default_factory=list)
    launches: list[float] = field(default_factory=list)  # launch_starts

    @property
    def max_steps(self) -> int | None:
        return get(self.config, "trainer.max_steps")

    @property
    def last_step(self) -> int | None:
        return int(self.rows[-1]["step"]) if self.rows else None

    @property
    def last_loss(self) -> float | None:
        return self.rows[-1].get("loss") if self.rows else None

    @property
    def first_loss(self) -> float | None:
        return self.rows[0].get("loss") if self.rows else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens trained per second of training steps, start-up left out (nxdt.data.throughput)."""
        return run_tokens_per_s(self.rows, self.launches)

    @property
    def step_time_s(self) -> float | None:
        """Mean step time over the same steps as :attr:`tokens_per_s`."""
        return run_step_time_s(self.rows, self.launches)

    @property
    def started(self) -> str:
        if self.record and self.record.get("started"):
            return printable(self.record["started"]).replace("T", " ")[:16]
        try:  # the run directory's timestamp name, else when its config was written
            return time.strftime("%Y-%m-%d %H:%M", time.strptime(self.path.name[:19], "%Y-%m-%d_%H-%M-%S"))
        except ValueError:
            pass
        try:
            return time.strftime("%Y-%m-%d %H:%M", time.localtime((self.path / "config.yaml").stat().st_mtime))
        except OSError:
            return "?"

    @property
    def layout(self) -> str:
        return printable(layout_short(self.plan, self.config), 120)

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": str(self.path),
            "name": self.name,
            "started": self.started,
            "status": self.status,
            "detail": self.detail,
            "layout": self.layout,
            "last_step": self.last_step,
            "max_steps": self.max_steps,
            "last_loss": self.last_loss,
            "tokens_per_s": self.tokens_per_s,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
        }


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / "plan.json").is_file()


def load_run(path: Path, root: Path | None = None) -> Run:
    path = Path(path)
    if root is not None and path != root and path.is_relative_to(root):
        name = str(path.relative_to(root))
    else:  # <name>/<timestamp>, as runs are laid out under exp_dir
        name = "/".join(path.parts[-2:])
    name = printable(name, 300)  # directory names can hold escape sequences too
    config, plan, rows, record = load_yaml(path / "config.yaml"), load_plan(path), read_metrics(path), read_status(path)
    run = Run(path=path, name=name, config=config, plan=plan, rows=rows, record=record, checkpoint=newest_checkpoint(path))
    run.launches = launch_starts(path)
    try:
        run.overrides = [printable(o, 200) for o in read_run_text(path / "overrides.txt", 1 << 20).split()]
    except OSError:
        pass
    run.status, run.detail = run_state(path, record, run.last_step, run.max_steps)
    return run


def find_run_dirs(root: Path, max_depth: int = 6) -> Iterator[Path]:
    """Run directories at or below ``root`` (``<exp_dir>/<name>/<timestamp>``, sweeps' ``multirun/.../<n>``,
    explicit_log_dir anywhere), not looking inside a run's own sub-directories."""
    root = Path(root)
    if is_run_dir(root):
        yield root
        return
    if max_depth <= 0:
        return
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return
    for child in children:
        if child.name not in _RUN_PARTS and not child.name.startswith("."):
            yield from find_run_dirs(child, max_depth - 1)


def list_runs(root: Path, skipped: list[tuple[Path, str]] | None = None) -> list[Run]:
    """Every run below ``root``. A directory that cannot be read as a run (whatever is wrong in it) is left out
    and, when ``skipped`` is given, appended to it with the reason: one crafted run never hides the others."""
    root = Path(root).resolve()
    runs = []
    for p in find_run_dirs(root):
        try:
            run = load_run(p, root)
            run.as_dict()  # every derived field a listing shows
        except Exception as exc:  # noqa: BLE001 - anything in a crafted run directory; named, not raised
            if skipped is not None:
                skipped.append((p, printable(f"{type(exc).__name__}: {exc}", 200)))
            continue
        runs.append(run)
    return sorted(runs, key=lambda r: (r.started, r.name))


# ---------------------------------------------------------------- nxdt runs


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


STATUS_STYLE = {"running": "bold cyan", "finished": "green", "failed": "bold red", "interrupted": "yellow", "unknown": "dim"}


def runs_table(runs: list[Run], title: str) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title), title_justify="left")
    for col, justify in (
        ("run", "left"),
        ("started", "left"),
        ("status", "left"),
        ("layout", "left"),
        ("steps", "right"),
        ("last loss", "right"),
        ("tokens/s", "right"),
        ("newest checkpoint", "left"),
    ):
        table.add_column(col, justify=justify, no_wrap=col != "run")
    for r in runs:
        # Text cells: brackets in a crafted run's strings are shown, never read as rich markup
        table.add_row(
            Text(r.name),
            Text(r.started),
            Text(r.status, style=STATUS_STYLE[r.status]),
            Text(r.layout),
            Text(steps_text(r)),
            _fmt(r.last_loss, ".4f"),
            _fmt(r.tokens_per_s, ",.0f"),
            Text(printable(r.checkpoint.name) if r.checkpoint else "-"),
        )
    return table


def steps_text(r: Run) -> str:
    if r.last_step is None:
        return "-"
    return f"{r.last_step}/{printable(r.max_steps, 40)}" if r.max_steps else str(r.last_step)


def cmd_runs(argv: list[str]) -> int:
    """``nxdt runs [DIR] [--json]``: every run under DIR (default: exp_manager.exp_dir's default, ``outputs``)."""
    import sys

    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print("usage: nxdt runs [DIR] [--json]   (DIR: an exp_dir such as outputs/, or one run directory)", file=sys.stderr)
        return 2
    root = Path(args[0] if args else "outputs")
    if not root.is_dir():
        print(
            f"nxdt runs: {root} is not a directory — pass the exp_dir your runs are in (default outputs/, exp_manager.exp_dir)",
            file=sys.stderr,
        )
        return 2
    skipped: list[tuple[Path, str]] = []
    runs = list_runs(root, skipped)
    for path, why in skipped:  # on stderr: the listing (and --json) stays what it was for the other runs
        print(f"nxdt runs: skipped {printable(path)}: cannot be read as a run ({why})", file=sys.stderr)
    if as_json:
        print(json.dumps([r.as_dict() for r in runs], indent=1))
        return 0
    if not runs:
        print(f"nxdt runs: no run directories under {printable(root)} (a run directory holds config.yaml and plan.json)")
        return 0
    from rich.console import Console
    from rich.text import Text

    console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    console.print(runs_table(runs, printable(f"runs under {root.resolve()}")))
    for r in runs:
        if r.status in ("failed", "interrupted") and r.detail:
            console.print(Text(f"{r.name}: {r.status}: {r.detail}", style="dim"), soft_wrap=True)
    return 0
