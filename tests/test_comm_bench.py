"""``nxdt comm-test``: argument handling and an exact-checked tiny run with the gloo baseline and JSON."""

import json
import subprocess
import sys

import pytest

from nxdt.cli import main
from nxdt.comm.bench import bus_factor, parse_size, ranks_per_node, sizes


def test_sizes_and_bus_factors():
    assert parse_size("1kb") == 1024 and parse_size("64MB") == 64 << 20 and parse_size("512") == 512
    assert sizes(1024, 16384, 4) == [1024, 4096, 16384]
    assert bus_factor("allr", 4) == pytest.approx(1.5) and bus_factor("allg", 4) == pytest.approx(0.75)
    assert bus_factor("bcast", 4) == 1.0


def test_bad_arguments_are_one_line_exit_2(capsys):
    # in this process, as the refusals below (a fresh interpreter's start is test_first_output.py's)
    code = main(["comm-test", "allreduce"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown operation" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, says",
    [
        (["-b", "lots"], "argument -b/--minbytes: size 'lots': use a number with an optional unit"),
        (["-r", "two"], "argument -r/--nworkers: invalid int value: 'two'"),
        (["--nope"], "unrecognized arguments: --nope"),
    ],
)
def test_argparse_refusals_are_one_line_too(capsys, args, says):
    """An issue 38 probe: argparse printed its 11-line usage block before the error; now one line, exit 2."""
    with pytest.raises(SystemExit) as done:
        main(["comm-test", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1 and err[0].startswith("nxdt comm-test: ") and says in err[0], err
    assert err[0].endswith("(nxdt comm-test --help lists the options)")


def test_r_is_the_total_over_n_nodes_as_in_nccom_test(capsys):
    assert ranks_per_node(64, 2) == 32 and ranks_per_node(2, 1) == 2 and ranks_per_node(2, 2) == 1
    for r, n, needle in (
        (3, 2, "-r 3 ranks do not divide equally over -N 2 nodes"),
        (1, 1, "-r 1: need at least 2 ranks"),
        (4, 0, "-N 0"),
    ):
        with pytest.raises(ValueError, match=needle):
            ranks_per_node(r, n)
    for argv in (
        ["comm-test", "-N", "2", "-r", "3", "allr"],
        ["comm-test", "--estimate", "--instance", "trn1.32xlarge", "-N", "2", "-r", "63", "allr"],
    ):
        assert main(argv) == 2  # refused before anything starts
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "do not divide equally" in err[0] and "total number of ranks" in err[0], err


def test_estimate_imports_neither_torch_nor_the_collectives_and_starts_no_process(tmp_path):
    """``--estimate`` runs nothing: it took 20-31 s (4.6 CPU-s) importing torch through nxdt.comm.bench for a printed
    table; without torch 1.1 CPU-s. Checked by what the process loaded (torch, Lightning, nxdt.comm, multiprocessing)
    and by its child processes (none), not by a wall-clock time on a shared host."""
    probe = (
        "import os, sys\n"
        "from nxdt.cli import main\n"
        "code = main(['comm-test', '--estimate', '--instance', 'trn1.32xlarge', '-d', 'bf16', 'allr', 'allg'])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'multiprocessing')"
        " or m.startswith('nxdt.comm'))\n"
        "children = open(f'/proc/{os.getpid()}/task/{os.getpid()}/children').read().split()\n"
        "print('RESULT', code, loaded, children)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.stdout.splitlines()[-1] == "RESULT 0 [] []", result.stdout[-2000:] + result.stderr[-2000:]
    table = result.stdout
    assert "# estimated all_reduce on 1 × trn1.32xlarge" in table and "# estimated all_gather" in table
    assert "     1024           512   bf16" in table  # -d bf16: 2 bytes an element, from the torch-free table module
    from nxdt.comm.bench import DTYPES
    from nxdt.topology.nccom import DTYPE_BYTES

    assert {k: v.itemsize for k, v in DTYPES.items()} == DTYPE_BYTES  # the two tables name the same types


def test_the_process_count_is_capped_by_cores_unless_forced():
    """-r 5000 forked 1,400 processes and 16 GB in 70 s before the host gave out: at most RANKS_PER_CORE per core."""
    from nxdt.comm.bench import RANKS_PER_CORE, check_process_count, usable_cores

    most = RANKS_PER_CORE * usable_cores()
    check_process_count(most, force=False)
    check_process_count(most + 1, force=True)
    with pytest.raises(ValueError, match=f"{most + 1} ranks on this node is more than {RANKS_PER_CORE} per usable CPU core"):
        check_process_count(most + 1, force=False)


@pytest.mark.timeout(180)
def test_small_checked_run_with_baseline_writes_nccom_style_json(tmp_path, capsys):
    report = tmp_path / "r.json"
    # in this process: the ranks are forked from its fork server (nxdt.comm.spawn), as `nxdt comm-test`'s are from its own
    code = main(
        [
            "comm-test",
            "-N",
            "1",
            "-r",
            "2",
            "-b",
            "1kb",
            "-e",
            "64kb",
            "-f",
            "8",
            "-n",
            "3",
            "-w",
            "1",
            "-c",
            "--baseline",
            "gloo",
            "--report-to-json-file",
            str(report),
            "allr",
            "allg",
            "redsct",
            "alltoall",
            "bcast",
            "reduce",
            "sendrecv",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert "Avg bus bandwidth" in out and "speed-up" in out
    data = json.loads(report.read_text())
    assert len(data["results"]) == 7 * 3 and len(data["baseline"]) == 7 * 3  # 1 KB, 8 KB, 64 KB
    for row in data["results"]:
        assert {"size(B)", "count(elems)", "type", "time:avg(us)", "algbw(GB/s)", "busbw(GB/s)"} <= set(row)
        assert row["#wrong"] == 0
    assert data["nworkers"] == 2 and data["nodes"] == 1

    # --estimate writes the same layout: the same keys (plus what the estimate was made from), the same rows
    predicted = tmp_path / "e.json"
    assert (
        main(
            [
                "comm-test",
                "--estimate",
                "--instance",
                "cpu",
                "-N",
                "1",
                "-r",
                "2",
                "-b",
                "1kb",
                "-e",
                "64kb",
                "-f",
                "8",
                "--report-to-json-file",
                str(predicted),
                "allr",
                "allg",
            ]
        )
        == 0
    )
    estimate = json.loads(predicted.read_text())
    assert set(estimate) == set(data) | {"estimate"} and estimate["nworkers"] == 2 and estimate["nodes"] == 1
    assert [set(r) for r in estimate["results"]] == [set(data["results"][0]) - {"#wrong"}] * 2 * 3
    assert [(r["op"], r["size(B)"]) for r in estimate["results"]][:2] == [("allr", 1024), ("allr", 8192)]
    assert estimate["layout"] == data["layout"] == "host 0: ranks [0, 1]"


def test_ranks_are_forked_from_the_caller_only_while_it_runs_one_thread():
    """`nxdt comm-test` forks its ranks from itself (no fork server importing torch again); a fork copies only the
    calling thread, so a process running another thread (a lock it holds would stay locked in every rank) is refused
    with one line naming the rule, never forked."""
    import threading

    from nxdt.comm.bench import _body
    from nxdt.comm.spawn import can_fork_here, run_local

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not can_fork_here(_body)
        with pytest.raises(ValueError, match="needs one thread"):
            run_local(_body, 2, {}, fork_here=True)
    finally:
        stop.set()
        other.join()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--baseline", "nccl", "allr"], "--baseline nccl times GPU tensors: add --device cuda"),
        # this suite's hosts have no GPU (on a GPU host tests/gpu/test_gpu.py runs --device cuda)
        (["--device", "cuda", "allr"], "--device cuda: torch sees no CUDA device here"),
    ],
)
def test_device_and_baseline_refusals_are_one_line_before_any_rank(capsys, args, says):
    import torch

    if "cuda" in args and torch.cuda.device_count() > 0:
        pytest.skip("this host has a GPU: --device cuda runs here (tests/gpu/test_gpu.py)")
    assert main(["comm-test", "-r", "2", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nxdt comm-test: ") and says in err[0], err


def test_gpu_ranks_are_placed_as_training_places_them():
    """``--device cuda``: each rank takes its local rank's entry of the training placement (``nxdt comm-test`` hands
    ``nxdt.parallel.devices.node_devices`` in), the local rank worked out from the world's host ids (no CUDA call)."""
    from types import SimpleNamespace

    import torch

    from nxdt.comm.bench import rank_device
    from nxdt.parallel.devices import node_devices

    def devices(host_ids, gpus):
        per_node = host_ids.count(host_ids[0])
        place = node_devices("cuda", per_node, gpus)
        return [rank_device(SimpleNamespace(host_ids=host_ids, rank=r), place) for r in range(len(host_ids))]

    assert devices(["a", "a", "b", "b"], 2) == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    assert devices(["a", "a"], 1) == [torch.device("cuda", 0)] * 2  # ranks sharing the GPU: CUDA IPC
    assert rank_device(SimpleNamespace(host_ids=["a"], rank=0), []) == torch.device("cpu")
