"""The README's test command lints too: ruff's pyflakes rules (unused imports and variables, undefined names)
and syntax errors over the package, the model hub, the tests and the experiments (config in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "nxdt", "models", "tests",
                             "experiments"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
