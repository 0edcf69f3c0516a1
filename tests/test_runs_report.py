"""``nxdt runs`` and ``nxdt report``, and the console of real runs.

Units first (status.json and the liveness of its launcher, finding run directories, figures from hand-written
metrics), then three launches shared by every end-to-end assertion (``everyday_runs`` in shared_runs.py, shared with
test_train_e2e.py): the default ``nxdt train`` (finished, 30 steps, checkpoints), a run whose rank 1 raises (failed,
``-q``) and one stopped with SIGINT (interrupted)."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import pytest

from nxdt.config import compose_config
from nxdt.launch.report import report, run_labels
from nxdt.launch.rundir import lock_run_dir, write_run_dir
from nxdt.launch.runs import find_run_dirs, list_runs, load_run, read_status, write_status
from nxdt.lightning.exp_manager import METRIC_COLUMNS
from nxdt.planner import plan
from shared_runs import DEFAULT_EVERY, DEFAULT_STEPS
from test_train_e2e import assert_ok, nxdt

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(path: Path, steps: int, *overrides: str, extra: dict | None = None, max_steps: int = 4) -> Path:
    cfg = compose_config([f"exp_manager.explicit_log_dir={path}", f"trainer.max_steps={max_steps}", *overrides])
    write_run_dir(path, cfg, plan(cfg))
    (path / "overrides.txt").write_text("\n".join(overrides) + "\n")
    columns = METRIC_COLUMNS + tuple(extra or {})
    with open(path / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for s in range(1, steps + 1):
            row = {
                "step": s,
                "loss": 5 - s * 0.5,
                "lr": 1e-3 * s,
                "step_time_s": 0.1,
                "tokens_per_s": 900 + s,
                "peak_rss_mb": 400,
                "wall_time": 1e9 + s,
            }
            row.update({k: f(s) for k, f in (extra or {}).items()})
            writer.writerow(row)
    return path


def assert_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, path
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 500 and pixels.std() > 0.01, (path, pixels.shape)  # drawn, not blank


# ---------------------------------------------------------------- units


def test_status_running_needs_a_live_launcher_holding_the_lock(tmp_path):
    run = make_run(tmp_path / "run", 2)
    lock = lock_run_dir(run)  # this process is the launcher
    write_status(run, "running", command="nxdt train")
    assert load_run(run).status == "running"
    lock.close()  # the launcher's lock is gone (a pid still alive is not enough: pids are reused)
    assert load_run(run).status == "interrupted"
    record = read_status(run)
    record["pid"] = 2**22 + 12345  # a launcher killed with SIGKILL: no such process
    (run / "status.json").write_text(json.dumps(record))
    got = load_run(run)
    assert got.status == "interrupted" and "gone" in got.detail
    write_status(run, "failed", reason="rank 1 failed: boom", exit_code=1)
    got = load_run(run)
    assert (got.status, got.detail) == ("failed", "rank 1 failed: boom")
    assert (
        read_status(run)["started"]
        and read_status(run)["ended"]
        and oct((run / "status.json").stat().st_mode)[-3:] in ("600", "644")
    )


def test_without_status_a_run_is_finished_only_if_it_reached_max_steps(tmp_path):
    assert load_run(make_run(tmp_path / "done", 4)).status == "finished"
    assert load_run(make_run(tmp_path / "partial", 2)).status == "unknown"


def test_run_directories_are_found_at_any_depth_but_not_inside_a_run(tmp_path):
    a = make_run(tmp_path / "llama_tiny" / "2026-01-01_00-00-00", 3)
    b = make_run(tmp_path / "multirun" / "llama_tiny" / "2026-01-02_00-00-00" / "1", 1)
    (a / "checkpoints" / "step-2").mkdir(parents=True)
    (a / "checkpoints" / "step-2" / "done").write_text("")
    (a / "checkpoints" / "step-3").mkdir()  # interrupted save: no done marker
    assert sorted(find_run_dirs(tmp_path)) == sorted([a, b])
    runs = list_runs(tmp_path)
    assert [r.name for r in runs] == ["llama_tiny/2026-01-01_00-00-00", "multirun/llama_tiny/2026-01-02_00-00-00/1"]
    assert runs[0].checkpoint == a / "checkpoints" / "step-2" and runs[0].layout == "2×cpu DP2 ZeRO-1"
    assert runs[0].started == "2026-01-01 00:00"  # from the directory name when there is no status.json


def test_runs_command_lists_and_refuses(tmp_path, capsys):
    from nxdt.cli import main

    make_run(tmp_path / "one", 4)
    assert main(["runs", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["last_step"], r["last_loss"]) for r in listed] == [("one", "finished", 4, 3.0)]
    assert main(["runs", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["runs", str(tmp_path / "empty")]) == 0 and "no run directories" in capsys.readouterr().out


def test_report_overlays_runs_adds_val_loss_and_exposed_comm_when_present(tmp_path):
    one = make_run(tmp_path / "a", 4, "trainer.devices=1")
    two = make_run(
        tmp_path / "b", 3, "trainer.devices=2", extra={"val_loss": lambda s: 4.0 - s * 0.1, "exposed_comm_s": lambda s: 0.01}
    )
    assert run_labels([load_run(one), load_run(two)]) == ["1×cpu trainer.devices=1", "2×cpu DP2 ZeRO-1 trainer.devices=2"]
    text, written, out = report([one, two], tmp_path / "figs")
    assert sorted(p.name for p in written) == ["exposed_comm.png", "loss.png", "lr.png", "tokens_per_s.png", "val_loss.png"]
    for png in written:
        assert_png(png)
    assert "3.0000" in text and "trainer.devices=2" in text and (out / "summary.txt").read_text() == text
    text, written, out = report([one])  # one run: into its own report/ directory, no val_loss figure
    assert out == one / "report" and sorted(p.name for p in written) == ["loss.png", "lr.png", "tokens_per_s.png"]


def test_one_tokens_per_s_in_runs_report_sweep_report_and_the_summary(tmp_path, capsys):
    """A sweep job launched twice (resumed after step 3): every tool shows the run's tokens/s of nxdt.data.throughput,
    tokens trained per second of training steps with each launch's first step (start-up) left out: steps 2, 3, 5, 6,
    4 × 1000 tokens in 0.1 + 0.4 + 0.1 + 0.2 s = 5,000 tokens/s. The statistics the tools used before differ: the
    median rate 3,750 (console, runs, report), the mean rate of the last half 5,222 (sweep-report)."""
    import time

    from nxdt.cli import main
    from nxdt.launch import console

    sweep = tmp_path / "multirun" / "llama_tiny" / "2026-01-01_00-00-00"
    base = time.mktime(time.strptime("2026-01-01_00-00-00", "%Y-%m-%d_%H-%M-%S"))
    times = {1: 2.0, 2: 0.1, 3: 0.4, 4: 1.5, 5: 0.1, 6: 0.2}  # steps 1 and 4 start a launch
    jobs = []
    for n in (0, 1):
        job = make_run(sweep / str(n), 6, f"trainer.devices={n + 1}", max_steps=6)
        for entry, at in (("0-2026-01-01_00-00-00", 0), ("1-2026-01-01_00-01-00", 60)):
            (job / "config-history" / entry).mkdir(parents=True)
        rows = [
            {"step": s, "loss": 5 - s * 0.1, "lr": 1e-3, "step_time_s": t * (n + 1), "tokens_per_s": 1000 / (t * (n + 1)),
             "peak_rss_mb": 400, "wall_time": base + (10 if s <= 3 else 70) + s}
            for s, t in times.items()
        ]  # fmt: skip
        with open(job / "metrics.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=METRIC_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        jobs.append(job)
    want = ["5,000", "2,500"]  # job 1: every step twice as long

    assert main(["runs", str(sweep), "--json"]) == 0
    listed = {Path(r["run"]).name: r["tokens_per_s"] for r in json.loads(capsys.readouterr().out)}
    assert listed == {"0": pytest.approx(5000.0, rel=1e-12), "1": pytest.approx(2500.0, rel=1e-12)}
    assert main(["sweep-report", str(sweep)]) == 0
    table = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if re.match(r"│ +\d ", line)}
    assert all(f" {tps} " in table[str(n)] for n, tps in enumerate(want)), table
    # its labels (table and legends) name the layout as well as the swept override (issue 39)
    assert "1×cpu trainer.devices=1" in table["0"] and "2×cpu DP2 ZeRO-1 trainer.devices=2" in table["1"], table
    text, _, _ = report(jobs, tmp_path / "figs")
    assert [re.search(r"(\d,\d{3})", line).group(1) for line in text.splitlines()[2:4]] == want, text
    summary = "\n".join(console.summary(jobs[0], "finished", base, []))
    assert "· 5,000 tokens/s ·" in summary, summary


def test_report_legends_name_the_layout_and_the_differing_overrides_not_timestamps(tmp_path):
    """Runs compared by ``nxdt report`` are labelled by what ran: layout (degrees, FSDP / ZeRO-1) and the overrides
    that differ; a timestamp only where two runs are otherwise alike."""
    root = tmp_path / "outputs" / "llama_tiny"
    tp = make_run(
        root / "2026-01-01_00-00-00",
        3,
        "trainer.devices=4",
        "distributed_strategy.tensor_model_parallel_size=2",
        "distributed_strategy.fsdp.enabled=true",
    )
    zero1 = make_run(root / "2026-01-01_00-10-00", 3, "trainer.devices=4", "distributed_strategy.zero1=true")
    again = make_run(root / "2026-01-01_00-20-00", 3, "trainer.devices=4", "distributed_strategy.zero1=true")
    assert run_labels([load_run(tp), load_run(zero1)]) == [
        "4×cpu TP2 DP2 FSDP distributed_strategy.tensor_model_parallel_size=2 distributed_strategy.fsdp.enabled=true",
        "4×cpu DP4 ZeRO-1 distributed_strategy.zero1=true",
    ]
    assert run_labels([load_run(p) for p in (tp, zero1, again)]) == [
        "4×cpu TP2 DP2 FSDP distributed_strategy.tensor_model_parallel_size=2 distributed_strategy.fsdp.enabled=true "
        "(2026-01-01_00-00-00)",
        "4×cpu DP4 ZeRO-1 distributed_strategy.zero1=true (2026-01-01_00-10-00)",
        "4×cpu DP4 ZeRO-1 distributed_strategy.zero1=true (2026-01-01_00-20-00)",
    ]
    text, _, _ = report([tp, zero1], tmp_path / "figs")  # the figures' legends and summary.txt use these labels
    assert "2026-01-01" not in text.split("\n\n")[0] and "4×cpu DP4 ZeRO-1 distributed_strategy.zero1=true  " in text


def test_report_refuses_what_is_not_a_run(tmp_path, capsys):
    from nxdt.cli import main

    assert main(["report", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["report"]) == 2 and "usage: nxdt report" in capsys.readouterr().err


# ---------------------------------------------------------------- crafted run directories
# Anyone who can write under a shared exp_dir can craft a run directory; `nxdt runs` / `nxdt report` (perhaps run
# by another user, or root) must neither write outside it, hang, fill memory, raise, nor pass escapes to a terminal.


def test_report_never_writes_through_a_link_planted_in_the_run(tmp_path, capsys):
    from nxdt.cli import main

    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious\n")
    linked_dir = make_run(tmp_path / "linked_dir", 3)
    (linked_dir / "report").symlink_to(outside, target_is_directory=True)
    assert main(["report", str(linked_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a symbolic link" in err[0] and "Traceback" not in err[0]
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]  # no figure, no summary written there

    linked_file = make_run(tmp_path / "linked_file", 3)
    (linked_file / "report").mkdir()
    (linked_file / "report" / "summary.txt").symlink_to(victim)
    (linked_file / "report" / "loss.png").symlink_to(outside / "loss.png")  # a dangling link: would create a file there
    hard = make_run(tmp_path / "hard", 3)
    (hard / "report").mkdir()
    os.link(victim, hard / "report" / "summary.txt")  # a hard link: writing in place would change the victim
    for run in (linked_file, hard):
        text, written, out = report([run])
        assert (out / "summary.txt").read_text() == text and not (out / "summary.txt").is_symlink()
        assert not (out / "loss.png").is_symlink()
    assert victim.read_text() == "precious\n" and sorted(p.name for p in outside.iterdir()) == ["victim.txt"]


def test_crafted_run_files_are_listed_without_traceback_hang_or_escapes(tmp_path, capsys):
    from nxdt.cli import main

    make_run(tmp_path / "good", 4)
    binary = make_run(tmp_path / "binary", 2)
    (binary / "metrics.csv").write_bytes(b"step,loss\n1,2\n" + bytes(range(256)) * 64)  # NULs: csv.Error before
    huge_pid = make_run(tmp_path / "huge_pid", 2)
    (huge_pid / "status.json").write_text(json.dumps({"status": "running", "pid": 2**80}))  # OverflowError before
    fifo = make_run(tmp_path / "fifo", 2)
    (fifo / "metrics.csv").unlink()
    os.mkfifo(fifo / "metrics.csv")  # opening it to read blocked forever before
    escapes = make_run(tmp_path / "escapes", 2)
    (escapes / "status.json").write_text(
        json.dumps({"status": "failed", "reason": "\x1b]0;owned\x07\x1b[2J[bold red]boom[/]\r\nfake line", "started": "\x1b[31m"})
    )
    broken = make_run(tmp_path / "broken", 2)
    (broken / "plan.json").write_text(json.dumps({"degrees": {"tp": "two"}, "world_size": 2}))  # '>' on a str

    assert main(["runs", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    for name in ("good", "binary", "huge_pid", "fifo", "escapes"):
        assert name in out, out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "Traceback" not in out + err
    assert "[bold red]boom[/]" in out  # shown as text, not taken as markup
    assert "skipped" in err and "broken" in err and "broken" not in out and len(err.strip().splitlines()) == 1

    runs = {r.name: r for r in list_runs(tmp_path)}
    assert runs["good"].status == "finished" and runs["good"].last_step == 4
    assert runs["binary"].last_step == 1  # the one parseable row
    assert runs["huge_pid"].status == "interrupted" and runs["fifo"].rows == []
    assert runs["escapes"].detail.startswith("?") and "\x1b" not in runs["escapes"].detail

    # the same crafted runs through nxdt report: one line or a report, never a traceback or a hang
    assert main(["report", str(fifo)]) == 2 and "no metrics yet" in capsys.readouterr().err
    assert main(["report", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be read as a run" in err[0]
    assert main(["report", str(binary), str(escapes), "-o", str(tmp_path / "figs")]) == 0
    assert "\x1b" not in capsys.readouterr().out


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdefg", "bcdefgh")
)  # 10**8 list items once expanded; OmegaConf copies every alias out (PyYAML shares them): it ran for minutes


def test_a_crafted_run_config_or_metrics_is_one_line_for_plan_against_and_report(tmp_path, capsys):
    """Issue 38 probes: ``nxdt plan --against`` read config.yaml with OmegaConf.load (a binary file or a Python tag:
    a traceback; a YAML alias bomb: minutes at 100% CPU and climbing memory; a link: followed), and ``nxdt report``
    drew NaN/huge losses (matplotlib's traceback). Each is now one line; report draws what it can."""
    from nxdt.cli import main

    crafted = {
        "binary": (b"\xde\xad\xbe\xef" * 100, "config.yaml: not UTF-8 text"),
        "tag": (b'name: !!python/object/apply:os.system ["true"]\n', "could not determine a constructor for the tag"),
        "bomb": (BILLION_LAUGHS.encode(), "expands to more than 100,000 YAML nodes (aliases)"),
        "scalar": (b"5\n", "holds a single value or a list, not a mapping of config keys"),
    }
    run = make_run(tmp_path / "crafted", 3)
    for name, (content, says) in crafted.items():
        (run / "config.yaml").write_bytes(content)
        assert main(["plan", "--against", str(run)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and str(run / "config.yaml") in err[0], (name, err)
    (run / "config.yaml").unlink()
    (run / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    (tmp_path / "elsewhere.yaml").write_text("name: elsewhere\n")
    assert main(["plan", "--against", str(run)]) == 2
    assert "config.yaml: a symbolic link" in capsys.readouterr().err

    diverged = run  # the header; then a NaN loss and one near float's limit
    (run / "config.yaml").unlink()
    (tmp_path / "elsewhere.yaml").rename(run / "config.yaml")
    with open(diverged / "metrics.csv", "w") as fh:
        fh.write(",".join(METRIC_COLUMNS) + "\n")
        fh.write("1,nan,0.001,0.1,900,400,1000000001\n2,1e308,0.002,0.1,900,400,1000000002\n")
    assert main(["report", str(diverged), "-o", str(tmp_path / "figs")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    # NaN is left off the axis; with 1e308 alone matplotlib cannot place ticks (its ValueError): named, not raised
    assert err == ["nxdt report: loss.png not drawn: loss holds values matplotlib cannot draw (arange: cannot compute length)"]
    assert_png(tmp_path / "figs" / "lr.png")


def test_run_files_are_read_only_when_small_regular_and_not_links(tmp_path):
    from nxdt.launch.runs import RunFileError, read_run_file

    (tmp_path / "big").write_bytes(b"x" * 101)
    (tmp_path / "ok").write_bytes(b"x" * 100)
    (tmp_path / "link").symlink_to(tmp_path / "ok")
    assert read_run_file(tmp_path / "ok", limit=100) == b"x" * 100
    with pytest.raises(RunFileError, match="more than the 100"):
        read_run_file(tmp_path / "big", limit=100)
    with pytest.raises(OSError):  # ELOOP: O_NOFOLLOW
        read_run_file(tmp_path / "link")
    with pytest.raises(RunFileError, match="not a regular file"):
        read_run_file(Path("/dev/zero"))


# ---------------------------------------------------------------- three real runs


@pytest.fixture
def launched(everyday_runs):
    return everyday_runs


def _rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_console_is_nxdts_own_banner_steps_and_summary(launched):
    result, run = launched["default"], launched["runs"]["llama_tiny"]
    assert_ok(result)
    console = result.stdout + result.stderr
    for noise in ("GPU available", "TPU available", "Tip", "deprecated", "litlogger", "Epoch", "Trainer.fit"):
        assert noise not in console, (noise, console)
    assert not re.search(r"t=\d{9,}|\b1\d{9}\.\d+", console), console  # no raw epoch timestamps
    lines = console.splitlines()
    # the first line is printed once the config is composed, before the data and model checks (test_first_output.py)
    assert lines[0] == "nxdt: llama_tiny (nxdt's config) · 2 ranks on cpu, TP1 PP1 DP2 · checking the data and the model…"
    lines = lines[1:]
    assert lines[0] == f"nxdt: run directory {run} (2 ranks)"
    assert lines[1] == "nxdt: layout: 2 ranks on cpu · TP1 PP1 DP2 CP1 EP1 · FSDP off · ZeRO-1 · fp32"
    assert re.match(rf"nxdt: llama_tiny: {DEFAULT_STEPS} steps × 8 sequences of 128 tokens .* plan: [0-9.]+ s/step", lines[2]), (
        lines[2]
    )
    # while the workers import torch and Lightning: a status line, then rank 0's when they are set up
    assert lines[3] == "nxdt: starting 2 workers…"
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    ready = [line for line in lines[4:first_step] if line.startswith("nxdt: 2 workers ready")]
    assert len(ready) == 1 and re.fullmatch(r"nxdt: 2 workers ready [0-9.]+ s after Enter; training", ready[0]), ready
    steps = [line for line in lines if line.startswith("step ")]
    rows = _rows(run)
    # step numbers right-aligned to the width of max_steps ("step  9/30", "step 10/30")
    assert [int(re.match(rf"step +(\d+)/{DEFAULT_STEPS}  loss ", line).group(1)) for line in steps] == list(
        range(1, DEFAULT_STEPS + 1)
    )
    assert all(f"loss {float(r['loss']):.4f}" in line for r, line in zip(rows, steps))
    last, first = float(rows[-1]["loss"]), float(rows[0]["loss"])
    assert f"nxdt: finished at step {DEFAULT_STEPS} of {DEFAULT_STEPS} in " in console
    assert f"nxdt: loss {first:.4f} → {last:.4f} · " in console  # the final loss is metrics.csv's last row
    assert f"nxdt: look at it: nxdt report {run}" in console
    # the newest checkpoint (the last step's, exp_manager.save_last), how to export it and how to continue the run
    final = run / "checkpoints" / f"step-{DEFAULT_STEPS}"
    assert f"nxdt: checkpoint checkpoints/step-{DEFAULT_STEPS} saved" in lines
    assert f"nxdt: newest checkpoint: {final}" in lines
    assert f"nxdt: export it: nxdt checkpoint export-hf {final} llama_tiny-hf" in lines
    assert (
        f"nxdt: continue it: nxdt train exp_manager.checkpoint_every_n_steps={DEFAULT_EVERY} "
        f"trainer.max_steps={2 * DEFAULT_STEPS} exp_manager.explicit_log_dir={run} exp_manager.resume_if_exists=true"
    ) in lines  # runnable as printed: the same trainer.max_steps would have nothing left to train (refused)
    # the per-rank log keeps what the console leaves out (Lightning's own lines; its import-time deprecation warning
    # too when the worker imported Lightning itself, which a worker of tests/warm_cli.py did not)
    log = (run / "logs" / "rank0.log").read_text()
    assert "GPU available" in log and re.search(r"rank 0 attempt 0 started \S+ \S+ \(pid \d+", log)
    # command → first step is a performance figure (measured in the closing note, not asserted: shared machine)
    assert json.loads((run / "status.json").read_text())["status"] == "finished"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensorboard_receives_every_metrics_column(launched):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = launched["runs"]["llama_tiny"]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    filled = {k for row in _rows(run) for k, v in row.items() if v != ""} - {"step"}
    assert filled <= set(events.Tags()["scalars"]), (filled, events.Tags()["scalars"])
    assert len(events.Scalars("loss")) == DEFAULT_STEPS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quiet_failure_and_interruption(launched):
    failing, stopped = launched["failing"], launched["stopped"]
    assert failing.returncode == 1 and "rank 1 failed: InjectedFault" in failing.stderr
    assert all(line.startswith("nxdt:") for line in failing.stdout.splitlines()), failing.stdout  # -q: banner + summary only
    assert "nxdt: failed at step" in failing.stdout and not re.search(r"^step ", failing.stdout, re.M)
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr
    run = launched["runs"]["stopped"]
    assert "death signal" not in stopped.stderr  # torch's agent notes go to the launcher's log
    assert "death signal" in (run / "logs" / "launcher.log").read_text()
    assert "nxdt: interrupted at step" in stopped.stdout and "nxdt: checkpoint checkpoints/step-2 saved" in stopped.stdout
    assert (
        f"nxdt: resume: nxdt train name=stopped data=synthetic trainer.max_steps=100000 exp_manager.checkpoint_every_n_steps=2 "
        f"exp_manager.keep_last_k=1 exp_manager.explicit_log_dir={run} exp_manager.resume_if_exists=true"
    ) in stopped.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_runs_lists_finished_failed_and_interrupted(launched):
    root = launched["root"]
    listed = nxdt("runs", "--json", cwd=root)  # default DIR: outputs/
    assert_ok(listed)
    got = {Path(r["run"]).parent.name: r for r in json.loads(listed.stdout)}
    assert {name: r["status"] for name, r in got.items()} == {
        "llama_tiny": "finished",
        "failing": "failed",
        "stopped": "interrupted",
    }
    assert got["llama_tiny"]["last_step"] == DEFAULT_STEPS and got["llama_tiny"]["layout"] == "2×cpu DP2 ZeRO-1"
    assert got["llama_tiny"]["last_loss"] == pytest.approx(float(_rows(launched["runs"]["llama_tiny"])[-1]["loss"]))
    assert got["stopped"]["checkpoint"] and Path(got["stopped"]["checkpoint"]).name.startswith("step-")
    table = nxdt("runs", cwd=root)
    assert_ok(table)
    for word in ("finished", "failed", "interrupted", "llama_tiny/", "failing/", "stopped/", "2×cpu DP2"):
        assert word in table.stdout, table.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_report_draws_the_real_runs(launched):
    runs = launched["runs"]
    result = nxdt(
        "report", str(runs["llama_tiny"]), str(runs["stopped"]), "-o", str(launched["root"] / "cmp"), cwd=launched["root"]
    )
    assert_ok(result)
    pngs = sorted((launched["root"] / "cmp").glob("*.png"))
    assert [p.name for p in pngs] == ["loss.png", "lr.png", "tokens_per_s.png"]
    for png in pngs:
        assert_png(png)
    assert "finished" in result.stdout and "interrupted" in result.stdout


def test_metrics_csv_is_streamed_into_a_bounded_number_of_rows(tmp_path):
    """Issue 38 probe: a 1M-row metrics.csv was read whole (~1 GB and 30 s in `nxdt runs`, measured 759 MB). It is
    streamed now and at most ``keep`` rows are kept, thinned evenly within each kind of row (the sparse validation
    rows among themselves, so they stay), the first row and the last complete one always there (a torn last line
    skipped), in step order."""
    from nxdt.launch.runs import read_metrics

    run = tmp_path / "run"
    run.mkdir()
    lines = ["step,loss,val_loss"] + [f"{s},{s / 10},{s if s % 100 == 0 else ''}" for s in range(1, 10_001)]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n10001,x")
    rows = read_metrics(run, keep=500)
    steps = [int(r["step"]) for r in rows]
    assert len(rows) <= 501 and steps[0] == 1 and steps[-1] == 10_000 and steps == sorted(steps)
    assert rows[-1] == {"step": 10_000.0, "loss": 1000.0, "val_loss": 10_000.0}
    train = [s for s, r in zip(steps, rows) if "val_loss" not in r]
    gaps = {b - a for a, b in zip(train, train[1:])}
    assert gaps <= {32, 33}, gaps  # every 32nd training row (33 across a validation row, a kind of its own)
    assert sum("val_loss" in r for r in rows) >= 3  # validation rows thinned among themselves, not lost
    assert len(read_metrics(run)) == 10_000  # below METRICS_ROWS_KEPT: every row, as before
