"""Run directories: ``<exp_dir>/<name>/<timestamp>/`` holding the resolved ``config.yaml`` and ``plan.json``
the workers read, and ``logs/``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from nxdt.config import ConfigError, run_config_text
from nxdt.config.resume_keys import MODEL, Change, config_changes, refusal, show, summary
from nxdt.planner import Plan
from nxdt.launch.runs import HISTORY_DIR, STAMP

CONFIG_FILE, PLAN_FILE, OVERRIDES_FILE = "config.yaml", "plan.json", "overrides.txt"
STORE_SECRET_FILE = ".store_secret"  # this launch's rendezvous-store secret, hex, 0600 (nxdt.comm.store)
STORE_FILE = ".store"  # a local launch's rendezvous store (torch FileStore), 0600 (nxdt.comm.store.create_file_store)


class StoreSecretError(RuntimeError):
    """The run directory's store secret is not a private regular file of this user; ``str()`` is the one line."""


def write_store_secret(run_dir: Path, secret: bytes) -> Path:
    """Write this launch's store secret for its workers: a new 0600 file in the (0700) run directory, created
    without following a link (a link or a file left in its place is removed first, never written through)."""
    path = run_dir / STORE_SECRET_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret.hex())
    return path


def read_store_secret(run_dir: Path) -> bytes | None:
    """The store secret the launcher left for this run's workers (None: there is none, e.g. a multi-node run,
    whose secret comes in ``NXDT_STORE_SECRET``). Read without following a link, and only from a regular file of
    this user that nobody else can read."""
    import stat

    try:
        fd = os.open(run_dir / STORE_SECRET_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreSecretError(f"nxdt: cannot read {run_dir / STORE_SECRET_FILE}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077 or info.st_size > 256:
            raise StoreSecretError(
                f"nxdt: {run_dir / STORE_SECRET_FILE} is not a private file of this user (mode "
                f"{stat.filemode(info.st_mode)}, uid {info.st_uid}); refused — start the run again"
            )
        text = fh.read(256).decode("ascii", errors="replace").strip()
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise StoreSecretError(f"nxdt: {run_dir / STORE_SECRET_FILE} does not hold a hex secret; start the run again") from None


def _resumable(run: Path) -> bool:
    # a complete checkpoint; one moved aside as damaged (checkpoint.DAMAGED_SUFFIX, not imported: it needs torch) is none
    return any((p / "done").is_file() for p in (run / "checkpoints").glob("step-*") if ".damaged" not in p.name)


def choose_run_dir(cfg: Any) -> Path:
    """explicit_log_dir if given; with resume_if_exists the newest run of this name that has a complete
    checkpoint (so the resumed run continues in the same directory); otherwise a new timestamped one."""
    em = cfg.exp_manager
    if em.explicit_log_dir:
        return Path(em.explicit_log_dir).expanduser().resolve()
    exp_root = Path(em.exp_dir).expanduser().resolve()
    root = exp_root / cfg.name
    normal = Path(os.path.normpath(root))
    if not cfg.name or normal == exp_root or normal.parent != exp_root:  # validate() refuses such names first
        raise ConfigError(
            "name",
            cfg.name,
            f"the run directory {normal} would not be a directory of its own under "
            f"exp_manager.exp_dir={exp_root}; give a plain directory name (no '/', '..' or absolute path)",
        )
    if em.resume_if_exists and root.is_dir():
        candidates = sorted(
            (p for p in root.iterdir() if p.is_dir() and _resumable(p) and _continues(cfg, p)), key=lambda p: p.name
        )
        if candidates:
            return candidates[-1]
    stamp = time.strftime(STAMP)
    run = root / stamp
    n = 1
    while run.exists():
        run = root / f"{stamp}_{n}"
        n += 1
    return run


def _continues(cfg: Any, run: Path) -> bool:
    """Whether ``cfg`` may continue the run in ``run``. Always, except when it starts from another run's weights
    (``model.weight_init_only``): then only a run that did the same — same starting checkpoint, no model or
    training key changed (``nxdt.config.resume_keys``) — is continued; a run of this name with other data or
    another objective (e.g. the pretraining run whose checkpoint this fine-tuning starts from) is left alone and a
    new run directory is made."""
    if not cfg.model.weight_init_only:
        return True
    try:
        previous = read_run_config(run)
    except ConfigError:
        return False
    if previous is None:
        return False
    starts = ("model.weight_init_only", "exp_manager.resume_from_checkpoint")
    if any(_select(previous, key) != _attribute(cfg, key) for key in starts):
        return False
    return refusal(config_changes(previous, config_dict(cfg)), weight_init_only=False) is None


def write_run_dir(run_dir: Path, cfg: Any, plan: Plan, overrides: list[str] | None = None) -> Path | None:
    """The run's config.yaml, plan.json and logs/; with ``overrides`` (a launch, not a dry run) also
    overrides.txt and this launch's entry in the config history (``config-history/<n>-<time>/``: config.yaml
    and overrides.txt), which keeps what every launch into the directory ran with. Returns that entry."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    entry = None
    text = run_config_text(cfg)  # built once: the history entry holds the same file
    if overrides is not None:
        entry = record_history(run_dir, text, overrides)
        (run_dir / OVERRIDES_FILE).write_text("\n".join(overrides) + "\n")
    (run_dir / CONFIG_FILE).write_text(text)
    plan.save(run_dir / PLAN_FILE)
    return entry


def record_history(run_dir: Path, text: str, overrides: list[str], keep_earlier: bool = True) -> Path:
    """Add this launch to ``run_dir/config-history/``: ``<n>-<YYYY-mm-dd_HH-MM-SS>/`` with its config.yaml (``text``) and
    overrides.txt, n counting from 0. A run directory written before the history existed gets its current files
    as entry 0 first (named by their modification time), so no launch's record is lost (``keep_earlier=False``:
    not for a multi-node launch, where another node may have just written them)."""
    history = run_dir / HISTORY_DIR
    history.mkdir(parents=True, exist_ok=True)
    entries = history_entries(run_dir)
    if keep_earlier and not entries and (run_dir / CONFIG_FILE).is_file():  # launched before nxdt kept a history
        stamp = time.strftime(STAMP, time.localtime((run_dir / CONFIG_FILE).stat().st_mtime))
        first = history / f"0-{stamp}"
        first.mkdir()
        for name in (CONFIG_FILE, OVERRIDES_FILE):
            if (run_dir / name).is_file():
                (first / name).write_bytes((run_dir / name).read_bytes())
        entries = [first]
    number = int(entries[-1].name.split("-", 1)[0]) + 1 if entries else 0  # after the newest, even if one was deleted
    entry = history / f"{number}-{time.strftime(STAMP)}"
    entry.mkdir()
    (entry / CONFIG_FILE).write_text(text)
    (entry / OVERRIDES_FILE).write_text("\n".join(overrides) + "\n")
    return entry


def history_entries(run_dir: Path) -> list[Path]:
    """The config history of a run directory, oldest first."""
    history = run_dir / HISTORY_DIR
    if not history.is_dir():
        return []
    numbered = [p for p in history.iterdir() if p.is_dir() and p.name.split("-", 1)[0].isdigit()]
    return sorted(numbered, key=lambda p: int(p.name.split("-", 1)[0]))


def check_resume(cfg: Any, run_dir: Path) -> list[str]:
    """Before any worker starts, when the run resumes its newest complete checkpoint (``resume_if_exists``, no
    ``resume_from_checkpoint``): verify that checkpoint's files (sizes and SHA-256). A damaged one is moved aside
    (``step-N.damaged``) and the previous good one is used: the workers pick the newest complete checkpoint
    themselves (``exp_manager.resume_checkpoint``), and a checkpoint moved aside is no longer one, so they resume
    from exactly the one verified here. Returns the lines to print (one per damaged checkpoint, and a note when the
    checkpoint resumed predates checksums). Raises ConfigError if a damaged checkpoint cannot be moved aside."""
    em = cfg.exp_manager
    named = em.resume_from_checkpoint and not cfg.model.weight_init_only  # weight_init_only: it names starting weights
    if named or not em.resume_if_exists or not _resumable(run_dir):
        return []  # a named checkpoint is verified whole by the CLI (damage is refused, not skipped)
    from nxdt.lightning import checkpoint as ckpt_io

    good, skipped = ckpt_io.newest_verified(run_dir / "checkpoints")
    target = f"resuming from {good.name}" if good is not None else "no good checkpoint left: starting from step 0"
    lines = []
    for path, reason in skipped:
        try:
            moved = ckpt_io.set_aside(path)
        except OSError as exc:
            raise ConfigError(
                "exp_manager.resume_if_exists",
                True,
                f"checkpoint {path} is damaged ({reason}) and could not be "
                f"moved aside ({exc.strerror or exc}) — move or delete it, then start again",
            ) from None
        lines.append(f"nxdt: checkpoint {path.name} is damaged ({reason}); {target} (moved it to {moved.name})")
    if good is not None and ckpt_io.read_checksums(good) is None:
        lines.append(f"nxdt: resuming from {good.name}, written by an older nxdt without checksums: unverified")
    step = int(good.name.split("-", 1)[1]) if good is not None and ckpt_io.is_step_name(good.name) else None
    if good is not None and step is not None and step >= cfg.trainer.max_steps:  # workers would train nothing
        raise ConfigError(
            "trainer.max_steps",
            cfg.trainer.max_steps,
            f"the run being resumed ({run_dir}) is at step {step} already (checkpoints/{good.name}): nothing is left "
            f"to train — continue it with a larger trainer.max_steps, e.g. trainer.max_steps={2 * max(step, 1)}",
        )
    return lines


def config_dict(cfg: Any) -> dict[str, Any]:
    """A typed config as the plain nested dict its config.yaml holds."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """The config.yaml of a run directory as a plain dict (read as ``load_run_config`` reads it); None when there is
    none. A damaged or crafted one is refused: there is nothing to compare against."""
    from nxdt.config import read_run_config_data

    file = run_dir / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        return read_run_config_data(file)
    except ValueError as exc:
        raise ConfigError(
            "exp_manager.resume_if_exists",
            True,
            f"{file} cannot be read ({exc}); start a new run (another name) or repair the file",
        ) from None


def check_same_run(cfg: Any, run_dir: Path) -> list[Change] | None:
    """A run continuing in an existing run directory (its config.yaml is there) must compute what the run that wrote
    it computed: every key is compared, and a change to a model or training key (``nxdt.config.resume_keys``) is
    refused in one line naming the key and both values — before anything in the directory is written. Returns the
    changes that are allowed (for the console's line), or None when the directory holds no run yet."""
    previous = read_run_config(run_dir)
    if previous is None:
        return None
    changes = config_changes(previous, config_dict(cfg))
    bad = refusal(changes, weight_init_only=False)
    if bad is not None:
        raise ConfigError(bad.key, bad.now, refusal_text(bad, changes, f"the run being resumed ({run_dir})", run_dir))
    return changes


def check_checkpoint_run(cfg: Any, checkpoint: str | Path) -> None:
    """``exp_manager.resume_from_checkpoint``: the run that wrote the checkpoint (its run directory's config.yaml,
    ``<run>/checkpoints/step-N``) and this one must agree on every model key, and — unless this run only starts
    from the weights (``model.weight_init_only``) — on every training key. A checkpoint outside a run directory
    (``nxdt checkpoint consolidate``'s) has no config beside it: its shapes are still checked (``checkpoint.verify``)."""
    path = Path(checkpoint).expanduser().resolve()
    if path.parent.name != "checkpoints":
        return
    run = path.parent.parent
    previous = read_run_config(run)
    if previous is None:
        return
    init_only = bool(cfg.model.weight_init_only)
    changes = config_changes(previous, config_dict(cfg))
    bad = refusal(changes, weight_init_only=init_only)
    if bad is not None:
        whose = f"checkpoint {path.name} of {run}"
        raise ConfigError(bad.key, bad.now, refusal_text(bad, changes, whose, run, weight_init_only=init_only))


def refusal_text(bad: Change, changes: list[Change], whose: str, run_dir: Path, weight_init_only: bool = False) -> str:
    """The one line after ``config error: KEY=NOW:``: the other value, why, what else changed, the fix."""
    others = [c.key for c in changes if c is not bad and c.refused(weight_init_only)]
    also = f" (also changed: {', '.join(others)})" if others else ""
    keep = f"{'start from the weights' if weight_init_only else 'resume'} with {bad.key}={show(bad.was)}"
    if bad.kind == MODEL:  # weight_init_only compares model keys too: only Hugging Face weights start another model
        why = "a model key: the weights would compute another function"
        fix = f"{keep}, or export the weights (nxdt checkpoint export-hf) and start another model from model.hf_checkpoint"
    else:
        why = "it changes the training"
        fix = (
            f"{keep}, or start new training from its weights (fresh optimizer, step 0) in another run directory: "
            f"exp_manager.resume_from_checkpoint={run_dir / 'checkpoints'}/step-N model.weight_init_only=true"
        )
    return f"{whose} was trained with {bad.key}={show(bad.was)}, not {show(bad.now)} ({why}){also}; {fix}"


def resume_lines(run_dir: Path, changes: list[Change], entry: Path | None, megatron: bool = False) -> list[str]:
    """The console's line on a launch into an existing run directory: what changed (or nothing), where the history
    entry is; then one line per noted change saying what it means. ``megatron`` (data.source): its sample index
    covers trainer.max_steps × data.global_batch_size samples, so changing either reshuffles the stream."""
    recorded = f" (recorded in {HISTORY_DIR}/{entry.name})" if entry is not None else ""
    lines = [f"nxdt: continuing {run_dir}: {summary(changes)}{recorded}"]
    lines += [f"nxdt: note: {note}" for c in changes if (note := c.note())]
    sized = [c.key for c in changes if c.key in ("trainer.max_steps", "data.global_batch_size")]
    if megatron and sized:
        lines.append(
            f"nxdt: note: {' and '.join(sized)} changed: Megatron's sample index (trainer.max_steps × "
            "data.global_batch_size samples) is rebuilt, newly shuffled, as in Megatron; training continues at the "
            "samples consumed in the new index"
        )
    return lines


def _select(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _attribute(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


class RunDirBusy(RuntimeError):
    """Another nxdt process writes this run directory; ``str()`` is the one line for the user."""


def lock_run_dir(run_dir: Path) -> Any:
    """Hold ``run_dir/.lock`` (an exclusive ``flock``) for as long as the returned file stays open: one writer per
    run directory. The lock dies with its process, so a killed launcher never leaves a stale lock behind."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    handle = os.fdopen(fd, "r+")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunDirBusy(
            f"nxdt: run directory {run_dir} is in use by another nxdt train (pid {holder}); wait for it "
            "to finish, or start a separate run (another name, or exp_manager.resume_if_exists=false)"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
