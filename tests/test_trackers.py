"""W&B, MLflow and ClearML trackers from NxDT's exp_manager keys (``nxdt.lightning.trackers``), with no network: W&B
offline (``WANDB_MODE=offline``), MLflow on a ``file:`` store, ClearML offline (``CLEARML_OFFLINE_MODE=1``). One launch
of 5 steps with the three trackers and one resume of it to 7 steps cover what a user reads back: every step's metrics at
its step, the config as parameters, the run directory, one tracker run across the resume. Bad input is refused before
launch; a tracker that fails mid-run is dropped with one warning line."""

from __future__ import annotations

import csv
import json
import os
import socket
import struct
import subprocess
import importlib.util
from pathlib import Path

import pytest
import warm_cli

# all three in the [test] extra; looked up, not imported: the run's rank 0 imports them (~2.5 CPU-s in each xdist
# worker's collection otherwise, also the worker that never runs this file)
for _tracker in ("wandb", "mlflow", "clearml"):
    if importlib.util.find_spec(_tracker) is None:
        pytest.skip(f"{_tracker} is not installed (pip install -e '.[trackers]')", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # launches (shared or this module's) on a loaded host

TRACKED = [
    "model=llama_tiny",
    "data=synthetic",
    "trainer.log_every_n_steps=1",
    "exp_manager.create_tensorboard_logger=false",
    "data.global_batch_size=4",
    "data.micro_batch_size=2",
    "exp_manager.checkpoint_every_n_steps=5",
    "model.optim.sched.max_steps=7",
    "exp_manager.resume_if_exists=true",
    "exp_manager.create_wandb_logger=true",
    "+exp_manager.wandb_logger_kwargs.project=nxdt-test",
    "exp_manager.create_mlflow_logger=true",
    "exp_manager.create_clearml_logger=true",
    "+exp_manager.clearml_logger_kwargs.tags=[t1]",
]
OFFLINE = {"CLEARML_OFFLINE_MODE": "1"}  # ClearML keeps the session under <run>/clearml/ (WANDB_MODE: nxdt() below)


def nxdt(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return warm_cli.run(
        [*args], cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", **(env or {})}, timeout=timeout
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """5 steps with both trackers (checkpoint at 5), then the same run resumed to 7 steps."""
    root = tmp_path_factory.mktemp("trackers")
    run, store = root / "run", f"file:{root / 'mlruns'}"
    args = [*TRACKED, f"+exp_manager.mlflow_logger_kwargs.tracking_uri={store}", f"exp_manager.explicit_log_dir={run}"]
    first = ok(nxdt("train", *args, "trainer.max_steps=5", cwd=root, env=OFFLINE))
    after_first = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    clearml_first = json.loads((run / "trackers.json").read_text())["clearml"]
    second = ok(nxdt("train", *args, "trainer.max_steps=7", cwd=root, env=OFFLINE))
    return {
        "run": run,
        "store": store,
        "first": first,
        "second": second,
        "wandb_after_first": after_first,
        "clearml_first": clearml_first,
    }


def metrics_csv(run: Path) -> dict[int, dict[str, str]]:
    with open(run / "metrics.csv", newline="") as fh:
        return {int(row["step"]): row for row in csv.DictReader(fh)}


def mlflow_client(store: str):
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 reads its file store only when asked (conftest restores env)
    from mlflow.tracking import MlflowClient

    return MlflowClient(store)


def test_mlflow_run_holds_every_step_the_config_and_the_run_dir(tracked):
    run, rows = tracked["run"], metrics_csv(tracked["run"])
    state = json.loads((run / "trackers.json").read_text())
    client = mlflow_client(tracked["store"])
    got = client.get_run(state["mlflow"]["run_id"])
    assert got.info.status == "FINISHED"
    assert client.get_experiment(got.info.experiment_id).name == "llama_tiny"  # NxDT: experiment_name defaults to the run name
    for name in ("loss", "lr", "tokens_per_s", "step_time_s"):  # every step, both launches, one MLflow run
        history = {m.step: m.value for m in client.get_metric_history(got.info.run_id, name)}
        assert sorted(history) == list(range(1, 8)), (name, history)
        for step, value in history.items():  # the very values of metrics.csv (both hold the Python float)
            assert value == float(rows[step][name]), (name, step)
    params = got.data.params
    assert params["model.hidden_size"] == "128" and params["data.global_batch_size"] == "4"  # llama_tiny, the overrides
    assert params["trainer.max_steps"] == "5"  # MLflow parameters cannot change: the first launch's stay
    assert params["nxdt.run_dir"] == str(run) and got.data.tags["nxdt.run_dir"] == str(run)
    # the resume names what it could not update, in one line
    assert "MLflow keeps this run's first parameters; changed on resume (see config-history/): trainer.max_steps" in (
        tracked["second"].stdout
    )


def wandb_records(path: Path):
    """The records of a W&B run file (``run-<id>.wandb``), as wandb's own protobuf ``Record``: W&B frames them like a
    LevelDB log (a 7-byte file header ':W&B', 0xBEE1, version; 32 KiB blocks of records with a 7-byte header: CRC-32,
    length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4), as wandb's former Python reader
    wandb/sdk/internal/datastore.py read them (wandb 0.31 reads them in its Go core only)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1) and version in (0, 1), (ident, magic, version)
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(run_dir: Path) -> tuple[str, list[dict], dict]:
    (path,) = run_dir.glob("run-*.wandb")
    run_id, history, config = "", [], {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind == "config":
            config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.config.update})
    return run_id, history, config


def test_wandb_offline_run_holds_every_step_and_the_resume_continues_it(tracked):
    run, rows = tracked["run"], metrics_csv(tracked["run"])
    first_dir, second_dir = sorted((run / "wandb").glob("offline-run-*"))
    assert tracked["wandb_after_first"] == [first_dir.name]
    state = json.loads((run / "trackers.json").read_text())
    (first_id, first, config), (second_id, second, _) = wandb_run(first_dir), wandb_run(second_dir)
    assert first_id == second_id == state["wandb"]["id"]  # the resume continues the same W&B run (wandb sync merges them)
    steps = [h["trainer/global_step"] for h in first + second]
    assert steps == list(range(1, 8))
    for h in first + second:
        step = h["trainer/global_step"]
        for name in ("loss", "lr", "tokens_per_s"):
            assert h[name] == float(rows[step][name]), (name, step)
    assert config["trainer.max_steps"] == 5 and config["model.hidden_size"] == 128
    assert config["nxdt.run_dir"] == str(run)


def clearml_session(session: Path) -> tuple[list[dict], dict]:
    """An offline ClearML session folder as ClearML writes it (and ``clearml-task``'s import reads it): metrics.jsonl,
    one JSON list of reports per line (``metric``/``variant``/``iter``/``value``), and task.json (``hyperparams``:
    section → name → {value: text})."""
    reports = [r for line in (session / "metrics.jsonl").read_text().splitlines() for r in json.loads(line)]
    return reports, json.loads((session / "task.json").read_text())


def test_clearml_offline_session_holds_every_step_and_the_resume_continues_it(tracked):
    run, rows = tracked["run"], metrics_csv(tracked["run"])
    state = json.loads((run / "trackers.json").read_text())["clearml"]
    assert state == tracked["clearml_first"]  # the resume continued the first launch's task, in the same folder
    session = Path(state["session_dir"])
    assert session.parent == run / "clearml" / "offline" and session.name == state["task_id"]
    assert [p.name for p in session.parent.iterdir() if p.is_dir()] == [session.name]  # one task, not two
    reports, task = clearml_session(session)
    for name in ("loss", "lr", "tokens_per_s", "step_time_s"):
        got = {r["iter"]: r["value"] for r in reports if r["metric"] == name and r["variant"] == name}
        assert sorted(got) == list(range(1, 8)), (name, got)  # at the step itself: no iteration offset on resume
        for step, value in got.items():  # the very values of metrics.csv (JSON keeps a float's every digit)
            assert value == float(rows[step][name]), (name, step)
    params = {k: v["value"] for k, v in task["hyperparams"]["nxdt"].items()}
    assert params["model.hidden_size"] == "128" and params["nxdt.run_dir"] == str(run)
    assert params["trainer.max_steps"] == "7"  # ClearML parameters follow the latest launch (MLflow's cannot)
    assert task["name"] == "llama_tiny" and task["project_name"] == "NeMo"  # NeMo's default project; the run name


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning(tmp_path):
    """A real MLflow logger whose file store vanishes after the first step (as a store on a lost mount): the next
    call fails, one warning line says so, later calls are skipped without raising."""
    import shutil

    from lightning.pytorch.loggers import MLFlowLogger

    from nxdt.lightning.trackers import GuardedLogger

    mlflow_client(f"file:{tmp_path}")  # the file store allowed in this process
    lines: list[str] = []
    logger = GuardedLogger(MLFlowLogger("e", tracking_uri=f"file:{tmp_path / 'store'}"), "MLflow", lines.append)
    logger.log_metrics({"loss": 1.0}, step=1)
    assert lines == []
    shutil.rmtree(tmp_path / "store")
    (tmp_path / "store").write_text("not a directory any more")
    for step in (2, 3, 4):
        logger.log_metrics({"loss": 1.0}, step=step)
    logger.finalize("success")
    assert len(lines) == 1 and lines[0].startswith("nxdt: warning: the MLflow tracker failed (log_metrics: "), lines
    assert lines[0].endswith("training continues without it (metrics.csv has every step)")


def test_a_wandb_run_failing_mid_run_is_dropped_with_one_warning(tmp_path, monkeypatch):
    """Issue 36: the W&B path of the same guard, on a real offline WandbLogger whose run ends under it (as when its
    service goes away): W&B raises UsageError on the next log; one warning line, later calls skipped, no exception.
    (ClearML needs no such test of a failure: a report to a closed task is dropped by ClearML itself, silently —
    tried offline: Task.close() then report_scalar raises nothing.)"""
    from lightning.pytorch.loggers import WandbLogger

    from nxdt.lightning.trackers import GuardedLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lines: list[str] = []
    inner = WandbLogger(project="nxdt-test", save_dir=str(tmp_path))
    logger = GuardedLogger(inner, "W&B", lines.append)
    logger.log_metrics({"loss": 1.0}, step=1)
    assert lines == []
    inner.experiment.finish()
    for step in (2, 3, 4):
        logger.log_metrics({"loss": 1.0}, step=step)
    logger.finalize("success")
    assert len(lines) == 1 and lines[0].startswith("nxdt: warning: the W&B tracker failed (log_metrics: UsageError: "), lines
    assert lines[0].endswith("training continues without it (metrics.csv has every step)")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the socket is: nothing listens there


@pytest.mark.parametrize(
    "overrides, env, expected",
    [
        (
            ["exp_manager.create_mlflow_logger=true", "+exp_manager.mlflow_logger_kwargs.tracking_uri=http://127.0.0.1:{port}"],
            {},
            "config error: exp_manager.mlflow_logger_kwargs.tracking_uri='http://127.0.0.1:{port}': cannot be reached (",
        ),
        (
            ["exp_manager.create_wandb_logger=true", "+exp_manager.wandb_logger_kwargs.project=p"],
            {"WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:{port}"},
            "config error: exp_manager.create_wandb_logger=True: the W&B server http://127.0.0.1:{port} cannot be reached (",
        ),
        (
            ["exp_manager.create_wandb_logger=true"],
            {},
            "config error: exp_manager.wandb_logger_kwargs={{}}: W&B needs a name or a project (as in NxD Training)",
        ),
        (
            ["exp_manager.create_clearml_logger=true"],
            {"HOME": "{home}", "CLEARML_CONFIG_FILE": "{home}/none.conf"},
            "config error: exp_manager.create_clearml_logger=True: ClearML has no server configured (no ~/clearml.conf, "
            "CLEARML_CONFIG_FILE or CLEARML_API_HOST): run clearml-init, or CLEARML_OFFLINE_MODE=1",
        ),
        (
            ["exp_manager.create_clearml_logger=true"],
            {"CLEARML_API_HOST": "http://127.0.0.1:{port}"},
            "config error: exp_manager.create_clearml_logger=True: the ClearML server CLEARML_API_HOST=http://127.0.0.1:{port} "
            "cannot be reached (",
        ),
        (
            ["exp_manager.create_clearml_logger=true", "+exp_manager.clearml_logger_kwargs.log_model=true"],
            {"CLEARML_OFFLINE_MODE": "1"},
            "config error: exp_manager.clearml_logger_kwargs.log_model=True: concerns the .nemo output model NeMo uploads",
        ),
        (
            ["exp_manager.create_clearml_logger=true", "+exp_manager.clearml_logger_kwargs.projct=p"],
            {"CLEARML_OFFLINE_MODE": "1"},
            "config error: exp_manager.clearml_logger_kwargs.projct='p': not a ClearML logger argument: use project, task, "
            "tags, connect_pytorch",
        ),
        (
            ["exp_manager.create_dllogger_logger=true"],
            {},
            "config error: exp_manager.create_dllogger_logger=True: not attached by nxdt (NxD Training passes it to NeMo "
            "as false): metrics.csv holds every step's values",
        ),
    ],
    ids=[
        "mlflow-unreachable",
        "wandb-unreachable",
        "wandb-no-project",
        "clearml-no-server",
        "clearml-unreachable",
        "clearml-log-model",
        "clearml-unknown-key",
        "dllogger",
    ],
)
def test_bad_tracker_input_is_one_line_before_launch(tmp_path, capsys, overrides, env, expected):
    """In this process (``nxdt.cli.main``): the checks run before any worker or run directory."""
    from nxdt.cli import main

    port = closed_port()
    os.environ.update({k: v.format(port=port, home=tmp_path) for k, v in env.items()})  # conftest restores os.environ
    out = tmp_path / "outputs"
    code = main(["train", "model=llama_tiny", f"exp_manager.exp_dir={out}", *(o.format(port=port) for o in overrides)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(port=port)), lines
    assert not out.exists()  # nothing written: refused before the run directory


@pytest.mark.parametrize(
    "key, module, install",
    [
        ("create_wandb_logger", "wandb", "pip install 'nxdt[trackers]'"),
        ("create_mlflow_logger", "mlflow", "pip install 'nxdt[trackers]'"),
        ("create_clearml_logger", "clearml", "pip install clearml"),
    ],
)
def test_a_tracker_key_without_its_package_is_refused_by_name(key, module, install):
    """The launcher's check on a host without the package (``is_installed`` answers as such a host would)."""
    from nxdt.config import ConfigError, compose_config
    from nxdt.config.trackers import check_trackers

    overrides = [f"exp_manager.{key}=true", "+exp_manager.wandb_logger_kwargs.project=p"]
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as err:
        check_trackers(cfg, env={"WANDB_MODE": "offline"}, is_installed=lambda name: name != module)
    assert str(err.value).startswith(f"config error: exp_manager.{key}=True: needs the {module} package, not installed: ")
    assert install in str(err.value)


def test_an_nxdt_config_carries_its_tracker_keys(tmp_path):
    """NxD Training's exp_manager block, as its YAML spells it, reaches the same keys (docs/migrating-from-nxdt.md)."""
    from nxdt.config import compose_nxdt_config

    shipped = Path(__file__).parent / "nxdt_configs"
    text = (shipped / "hf_llama3_8B_config.yaml").read_text()
    block = (
        "exp_manager:\n  create_wandb_logger: true\n  wandb_logger_kwargs:\n    project: p1\n    name: r1\n"
        "  create_mlflow_logger: true\n  mlflow_logger_kwargs:\n    experiment_name: e1\n    tracking_uri: file:/tmp/m\n"
        "  create_clearml_logger: true\n  clearml_logger_kwargs:\n    project: p2\n    tags: [a]\n"
    )
    assert text.count("exp_manager:\n") == 1
    (tmp_path / "c.yaml").write_text(text.replace("exp_manager:\n", block))
    (tmp_path / "llama3_8B_config.json").write_text((shipped / "llama3_8B_config.json").read_text())
    cfg, _ = compose_nxdt_config(tmp_path, "c", ["instance=trn1.32xlarge"], check=False)
    em = cfg.exp_manager
    assert em.create_wandb_logger and em.wandb_logger_kwargs == {"project": "p1", "name": "r1"}
    assert em.create_mlflow_logger and em.mlflow_logger_kwargs == {"experiment_name": "e1", "tracking_uri": "file:/tmp/m"}
    assert em.create_clearml_logger and em.clearml_logger_kwargs == {"project": "p2", "tags": ["a"]}
