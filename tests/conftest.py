"""Test-suite setup. Its presence puts ``tests/`` on ``sys.path`` (pytest's prepend import mode) before any test
module is collected, so tests in sub-folders import the shared helpers of this folder (``hf_reference``,
``test_train_e2e``'s launch helpers) whatever order pytest collects them in."""

from shared_runs import attacked_restart, everyday_runs, reliability_reference  # noqa: E402,F401  (session fixtures several modules share)

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SHARED_RUN_FIXTURES = {"attacked_restart", "everyday_runs", "reliability_reference"}

# The groups that took longest in a full run on the 2-core host (worker-seconds, the README's command on main at a6cad8d,
# 2026-11-29 13:24, load 1-3), scheduled longest first — the classic list-scheduling bound; a group missing here only runs
# later, nothing else changes. xdist (>= 3.8) would otherwise re-sort the groups by their number of tests
# (`--loadscope-reorder`, its default: ``pytest_configure`` turns it off), which put the one-test fresh-install group
# last: it started at 651 s of 741 while the other worker had finished at 653.
LONGEST_GROUPS = (
    "shared_runs",  # 176 s
    "tests/test_readme_commands.py",  # 89 s
    "tests/test_fresh_install.py",  # 68 s
    "tests/test_multinode.py",  # 68 s
    "tests/test_lightning_api.py",  # 56 s
    "tests/test_model_parallel_e2e.py",  # 52 s
    "tests/test_trackers.py",  # 35 s
    "tests/test_lightning_conformance_dist.py",  # 34 s
    "tests/test_reshard.py",  # 32 s
    "tests/test_dpo_e2e.py",  # 26 s
    "tests/test_nxdt_configs.py",  # 26 s
    "tests/test_config_cli.py",  # 24 s
    "tests/test_lightning_conformance_demos.py",  # 23 s
    "tests/test_vocab_padding_e2e.py",  # 21 s
    "tests/test_nxdt_upstream_cases.py",  # 19 s
    "tests/test_grpo_train.py",  # 19 s
    "tests/test_context_parallel_e2e.py",  # 19 s
    "tests/comm/test_shared_tensors.py",  # 17 s
    "tests/test_sft_e2e.py",  # 16 s
    "tests/test_rope_attention.py",  # 15 s
    "tests/parallel/test_fsdp.py",  # 14 s
    "tests/comm/test_collectives.py",  # 13 s
    "tests/comm/test_transport.py",  # 11 s
    "tests/test_family_train.py",  # 11 s
    "tests/test_lightning_conformance_ckpt.py",  # 11 s
    "tests/test_stochastic_rounding.py",  # 11 s
    "tests/comm/test_native.py",  # 11 s
    "tests/comm/test_algorithms.py",  # 10 s
    "tests/parallel/test_overlap.py",  # 10 s
    "tests/test_resume_keys.py",  # 10 s
    "tests/test_planner_heldout.py",  # 10 s
    "tests/parallel/test_pipeline.py",  # 10 s
    "tests/test_lora_checkpoint_e2e.py",  # 9 s
    "tests/test_bad_input_matrix.py",  # 9 s
    "tests/test_nxdt_semantics.py",  # 8 s
    "tests/test_hf_interop.py",  # 8 s
    "tests/parallel/test_moe.py",  # 7 s
    "tests/test_config_keys_read.py",  # 6 s
    "tests/test_first_output.py",  # 6 s
    "tests/parallel/test_tensor_parallel.py",  # 5 s
    "tests/test_orpo.py",  # 5 s
)


@pytest.fixture
def short_tmpdir():
    """A private TMPDIR for a launch, with a short path: the workers' fork server listens on a Unix socket under it
    (``pymp-…/listener-…``), whose path must fit 107 bytes — a pytest ``tmp_path`` under xdist
    (``/tmp/pytest-of-…/pytest-N/popen-gw0/test_…``) does not always leave room for it."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="nxdt-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks to group the items
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the README's ``-n 2 --dist loadgroup``) each module's tests run on one worker, so a
    module-scoped launch starts once; the modules that use the session's shared runs form one group, so those
    launches start once too. The longest groups go first (``LONGEST_GROUPS``)."""
    module = {item: item.nodeid.split("::")[0] for item in items}
    sharing = {module[item] for item in items if SHARED_RUN_FIXTURES & set(getattr(item, "fixturenames", ()))}
    group = {item: "shared_runs" if module[item] in sharing else module[item] for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[item]))
    rank = {name: i for i, name in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(group[item], len(rank)))  # stable: each module keeps its own order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test leaves os.environ as it found it. Lightning's launcher writes LOCAL_RANK, WORLD_SIZE and
    MASTER_PORT into the launching process's environment even for one process, so after an in-process fit every
    later subprocess inherited LOCAL_RANK=0 — and a ``python train.py`` of two ranks then started no second rank
    and waited for it (CI, twice). And on torch's compute threads: the same launcher, finding no OMP_NUM_THREADS, sets
    torch's threads to cores // processes (``_set_num_threads_if_needed``: 2 here), so every later in-process test of
    that worker computed on an OpenMP team of two on contended cores (a 0.3 s sampling test took 12.8 CPU-s)."""
    import torch

    saved, threads = dict(os.environ), torch.get_num_threads()
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def compile_sources() -> None:
    """Byte-compile the repository's modules once per suite (``__pycache__``, as ``pip install`` does for an installed
    package). An editable install is imported from source, and a host with ``PYTHONDONTWRITEBYTECODE`` set (this one)
    never caches what it compiles: each of the suite's ~60 fresh interpreters that import nxdt (launchers, fork
    servers, scripts run as users run them) compiled it again, ~0.4 CPU-s each. Python checks each cached file against
    its source's size and modification time, so a stale one is never used; up-to-date files cost a stat."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for folder in ("nxdt", "models", "tests"):
        compileall.compile_dir(root / folder, quiet=2, workers=1)


def pytest_configure(config):
    """Groups are handed out in the order ``pytest_collection_modifyitems`` leaves them (``LONGEST_GROUPS``), not
    re-sorted by xdist by their number of tests. In-process tests compute on one thread: the suite's two xdist
    workers (and the worker processes of every launch, which take cores // local ranks threads each) already fill both
    cores; an OpenMP team of two on contended cores spends its time in barrier spins — a 3-second in-process training
    took 120 s under load and hit its timeout."""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.8
        config.option.loadscopereorder = False
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, once, before any worker or launch imports nxdt
        compile_sources()
    # pytest keeps each test module's assertion-rewritten code in __pycache__ unless bytecode writing is off, as this
    # host's PYTHONDONTWRITEBYTECODE turns it: every worker then parsed and rewrote all ~200 modules on every run (7 of
    # a worker's 20 CPU-s of collection, measured). Read before each test module is imported: set here, before that.
    sys.dont_write_bytecode = False
    import torch

    torch.set_num_threads(1)


def pytest_unconfigure(config):
    """The last act of the controller and of each xdist worker: no final garbage collection over the torch,
    Lightning and transformers objects a worker imported (frozen; what nxdt's own program does at exit, nxdt/cli.py)."""
    import gc

    gc.freeze()
