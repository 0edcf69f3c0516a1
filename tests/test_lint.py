"""The README's test command lints too: ruff's pyflakes rules (unused imports and variables, undefined names)
and syntax errors over the package, the model hub, the tests and the experiments; ruff's formatter
([tool.ruff.format]); and mypy over nxdt/ (its scope and what it does not report yet: [tool.mypy] in
pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The whole tree is checked by `ruff format --check .` once it has been formatted (`ruff format .` on main, in one
# commit of its own); until then only the files below, already formatted, are kept so. Switch on: True.
FORMAT_WHOLE_TREE = True
FORMATTED = [
    "nxdt/lightning/strategy.py",
    "nxdt/lightning/sharded_checkpoint.py",
    "nxdt/lightning/collectives.py",
    "nxdt/lightning/environment.py",
    "nxdt/parallel/parallelize.py",
    "tests/test_lint.py",
]


def test_ruff_finds_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", "nxdt", "models", "tests", "experiments"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_mypy_finds_nothing():
    # mypy's own incremental cache (.mypy_cache/, git-ignored), as a developer's `mypy` uses it: a module is rechecked
    # when its source, a dependency's interface, the options or mypy's version changed (mypy keys each entry by all
    # four), so the findings equal a full check's. Measured: 13-17 CPU-s without a cache (a clean checkout, CI's first
    # run), 0.5 CPU-s with one after a full check (every later run of the suite on a host).
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def _ruff_format_check(*paths: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *paths], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, "run `ruff format` on these:\n" + result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.skipif(
    not FORMAT_WHOLE_TREE, reason="the tree is not formatted yet: `ruff format .` once on main, then FORMAT_WHOLE_TREE = True"
)
def test_ruff_format_leaves_the_tree_unchanged():
    _ruff_format_check(".")


def test_ruff_format_leaves_the_formatted_files_unchanged():
    _ruff_format_check(*FORMATTED)
