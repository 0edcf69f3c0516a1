"""``nxdt sweep-report DIR``: one row per job of a multirun (overrides, final loss, tokens/s, step
time) and PNGs of loss and tokens/s against step for every job (drawn by ``nxdt.launch.report.plot_metric``)."""

from __future__ import annotations

from pathlib import Path

from nxdt.launch.runs import Run, load_run, printable


class SweepReportError(ValueError):
    pass


def _jobs(sweep_dir: Path) -> list[Run]:
    """Each job directory (0/, 1/, ...) read as ``nxdt runs`` reads a run (no link followed, regular files,
    size-capped, metrics streamed): its overrides, layout, metrics rows and tokens/s (the one definition,
    :mod:`nxdt.data.throughput`)."""
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()]
    return [load_run(job, sweep_dir) for job in sorted(jobs, key=lambda p: int(p.name))]


def _sweep_keys(jobs: list[Run]) -> set[str]:
    """Overrides that differ between jobs: the swept ones."""
    seen = [set(j.overrides) for j in jobs]
    return set[str]().union(*seen) - seen[0].intersection(*seen[1:]) if seen else set()


def _label(job: Run, swept: set[str]) -> str:
    """A job's legend and table label: its layout (world × instance, degrees above 1, FSDP / ZeRO-1) and its swept
    overrides — what ran, not only what was typed (a sweep of trainer.devices changes the layout too)."""
    shown = " ".join(o for o in job.overrides if o in swept) or " ".join(job.overrides)
    return " ".join(part for part in (job.layout if job.layout != "?" else "", shown) if part) or f"job {job.path.name}"


def report(sweep_dir: Path) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if not sweep_dir.is_dir():
        raise SweepReportError(f"nxdt sweep-report: {sweep_dir} is not a directory — pass outputs/multirun/<name>/<timestamp>")
    jobs = _jobs(sweep_dir)
    if not jobs:
        raise SweepReportError(
            f"nxdt sweep-report: {sweep_dir} holds no job directories (0/, 1/, ...) — pass a multirun directory"
        )
    from nxdt.config.validate import output_path_problem  # the PNGs go into the sweep directory

    problem = output_path_problem(sweep_dir, directory=True)
    if problem is not None:
        raise SweepReportError(f"nxdt sweep-report: {printable(sweep_dir)} {problem}")
    swept = _sweep_keys(jobs)
    table = Table(title=Text(printable(f"sweep {sweep_dir}")))
    for col in ("job", "layout and overrides", "steps", "final loss", "tokens/s", "step time (s, mean)"):
        table.add_column(col)
    for job in jobs:
        if job.rows:
            # the figures nxdt runs and nxdt report show: tokens per second of training steps, start-up left out
            tps, st, loss = job.tokens_per_s, job.step_time_s, job.last_loss
            table.add_row(
                job.path.name,
                Text(_label(job, swept)),
                str(job.last_step),
                "-" if loss is None else f"{loss:.4f}",
                "-" if tps is None else f"{tps:,.0f}",
                "-" if st is None else f"{st:.4f}",
            )
        else:
            table.add_row(job.path.name, Text(_label(job, swept)), "0", "failed", "-", "-")
    Console(width=160).print(table)

    from nxdt.launch.report import plot_metric

    series = [(_label(job, swept), job.rows) for job in jobs if job.rows]
    for key, ylabel, name in (("loss", "loss", "sweep_loss.png"), ("tokens_per_s", "tokens/s", "sweep_tokens_per_s.png")):
        out = plot_metric(series, key, ylabel, sweep_dir / name, sweep_dir.name)
        if out is not None:
            print(f"plot: {out}")
    return 0
