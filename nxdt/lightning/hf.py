"""Hugging Face checkpoint interop for the model hub's families (every ``nxdt.config.hf_model.FAMILIES`` spec).

Tensor names go through the family's state-dict adapter (:class:`StateDictAdapter`, the rules of
``nxdt.config.hf_model.ModelSpec.weights``): Llama's and Mixtral's are ours under ``model.`` (``lm_head`` has none);
Qwen3-MoE's experts are renamed (w1/w3/w2 ↔ gate_proj/up_proj/down_proj); GPT-2's are renamed, q/k/v fused into ``c_attn`` and ``Conv1D`` weights transposed. So:

* import: ``model.hf_checkpoint=DIR`` loads ``DIR/*.safetensors`` into the full model on every rank before
  tensor/pipeline parallelism slices it — any layout starts from the same weights; the model config came from
  ``DIR/config.json`` when the config was composed (``nxdt.config``);
* export: ``nxdt checkpoint export-hf CKPT OUT`` reassembles a (TP × PP sharded) nxdt checkpoint into full
  tensors — TP shards concatenated along the dimension recorded in ``meta.json``'s ``tensor_parallel``
  layout, PP stages merged by name — and writes a Hugging Face model directory: ``model.safetensors`` (HF names,
  fp32 or bf16), the family's own ``config.json`` with every field that changes the computation,
  ``generation_config.json`` and the run's tokenizer files. Importing, training zero effective steps and exporting
  returns the original bytes.
"""

from __future__ import annotations

import json
import os
import re
import stat
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from nxdt.config.hf_model import DEFAULT_ARCHITECTURE, ModelSpec, family_of_architecture
from nxdt.config.validate import read_json_object


MODULE_PREFIX = "model."  # CausalLMModule holds the hub model as `model`


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def our_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


_PATTERN_PARTS = {"i": r"(?P<i>\d+)", "e": r"(?P<e>\d+)", "p": r"(?P<p>weight|bias)", "name": r"(?P<name>.+)"}


def _regex(pattern: str) -> re.Pattern[str]:
    """A :class:`~nxdt.config.hf_model.WeightRule` name pattern as a regex binding ``{i}``, ``{e}``, ``{p}``, ``{name}``."""
    out, rest = "", pattern
    while "{" in rest:
        before, _, after = rest.partition("{")
        field, _, rest = after.partition("}")
        out += re.escape(before) + _PATTERN_PARTS[field]
    return re.compile(out + re.escape(rest) + "$")


class StateDictAdapter:
    """Our tensor names ↔ a Hugging Face family's (torchtitan's ``StateDictAdapter``: ``to_hf`` / ``from_hf``), by
    the family's :attr:`~nxdt.config.hf_model.ModelSpec.weights` rules: renamed, fused along the output dimension,
    transposed. A name no rule maps passes through unchanged, for the caller to name it."""

    def __init__(self, family: ModelSpec) -> None:
        self.family = family
        self._ours = [[_regex(p) for p in rule.ours] for rule in family.weights]
        self._hf = [_regex(rule.hf) for rule in family.weights]

    def _match_hf(self, key: str) -> tuple[int, dict[str, str]] | None:
        for index, regex in enumerate(self._hf):
            m = regex.match(key)
            if m:
                return index, m.groupdict()
        return None

    def canonical(self, key: str) -> str | None:
        """A checkpoint's tensor name as :meth:`from_hf` takes it (the family's prefix added where an older
        checkpoint leaves it out); None: not weights (a buffer), skipped."""
        if key.endswith(self.family.skip):
            return None
        prefix = self.family.hf_prefix
        if prefix and not key.startswith(prefix) and self._match_hf(key) is None and self._match_hf(prefix + key):
            return prefix + key
        return key

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]] = {}
        out: dict[str, torch.Tensor] = {}
        for name in state:
            found = next(
                (
                    (r, j, m.groupdict())
                    for r, regexes in enumerate(self._ours)
                    for j, rx in enumerate(regexes)
                    if (m := rx.match(name))
                ),
                None,
            )
            if found is None:
                out[name] = state[name]
                continue
            r, j, bound = found
            groups.setdefault((r, tuple(sorted(bound.items()))), {})[j] = name
        for (r, bindings), names in groups.items():
            rule = self.family.weights[r]
            if len(names) < len(rule.ours):  # part of a fused tensor: passed through, named by the caller
                out.update({n: state[n] for n in names.values()})
                continue
            parts = [state[names[j]] for j in range(len(rule.ours))]
            tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            if rule.transpose and tensor.dim() == 2:
                tensor = tensor.t()
            out[rule.hf.format(**dict(bindings))] = tensor.contiguous()
        return out

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            found = self._match_hf(key)
            if found is None:
                out[key] = tensor
                continue
            rule, bound = self.family.weights[found[0]], found[1]
            if rule.transpose and tensor.dim() == 2:
                tensor = tensor.t()
            if tensor.shape[0] % len(rule.ours):
                out[key] = tensor  # cannot be split: its shape is reported by the caller
                continue
            for pattern, part in zip(rule.ours, tensor.chunk(len(rule.ours), dim=0)):
                out[pattern.format(**bound)] = part.contiguous()
        return out


def adapter_for(architecture: str) -> StateDictAdapter:
    """The state-dict adapter of the HF family ``architecture`` (an nxdt hub class path) maps to."""
    return StateDictAdapter(family_of_architecture(architecture))


def _read_hf_state(directory: str | Path, adapter: StateDictAdapter) -> dict[str, torch.Tensor]:
    files = sorted(Path(directory).expanduser().glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.hf_checkpoint={directory}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), "pt") as fh:
            for key in fh.keys():
                name = adapter.canonical(key)
                if name is not None:
                    state[name] = fh.get_tensor(key)
    return state


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory: str | Path, architecture: str) -> None:
    """Copy every tensor of a HF safetensors checkpoint into ``model`` through its family's adapter (names and
    shapes must match exactly)."""
    params = dict(model.named_parameters())
    seen = set()
    adapter = adapter_for(architecture)
    for name, tensor in adapter.from_hf(_read_hf_state(directory, adapter)).items():
        if name not in params:
            raise ValueError(f"model.hf_checkpoint={directory}: tensor {name} has no counterpart in {type(model).__name__}")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"model.hf_checkpoint={directory}: {name} has shape {list(tensor.shape)}, the configured model "
                f"expects {list(params[name].shape)} — make the model config match the checkpoint's config.json"
            )
        params[name].copy_(tensor)
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"model.hf_checkpoint={directory}: missing tensors {missing[:4]}{' …' if len(missing) > 4 else ''}")


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    merge: bool = False,
    base: str | Path | None = None,
    dtype: str = "fp32",
) -> Path:
    """Write a Hugging Face model directory (``model.safetensors``, the family's ``config.json``,
    ``generation_config.json``, the run's tokenizer files) from an nxdt checkpoint directory (the model part of the
    consolidated full state, :func:`nxdt.lightning.reshard.read_full_state`). A LoRA checkpoint exports as
    :func:`nxdt.lightning.lora_checkpoint.export_lora_checkpoint` says: a PEFT adapter directory, or with ``merge`` a
    full model with the adapters merged (``base``: the Hugging Face directory an adapters-only checkpoint merges into,
    whose config.json, generation_config.json and tokenizer the export keeps)."""
    from nxdt.lightning.reshard import read_full_state  # reshard builds on this package's checkpoint module

    from nxdt.lightning.checkpoint import CheckpointError, refuse_target_inside_checkpoint
    from nxdt.lightning.lora_checkpoint import lora_kind

    refuse_target_inside_checkpoint(checkpoint, out)
    _check_out(Path(out))
    if dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {dtype}: export writes {' or '.join(EXPORT_DTYPES)}")
    if lora_kind(checkpoint) != "none":  # adapters: a PEFT adapter directory, or with merge a full model
        from nxdt.lightning.lora_checkpoint import export_lora_checkpoint

        try:
            return export_lora_checkpoint(checkpoint, out, merge=merge, base=base, dtype=dtype)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    if merge or base is not None:
        raise CheckpointError(f"checkpoint {checkpoint} has no LoRA adapters to merge; export it without --merge / --base")
    state = read_full_state(checkpoint, optimizer=False)
    model = {name[len(MODULE_PREFIX) :] if name.startswith(MODULE_PREFIX) else name: t for name, t in state.model.items()}
    return export_hf_state(model, export_source(checkpoint), out, dtype=dtype)


EXPORT_DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
# a tokenizer directory's files AutoTokenizer reads (tokenizer.json alone is enough for a fast tokenizer)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def export_source(checkpoint: str | Path) -> dict[str, Any]:
    """What an export needs besides the tensors, from a checkpoint's meta.json: ``model_config`` (the flat model
    config, :func:`nxdt.config.hf_model.model_meta`) and ``tokenizer`` (the run's data.tokenizer, or None).
    Checkpoints of older nxdt versions record neither: they are read from the run's config.yaml
    (``RUN/checkpoints/step-N`` → ``RUN/config.yaml``) when it is there, else the export is refused by name."""
    from nxdt.config import ConfigError, load_run_config
    from nxdt.config.hf_model import model_meta
    from nxdt.lightning.checkpoint import CheckpointError, read_meta

    root = Path(checkpoint)
    meta = read_meta(root)
    if meta.get(MODEL_CONFIG_KEY) is not None:
        return {"model_config": meta[MODEL_CONFIG_KEY], "tokenizer": meta.get(TOKENIZER_KEY)}
    run_config = root.resolve().parent.parent / "config.yaml"
    try:
        cfg = load_run_config(run_config)
    except ConfigError:
        raise CheckpointError(
            f"checkpoint {root} does not record its model config (written by an older nxdt) and its run's "
            f"config.yaml is not at {run_config}; export it from inside its run directory"
        ) from None
    recorded = meta.get("model") or {}
    fields = model_meta(cfg.model)
    differ = [k for k, v in recorded.items() if k in fields and fields[k] != v]
    if differ:
        raise CheckpointError(
            f"checkpoint {root}: {run_config} describes another model ({differ[0]}={fields[differ[0]]}, the checkpoint "
            f"has {recorded[differ[0]]}); export it from its own run directory"
        )
    return {"model_config": fields, "tokenizer": cfg.data.tokenizer}


MODEL_CONFIG_KEY = "model_config"  # meta.json: the flat model config (hf_model.model_meta), for export-hf
TOKENIZER_KEY = "tokenizer"  # meta.json: the run's data.tokenizer (absolute), for export-hf


def _check_out(out: Path) -> None:
    from nxdt.lightning.checkpoint import CheckpointError

    if out.is_symlink():
        raise CheckpointError(f"{out} is a symbolic link; export-hf never writes through links — name a new directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory — name a new directory to export to")


def hf_files(
    model_config: dict[str, Any], tokenizer: str | None, dtype: str, base: str | Path | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Path]]:
    """(config.json, generation_config.json, {file name: tokenizer file to copy}) of an export. With ``base`` (the
    HF directory a LoRA merge started from) its config.json is kept, checked against the model, and its
    generation config and tokenizer files are used where the run had none."""
    from nxdt.config.hf_model import HFConfigError, family_of
    from nxdt.lightning.checkpoint import CheckpointError

    try:
        family = family_of_architecture(model_config["architecture"])
        config = family.hf_config(model_config, EXPORT_DTYPES[dtype][1])
    except HFConfigError as exc:
        raise CheckpointError(f"cannot export as a Hugging Face model: {exc}") from None
    generation: dict[str, Any] = {}
    sources: list[Path] = []
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise CheckpointError(f"the run's tokenizer {tokenizer} is gone; restore it there to export it with the model")
        sources.append(path if path.is_dir() else path.parent)
    if base is not None:
        base_dir = Path(base).expanduser()
        try:
            theirs = read_json_object(base_dir / "config.json")  # size-capped, no FIFO blocked on
            bad = family_of(theirs).mismatches(theirs, model_config)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"--base {base}: no usable config.json there ({exc})") from None
        if bad:
            name, ours, value = bad[0]
            raise CheckpointError(f"--base {base}: its config.json has {name}={value!r}, the checkpoint's model {ours!r}")
        config = {**theirs, "torch_dtype": EXPORT_DTYPES[dtype][1]}
        config.pop("dtype", None)  # transformers 5's spelling of torch_dtype
        if (base_dir / "generation_config.json").is_file():
            try:
                generation = read_json_object(base_dir / "generation_config.json")
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"--base {base}: its generation_config.json is unusable ({exc})") from None
        if tokenizer is None:
            sources.append(base_dir)
    files: dict[str, Path] = {}
    if sources:
        if tokenizer is not None and Path(tokenizer).expanduser().is_file():
            files["tokenizer.json"] = Path(tokenizer).expanduser()  # a tokenizer.json of any name
        for name in TOKENIZER_FILES:
            if name not in files and (sources[0] / name).is_file():
                files[name] = sources[0] / name
    if not generation:
        special = _special_ids(files)
        for key in ("bos_token_id", "eos_token_id"):
            config[key] = special.get(key, config.get(key))
        generation = {"_from_model_config": True, **{k: config.get(k) for k in ("bos_token_id", "eos_token_id")}}
        if special.get("pad_token_id") is not None:
            generation["pad_token_id"] = special["pad_token_id"]
    return config, generation, files


def _special_ids(files: dict[str, Path]) -> dict[str, int]:
    """bos/eos/pad ids of the exported tokenizer (its tokenizer_config.json's tokens, looked up in tokenizer.json)."""
    if "tokenizer.json" not in files or "tokenizer_config.json" not in files:
        return {}
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(files["tokenizer.json"]))
    config = read_json_object(files["tokenizer_config.json"])
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        tid = vocab.token_to_id(text) if isinstance(text, str) else None
        if tid is not None:
            out[f"{key}_id"] = tid
    return out


def export_hf_state(
    model: dict[str, torch.Tensor],
    source: dict[str, Any],
    out: str | Path,
    *,
    dtype: str = "fp32",
    base: str | Path | None = None,
) -> Path:
    """Write ``OUT/model.safetensors`` (HF names, through the family's adapter) + config.json,
    generation_config.json and the tokenizer files from a full model state by hub names (no ``model.`` prefix) and
    :func:`export_source`'s description of the run."""
    from nxdt.lightning.checkpoint import CheckpointError

    out = Path(out)
    _check_out(out)
    model_config = source["model_config"]
    config, generation, tokenizer_files = hf_files(model_config, source.get("tokenizer"), dtype, base)
    if model_config.get("tie_word_embeddings"):
        model = {n: t for n, t in model.items() if n != "lm_head.weight"}  # HF ties it again on loading
    to = EXPORT_DTYPES[dtype][0]
    full = {k: t.to(to).contiguous() for k, t in adapter_for(model_config["architecture"]).to_hf(model).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    # written into a fresh private directory beside the target, then renamed into place: nothing is written
    # through a link planted in the target meanwhile, and a crash leaves no half export under the target's name
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(full, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
        for name, file in tokenizer_files.items():
            shutil.copyfile(file, staging / name)
        if out.is_dir() and not out.is_symlink():
            out.rmdir()  # empty (checked above); rename will not replace a directory on every platform
        os.rename(staging, out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"could not export to {out}: {exc.strerror or exc}") from None
    return out / "model.safetensors"


# safetensors dtypes a float parameter can be loaded from (copy_ converts them); anything else is not weights
LOADABLE_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_ITEM_BYTES = {
    **LOADABLE_DTYPES,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


class HFCheckpointError(ValueError):
    """A ``model.hf_checkpoint`` the workers could not load: ``fix`` is the one-line reason and remedy."""

    def __init__(self, fix: str) -> None:
        self.fix = fix
        super().__init__(fix)


def read_safetensors_header(file: Path) -> dict[str, Any]:
    """``{name: {"dtype", "shape", "data_offsets"}}`` of one safetensors file from its 8-byte length and JSON header
    alone (no tensor data is read); the offsets are checked against the file's size (a truncated file fails here)."""
    # O_NONBLOCK: a FIFO planted as a model file would block open() until a writer came; links are followed (the
    # Hugging Face cache links its snapshots' files to blobs), but what was opened must be a regular file
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise HFCheckpointError(f"{file.name} cannot be read ({exc.strerror or exc}); the file is damaged") from None
    with open(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HFCheckpointError(f"{file.name} is not a regular file (a device, FIFO or socket); the file is damaged")
        size = info.st_size
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise HFCheckpointError(f"{file.name} is {size} bytes, too short for a safetensors header; the file is damaged")
        length = int.from_bytes(prefix, "little")
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise HFCheckpointError(
                f"{file.name} does not start with a safetensors header (header length {length}, file "
                f"{size} bytes); the file is damaged or not safetensors"
            )
        raw = fh.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise HFCheckpointError(f"{file.name}'s safetensors header is not JSON; the file is damaged") from None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{file.name}'s safetensors header is not a JSON object; the file is damaged")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") in _ITEM_BYTES
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) for o in entry["data_offsets"])
        )
        if ok:
            begin, stop = entry["data_offsets"]
            count = 1
            for d in entry["shape"]:
                count *= d
            ok = 0 <= begin <= stop and stop - begin == count * _ITEM_BYTES[entry["dtype"]]
        if not ok:
            raise HFCheckpointError(
                f"{file.name}: the header's entry for {name} is malformed (dtype, shape, offsets); the file is damaged"
            )
        end = max(end, entry["data_offsets"][1])
    if 8 + length + end != size:
        raise HFCheckpointError(
            f"{file.name} is {size} bytes, its header describes {8 + length + end}; the file is "
            f"{'truncated' if 8 + length + end > size else 'damaged'}"
        )
    return header


def check_hf_checkpoint(
    directory: str | Path, expected: dict[str, tuple[int, ...]], tied: bool = False, architecture: str | None = None
) -> int:
    """The launcher's check of ``model.hf_checkpoint`` against the configured model's parameter shapes
    (``expected``: our names → shapes, e.g. from the model built on the ``meta`` device), in the checkpoint's names
    (the family's adapter, by ``architecture``; default Llama's): every file's header whole, every tensor known, of
    the expected shape and a float dtype, none missing — what :func:`load_hf_weights` would find only in the
    workers. Reads headers only. Returns the tensors checked."""
    adapter = adapter_for(architecture or DEFAULT_ARCHITECTURE)
    shapes = {
        k: tuple(t.shape) for k, t in adapter.to_hf({n: torch.empty(s, device="meta") for n, s in expected.items()}).items()
    }
    files = sorted(Path(directory).expanduser().glob("*.safetensors"))
    if not files:
        raise HFCheckpointError("no *.safetensors files there; give a Hugging Face model directory saved with safetensors")
    seen: dict[str, str] = {}
    for file in files:
        try:
            header = read_safetensors_header(file)
        except OSError as exc:
            raise HFCheckpointError(f"cannot read {file.name}: {exc.strerror or exc}") from None
        for key, entry in header.items():
            name = adapter.canonical(key)
            if name is None:
                continue
            if name not in shapes:
                raise HFCheckpointError(
                    f"{file.name}: tensor {key} has no counterpart in the configured model "
                    f"({'its head is tied to the embedding; set model.tie_word_embeddings=false' if tied and name == 'lm_head.weight' else 'make model.architecture and the model config match the checkpoint'})"
                )
            if name in seen:
                raise HFCheckpointError(f"tensor {key} is in both {seen[name]} and {file.name}; give one copy of each tensor")
            seen[name] = file.name
            if tuple(entry["shape"]) != shapes[name]:
                raise HFCheckpointError(
                    f"{file.name}: {key} has shape {entry['shape']}, the configured model expects "
                    f"{list(shapes[name])}; make the model config match the checkpoint's config.json"
                )
            if entry["dtype"] not in LOADABLE_DTYPES:
                raise HFCheckpointError(
                    f"{file.name}: {key} is {entry['dtype']}, not floating-point weights (loadable: "
                    f"{', '.join(LOADABLE_DTYPES)}); give an unquantized checkpoint"
                )
    missing = sorted(set(shapes) - set(seen))
    if missing:
        raise HFCheckpointError(
            f"missing tensors {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''} "
            f"({len(missing)} of {len(shapes)}); give the complete checkpoint, or a model config of its shape"
        )
    return len(seen)
