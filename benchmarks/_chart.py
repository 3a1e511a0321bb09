"""``results.png``: handoff latency (B2, x the one-hop floor), commands per handoff (B3), the
topologies side by side — handoff on a cluster (B7, x the floor on that cluster) and ``RedLock``
acquire on 5 masters (B6, x ``RedLock`` on one) — and the lock family's throughput side by side
in the last row: ``ReadWriteLock`` reads with and without a writer (B9) and ``Semaphore(N)``
acquisitions/s against N (B10).

matplotlib is optional (the ``bench`` and ``dev`` extras install it): without it no chart is
written and :func:`write_chart` says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

OURS = "redis-locks-async"
_OURS_COLOR = "#1f6fb4"
_PEER_COLOR = "#9a9a9a"
_REFERENCE_COLOR = "#4caf50"
_REFERENCES = frozenset({"floor", "pubsub-hop"})


def _color(key: str) -> str:
    if key == OURS or key.startswith(OURS + "/"):
        return _OURS_COLOR
    return _REFERENCE_COLOR if key in _REFERENCES else _PEER_COLOR


def _ratio_bars(result: Mapping[str, Any]) -> list[tuple[str, str, float, float]]:
    """(key, label, median ratio, p99 ratio) of every row with both ratios (B2, B6, B7)."""
    bars = []
    for row in result.get("rows", []):
        median, p99 = row.get("ratio_median"), row.get("ratio_p99")
        if isinstance(median, (int, float)) and isinstance(p99, (int, float)):
            bars.append((row["key"], row["label"], float(median), float(p99)))
    return bars


def _command_bars(b3: Mapping[str, Any]) -> list[tuple[str, str, float, float]]:
    """(key, label with waiters, client commands/handoff, server commands/handoff)."""
    bars = []
    for row in b3.get("rows", []):
        client = row.get("client_commands_per_handoff")
        server = row.get("server_commands_per_handoff")
        if isinstance(client, (int, float)) and isinstance(server, (int, float)):
            label = f"{row['label']}\n{row['waiters']:,} waiters / {row['processes']} processes"
            bars.append((row["key"], label, float(client), float(server)))
    return bars


def _read_bars(b9: Mapping[str, Any]) -> list[tuple[str, float, float]]:
    """(label, reads/s, writes/s) of every B9 phase measured."""
    bars = []
    for row in b9.get("rows", []):
        if isinstance(row.get("reads_per_s"), (int, float)):
            bars.append((row["label"], float(row["reads_per_s"]), float(row["writes_per_s"])))
    return bars


def _permit_points(b10: Mapping[str, Any]) -> list[tuple[int, float, float, int]]:
    """(N, acquisitions/s, ceiling/s, peak concurrency) of every B10 row measured."""
    points = []
    for row in b10.get("rows", []):
        if isinstance(row.get("per_s"), (int, float)):
            points.append(
                (
                    int(row["permits"]),
                    float(row["per_s"]),
                    float(row["ceiling_per_s"]),
                    int(row["peak_concurrency"]),
                )
            )
    return points


def _draw_reads(ax: Any, reads: list[tuple[str, float, float]]) -> None:
    positions = list(range(len(reads)))
    values = [value for _, value, _ in reads]
    ax.bar(positions, values, color=_OURS_COLOR, width=0.55)
    base = values[0] if values and values[0] > 0 else None
    for p, (_, value, writes) in zip(positions, reads, strict=True):
        text = f"{value:,.0f}/s"
        if base is not None:
            text += f"\n{value / base:.2f}x"
        if writes:
            text += f"\n+ {writes:,.1f} writes/s"
        ax.text(p, value, text, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(positions, [label for label, _, _ in reads], fontsize=8)
    ax.set_ylim(top=max(values) * 1.45)
    ax.set_ylabel("reads/s", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title("B9 — ReadWriteLock reads/s, alone and with one writer", fontsize=10)


def _draw_permits(ax: Any, points: list[tuple[int, float, float, int]]) -> None:
    permits = [n for n, _, _, _ in points]
    rates = [rate for _, rate, _, _ in points]
    ceilings = [ceiling for _, _, ceiling, _ in points]
    ax.plot(permits, rates, marker="o", color=_OURS_COLOR, label="acquisitions/s")
    ax.plot(permits, ceilings, linestyle="--", color=_PEER_COLOR, label="ceiling N / hold")
    for n, rate, _, peak in points:
        ax.annotate(
            f"peak {peak}",
            (n, rate),
            textcoords="offset points",
            xytext=(0, -13),
            ha="center",
            fontsize=7,
            color="black" if peak == n else "red",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(rates) / 1.6, top=max(rates + ceilings) * 1.4)
    ax.set_xticks(permits, [str(n) for n in permits], fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("permits N (log scale); peak = most holders at once", fontsize=8)
    ax.set_ylabel("acquisitions/s (log scale)", fontsize=8)
    ax.set_title("B10 — Semaphore(N) throughput against N", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def _draw_ratios(
    ax: Any, bars: list[tuple[str, str, float, float]], xlabel: str, title: str
) -> None:
    """Horizontal bars of ratios, median solid and p99 hatched, a line at 1.0; a log scale
    when they span more than 10 x (pollers beside event-driven locks)."""
    labels = [label for _, label, _, _ in bars][::-1]
    colors = [_color(key) for key, _, _, _ in bars][::-1]
    positions = list(range(len(bars)))
    medians = [median for _, _, median, _ in bars][::-1]
    p99s = [p99 for _, _, _, p99 in bars][::-1]
    ax.barh([p + 0.2 for p in positions], medians, height=0.4, color=colors, label="median")
    ax.barh(
        [p - 0.2 for p in positions],
        p99s,
        height=0.4,
        color=colors,
        alpha=0.45,
        hatch="//",
        label="p99",
    )
    for p, median, p99 in zip(positions, medians, p99s, strict=True):
        ax.text(median, p + 0.2, f" {median:.2f}x", va="center", fontsize=8)
        ax.text(p99, p - 0.2, f" {p99:.2f}x", va="center", fontsize=8)
    ax.set_yticks(positions, labels, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(title, fontsize=10)
    values = [v for v in medians + p99s if v > 0]
    log_scale = bool(values) and max(values) / min(values) > 10
    scale_note = "log scale; " if log_scale else ""
    ax.set_xlabel(f"{xlabel} ({scale_note}median solid, p99 hatched)", fontsize=9)
    if log_scale:
        ax.set_xscale("log")
        ax.set_xlim(right=max(values) * 3)
    else:
        ax.set_xlim(left=0, right=max(values, default=1.0) * 1.25)


def _legend(ax: Any, solid: str, hatched: str) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor="#777777", label=solid),
        Patch(facecolor="#cccccc", hatch="//", label=hatched),
        Patch(facecolor=_OURS_COLOR, label="redis-locks-async"),
        Patch(facecolor=_REFERENCE_COLOR, label="reference"),
    ]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def write_chart(results: Mapping[str, Any], path: Path) -> str:
    """Draw the chart into ``path``; return ``""`` or why there is none."""
    scenarios = results.get("scenarios", {})
    handoffs = _ratio_bars(scenarios.get("B2", {}))
    commands = _command_bars(scenarios.get("B3", {}))
    cluster = _ratio_bars(scenarios.get("B7", {}))
    redlock = _ratio_bars(scenarios.get("B6", {}))
    reads = _read_bars(scenarios.get("B9", {}))
    permits = _permit_points(scenarios.get("B10", {}))
    if not any((handoffs, commands, cluster, redlock, reads, permits)):
        return "none of B2, B3, B6, B7, B9, B10 was measured in this run"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    panels = [p for p in (handoffs, commands) if p]
    topologies = max(len(cluster), len(redlock))
    family = bool(reads or permits)
    heights = [0.55 * len(p) + 1.6 for p in panels]
    heights += ([0.55 * topologies + 1.6] if topologies else []) + ([3.4] if family else [])
    height = max(3.0, sum(heights))
    figure = plt.figure(figsize=(12, height))
    grid = figure.add_gridspec(len(heights), 2, height_ratios=heights)
    rows = iter(range(len(heights)))
    if handoffs:
        ax = figure.add_subplot(grid[next(rows), :])
        _draw_ratios(
            ax,
            handoffs,
            "handoff latency x one-hop floor",
            "B2 — cross-process handoff to a waiting task",
        )
        _legend(ax, "median", "p99")
    if commands:
        ax = figure.add_subplot(grid[next(rows), :])
        labels = [label for _, label, _, _ in commands][::-1]
        colors = [_color(key) for key, _, _, _ in commands][::-1]
        positions = list(range(len(commands)))
        client = [value for _, _, value, _ in commands][::-1]
        server = [value for _, _, _, value in commands][::-1]
        ax.barh([p + 0.2 for p in positions], client, height=0.4, color=colors, label="client")
        ax.barh(
            [p - 0.2 for p in positions],
            server,
            height=0.4,
            color=colors,
            alpha=0.45,
            hatch="//",
            label="server (incl. Lua-internal)",
        )
        for p, c, s in zip(positions, client, server, strict=True):
            ax.text(c, p + 0.2, f" {c:.2f}", va="center", fontsize=8)
            ax.text(s, p - 0.2, f" {s:.2f}", va="center", fontsize=8)
        ax.set_yticks(positions, labels, fontsize=8)
        values = [v for v in client + server if v > 0]
        # Pollers can cost a hundred times what we do: a log scale keeps every bar readable.
        log_scale = bool(values) and max(values) / min(values) > 30
        scale_note = "log scale; " if log_scale else ""
        ax.set_xlabel(
            f"commands per handoff ({scale_note}client-sent solid; all server-side hatched)"
        )
        ax.set_title("B3 — Redis commands per handoff", fontsize=10)
        _legend(ax, "client-sent", "server-side (incl. Lua-internal)")
        if log_scale:
            ax.set_xscale("log")
            ax.set_xlim(left=min(values) / 2, right=max(values) * 3)
        else:
            ax.set_xlim(right=max(client + server) * 1.15)
    if topologies:
        row = next(rows)
        if cluster:
            _draw_ratios(
                figure.add_subplot(grid[row, 0]),
                cluster,
                "x one-hop floor, same node",
                "B7 — handoff on a 6-node cluster",
            )
        if redlock:
            _draw_ratios(
                figure.add_subplot(grid[row, 1]),
                redlock,
                "acquire x RedLock, 1 master",
                "B6 — RedLock acquire, 5 masters vs 1, one stopped",
            )
    if family:
        row = next(rows)
        if reads:
            _draw_reads(figure.add_subplot(grid[row, 0]), reads)
        if permits:
            _draw_permits(figure.add_subplot(grid[row, 1]), permits)
    meta = results.get("meta", {})
    server_meta = meta.get("server", {})
    figure.suptitle(
        f"redis-locks-async vs peers — {server_meta.get('name', '?')} "
        f"{server_meta.get('version', '?')}, Python {meta.get('python', '?')}, "
        f"{meta.get('cpu_count', '?')} cores, {'quick' if meta.get('quick') else 'full'} run",
        fontsize=10,
    )
    figure.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.3 / height))  # room for the suptitle
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return ""
