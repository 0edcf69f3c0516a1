"""The planner's fit and held-out check (experiments/planner-accuracy/fit.py, heldout*.yaml, heldout.py): the catalogue
ships the fit of the fitted figures, the blind set is never fitted, figures the fit never sees are predicted with the
shipped catalogue, and the model term the held-out all-gather sweeps showed missing."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import math
from pathlib import Path

import pytest
import yaml

from nxdt.planner.cost import estimate_collective
from nxdt.planner.fitting import COLLECTIVE_PARAMS, STEP_PARAMS, catalogue_instance, get_param, with_params
from nxdt.topology import topology_of

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "experiments" / "planner-accuracy"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"planner_accuracy_{name}", STUDY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fit_script():
    """fit.py and the data it fits (published.yaml with the seen sets' training figures: each composed once)."""
    script = _script("fit")
    return script, script.fit_data()


def test_catalogue_ships_the_fit_of_the_shipped_figures(fit_script):
    """Every fitted value in conf/instance/*.yaml equals what fit.py computes from published.yaml and the seen held-out
    sets' training figures (0.5 %: the catalogue stores 3 significant digits), and every published figure the fit uses
    names a source of the file."""
    script, data = fit_script
    published = yaml.safe_load((STUDY / "published.yaml").read_text())
    for entry in [*published["collectives"], *published["end_to_end"]]:
        assert entry["source"] in published["sources"], entry["id"]
    result = script.fit_all(copy.deepcopy(data), loo=False, log=lambda *_: None)  # with the seen held-out figures
    assert script.catalogue_differences(result) == []
    assert set(result["instances"]) == set(COLLECTIVE_PARAMS) | set(STEP_PARAMS)
    assert all(math.isfinite(r["fitted_us" if r["kind"] == "collective" else "fitted_seq_per_s"]) for r in result["figures"])


def test_the_fit_never_reads_the_blind_set(fit_script):
    """heldout3.yaml is the blind set (committed before its first prediction): fit.py and the fitting module never name
    it, fit.py's SEEN (the held-out sets folded into the fit once their predictions were published) does not hold it,
    and none of its figures is a fitted one (same entry id; nor the same composed configuration, recipe and overrides,
    but for PaddlePaddle's 12 unfused BERT rows, which repeat the configurations of NVIDIA's PyTorch rows).
    Its ids are unique and every figure cites a source of the file."""
    for path in (STUDY / "fit.py", ROOT / "nxdt" / "planner" / "fitting.py"):
        assert "heldout3" not in path.read_text().lower(), path
    script, fitted = fit_script
    assert "heldout3.yaml" not in script.SEEN
    blind = yaml.safe_load((STUDY / "heldout3.yaml").read_text())
    ids = [e["id"] for e in blind["end_to_end"]]
    assert len(set(ids)) == len(ids) and not set(ids) & {e["id"] for e in fitted["end_to_end"]}
    common = fitted["end_to_end_common"]
    composed = lambda e, shared: frozenset([*shared, *e["overrides"]])
    fitted_configs = {
        composed(e, [] if not e.get("common", True) else common.get(e["instance"], [])) for e in fitted["end_to_end"]
    }
    repeated = {e["id"] for e in blind["end_to_end"] if composed(e, blind["recipes"][e["recipe"]]) in fitted_configs}
    # the one exception, found after the commit and kept (nothing is dropped): PaddlePaddle's BERT-Large rows with
    # unfused attention state the batch, sequence and precision of NVIDIA's PyTorch rows that published.yaml fits (same
    # DGX A100 80GB): another framework's measurement of one nxdt configuration
    assert repeated == {e["id"] for e in blind["end_to_end"] if e["source"] == "dle-bert-paddle-a100-80gb-2212"}
    assert len(repeated) == 12
    assert blind["collectives"] == []  # no fresh collective figure was found (the file says where it looked)
    for entry in blind["end_to_end"]:
        assert entry["source"] in blind["sources"], entry["id"]


def test_the_collective_blind_set_is_split_by_its_rule_and_never_fitted(fit_script):
    """heldout4.yaml (collectives inside one GPU node, committed before its first prediction) is split by the rule its
    header states: a figure '<sweep>@<bytes>' is 'dev' when int(sha256(id), 16) is even, else 'blind'. fit.py and the
    fitting module never name it, SEEN does not hold it, and no sweep repeats a fitted or earlier held-out one (its
    source appears in no other file). Every point is >= 1 MiB, every entry cites a source of the file."""
    for path in (STUDY / "fit.py", ROOT / "nxdt" / "planner" / "fitting.py"):
        assert "heldout4" not in path.read_text().lower(), path
    script, fitted = fit_script
    assert "heldout4.yaml" not in script.SEEN
    data = yaml.safe_load((STUDY / "heldout4.yaml").read_text())
    halves = {"dev": 0, "blind": 0}
    for entry in data["collectives"]:
        assert entry["source"] in data["sources"] and entry["id"] == f"{entry['sweep']}-{entry['half']}"
        for size, _ in entry["points"]:
            fid = f"{entry['sweep']}@{size}"
            assert ("dev" if int(hashlib.sha256(fid.encode()).hexdigest(), 16) % 2 == 0 else "blind") == entry["half"]
            assert size >= 1 << 20
            halves[entry["half"]] += 1
    assert halves == {"dev": 150, "blind": 170}
    earlier = [yaml.safe_load((STUDY / n).read_text()) for n in ("published.yaml", *script.SEEN, "heldout3.yaml")]
    assert not set(data["sources"]) & {s for f in earlier for s in f["sources"]}
    sweeps = {e["sweep"] for e in data["collectives"]}
    assert not sweeps & {e["id"] for f in earlier for e in f["collectives"]}


def test_the_catalogue_ships_the_nvlink_values_tuned_on_the_dev_half_only():
    """tune_dev.py fits the A100's (p4d, inherited by p4de) and GB200's NVLink efficiency and ramp inside one node to
    heldout4.yaml's dev half: it binds only dev figures (none of the blind half), and conf/instance/ holds exactly the
    values it computes."""
    script = _script("tune_dev")
    figures = script.dev_figures()
    assert figures and all("-dev@" in f.id for f in figures)
    data = yaml.safe_load((STUDY / "heldout4.yaml").read_text())
    assert len(figures) == sum(len(e["points"]) for e in data["collectives"] if e["half"] == "dev")
    for holder, values in script.tuned_values(figures).items():
        inst = catalogue_instance(holder)
        assert {p: get_param(inst, p) for p in values} == values, holder


def test_the_seen_held_out_training_figures_are_fitted_in_sequences_per_second(fit_script):
    """fit.py folds the training figures of heldout.yaml and heldout2.yaml into the fit (their predictions have been
    published, so they are no longer blind), each with its recipe composed and its throughput in sequences per second:
    llm-foundry's MPT-1B row (363,645 tokens/s at sequence 2,048) becomes 177.6 seq/s on p5; the Neuron BERT rows keep
    their seq/s. Their collective figures stay out (SEEN's comment: the collective model did not change)."""
    script, data = fit_script
    assert script.SEEN == ("heldout.yaml", "heldout2.yaml")
    by_id = {e["id"]: e for e in data["end_to_end"]}
    for name in script.SEEN:
        held = yaml.safe_load((STUDY / name).read_text())
        assert {e["id"] for e in held["end_to_end"]} <= set(by_id)
    mpt = by_id["h100-mpt-1b-s2048-8gpu"]
    assert mpt["instance"] == "p5.48xlarge" and mpt["value"] == pytest.approx(363645 / 2048, rel=1e-12)
    assert not mpt["common"] and "distributed_strategy.fsdp.enabled=true" in mpt["overrides"]
    assert by_id["trn1-bert-large-ph2-bf16sr-n16"]["value"] == 7800.9
    published = yaml.safe_load((STUDY / "published.yaml").read_text())
    assert len(data["collectives"]) == len(published["collectives"])


def test_every_step_of_a_ring_across_nodes_waits_for_the_network_post():
    """NCCL's ring across nodes runs its steps in lockstep, each waiting for the host to post the send at the node
    boundary (tuning.cc: "Inter-node rings still have to launch nsteps * net overhead"; getNetOverhead 2 µs on AMD
    hosts, x3 with the Simple protocol). The held-out all_gather_perf sweeps on 2-32 p5 nodes grow by ~80 µs per node
    at 32-256 MiB (2.7 ms on 32 nodes at 32 MiB); without the term the node-laid ring charged 2 µs per NVLink step and
    was 0.56x of that. With Simple only, exactly (n - k) steps inside nodes change, from NCCL's Simple NVLink step
    (3.4 µs) to 3 x post each."""
    inst = with_params(catalogue_instance("p5.48xlarge"), {})
    assert inst.inter_node.post_us == 2.0
    inst.network_protocols = ["simple"]
    without = with_params(inst, {"inter_node.post_us": 0.0})
    for k in (2, 32):
        topo = topology_of(inst, ranks_per_node=8)
        group = list(range(8 * k))
        ring = estimate_collective("all_gather", group, 32 << 20, topo, inst, 8)[2]["ring"]
        base = estimate_collective("all_gather", group, 32 << 20, topo, without, 8)[2]["ring"]
        step = (3 * inst.inter_node.post_us - 3.4) * 1e-6
        assert ring - base == pytest.approx((8 * k - k) * step, rel=1e-9)
    # Trainium's rings (no NCCL proxy; not set) are unchanged
    assert catalogue_instance("trn1.32xlarge").inter_node.post_us == 0.0


def test_ring_across_nodes_takes_nccls_cheapest_protocol():
    """NCCL prices each protocol (src/graph/tuning.cc): LL posts each step once (no x3), its network step is 2.7 µs
    instead of Simple's 14 and its per-call base 6.6 µs instead of 8.4, but it carries half the bandwidth; LL128 carries
    0.92 of it. On 2 p5 nodes (16 GPUs, all three protocols allowed: aws-ofi-nccl leaves them to NCCL on p5) a 1 KiB
    all-reduce is LL's time, hand-computed here; at 8 MiB LL128 beats both; at 16 GiB Simple's full bandwidth wins and
    the ring is Simple's. On p4d (EFA without ordered 128-byte delivery: the plugin forces Simple) nothing changes."""
    inst = catalogue_instance("p5.48xlarge")
    assert inst.network_protocols == ["ll", "ll128", "simple"]
    simple = with_params(inst, {})
    simple.network_protocols = ["simple"]
    topo = topology_of(inst, ranks_per_node=8)
    group = list(range(16))
    ring = lambda i, size: estimate_collective("all_reduce", group, size, topo, i, 8)[2]["ring"]
    lat, post = inst.inter_node.latency_us, inst.inter_node.post_us
    chunk = 1024 / 16
    per_step = max(chunk / (400e9 * inst.inter_node.efficiency), chunk / (450e9 * inst.device_link.efficiency))
    # LL: base 6.6 vs 8.4; 28 steps inside nodes at max(0.6, 0.6, post); 2 crossings at max(2.7, lat - (14 - 2.7))
    ll = (6.6 - 8.4) * 1e-6 + 28 * max(0.6, post) * 1e-6 + 2 * max(2.7, lat - 11.3) * 1e-6 + 30 * per_step / 0.5
    assert ring(inst, 1024) - ring(simple, 1024) == pytest.approx(
        ll - (28 * 3 * post * 1e-6 + 2 * lat * 1e-6 + 30 * per_step), rel=1e-9
    )
    assert ring(inst, 8 << 20) < 0.9 * ring(simple, 8 << 20)  # LL128 in the middle
    assert ring(inst, 16 << 30) == ring(simple, 16 << 30)  # Simple at the largest size
    p4d = catalogue_instance("p4d.24xlarge")
    assert p4d.network_protocols == ["simple"]


def test_heldout_script_predicts_each_figure_and_reports_per_class():
    """heldout.py on a slice of heldout.yaml (one collective sweep, one training figure): every figure gets a
    prediction from the catalogue, and the class table and verdict name the classes and the bands."""
    script = _script("heldout")
    data = yaml.safe_load((STUDY / "heldout.yaml").read_text())
    data["collectives"] = [e for e in data["collectives"] if e["id"] == "h100-allg-4gpu"]
    data["end_to_end"] = [e for e in data["end_to_end"] if e["id"] == "trn1-llama2-13b-tp8-pp4-n32"]
    rows = script.predict_collectives(data) + script.predict_training(data)
    assert len(rows) == 8 and all(r["ratio"] > 0 for r in rows)
    step = rows[-1]
    # 87.44 seq/s measured (Neuron 2.18 table); the planner's throughput is global batch / its step time
    assert step["measured_seq_per_s"] == 87.44
    assert step["predicted_seq_per_s"] == pytest.approx(1024 / step["step_time_s"], rel=1e-12)
    classes = {c["class"]: c for c in script.class_table(rows)}
    assert set(classes) == {"GPU collectives inside one node", "LLM training, Trainium (TP/PP)"}
    assert classes["GPU collectives inside one node"]["figures"] == 7
    verdict = script.verdict(rows, list(classes.values()))
    assert set(verdict) == {"training_median_error", "collective_median_error", "classes_over_35pct"}


def test_heldout_script_reads_the_fresh_set_without_collectives():
    """heldout2.yaml has no collective figure (none fresh was found): heldout.py predicts its training figures (here the
    GPT3-23B NeMo row on 32 trn1 nodes, 102.5 seq/s) and its verdict says the collective median is absent, not 0."""
    script = _script("heldout")
    data = yaml.safe_load((STUDY / "heldout2.yaml").read_text())
    assert data["collectives"] == []
    data["end_to_end"] = [e for e in data["end_to_end"] if e["id"] == "trn1-gpt3-23b-tp8-pp4-n32"]
    rows = script.predict_collectives(data) + script.predict_training(data)
    assert len(rows) == 1 and rows[0]["measured_seq_per_s"] == 102.5
    assert rows[0]["predicted_seq_per_s"] == pytest.approx(1024 / rows[0]["step_time_s"], rel=1e-12)
    verdict = script.verdict(rows, script.class_table(rows))
    assert verdict["collective_median_error"] is None
    assert verdict["training_median_error"] == pytest.approx(abs(rows[0]["ratio"] - 1), rel=1e-12)
