"""Composing, validating, saving and loading configs (pure data: no torch.distributed, no processes).

``compose_config(overrides)`` is what ``nxdt train`` and ``nxdt plan`` use; workers read the resolved
``config.yaml`` the launcher wrote with ``load_run_config`` and never re-enter Hydra.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import pickle
import re
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from nxdt.config.schema import Config, field_docs, register_schemas
from nxdt.config.validate import ConfigError, read_json_object, validate

__all__ = [
    "Config",
    "ConfigError",
    "compose_config",
    "compose_nxdt_config",
    "load_run_config",
    "save_run_config",
    "run_config_text",
    "read_run_config_data",
    "to_config",
    "validate",
    "field_docs",
    "CONFIG_MODULE",
    "config_error_from_hydra",
    "available_options",
    "catalogue_instance",
]

CONFIG_MODULE = "nxdt.conf"


def conf_dir() -> Path:
    """The directory of the config tree (the installed ``nxdt.conf`` package)."""
    return Path(importlib.import_module(CONFIG_MODULE).__path__[0])


def available_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def catalogue_instance(name: str) -> Any:
    """The catalogue entry ``conf/instance/<name>.yaml`` as a typed InstanceConfig without a Hydra compose (~15 ms
    instead of ~0.3 s: workers read their emulated instance with it, an NxDT config's instance is inferred from the
    Trainium entries with it): the file merged over the entries its ``defaults`` list names, in Hydra's order
    (``_self_`` last unless placed), onto the schema. tests/test_topology_planner.py checks every entry equals the
    composed one."""
    from nxdt.config.schema import InstanceConfig

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(InstanceConfig), _instance_entry(name, ())))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"instance/{name}.yaml", "", str(exc).splitlines()[0]) from None


def _instance_entry(name: str, seen: tuple[str, ...]) -> DictConfig:
    """One catalogue file merged over the files its ``defaults`` list names (recursively)."""
    if name in seen:
        raise ConfigError(f"instance/{name}.yaml", "defaults", f"inherits from itself through {' -> '.join(seen)}")
    path = conf_dir() / "instance" / f"{name}.yaml"
    raw = OmegaConf.load(path)
    defaults = list(raw.pop("defaults", None) or [])
    if "_self_" not in defaults:
        defaults.append("_self_")
    merged = OmegaConf.create()
    for entry in defaults:
        if entry != "_self_" and not (path.parent / f"{entry}.yaml").is_file():
            continue  # the structured schema (ConfigStore), merged by catalogue_instance itself
        merged = OmegaConf.merge(merged, raw if entry == "_self_" else _instance_entry(str(entry), seen + (name,)))
    assert isinstance(merged, DictConfig)
    return merged


@functools.cache
def _schema_tree() -> DictConfig:
    return OmegaConf.structured(Config)


def schema_tree() -> DictConfig:
    """A fresh ``OmegaConf.structured(Config)``: the typed tree with every default, built from the dataclasses' type
    hints once per process (~75 ms) and copied (~15 ms) for each caller, who may change it."""
    return copy.deepcopy(_schema_tree())


def _closest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def config_error_from_hydra(exc: BaseException) -> ConfigError:
    """Turn Hydra/OmegaConf composition errors into one line naming the key, the value and the fix."""
    text = str(exc)
    cause = str(exc.__cause__) if exc.__cause__ else ""
    both = text + "\n" + cause
    m = re.search(r"Could not find '([^/']+)/([^']+)'", both)
    if m:
        group, option = m.groups()
        opts = available_options(group)
        return ConfigError(group, option, f"unknown {group}{_closest(option, opts)}; available: {', '.join(opts)}")
    m = re.search(r"full_key: (\S+)", cause)
    key = m.group(1) if m else None
    m = re.search(r"Value '([^']*)' of type '\w+' could not be converted to (\w+)", cause)
    if m and key:
        return ConfigError(key, m.group(1), f"must be of type {m.group(2).lower()}")
    if re.search(r"Key '[^']+' not in '\w+'", cause) and key:
        all_keys = [k for k, _, _ in field_docs()]
        prefix_len = key.count(".") + 1
        candidates = sorted({".".join(k.split(".")[:prefix_len]) for k in all_keys if k.count(".") + 1 >= prefix_len})
        return ConfigError(key, "", f"unknown key{_closest(key, candidates)}; `nxdt train --help` lists every key")
    first = next((line for line in (cause or text).splitlines() if line.strip()), type(exc).__name__)
    return ConfigError(key or "config", "", first.strip())


GROUPS = ("model", "data", "instance", "launcher", "recipe")  # config groups of conf/, chosen by name


def check_overrides(overrides: list[str] | tuple[str, ...], groups: tuple[str, ...] = GROUPS) -> None:
    """What Hydra would refuse in its own words (a lexer exception, ``Could not load 'instance/model_schema'``,
    ``Got NoneType``) or accept without effect, refused first in one line naming the key: a value with a control
    character, an override Hydra cannot parse, a config group option that is not a file of that group (a path such
    as ``instance=../model/llama_tiny``, ``null``), and ``hydra.*`` keys (nxdt composes with Hydra but runs no Hydra
    app: its callbacks, run directory, launchers and sweepers would silently do nothing)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for text in overrides:
        if not isinstance(text, str) or "=" not in text and not text.startswith("~"):
            continue  # the CLI says "key=value" for these
        key, _, value = text.partition("=")
        key = key.lstrip("+~").strip()
        if text.startswith("~"):  # Hydra's delete: a schema key cannot be deleted, and a whole section would reset
            raise ConfigError(
                key,
                value,
                "is a Hydra delete (~key), which nxdt does not take: every key has a typed default (`nxdt train "
                f"--help`); set the value you want instead: {key}=<value>",
            )
        if key == "hydra" or key.startswith("hydra.") or key.startswith("hydra/"):
            raise ConfigError(
                key,
                value,
                "nxdt composes its config with Hydra but runs no Hydra app: hydra.* keys (callbacks, run dir, "
                "launcher, sweeper) would have no effect; remove it (exp_manager.* places the run, -m sweeps)",
            )
        try:
            parsed = parser.parse_override(text)
        except Exception as exc:  # Hydra's grammar: OverrideParseException and its lexer's errors
            if not value.isprintable():  # what the lexer stops at, in its words "LexerNoViableAltException"
                raise ConfigError(
                    key, value, "contains a control character (newline, tab, escape, ...); give plain text"
                ) from None
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(
                key,
                value,
                f"is not a value Hydra's override grammar accepts ({reason}); quote a value with special characters, "
                "e.g. key='a b,c'",
            ) from None
        if parsed.is_sweep_override():  # key=a,b without -m: Hydra's "Ambiguous value", blamed on no key
            raise ConfigError(
                key,
                value,
                "is a comma-separated list, which Hydra reads as a sweep: quote it for one text value "
                f"({key}='{value}'), write a list as {key}=[{value}], or sweep over it with -m",
            )
        if key in groups and not text.startswith("~"):
            choice = parsed.value()
            options = available_options(key)
            if not isinstance(choice, str) or choice not in options:
                raise ConfigError(
                    key,
                    choice if isinstance(choice, str) else value,
                    f"unknown {key}{_closest(str(choice), options)}; name one of conf/{key}/: {', '.join(options)}",
                )


def _reject_unknown_keys(cfg: DictConfig) -> None:
    docs = field_docs()
    known = {k for k, _, _ in docs}
    sections = {k.rsplit(".", 1)[0] for k in known if "." in k}
    mappings = tuple(k + "." for k, default, _ in docs if default == "{}")  # free-form keys below (typed values)
    for key in _leaf_keys(cfg):
        if key not in known and key not in sections and not key.startswith(mappings):
            depth = key.count(".") + 1
            candidates = sorted({".".join(k.split(".")[:depth]) for k in known if k.count(".") + 1 >= depth})
            raise ConfigError(key, "", f"unknown key{_closest(key, candidates)}; `nxdt train --help` lists every key")


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, DictConfig):
        return [prefix[:-1]]
    keys = []
    for k in node.keys():
        keys.extend(_leaf_keys(node._get_node(k), f"{prefix}{k}."))
    return keys


def to_config(cfg: DictConfig) -> Config:
    """Resolve interpolations and turn the DictConfig into typed dataclass instances."""
    _reject_unknown_keys(cfg)
    try:
        OmegaConf.resolve(cfg)
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or _unresolvable_key(cfg) or "config"
        raise ConfigError(key, "", str(exc).splitlines()[0]) from None


def _unresolvable_key(cfg: DictConfig) -> str | None:
    """The first key whose interpolation cannot be resolved (``${oc.env:UNSET}``, ``${model.nope}``): OmegaConf's
    error on resolving the whole tree names none."""
    for key in _leaf_keys(cfg):
        try:
            OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        except OmegaConfBaseException:
            return key
    return None


@functools.cache  # the sources are package data and the ConfigStore (looked up live): fixed while a process runs
def _config_sources() -> tuple[Any, ...]:
    """Hydra's config sources for nxdt's tree (Hydra's own package, ``nxdt.conf``, the ConfigStore)."""
    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return tuple(GlobalHydra.instance().config_loader().get_sources())
    finally:
        GlobalHydra.instance().clear()


def is_config_group(key: str) -> bool:
    """Whether Hydra reads ``key=...`` as a choice of config group (``model``, ``recipe``, ``hydra/launcher``): its
    ``ConfigRepository.group_exists``, asked of the same sources."""
    return any(source.is_group(key) for source in _config_sources())


@functools.lru_cache(maxsize=64)  # ~22 kB each
def _composed_defaults(config_name: str, choices: tuple[str, ...]) -> bytes:
    """Hydra's compose of nxdt's tree with the overrides that choose config groups and no other: the defaults list
    and every file and schema on it merged (~0.25 CPU-s, most of a compose), once per process for each choice. Kept
    as a pickled snapshot of this process's own object (never read from anywhere else): ``pickle.loads`` gives each
    caller its copy in ~2 CPU-ms where a ``copy.deepcopy`` of the DictConfig took ~13 (a fit composing 78 figures:
    test_planner_fitting 41 -> 27 s at load 10)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=list(choices), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    # Of Hydra's own node only the group choices are kept, for ``name: ${hydra.runtime.choices.model}``: the rest
    # (its logging, launcher, sweeper) configures a Hydra app nxdt does not run.
    picked = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
    with open_dict(cfg):
        cfg.hydra = {"runtime": {"choices": picked}}
    return pickle.dumps(cfg)


def _hydra_compose(config_name: str, overrides: list[str] | tuple[str, ...]) -> DictConfig:
    """What ``hydra.compose(config_name, overrides)`` returns, in Hydra's own two steps (``ConfigLoaderImpl.
    _load_configuration_impl`` in hydra-core 1.3): an override whose key is a config group (or with an ``@package``)
    goes to the defaults list, every other one is a value set on the composed tree afterwards, in the order given, by
    Hydra's ``_apply_overrides_to_config`` (its errors and wording unchanged). The first step depends on the group
    choices alone, so it is composed once per process (``_composed_defaults``); a sweep of values, `nxdt plan -m`,
    ``distributed_strategy=auto`` and the tests pay only the second. A group key with a mapping value (Hydra sets it as
    a value, in order among the others) is composed in one piece, as Hydra does."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    choices: list[str] = []
    values = []
    for text, override in zip(overrides, parsed):
        if override.package is not None or is_config_group(override.key_or_group):
            if isinstance(override.value(), dict):
                return pickle.loads(_composed_defaults(config_name, tuple(overrides)))
            choices.append(text)
        else:
            values.append(override)
    cfg = pickle.loads(_composed_defaults(config_name, tuple(choices)))
    for override in values:
        _open_unset_sections(cfg, override.key_or_group)
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    return cfg


def _open_unset_sections(cfg: DictConfig, key: str) -> None:
    """A section that is null by default (``model_alignment_strategy.peft``, ``.dpo``, ...) filled with its schema's
    defaults when an override sets something inside it (``model_alignment_strategy.peft.lora_rank=8``, or the section
    as a mapping: ``model_alignment_strategy.peft={lora_rank: 8}``), as a YAML file that names the section does;
    OmegaConf cannot merge into a null node (its errors named no key). ``...peft=null`` still turns a section off."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return
        child = node._get_node(part)
        schema = child._metadata.ref_type if isinstance(child, DictConfig) else None
        if isinstance(schema, type) and dataclasses.is_dataclass(schema) and child._is_none():
            node[part] = schema()
        node = node[part]


def _resolved_name(cfg: DictConfig) -> Any:
    try:
        return cfg.name
    except OmegaConfBaseException as exc:
        raise ConfigError("name", OmegaConf.to_container(cfg, resolve=False)["name"], str(exc).splitlines()[0]) from None


def compose_config(
    overrides: list[str] | tuple[str, ...] = (), config_name: str = "config", *, check: bool = True, paths: bool = True
) -> Config:
    """nxdt's own config tree with Hydra overrides; ``paths=False`` (planning) does not require data and
    weight files to exist here."""
    register_schemas()
    check_overrides(overrides)
    try:
        cfg = _hydra_compose(config_name, overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise config_error_from_hydra(exc) from None
    OmegaConf.set_struct(cfg, False)
    if "hydra" in cfg and OmegaConf.is_interpolation(cfg, "name"):
        cfg.name = _resolved_name(cfg)  # before Hydra's node goes: the default name is the model's group choice
    cfg.pop("hydra", None)
    _take_hf_config(cfg, overrides)
    config = to_config(cfg)
    if check:
        validate(config, paths=paths)
    return config


def _explicit_model_keys(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The model fields (below ``model.``) a user set by name: ``model.KEY=...`` overrides, and every key of a model
    group chosen with ``model=NAME`` (its file is the user's choice too; the default group is not)."""
    keys: set[str] = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("model."):
            keys.add(key[len("model.") :])
        elif key == "model" and "=" in override:
            group = OmegaConf.load(conf_dir() / "model" / f"{override.split('=', 1)[1]}.yaml")
            keys.update(k for k in _leaf_keys(group) if k != "defaults")
    return keys


def _take_hf_config(cfg: DictConfig, overrides: list[str] | tuple[str, ...]) -> None:
    """``model.model_config=FILE`` (NxDT's spelling) or ``model.hf_checkpoint=DIR``: the architecture and every model
    field config.json holds come from it; an explicit override that changes the computation and contradicts it is
    refused by name (:func:`nxdt.config.hf_model.settings_from`). Without a config.json a checkpoint's tensors are
    still compared with the model before launch (``validate``)."""
    from nxdt.config.hf_model import HFConfigError, settings_from

    model = cfg.model
    key = "model.model_config" if model.get("model_config") is not None else "model.hf_checkpoint"
    value = OmegaConf.select(cfg, key)
    if value is None:
        return
    path = Path(str(value)).expanduser()
    file = path / "config.json" if path.is_dir() or key == "model.hf_checkpoint" else path
    if not file.is_file():
        if key == "model.hf_checkpoint":
            return
        raise ConfigError(key, value, "no such file; give a Hugging Face config.json (or the directory holding one)")
    try:  # size-capped: a 300 MB config.json is refused before it is read whole
        hf = read_json_object(file)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, value, f"{file} is not a readable config.json ({exc})") from None
    explicit = _explicit_model_keys(overrides)
    current = {k: OmegaConf.select(model, k) for k in _leaf_keys(model)}
    try:
        updates, contradiction = settings_from(hf, current, explicit)
    except HFConfigError as exc:
        raise ConfigError(key, value, f"{file}: {exc}") from None
    if contradiction is not None:
        name, ours, theirs, field = contradiction
        raise ConfigError(
            f"model.{name}",
            ours,
            f"contradicts {file} ({key}): its {field} is {theirs!r}; drop the override (config.json sets the model)",
        )
    for name, setting in updates.items():
        OmegaConf.update(model, name, setting, merge=False)


def compose_nxdt_config(
    config_path: str | Path,
    config_name: str,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    check: bool = True,
    paths: bool = True,
) -> tuple[Config, list[str]]:
    """A config written for NxD Training (``--config-path DIR --config-name NAME``, as NxDT's own launcher passes
    them) as a validated nxdt Config, plus the warnings to show the user once.

    Overrides use NxDT's keys or nxdt's (``instance=<name>`` picks the instance; NxDT configs name none).
    The file is composed by Hydra (interpolations such as NxDT's ``${multiply:...}`` resolve), overridden,
    translated by :func:`nxdt.config.nxdt_compat.translate` and merged onto nxdt's typed schema."""
    from nxdt.config import nxdt_loader

    return nxdt_loader.compose(config_path, config_name, overrides, check=check, paths=paths)


def run_config_text(config: Config) -> str:
    """What a run's ``config.yaml`` holds for ``config`` (built once per launch: the run directory and its history
    entry get the same text)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def save_run_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(run_config_text(config))


RUN_CONFIG_LIMIT = 4 << 20  # bytes: a resolved config.yaml is ~5 KB; a larger one is not a file nxdt wrote
RUN_CONFIG_NODES = 100_000  # YAML nodes once aliases are expanded (~400 in a run config; a billion-laughs file: 10**8)


def _expanded_nodes(node: Any, memo: dict[int, int]) -> int:
    """How many nodes ``node`` becomes once every alias is copied out, as OmegaConf copies them (memoised by node, so
    linear in the document even when the expansion is exponential; a node that contains itself counts once)."""
    import yaml

    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1
    if isinstance(node, yaml.MappingNode):
        count = 1 + sum(_expanded_nodes(k, memo) + _expanded_nodes(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        count = 1 + sum(_expanded_nodes(v, memo) for v in node.value)
    else:
        count = 1
    memo[id(node)] = count
    return count


@functools.cache
def _run_config_loader() -> Any:
    """The YAML loader for run configs: libyaml's parser (when PyYAML has it: ~10x faster than the pure-Python one,
    which every worker otherwise ran twice on start-up) with OmegaConf's rules, so a file reads as
    ``OmegaConf.create(text)`` would read it: a duplicate key is an error, ``1e-3`` is a float, timestamps stay
    strings. Python tags (``!!python/...``) are refused, as by any safe loader."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class RunConfigLoader(base):  # type: ignore[valid-type, misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            keys = set()
            for key_node, _ in node.value:
                if key_node.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                    if key_node.value in keys:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping",
                            node.start_mark,
                            f"found duplicate key {key_node.value}",
                            key_node.start_mark,
                        )
                    keys.add(key_node.value)
            return super().construct_mapping(node, deep=deep)

    RunConfigLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_YAML_TIMESTAMP, _YAML_FLOAT)]
        for first, resolvers in base.yaml_implicit_resolvers.items()
    }
    RunConfigLoader.add_implicit_resolver(_YAML_FLOAT, _OMEGACONF_FLOAT, list("-+0123456789."))
    return RunConfigLoader


_YAML_FLOAT, _YAML_TIMESTAMP = "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"
_OMEGACONF_FLOAT = re.compile(  # OmegaConf's float rule (YAML 1.2's: an exponent needs no dot)
    r"""^(?:[-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def read_run_config_data(path: Path) -> dict[str, Any]:
    """A run's ``config.yaml`` as plain data, read as a file anyone who can write the run directory may have crafted:
    without following a link or blocking on a FIFO, at most RUN_CONFIG_LIMIT bytes, UTF-8, one YAML mapping that
    stays small once its aliases are expanded (a "billion laughs" file would make OmegaConf build 10**8 nodes), parsed
    once (:func:`_run_config_loader`). ValueError (one line) for what it refuses."""
    import errno
    import os
    import stat

    import yaml

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError("a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))) from None
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = fh.read(RUN_CONFIG_LIMIT + 1)
    if len(data) > RUN_CONFIG_LIMIT:
        raise ValueError(f"more than {RUN_CONFIG_LIMIT >> 20} MiB, not a config nxdt wrote")
    try:
        loader = _run_config_loader()(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    try:
        node = loader.get_single_node()
        if not isinstance(node, yaml.MappingNode):
            raise ValueError(f"holds {'nothing' if node is None else 'a single value or a list'}, not a mapping of config keys")
        if _expanded_nodes(node, {}) > RUN_CONFIG_NODES:
            raise ValueError(f"expands to more than {RUN_CONFIG_NODES:,} YAML nodes (aliases), not a config nxdt wrote")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        from nxdt.config.nxdt_loader import reading_error

        raise ValueError(reading_error(exc)) from None
    finally:
        loader.dispose()


def load_run_config(path: str | Path) -> Config:
    """Read a resolved ``config.yaml`` back into the typed schema (unknown keys and bad types fail); a crafted file
    (a link, a FIFO, binary, a YAML bomb, a Python tag) is a ConfigError naming it, never a hang or a traceback."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "", "no such run config; pass a run directory written by `nxdt train`")
    try:
        merged = OmegaConf.merge(schema_tree(), read_run_config_data(path))
    except (ValueError, OmegaConfBaseException, yaml.YAMLError) as exc:
        raise ConfigError(getattr(exc, "full_key", "") or str(path), "", str(exc).splitlines()[0]) from None
    return to_config(merged)
