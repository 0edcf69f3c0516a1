"""Topology catalogue, placement rules, cost and memory model, `nxdt topo` / `nxdt plan` / `comm-test --estimate`
(all pure: no processes). Golden values come from the catalogue's sources (docs/sources.md) and the published
nccom-test tables of experiments/planner-accuracy/published.yaml (the NCCOM-TEST guide's 2-rank all-reduce)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from nxdt.cli import main
from nxdt.config import available_options, compose_config
from nxdt.config.schema import InstanceConfig, LinkConfig
from nxdt.planner import Plan, PlacementError, plan
from nxdt.planner.cost import bus_bandwidth, estimate_collective
from nxdt.topology import topology_of

BATCH = ["data.micro_batch_size=1", "data.global_batch_size=1536"]
LLAMA8B = ["model=llama3_8b", "distributed_strategy.kv_replicator=4", *BATCH]


def _plan(*overrides: str) -> Plan:
    return plan(compose_config(list(overrides)))


def _instance(name: str) -> InstanceConfig:
    return compose_config([f"instance={name}"], check=False).instance


# ------------------------------------------------------------------ catalogue
def test_every_stated_value_names_its_source():
    numeric = [
        f.name for f in fields(InstanceConfig) if f.type in ("int", "float", "LinkConfig") and f.name not in ("lnc_default",)
    ]
    for name in available_options("instance"):
        inst = _instance(name)
        for key in numeric:
            value = getattr(inst, key)
            if isinstance(value, LinkConfig):
                value = value.bandwidth_GBps
            if name != "cpu" and value and key not in ("domain_nodes",):
                assert key in inst.provenance and inst.provenance[key].source, f"{name}.{key} has no source"
        for key, prov in inst.provenance.items():
            assert hasattr(inst, key), f"{name}: provenance for unknown field {key}"
    # values no document states are flagged, e.g. per-direction link bandwidth of trn1
    assert _instance("trn1.32xlarge").provenance["device_link"].guess
    assert not _instance("trn1.32xlarge").provenance["devices"].guess


def test_catalogue_covers_the_issue_list():
    names = set(available_options("instance"))
    assert {
        "trn1.2xlarge",
        "trn1.32xlarge",
        "trn1n.32xlarge",
        "inf2.xlarge",
        "inf2.8xlarge",
        "inf2.24xlarge",
        "inf2.48xlarge",
        "trn2.48xlarge",
        "trn2u.48xlarge",
        "trn3-gen1-ultraserver",
        "trn3-gen2-ultraserver",
        "p4d.24xlarge",
        "p5.48xlarge",
        "gb200-nvl72",
        "cpu",
    } <= names


# ------------------------------------------------------------------ topology graphs
def test_trn1_neighbours_match_neuron_ls():
    topo = topology_of(_instance("trn1.32xlarge"))
    assert topo.neighbours(0) == [12, 3, 4, 1]
    assert topo.neighbours(5) == [1, 4, 9, 6]
    assert topo.neighbours(15) == [11, 14, 3, 12]
    assert topo.distance(0, 10) == 4 and topo.distance(0, 3) == 1


def test_graph_kinds():
    ring = topology_of(_instance("inf2.48xlarge"))
    assert ring.neighbours(0) == [11, 1] and ring.distance(0, 6) == 6
    chain = topology_of(_instance("inf2.24xlarge"))
    assert chain.neighbours(0) == [1] and chain.neighbours(5) == [4]
    trn2 = topology_of(_instance("trn2.48xlarge"), 1)
    assert trn2.ranks_per_device == 8 and list(trn2.core_ids(1)) == list(range(8, 16))
    assert topology_of(_instance("trn2.48xlarge")).ranks_per_device == 4  # LNC 2 by default
    assert topology_of(_instance("p5.48xlarge")).distance(0, 7) == 1
    ultra = topology_of(_instance("trn2u.48xlarge"))
    assert ultra.link_class(0, 64) == "domain" and ultra.link_class(0, 4 * 64) == "network" and ultra.link_class(0, 3) == "core"


def test_nxdt_topo_prints_the_neuron_ls_table(capsys):
    assert main(["topo", "trn1.32xlarge"]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split("|")[1].strip(): line.split("|")[5].strip()
        for line in out.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip().isdigit()
    }
    assert rows["0"] == "12, 3, 4, 1" and rows["5"] == "1, 4, 9, 6"
    assert "4x4 torus" in out and "device_link" in out  # guessed values are named
    assert main(["topo", "trn2.48xlarge", "--lnc", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device_table"][1]["core_ids"] == list(range(8, 16))


# ------------------------------------------------------------------ placement golden tests
def test_trn1_tp8_dp4_rows_and_columns():
    p = _plan("instance=trn1.32xlarge", "distributed_strategy.tensor_model_parallel_size=8", *LLAMA8B)
    assert p.degrees["dp"] == 4 and p.device_order == "identity"
    assert p.groups["tp"][:2] == [list(range(8)), list(range(8, 16))]  # a torus row each
    assert p.groups["dp"][:2] == [[0, 8, 16, 24], [1, 9, 17, 25]]  # a torus column each


def test_trn1_tp4_uses_column_rings():
    p = _plan("instance=trn1.32xlarge", "distributed_strategy.tensor_model_parallel_size=4", *LLAMA8B)
    assert p.device_order == "column_rings"
    assert [0, 8, 16, 24] in p.groups["tp"] and [1, 9, 17, 25] in p.groups["tp"]
    assert p.groups["dp"][0] == list(range(8))  # DP groups become rows


def test_trn2_lnc2_tp32_pairs_rows_0_3_and_1_2():
    p = _plan("instance=trn2.48xlarge", "distributed_strategy.tensor_model_parallel_size=32", *LLAMA8B)
    assert p.device_order == "row_pairs"
    assert p.groups["tp"] == [list(range(16)) + list(range(48, 64)), list(range(16, 48))]
    assert p.groups["dp"][0] == [0, 16]  # device 0 ↔ device 4: direct neighbours


def test_megatron_example_16_ranks():
    p = _plan(
        "trainer.devices=16",
        "distributed_strategy.tensor_model_parallel_size=2",
        "distributed_strategy.pipeline_model_parallel_size=4",
        "data.global_batch_size=8",
        "data.micro_batch_size=1",
    )
    assert p.groups["tp"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert p.groups["dp"][:2] == [[0, 2], [1, 3]]
    assert p.groups["pp"][:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]


def test_two_member_groups_must_be_neighbours_or_another_order_is_found():
    # identity would pair devices 0 and 8 (two rows apart) for PP; row_pairs makes them neighbours
    p = _plan(
        "instance=trn1.32xlarge",
        "distributed_strategy.tensor_model_parallel_size=8",
        "distributed_strategy.pipeline_model_parallel_size=2",
        *LLAMA8B,
    )
    topo = topology_of(_instance("trn1.32xlarge"))
    for g in p.groups["pp"] + p.groups["dp"]:
        devices = sorted({topo.device_of(r) for r in g})
        assert len(devices) != 2 or topo.distance(*devices) == 1


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            [
                "instance=inf2.48xlarge",
                "distributed_strategy.tensor_model_parallel_size=3",
                "model.num_attention_heads=24",
                "model.num_kv_heads=24",
                "model.hidden_size=3072",
                "model.vocab_size=264",
                *BATCH,
            ],
            "even number of ranks",
        ),
        (["instance=inf2.48xlarge", "distributed_strategy.tensor_model_parallel_size=4", *LLAMA8B], "not consecutive"),
    ],
)
def test_rejected_layouts_name_the_rule_and_the_degrees_that_work(overrides, needle):
    with pytest.raises(PlacementError, match=needle) as info:
        _plan(*overrides)
    assert "TP degrees that work here: 1, 2, 24" in str(info.value)
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "instance=trn1.32xlarg"], "did you mean 'trn1.32xlarge'"),
        (["plan", "instance=trn1.2xlarge", "trainer.devices=4"], "at most 2 ranks"),
        (["plan", "instance=trn1.2xlarge", "trainer.num_nodes=2"], "cannot run multi-node"),
        (["plan", "instance=trn1.32xlarge", "trainer.lnc=2"], "no logical-NeuronCore setting"),
        (["plan", "instance=trn2.48xlarge", "trainer.lnc=4"], "accepts LNC 1, 2"),
        (
            [
                "plan",
                "instance=inf2.48xlarge",
                "distributed_strategy.tensor_model_parallel_size=3",
                "model.num_attention_heads=24",
                "model.num_kv_heads=24",
                "model.hidden_size=3072",
                "model.vocab_size=264",
                *BATCH,
            ],
            "topology rule",
        ),
        (["topo", "trn9.huge"], "unknown instance"),
        (["topo", "trn1.32xlarge", "--lnc", "2"], "no logical-NeuronCore setting"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------ cost model
def _published_sweep(sweep_id: str) -> list[list[float]]:
    """[size(B), time(us)] of one published nccom-test sweep (experiments/planner-accuracy/published.yaml)."""
    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "experiments/planner-accuracy/published.yaml").read_text())
    return next(e["points"] for e in data["collectives"] if e["id"] == sweep_id)


def test_estimate_reproduces_the_published_two_core_nccom_test_table():
    """nccom-test -r 2 allr fp32 of the NCCOM-TEST guide (two NeuronCores of one Trainium) from trn1.2xlarge's
    entry, which takes trn1.32xlarge's fitted chip figures: within 35 % at >= 1 MB (busbw), within 2x below."""
    inst = _instance("trn1.2xlarge")
    topo = topology_of(inst)
    for nbytes, measured_us in _published_sweep("trn1-allr-r2"):
        _, seconds, _ = estimate_collective("all_reduce", [0, 1], nbytes, topo, inst, 2)
        if nbytes >= 1 << 20:
            predicted, real = (
                bus_bandwidth("all_reduce", 2, nbytes, seconds),
                bus_bandwidth("all_reduce", 2, nbytes, measured_us * 1e-6),
            )
            assert abs(predicted / real - 1) <= 0.35, nbytes
        else:
            assert 0.5 <= seconds * 1e6 / measured_us <= 2.0, nbytes


def test_algorithm_choice_follows_size_and_span():
    inst = _instance("trn1.32xlarge")
    topo = topology_of(inst)
    node = list(range(32))
    small = estimate_collective("all_reduce", node, 1 << 10, topo, inst, 32)[0]
    large = estimate_collective("all_reduce", node, 1 << 30, topo, inst, 32)[0]
    assert (
        small in ("direct", "rhd") and large == "ring"
    )  # latency-bound vs bandwidth-bound (reference: mesh < 1 MB, ring at large sizes)
    across = estimate_collective("all_reduce", list(range(64)), 64 << 20, topo, inst, 32)[0]
    assert across == "hierarchical"


def test_across_switched_gpu_nodes_the_cheaper_of_nccls_ring_and_nvls_tree_is_priced():
    """16 GPUs on 2 × p5.48xlarge (published.yaml p5-allr-16gpu-n2): NCCL's node-laid ring (2(n-1)/n·S through each
    node's NICs; every step at least the network post, tuning.cc's nsteps × net overhead, in NCCL's cheapest protocol)
    against NVLS_TREE (S through each node's NICs on two nodes, NVLS inside the node, plus its pipeline's fill: the
    ramp). From the catalogue (NVSwitch: 0.6 µs, 450 GB/s × 0.734 = 330.3 GB/s, NVLS 0.782 of it = 258.29 GB/s;
    network: 29.5 µs, 400 GB/s × 0.767 = 306.8 GB/s per node, post 2 µs (× 3 with Simple); ramp 671 µs, half at
    827 kB; 20.1 µs per call) and tuning.cc's protocol constants, by hand:
      LL128 ring at 4 MiB: (14 - 8.4) + 28 steps × max(0.6, 1.9, 2) + 2 × max(4, 29.5 - 10)
                           + 30 × 262144 B / 306.8 GB/s / 0.92 + 20.1 = 148.56 µs (Simple: 272.73, LL: 161.96)
      NVLS tree at 4 MiB:  2 × 29.5 + 0.6 + S / 258.29 GB/s + 671 · S/(S + 827e3) + 20.1 = 656.4 µs (the fill)
      NVLS tree at 1 GiB:  59.6 + 4157.1 (the switch sets the pace on two nodes) + 670.5 (fill) + 20.1 = 4907.3 µs
      Simple ring at 1 GiB: 28 × 6 + 2 × 29.5 + 30 × 67108864 B / 306.8 GB/s + 20.1 = 6809.4 µs (LL128 pays 0.92)"""
    inst = _instance("p5.48xlarge")
    topo = topology_of(inst, ranks_per_node=8)
    group = list(range(16))
    algorithm, seconds, every = estimate_collective("all_reduce", group, 4 << 20, topo, inst, 8)
    ll128 = 5.6 + 28 * 2 + 2 * 19.5 + 30 * 262144 / 306.8e9 / 0.92 * 1e6 + 20.1
    assert algorithm == "ring" and seconds * 1e6 == pytest.approx(ll128, rel=1e-9)
    assert every["nvls_tree"] * 1e6 == pytest.approx(656.4, abs=0.1)
    algorithm, seconds, every = estimate_collective("all_reduce", group, 1 << 30, topo, inst, 8)
    assert algorithm == "nvls_tree" and seconds * 1e6 == pytest.approx(4907.3, abs=0.1)
    simple = 28 * 6 + 2 * 29.5 + 30 * 67108864 / 306.8e9 * 1e6 + 20.1
    assert every["ring"] * 1e6 == pytest.approx(simple, rel=1e-9)


def test_comm_test_estimate_prints_an_nccom_test_table(capsys):
    assert main(["comm-test", "--estimate", "--instance", "trn1.2xlarge", "-b", "1mb", "-e", "4mb", "-d", "bf16", "allr"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1 << 20, 4 << 20] and all(r[2] == "bf16" for r in rows)
    published = dict(_published_sweep("trn1-allr-r2"))  # busbw = algbw for 2 ranks; the guide's GB/s are GiB/s
    for row in rows:
        assert abs(float(row[5]) / (int(row[0]) / (published[int(row[0])] * 1e-6) / 1e9) - 1) < 0.35


def test_comm_test_estimate_takes_nccom_tests_flags_and_a_measured_runs_outputs(tmp_path, capsys):
    # nccom-test's documented two-instance example: -r is the total (64 = 2 × 32), -N the nodes
    report = tmp_path / "f.json"
    assert (
        main(
            [
                "comm-test",
                "--estimate",
                "--instance",
                "trn1.32xlarge",
                "-N",
                "2",
                "-r",
                "64",
                "-b",
                "8",
                "-e",
                "1gb",
                "-f",
                "2",
                "-d",
                "fp32",
                "-n",
                "50",
                "-w",
                "5",
                "--report-to-json-file",
                str(report),
                "allr",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "on 2 × trn1.32xlarge (64 ranks, 32 per node)" in out and "# algorithm" not in out
    data = json.loads(report.read_text())
    assert (data["nworkers"], data["nodes"], data["hosts"]) == (64, 2, 2) and "algorithms" not in data
    assert [r["size(B)"] for r in data["results"]] == [1 << k for k in range(3, 31)]
    assert all(r["op"] == "allr" and r["type"] == "fp32" and r["count(elems)"] == r["size(B)"] // 4 for r in data["results"])
    assert data["layout"] == f"host 0: ranks {list(range(32))} | host 1: ranks {list(range(32, 64))}"
    assert data["estimate"]["instance"] == "trn1.32xlarge" and data["estimate"]["ranks_per_node"] == 32

    assert (
        main(
            [
                "comm-test",
                "--estimate",
                "--instance",
                "trn1.32xlarge",
                "-N",
                "2",
                "-r",
                "64",
                "-b",
                "1mb",
                "-e",
                "4mb",
                "--show-algorithm",
                "--report-to-json-file",
                str(report),
                "allr",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "# algorithm: hierarchical (1MB–4MB)" in out and out.count("hierarchical") == 1 + 2  # the band, then each row
    assert json.loads(report.read_text())["algorithms"] == {
        "1048576": {"allr": "hierarchical"},
        "4194304": {"allr": "hierarchical"},
    }


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["-c"], "--check: an estimate has nothing to check"),
        (["--check"], "--check: an estimate has nothing to check"),
        (["-N", "2", "-r", "128"], "-r 128 over -N 2 nodes is 64 ranks per node: a trn1.32xlarge node runs at most 32 ranks"),
        (["-N", "2", "-r", "3"], "-r 3 ranks do not divide equally over -N 2 nodes"),
    ],
)
def test_comm_test_estimate_refusals_are_one_line(argv, needle, capsys):
    assert main(["comm-test", "--estimate", "--instance", "trn1.32xlarge", *argv, "allr"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_plan_of_the_first_natural_command_exits_0(capsys):
    # the default global batch (null = micro × DP) fits any layout: here 4 × DP 8 = 32
    assert main(["plan", "instance=trn1.32xlarge", "model=llama3_8b", "distributed_strategy.tensor_model_parallel_size=4"]) == 0
    assert "global 32 = micro 4 × DP 8" in capsys.readouterr().out


# ------------------------------------------------------------------ step and memory estimates
def test_pipeline_stages_send_the_sequence_parallel_shard():
    """With SP the stage boundary is in the sequence-parallel layout, so each TP rank sends its s/t rows:
    b·s·h·2/t = 1·4096·4096·2/8 = 4194304 bytes; without SP every TP rank holds (and sends) the whole activation,
    33554432. Forward and backward, once per micro-batch each: 2 × 32 micro-batches (global 64 / (micro 1 × DP 2))."""
    common = [
        "instance=trn1.32xlarge",
        "trainer.num_nodes=2",
        "model=llama3_8b",
        "distributed_strategy.tensor_model_parallel_size=8",
        "distributed_strategy.pipeline_model_parallel_size=4",
        "data.seq_length=4096",
        "data.micro_batch_size=1",
        "data.global_batch_size=64",
        "precision.type=mixed_precision",
    ]
    for sp, nbytes in (("true", 4194304), ("false", 33554432)):
        [row] = [r for r in _plan(*common, f"distributed_strategy.sequence_parallel={sp}").collectives if r["dim"] == "pp"]
        assert (row["op"], row["bytes"], row["count"]) == ("send_recv", nbytes, 64), sp


def test_memory_model_shards_with_zero1_and_tp():
    base = _plan(
        "instance=trn1.32xlarge",
        "distributed_strategy.tensor_model_parallel_size=8",
        "distributed_strategy.zero1=false",
        *LLAMA8B,
    )
    zero = _plan(
        "instance=trn1.32xlarge", "distributed_strategy.tensor_model_parallel_size=8", "distributed_strategy.zero1=true", *LLAMA8B
    )
    m0, m1 = base.estimate["memory_per_rank_bytes"], zero.estimate["memory_per_rank_bytes"]
    assert m1["optimizer"] == pytest.approx(m0["optimizer"] / 4)  # DP = 4
    assert m1["parameters"] == m0["parameters"]
    assert any(
        "does not fit" in w
        for w in _plan(
            "instance=trn1.32xlarge",
            "model=llama3_70b",
            "distributed_strategy.tensor_model_parallel_size=32",
            "distributed_strategy.kv_replicator=4",
            *BATCH,
        ).warnings
    )


def test_plan_json_round_trip_with_estimates(tmp_path, capsys):
    p = _plan("instance=trn1.32xlarge", "distributed_strategy.tensor_model_parallel_size=8", *LLAMA8B)
    assert p.estimate["step_time_s"] > 0 and 0 < p.estimate["mfu"] < 1 and p.algorithms["tp"]["all_reduce"]
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == p
    assert main(["plan", "instance=trn1.32xlarge", "distributed_strategy.tensor_model_parallel_size=8", *LLAMA8B]) == 0
    out = capsys.readouterr().out
    assert "collectives per step" in out and "placement on node 0" in out and "MFU" in out


def test_131072_ranks_plan():  # the timing of this (< 2 s) is a benchmark in the closing note, not asserted here
    p = _plan(
        "instance=trn2.48xlarge",
        "trainer.lnc=1",
        "trainer.num_nodes=1024",
        "model=llama3_70b",
        "distributed_strategy.tensor_model_parallel_size=8",
        "distributed_strategy.pipeline_model_parallel_size=8",
        "data.micro_batch_size=1",
        "data.global_batch_size=4096",
    )
    assert p.world_size == 131072 and len(p.groups["tp"]) == 16384


def test_auto_ranks_valid_layouts_that_fit(capsys):
    from nxdt.planner.auto import auto_layouts

    result = auto_layouts(
        [
            "instance=trn1.32xlarge",
            "model=llama3_8b",
            "precision.type=mixed_precision",
            "distributed_strategy.zero1=true",
            "data.micro_batch_size=1",
            "data.global_batch_size=64",
            "data.seq_length=4096",
        ]
    )
    layouts = result["layouts"]
    assert layouts and [r["tokens_per_s"] for r in layouts] == sorted((r["tokens_per_s"] for r in layouts), reverse=True)
    assert all(r["memory_per_device_GiB"] <= 32 for r in layouts)
    assert "TP1 PP1 DP32" in result["rejected"]  # 8B with full replicas does not fit a 32 GiB device
    best = layouts[0]
    assert (
        plan(
            compose_config(
                [
                    "instance=trn1.32xlarge",
                    "model=llama3_8b",
                    "precision.type=mixed_precision",
                    "distributed_strategy.zero1=true",
                    "data.micro_batch_size=1",
                    "data.global_batch_size=64",
                    "data.seq_length=4096",
                    *best["overrides"],
                ]
            )
        ).warnings
        == []
    )
    assert (
        main(
            [
                "plan",
                "distributed_strategy=auto",
                "instance=trn1.32xlarge",
                "model=llama3_8b",
                "data.micro_batch_size=1",
                "data.global_batch_size=64",
                "precision.type=mixed_precision",
                "distributed_strategy.zero1=true",
            ]
        )
        == 0
    )
    assert "run the best with" in capsys.readouterr().out


def test_plan_sweeps_several_layouts(capsys):
    assert (
        main(
            [
                "plan",
                "-m",
                "instance=trn1.32xlarge",
                "model=llama3_8b",
                "distributed_strategy.kv_replicator=4",
                "distributed_strategy.tensor_model_parallel_size=8,32",
                *BATCH,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("### ") == 2 and "TP8 PP1 CP1 EP1 DP4" in out and "TP32 PP1 CP1 EP1 DP1" in out


def test_workers_read_every_instance_as_hydra_composes_it():
    """Workers load the emulated instance without Hydra (``links.load_instance``); an entry that inherits
    (trn1n from trn1, p5 and gb200 from their parents) must come out equal to the composed config, or link
    emulation prices a link with the parent's figures missing."""
    from omegaconf import OmegaConf

    from nxdt.planner.links import load_instance

    for name in available_options("instance"):
        composed = compose_config([f"instance={name}"]).instance
        composed = OmegaConf.to_object(composed) if OmegaConf.is_config(composed) else composed
        assert load_instance(name) == composed, name
