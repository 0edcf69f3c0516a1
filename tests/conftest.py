"""Test-suite setup. Its presence puts ``tests/`` on ``sys.path`` (pytest's prepend import mode) before any test
module is collected, so tests in sub-folders import the shared helpers of this folder (``hf_reference``,
``test_train_e2e``'s launch helpers) whatever order pytest collects them in."""

from shared_runs import everyday_runs, reliability_reference  # noqa: E402,F401  (session fixtures several modules share)

import os  # noqa: E402

import pytest  # noqa: E402

SHARED_RUN_FIXTURES = {"everyday_runs", "reliability_reference"}

# The groups that took longest in a full run on the 2-core host (seconds of one xdist worker, measured 2026-11-28/29),
# scheduled first: xdist hands out groups in collection order, so a long group collected last (the alphabet puts
# test_readme_commands, test_reliability and test_train_e2e there) ran alone on one worker while the other idled.
# Longest first is the classic list-scheduling bound; a module missing here only runs later, nothing else changes.
LONGEST_GROUPS = (
    "shared_runs",  # test_train_e2e + test_reliability + test_runs_report + test_eval + test_security ...: ~600 s
    "tests/test_readme_commands.py",  # ~400 s
    "tests/test_lora_checkpoint_e2e.py",
    "tests/test_dpo_e2e.py",
    "tests/test_multinode.py",
    "tests/test_model_parallel_e2e.py",
    "tests/test_nxdt_configs.py",
    "tests/test_vocab_padding_e2e.py",
    "tests/test_grpo_train.py",
    "tests/test_reshard.py",
    "tests/test_context_parallel_e2e.py",
    "tests/test_sft_e2e.py",
    "tests/test_fresh_install.py",
    "tests/test_trackers.py",
    "tests/test_bad_input_matrix.py",
    "tests/test_lightning_conformance_dist.py",
    "tests/parallel/test_lora_lightning.py",
)


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
    and waited for it (CI, twice)."""
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


def pytest_configure(config):
    """In-process tests compute on one thread. The suite's two xdist workers (and the worker processes of every
    launch, which take cores // local ranks threads each) already fill both cores; an OpenMP team of two on contended
    cores spends its time in barrier spins — a 3-second in-process training took 120 s under load and hit its timeout."""
    import torch

    torch.set_num_threads(1)
