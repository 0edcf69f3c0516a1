"""No dead config keys: every leaf of the schema (``nxdt/config/schema.py``) is read by some code path in
``nxdt/`` or ``models/``. A key nothing reads is a promise nxdt does not keep (``--help`` documents it, the
user sets it, nothing changes): wire it or delete it.

The code is read with ``ast``, not run. A key ``a.b.leaf`` counts as read where the code accesses ``leaf`` on
something that stands for ``b``:

* an attribute chain ``… .b.leaf``; a name bound to ``… .b`` (``ds = cfg.distributed_strategy``, also in tuple
  assignments), a parameter annotated with ``b``'s schema class, a name ``b_cfg`` / ``b_config``;
* a getter with the leaf's name as a string (``getattr(x, "leaf")``, ``x.get("leaf")``, ``x["leaf"]``,
  ``_opt(cfg, "leaf", default)``, ``moe_option(cfg, "leaf")``) on something standing for ``b`` or an ancestor;
* ``cfg`` / ``config`` (whatever node a function was handed) when the leaf's name is unique in the schema, or the
  key is top-level; in ``models/`` ``cfg`` is the model node (the hub models are handed ``model``);
* the dotted key as a string (``OmegaConf.select(cfg, "a.b.leaf")``, tables of keys read by a getter).

What does not count: the schema itself and the ``--help`` walk over it; the NxDT / Hugging Face translators
(``nxdt_compat.py``, ``nxdt_loader.py``, ``hf_model.py``: they *write* nxdt keys from another format's keys); the
table of what a resume may change (``resume_keys.py``: it names every key);
range checks (``validate.check_ranges`` and the ``_integer`` / ``_number`` / ``_positive`` helpers): a key
that is only checked is still dead. Cross-field validation does count (``instance.multi_node`` refuses a
multi-node job on a single-node instance).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections import Counter
from pathlib import Path

from nxdt.config.schema import CommConfig, Config

ROOT = Path(__file__).resolve().parent.parent
NOT_READERS = {
    "nxdt/config/schema.py",
    "nxdt/config/nxdt_compat.py",
    "nxdt/config/nxdt_loader.py",
    "nxdt/config/hf_model.py",
    "nxdt/config/resume_keys.py",  # names every key to classify it for resumes: a table of names, not a reader
}
RANGE_CHECKS = {"check_ranges", "_integer", "_number", "_positive", "check_run_name"}  # in nxdt/config/validate.py
GENERIC = {"cfg", "config"}

# Keys read by a name held in a table (a loop over names): key -> (file, module-level table) that must hold the leaf's name.
READ_BY_TABLE = {
    # llama3_inv_freq reads the four llama3 parameters of model.rope_scaling by these names
    "model.rope_scaling.factor": ("models/llama.py", "LLAMA3_ROPE_KEYS"),
    "model.rope_scaling.low_freq_factor": ("models/llama.py", "LLAMA3_ROPE_KEYS"),
    "model.rope_scaling.high_freq_factor": ("models/llama.py", "LLAMA3_ROPE_KEYS"),
    "model.rope_scaling.original_max_position_embeddings": ("models/llama.py", "LLAMA3_ROPE_KEYS"),
    # alignment_recipes reads each model_alignment_strategy block by these names (set, the block picks the recipe)
    "model_alignment_strategy.dpo": ("nxdt/config/validate.py", "ALIGNMENT_BLOCKS"),
    "model_alignment_strategy.orpo": ("nxdt/config/validate.py", "ALIGNMENT_BLOCKS"),
}


def _leaves(node: type, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for f in dataclasses.fields(node):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out += _leaves(type(default), prefix + (f.name,)) if dataclasses.is_dataclass(default) else [prefix + (f.name,)]
    return out


def _schema_classes(node: type, name: str = "cfg") -> dict[str, str]:
    """Schema class name -> the key it is the value of (``OptimConfig`` -> ``optim``)."""
    out = {node.__name__: name}
    for f in dataclasses.fields(node):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out.update(_schema_classes(type(default), f.name))
    return out


def _own_name(node: ast.AST) -> str | None:
    """The name an expression stands for: ``x.b`` -> b, ``b`` -> b, ``getattr(x, "b")`` -> b, ``x.b or y`` -> b."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.BoolOp):
        return _own_name(node.values[0])
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
    ):
        return node.args[1].value
    return None


def _nodes(tree: ast.AST, skip_ranges: bool):
    """Every node, without the subtrees of range checks (in validate.py)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if skip_ranges and isinstance(node, ast.FunctionDef) and node.name in RANGE_CHECKS:
            continue
        if skip_ranges and isinstance(node, ast.Call) and getattr(node.func, "id", None) in RANGE_CHECKS:
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


class Reads:
    """What the code reads: (parent name, leaf) by attribute or by getter, and dotted key strings."""

    def __init__(self) -> None:
        self.attributes: set[tuple[str, str]] = set()
        self.getters: set[tuple[str, str]] = set()
        self.dotted: set[str] = set()

    def scan(self, path: Path, classes: dict[str, str]) -> None:
        rel = path.relative_to(ROOT).as_posix()
        nodes = list(_nodes(ast.parse(path.read_text()), skip_ranges=rel == "nxdt/config/validate.py"))
        aliases: dict[str, set[str]] = {}

        def bind(target: ast.AST, value: ast.AST) -> None:
            if isinstance(target, ast.Name) and _own_name(value):
                aliases.setdefault(target.id, set()).add(_own_name(value))
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                for t, v in zip(target.elts, value.elts):
                    bind(t, v)

        for node in nodes:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target, node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                bind(node.target, node.value)
            elif isinstance(node, ast.arg) and node.annotation is not None:
                annotation = ast.unparse(node.annotation)
                aliases.setdefault(node.arg, set()).update(
                    key for cls, key in classes.items() if re.search(rf"\b{cls}\b", annotation)
                )

        def stands_for(expr: ast.AST) -> set[str]:
            names = {_own_name(expr)} - {None}
            if isinstance(expr, ast.Name):
                names |= aliases.get(expr.id, set())
            names |= {n.rsplit("_", 1)[0] for n in names if n.endswith(("_cfg", "_config"))}
            if rel.startswith("models/") and names & GENERIC:
                names.add("model")
            return names

        for node in nodes:
            if isinstance(node, ast.Attribute):
                self.attributes |= {(p, node.attr) for p in stands_for(node.value)}
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                self.getters |= {(p, node.slice.value) for p in stands_for(node.value)}
            elif isinstance(node, ast.Call) and not _name_of(node.func).endswith("Error"):
                strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                objects = [a for a in node.args if not isinstance(a, ast.Constant)]
                if _name_of(node.func) == "get" and isinstance(node.func, ast.Attribute):
                    objects.append(node.func.value)
                self.dotted.update(strings)
                self.getters |= {(p, s) for s in strings for o in objects for p in stands_for(o)}
            elif isinstance(node, (ast.Tuple, ast.List)):
                self.dotted.update(e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))


def _name_of(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


@functools.lru_cache(maxsize=None)
def _code_reads(classes: tuple[tuple[str, str], ...]) -> Reads:
    reads = Reads()
    for path in sorted(p for folder in ("nxdt", "models") for p in (ROOT / folder).rglob("*.py")):
        if path.relative_to(ROOT).as_posix() not in NOT_READERS:
            reads.scan(path, dict(classes))
    return reads


def unread_keys(schema: type = Config) -> list[str]:
    keys = _leaves(schema)
    unique = {leaf for leaf, n in Counter(k[-1] for k in keys).items() if n == 1}
    reads = _code_reads(tuple(sorted(_schema_classes(schema).items())))

    def read(key: tuple[str, ...]) -> bool:
        leaf, ancestors = key[-1], key[:-1]
        parent = ancestors[-1:] or tuple(GENERIC)
        return (
            any((p, leaf) in reads.attributes | reads.getters for p in parent)
            or any((a, leaf) in reads.getters for a in ancestors)
            or (leaf in unique and any((g, leaf) in reads.attributes | reads.getters for g in GENERIC))
            or ".".join(key) in reads.dotted
        )

    return [".".join(k) for k in keys if not read(k) and ".".join(k) not in READ_BY_TABLE]


def test_every_schema_key_is_read_by_some_code_path():
    unread = unread_keys()
    assert not unread, (
        f"config keys that no code in nxdt/ or models/ reads: {unread} — wire each (read it where it "
        "takes effect) or delete it from nxdt/config/schema.py, conf/ and the NxDT compat table"
    )


def test_the_keys_read_by_name_are_in_their_tables():
    for key, (file, table) in READ_BY_TABLE.items():
        tree = ast.parse((ROOT / file).read_text())
        values = [
            ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == table
        ]
        assert values and key.rsplit(".", 1)[-1] in values[0], (key, file, table)


def test_the_walk_finds_a_key_nothing_reads():
    """The check can fail: a field that exists only in the schema is reported, also where its name is common."""

    @dataclasses.dataclass
    class Probe(CommConfig):
        never_read_anywhere_xyz: int = 0
        devices: int = 0  # a name read all over nxdt (trainer.devices, instance.devices), never of a comm node

    @dataclasses.dataclass
    class ProbeConfig(Config):
        comm: Probe = dataclasses.field(default_factory=Probe)

    assert unread_keys(ProbeConfig) == ["comm.never_read_anywhere_xyz", "comm.devices"]
