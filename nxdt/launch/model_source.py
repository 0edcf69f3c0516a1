"""The model a command reads (``nxdt eval``, ``nxdt generate``): an nxdt checkpoint or a Hugging Face directory.

MODEL is an nxdt checkpoint (``<run>/checkpoints/step-<N>``, any layout, consolidated here: its run's ``config.yaml``
gives the architecture and the tokenizer, ``data.tokenizer``) or a Hugging Face model directory (``config.json`` +
safetensors, e.g. what ``nxdt checkpoint export-hf`` writes; its ``tokenizer.json`` if there — the directory, so its
``tokenizer_config.json`` and chat template come with it — else byte-level). One loader, shared by the commands.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdt.config.validate import read_json_object
from nxdt.launch.runs import printable

HF_DEFAULT_MAX_SEQ = 2048  # a Hugging Face model's default window: its max_position_embeddings, at most this


class CommandError(Exception):
    """Bad input to a command: ``str()`` is one line naming what and how to fix it (printed, exit 2)."""


def check_fits(command: str, prompts: list[list[int]], max_new_tokens: int, max_positions: int) -> None:
    """Every prompt plus ``max_new_tokens`` within the model's positions, refused before decoding starts: past them
    the model has no position to give a token (transformers' RoPE models silently extrapolate; nxdt's refuse
    mid-batch), and a huge ``--max-new-tokens`` would size the KV cache by it."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    need = len(prompts[longest]) + max_new_tokens
    if need > max_positions:
        room = max_positions - len(prompts[longest])
        fix = f"give --max-new-tokens {room} or less" if room >= 1 else "shorten the prompt"
        raise CommandError(
            f"{command}: prompt {longest} has {len(prompts[longest])} tokens; with --max-new-tokens {max_new_tokens} it "
            f"would need {need} positions, more than the model's max_position_embeddings={max_positions} — {fix}"
        )


def check_output(command: str, out: str) -> None:
    """``--out`` refused before any model is loaded: a system directory, a link, not a regular file
    (:func:`nxdt.config.validate.output_path_problem`, the one home of those rules)."""
    from nxdt.config.validate import output_path_problem

    problem = output_path_problem(out)
    if problem is not None:
        raise CommandError(f"{command}: --out {printable(out)} {problem}")


def write_output(command: str, out: str, text: str) -> None:
    """``--out``: one line, exit 2, when it cannot be written (a directory, a missing parent, no permission, a link
    planted since :func:`check_output`)."""
    from nxdt.config.validate import write_output_file

    try:
        write_output_file(out, text.encode("utf-8"))
    except ValueError as exc:
        raise CommandError(f"{command}: --out {printable(out)} {exc}") from None
    except OSError as exc:
        raise CommandError(
            f"{command}: --out {printable(out)}: cannot be written ({exc.strerror or exc}) — name a file"
        ) from None


@dataclass
class Loaded:
    model: Any  # a hub model (torch.nn.Module) in eval mode
    tokenizer: str | None  # a tokenizer.json or its directory, None = byte-level
    seq_length: int
    what: str  # "nxdt checkpoint" / "Hugging Face directory"
    vocab_size: int  # the model's embedding rows: token ids must be below it
    max_positions: int  # model.max_position_embeddings: a window, or a prompt plus its completion, must fit in it


def _config_from_meta(where: Path, run_config: Path, command: str) -> Any:
    """A config whose model is the one a checkpoint's meta.json records (``model_config``: every field of
    :data:`nxdt.config.hf_model.META_KEYS`, what ``export-hf`` builds config.json from) and whose tokenizer is the
    run's (``tokenizer``); the window: the model's positions, at most HF_DEFAULT_MAX_SEQ. Checkpoints of nxdt
    versions before model_config was recorded need their run's config.yaml: refused naming it."""
    from nxdt.config import compose_config
    from nxdt.lightning.checkpoint import CheckpointError, read_meta

    try:
        meta = read_meta(where)
    except CheckpointError as exc:
        raise CommandError(f"{command}: {str(exc).splitlines()[0]}") from None
    fields = meta.get("model_config")
    if not isinstance(fields, dict) or not isinstance(fields.get("architecture"), str):
        raise CommandError(
            f"{command}: {where} does not record its model (written by an older nxdt) and its run's config "
            f"{run_config} is missing — evaluate it inside its run directory, or export it (nxdt checkpoint export-hf) "
            "where the run is and give the export"
        )
    cfg = compose_config(["data=synthetic"])
    for key, value in fields.items():
        *parents, leaf = key.split(".")
        node = cfg.model
        for part in parents:
            node = getattr(node, part)
        if not hasattr(node, leaf):
            raise CommandError(f"{command}: {where}/meta.json records model.{key}, which this nxdt does not know")
        setattr(node, leaf, value)
    tokenizer = meta.get("tokenizer")
    cfg.data.tokenizer = tokenizer if isinstance(tokenizer, str) else None
    cfg.data.seq_length = min(cfg.model.max_position_embeddings, HF_DEFAULT_MAX_SEQ)
    return cfg


def check_model_dir(command: str, path: str) -> None:
    """MODEL refused before torch is imported (15 CPU-s, a minute on a loaded host, before a typo was named): a
    directory with an nxdt checkpoint's meta.json or a Hugging Face config.json."""
    where = Path(path).expanduser()
    if not (where / "meta.json").is_file() and not (where / "config.json").is_file():
        raise CommandError(
            f"{command}: {printable(path)} is neither an nxdt checkpoint (meta.json) nor a Hugging Face model directory "
            "(config.json)"
        )


def load_model(path: str, command: str = "nxdt eval") -> Loaded:
    """The hub model of an nxdt checkpoint (any layout, consolidated) or of a Hugging Face directory; ``command``
    starts the one-line error (:class:`CommandError`)."""
    import torch

    from nxdt.config import ConfigError, compose_config, load_run_config
    from nxdt.lightning.module import import_architecture, load_checkpoint_weights, read_checkpoint_weights

    where = Path(path).expanduser()
    if (where / "meta.json").is_file():
        run_config = where.parent.parent / "config.yaml"
        if run_config.is_file():
            try:
                cfg = load_run_config(run_config)
            except ConfigError as exc:  # e.g. a run config another nxdt version wrote
                raise CommandError(f"{command}: {run_config}: {str(exc).splitlines()[0]}") from None
        else:  # outside its run directory (consolidated elsewhere, copied): the model config its meta.json records
            cfg = _config_from_meta(where, run_config, command)
        torch.manual_seed(cfg.seed)
        model = import_architecture(cfg.model.architecture)(cfg.model)
        try:
            state, kind = read_checkpoint_weights(str(where))
            if kind in ("with_base", "adapters_only"):
                raise CommandError(
                    f"{command}: {where} holds LoRA adapters; export a merged model first "
                    f"(nxdt checkpoint export-hf DIR OUT --merge) and give {command} OUT"
                )
            load_checkpoint_weights(model, str(where), state=state)
        except (ValueError, OSError) as exc:
            raise CommandError(f"{command}: {where}: {str(exc).splitlines()[0]}") from None
        tokenizer = cfg.data.tokenizer
        return Loaded(
            model.eval(),
            str(Path(tokenizer).expanduser()) if tokenizer else None,
            cfg.data.seq_length,
            "nxdt checkpoint",
            cfg.model.vocab_size,
            cfg.model.max_position_embeddings,
        )
    if (where / "config.json").is_file():
        from nxdt.lightning.hf import load_hf_weights

        # only the model is used: synthetic data (no byte-level vocabulary check), a window the model fits (a tiny
        # model's 64 positions < the default 128)
        overrides = ["data=synthetic", f"model.hf_checkpoint={where.resolve()}"]
        try:
            positions = read_json_object(where / "config.json").get("max_position_embeddings")
        except (ValueError, OSError, AttributeError):
            positions = None  # compose_config reads config.json again and names what is wrong with it
        if isinstance(positions, int) and positions > 0:
            overrides.append(f"data.seq_length={min(positions, HF_DEFAULT_MAX_SEQ)}")
        try:
            cfg = compose_config(overrides)
            model = import_architecture(cfg.model.architecture)(cfg.model)
            load_hf_weights(model, where, cfg.model.architecture)
        except (ConfigError, ValueError, OSError) as exc:
            raise CommandError(f"{command}: {where}: {str(exc).splitlines()[0]}") from None
        return Loaded(
            model.eval(),
            str(where) if (where / "tokenizer.json").is_file() else None,  # the directory: its chat template too
            min(cfg.model.max_position_embeddings, HF_DEFAULT_MAX_SEQ),
            "Hugging Face directory",
            cfg.model.vocab_size,
            cfg.model.max_position_embeddings,
        )
    raise CommandError(
        f"{command}: {where} is neither an nxdt checkpoint (meta.json) nor a Hugging Face model directory (config.json)"
    )
