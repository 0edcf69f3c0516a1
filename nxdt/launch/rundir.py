"""Run directories: ``<exp_dir>/<name>/<timestamp>/`` holding the resolved ``config.yaml`` and ``plan.json``
the workers read, and ``logs/``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from nxdt.config import ConfigError, save_run_config
from nxdt.planner import Plan

CONFIG_FILE, PLAN_FILE = "config.yaml", "plan.json"
STORE_SECRET_FILE = ".store_secret"  # this launch's rendezvous-store secret, hex, 0600 (nxdt.comm.store)


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
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    run = root / stamp
    n = 1
    while run.exists():
        run = root / f"{stamp}_{n}"
        n += 1
    return run


def _continues(cfg: Any, run: Path) -> bool:
    """Whether ``cfg`` may continue the run in ``run``. Always, except when it starts from another run's weights
    (``model.weight_init_only``): then only a run that did the same — same starting checkpoint, same model and
    data — is continued; a run of this name with other data (e.g. the pretraining run whose checkpoint this
    fine-tuning starts from) is left alone and a new run directory is made."""
    if not cfg.model.weight_init_only:
        return True
    from omegaconf import OmegaConf

    try:
        previous = OmegaConf.load(run / CONFIG_FILE)
    except Exception:
        return False
    keys = (*SAME_RUN_KEYS, "model.weight_init_only", "exp_manager.resume_from_checkpoint", "model.hf_checkpoint")
    return all(OmegaConf.select(previous, key, default=None) == _attribute(cfg, key) for key in keys)


def write_run_dir(run_dir: Path, cfg: Any, plan: Plan) -> None:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_run_config(cfg, run_dir / CONFIG_FILE)
    plan.save(run_dir / PLAN_FILE)


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
    return lines


# what a resumed run must share with the run whose directory (and checkpoints) it continues
SAME_RUN_KEYS = (
    "model.architecture",
    "model.vocab_size",
    "model.hidden_size",
    "model.num_layers",
    "model.num_attention_heads",
    "model.num_kv_heads",
    "model.ffn_hidden_size",
    "data.source",
    "data.train_dir",
    "data.tokenizer",
    "data.seq_length",
    "data.dev_choose_samples",
)


def check_same_run(cfg: Any, run_dir: Path) -> None:
    """A run continuing in an existing run directory (``resume_if_exists``) must train the same model on the same
    data as the run that wrote it: its ``config.yaml`` is compared key by key (``SAME_RUN_KEYS``) before it is
    overwritten. The first difference is refused in one line."""
    from omegaconf import OmegaConf

    previous_file = run_dir / CONFIG_FILE
    if not previous_file.is_file():
        return
    try:
        previous = OmegaConf.load(previous_file)
    except Exception as exc:  # a damaged config.yaml: nothing to compare against, say so
        raise ConfigError(
            "exp_manager.resume_if_exists",
            True,
            f"{previous_file} cannot be read ({type(exc).__name__}); start a new run (another name) or repair the file",
        ) from None
    for key in SAME_RUN_KEYS:
        was, now = OmegaConf.select(previous, key, default=None), _attribute(cfg, key)
        if was != now:
            raise ConfigError(
                key,
                now,
                f"the run being resumed ({run_dir}) was trained with {key}={was}; resume "
                "with the same model and data, or start a new run (another name, or "
                "exp_manager.resume_if_exists=false; start from its weights with model.hf_checkpoint "
                "after nxdt checkpoint export-hf)",
            )


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
