"""The README's test command lints too: ruff's pyflakes rules (unused imports and variables, undefined names)
and syntax errors over the package, the model hub, the tests and the experiments; and mypy over nxdt/ (its
scope and what it does not report yet: [tool.mypy] in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "nxdt", "models", "tests",
                             "experiments"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_mypy_finds_nothing():
    # no cache: the result never depends on an earlier run; the whole check takes ~8 s of CPU
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
