"""``nxdt report RUN [RUN ...]``: loss, learning rate, tokens/s and (when a run has them) validation loss and
exposed communication against step, one PNG per figure with every run given overlaid, and a text summary.
``nxdt sweep-report`` draws its figures with the same code (:func:`plot_metric`)."""

from __future__ import annotations

import io
import math
import os
import sys
from pathlib import Path

from nxdt.launch.runs import (
    Run,
    RunFileError,
    _fmt,
    is_run_dir,
    load_run,
    median,
    open_out_dir,
    printable,
    steps_text,
    write_into,
)

# (metrics.csv column, axis label, file name); the last two only when some run has the column
FIGURES = (
    ("loss", "training loss", "loss"),
    ("lr", "learning rate", "lr"),
    ("tokens_per_s", "tokens/s", "tokens_per_s"),
    ("val_loss", "validation loss", "val_loss"),
    ("exposed_comm_s", "exposed communication per step (s)", "exposed_comm"),
)
ALWAYS = {"loss", "lr", "tokens_per_s"}


class ReportError(ValueError):
    pass


def plot_metric(
    series: list[tuple[str, list[dict[str, float]]]], key: str, ylabel: str, path: Path, title: str, dir_fd: int | None = None
) -> Path | None:
    """One PNG: ``key`` against step for every (label, metrics rows) given; None when no run has ``key``. Written
    through :func:`nxdt.launch.runs.write_into` (never through a link), into ``dir_fd`` when given (the directory
    ``path`` is in, opened once by the caller)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    # a NaN/inf loss (a run that diverged, a crafted metrics.csv) has no place on an axis: only finite points
    drawn = [
        (label, [(r["step"], r[key]) for r in rows if key in r and "step" in r and math.isfinite(r[key])])
        for label, rows in series
    ]
    drawn = [(label, points) for label, points in drawn if points]
    if not drawn:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    try:
        for label, points in drawn:
            steps, values = zip(*points)
            ax.plot(steps, values, label=label, marker="o" if len(points) <= 20 else None, markersize=3, linewidth=1.4)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if len(drawn) > 1 or drawn[0][0]:
            ax.legend(fontsize="small")
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
    except (ValueError, OverflowError) as exc:  # values near float's limits: matplotlib cannot place the ticks
        print(f"nxdt report: {path.name} not drawn: {key} holds values matplotlib cannot draw ({exc})", file=sys.stderr)
        return None
    finally:
        plt.close(fig)
    own_fd = dir_fd is None
    fd = open_out_dir(path.parent) if dir_fd is None else dir_fd
    try:
        write_into(fd, path.name, png.getvalue())
    finally:
        if own_fd:
            os.close(fd)
    return path


def run_labels(runs: list[Run]) -> list[str]:
    """Legend labels telling the runs apart by what was run: each run's layout (world × instance, the degrees above 1,
    FSDP / ZeRO-1) and the overrides that differ between the runs; where that still leaves two runs alike (the same
    command twice), the shortest distinct tail of their paths is added. One run: its name."""
    return [printable(label, 300) for label in _labels(runs)]


def _labels(runs: list[Run]) -> list[str]:
    if len(runs) == 1:
        return [runs[0].name]
    seen = [set(r.overrides) for r in runs]
    differing = set().union(*seen) - seen[0].intersection(*seen[1:])
    labels = [" ".join([r.layout, *(o for o in r.overrides if o in differing)]) for r in runs]
    if len(set(labels)) == len(labels):
        return labels
    parts = [r.path.parts for r in runs]
    for n in range(1, max(len(p) for p in parts) + 1):
        tails = ["/".join(p[-n:]) for p in parts]
        if len(set(tails)) == len(tails):
            break
    return [f"{label} ({tail})" for label, tail in zip(labels, tails)]


def summary_rows(runs: list[Run], labels: list[str]) -> list[list[str]]:
    out = []
    for r, label in zip(runs, labels):
        steps = steps_text(r)
        loss = (
            f"{r.first_loss:.4f} → {r.last_loss:.4f}" if r.rows and r.first_loss is not None and r.last_loss is not None else "-"
        )
        best = min((x["loss"] for x in r.rows if "loss" in x), default=None)
        val = [x["val_loss"] for x in r.rows if "val_loss" in x]
        exposed = median(r.rows, "exposed_comm_s")
        out.append(
            [
                label,
                r.status,
                r.layout,
                steps,
                loss,
                _fmt(best, ".4f"),
                f"{val[-1]:.4f}" if val else "-",
                _fmt(r.tokens_per_s, ",.0f"),
                _fmt(r.step_time_s, ".3f"),
                _fmt(max((x["peak_rss_mb"] for x in r.rows if "peak_rss_mb" in x), default=None), ",.0f"),
                _fmt(exposed, ".4f"),
                printable(r.checkpoint.name) if r.checkpoint else "-",
            ]
        )
    return out


SUMMARY_COLUMNS = (
    "run",
    "status",
    "layout",
    "steps",
    "loss first → last",
    "best loss",
    "val loss",
    "tokens/s",
    "step s (mean)",
    "peak MB",
    "exposed comm s",
    "checkpoint",
)


def text_summary(runs: list[Run], labels: list[str]) -> str:
    """A plain-text table (also written to summary.txt)."""
    rows = [list(SUMMARY_COLUMNS)] + summary_rows(runs, labels)
    keep = [i for i in range(len(SUMMARY_COLUMNS)) if i < 2 or any(row[i] != "-" for row in rows[1:])]
    rows = [[row[i] for i in keep] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(keep))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [""] + [f"{label}: {printable(r.path)}" for r, label in zip(runs, labels)]
    return "\n".join(lines) + "\n"


def default_out_dir(runs: list[Run]) -> Path:
    return runs[0].path / "report" if len(runs) == 1 else Path("nxdt-report")


def report(paths: list[Path], out_dir: Path | None = None) -> tuple[str, list[Path], Path]:
    """Figures and the text summary of the runs at ``paths``; returns (summary text, PNGs written, directory)."""
    runs = []
    for p in paths:
        if not Path(p).is_dir():
            raise ReportError(
                f"nxdt report: {printable(p)} is not a directory — pass run directories (outputs/<name>/<timestamp>; `nxdt runs` lists them)"
            )
        if not is_run_dir(Path(p)):
            raise ReportError(
                f"nxdt report: {printable(p)} is not a run directory (no config.yaml and plan.json) — `nxdt runs {printable(p)}` "
                "lists the runs below it"
            )
        try:
            run = load_run(Path(p).resolve())
            run.as_dict()  # every derived field the summary shows
            runs.append(run)
        except Exception as exc:  # noqa: BLE001 - whatever a crafted run directory holds: one line, not a traceback
            raise ReportError(f"nxdt report: {printable(p)} cannot be read as a run ({printable(exc, 200)})") from None
    if not any(r.rows for r in runs):
        raise ReportError(
            f"nxdt report: no metrics yet in {', '.join(str(r.path / 'metrics.csv') for r in runs)} — "
            "a run writes a row every trainer.log_every_n_steps steps"
        )
    labels = run_labels(runs)
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(runs)
    title = runs[0].name if len(runs) == 1 else f"{len(runs)} runs"
    series = list(zip(labels if len(runs) > 1 else [""], [r.rows for r in runs]))
    from nxdt.config.validate import output_path_problem  # here: `nxdt runs` imports this module, not Hydra

    problem = output_path_problem(out_dir, directory=True)  # a system directory, a link: as eval/generate --out
    if problem is not None:
        raise ReportError(f"nxdt report: cannot write the report into {printable(out_dir)}: it {problem} — pass -o DIR")
    try:  # a crafted run's report/ (a link out of the run) is refused; its files are replaced, never written through
        dir_fd = open_out_dir(out_dir)
    except (RunFileError, OSError) as exc:
        raise ReportError(
            f"nxdt report: cannot write the report into {printable(out_dir)}: {printable(exc)} — pass -o DIR"
        ) from None
    written = []
    try:
        for key, ylabel, stem in FIGURES:
            if key not in ALWAYS and not any(key in row for r in runs for row in r.rows):
                continue
            png = plot_metric(series, key, ylabel, out_dir / f"{stem}.png", f"{ylabel} — {title}", dir_fd=dir_fd)
            if png is not None:
                written.append(png)
        text = text_summary(runs, labels)
        write_into(dir_fd, "summary.txt", text.encode())
    except OSError as exc:
        raise ReportError(f"nxdt report: cannot write the report into {printable(out_dir)}: {printable(exc)}") from None
    finally:
        os.close(dir_fd)
    return text, written, out_dir


def cmd_report(argv: list[str]) -> int:
    import sys

    out_dir = None
    args = list(argv)
    for flag in ("-o", "--out"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                print(f"nxdt report: {flag} needs a directory", file=sys.stderr)
                return 2
            out_dir = Path(args[i + 1])
            del args[i : i + 2]
    if not args or any(a.startswith("-") for a in args):
        print(
            "usage: nxdt report RUN [RUN ...] [-o DIR]   (RUN: a run directory; figures go to RUN/report/ for one run, "
            "./nxdt-report/ for several, or DIR)",
            file=sys.stderr,
        )
        return 2
    try:
        text, written, out_dir = report([Path(a) for a in args], out_dir)
    except ReportError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(text, end="")
    print()
    for png in written:
        print(f"figure: {printable(png)}")
    print(f"summary: {printable(out_dir / 'summary.txt')}")
    return 0
