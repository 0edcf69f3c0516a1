"""``nxdt comm-test``: argument handling and an exact-checked tiny run with the gloo baseline and JSON."""

import json
import subprocess
import sys

import pytest

from nxdt.comm.bench import bus_factor, parse_size, sizes


def test_sizes_and_bus_factors():
    assert parse_size("1kb") == 1024 and parse_size("64MB") == 64 << 20 and parse_size("512") == 512
    assert sizes(1024, 16384, 4) == [1024, 4096, 16384]
    assert bus_factor("allr", 4) == pytest.approx(1.5) and bus_factor("allg", 4) == pytest.approx(0.75)
    assert bus_factor("bcast", 4) == 1.0


def test_bad_arguments_are_one_line_exit_2():
    result = subprocess.run([sys.executable, "-m", "nxdt.cli", "comm-test", "allreduce"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown operation" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(180)
def test_small_checked_run_with_baseline_writes_nccom_style_json(tmp_path):
    report = tmp_path / "r.json"
    result = subprocess.run([sys.executable, "-m", "nxdt.cli", "comm-test", "-r", "2", "-b", "1kb", "-e", "64kb", "-f", "8",
                             "-n", "3", "-w", "1", "-c", "--baseline", "gloo", "--report-to-json-file", str(report),
                             "allr", "allg", "redsct", "alltoall", "bcast", "reduce", "sendrecv"], capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Avg bus bandwidth" in result.stdout and "speed-up" in result.stdout
    data = json.loads(report.read_text())
    assert len(data["results"]) == 7 * 3 and len(data["baseline"]) == 7 * 3  # 1 KB, 8 KB, 64 KB
    for row in data["results"]:
        assert {"size(B)", "count(elems)", "type", "time:avg(us)", "algbw(GB/s)", "busbw(GB/s)"} <= set(row)
        assert row["#wrong"] == 0
