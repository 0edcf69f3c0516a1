"""Beyond one machine: launchers (torchrun rendezvous, Slurm), node order, and real separate hosts.

The hosts are two network namespaces joined by a veth pair (``netns_hosts``), each running its own
torch elastic agent, so nxdt must treat them as different hosts: p2p over TCP between them, shared
memory only within each. The real-host tests need root (skipped otherwise, with the reason); the Slurm
job runs under a real slurmctld + two slurmd where slurm-wlm is installed, and the job script is always
checked against a golden file.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from netns_hosts import Slurm, make_hosts, slurm_installed
from test_train_e2e import TINY, assert_ok, losses, nxdt

from nxdt.cli import main as cli_main
from nxdt.config import ConfigError
from nxdt.launch.multinode import NodeOrderError, node_order, resolve_node, split_endpoint, topology_key

GOLDEN = Path(__file__).parent / "golden"
COMMON = [
    *TINY,
    "data=synthetic",
    # 4 steps: a checkpoint at step 2, a hang at step 3, steps 3-4 resumed (was 6 steps, checkpoint 4, hang at 5: the
    # same resume from the last checkpoint, checked on the same number of resumed steps, 2 steps less per run)
    "trainer.max_steps=4",
    "model.optim.sched.max_steps=4",
    "data.global_batch_size=8",
    "data.micro_batch_size=2",
    "exp_manager.checkpoint_every_n_steps=2",
    "comm.timeout_s=60",
]
TWO_NODES = ["trainer.num_nodes=2", "trainer.devices=2", "launcher.join_timeout_s=90"]
SMALL_BATCH = ["data.micro_batch_size=2"]  # the default global batch over 4 data-parallel ranks


# ------------------------------------------------------------------------------------- pure
def _rec(key, digest="d1", addr="a"):
    return {"key": key, "digest": digest, "source": "test", "addr": addr}


def test_node_order_follows_node_ranks_then_ultraserver_ids_then_rendezvous():
    # c10d numbered the nodes 0,1,2 by address; their node ranks say otherwise
    assert node_order([_rec(["rank", 2]), _rec(["rank", 0]), _rec(["rank", 1])]) == [2, 0, 1]
    # UltraServer (server_id, node_id): servers together, nodes in order within a server
    topo = [_rec(["topo", "7", "1"]), _rec(["topo", "3", "0"]), _rec(["topo", "7", "0"]), _rec(["topo", "3", "1"])]
    assert node_order(topo) == [3, 0, 2, 1]
    assert node_order([_rec(None), _rec(None)]) == [0, 1]


@pytest.mark.parametrize(
    "records,needle",
    [
        ([_rec(["rank", 0]), _rec(["rank", 0])], "rank 0 is given twice"),
        ([_rec(["rank", 0]), _rec(None)], "ordered by different means"),
        ([_rec(["rank", 0]), _rec(["rank", 1], digest="d2", addr="b")], "same command, with the same overrides"),
    ],
)
def test_nodes_that_disagree_stop_with_one_line(records, needle):
    with pytest.raises(NodeOrderError) as exc:
        node_order(records)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def _launcher(**kw):
    base = dict(rdzv_endpoint=None, rdzv_id=None, node_rank=None, local_addr=None, port=29500, join_timeout_s=60.0)
    return SimpleNamespace(**{**base, **kw})


def test_node_settings_come_from_config_first_then_the_environment():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29411", "SLURM_JOB_ID": "77", "SLURM_NODEID": "1"}
    spec = resolve_node(_launcher(), 2, 2, env=env)
    assert (spec.rdzv_endpoint, spec.rdzv_id, spec.node_key, spec.node_key_source) == (
        "127.0.0.1:29411",
        "77",
        ["rank", 1],
        "$SLURM_NODEID",
    )
    assert spec.local_addr == "127.0.0.1" and spec.is_host  # the route to the endpoint; the endpoint is ours
    spec = resolve_node(_launcher(rdzv_endpoint="127.0.0.1", rdzv_id="job", node_rank=0), 2, 2, env={**env, "NODE_RANK": "1"})
    assert (spec.rdzv_endpoint, spec.rdzv_id, spec.node_key) == ("127.0.0.1:29500", "job", ["rank", 0])
    spec = resolve_node(
        _launcher(rdzv_endpoint="127.0.0.1:1", rdzv_id="j"),
        2,
        2,
        env={"NEURON_RT_ULTRASERVER_SERVER_ID": "s9", "NEURON_RT_ULTRASERVER_NODE_ID": "2"},
    )
    assert spec.node_key == ["topo", "s9", "2"] and spec.known_node_rank is None
    config = spec.launch_config(Path("/tmp/nowhere"))
    assert (config.rdzv_backend, config.min_nodes, config.max_nodes, config.nproc_per_node) == ("c10d", 2, 2, 2)


def test_ultraserver_position_is_read_from_the_neuron_sysfs_files(tmp_path):
    (tmp_path / "server_id_0").write_text("4\n")
    (tmp_path / "node_id_0").write_text("3\n")
    assert topology_key({}, sysfs=tmp_path) == ["topo", "4", "3"]
    assert topology_key({}, sysfs=tmp_path / "absent") is None


@pytest.mark.parametrize(
    "launcher,env,key",
    [
        (_launcher(), {}, "launcher.rdzv_endpoint"),
        (_launcher(rdzv_endpoint="host:port"), {}, "launcher.rdzv_endpoint"),
        (_launcher(rdzv_endpoint="127.0.0.1:29500"), {}, "launcher.rdzv_id"),
        (_launcher(rdzv_endpoint="127.0.0.1:29500", rdzv_id="j"), {"NODE_RANK": "first"}, "$NODE_RANK"),
        (_launcher(rdzv_endpoint="127.0.0.1:29500", rdzv_id="j", node_rank=2), {}, "launcher.node_rank"),
        (_launcher(rdzv_endpoint="no-such-host.invalid:29500", rdzv_id="j"), {}, "cannot resolve"),
    ],
)
def test_bad_node_settings_name_the_key_and_the_fix(launcher, env, key):
    with pytest.raises(ConfigError) as exc:
        resolve_node(launcher, 2, 2, env=env)
    assert key in str(exc.value)
    assert split_endpoint("[::1]:5", 1) == ("::1", 5)


# ------------------------------------------------------------------------------------- CLI, dry runs
@pytest.mark.parametrize(
    "args,needle",
    [
        (["trainer.num_nodes=2", *SMALL_BATCH], "launcher=local runs on this host only"),
        (["launcher=torchrun", "trainer.num_nodes=2", *SMALL_BATCH], "launcher.rdzv_endpoint"),
        (["launcher=mpirun"], "unknown launcher"),
        (["launcher=slurm", "launcher.port=0"], "launcher.port"),
    ],
)
def test_bad_launcher_input_is_one_line_exit_2_before_anything_starts(tmp_path, monkeypatch, capsys, args, needle):
    monkeypatch.chdir(tmp_path)
    for var in ("MASTER_ADDR", "PET_RDZV_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert cli_main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "outputs").exists()


def test_torchrun_dry_run_shows_the_agent_and_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NODE_RANK", "1")
    assert (
        cli_main(
            [
                "train",
                *TWO_NODES,
                *SMALL_BATCH,
                "launcher=torchrun",
                "launcher.rdzv_endpoint=127.0.0.1:29512",
                "launcher.rdzv_id=job7",
                "launcher.dry_run=true",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "node: rank 1 of 2 (from $NODE_RANK)" in out
    run_dir = tmp_path / "outputs" / "llama_tiny" / "job7"  # the same on every node: named by the id
    assert f"the run directory would be {run_dir}" in out
    assert (
        "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29512 --rdzv-id=job7 "
        "--rdzv-conf=is_host=1,join_timeout=90 --local-addr=127.0.0.1"
    ) in out
    assert "-m nxdt.launch.worker" in out and "WORLD_SIZE=4" in out
    assert not (tmp_path / "outputs").exists()


def test_local_dry_run_prints_the_worker_command_and_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "launcher.dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "2 workers" in out and f"{sys.executable} -m nxdt.launch.worker" in out
    assert not (tmp_path / "outputs").exists()


def test_slurm_dry_run_prints_the_golden_job_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert (
        cli_main(
            [
                "train",
                *TWO_NODES,
                *SMALL_BATCH,
                "distributed_strategy.tensor_model_parallel_size=2",
                "launcher=slurm",
                "launcher.partition=trn1",
                'launcher.sbatch_args=["--constraint=efa"]',
                "launcher.dry_run=true",
                "exp_manager.explicit_log_dir=/fsx/runs/llama-2node",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.replace(sys.executable, "PYTHON")
    assert out == (GOLDEN / "slurm_dry_run.txt").read_text()
    assert not Path("/fsx/runs/llama-2node").exists()


# ------------------------------------------------------------------------------------- real hosts
@pytest.fixture(scope="module")
def hosts():
    made = make_hosts()
    yield made
    made.teardown()


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The reference: the same job as 4 ranks on one host."""
    run = tmp_path_factory.mktemp("one-host") / "run"
    assert_ok(nxdt("train", *COMMON, "trainer.devices=4", f"exp_manager.explicit_log_dir={run}", cwd=run.parent))
    return losses(run)


def _same_losses(got, want):
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)


def _finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    return SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err)


def _host_lines(run: Path) -> dict[int, str]:
    hosts = {}
    for rank in range(4):
        m = re.search(r"is on node (\d) .*host (\S+),", (run / f"logs/rank{rank}.log").read_text())
        hosts[rank] = (int(m.group(1)), m.group(2))
    return hosts


@pytest.mark.timeout(400)
def test_tp2_dp2_on_two_hosts_survives_a_killed_host_and_equals_one_host(hosts, one_host, tmp_path, short_tmpdir):
    """TP inside each host (shared memory), DP across them (TCP); a rank hangs, its host dies, the survivor names the
    lost ranks, and both hosts restarted with the same command continue from the last checkpoint to one host's
    losses. (DP spanning both hosts with two ranks on each, the hierarchical all-reduce, is comm-test's case below.)
    The killed agent's temporary directories (multiprocessing's, torch's traceback files') go with it: its watchdog
    removes them (a private TMPDIR here)."""
    run = tmp_path / "run"
    job = [
        *COMMON,
        *TWO_NODES,
        "distributed_strategy.tensor_model_parallel_size=2",
        f"exp_manager.explicit_log_dir={run}",
        "launcher=torchrun",
        f"launcher.rdzv_endpoint={hosts.addr[0]}:29521",
        "launcher.rdzv_id=tp2dp2",
    ]
    hang = ["exp_manager.fault_injection.step=3", "exp_manager.fault_injection.rank=3", "exp_manager.fault_injection.kind=hang"]
    # node ranks given crosswise to the namespaces' start order: the plan follows them, not the rendezvous
    b = hosts.nxdt(1, ["train", *job, *hang, "launcher.node_rank=1"], env={"TMPDIR": str(short_tmpdir)})
    a = hosts.nxdt(0, ["train", *job, *hang, "launcher.node_rank=0"])
    log3 = run / "logs/rank3.log"
    while not (log3.exists() and "hangs at step 3" in log3.read_text()):  # bounded by the test timeout
        assert a.poll() is None and b.poll() is None, (_finish(a).stderr[-2000:], _finish(b).stderr[-2000:])
        time.sleep(0.2)
    b.send_signal(signal.SIGKILL)  # host 1's agent dies; its workers go with it
    first = _finish(a)
    assert first.returncode == 1
    failure = first.stderr.strip().splitlines()[-1]
    assert "PeerDiedError" in failure and "on another host" in failure, failure
    assert re.search(r"lost the connection to rank\(s\) \[[23](, [23])?\] on another host", failure), failure
    assert "timed out" not in failure  # noticed when the connection dropped, well before comm.timeout_s
    assert _finish(b).returncode == -signal.SIGKILL
    while hosts.pids(1):  # no orphaned worker on the killed host, its watchdog done (bounded by the test timeout)
        time.sleep(0.1)
    assert sorted(p.name for p in short_tmpdir.iterdir() if p.name != "torchinductor_root") == []
    placement = _host_lines(run)
    assert [placement[r][0] for r in range(4)] == [0, 0, 1, 1]
    assert placement[0][1] == placement[1][1] and placement[2][1] == placement[3][1] and placement[1][1] != placement[2][1]

    # both hosts restarted with the same command: the job continues from its last checkpoint
    b = hosts.nxdt(1, ["train", *job, "exp_manager.resume_if_exists=true", "launcher.node_rank=1"])
    a = hosts.nxdt(0, ["train", *job, "exp_manager.resume_if_exists=true", "launcher.node_rank=0"])
    second, other = _finish(a), _finish(b)
    assert_ok(second)
    assert_ok(other)
    assert "Restored all states from the checkpoint at " + str(run / "checkpoints/step-2") in (run / "logs/rank0.log").read_text()
    _same_losses(losses(run), one_host)


@pytest.mark.timeout(400)
@pytest.mark.skipif(not slurm_installed(), reason="slurm-wlm is not installed (slurmctld, slurmd, sbatch, munged)")
def test_tp2_dp2_through_a_real_slurm_job_equals_one_host(hosts, one_host, tmp_path):
    """One agent per node via srun, node ranks from $SLURM_NODEID, the rendezvous on the first node."""
    run = tmp_path / "run"
    job = [*COMMON, *TWO_NODES, "distributed_strategy.tensor_model_parallel_size=2", f"exp_manager.explicit_log_dir={run}"]
    slurm = Slurm(hosts, tmp_path / "slurm")
    try:
        slurm.start()
        result = _finish(hosts.nxdt(0, ["train", *job, "launcher=slurm", "launcher.wait=true"], env=slurm.env))
    finally:
        slurm.stop()
    assert_ok(result)
    job_id = re.search(r"submitted Slurm job (\d+)", result.stdout).group(1)
    log = (run / f"logs/slurm-{job_id}.out").read_text()
    agents = sorted(
        re.findall(
            r"^(\d): nxdt: node agent: node rank (\d) of 2 \(from \$SLURM_NODEID\).*c10d rendezvous (\S+) id (\d+)", log, re.M
        )
    )
    assert agents == [("0", "0", f"{hosts.addr[0]}:29500", job_id), ("1", "1", f"{hosts.addr[0]}:29500", job_id)], log[-3000:]
    placement = _host_lines(run)
    assert [placement[r][0] for r in range(4)] == [0, 0, 1, 1] and placement[1][1] != placement[2][1]
    _same_losses(losses(run), one_host)


@pytest.mark.timeout(200)
def test_comm_test_every_op_across_two_hosts_is_correct_and_hierarchical(hosts):
    args = [
        "comm-test",
        "-N",
        "2",
        "-r",
        "4",
        "--rdzv-endpoint",
        f"{hosts.addr[0]}:29523",
        "--show-algorithm",
        "--check",
        "-b",
        "4kb",
        "-e",
        "1mb",
        "-f",
        "16",
        "-n",
        "2",
        "-w",
        "1",
        "allr",
        "allg",
        "redsct",
        "alltoall",
        "bcast",
        "reduce",
        "sendrecv",
    ]
    b = hosts.nxdt(1, [*args, "--node-rank", "1"])
    a = hosts.nxdt(0, [*args, "--node-rank", "0"])
    first, second = _finish(a), _finish(b)
    assert_ok(first)
    assert_ok(second)
    out = first.stdout
    assert "# 2 hosts: host 0: ranks [0, 1] | host 1: ranks [2, 3]" in out
    sections = out.split("# nxdt ")[1:]
    assert len(sections) == 7 and all("transport p2p" in s for s in sections)
    assert "# algorithm: hierarchical (4KB–1MB)" in sections[0]
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 7 * 3 and all(row[-1] == "0" for row in rows)  # the #wrong column, summed over every rank
    assert "the node holding rank 0 prints the table" in second.stdout
