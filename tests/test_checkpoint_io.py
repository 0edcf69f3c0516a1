"""Atomic directory checkpoints: complete ones load exactly, interrupted or damaged ones never do."""

import os
import threading

import pytest
import torch

from nxdt.lightning import checkpoint as ckpt_io


def _checkpoint(step: int) -> dict:
    emb = torch.randn(10, 4)
    return {
        "global_step": step,
        "state_dict": {"embed.weight": emb, "head.weight": emb, "norm.weight": torch.ones(4)},  # tied head
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "hyper_parameters": {"anything": object()},  # never stored: may hold arbitrary objects
    }


def test_roundtrip_is_exact_and_safe(tmp_path):
    original = _checkpoint(5)
    path = ckpt_io.save(original, tmp_path / "checkpoints" / "step-5", meta={"world_size": 2})
    loaded = ckpt_io.load(path)
    assert loaded["global_step"] == 5
    for name, tensor in original["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor)
    assert torch.equal(
        loaded["optimizer_states"][0]["state"][0]["exp_avg"], original["optimizer_states"][0]["state"][0]["exp_avg"]
    )
    assert "hyper_parameters" not in loaded
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-5"


def test_latest_ignores_incomplete_and_temporary(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt_io.save(_checkpoint(2), root / "step-2")
    ckpt_io.save(_checkpoint(10), root / "step-10")
    (root / "step-12").mkdir()  # a save killed before its done marker
    (root / ".tmp-step-14-abcd").mkdir()
    assert ckpt_io.latest_complete(root).name == "step-10"  # numeric, not lexical order
    removed = {p.name for p in ckpt_io.remove_incomplete(root)}
    assert removed == {"step-12", ".tmp-step-14-abcd"}
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-10", "step-2"]


def test_incomplete_checkpoint_is_refused_with_a_clear_message(tmp_path):
    (tmp_path / "step-3").mkdir()
    with pytest.raises(ckpt_io.CheckpointError, match="incomplete"):
        ckpt_io.load(tmp_path / "step-3")
    with pytest.raises(ckpt_io.CheckpointError, match="does not exist"):
        ckpt_io.load(tmp_path / "nope")


def test_truncated_file_is_reported_not_unpickled(tmp_path):
    path = ckpt_io.save(_checkpoint(1), tmp_path / "step-1")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt_io.CheckpointError, match=r"damaged \(truncated: model.safetensors \(\d+ of \d+ bytes\)\)"):
        ckpt_io.load(path)


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    ckpt_io.save(_checkpoint(1), root / "step-1")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_io.torch, "save", disk_full)
    with pytest.raises(ckpt_io.CheckpointError, match="No space left on device.*previous checkpoint is intact"):
        ckpt_io.save(_checkpoint(2), root / "step-2")
    assert [p.name for p in ckpt_io.list_complete(root)] == ["step-1"]
    assert not [p for p in os.listdir(root) if p.startswith(".tmp-")]


def test_async_writer_persists_a_snapshot_while_training_goes_on_and_removes_only_after_commit(tmp_path):
    root = tmp_path / "checkpoints"
    ckpt_io.save(_checkpoint(1), root / "step-1")
    live = _checkpoint(2)
    weight = live["state_dict"]["norm.weight"]
    writing, release = threading.Event(), threading.Event()

    def hold(tmp_dir):  # the writer is mid-save (files written, not committed) until the test lets it go on
        writing.set()
        assert release.wait(30)

    writer = ckpt_io.AsyncWriter()
    snap = ckpt_io.snapshot(live)
    writer.submit(lambda: ckpt_io.save(snap, root / "step-2", before_commit=hold))
    writer.after_success(lambda: ckpt_io.remove(root / "step-1"))
    assert writing.wait(30)
    weight.add_(1.0)  # "training" changes the live tensors while the save is in flight
    assert [p.name for p in ckpt_io.list_complete(root)] == ["step-1"]  # not committed yet, nothing removed
    release.set()
    writer.wait()
    assert [p.name for p in ckpt_io.list_complete(root)] == ["step-2"]
    assert torch.equal(ckpt_io.load(root / "step-2")["state_dict"]["norm.weight"], torch.ones(4))  # the snapshot's values
    verified = ckpt_io.check(root / "step-2")  # checksums are written by the background save too, before its commit
    assert verified.checksummed and verified.ok and verified.files == 3

    def disk_full(tmp_dir):
        raise OSError(28, "No space left on device")

    writer.submit(lambda: ckpt_io.save(_checkpoint(3), root / "step-3", before_commit=disk_full))
    writer.after_success(lambda: ckpt_io.remove(root / "step-2"))  # must not run: step-3 failed
    with pytest.raises(ckpt_io.CheckpointError, match="No space left"):
        writer.close()
    assert [p.name for p in ckpt_io.list_complete(root)] == ["step-2"]
