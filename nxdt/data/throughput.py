"""Tokens per second: the one definition every nxdt figure of training throughput uses.

**tokens/s = global tokens trained ÷ wall-clock seconds of the training steps that trained them.** Global: every
data-parallel replica's sequences (the global batch × sequence length, × 2 for preference pairs), not one rank's.
Seconds: the steps' own ``step_time_s`` (from the end of one optimizer step to the end of the next; validation
excluded), not the time since launch.

* one step (a ``metrics.csv`` row, the console's step line): the step's tokens ÷ its step time (:func:`tokens_per_s`);
* a run (the console's summary, ``nxdt runs``, ``nxdt report``, ``nxdt sweep-report``): the tokens of its logged
  steps ÷ the sum of their step times (:func:`run_tokens_per_s`), leaving out the first logged step of each launch
  (start-up: the first batch, first-touch allocations, lazy initialisation; in one 20-step DP1 run of a sweep its
  step took 4.6 s where the median step took 0.33 s). A ratio of sums, not a statistic of per-step rates: the
  mean of rates over-weights fast steps and the median ignores how long the slow ones took, so the two disagreed
  with each other and with the run's real rate (that run: 1,125 tokens/s by sweep-report's old mean of the last
  half's rates, 1,513 by the console's old median, 620 tokens trained per second of its steps after start-up).

Pure Python: ``nxdt runs`` and ``nxdt report`` read run directories without torch.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence


def tokens_per_s(tokens: float, seconds: float) -> float:
    """``tokens`` trained in ``seconds`` of training steps; 0 when no time was measured."""
    return tokens / seconds if seconds > 0 else 0.0


def steady_rows(rows: Sequence[Mapping[str, float]], launch_starts: Iterable[float] = ()) -> list[Mapping[str, float]]:
    """``rows`` (metrics.csv rows, in step order) without the first logged step of each launch: the first row, and
    the first row written after each time in ``launch_starts`` (epoch seconds; a run directory's config history).
    All rows when that would leave none (a run of one logged step per launch)."""
    starts = sorted(launch_starts)
    kept, previous = [], None
    for row in rows:
        at = row.get("wall_time")
        first = previous is None or (
            at is not None and previous.get("wall_time") is not None and any(previous["wall_time"] < t <= at for t in starts)
        )
        if not first:
            kept.append(row)
        previous = row
    return kept or list(rows)


def _timed(rows: Iterable[Mapping[str, float]]) -> list[tuple[float, float]]:
    """(tokens, seconds) of each row that has both figures; a row's tokens are its rate × its step time."""
    return [
        (r["tokens_per_s"] * r["step_time_s"], r["step_time_s"])
        for r in rows
        if r.get("tokens_per_s") is not None and r.get("step_time_s") is not None and r["step_time_s"] > 0
    ]


def run_tokens_per_s(rows: Sequence[Mapping[str, float]], launch_starts: Iterable[float] = ()) -> float | None:
    """The run's tokens/s (module doc); None without a timed step."""
    timed = _timed(steady_rows(rows, launch_starts))
    if not timed:
        return None
    return tokens_per_s(sum(t for t, _ in timed), sum(s for _, s in timed))


def run_step_time_s(rows: Sequence[Mapping[str, float]], launch_starts: Iterable[float] = ()) -> float | None:
    """Mean step time over the same steps as :func:`run_tokens_per_s` (so tokens per step ÷ it is that figure)."""
    timed = _timed(steady_rows(rows, launch_starts))
    return sum(s for _, s in timed) / len(timed) if timed else None
