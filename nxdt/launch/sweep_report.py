"""``nxdt sweep-report DIR``: one row per job of a multirun (overrides, final loss, tokens/s, step
time) and PNGs of loss and tokens/s against step for every job (drawn by ``nxdt.launch.report.plot_metric``)."""

from __future__ import annotations

from pathlib import Path

from nxdt.data.throughput import run_step_time_s, run_tokens_per_s
from nxdt.launch.runs import launch_starts, printable, read_metrics, read_run_text


class SweepReportError(ValueError):
    pass


def _job_rows(sweep_dir: Path) -> list[dict]:
    rows = []
    for job in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        try:  # read as nxdt runs reads a run: no link followed, regular files, size-capped
            overrides = [printable(o, 200) for o in read_run_text(job / "overrides.txt", 1 << 20).split()]
        except OSError:
            overrides = []
        rows.append({"job": job.name, "overrides": overrides, "steps": read_metrics(job), "launches": launch_starts(job)})
    return rows


def _sweep_keys(rows: list[dict]) -> set[str]:
    """Overrides that differ between jobs: the swept ones."""
    seen = [set(r["overrides"]) for r in rows]
    return set.union(*seen) - set.intersection(*seen) if seen else set()


def report(sweep_dir: Path) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if not sweep_dir.is_dir():
        raise SweepReportError(f"nxdt sweep-report: {sweep_dir} is not a directory — pass outputs/multirun/<name>/<timestamp>")
    rows = _job_rows(sweep_dir)
    if not rows:
        raise SweepReportError(
            f"nxdt sweep-report: {sweep_dir} holds no job directories (0/, 1/, ...) — pass a multirun directory"
        )
    swept = _sweep_keys(rows)
    table = Table(title=Text(printable(f"sweep {sweep_dir}")))
    for col in ("job", "overrides", "steps", "final loss", "tokens/s", "step time (s, mean)"):
        table.add_column(col)
    for r in rows:
        shown = " ".join(o for o in r["overrides"] if o in swept) or " ".join(r["overrides"])
        if r["steps"]:
            # the figures nxdt runs and nxdt report show: tokens per second of training steps, start-up left out
            tps, st = run_tokens_per_s(r["steps"], r["launches"]), run_step_time_s(r["steps"], r["launches"])
            loss = r["steps"][-1].get("loss")
            table.add_row(
                r["job"],
                Text(shown),
                str(len(r["steps"])),
                "-" if loss is None else f"{loss:.4f}",
                "-" if tps is None else f"{tps:,.0f}",
                "-" if st is None else f"{st:.4f}",
            )
        else:
            table.add_row(r["job"], Text(shown), "0", "failed", "-", "-")
    Console(width=160).print(table)

    from nxdt.launch.report import plot_metric

    series = [(" ".join(o for o in r["overrides"] if o in swept) or f"job {r['job']}", r["steps"]) for r in rows if r["steps"]]
    for key, ylabel, name in (("loss", "loss", "sweep_loss.png"), ("tokens_per_s", "tokens/s", "sweep_tokens_per_s.png")):
        out = plot_metric(series, key, ylabel, sweep_dir / name, sweep_dir.name)
        if out is not None:
            print(f"plot: {out}")
    return 0
