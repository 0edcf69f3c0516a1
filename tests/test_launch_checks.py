"""The launcher's cheap checks of what the workers would otherwise find wrong only after they start: training text
(a sample of each file), a save_to_disk dataset's JSON and Arrow schema, a tokenizer.json, an hf_checkpoint's
safetensors headers against the configured model, the model class, and host memory. Each is one config line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nxdt.cli import _check_host_memory, _check_model, check_data
from nxdt.config import ConfigError, compose_config
from nxdt.data.datasets import SAMPLE_BYTES, TextSourceError, check_text_files
from nxdt.lightning.hf import HFCheckpointError, check_hf_checkpoint, hf_name, read_safetensors_header
from nxdt.lightning.module import import_architecture
from shared_runs import run_train


def llama_tiny_tensors(**overrides) -> dict[str, torch.Tensor]:
    """HF-named tensors of the shapes llama_tiny (the default model) expects."""
    cfg = compose_config([f"model.{k}={v}" for k, v in overrides.items()])
    with torch.device("meta"):
        model = import_architecture(cfg.model.architecture)(cfg.model)
    return {hf_name(n): torch.zeros(p.shape) for n, p in model.named_parameters()}


def write_hf(directory: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / name))
    return directory / name


def refusal(overrides: list[str], check=check_data) -> ConfigError:
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as info:
        check(cfg)
    assert "\n" not in str(info.value)
    return info.value


# ------------------------------------------------------------------------------------------ text


def test_text_files_are_sampled_not_read(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * 4096 + b"\xff\xfe")  # invalid UTF-8 only after the sample: left to the workers
    check_text_files(big, 128, byte_level=True)
    cut = tmp_path / "cut.txt"
    cut.write_bytes("é".encode() * (SAMPLE_BYTES // 2) + b"x")  # the sample ends inside no character
    check_text_files(cut, 128, byte_level=True)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "bad.txt").write_bytes(b"\x80abc")
    with pytest.raises(TextSourceError, match=r"sub/bad.txt is not UTF-8"):
        check_text_files(tmp_path, 128, byte_level=True)


def test_text_length_is_checked_only_for_byte_level(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("x" * 129)  # 129 bytes: exactly one sample of 128 (+1 label)
    check_text_files(short, 128, byte_level=True)
    with pytest.raises(TextSourceError, match="holds 129 bytes"):
        check_text_files(short, 129, byte_level=True)
    check_text_files(short, 129, byte_level=False)  # a subword tokenizer's count is not known without tokenizing


def test_the_shipped_sample_and_good_inputs_pass():
    for overrides in ([], ["data=synthetic"], ["model=gpt_tiny"], ["model=mixtral_tiny"]):
        check_data(compose_config(overrides))


# ------------------------------------------------------------------------------------------ hf_dataset


def test_a_dataset_schema_without_input_ids_is_refused_without_reading_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc  # noqa: F401

    table = pa.table({"input_ids": [[1.0, 2.0]]})  # floats: not token ids
    with pa.ipc.new_stream(str(tmp_path / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    error = refusal(["data.source=hf_dataset", f"data.train_dir={tmp_path}"])
    assert error.key == "data.train_dir" and "not a list of token ids" in error.fix


# ------------------------------------------------------------------------------------------ tokenizer


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(300)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.save(str(tmp_path / "tokenizer.json"))
    error = refusal([f"data.tokenizer={tmp_path}"])
    assert error.key == "data.tokenizer" and "300 token ids" in error.fix and "model.vocab_size >= 300" in error.fix
    check_data(compose_config([f"data.tokenizer={tmp_path}", "model.vocab_size=512"]))


# ------------------------------------------------------------------------------------------ hf_checkpoint


def test_a_matching_checkpoint_passes_in_shards_and_dtypes(tmp_path):
    tensors = llama_tiny_tensors()
    names = sorted(tensors)
    write_hf(tmp_path, {n: tensors[n].to(torch.bfloat16) for n in names[:10]}, "model-00001-of-00002.safetensors")
    write_hf(tmp_path, {n: tensors[n] for n in names[10:]}, "model-00002-of-00002.safetensors")
    _check_model(compose_config([f"model.hf_checkpoint={tmp_path}"]))


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("truncated", "truncated"),
        ("length", "does not start with a safetensors header"),
        ("json", "header is not JSON"),
        ("offsets", "malformed"),
        ("shape", "has shape [256, 64], the configured model expects [256, 128]"),
        ("dtype", "is I64, not floating-point weights"),
        ("missing", "missing tensors model.norm.weight"),
        ("extra", "tensor model.extra.weight has no counterpart"),
        ("duplicate", "is in both"),
    ],
)
def test_a_damaged_or_mismatched_checkpoint_is_one_line(tmp_path, damage, needle):
    tensors = llama_tiny_tensors()
    if damage == "shape":
        tensors["model.embed_tokens.weight"] = torch.zeros(256, 64)
    elif damage == "dtype":
        tensors["model.norm.weight"] = torch.zeros(128, dtype=torch.int64)
    elif damage == "missing":
        del tensors["model.norm.weight"]
    elif damage == "extra":
        tensors["model.extra.weight"] = torch.zeros(2)
    elif damage == "duplicate":
        write_hf(tmp_path, {"model.norm.weight": torch.zeros(128)}, "extra.safetensors")
    file = write_hf(tmp_path, tensors)
    data = bytearray(file.read_bytes())
    length = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[:-100]
    elif damage == "length":
        data[:8] = (len(data) * 2).to_bytes(8, "little")
    elif damage == "json":
        data[8] = ord("~")  # where the header's '{' was
    elif damage == "offsets":
        header = data[8 : 8 + length].decode()
        entry = header.index('"model.norm.weight"')
        data[8 : 8 + length] = (header[:entry] + header[entry:].replace("[128]", "[129]", 1)).encode()  # same length
    file.write_bytes(bytes(data))
    error = refusal([f"model.hf_checkpoint={tmp_path}"], _check_model)
    assert error.key == "model.hf_checkpoint" and needle in error.fix, error.fix


def test_a_header_is_read_without_the_data(tmp_path, monkeypatch):
    file = write_hf(tmp_path, {"model.norm.weight": torch.zeros(1 << 20)})
    reads = []
    real_open = open

    def counting_open(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        if str(path) == str(file):
            original = fh.read
            fh.read = lambda n=-1: reads.append(n) or original(n)
        return fh

    monkeypatch.setattr("builtins.open", counting_open)
    header = read_safetensors_header(file)
    assert header["model.norm.weight"]["shape"] == [1 << 20]
    assert all(0 <= n <= 4096 for n in reads), reads


def test_a_tied_model_refuses_a_separate_head(tmp_path):
    write_hf(tmp_path, {"lm_head.weight": torch.zeros(4, 2), "model.embed_tokens.weight": torch.zeros(4, 2)})
    with pytest.raises(HFCheckpointError, match="tie_word_embeddings=false"):
        check_hf_checkpoint(tmp_path, {"embed_tokens.weight": (4, 2)}, tied=True)


# ------------------------------------------------------------------------------------------ model class


@pytest.mark.parametrize(
    "arch, needle",
    [
        ("nxdt.models.llama.rope_tables", "is a function"),
        ("nxdt.models.llama.math", "is a module"),
        ("nxdt.models.llama.RMSNorm", "not a causal language model"),
        ("nxdt.models.llama.NoSuchModel", "cannot be imported"),
    ],
)
def test_an_architecture_that_is_no_model_class_is_refused(arch, needle):
    error = refusal([f"model.architecture={arch}"], _check_model)
    assert error.key == "model.architecture" and needle in error.fix, error.fix


# ------------------------------------------------------------------------------------------ host memory


def test_host_memory_refuses_what_cannot_fit(monkeypatch):
    monkeypatch.setattr("nxdt.cli.host_available_bytes", lambda: 50 << 20)  # 50 MB available
    error = refusal(["trainer.devices=2"], _check_host_memory)
    assert error.key == "trainer.devices" and "× 2 ranks" in error.fix and "50.0 MB available" in error.fix
    _check_host_memory(compose_config(["launcher=torchrun"]))  # other hosts' memory is not this host's
    monkeypatch.setattr("nxdt.cli.host_available_bytes", lambda: None)  # no /proc/meminfo: nothing to compare with
    _check_host_memory(compose_config([]))
    monkeypatch.setattr("nxdt.cli.host_available_bytes", lambda: 64 << 30)
    _check_host_memory(compose_config([]))


# ------------------------------------------------------------------------------------------ the early fork server


def _marked(mark: str) -> dict[int, str]:
    """Live processes whose environment carries ``NXDT_TEST_MARK=mark``: pid → command line."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"NXDT_TEST_MARK={mark}".encode() in environ.read_bytes().split(b"\0"):
                found[int(environ.parent.name)] = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone, or not ours to read
            continue
    return found


def test_a_config_refused_after_the_worker_server_started_is_one_line_and_leaves_no_process(tmp_path):
    """``nxdt train`` starts its workers' fork server before it composes the config (unless an override names the
    launcher), so the server's imports overlap the composition and the data and model checks. When the config (or a
    later check) is refused, the program still prints one line, exits 2, and takes the server along (it dies with its
    launcher), instead of leaving it importing Lightning for nobody. The refusal here is the earliest one, a value
    the composed config's validation refuses: seeing the server then shows it started before the config was known."""
    mark = uuid.uuid4().hex
    env = {**os.environ, "NXDT_TEST_MARK": mark}
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:  # a file, not a pipe: a surviving server would hold a pipe open
        proc = subprocess.Popen(
            [sys.executable, "-m", "nxdt.cli", "train", "model=llama_tiny", "trainer.devices=0"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
        servers: set[int] = set()
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            servers |= {pid for pid, cmd in _marked(mark).items() if "multiprocessing.forkserver" in cmd}
            time.sleep(0.02)
        # SIGKILL on the launcher's exit takes milliseconds; a server that checked for its launcher only after its
        # imports lived on for 2 s or more (measured with die_with_agent moved below them)
        gone_by = time.monotonic() + 1
        while (left := _marked(mark)) and time.monotonic() < gone_by:
            time.sleep(0.02)
    assert proc.wait(timeout=30) == 2
    lines = [line for line in err_path.read_text().splitlines() if line.strip()]
    assert lines == ["config error: trainer.devices=0: must be >= 1"], lines
    assert servers, "the fork server was not started before the config was composed: this test no longer covers that path"
    assert not left, f"processes outlived the failed launch: {left}"


@pytest.mark.timeout(120)
def test_a_temporary_directory_too_deep_for_the_fork_servers_socket_is_one_line(tmp_path, short_tmpdir):
    """multiprocessing puts the fork server's Unix socket under TMPDIR, and a socket's path must fit 107 bytes: a deep
    per-job TMPDIR (as some clusters set) failed with a traceback from inside multiprocessing; now one line naming
    TMPDIR and the fix, exit 2, before any worker or run directory."""
    deep = short_tmpdir / ("d" * 90)
    deep.mkdir()
    done = run_train(["model=llama_tiny", f"exp_manager.explicit_log_dir={tmp_path / 'run'}"], tmp_path, {"TMPDIR": str(deep)})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith("nxdt: the workers' fork server cannot listen") and "set TMPDIR to a shorter" in lines[0]
    assert str(deep) in lines[0] and not (tmp_path / "run").exists()
