"""Cross-field validation: everything that can be checked before a worker starts is checked here,
and each failure is one line naming the key, the value and the fix."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from enum import Enum
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nxdt.topology import TopologyError, check_lnc, ranks_per_device

ALLOWED_MODEL_PREFIX = "nxdt.models."
# what makes two checkpoints of "the same model" (stored in meta.json, compared before resuming)
MODEL_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "ffn_hidden_size")

CHOICES = {
    "data.source": ("synthetic", "text", "hf_dataset", "megatron", "instructions", "preferences", "prompts"),
    "precision.type": ("fp32", "bf16", "bf16SR", "mixed_precision", "mixed_precisionSR"),
    "model.optim.name": ("adamw", "adamw_fp32OptState"),
    "model.optim.sched.name": ("CosineAnnealing", "LinearAnnealingWithWarmUp", "constant"),
    "model.optim.no_weight_decay": ("norms_and_biases", "biases", "none"),
    "model.loss_averaging": ("tokens", "micro_batches"),
    "model.activations_checkpoint_granularity": (None, "full", "selective"),
    "model.core_attention": ("sdpa", "blockwise", "naive"),
    "model.moe.router_activation": ("softmax", "sigmoid"),
    "distributed_strategy.fsdp.prefetch": ("none", "eager", "token_threaded"),
    "comm.transport": ("auto", "shm", "p2p", "gloo"),
    "exp_manager.fault_injection.kind": ("raise", "sigkill", "sigkill_during_save", "hang", "sigstop", "nan"),
    "exp_manager.nan_policy": ("stop", "skip_step"),
}


# nxdt.comm.transport.ALGORITHM_NAMES (config sits below comm; tests/comm/test_transport.py keeps the two equal)
COMM_ALGORITHMS = ("auto", "direct", "slice", "ring", "rhd", "torus", "hierarchical", "tree", "pairwise")


class Dim(str, Enum):
    """A parallel dimension. The values are the keys of ``Plan.degrees``/``Plan.groups`` and of plan.json and
    checkpoint meta.json (a ``str`` enum: ``Dim.TP == "tp"``, it hashes and serialises as ``"tp"``)."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    PP = "pp"
    EDP = "edp"  # expert data parallelism: the DP ranks holding the same experts (derived: DP / EP)
    DP_CP = "dp_cp"  # the replicas of one model-parallel shard: DP × CP (derived; gradients and ZeRO-1/FSDP shards)
    EDP_CP = "edp_cp"  # the replicas of the same experts under context parallelism: EDP × CP (derived; EP with CP only)
    MP = "mp"  # the model-parallel replica, TP × PP (derived)

    def __str__(self) -> str:
        return self.value


DIMENSIONS = (Dim.TP, Dim.CP, Dim.EP, Dim.DP, Dim.PP)  # the degrees a layout sets (placement_order names each once)
MAX_INT = 2**62  # any integer key (steps, sizes, counts): beyond it the value is a typo, and int64 arithmetic overflows
MAX_SEED = 2**32 - 1  # numpy (and so Lightning's seed_everything) takes seeds in 0..2**32-1
MAX_LOCAL_RANKS = 4096  # worker processes one host (instance graph "host", e.g. cpu) runs per node
MAX_WORLD_SIZE = 2**20  # ranks in one job, over all nodes
NAME_MAX_BYTES = 255  # the run name is one directory name


class ConfigError(ValueError):
    """A config a user can fix: ``str()`` is one line with the key, the value and the fix."""

    def __init__(self, key: str, value: Any, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        shown = f"={value!r}" if value not in ("", None) else ""
        super().__init__(f"config error: {key}{shown}: {fix}")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _positive(cfg: Any, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = _get(cfg, key)
        if value is not None and not 1 <= value <= MAX_INT:
            raise ConfigError(key, value, "must be >= 1" if value < 1 else "must be an integer in 1..2**62")


def _integer(key: str, value: Any, lo: int, hi: int = MAX_INT, what: str = "") -> None:
    """``value`` an int in lo..hi (None is left to the caller); ``what`` says what the key means, for the fix."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        too_big = isinstance(value, int) and value > hi
        allowed = f"in {lo}..{hi}" if hi != MAX_INT else f"in {lo}..2**62" if too_big else f">= {lo}"
        raise ConfigError(key, value, f"must be an integer {allowed}{what}")


def _number(
    key: str,
    value: Any,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    what: str = "",
) -> None:
    """``value`` a finite number in the interval (``lo_open``/``hi_open``: bounds excluded)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        parts = []
        if lo != -math.inf:
            parts.append(f"{'>' if lo_open else '>='} {lo:g}")
        if hi != math.inf:
            parts.append(f"{'<' if hi_open else '<='} {hi:g}")
        raise ConfigError(key, value, f"must be a finite number{' ' + ' and '.join(parts) if parts else ''}{what}")


def check_run_name(name: Any) -> None:
    """The run name is one directory under exp_manager.exp_dir (after interpolation, e.g. ``${oc.env:HOME}``)."""
    fix = "give a plain directory name (it is created under exp_manager.exp_dir), e.g. name=llama_tiny"
    if not isinstance(name, str) or not name.strip():
        raise ConfigError("name", name, f"is empty; {fix}")
    if not name.isprintable():
        raise ConfigError("name", name, f"contains a control character (newline, tab, ...); {fix}")
    if "/" in name or "\\" in name:
        raise ConfigError("name", name, f"contains a path separator (an absolute path or a subdirectory); {fix}")
    if name in (".", ".."):
        raise ConfigError("name", name, f"names no directory of its own; {fix}")
    if len(name.encode()) > NAME_MAX_BYTES:
        raise ConfigError(
            "name",
            name[:40] + "...",
            f"is {len(name.encode())} bytes long, a directory name holds at most {NAME_MAX_BYTES}; give a shorter name",
        )


# Launcher fields that become lines of job.sbatch or arguments of a node's command: a newline in one would be a
# shell line of its own in the job script.
LAUNCHER_TEXT_KEYS = ("partition", "account", "time_limit", "rdzv_endpoint", "rdzv_id", "local_addr")


def check_launcher_text(cfg: Any) -> None:
    """No control character (newline, CR, escape, NUL, ...) in a launcher string or an sbatch option."""
    launcher = cfg.launcher
    values = [(f"launcher.{k}", getattr(launcher, k, None)) for k in LAUNCHER_TEXT_KEYS]
    values += [(f"launcher.sbatch_args[{i}]", a) for i, a in enumerate(launcher.sbatch_args or [])]
    for key, value in values:
        if isinstance(value, str) and not value.isprintable():
            raise ConfigError(
                key,
                value,
                "contains a control character (newline, tab, escape, ...): it would become a line of its own in job.sbatch; give plain text",
            )
    for i, arg in enumerate(launcher.sbatch_args or []):
        if isinstance(arg, str) and not arg.startswith("-"):
            raise ConfigError(
                f"launcher.sbatch_args[{i}]",
                arg,
                "is not an sbatch option; give options such as '--constraint=trn1' (each starts with -)",
            )


# Directories a run must never write into: the system's own (resolved, so /lib → /usr/lib counts), and shared
# roots where a run's files would lie loose among everyone's (their subdirectories are fine).
SYSTEM_DIRS = (
    "/etc",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/boot",
    "/dev",
    "/proc",
    "/sys",
    "/run",
    "/var/lib",
    "/var/log",
    "/var/spool",
    "/var/cache",
    "/var/mail",
    "/snap",
)
SHARED_ROOTS = ("/", "/home", "/tmp", "/var", "/var/tmp", "/dev/shm", "/mnt", "/media", "/opt", "/srv", "/root")


def system_dir_of(path: str | Path) -> str | None:
    """The system directory (:data:`SYSTEM_DIRS`) ``path`` is or lies in, once resolved (links followed), else None."""
    import os

    resolved = os.path.realpath(os.path.expanduser(str(path)))
    return next((d for d in SYSTEM_DIRS if resolved == d or resolved.startswith(d + "/")), None)


# The most nxdt reads of a small file a user or a download supplies (config.json, tokenizer_config.json,
# adapter_config.json, a run's status/plan): a few KB as written; a larger one is refused before it is read whole.
SMALL_FILE_LIMIT = 16 << 20


def read_capped(path: str | Path, limit: int = SMALL_FILE_LIMIT) -> bytes:
    """The bytes of a small regular file the user hands in, at most ``limit`` bytes read, opened without blocking on
    a FIFO (O_NONBLOCK, then fstat of what was opened). A link is followed: the user chose it, and a Hugging Face
    cache snapshot is all links (``snapshots/<rev>/config.json`` → ``blobs/<sha>``); the files of a run or
    checkpoint, which others may have crafted, are read by ``nxdt.launch.runs.read_run_file`` and
    ``nxdt.lightning.checkpoint.read_small_file``, which follow none. ValueError (one phrase) for what it refuses;
    OSError when it is absent or unreadable."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file (a FIFO, device or directory)")
        if info.st_size > limit:
            raise ValueError(f"{info.st_size:,} bytes, more than the {limit >> 20} MiB nxdt reads of such a file")
        data = fh.read(limit + 1)
    if len(data) > limit:  # grew since fstat
        raise ValueError(f"more than the {limit >> 20} MiB nxdt reads of such a file")
    return data


def read_json_object(path: str | Path, limit: int = SMALL_FILE_LIMIT) -> dict:
    """:func:`read_capped`, parsed as a JSON object (config.json and its kin). ValueError / OSError as there."""
    import json

    data = json.loads(read_capped(path, limit))
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def output_path_problem(path: str | Path, directory: bool = False) -> str | None:
    """Why nxdt will not write the file (or, ``directory``, into the directory) a command's output flag names —
    ``report -o``, ``eval --out``, ``generate --out``, ``comm-test --report-to-json-file`` — else None: a control
    character, a system directory (:data:`SYSTEM_DIRS`, as for ``explicit_log_dir``), a symbolic link at its last
    component (written through, it would change the file the link names), something not a regular file."""
    import os
    import stat

    text = str(path)
    if not text.isprintable():
        return "contains a control character; give a plain path"
    inside = system_dir_of(text)
    if inside is not None:
        return f"is {'inside ' if os.path.realpath(text) != inside else ''}the system directory {inside}; give a path of your own"
    try:
        info = os.lstat(text)
    except OSError:
        return None  # created by the command
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link; name the file itself (nxdt does not write through links)"
    if not directory and not stat.S_ISREG(info.st_mode):
        return "exists and is not a regular file (a directory, FIFO or device); name a file"
    return None


def write_output_file(path: str | Path, data: bytes) -> None:
    """``data`` into the file ``path`` (checked by :func:`output_path_problem` first), created or replaced without
    following a link at its last component (O_NOFOLLOW) or blocking on a FIFO (O_NONBLOCK, then fstat: a link or a
    FIFO planted after the check is refused, not written through). OSError for what fails; ValueError (one phrase)
    for what the check refuses."""
    import os
    import stat

    problem = output_path_problem(path)
    if problem is not None:
        raise ValueError(problem)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    with open(fd, "wb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("is not a regular file; name a file")
        fh.truncate(0)
        fh.write(data)


def check_log_dir(key: str, value: Any) -> None:
    """``exp_manager.explicit_log_dir`` / ``exp_dir``: printable, not a system directory, and — when it exists —
    a directory of this user's (a run's files, and its ``.lock``, belong in a place the user owns)."""
    import os

    if not isinstance(value, str) or not value:
        return
    if not value.isprintable():
        raise ConfigError(key, value, "contains a control character (newline, tab, escape, ...); give a plain path")
    resolved = os.path.realpath(os.path.expanduser(value))
    inside = system_dir_of(value)
    fix = "give a directory of your own, e.g. outputs/ (the default) or a path under your home"
    if inside is not None:
        raise ConfigError(key, value, f"is {'inside ' if resolved != inside else ''}the system directory {inside}; {fix}")
    if resolved in SHARED_ROOTS:
        raise ConfigError(key, value, f"is the shared directory {resolved} itself, where the run's files would lie loose; {fix}")
    try:
        info = os.stat(resolved)
    except OSError:
        return  # created by the run, as this user
    if info.st_uid != os.geteuid():
        raise ConfigError(key, value, f"exists and belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}); {fix}")
    if key == "exp_manager.explicit_log_dir" and info.st_mode & 0o022:  # the run directory itself
        raise ConfigError(
            key,
            value,
            f"is writable by other users (mode {oct(info.st_mode & 0o777)}), and a run's rendezvous store is a file "
            f"in its directory; `chmod go-w {resolved}`, or give a directory of your own",
        )


def check_splits_string(value: Any) -> None:
    """Megatron's ``splits_string``: up to three non-negative shares (``980,10,10``; ``/`` separates too), some
    above 0; what ``nxdt.data.megatron.train_split_end`` reads in every worker."""
    if value is None:
        return
    fix = "give up to three non-negative train,validation,test shares, e.g. 980,10,10 (or null: every document)"
    parts = [p.strip() for p in str(value).replace("/", ",").split(",")]
    try:
        shares = [float(p) for p in parts if p]
    except ValueError:
        raise ConfigError("data.splits_string", value, f"is not a list of numbers; {fix}") from None
    if not shares or len(shares) > 3 or any(not math.isfinite(x) or x < 0 for x in shares) or sum(shares) <= 0:
        raise ConfigError("data.splits_string", value, fix)


def check_ranges(cfg: Any) -> None:
    """Every numeric key within the range its consumer accepts (finite floats, bounded integers); the run name, the
    launcher's text fields and the run's directories (:func:`check_launcher_text`, :func:`check_log_dir`)."""
    check_run_name(cfg.name)
    check_launcher_text(cfg)
    check_splits_string(cfg.data.splits_string)
    for key in ("exp_manager.explicit_log_dir", "exp_manager.exp_dir"):
        check_log_dir(key, _get(cfg, key))
    _integer("seed", cfg.seed, 0, MAX_SEED, " (numpy and torch seeds are unsigned 32-bit)")
    trainer, em, model = cfg.trainer, cfg.exp_manager, cfg.model
    _integer("exp_manager.max_restarts", em.max_restarts, 0, what=" (0 = no restart)")
    if trainer.max_epochs != -1:
        _integer(
            "trainer.max_epochs", trainer.max_epochs, 1, what=", or -1 for no epoch limit (trainer.max_steps bounds the run)"
        )
    if trainer.gradient_clip_val is not None:
        _number(
            "trainer.gradient_clip_val",
            trainer.gradient_clip_val,
            0,
            what=" (the largest global gradient norm; 0 or null = no clipping)",
        )
    if em.fault_injection.step is not None:
        fi = em.fault_injection
        _integer(
            "exp_manager.fault_injection.step",
            fi.step,
            1,
            trainer.max_steps,
            f" (an optimizer step of this run: trainer.max_steps={trainer.max_steps}), or null for no fault",
        )
        _integer(
            "exp_manager.fault_injection.attempt",
            fi.attempt,
            0,
            em.max_restarts,
            f" (launch attempts are 0..exp_manager.max_restarts={em.max_restarts}; raise max_restarts to reach a later one)",
        )
    else:
        _integer("exp_manager.fault_injection.attempt", em.fault_injection.attempt, 0)

    if em.profile_steps is not None:
        steps = list(em.profile_steps)
        if (
            len(steps) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in steps)
            or not 1 <= steps[0] <= steps[1] <= trainer.max_steps
        ):
            raise ConfigError(
                "exp_manager.profile_steps",
                steps,
                f"must be [first, last]: optimizer steps with 1 <= first <= last <= trainer.max_steps={trainer.max_steps}, "
                "e.g. [10, 12]",
            )

    optim = model.optim
    _number("model.optim.lr", optim.lr, 0, what=" (the peak learning rate, e.g. 3e-4; 0 freezes the weights)")
    _number("model.optim.weight_decay", optim.weight_decay, 0, what=" (e.g. 0.01; 0 = no weight decay)")
    if optim.fixed_weight_decay is not None:
        _number("model.optim.fixed_weight_decay", optim.fixed_weight_decay, 0, what=" (null = model.optim.weight_decay)")
    _number("model.optim.eps", optim.eps, 0, lo_open=True, what=" (Adam's epsilon, e.g. 1e-8)")
    betas = list(optim.betas)
    if len(betas) != 2:
        raise ConfigError("model.optim.betas", betas, "must be two numbers [beta1, beta2], e.g. [0.9, 0.95]")
    for i, beta in enumerate(betas):
        _number(f"model.optim.betas[{i}]", beta, 0, 1, hi_open=True, what=" (Adam's decay rates, e.g. [0.9, 0.95])")
    sched = optim.sched
    _integer("model.optim.sched.warmup_steps", sched.warmup_steps, 0, what=" (0 = no warm-up)")
    _integer("model.optim.sched.max_steps", sched.max_steps, 1, what=" (the schedule's length; by default trainer.max_steps)")
    _integer("model.optim.sched.constant_steps", sched.constant_steps, 0)
    _number("model.optim.sched.min_lr", sched.min_lr, 0, what=" (the rate the schedule decays to)")
    if sched.name != "constant" and optim.lr > 0 and sched.min_lr > optim.lr:
        raise ConfigError(
            "model.optim.sched.min_lr",
            sched.min_lr,
            f"must be <= model.optim.lr={optim.lr!r} (the schedule decays from lr to min_lr); lower min_lr or raise lr",
        )

    _number("model.norm_eps", model.norm_eps, 0, lo_open=True, what=" (RMSNorm's epsilon, e.g. 1e-5)")
    _number("model.rope_theta", model.rope_theta, 0, lo_open=True, what=" (RoPE's base, e.g. 10000 or 500000)")
    rope = model.rope_scaling
    if rope.rope_type not in (None, "default", "llama3"):
        raise ConfigError(
            "model.rope_scaling.rope_type",
            rope.rope_type,
            "is not implemented; nxdt implements llama3 (Llama 3.1) and default (= null: plain RoPE)",
        )
    if rope.rope_type == "llama3":
        _number("model.rope_scaling.factor", rope.factor, 0, lo_open=True, what=" (Llama 3.1: 8)")
        _number("model.rope_scaling.low_freq_factor", rope.low_freq_factor, 0, lo_open=True, what=" (Llama 3.1: 1)")
        _number(
            "model.rope_scaling.high_freq_factor",
            rope.high_freq_factor,
            rope.low_freq_factor,
            lo_open=True,
            what=" (above model.rope_scaling.low_freq_factor; Llama 3.1: 4)",
        )
        _integer(
            "model.rope_scaling.original_max_position_embeddings",
            rope.original_max_position_embeddings,
            1,
            what=" (the pretraining context; Llama 3.1: 8192)",
        )
    _number("model.init_method_std", model.init_method_std, 0, what=" (std of the normal weight init, e.g. 0.02)")
    if model.head_dim is not None:
        _integer("model.head_dim", model.head_dim, 2, what=" (null = hidden_size / num_attention_heads)")
        if model.head_dim % 2:
            raise ConfigError("model.head_dim", model.head_dim, "must be even for rotary embeddings (e.g. 128)")
    if model.sliding_window is not None:
        _integer("model.sliding_window", model.sliding_window, 1, what=" (null = attention over the whole sequence)")
        if cfg.data.seq_length > model.sliding_window:
            raise ConfigError(
                "model.sliding_window",
                model.sliding_window,
                f"is shorter than data.seq_length={cfg.data.seq_length}: sliding-window attention is not implemented "
                "(full causal attention equals it only up to the window); set data.seq_length <= the window",
            )
    moe = model.moe
    _integer("model.moe.num_experts", moe.num_experts, 0, what=" (0 = a dense model)")
    if moe.num_experts > 0:
        _integer(
            "model.moe.top_k",
            moe.top_k,
            1,
            moe.num_experts,
            f" (experts per token, at most model.moe.num_experts={moe.num_experts})",
        )
    _number("model.moe.router_aux_loss_coef", moe.router_aux_loss_coef, 0, what=" (0 = no load-balancing loss)")

    _number("comm.timeout_s", cfg.comm.timeout_s, 1, what=" (seconds a collective waits for every rank)")
    _number("comm.emulate_slowdown", cfg.comm.emulate_slowdown, 0, lo_open=True, what=" (1 = the instance's own links)")
    _number(
        "launcher.join_timeout_s", cfg.launcher.join_timeout_s, 0, lo_open=True, what=" (seconds a node waits for the others)"
    )

    inst = cfg.instance
    for key in ("lnc_default", "domain_nodes"):
        _integer(f"instance.{key}", getattr(inst, key), 1)
    if inst.max_nodes is not None:
        _integer("instance.max_nodes", inst.max_nodes, 1, what=", or null for no limit")
    for key in ("shape", "group_sizes", "lnc_options"):
        for i, value in enumerate(getattr(inst, key)):
            _integer(f"instance.{key}[{i}]", value, 1)
    for key in (
        "memory_GiB",
        "peak_tflops_bf16",
        "peak_tflops_fp32",
        "compute_half_size",
        "compute_half_tokens",
        "memory_bandwidth_GBps",
        "nvls_latency_us",
        "collective_overhead_us",
        "collective_overhead_per_rank_us",
    ):
        _number(f"instance.{key}", getattr(inst, key), 0)
    for key in ("compute_efficiency", "link_efficiency"):
        _number(f"instance.{key}", getattr(inst, key), 0, 1, lo_open=True, what=" (an achieved fraction of the peak)")
    if inst.compute_efficiency_fp32 is not None:
        _number(
            "instance.compute_efficiency_fp32",
            inst.compute_efficiency_fp32,
            0,
            1,
            lo_open=True,
            what=" (an achieved fraction of the fp32 peak), or null for instance.compute_efficiency",
        )
    for i, proto in enumerate(inst.network_protocols):
        if proto not in ("ll", "ll128", "simple"):
            raise ConfigError(f"instance.network_protocols[{i}]", proto, "an NCCL protocol: ll | ll128 | simple")
    _number("instance.nvls_efficiency", inst.nvls_efficiency, 0, 1, what=" (a fraction of the NVLink bandwidth; 0 = no NVLS)")
    for link in ("intra_device", "device_link", "domain_link", "inter_node"):
        _number(f"instance.{link}.bandwidth_GBps", getattr(inst, link).bandwidth_GBps, 0)
        _number(f"instance.{link}.latency_us", getattr(inst, link).latency_us, 0)
        for key in ("ramp_us", "ramp_bytes", "message_us", "post_us"):
            _number(f"instance.{link}.{key}", getattr(getattr(inst, link), key), 0)
        if getattr(inst, link).efficiency is not None:
            _number(
                f"instance.{link}.efficiency",
                getattr(inst, link).efficiency,
                0,
                1,
                lo_open=True,
                what=" (an achieved fraction of the link's bandwidth), or null for instance.link_efficiency",
            )

    if inst.graph == "host" and trainer.devices > MAX_LOCAL_RANKS:
        raise ConfigError(
            "trainer.devices",
            trainer.devices,
            f"{inst.name} runs at most {MAX_LOCAL_RANKS} worker processes per "
            "node (one per rank); use fewer ranks per node, or more nodes",
        )
    if trainer.num_nodes * trainer.devices > MAX_WORLD_SIZE:
        raise ConfigError(
            "trainer.num_nodes",
            trainer.num_nodes,
            f"{trainer.num_nodes} nodes × trainer.devices={trainer.devices} "
            f"= {trainer.num_nodes * trainer.devices} ranks; one job holds at most {MAX_WORLD_SIZE}",
        )
    _check_leaves(cfg, "")


def _check_leaves(node: Any, prefix: str) -> None:
    """What no rule above names: every float finite, every integer within ±MAX_INT."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _check_leaves(getattr(node, f.name), f"{prefix}{f.name}.")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _check_leaves(value, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, dict):
        for k, value in node.items():
            _check_leaves(value, f"{prefix}{k}.")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(prefix[:-1], node, "must be a finite number")
    elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > MAX_INT:
        raise ConfigError(prefix[:-1], node, "must be an integer in -2**62..2**62")


def devices_per_node(cfg: Any) -> int:
    """``trainer.devices`` of a composed config (``fill_instance_defaults`` has replaced null by the instance's)."""
    devices = cfg.trainer.devices
    if devices is None:
        raise ValueError("trainer.devices is null: compose the config with nxdt.config.compose_config, which fills it in")
    return devices


def fill_zero1_default(cfg: Any, dp: int) -> None:
    """``distributed_strategy.zero1: null`` (the default): ZeRO-1 wherever it trains as plain data parallelism
    — more than one data-parallel rank, no FSDP (which shards the optimizer state itself) and no bf16SR (its rounding
    draws one random stream per optimizer parameter, and ZeRO-1's optimizer steps flat shards: other bits than a single
    process's); expert parameters are sharded over the replicas of the same experts. Each rank then keeps and updates 1/DP of the
    optimizer state: less memory, and on CPU hosts less time a step (experiments/peers). NxDT's default is
    ``zero1: true``. ``dp``: the data-parallel degree, as :func:`validate` has checked it."""
    ds = cfg.distributed_strategy
    if ds.zero1 is not None:
        return
    ds.zero1 = dp > 1 and not ds.fsdp.enabled and cfg.precision.type != "bf16SR"


def fill_instance_defaults(cfg: Any) -> None:
    """``trainer.devices: null`` means one rank per (logical) core of the instance's node."""
    inst, trainer = cfg.instance, cfg.trainer
    for key in ("devices", "cores_per_device"):
        _integer(f"instance.{key}", getattr(inst, key), 1, what=" (per node of the instance)")
    if trainer.devices is None:
        if inst.graph == "host":
            trainer.devices = inst.devices
        else:
            try:
                trainer.devices = inst.devices * ranks_per_device(inst, check_lnc(inst, trainer.lnc))
            except TopologyError as exc:
                raise ConfigError("trainer.lnc", trainer.lnc, str(exc)) from None


def global_batch(data: Any, dp: int) -> int:
    """``data.global_batch_size``, or micro_batch_size × DP when it is null (one micro-batch per rank per step)."""
    return data.micro_batch_size * dp if data.global_batch_size is None else data.global_batch_size


def batch_plan(data: Any, dp: int) -> dict[str, int]:
    """``Plan.batch``: global and micro-batch size, sequence length and micro-batches per DP rank and step (the
    gradient accumulation count). The one place that count is derived; everything else reads ``Plan.batch``."""
    batch = global_batch(data, dp)
    return {
        "global": batch,
        "micro": data.micro_batch_size,
        "seq_length": data.seq_length,
        "micro_batches": batch // (data.micro_batch_size * dp),
    }


def _check_comm_choice(cfg: Any) -> None:
    """comm.algorithm names an algorithm nxdt.comm has (torus may carry its grid); the transport can run it."""
    algorithm, transport = str(cfg.comm.algorithm), cfg.comm.transport
    name, _, grid = algorithm.partition(":")
    if name not in COMM_ALGORITHMS or (grid and (name != "torus" or not re.fullmatch(r"[1-9]\d*x[1-9]\d*", grid.lower()))):
        raise ConfigError(
            "comm.algorithm", algorithm, f"use one of {', '.join(COMM_ALGORITHMS)} (torus may give its grid: torus:RxC)"
        )
    if transport == "gloo" and algorithm != "auto":
        raise ConfigError(
            "comm.algorithm",
            algorithm,
            "comm.transport=gloo runs gloo's own algorithms: use comm.algorithm=auto, or comm.transport=shm/p2p",
        )
    if transport == "shm" and cfg.trainer.num_nodes > 1:
        raise ConfigError(
            "comm.transport",
            transport,
            f"shm needs every rank on one host, but trainer.num_nodes={cfg.trainer.num_nodes}; "
            "use auto (shm within a host, p2p across) or p2p",
        )


def _is_moe_family(architecture: str) -> bool:
    """Its family's spec says the feed-forward is a mixture of experts; an architecture without a spec is left to the
    model check before launch (``cli._check_model``), which names it."""
    from nxdt.config.hf_model import HFConfigError, family_of_architecture

    try:
        return family_of_architecture(architecture).block.moe
    except HFConfigError:
        return True


def validate(cfg: Any, *, paths: bool = True) -> None:
    """``paths=False`` (``nxdt plan``): do not require the files the run would read to exist here."""
    fill_instance_defaults(cfg)
    kind = cfg.precision.type
    if isinstance(kind, str) and kind.endswith("SR") and kind not in CHOICES["precision.type"]:
        raise ConfigError(
            "precision.type",
            kind,
            "stochastic rounding (SR) rounds to bf16, and fp32 training rounds "
            "nothing to bf16; use fp32, or one of the SR types bf16SR, mixed_precisionSR",
        )
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(key, value, f"must be one of {', '.join(str(a) for a in allowed)}")
    ds, data, model, trainer = cfg.distributed_strategy, cfg.data, cfg.model, cfg.trainer
    _positive(
        cfg,
        (
            "trainer.devices",
            "trainer.num_nodes",
            "trainer.max_steps",
            "trainer.log_every_n_steps",
            "data.micro_batch_size",
            "data.global_batch_size",
            "data.seq_length",
            "data.num_samples",
            "distributed_strategy.tensor_model_parallel_size",
            "distributed_strategy.pipeline_model_parallel_size",
            "distributed_strategy.virtual_pipeline_model_parallel_size",
            "distributed_strategy.context_parallel_size",
            "distributed_strategy.expert_model_parallel_size",
            "distributed_strategy.kv_replicator",
            "exp_manager.keep_last_k",
            "exp_manager.checkpoint_every_n_steps",
            "distributed_strategy.fsdp.prefetch_distance",
            "model.vocab_size",
            "model.make_vocab_size_divisible_by",
            "model.hidden_size",
            "model.num_layers",
            "model.num_attention_heads",
            "model.num_kv_heads",
            "model.ffn_hidden_size",
            "model.max_position_embeddings",
        ),
    )
    order = ds.placement_order.split("-")
    if sorted(order) != sorted(DIMENSIONS):
        raise ConfigError(
            "distributed_strategy.placement_order",
            ds.placement_order,
            f"must order each of {', '.join(DIMENSIONS)} once, e.g. tp-cp-ep-dp-pp",
        )
    check_ranges(cfg)

    inst = cfg.instance
    try:
        lnc = check_lnc(inst, trainer.lnc)
    except TopologyError as exc:
        raise ConfigError("trainer.lnc", trainer.lnc, str(exc)) from None
    if inst.graph != "host":
        per_node = inst.devices * ranks_per_device(inst, lnc)
        if trainer.devices > per_node:
            raise ConfigError(
                "trainer.devices",
                trainer.devices,
                f"a {inst.name} node runs at most {per_node} ranks "
                f"({inst.devices} devices × {inst.cores_per_device // lnc} cores at LNC {lnc})",
            )
    if trainer.num_nodes > 1 and not inst.multi_node:
        raise ConfigError("trainer.num_nodes", trainer.num_nodes, f"instance {inst.name} cannot run multi-node; use 1")
    if inst.max_nodes is not None and trainer.num_nodes > inst.max_nodes:
        raise ConfigError("trainer.num_nodes", trainer.num_nodes, f"instance {inst.name} joins at most {inst.max_nodes} nodes")
    world = trainer.num_nodes * trainer.devices
    tp, pp, cp, ep = (
        ds.tensor_model_parallel_size,
        ds.pipeline_model_parallel_size,
        ds.context_parallel_size,
        ds.expert_model_parallel_size,
    )
    if world % (tp * pp * cp):
        key = "distributed_strategy.tensor_model_parallel_size" if pp * cp == 1 else "distributed_strategy"
        raise ConfigError(
            key,
            f"TP{tp}×PP{pp}×CP{cp}",
            f"TP·PP·CP={tp * pp * cp} must divide the world size {world} "
            f"(trainer.num_nodes={trainer.num_nodes} × trainer.devices={trainer.devices})",
        )
    dp = world // (tp * pp * cp)
    if dp % ep:
        raise ConfigError("distributed_strategy.expert_model_parallel_size", ep, f"must divide the data-parallel degree {dp}")
    fill_zero1_default(cfg, dp)

    heads, kv = model.num_attention_heads, model.num_kv_heads or model.num_attention_heads
    if model.head_dim is None and model.hidden_size % heads:  # an explicit head_dim needs no quotient
        raise ConfigError("model.num_attention_heads", heads, f"must divide model.hidden_size={model.hidden_size}")
    if heads % kv:
        raise ConfigError("model.num_kv_heads", kv, f"must divide model.num_attention_heads={heads}")
    if heads % tp:
        raise ConfigError("distributed_strategy.tensor_model_parallel_size", tp, f"must divide model.num_attention_heads={heads}")
    if (kv * ds.kv_replicator) % tp:
        raise ConfigError(
            "distributed_strategy.tensor_model_parallel_size",
            tp,
            f"must divide model.num_kv_heads × kv_replicator = {kv}×{ds.kv_replicator}; raise distributed_strategy.kv_replicator",
        )
    if model.num_layers < pp:
        raise ConfigError(
            "distributed_strategy.pipeline_model_parallel_size", pp, f"cannot exceed model.num_layers={model.num_layers}"
        )
    vpp = ds.virtual_pipeline_model_parallel_size
    if vpp > 1 and model.num_layers < pp * vpp:
        raise ConfigError(
            "distributed_strategy.virtual_pipeline_model_parallel_size",
            vpp,
            f"PP×virtual = {pp}×{vpp} model chunks need at least that many layers (model.num_layers={model.num_layers})",
        )
    experts = model.moe.num_experts
    if ep > 1 and not _is_moe_family(model.architecture):
        raise ConfigError(
            "distributed_strategy.expert_model_parallel_size",
            ep,
            f"model.architecture={model.architecture} is a dense family (no experts to spread); use 1, or a "
            "mixture-of-experts family (mixtral, qwen3_moe)",
        )
    if ep > 1 and (experts == 0 or experts % ep):
        raise ConfigError(
            "distributed_strategy.expert_model_parallel_size",
            ep,
            f"must divide model.moe.num_experts={experts} (each EP rank holds an equal share of the experts)",
        )
    if cp > 1 and data.seq_length % (2 * cp):
        raise ConfigError(
            "data.seq_length",
            data.seq_length,
            f"must split into 2·CP = {2 * cp} equal chunks with "
            f"distributed_strategy.context_parallel_size={cp} (CP rank i holds chunks i and 2·CP−1−i); "
            f"use a multiple of {2 * cp}",
        )
    if ds.sequence_parallel and tp > 1 and (data.seq_length // cp) % tp:
        what = "" if cp == 1 else f" (each CP rank's {data.seq_length // cp} tokens)"
        raise ConfigError(
            "data.seq_length",
            data.seq_length,
            f"must be divisible by TP={tp}{what} with sequence_parallel (activations are split along it)",
        )
    if pp > 1 and model.tie_word_embeddings:
        raise ConfigError(
            "model.tie_word_embeddings",
            True,
            "is not supported with pipeline parallelism (the embedding and the "
            "head live on different stages); set it to false or use PP=1",
        )
    if vpp > 1 and pp == 1:
        raise ConfigError(
            "distributed_strategy.virtual_pipeline_model_parallel_size", vpp, "needs pipeline_model_parallel_size > 1"
        )

    given = data.global_batch_size
    if given is None:  # resolved here, so the plan, the workers and the run's config.yaml all see the number
        data.global_batch_size = global_batch(data, dp)
    if data.global_batch_size % (data.micro_batch_size * dp):
        raise ConfigError(
            "data.global_batch_size",
            data.global_batch_size,
            f"must be divisible by micro_batch_size × DP = {data.micro_batch_size}×{dp} = {data.micro_batch_size * dp}",
        )
    microbatches = batch_plan(data, dp)["micro_batches"]
    if vpp > 1 and microbatches % pp:
        fix = (
            f"the interleaved schedule needs micro-batches per step ({microbatches} = global / (micro × DP)) divisible by PP={pp}"
        )
        if given is None:
            fix += (
                f"; null means one micro-batch per rank per step (micro_batch_size × DP = {data.global_batch_size}): "
                f"set a multiple of {data.global_batch_size * pp}"
            )
        raise ConfigError("data.global_batch_size", given, fix)
    if data.seq_length > model.max_position_embeddings:
        raise ConfigError(
            "data.seq_length", data.seq_length, f"exceeds model.max_position_embeddings={model.max_position_embeddings}"
        )
    _check_fine_tuning(cfg)
    _check_validation(cfg)
    if paths:
        _check_paths(cfg)
    if data.source == "hf_dataset" and data.train_dir is None:
        raise ConfigError(
            "data.train_dir", None, "data.source=hf_dataset reads a directory written by datasets' save_to_disk; name it here"
        )
    if data.source == "megatron" and data.data_prefix is None:
        raise ConfigError(
            "data.data_prefix",
            None,
            "data.source=megatron reads Megatron indexed datasets: give [weight, prefix, ...] "
            "(nxdt data convert-megatron writes PREFIX.bin/.idx from text)",
        )
    if data.source == "text" and data.tokenizer is None and model.vocab_size < 256:
        raise ConfigError(
            "model.vocab_size", model.vocab_size, "byte-level text needs >= 256 ids; set data.tokenizer or a larger vocab"
        )

    arch = model.architecture
    module, _, cls = arch.rpartition(".")
    if not arch.startswith(ALLOWED_MODEL_PREFIX) or not module:
        raise ConfigError(
            "model.architecture",
            arch,
            f"only model classes under {ALLOWED_MODEL_PREFIX} may be named (a config is not a way to run code)",
        )
    if importlib.util.find_spec(module) is None:
        raise ConfigError("model.architecture", arch, f"module {module} does not exist in the model hub")
    for key in ("distributed_strategy.fsdp.reduce_scatter_delay", "distributed_strategy.fsdp.param_persistence_threshold"):
        if _get(cfg, key) < 0:
            raise ConfigError(key, _get(cfg, key), "must be >= 0")
    if not cfg.comm.emulate_slowdown > 0:
        raise ConfigError("comm.emulate_slowdown", cfg.comm.emulate_slowdown, "must be > 0 (1 = the instance's own links)")
    if cfg.comm.emulate is not None and cfg.comm.emulate not in _instance_names():
        raise ConfigError("comm.emulate", cfg.comm.emulate, f"unknown instance; choose one of {', '.join(_instance_names())}")
    _check_comm_choice(cfg)
    fi = cfg.exp_manager.fault_injection
    if fi.rank is not None and not 0 <= fi.rank < world:
        raise ConfigError("exp_manager.fault_injection.rank", fi.rank, f"must be a rank in 0..{world - 1}")


ALIGNMENT_BLOCKS = ("sft", "peft", "dpo", "orpo", "grpo")
# the data.source values pretraining reads (token streams); the others are an objective's records, read by its spec
# (nxdt.lightning.registry: pretraining's data_sources are these)
TOKEN_SOURCES = ("synthetic", "text", "hf_dataset", "megatron")
SFT_TRUNCATION = ("truncate", "drop")  # nxdt.data.instructions.TRUNCATION_MODES (config sits below data)
SFT_PACKING_STYLES = ("per_record", "concat")  # nxdt.data.instructions.PACKING_STYLES
PREFERENCE_TRUNCATION = ("keep_start", "keep_end")  # nxdt.data.preferences.TRUNCATION_MODES
# nxdt.models.objectives' DPO_LOSS_TYPES, DPO_BATCH_SORTED_LOSS_TYPES, F_DIVERGENCES and F_DIVERGENCE_LOSS_TYPES (the
# config layer imports no torch; tests/test_dpo_losses.py holds them equal)
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "sft",
)
DPO_BATCH_SORTED_LOSS_TYPES = ("aot", "aot_unpaired")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
ORPO_NLL_MEANS = ("tokens", "sequences")  # nxdt.lightning.objective.ORPO_NLL_MEANS


def dpo_loss_types(value: Any) -> list[str]:
    """``dpo.loss_type`` as a list of names: one name, or a list of them (TRL's ``loss_type``)."""
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value] if isinstance(value, Sequence) else []


def _check_dpo_loss(key: str, block: Any) -> None:
    """The DPO loss's settings: known loss types (TRL's, less the two that sort over the batch), one weight per type,
    and the ranges each type's parameter needs."""
    value = block.loss_type
    names = dpo_loss_types(value)
    if not names:
        raise ConfigError(f"{key}.loss_type", value, "give a loss name (sigmoid is the paper's) or a list of names")
    for name in names:
        if name not in DPO_LOSS_TYPES + DPO_BATCH_SORTED_LOSS_TYPES:  # the latter: known, refused by check_trainable
            raise ConfigError(f"{key}.loss_type", name, f"must be one of {', '.join(DPO_LOSS_TYPES)} (TRL's loss types)")
    weights = block.loss_weights
    if weights is not None:
        if len(weights) != len(names):
            raise ConfigError(
                f"{key}.loss_weights", list(weights), f"has {len(weights)} weight(s) for loss_type {names}: give one per loss"
            )
        for i, weight in enumerate(weights):
            _number(f"{key}.loss_weights[{i}]", weight, what=" (weight of a DPO loss)")
    eps = block.label_smoothing
    if "robust" in names and not 0.0 <= eps < 0.5:
        raise ConfigError(
            f"{key}.label_smoothing", eps, "must lie in [0, 0.5) for robust: the probability a preference is flipped"
        )
    if "exo_pair" in names and not 0.0 < eps < 1.0:
        raise ConfigError(f"{key}.label_smoothing", eps, "must lie in (0, 1) for exo_pair: its epsilon (the EXO paper's: 1e-3)")
    if block.f_divergence_type not in F_DIVERGENCES:
        raise ConfigError(f"{key}.f_divergence_type", block.f_divergence_type, f"must be one of {', '.join(F_DIVERGENCES)}")
    other = [name for name in names if name not in F_DIVERGENCE_LOSS_TYPES]
    if block.f_divergence_type != "reverse_kl" and other:
        raise ConfigError(
            f"{key}.f_divergence_type",
            block.f_divergence_type,
            f"is defined only for losses of the chosen − rejected score ({', '.join(F_DIVERGENCE_LOSS_TYPES)}), not for "
            f"{', '.join(other)} (as in TRL): use reverse_kl with those",
        )
    if block.f_divergence_type == "alpha_divergence":
        _number(f"{key}.f_alpha_divergence_coef", block.f_alpha_divergence_coef, what=" (alpha of the alpha-divergence)")
    if "discopop" in names:
        _number(f"{key}.discopop_tau", block.discopop_tau, 0, lo_open=True, what=" (DiscoPOP's temperature)")


def alignment_recipes(cfg: Any) -> list[str]:
    """The ``model_alignment_strategy`` blocks that are set (not null): the fine-tuning recipe; [] = pretraining."""
    return [name for name in ALIGNMENT_BLOCKS if getattr(cfg.model_alignment_strategy, name, None) is not None]


def _check_fine_tuning(cfg: Any) -> None:
    """The recipe, its data source and where its weights start agree with each other."""
    data, model, em = cfg.data, cfg.model, cfg.exp_manager
    _check_preference_recipe(cfg)
    sft = cfg.model_alignment_strategy.sft
    if sft is not None:
        if data.source != "instructions":
            raise ConfigError(
                "data.source",
                data.source,
                "model_alignment_strategy.sft trains on instruction records: set "
                "data.source=instructions (data.train_dir: a .jsonl file or directory, or a save_to_disk directory)",
            )
        if sft.truncation not in SFT_TRUNCATION:
            raise ConfigError(
                "model_alignment_strategy.sft.truncation", sft.truncation, f"must be one of {', '.join(SFT_TRUNCATION)}"
            )
        if sft.packing_style not in SFT_PACKING_STYLES:
            raise ConfigError(
                "model_alignment_strategy.sft.packing_style",
                sft.packing_style,
                f"must be one of {', '.join(SFT_PACKING_STYLES)} (concat = NxD Training's packed layout)",
            )
        if sft.packing_style == "concat" and not sft.packing:
            raise ConfigError(
                "model_alignment_strategy.sft.packing_style",
                sft.packing_style,
                "is a packed layout: set model_alignment_strategy.sft.packing=true, or packing_style=per_record",
            )
    elif data.source == "text" and any(str(p).endswith(".jsonl") for p in (data.train_dir, data.val_dir) if p):
        raise ConfigError(
            "data.train_dir",
            data.train_dir,
            "is JSON lines, which data.source=text would train on as raw text; "
            "for instruction records use data.source=instructions with model_alignment_strategy.sft (+recipe=sft)",
        )
    elif data.source == "instructions":
        raise ConfigError(
            "data.source",
            "instructions",
            "instruction records are read for fine-tuning: add "
            "model_alignment_strategy.sft (e.g. +recipe=sft, or model_alignment_strategy.sft.packing in an NxDT config)",
        )
    if data.dev_choose_samples is not None:
        _integer("data.dev_choose_samples", data.dev_choose_samples, 1, what=" (the first N records), or null for all")
    if model.weight_init_only:
        if em.resume_from_checkpoint is None and model.hf_checkpoint is None:
            raise ConfigError(
                "model.weight_init_only",
                True,
                "loads the model weights of exp_manager.resume_from_checkpoint (an "
                "nxdt checkpoint); name one there (or start from Hugging Face weights with model.hf_checkpoint)",
            )
        peft = cfg.model_alignment_strategy.peft
        lora_on_base = peft is not None and peft.load_lora_from_ckpt  # the adapters (alone) from the checkpoint, on this base
        if em.resume_from_checkpoint is not None and model.hf_checkpoint is not None and not lora_on_base:
            raise ConfigError(
                "model.hf_checkpoint",
                model.hf_checkpoint,
                "and exp_manager.resume_from_checkpoint with model.weight_init_only both name starting weights; keep one of them",
            )


def _check_preference_recipe(cfg: Any) -> None:
    """DPO / ORPO: preference records, and their keys' values."""
    mas, source = cfg.model_alignment_strategy, cfg.data.source
    name = next((n for n in ("dpo", "orpo") if getattr(mas, n, None) is not None), None)
    if name is None:
        if source == "preferences":
            raise ConfigError(
                "data.source",
                source,
                "preference records are read for DPO or ORPO: add model_alignment_strategy.dpo or .orpo (e.g. +recipe=dpo)",
            )
        return
    block, key = getattr(mas, name), f"model_alignment_strategy.{name}"
    if source != "preferences":
        raise ConfigError(
            "data.source",
            source,
            f"{key} trains on preference records (prompt, chosen, rejected): set "
            "data.source=preferences (data.train_dir: a .jsonl file or directory, or a save_to_disk directory)",
        )
    if block.truncation_mode not in PREFERENCE_TRUNCATION:
        raise ConfigError(f"{key}.truncation_mode", block.truncation_mode, f"must be one of {', '.join(PREFERENCE_TRUNCATION)}")
    _integer(f"{key}.max_prompt_length", block.max_prompt_length, 1, what=" (tokens)")
    if block.max_prompt_length >= cfg.data.seq_length:  # TRL's rule too: max_prompt_length < max_length
        raise ConfigError(
            f"{key}.max_prompt_length",
            block.max_prompt_length,
            f"is not below data.seq_length={cfg.data.seq_length}: a prompt that long leaves no token for the responses; "
            f"give at most {cfg.data.seq_length - 1} (or a longer data.seq_length)",
        )
    if name == "dpo":
        _check_dpo_loss(key, block)
        _number(f"{key}.kl_beta", block.kl_beta, 0, lo_open=True, what=" (β of the DPO loss)")
    else:
        _number(f"{key}.beta", block.beta, 0, what=" (weight of the odds-ratio term)")
        if block.nll_mean not in ORPO_NLL_MEANS:
            raise ConfigError(
                f"{key}.nll_mean",
                block.nll_mean,
                "use tokens (TRL's ORPOTrainer: the token mean over the global batch's chosen prompts and responses) or "
                "sequences (NxD Training's: the mean over pairs of each chosen response's mean token log-probability)",
            )


def _check_peft(cfg: Any) -> None:
    """NxDT's peft keys this version does not do, refused by name (the model-shaping keys: ``check_peft`` on the model)."""
    peft = cfg.model_alignment_strategy.peft
    if peft is None:
        return
    if peft.merge_lora and not peft.save_lora_base:
        raise ConfigError(
            "model_alignment_strategy.peft.merge_lora",
            True,
            "folds the adapters into the saved base weights: "
            "set save_lora_base=true too (with save_lora_base=false checkpoints hold the adapters alone)",
        )
    if peft.merge_lora and peft.merge_sharded_lora:
        raise ConfigError(
            "model_alignment_strategy.peft.merge_sharded_lora",
            True,
            "makes NxD save the adapters alone, turning merge_lora off; keep one of them",
        )
    if peft.merge_lora and (cfg.exp_manager.resume_if_exists or cfg.exp_manager.max_restarts):
        raise ConfigError(
            "model_alignment_strategy.peft.merge_lora",
            True,
            "checkpoints hold the adapters merged into the base, "
            "which cannot resume this LoRA run: set exp_manager.resume_if_exists=false and "
            "exp_manager.max_restarts=0 (or merge_lora=false and export-hf --merge afterwards)",
        )
    if peft.load_lora_from_ckpt and cfg.exp_manager.resume_from_checkpoint is None:
        raise ConfigError(
            "model_alignment_strategy.peft.load_lora_from_ckpt",
            True,
            "loads the adapters of exp_manager.resume_from_checkpoint: name a checkpoint of a LoRA run there",
        )
    if peft.save_lora_config_adapter and peft.lora_bias in ("all", "lora_only"):  # other values: check_peft names them
        raise NotYetSupported(
            "model_alignment_strategy.peft.save_lora_config_adapter",
            True,
            f"the PEFT adapter export has no trainable biases (lora_bias={peft.lora_bias}); set false, or lora_bias=none",
        )


def _check_validation(cfg: Any) -> None:
    trainer = cfg.trainer
    if trainer.val_check_interval is not None:
        _integer(
            "trainer.val_check_interval", trainer.val_check_interval, 1, what=" (optimizer steps), or null for once at the end"
        )
    _integer("trainer.num_sanity_val_steps", trainer.num_sanity_val_steps, 0, what=" (0 = none)")
    limit = trainer.limit_val_batches
    _number("trainer.limit_val_batches", limit, 0, what=" (<= 1: a fraction of the validation batches, > 1: a count)")
    if limit > 1 and limit != int(limit):
        raise ConfigError("trainer.limit_val_batches", limit, "above 1 it counts batches: give an integer (or a fraction <= 1)")
    split = cfg.data.val_split
    _number("data.val_split", split, 0, 1, hi_open=True, what=" (the held-out fraction of the training samples; 0 = none)")
    if split > 0 and cfg.data.val_dir is not None:
        raise ConfigError("data.val_split", split, "and data.val_dir both name validation data; keep one of them")
    if cfg.data.val_dir is not None and cfg.data.source == "synthetic":
        raise ConfigError("data.val_dir", cfg.data.val_dir, "data.source=synthetic reads no files; set data.val_dir=null")


def _check_paths(cfg: Any) -> None:
    """Files the run reads. ``nxdt plan`` skips this: a plan for a cluster needs none of them here."""
    hf = cfg.model.hf_checkpoint
    if hf is not None:
        if not list(Path(hf).expanduser().glob("*.safetensors")):
            raise ConfigError(
                "model.hf_checkpoint",
                hf,
                "no *.safetensors files there; give a Hugging Face model directory saved "
                "with safetensors (save_pretrained(..., safe_serialization=True))",
            )
        _check_hf_config(cfg, Path(hf).expanduser() / "config.json")
    for key in ("data.train_dir", "data.tokenizer", "data.val_dir"):
        path = _get(cfg, key)
        if path is not None and not Path(path).expanduser().exists():
            # NxDT's megatron_llama2_7B_SFT example writes $HOME/training.jsonl; neither Hydra nor its loaders expand it
            unexpanded = " (environment variables such as $HOME are not expanded)" if "$" in str(path) else ""
            raise ConfigError(key, path, f"no such file{unexpanded}; give an existing path (or null for the default)")
    cache = cfg.data.index_mapping_dir
    if cache is not None and Path(cache).expanduser().exists() and not Path(cache).expanduser().is_dir():
        raise ConfigError(
            "data.index_mapping_dir",
            cache,
            "is a file, not a directory: the sample index cache (.npy files) is written into it; give a directory "
            "(or null: beside each .idx)",
        )
    if cache is not None:  # the cache is written there: a place it cannot be made was accepted, then never used
        import os

        nearest = Path(cache).expanduser().absolute()
        while not nearest.exists() and nearest != nearest.parent:
            nearest = nearest.parent
        if not nearest.is_dir() or not os.access(nearest, os.W_OK | os.X_OK):
            raise ConfigError(
                "data.index_mapping_dir",
                cache,
                f"cannot be created or written: {nearest} is {'not a directory' if not nearest.is_dir() else 'not writable by you'}; "
                "give a directory of yours (or null: beside each .idx)",
            )
    if cfg.data.source == "hf_dataset" and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError("data.source", "hf_dataset", "reading a save_to_disk directory needs pyarrow: pip install 'nxdt[hf]'")


def _check_hf_config(cfg: Any, config_json: Path) -> None:
    """A checkpoint whose config.json describes another model fails here, in one line naming the field and both
    values, rather than training silently (epsilon, RoPE) or failing in every worker's weight loading (shapes). The
    workers still check each tensor, for directories without config.json."""
    from nxdt.config.hf_model import HFConfigError, family_of, model_meta

    if not config_json.is_file():
        return  # the tensors are compared with the model before launch (cli._check_model) and by the workers
    try:
        hf = read_json_object(config_json)
        family = family_of(hf)
        bad = family.mismatches(hf, model_meta(cfg.model))
    except (OSError, ValueError) as exc:  # HFConfigError is a ValueError: a field the hub cannot honour
        what = str(exc) if isinstance(exc, HFConfigError) else f"not a readable config.json ({exc})"
        raise ConfigError("model.hf_checkpoint", cfg.model.hf_checkpoint, f"{config_json}: {what}") from None
    if bad:
        name, ours, theirs = bad[0]
        field = "model_type" if name == "architecture" else family.hf_key(name)
        shown = family.model_type if name == "architecture" else theirs
        raise ConfigError(
            f"model.{name}",
            ours,
            f"the checkpoint's config.json ({config_json}) has {field}={shown!r}; make the model config match the "
            "checkpoint's config.json (or drop the override: model.hf_checkpoint alone takes it from there)",
        )


def _instance_names() -> list[str]:
    from nxdt.config import available_options  # the package imports this module

    return available_options("instance")


def ineffective_settings(cfg: Any) -> list[str]:
    """Settings that are valid but cannot take effect in this run, one ``warning:`` line each (the launcher prints them
    before any worker starts; the run goes ahead): validation data never validated, a learning-rate schedule the run
    stops inside, LoRA adapters trained on a random base."""
    out = []
    trainer, data, sched = cfg.trainer, cfg.data, cfg.model.optim.sched
    max_steps = trainer.max_steps
    val_data = "data.val_dir" if data.val_dir is not None else "data.val_split" if data.val_split > 0 else None
    interval = trainer.val_check_interval
    # validation runs every val_check_interval steps (null: after the last step), so never when that is past the end
    if val_data and trainer.limit_val_batches > 0 and interval is not None and max_steps and interval > max_steps:
        out.append(
            f"warning: trainer.val_check_interval={interval} is beyond trainer.max_steps={max_steps}: {val_data} is never "
            f"validated; set trainer.val_check_interval to at most {max_steps} (null: once, after the last step)"
        )
    # the peak lr is reached at step index warmup_steps (NeMo's warm-up, (s+1)/(w+1), and Megatron's s/w), or
    # warmup_steps - 1 for LinearAnnealingWithWarmUp's (s+1)/w: nxdt.lightning.optim.lr_lambda
    warmup = sched.warmup_steps
    last_ramp = warmup - 1 if sched.name == "LinearAnnealingWithWarmUp" else warmup
    if warmup > 0 and max_steps and last_ramp >= max_steps:
        out.append(
            f"warning: model.optim.sched.warmup_steps={warmup} does not end within trainer.max_steps={max_steps}: the "
            f"learning rate never reaches model.optim.lr={cfg.model.optim.lr}; use fewer warm-up steps or more steps"
        )
    # the decay ends constant_steps before sched.max_steps (then min_lr holds); ending after the run, it is cut short.
    # sched.max_steps follows trainer.max_steps unless set apart from it (an NxDT config always follows)
    decay_end = (sched.max_steps or 0) - max(0, sched.constant_steps)
    if sched.name != "constant" and max_steps and decay_end > max_steps:
        out.append(
            f"warning: model.optim.sched.max_steps={sched.max_steps} is beyond trainer.max_steps={max_steps}: the "
            f"{sched.name} decay runs to step {decay_end}, so the run stops before the learning rate falls to "
            f"model.optim.sched.min_lr={sched.min_lr}; leave model.optim.sched.max_steps to follow trainer.max_steps"
        )
    em = cfg.exp_manager
    if cfg.model_alignment_strategy.peft is not None and cfg.model.hf_checkpoint is None:
        if em.resume_from_checkpoint is None and not em.resume_if_exists:
            out.append(
                "warning: LoRA (model_alignment_strategy.peft) without model.hf_checkpoint: the adapters train on a "
                "randomly initialised base model; set model.hf_checkpoint=DIR (a Hugging Face model directory), or "
                "exp_manager.resume_from_checkpoint=CKPT model.weight_init_only=true, to adapt trained weights"
            )
    return out


class NotYetSupported(ConfigError):
    """A valid config asking for a feature this version cannot train with yet (it can still be planned)."""


def check_trainable(cfg: Any) -> None:
    """Refuse, before any worker starts, what would otherwise train silently wrong."""
    ds = cfg.distributed_strategy
    if ds.fsdp.enabled and ds.zero1:
        raise ConfigError(
            "distributed_strategy.zero1", True, "FSDP already shards the optimizer state; set zero1=false (or fsdp.enabled=false)"
        )
    recipes = [name for name in alignment_recipes(cfg) if name != "peft"]  # peft (LoRA) adapts any of them
    if len(recipes) > 1:
        raise ConfigError(
            f"model_alignment_strategy.{recipes[1]}",
            "",
            f"model_alignment_strategy.{recipes[0]} is set too; one recipe per run (remove one block)",
        )
    _check_preference_training(cfg)
    _check_peft(cfg)


def _check_preference_training(cfg: Any) -> None:
    """What DPO / ORPO training does not cover yet, refused by name."""
    mas = cfg.model_alignment_strategy
    name = next((n for n in ("dpo", "orpo") if getattr(mas, n, None) is not None), None)
    if name is None:
        return
    key = f"model_alignment_strategy.{name}"
    sorted_losses = [n for n in dpo_loss_types(mas.dpo.loss_type) if n in DPO_BATCH_SORTED_LOSS_TYPES] if name == "dpo" else []
    if sorted_losses:
        raise NotYetSupported(
            f"{key}.loss_type",
            sorted_losses[0],
            "it sorts the log-ratios over the batch, so a pair's loss would depend on which pairs share its micro-batch "
            f"(micro_batch_size, data parallelism); use one of {', '.join(DPO_LOSS_TYPES)}",
        )
    if name == "dpo" and not mas.dpo.precompute_ref_log_probs and cfg.distributed_strategy.pipeline_model_parallel_size > 1:
        raise NotYetSupported(
            f"{key}.precompute_ref_log_probs",
            False,
            "with pipeline parallelism the reference log-probabilities are computed once before training (by the policy's "
            "own pipeline, with the starting weights): scoring each step with a frozen copy would need a pipeline of "
            "its own; set true (the same numbers: the reference is frozen) or pipeline_model_parallel_size=1",
        )
