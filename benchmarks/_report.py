"""``results.json`` and ``results.md``: one Markdown table per scenario under a header that says
where the numbers come from (server, Python, machine, date)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def _us(value: float) -> str:
    return f"{value:,.1f} µs"


def _ms(value_us: float) -> str:
    return f"{value_us / 1000:,.3f} ms"


def _x(value: object) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) else "—"


def _table(headers: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    head = list(headers)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def _verdict(target: Mapping[str, Any]) -> str:
    return "met" if target.get("met") else "**not met**"


def _commands(by_type: Mapping[str, float], limit: int = 4) -> str:
    top = sorted(by_type.items(), key=lambda item: -item[1])[:limit]
    return ", ".join(f"{cmd} {calls:g}" for cmd, calls in top)


_SCRIPT_CALLS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def _command_note(total: float, by_type: Mapping[str, float], unit: str) -> str:
    """E.g. "15 server commands/cycle, 2 of them script calls (zrem 2, hget 2, ...)"."""
    scripts = sum(by_type.get(name, 0.0) for name in _SCRIPT_CALLS)
    text = f"{total:g} server commands/{unit}"
    if scripts:
        text += f", {scripts:g} of them script calls"
    return f"{text} ({_commands(by_type)})"


def _skipped(result: Mapping[str, Any]) -> list[str]:
    skipped: Mapping[str, str] = result.get("skipped", {})
    if not skipped:
        return []
    return ["", "Not measured: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "."]


def _section(
    result: Mapping[str, Any],
    intro: str,
    headers: Iterable[str],
    rows: Iterable[Iterable[str]],
    footnote: str,
) -> list[str]:
    """One scenario: heading, what was measured, the table, a footnote, the peers not measured."""
    lines = [f"## {result['scenario']} — {result['title']}", "", intro, ""]
    lines += _table(headers, rows)
    lines += ["", footnote]
    return lines + _skipped(result)


def _error_row(row: Mapping[str, Any], *cells: str) -> list[str]:
    return [row["label"], *cells, f"error: {row.get('error')}"]


def _b1(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    intro = (
        f"{result['cycles']:,} cycles per peer in {result['rounds']} interleaved rounds. "
        f"Reference: {result['reference']} = {_us(result['ping_median_us'])}. "
        f"Target: {target['text']} — {_verdict(target)} ({_x(target['value'])})."
    )
    rows = []
    for row in result["rows"]:
        if "error" in row:
            rows.append(_error_row(row, "—", "—", "—", "—"))
            continue
        summary = row["summary"]
        note = _command_note(row["commands_per_cycle"], row["commands_by_type"], "cycle")
        if row.get("note"):
            note = f"{row['note']}; {note}"
        rows.append(
            [
                row["label"],
                _us(summary["median_us"]),
                _us(summary["p99_us"]),
                _x(row["ratio_median"]),
                _x(row["ratio_p99"]),
                note,
            ]
        )
    return _section(
        result,
        intro,
        ["peer", "median", "p99", "x PING (median)", "x PING (p99)", "notes"],
        rows,
        "Server commands include those run inside Lua scripts (`INFO commandstats`).",
    )


def _b2(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    clock = result.get("clock_check", {})
    config = result["config"]
    value = target["value"]
    intro = (
        f"Two processes ping-pong one lock; latency = release started → waiter's acquire "
        f"returned. Hold {config['hold_base_ms']:g} ms + jitter of one polling period. "
        f"Reference: {result['reference']}. Target: {target['text']} — {_verdict(target)} "
        f"({_x(value[0])} median, {_x(value[1])} p99). CLOCK_MONOTONIC shared across "
        f"processes: {'yes' if clock.get('shared') else 'NO'} "
        f"({clock.get('inside_bracket')}/{clock.get('exchanges')} readings inside their bracket)."
    )
    rows = []
    for row in result["rows"]:
        if "summary" not in row:
            rows.append(_error_row(row, "—", "—", "—", "—"))
            continue
        summary = row["summary"]
        parts = [
            row.get("note", ""),
            f"{summary['n']} handoffs",
            "≈ " + _command_note(row["commands_per_handoff"], row["commands_by_type"], "handoff"),
        ]
        if row.get("late"):
            parts.append(f"{row['late']} late waiters left out")
        if row.get("exclusion_violations"):
            parts.append(f"{row['exclusion_violations']} acquired before the release began!")
        if "fencing_tokens_increase" in row:
            parts.append(
                "fencing tokens increased on every handoff"
                if row["fencing_tokens_increase"]
                else "fencing tokens NOT increasing!"
            )
        if row.get("error"):
            parts.append(f"error: {row['error']}")
        rows.append(
            [
                row["label"],
                _ms(summary["median_us"]),
                _ms(summary["p99_us"]),
                _x(row.get("ratio_median")),
                _x(row.get("ratio_p99")),
                "; ".join(p for p in parts if p),
            ]
        )
    return _section(
        result,
        intro,
        ["peer", "median", "p99", "x floor (median)", "x floor (p99)", "notes"],
        rows,
        "Commands per handoff are approximate: they include set-up, warm-up and "
        "Lua-internal commands.",
    )


def _b4(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"Window {config['window_s']:g} s after the set-up burst settled; holder silent "
        f"(lease {config['holder_lease_s']:g} s, no renewal). asyncio waiters share a "
        f"BlockingConnectionPool of {config['pool_size']}. Target: {target['text']} — "
        f"{_verdict(target)}."
    )
    rows = []
    for row in result["rows"]:
        if "error" in row:
            rows.append(_error_row(row, f"{row['tasks']:,} on {row['locks']:,}", "—", "—"))
            continue
        parts = [row.get("note", "")]
        by_type = row.get("commands_by_type_per_s", {})
        if by_type:
            parts.append(_commands(by_type) + " /s")
        parts.append(f"{row['waiting_at_end']:,}/{row['tasks']:,} still waiting at the end")
        if row.get("failed"):
            parts.append(f"{row['failed']} failed: {row.get('errors')}")
        parts.append(
            f"set-up: {row['setup_commands']:,} commands, settled in {row['settle_s']:g} s"
        )
        rows.append(
            [
                row["label"],
                f"{row['tasks']:,} on {row['locks']:,} lock{'s' if row['locks'] > 1 else ''}",
                f"{row['commands_per_s']:,.1f}",
                f"{row['connections_in_use']} ({row['connections_open']} open)",
                "; ".join(p for p in parts if p),
            ]
        )
    return _section(
        result,
        intro,
        ["peer", "waiters", "commands/s", "connections in use (open)", "notes"],
        rows,
        '"In use": subscribed, blocked (BLPOP), or sent a command during the window. '
        '"Open" includes idle connections the pool opened during the start-up burst.',
    )


_RENDER = {"B1": _b1, "B2": _b2, "B4": _b4}


def markdown(results: Mapping[str, Any]) -> str:
    """The whole ``results.md``."""
    meta = results["meta"]
    header = [
        ("Date", meta["date"]),
        ("Mode", "quick" if meta["quick"] else "full"),
        (
            "Server",
            f"{meta['server']['name']} {meta['server']['version']} — "
            f"`{meta['server']['binary']}` ({meta['server']['version_line']})",
        ),
        (
            "Python",
            f"{meta['python']} ({meta['python_implementation']}); redis-py "
            f"{meta['redis_py']}, hiredis {meta['hiredis'] or 'not installed'}",
        ),
        ("Machine", f"{meta['platform']}, {meta['cpu_count']} cores"),
        (
            "Library",
            f"redis-locks-async {meta['peers']['redis-locks-async']['version']}"
            + (f" @ {meta['library_revision']}" if meta.get("library_revision") else ""),
        ),
        (
            "Peers",
            ", ".join(
                f"{k} {v['version']}" if v["available"] else f"{k} ({v['reason']})"
                for k, v in meta["peers"].items()
                if k != "redis-locks-async"
            ),
        ),
        ("Elapsed", f"{meta.get('elapsed_s', 0):.0f} s"),
    ]
    lines = ["# redis-locks-async benchmarks", ""]
    lines += _table(["", ""], [[k, v] for k, v in header])
    lines += [
        "",
        "Compare ratios, not absolute times: every ratio's reference (PING round trip, "
        "one-hop floor) is measured in the same run on the same server. See "
        "`benchmarks/README.md`.",
        "",
    ]
    for key, result in results["scenarios"].items():
        render = _RENDER.get(key)
        if "rows" not in result or render is None:
            lines += [f"## {key}", "", f"Failed: {result.get('failures')}", ""]
            continue
        lines += render(result)
        if result.get("failures"):
            lines += ["", "**Failures:** " + "; ".join(result["failures"])]
        lines.append("")
    return "\n".join(lines)


def write(results: Mapping[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.md`` into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    md_path = out / "results.md"
    json_path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md_path.write_text(markdown(results), encoding="utf-8")
    return json_path, md_path
