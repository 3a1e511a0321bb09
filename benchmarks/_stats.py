"""Summaries of latency samples (nearest-rank percentiles; no interpolation)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Summary:
    """Latency samples summarised, in microseconds."""

    n: int
    median_us: float
    p99_us: float
    mean_us: float
    min_us: float
    max_us: float

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            key: round(value, 3) if isinstance(value, float) else value
            for key, value in asdict(self).items()
        }


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of already sorted samples."""
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize_ns(samples_ns: Sequence[int]) -> Summary:
    """Summarise samples given in nanoseconds."""
    ordered = sorted(value / 1000.0 for value in samples_ns)
    return Summary(
        n=len(ordered),
        median_us=statistics.median(ordered),
        p99_us=percentile(ordered, 99.0),
        mean_us=statistics.fmean(ordered),
        min_us=ordered[0],
        max_us=ordered[-1],
    )


def ratio(value: float, reference: float) -> float | None:
    """``value / reference`` rounded to 3 places, or ``None`` if the reference is unusable."""
    if reference <= 0 or math.isnan(reference):
        return None
    return round(value / reference, 3)


def fmt_ratio(value: float | None) -> str:
    """``1.23`` for a ratio, ``—`` when there is none."""
    return "—" if value is None else f"{value:.2f}"


def command_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int]:
    """Per-command call counts between two ``INFO commandstats`` snapshots (non-zero only)."""
    delta: dict[str, int] = {}
    for key, stats in after.items():
        if not key.startswith("cmdstat_") or not isinstance(stats, Mapping):
            continue
        old = before.get(key)
        calls = int(stats.get("calls", 0)) - (
            int(old.get("calls", 0)) if isinstance(old, Mapping) else 0
        )
        if calls:
            delta[key.removeprefix("cmdstat_")] = calls
    return delta
