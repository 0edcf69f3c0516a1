"""The console of ``nxdt train``, piece by piece and without launching workers: the banner, one line per logged step
(MFU only with a known peak), the summary, the routing of third-party lines to the rank's log, the step-counting
progress bar. The launched runs are in tests/test_runs_report.py."""

from __future__ import annotations

import csv
import io
import logging
import re

import pytest
import torch

from nxdt.config import compose_config
from nxdt.launch import console
from nxdt.launch.rundir import write_run_dir
from nxdt.lightning.exp_manager import METRIC_COLUMNS, StepConsole
from nxdt.planner import plan


def test_banner_has_the_run_dir_the_layout_in_one_line_and_the_predicted_step_time(tmp_path):
    cfg = compose_config(
        [
            "trainer.devices=4",
            "distributed_strategy.tensor_model_parallel_size=2",
            "distributed_strategy.fsdp.enabled=true",
            "distributed_strategy.fsdp.prefetch=eager",
        ]
    )
    the_plan = plan(cfg)
    lines = console.banner(tmp_path / "run", the_plan, cfg)
    assert lines[0] == f"nxdt: run directory {tmp_path / 'run'} (4 ranks)"
    assert lines[1] == "nxdt: layout: 4 ranks on cpu · TP2 PP1 DP2 CP1 EP1 · FSDP eager · fp32"
    predicted = re.search(r"plan: ([0-9.]+) s/step", lines[2])
    assert predicted and float(predicted.group(1)) == pytest.approx(the_plan.estimate["step_time_s"], abs=1e-3)
    assert "(cpu: placeholder figures)" in lines[2]  # the cpu instance's peak FLOP/s is a guess
    sized = console.banner(
        tmp_path,
        plan(compose_config(["instance=trn1.32xlarge", "trainer.devices=32"], check=False)),
        compose_config(["instance=trn1.32xlarge"], check=False),
    )
    assert "placeholder" not in sized[2]


def test_step_line_shows_mfu_only_when_the_peak_is_known():
    row = {
        "step": 7,
        "loss": 2.345678,
        "lr": 3e-4,
        "tokens_per_s": 5000.0,
        "peak_rss_mb": 431.2,
        "exposed_comm_s": 0.0123,
        "overlap_pct": 81.0,
    }
    estimate = {"tokens_per_s": 10000.0, "mfu": 0.40}
    known = StepConsole(50, estimate, peak_known=True).line(row)
    assert (
        known
        == "step  7/50  loss 2.3457  lr 3.00e-04  5,000 tokens/s  MFU 20.0%  peak mem 431 MB  exposed comm 12.3 ms (overlap 81%)"
    )
    guessed = StepConsole(50, estimate, peak_known=False).line(
        {k: v for k, v in row.items() if "comm" not in k and k != "overlap_pct"}
    )
    assert guessed == "step  7/50  loss 2.3457  lr 3.00e-04  5,000 tokens/s  peak mem 431 MB"


def test_step_console_reads_the_plan_and_the_instance_peak(tmp_path):
    cfg = compose_config([])
    write_run_dir(tmp_path, cfg, plan(cfg))
    assert StepConsole.for_run(cfg, tmp_path).mfu_per_token_per_s is None  # cpu: placeholder peak
    trn = compose_config(["instance=trn1.32xlarge", "trainer.devices=32"], check=False)
    trn_plan = plan(trn)
    write_run_dir(tmp_path, trn, trn_plan)
    est = trn_plan.estimate
    got = StepConsole.for_run(trn, tmp_path).mfu_per_token_per_s * est["tokens_per_s"]
    assert got == pytest.approx(est["mfu"])  # at the predicted throughput, the measured MFU is the predicted one


def _fake_run(tmp_path, rows, status_kw=None):
    cfg = compose_config([f"exp_manager.explicit_log_dir={tmp_path}", "trainer.max_steps=4"])
    write_run_dir(tmp_path, cfg, plan(cfg))
    with open(tmp_path / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return tmp_path


def test_summary_names_steps_losses_throughput_checkpoint_and_the_next_commands(tmp_path):
    rows = [
        {
            "step": s,
            "loss": 5.0 - s / 3,
            "lr": 1e-3,
            "step_time_s": 0.1,
            "tokens_per_s": 1000.0 * s,
            "peak_rss_mb": 400 + s,
            "wall_time": 1000.0 + s,
        }
        for s in range(1, 5)
    ]
    run = _fake_run(tmp_path, rows)
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "done").write_text("")
    (run / "checkpoints" / "step-4.damaged").mkdir()
    lines = console.summary(run, "interrupted", 999.0, ["trainer.max_steps=4", "exp_manager.resume_if_exists=false"])
    text = "\n".join(lines)
    # tokens/s: steps 2-4 (step 1 is start-up), 900 tokens in 0.3 s (nxdt.data.throughput), not a median of rates
    assert lines[0].startswith("nxdt: interrupted at step 4 of 4 in ") and "(first step logged after 2.0 s)" in lines[0]
    assert "loss 4.6667 → 3.6667" in text and "3,000 tokens/s" in text and "peak memory 404 MB" in text
    assert f"nxdt: newest checkpoint: {run / 'checkpoints' / 'step-2'}" in lines
    assert (
        f"nxdt: resume: nxdt train trainer.max_steps=4 exp_manager.explicit_log_dir={run} exp_manager.resume_if_exists=true"
        in lines
    )  # the original resume_if_exists=false is replaced, not repeated
    assert lines[-1].startswith(f"nxdt: look at it: nxdt report {run}") and "tensorboard --logdir" in lines[-1]


def test_a_finished_runs_continue_command_runs_as_printed_and_the_same_steps_are_refused(tmp_path):
    """Issue 39 newcomer probe: after a finished run the summary printed `resume (with a larger trainer.max_steps):`
    and a command with the same trainer.max_steps; pasted as printed it started both workers (73 s on a loaded host)
    to finish "at step 50 of 50". Now the line names a larger trainer.max_steps, and the same steps are refused before
    any worker starts, naming the step reached and the fix."""
    from nxdt.config import ConfigError
    from nxdt.launch.rundir import check_resume
    from nxdt.lightning import checkpoint as ckpt_io

    rows = [
        {"step": s, "loss": 5.0 - s, "lr": 1e-3, "step_time_s": 0.1, "tokens_per_s": 1e3, "wall_time": 1e3 + s}
        for s in (1, 2, 3, 4)
    ]
    run = _fake_run(tmp_path, rows)
    ckpt_io.save({"state_dict": {"w": torch.ones(2)}, "global_step": 4}, run / "checkpoints" / "step-4", meta={"step": 4})
    lines = console.summary(run, "finished", 999.0, ["trainer.max_steps=4", "data=synthetic"])
    assert (
        f"nxdt: continue it: nxdt train data=synthetic trainer.max_steps=8 exp_manager.explicit_log_dir={run} "
        "exp_manager.resume_if_exists=true"
    ) in lines
    same = compose_config([f"exp_manager.explicit_log_dir={run}", "trainer.max_steps=4", "exp_manager.resume_if_exists=true"])
    with pytest.raises(ConfigError) as refused:
        check_resume(same, run)
    assert str(refused.value) == (
        f"config error: trainer.max_steps=4: the run being resumed ({run}) is at step 4 already (checkpoints/step-4): "
        "nothing is left to train — continue it with a larger trainer.max_steps, e.g. trainer.max_steps=8"
    )
    longer = compose_config([f"exp_manager.explicit_log_dir={run}", "trainer.max_steps=8", "exp_manager.resume_if_exists=true"])
    assert check_resume(longer, run) == []


def test_summary_of_a_run_that_logged_nothing(tmp_path):
    run = _fake_run(tmp_path, [])
    lines = console.summary(run, "failed", 0.0, [])
    assert lines[0].startswith("nxdt: failed after") and "before any step was logged" in lines[0]
    assert any("newest checkpoint: none" in line for line in lines)


def test_third_party_lines_go_to_the_log_and_the_rest_to_the_console(tmp_path, monkeypatch):
    """The routing worker_output installs on Lightning's and py.warnings' loggers, on a logger of its own here."""
    console_stream, log_stream = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", console_stream)
    logger = logging.getLogger("nxdt.test.routing")
    console._route(logger, console.THIRD_PARTY_NOISE, log_stream)
    logger.setLevel(logging.INFO)
    for line in (
        "GPU available: False, used: False",
        "TPU available: False, using: 0 TPU cores",
        "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
        "`Trainer.fit` stopped: `max_steps=5` reached.",
        "Restoring states from the checkpoint path at /x/step-5",
        "data: PackedText, 5348 samples of 128 tokens, data-parallel 2",
    ):
        logger.info(line)
    assert console_stream.getvalue().splitlines() == ["data: PackedText, 5348 samples of 128 tokens, data-parallel 2"]
    assert len(log_stream.getvalue().splitlines()) == 5 and "GPU available" in log_stream.getvalue()
    assert "Restoring states from the checkpoint path at /x/step-5" in log_stream.getvalue()  # nxdt says "resuming from"
    leaf = (
        "/site-packages/lightning/pytorch/utilities/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated, "
        "use `isinstance(treespec, TreeSpec) and treespec.is_leaf()` instead.\n"
    )
    assert console.WARNING_NOISE.search(leaf) and console.WARNING_NOISE.search("x.py:1: FutureWarning: y")
    assert not console.WARNING_NOISE.search("x.py:3: UserWarning: the dataloader has few workers")
    # nxdt's own loaders have no workers on purpose; Lightning's advice about them goes to the log (on a many-core host)
    few = (
        "/site-packages/lightning/pytorch/trainer/connectors/data_connector.py:434: The 'train_dataloader' does not "
        "have many workers which may be a bottleneck. Consider increasing the value of the `num_workers` argument` to "
        "`num_workers=15` in the `DataLoader` to improve performance."
    )
    assert console.WARNING_NOISE.search(few) and console.WARNING_NOISE.search(few.replace("train_", "val_"))
    tf32 = "You are using a CUDA device ('NVIDIA H200') that has Tensor Cores. To properly utilize them, you should set"
    assert console.THIRD_PARTY_NOISE.search(tf32)
    # Lightning's call.py on a resume whose checkpoint callback key changed (exp_manager.checkpoint_every_n_steps 2 → 3,
    # the text as a real resume logged it): nxdt's own callbacks only → the log; a user's callback → the console
    changed = (
        "/site-packages/lightning/pytorch/trainer/call.py:283: Be aware that when using `ckpt_path`, callbacks used to "
        "create the checkpoint need to be provided during `Trainer` instantiation. Please add the following callbacks: "
        "[\"DirectoryCheckpoint{'monitor': 'step', 'mode': 'max', 'every_n_train_steps': 2, 'every_n_epochs': 0, "
        "'train_time_interval': None}\"]."
    )
    assert console.WARNING_NOISE.search(changed) and console.WARNING_NOISE.search(changed.replace("]", ", 'EpochLimit']"))
    assert not console.WARNING_NOISE.search(changed.replace("]", ", 'MyEarlyStopping']"))
    assert not console.WARNING_NOISE.search(changed.replace('"DirectoryCheckpoint', '"MyCheckpoint'))


def test_verbose_and_quiet_workers_keep_their_output_as_it_is(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv(console.MODE_ENV, "verbose")
    assert console.worker_output(tmp_path / "rank0.log", console=True) is sys.stdout  # nothing rerouted
    monkeypatch.setenv(console.MODE_ENV, "quiet")
    assert console.worker_output(tmp_path / "rank0.log", console=False) is sys.stdout  # the whole rank goes to its log
    monkeypatch.setenv(console.MODE_ENV, "nonsense")
    assert console.mode() == "normal"


@pytest.mark.parametrize("argv, message", [(["train", "-q", "-v"], "exclude each other"), (["train", "-x"], "unknown option")])
def test_quiet_and_verbose_flags_are_checked(argv, message, capsys, monkeypatch):
    from nxdt.cli import main

    monkeypatch.delenv(console.MODE_ENV, raising=False)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_progress_bar_counts_steps_to_max_steps_across_epochs():
    """Lightning's bar would show ``Epoch 0/-2`` and restart each epoch; nxdt's counts optimizer steps to max_steps."""
    import lightning.pytorch as pl
    import torch

    from nxdt.lightning.exp_manager import StepProgressBar

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.ones(3, 2)), batch_size=1
            )  # 3 batches an epoch

    bar = StepProgressBar()
    trainer = pl.Trainer(
        max_steps=7,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(Tiny())
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.total, task.completed) == (7, 7) and trainer.current_epoch >= 2  # across three epochs
    assert "steps" in task.description and "Epoch" not in task.description
    assert len(bar.progress.tasks) == 1  # one bar for the run, not one per epoch
