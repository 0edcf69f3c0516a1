"""Host calibration (``nxdt comm-test --calibrate``) is used only when asked (``--calibration PATH|auto``), and a plan
that uses it says which file and when it was measured. A file in the per-host cache used to change every later
``nxdt plan`` on the cpu instance silently."""

from __future__ import annotations

import json
import socket

import pytest

from nxdt.cli import main
from nxdt.config import compose_config
from nxdt.planner import plan

# figures far from the catalogue's cpu placeholders, so a plan that used them cannot be mistaken for one that did not:
# 1 ms + 1 ns/byte all-reduces between 2 ranks, 1 GFLOP/s per rank
CALIBRATION = {
    "host": "calibrated-host",
    "date": "2026-01-02 03:04:05",
    "latency_s": 5e-4,
    "bandwidth_Bps": 1e9,
    "ops": {"all_reduce": {"2": [1e-3, 1e-9]}},
    "flops_per_s": 1e9,
    "flops_ranks": 2,
    "cpus": 2,
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """This host's default calibration file, written where --calibrate writes it ($XDG_CACHE_HOME/nxdt/)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tmp_path / "nxdt" / f"calibration-{socket.gethostname()}.json"
    path.parent.mkdir()
    path.write_text(json.dumps(CALIBRATION))
    return path


def _plan_json(argv: list[str], capsys) -> dict:
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_calibration_file_present_does_not_change_the_default_plan(cache, capsys):
    default = plan(compose_config([])).estimate  # no calibration at all
    got = _plan_json([], capsys)["estimate"]
    assert got["calibrated"] is False and "calibration" not in got
    assert got["step_time_s"] == default["step_time_s"] and got["comm_s"] == default["comm_s"]


@pytest.mark.parametrize("how", ["auto", "path"])
def test_asked_for_the_calibration_changes_the_plan_and_the_plan_says_so(cache, how, capsys):
    default = _plan_json([], capsys)["estimate"]
    flag = "auto" if how == "auto" else str(cache)
    got = _plan_json(["--calibration", flag], capsys)["estimate"]
    assert got["calibrated"] is True and got["step_time_s"] != default["step_time_s"]
    assert got["calibration"] == {"file": str(cache), "date": CALIBRATION["date"], "host": CALIBRATION["host"]}
    assert main(["plan", "--calibration", flag]) == 0
    text = capsys.readouterr().out
    assert f"calibration: {cache} (measured 2026-01-02 03:04:05 on calibrated-host; --calibration asked for it)" in text


def test_estimate_tables_use_the_calibration_only_when_asked(cache, capsys):
    argv = ["comm-test", "--estimate", "--instance", "cpu", "-r", "2", "-b", "1kb", "-e", "1kb", "allr"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--calibration", "auto"]) == 0
    calibrated = capsys.readouterr().out
    row = [line.split() for line in calibrated.splitlines() if line.startswith("  ")]
    # µs: the calibration's a + S·b for 2 ranks, printed with 2 decimals (hence abs 0.005)
    assert plain != calibrated and float(row[0][3]) == pytest.approx(1e6 * (1e-3 + 1024 * 1e-9), abs=0.005)


def test_auto_without_a_calibration_is_one_line_naming_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["plan", "--calibration", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--calibration" in err[0] and "auto" in err[0] and "nxdt comm-test --calibrate" in err[0], err
