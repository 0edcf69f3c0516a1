"""The explicit package list in pyproject.toml must name every sub-package (models/ and conf/ are
mapped into the nxdt namespace, so automatic discovery cannot be used)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    found = {
        "nxdt." + ".".join(p.parent.relative_to(ROOT / "nxdt").parts) if p.parent != ROOT / "nxdt" else "nxdt"
        for p in (ROOT / "nxdt").rglob("__init__.py")
    }
    for top, name in (("models", "nxdt.models"), ("conf", "nxdt.conf")):
        found |= {
            name + "".join("." + part for part in p.parent.relative_to(ROOT / top).parts)
            for p in (ROOT / top).rglob("__init__.py")
        }
    assert found <= listed, f"add to pyproject.toml [tool.setuptools].packages: {sorted(found - listed)}"


def test_torch_is_pinned_to_the_cpu_build():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in deps


def test_version_flag_prints_the_project_version(capsys):
    """Issue 39 probe: `nxdt --version`, a newcomer's first command, was "unknown command"; it prints the version
    pyproject.toml declares."""
    from nxdt.cli import main

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"nxdt {version}\n"
