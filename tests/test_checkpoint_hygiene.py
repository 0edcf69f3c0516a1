"""Checkpoint hygiene (issue 38): tools never write into a checkpoint, never read a checkpoint's file through a link,
and ``keep_last_k`` counts the checkpoints on disk, so a resumed run keeps no more than it was told."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from nxdt.cli import main
from nxdt.lightning import checkpoint as ckpt_io
from nxdt.lightning.exp_manager import DirectoryCheckpoint
from nxdt.lightning.reshard import read_full_state


def _checkpoint(path: Path, step: int = 4) -> Path:
    ckpt_io.save({"state_dict": {"model.w": torch.arange(4.0) + step}, "global_step": step}, path)
    return path


def _contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "tool,target", [("export-hf", "hf"), ("consolidate", "full"), ("export-hf", "."), ("consolidate", "sub/deeper")]
)
def test_export_and_consolidate_refuse_a_target_inside_the_checkpoint(tmp_path, capsys, tool, target):
    """On main ``export-hf C C/hf`` wrote C/hf and the checkpoint no longer matched its checksums."""
    ckpt = _checkpoint(tmp_path / "checkpoints" / "step-4")
    before = _contents(ckpt)
    assert main(["checkpoint", tool, str(ckpt), str(ckpt / target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is inside the checkpoint {ckpt}" in err[0] and "name a directory outside it" in err[0], err
    assert _contents(ckpt) == before and ckpt_io.check(ckpt).ok


def test_a_target_inside_another_checkpoint_is_refused_too(tmp_path, capsys):
    source, other = _checkpoint(tmp_path / "a" / "step-2", 2), _checkpoint(tmp_path / "b" / "step-4")
    link = tmp_path / "to-other"
    link.symlink_to(other)  # resolved: a link does not hide where the target lies
    for out in (other / "hf", link / "hf"):
        assert main(["checkpoint", "consolidate", str(source), str(out)]) == 2
        assert f"is inside the checkpoint {other}" in capsys.readouterr().err
    assert ckpt_io.check(other).ok and not (other / "hf").exists()


def test_a_checkpoint_file_that_is_a_link_is_refused_even_with_the_recorded_bytes(tmp_path, capsys):
    """On main export-hf read through a link planted in the checkpoint whenever the bytes behind it matched."""
    ckpt = _checkpoint(tmp_path / "step-4")
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(ckpt / "model.safetensors", outside)  # the very bytes checksums.json records
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to(outside)
    assert ckpt_io.check(ckpt).problems == ["not a regular file: model.safetensors (a symbolic link)"]
    with pytest.raises(ckpt_io.CheckpointError, match="not a regular file: model.safetensors"):
        read_full_state(ckpt, optimizer=False)
    assert main(["checkpoint", "export-hf", str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors" in err[0] and not (tmp_path / "hf").exists(), err
    with pytest.raises(ckpt_io.CheckpointError, match="is a symbolic link"):  # the reader itself, past any check
        with ckpt_io.opened_regular(ckpt / "model.safetensors"):
            pass


def test_keep_last_k_counts_the_checkpoints_on_disk_after_a_resume(tmp_path):
    """A run resumed from step-6 with keep_last_k=2 that saves step-8 removes step-2 and step-4 (on main: Lightning
    counted only what its restored state remembered, and 3 checkpoints were left). A damaged one moved aside and a
    newer step of another timeline are not its to remove."""
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6, 10):
        _checkpoint(root / f"step-{step}", step)
    ckpt_io.set_aside(_checkpoint(root / "step-3", 3))
    callback = DirectoryCheckpoint(dirpath=root, filename="step-{step}", save_top_k=2, monitor="step", mode="max")
    assert callback.beyond_keep_last_k(root / "step-8") == [root / "step-2", root / "step-4"]
    assert DirectoryCheckpoint(dirpath=root, save_top_k=-1, monitor="step", mode="max").beyond_keep_last_k(root / "step-8") == []
