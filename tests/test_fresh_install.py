"""A new user's path: a fresh virtual environment, the README's first command, a run that learns.

The command is read from the README (the first ``bash`` block under "Set up and run"), so the
documented command is the one tested. The install is non-editable (``pip install -e .`` is rewritten to
``pip install .``) so the test also proves that the config tree and the sample text ship inside the
package. Only ``trainer.max_steps`` is shortened for time.

Three things a user's install does are left out because they cannot change what is tested: ensurepip's copy of pip in
the new environment (``python -m venv`` installs pip and byte-compiles it: 6.5 CPU-s measured, 14 s at load 6); the
pip that runs this test installs into the new environment instead (``pip --python``: pip re-runs itself under the
environment's interpreter, so the install, its isolated build and the ``nxdt`` script are the environment's own),
pip's byte-compilation of every installed module (``--no-compile``: ``.pyc`` files are only a cache of what the run
imports; it halves the install's CPU time, 52 → 25 CPU-seconds measured; ``PIP_NO_COMPILE`` extends it to the
setuptools and wheel that pip installs into the isolated build environment, which the wheel build imports from
source) and importing torch only to print its version (the installed distribution's version, ``2.13.0+cpu``, is what
``torch.__version__`` reports; the run imports torch anyway).
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_command(section: str) -> str:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}", 1)[1]
    return re.search(r"```bash\n(.*?)\n```", body, re.S).group(1).strip()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_first_command_in_a_fresh_venv(tmp_path):
    command = readme_command("Set up and run")
    assert command == "pip install -e . && nxdt train"
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    # --no-compile for the pip that fills the build environment too (no flag reaches that one; 1.9 CPU-s measured).
    # pip reads the variable as the value of its `compile` setting, so "0" is what turns compiling off (1 compiles).
    env["PIP_NO_COMPILE"] = "0"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q", "--no-compile", str(ROOT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    torch_version = subprocess.run(
        [str(bin_dir / "python"), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        env=env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert torch_version.endswith("+cpu"), f"a CPU build of torch must be installed, got {torch_version}"
    workdir = tmp_path / "elsewhere"  # not the repository: the package must carry its configs and data
    workdir.mkdir()
    run = subprocess.run(
        [str(bin_dir / "nxdt"), "train", "trainer.max_steps=6"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = sorted(workdir.glob("outputs/*/*/metrics.csv"))
    assert len(metrics) == 1
    with open(metrics[0], newline="") as fh:
        loss = {int(r["step"]): float(r["loss"]) for r in csv.DictReader(fh)}
    # learning from the shipped text: 5.55 (ln 256, a byte-level model that learnt nothing) to 4.01 at step 6 of this
    # 6-step run. Step 6's loss comes from the updates of steps 1-5, all inside llama_tiny's 5-step warmup, whose
    # learning rates do not depend on trainer.max_steps: the 10-step run before had the same 4.01 at step 6 (and 3.26
    # at step 10, for 4 more steps: ~3 s at load 6; 3.18 at step 10 of the 25 steps run before that);
    # a run whose data, gradients or optimizer did nothing stays near 5.55
    assert loss[6] < loss[1] - 1.0, loss
