"""Checkpoint checksums: every file's size and SHA-256 recorded when it is written (single-rank, sharded and
asynchronous saves), checked on load, by ``nxdt checkpoint verify`` and by the launcher before any worker starts
(a damaged newest checkpoint is moved aside and the previous good one resumed). Old checkpoints without
checksums still load, "unverified". All in-process: no worker is launched."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch

from nxdt.comm import objects
from nxdt.lightning import checkpoint as ckpt_io

FILES = ["model.safetensors", "trainer_state.pt", "rng-rank0.safetensors", "meta.json"]


def _checkpoint(step: int) -> dict:
    torch.manual_seed(step)
    emb = torch.randn(16, 8)
    return {
        "global_step": step,
        "state_dict": {"embed.weight": emb, "head.weight": emb, "norm.weight": torch.ones(8)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(5)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
    }


def _save(root: Path, step: int) -> Path:
    return ckpt_io.save(
        _checkpoint(step), root / f"step-{step}", meta={"world_size": 1}, extra_files={ckpt_io.rng_file(0): ckpt_io.rng_tensors()}
    )


def _flip(file: Path, offset: int | None = None) -> None:
    """One bit of one byte changed, same length (the middle of the file unless ``offset``)."""
    data = bytearray(file.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    file.write_bytes(bytes(data))


def _flip_meta(path: Path) -> None:
    """A flip that keeps meta.json valid JSON (the step's last digit), so only its checksum can tell."""
    text = (path / "meta.json").read_bytes()
    _flip(path / "meta.json", text.index(b'"step": ') + len(b'"step": '))
    json.loads((path / "meta.json").read_text())


def _old_format(path: Path) -> Path:
    """What nxdt wrote before checksums: format 2, no checksums.json."""
    (path / ckpt_io.CHECKSUMS_FILE).unlink()
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format_version": 2}, indent=2))
    return path


def test_save_records_every_file_and_a_good_checkpoint_verifies(tmp_path):
    path = _save(tmp_path, 5)
    recorded = ckpt_io.read_checksums(path)
    assert sorted(recorded) == sorted(FILES)  # every file but the manifest and the done marker
    assert all(recorded[n] == ckpt_io.file_digest(path / n) for n in FILES)
    assert json.loads((path / "meta.json").read_text())["format_version"] == ckpt_io.FORMAT_VERSION == 3
    result = ckpt_io.check(path)
    assert result.ok and result.checksummed and result.files == 4 and result.size == sum(e["size"] for e in recorded.values())
    ckpt_io.verify(path)
    assert ckpt_io.load(path)["global_step"] == 5


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_in_any_file_is_caught_by_verify_and_by_load(tmp_path, name):
    path = _save(tmp_path, 5)
    _flip_meta(path) if name == "meta.json" else _flip(path / name)
    assert ckpt_io.check(path).problems == [f"checksum mismatch: {name}"]
    needle = f"is damaged \\(checksum mismatch: {name}\\) — use an earlier checkpoint"
    with pytest.raises(ckpt_io.CheckpointError, match=needle):
        ckpt_io.verify(path)
    with pytest.raises(ckpt_io.CheckpointError, match=needle) as info:  # load: this rank's files; rng: restore_rng
        ckpt_io.restore_rng(path, 0, same_layout=True) if name.startswith("rng-") else ckpt_io.load(path)
    chained = info.value.__cause__ or (None if info.value.__suppress_context__ else info.value.__context__)
    assert "\n" not in str(info.value) and chained is None  # one line, no deep traceback


def test_meta_json_damaged_beyond_parsing_is_one_line(tmp_path):
    path = _save(tmp_path, 5)
    _flip(path / "meta.json", 0)  # "{" → "z"
    with pytest.raises(ckpt_io.CheckpointError, match=r"is damaged \(unreadable: meta.json"):
        ckpt_io.load(path)
    assert ckpt_io.check(path).problems == ["checksum mismatch: meta.json"]


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.pt"])
def test_truncated_and_extended_files_are_caught(tmp_path, name):
    path = _save(tmp_path, 5)
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[:-10])
    want = f"truncated: {name} ({len(data) - 10} of {len(data)} bytes)"
    assert ckpt_io.check(path).problems == [want]
    with pytest.raises(ckpt_io.CheckpointError, match=re.escape(f"damaged ({want})")):
        ckpt_io.load(path)
    (path / name).write_bytes(data + b"\0")
    assert ckpt_io.check(path).problems == [f"size mismatch: {name} ({len(data) + 1} bytes, {len(data)} recorded)"]


def test_missing_unrecorded_and_tampered_manifest(tmp_path):
    path = _save(tmp_path, 5)
    (path / "trainer_state.pt").unlink()
    (path / "notes.txt").write_text("hello")
    assert ckpt_io.check(path).problems == ["missing: trainer_state.pt", f"not recorded in {ckpt_io.CHECKSUMS_FILE}: notes.txt"]
    with pytest.raises(ckpt_io.CheckpointError, match=r"damaged \(missing: trainer_state.pt; 1 more problem"):
        ckpt_io.verify(path)

    path = _save(tmp_path, 6)
    manifest = path / ckpt_io.CHECKSUMS_FILE
    doc = json.loads(manifest.read_text())
    digest = doc["files"]["model.safetensors"]["sha256"]
    manifest.write_text(manifest.read_text().replace(digest, ("0" if digest[0] != "0" else "1") + digest[1:]))
    problem = f"checksum mismatch: {ckpt_io.CHECKSUMS_FILE} (unreadable, or it does not match its own digest)"
    assert ckpt_io.check(path).problems == [problem]
    with pytest.raises(ckpt_io.CheckpointError, match="checksum mismatch: checksums.json"):
        ckpt_io.load(path)

    path = _save(tmp_path, 7)
    manifest = path / ckpt_io.CHECKSUMS_FILE
    manifest.unlink()  # format 3 records one: its absence is damage, not an old checkpoint
    assert ckpt_io.check(path).problems == ["missing: checksums.json (format 3 records one)"]
    with pytest.raises(ckpt_io.CheckpointError, match=r"damaged \(missing: checksums.json"):
        ckpt_io.load(path)


def test_old_format_without_checksums_still_loads_unverified(tmp_path, capsys):
    from nxdt.cli import main

    path = _old_format(_save(tmp_path, 5))
    loaded = ckpt_io.load(path)
    assert loaded["global_step"] == 5 and torch.equal(loaded["state_dict"]["norm.weight"], torch.ones(8))
    assert ckpt_io.restore_rng(path, 0, same_layout=True) == path / ckpt_io.rng_file(0)
    ckpt_io.verify(path)
    result = ckpt_io.check(path)
    assert result.ok and not result.checksummed
    assert "no checksums: unverified" in ckpt_io.describe(path)
    assert main(["checkpoint", "verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert "unverified" in out and len(out.splitlines()) == 1
    # without checksums the structural checks still catch a truncated file
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-8])
    assert ckpt_io.check(path).problems[0].startswith("truncated: model.safetensors")
    with pytest.raises(ckpt_io.CheckpointError, match="truncated: model.safetensors"):
        ckpt_io.verify(path)


def test_cli_verify_exit_codes_and_one_line_per_problem(tmp_path, capsys):
    from nxdt.cli import main

    good = _save(tmp_path, 5)
    assert main(["checkpoint", "verify", str(good)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"nxdt: checkpoint {good} is good: 4 files ({out[0].split('(')[1].split(')')[0]}) match their SHA-256"]

    bad = _save(tmp_path, 10)
    _flip(bad / "model.safetensors")
    (bad / "rng-rank0.safetensors").write_bytes((bad / "rng-rank0.safetensors").read_bytes()[:100])
    assert main(["checkpoint", "verify", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        f"{bad}: checksum mismatch: model.safetensors",
        f"{bad}: truncated: rng-rank0.safetensors (100 of {ckpt_io.read_checksums(bad)['rng-rank0.safetensors']['size']} bytes)",
    ]
    assert out[2] == f"nxdt: checkpoint {bad} is damaged: 2 problems — resume from an earlier checkpoint" and len(out) == 3

    (good / "done").unlink()
    assert main(["checkpoint", "verify", str(good)]) == 1
    assert "incomplete: no 'done' marker" in capsys.readouterr().out

    for argv in (
        ["checkpoint", "verify", str(tmp_path / "nowhere")],
        ["checkpoint", "verify"],
        ["checkpoint", "verify", str(tmp_path)],
    ):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert not captured.out and len(captured.err.strip().splitlines()) == 1
    assert main(["checkpoint", "inspect", str(bad)]) == 2  # inspect checks the checksums too
    assert "checksum mismatch: model.safetensors" in capsys.readouterr().err


def test_newest_verified_falls_back_to_the_previous_good_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15, 20):
        _save(root, step)
    _flip(root / "step-20" / "trainer_state.pt")
    (root / "step-15" / "model.safetensors").write_bytes((root / "step-15" / "model.safetensors").read_bytes()[:-1])
    _old_format(root / "step-5")
    before = sorted(p.name for p in root.iterdir())
    good, skipped = ckpt_io.newest_verified(root)
    assert good == root / "step-10"
    assert [(p.name, reason.split(" (")[0]) for p, reason in skipped] == [
        ("step-20", "checksum mismatch: trainer_state.pt"),
        ("step-15", "truncated: model.safetensors"),
    ]
    assert sorted(p.name for p in root.iterdir()) == before  # pure: nothing moved
    _flip(root / "step-10" / "meta.json", 0)
    assert ckpt_io.newest_verified(root)[0] == root / "step-5"  # an old checkpoint without checksums counts if whole
    _flip(root / "step-5" / "trainer_state.pt", 0)  # zip local header: its structural check fails
    good, skipped = ckpt_io.newest_verified(root)
    assert good is None and [p.name for p, _ in skipped] == ["step-20", "step-15", "step-10", "step-5"]
    assert ckpt_io.newest_verified(tmp_path / "none") == (None, [])


def test_set_aside_hides_a_damaged_checkpoint_from_resume_and_cleanup(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (5, 10):
        _save(root, step)
    moved = ckpt_io.set_aside(root / "step-10")
    assert moved == root / "step-10.damaged" and (moved / "done").is_file()
    assert [p.name for p in ckpt_io.list_complete(root)] == ["step-5"]
    assert (root / "latest").read_text().strip() == "step-5"
    assert ckpt_io.remove_incomplete(root) == [] and moved.is_dir()  # kept for inspection
    _save(root, 10)  # the resumed run writes step 10 again; a second damage of it gets its own name
    assert ckpt_io.set_aside(root / "step-10").name == "step-10.damaged-1"
    ckpt_io.set_aside(root / "step-5")
    assert ckpt_io.latest_complete(root) is None and not (root / "latest").exists()


def _launcher_cfg(tmp_path: Path, *extra: str):
    from nxdt.config import compose_config

    return compose_config([f"exp_manager.exp_dir={tmp_path}", "exp_manager.resume_if_exists=true", *extra])


def test_launcher_skips_a_damaged_newest_checkpoint_and_the_workers_resume_the_same_one(tmp_path):
    from nxdt.launch.rundir import check_resume, choose_run_dir
    from nxdt.lightning.exp_manager import resume_checkpoint

    run = tmp_path / "llama_tiny" / "2026-01-01_00-00-00"
    for step in (5, 10, 15, 20):
        _save(run / "checkpoints", step)
    _flip(run / "checkpoints" / "step-20" / "model.safetensors")
    cfg = _launcher_cfg(tmp_path)
    assert choose_run_dir(cfg) == run
    lines = check_resume(cfg, run)
    assert lines == [
        "nxdt: checkpoint step-20 is damaged (checksum mismatch: model.safetensors); resuming from step-15 "
        "(moved it to step-20.damaged)"
    ]
    assert resume_checkpoint(run) == run / "checkpoints" / "step-15"  # what rank 0 of the workers picks and publishes
    assert check_resume(cfg, run) == []  # the next start verifies step-15 again and finds nothing to say

    _old_format(run / "checkpoints" / "step-15")
    assert check_resume(cfg, run) == ["nxdt: resuming from step-15, written by an older nxdt without checksums: unverified"]
    assert check_resume(_launcher_cfg(tmp_path, "exp_manager.resume_if_exists=false"), run) == []
    named = _launcher_cfg(tmp_path, f"exp_manager.resume_from_checkpoint={run / 'checkpoints' / 'step-5'}")
    assert check_resume(named, run) == []  # a named checkpoint is verified (and refused if damaged) by the CLI instead


def test_launcher_with_no_good_checkpoint_starts_over(tmp_path):
    from nxdt.launch.rundir import check_resume, choose_run_dir
    from nxdt.lightning.exp_manager import resume_checkpoint

    run = tmp_path / "llama_tiny" / "2026-01-01_00-00-00"
    _save(run / "checkpoints", 5)
    (run / "checkpoints" / "step-5" / "trainer_state.pt").write_bytes(b"garbage")
    cfg = _launcher_cfg(tmp_path)
    lines = check_resume(cfg, run)
    assert len(lines) == 1 and lines[0].startswith("nxdt: checkpoint step-5 is damaged (truncated: trainer_state.pt")
    assert "no good checkpoint left: starting from step 0" in lines[0]
    assert resume_checkpoint(run) is None
    assert choose_run_dir(cfg) != run  # a run whose checkpoints were all moved aside is no longer resumable


def test_cli_named_checkpoint_damage_is_refused_in_one_line(tmp_path):
    from nxdt.cli import check_resume_checkpoint
    from nxdt.config import ConfigError

    path = _save(tmp_path, 5)
    _flip(path / "trainer_state.pt")
    cfg = _launcher_cfg(tmp_path, f"exp_manager.resume_from_checkpoint={path}")
    with pytest.raises(ConfigError) as info:
        check_resume_checkpoint(cfg, None)
    assert "exp_manager.resume_from_checkpoint" in str(info.value) and "checksum mismatch: trainer_state.pt" in str(info.value)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- sharded saves
class _Group:
    """In-process stand-in for a communicator's collectives among threads (objects go through the real codec)."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.gate = size, [b""] * size, threading.Barrier(size, timeout=30)


class _Comm:
    def __init__(self, group: _Group, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def barrier(self, stream: str = "default") -> None:
        self.group.gate.wait()

    def all_gather_object(self, obj, *, stream: str = "default"):
        self.group.slots[self.rank] = objects.encode(obj)
        self.group.gate.wait()
        out = [objects.decode(b) for b in self.group.slots]
        self.group.gate.wait()
        return out


def _save_sharded(path: Path, size: int = 2) -> None:
    group, errors = _Group(size), []

    def rank(r: int) -> None:
        try:
            state = {**_checkpoint(r), "global_step": 7}
            ckpt_io.save_sharded(
                state,
                path,
                model_file=f"model-mp{r}.safetensors",
                state_file=f"trainer_state-mp{r}.pt",
                comm=_Comm(group, r),
                meta={"world_size": size},
                extra_files={ckpt_io.rng_file(r): ckpt_io.rng_tensors()},
            )
        except BaseException as exc:  # noqa: BLE001 — reported by the test thread
            errors.append(exc)
            group.gate.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_sharded_save_records_every_ranks_files_and_load_checks_them(tmp_path):
    path = tmp_path / "checkpoints" / "step-7"
    _save_sharded(path)
    recorded = ckpt_io.read_checksums(path)
    assert sorted(recorded) == [
        "meta.json",
        "model-mp0.safetensors",
        "model-mp1.safetensors",
        "rng-rank0.safetensors",
        "rng-rank1.safetensors",
        "trainer_state-mp0.pt",
        "trainer_state-mp1.pt",
    ]
    assert ckpt_io.check(path).ok
    for r in range(2):
        loaded = ckpt_io.load(path, model_file=f"model-mp{r}.safetensors", state_file=f"trainer_state-mp{r}.pt")
        assert torch.equal(loaded["state_dict"]["norm.weight"], torch.ones(8))
    _flip(path / "trainer_state-mp1.pt")
    assert ckpt_io.load(path, model_file="model-mp0.safetensors", state_file="trainer_state-mp0.pt")["global_step"] == 7
    with pytest.raises(ckpt_io.CheckpointError, match=r"checksum mismatch: trainer_state-mp1.pt"):
        ckpt_io.load(path, model_file="model-mp1.safetensors", state_file="trainer_state-mp1.pt")
    assert ckpt_io.check(path).problems == ["checksum mismatch: trainer_state-mp1.pt"]
