"""The import rule of docs/architecture.md §2: imports only go downwards.

Walks every ``import`` / ``from ... import`` (module level and inside functions, relative ones resolved) of
every module under ``nxdt/`` and ``models/`` (installed as ``nxdt.models``) with :mod:`ast`, and fails when a
module imports one of a higher layer. Layers, lowest first (same-layer imports are allowed):

    config, topology (pure data)  →  planner  →  comm  →  parallel, models, data  →  lightning  →  launch, cli
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    ("config", "topology", "collector", "gc_paused"),
    ("planner",),
    ("comm",),
    ("parallel", "models", "data"),
    ("lightning",),
    ("launch", "cli"),
]
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}

# Known upward imports, each with its reason. Keep this list short; an entry here is a debt.
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    """Dotted module name → file, for nxdt/ and models/ (as nxdt.models)."""
    out = {}
    for package, directory in (("nxdt", ROOT / "nxdt"), ("nxdt.models", ROOT / "models")):
        for path in sorted(directory.rglob("*.py")):
            rel = path.relative_to(directory).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((package, *rel))] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Every module this file imports (absolute dotted names), wherever the import statement is."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            if target == "nxdt":  # `from nxdt import comm`: the names are the modules
                found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _layer(name: str) -> tuple[str, int] | None:
    """(layer part, level) of an nxdt module name; None outside nxdt or for the bare root package."""
    parts = name.split(".")
    if parts[0] != "nxdt" or len(parts) < 2 or parts[1] not in LEVEL:
        return None
    return parts[1], LEVEL[parts[1]]


def test_every_module_has_a_layer():
    unplaced = [m for m in _modules() if m != "nxdt" and _layer(m) is None]
    assert not unplaced, f"modules outside every layer (add them to LAYERS in this test and to docs/architecture.md): {unplaced}"


def test_imports_only_go_downwards():
    violations = []
    for module, path in _modules().items():
        here = _layer(module)
        if here is None:
            continue
        for target in sorted(_imports(module, path)):
            there = _layer(target)
            if there is None or there[1] <= here[1]:
                continue
            if (module, f"nxdt.{there[0]}") in ALLOWED:
                continue
            violations.append(f"{path.relative_to(ROOT)}: {here[0]} imports {target} ({there[0]} is a higher layer)")
    assert not violations, "lower layers import higher ones:\n" + "\n".join(sorted(set(violations)))


def test_the_allow_list_is_still_needed():
    """An entry that no longer matches an upward import must go (the debt was paid)."""
    modules = _modules()
    for module, layer_pkg in ALLOWED:
        here, there = _layer(module), _layer(layer_pkg)
        if there[1] <= here[1]:
            continue  # recorded for the reader only: not an upward import
        assert any(t == layer_pkg or t.startswith(layer_pkg + ".") for t in _imports(module, modules[module])), (
            f"{module} no longer imports {layer_pkg}: remove it from ALLOWED"
        )


def test_parallel_builds_on_comm_only():
    """docs/architecture.md §2: the parallel layers take communicators (their degrees are the groups' sizes), never
    the plan or the config: a Lightning-free user of nxdt.parallel needs nxdt.comm (and its peers models/data)."""
    outside = []
    for module, path in _modules().items():
        if module.startswith("nxdt.parallel"):
            for target in sorted(_imports(module, path)):
                layer = _layer(target)
                if layer is not None and layer[0] in ("config", "topology", "planner"):  # higher: the test above
                    outside.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not outside, "\n".join(outside)
