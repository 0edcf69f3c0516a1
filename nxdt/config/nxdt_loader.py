"""Reading an NxDT config from disk: the I/O around the pure translation in :mod:`nxdt.config.nxdt_compat`.

1. Hydra composes ``DIR/NAME.yaml`` as NxDT's own launcher does (``--config-path``/``--config-name``).
2. Command-line overrides are sorted: NxDT's keys change the NxDT config before translation (so
   ``model.num_layers=2`` overrides config.json as in NxDT); nxdt's own keys (``data.source=synthetic``,
   ``comm.timeout_s=30``) change the translated config afterwards; ``instance=<name>`` picks the instance.
3. ``model.model_config`` is read; the translation runs; the instance is taken from the command line, the
   file, or inferred from ``trainer.devices``/``trainer.lnc``.
4. The result is merged onto nxdt's typed schema and validated like any nxdt config.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any, Mapping

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nxdt.config.nxdt_compat import (
    GPT2_BPE_VOCAB,
    check_keys,
    infer_instance,
    is_our_key,
    rule_for,
    translate,
    unknown_key_error,
)
from nxdt.config.schema import Config, register_schemas
from nxdt.config.validate import ConfigError, read_capped, read_json_object, validate

# NxDT registers this resolver for `model_parallel_size: ${multiply:${...tensor...}, ${...pipeline...}}`
if not OmegaConf.has_resolver("multiply"):
    OmegaConf.register_new_resolver("multiply", lambda x, y: x * y)

# files an NxDT config names, resolved like model.model_config (see _resolve_path)
PATH_KEYS = ("model.model_config", "data.train_dir")
# nxdt's config groups with no NxDT counterpart: chosen (`launcher=slurm`) and overridden (`instance.devices=8`)
# on nxdt's own config tree, then taken from it whole
OWN_GROUPS = ("instance", "launcher")


def compose(
    config_path: str | Path,
    config_name: str,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    check: bool = True,
    paths: bool = True,
) -> tuple[Config, list[str]]:
    from nxdt.config import check_overrides, compose_config, schema_tree, to_config

    check_overrides(overrides, groups=("instance",))  # NxDT's own keys may share other group names
    config_dir = Path(config_path).expanduser().resolve()
    instance, group_overrides, nxdt_overrides, our_overrides = _sort_overrides(overrides)
    raw = _load_file(config_dir, config_name)
    for ov in nxdt_overrides:
        _apply(raw, ov)
    check_keys(OmegaConf.to_container(raw, resolve=False))
    try:
        nxdt = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(getattr(exc, "full_key", "") or config_name, "", str(exc).splitlines()[0]) from None
    for key in PATH_KEYS:
        _resolve_path(nxdt, key, config_dir)
    hf = _read_hf_config(nxdt)
    translation = translate(nxdt, hf)

    name = instance or translation.instance
    if name is None:
        trainer = translation.config.get("trainer", {})
        name = infer_instance(trainer.get("devices"), trainer.get("lnc"), trainium_catalogue())
    own = compose_config([f"instance={name}", *group_overrides], check=False)

    register_schemas()
    cfg = schema_tree()
    try:
        for group in OWN_GROUPS:
            setattr(cfg, group, OmegaConf.structured(getattr(own, group)))
        cfg.merge_with(translation.config)
        for ov in our_overrides:
            _apply(cfg, ov)
        if OmegaConf.is_missing(cfg.model, "vocab_size") and nxdt.get("model_source") == "megatron":
            cfg.model.vocab_size = _megatron_vocab(nxdt)
        if cfg.data.source == "synthetic":  # `data.source=synthetic` on the command line: NxDT's train_dir is not read
            cfg.data.train_dir = None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or "config"
        raise ConfigError(key, "", str(exc).splitlines()[0]) from None
    config = to_config(cfg)
    if check:
        validate(config, paths=paths)
    return config, translation.warnings()


def _sort_overrides(overrides: list[str] | tuple[str, ...]) -> tuple[str | None, list[str], list[Override], list[Override]]:
    """(instance name, other overrides of OWN_GROUPS as text, NxDT-key overrides, nxdt-key overrides)."""
    instance, group_overrides, nxdt, ours = None, [], [], []
    for text, ov in zip(overrides, OverridesParser.create().parse_overrides(list(overrides))):
        key = ov.key_or_group
        if ov.is_sweep_override():
            raise ConfigError(key, "", "several values sweep: run with -m (multirun)")
        if key == "instance":
            instance = ov.value()
        elif key.split(".")[0] in OWN_GROUPS:
            group_overrides.append(text)
        elif rule_for(key) is not None or _under_rule(key):
            nxdt.append(ov)
        elif is_our_key(key):
            ours.append(ov)
        else:
            raise unknown_key_error(key)
    return instance, group_overrides, nxdt, ours


def _under_rule(key: str) -> bool:
    """A whole NxDT section given at once, e.g. ``model.moe={num_experts: 8, top_k: 2}``."""
    from nxdt.config.nxdt_compat import RULES

    return any(k.startswith(key + ".") for k in RULES)


def _apply(cfg: DictConfig, ov: Override) -> None:
    key = ov.key_or_group
    if ov.type == OverrideType.DEL:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig) and leaf in node:
            node.pop(leaf)
        return
    OmegaConf.update(cfg, key, ov.value(), merge=True, force_add=True)


def reading_error(exc: BaseException) -> str:
    """What is wrong with a config file, in a few words: YAML's problem and its line, or the error's first line (a
    scalar file: "not a mapping of keys" rather than OmegaConf's "Invalid loaded object type: int")."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return f"not valid YAML: {exc.problem or exc.context}{where}"
    text = str(exc)
    if text.startswith("Invalid loaded object type"):
        return f"holds a single value ({text.rsplit(':', 1)[-1].strip()}), not a mapping of config keys"
    return next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)


def _load_file(config_dir: Path, config_name: str) -> DictConfig:
    if not config_dir.is_dir():
        raise ConfigError("--config-path", str(config_dir), "no such directory; give the directory holding the NxDT YAML file")
    name = config_name[:-5] if config_name.endswith(".yaml") else config_name
    try:
        text = read_capped(config_dir / f"{name}.yaml").decode()
    except (OSError, ValueError, UnicodeDecodeError):
        text = None  # Hydra's compose below says what is wrong with it, as before
    if text is not None and "defaults" not in text:
        return copy.deepcopy(_composed_file(str(config_dir), config_name, text))
    return _compose_file(config_dir, config_name)


@functools.lru_cache(maxsize=16)
def _composed_file(config_dir: str, config_name: str, text: str) -> DictConfig:
    """A config file with no defaults list (NxDT's own have none) is all Hydra reads of ``config_dir``: its compose
    (~0.15 CPU-s, Hydra's own config tree included) is a function of its text, kept per process and copied by the
    caller. ``text`` (the key) is what the file held when read; a changed file is a new key."""
    return _compose_file(Path(config_dir), config_name)


def _compose_file(config_dir: Path, config_name: str) -> DictConfig:
    name = config_name[:-5] if config_name.endswith(".yaml") else config_name
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = hydra_compose(config_name=name)
    except MissingConfigException:
        available = sorted(p.stem for p in config_dir.glob("*.yaml"))
        raise ConfigError(
            "--config-name", config_name, f"no {name}.yaml in {config_dir}; available: {', '.join(available) or 'none'}"
        ) from None
    except Exception as exc:  # Hydra's and OmegaConf's errors, YAML syntax, a file that is no mapping (a number)
        raise ConfigError(
            "--config-name", config_name, f"cannot read {config_dir / (name + '.yaml')}: {reading_error(exc)}"
        ) from None
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra", None)
    return cfg


def _resolve_path(nxdt: dict[str, Any], dotted: str, config_dir: Path) -> None:
    """A relative path is taken from the working directory when it exists there, else from the config
    file's directory (so a config directory can carry its config.json); absolute in the result."""
    *parents, leaf = dotted.split(".")
    node: Any = nxdt
    for p in parents:
        node = node.get(p) if isinstance(node, Mapping) else None
    if not isinstance(node, dict) or not isinstance(node.get(leaf), str):
        return
    path = Path(node[leaf]).expanduser()
    if not path.is_absolute():
        path = path.resolve() if path.exists() or not (config_dir / path).exists() else config_dir / path
    node[leaf] = str(path)


def _read_hf_config(nxdt: Mapping[str, Any]) -> dict[str, Any] | None:
    value = (nxdt.get("model") or {}).get("model_config")
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            "model.model_config",
            value,
            "no such file; give a Hugging Face config.json (NxDT configs often "
            "name /home/ubuntu/config.json: override it with model.model_config=PATH)",
        )
    try:
        data = read_json_object(path)  # size-capped: a 300 MB file was read whole
    except (OSError, ValueError) as exc:
        raise ConfigError("model.model_config", value, f"not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError("model.model_config", value, "not a Hugging Face config (a JSON object)")
    return data


def _megatron_vocab(nxdt: Mapping[str, Any]) -> int:
    """A Megatron model's vocabulary: its tokenizer's ids (a tokenizer.json, GPT2BPETokenizer's vocab.json), unpadded
    (under TP the parallel embedding and head pad it to make_vocab_size_divisible_by × TP, masked)."""
    tok = (nxdt.get("data") or {}).get("tokenizer") or {}
    kind, ids = tok.get("type"), None
    if kind == "GPT2BPETokenizer":
        ids = _json_size(tok.get("vocab_file"), lambda d: len(d) if isinstance(d, dict) else None) or GPT2_BPE_VOCAB
    elif isinstance(kind, str):
        path = Path(kind).expanduser()
        ids = _json_size(path / "tokenizer.json" if path.is_dir() else path, _tokenizer_ids)
    if ids is None:
        raise ConfigError(
            "model.vocab_size",
            "",
            f"the Megatron model's vocabulary comes from its tokenizer (data.tokenizer.type="
            f"{kind}), not readable here: give data.tokenizer.type=DIR (a Hugging Face tokenizer directory) or "
            "model.vocab_size=N",
        )
    return ids


def _json_size(path: Any, size) -> int | None:
    try:
        return size(json.loads(Path(path).read_text())) if path is not None and Path(path).is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _tokenizer_ids(tokenizer_json: Any) -> int | None:
    """Highest id + 1 of a tokenizer.json: its model's vocabulary (a dict for BPE/WordPiece, a list for Unigram) and
    added tokens."""
    if not isinstance(tokenizer_json, dict):
        return None
    vocab = (tokenizer_json.get("model") or {}).get("vocab")
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab))) if isinstance(vocab, list) else []
    ids += [t["id"] for t in tokenizer_json.get("added_tokens") or [] if isinstance(t, dict) and isinstance(t.get("id"), int)]
    return max(ids) + 1 if ids else None


def trainium_catalogue() -> dict[str, dict[int, int]]:
    """Trainium instance → {lnc: ranks per node} (key 0: at the instance's default lnc), for inference."""
    from nxdt.config import available_options, catalogue_instance
    from nxdt.topology import ranks_per_device

    catalogue = {}
    for name in available_options("instance"):
        if not name.startswith("trn"):
            continue  # NxDT trains on Trainium
        inst = catalogue_instance(name)  # the entry as composed (8 Hydra composes took ~2 CPU-s)
        per_lnc = {lnc: inst.devices * ranks_per_device(inst, lnc) for lnc in (inst.lnc_options or [inst.lnc_default])}
        per_lnc[0] = inst.devices * ranks_per_device(inst, inst.lnc_default)
        catalogue[name] = per_lnc
    return catalogue
