"""``results.json`` and ``results.md``: one Markdown table per scenario under a header that says
where the numbers come from (server, Python, machine, date)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._chart import write_chart


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
    top = sorted(((k, v) for k, v in by_type.items() if v >= 0.0005), key=lambda kv: -kv[1])
    top = top[:limit]
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
        f"Reference: {result['reference']} = {_us(result['evalsha_median_us'])} "
        f"(PING: {_us(result['ping_median_us'])}). Target: {target['text']} — "
        f"{_verdict(target)} ({target.get('value_text')})."
    )
    rows = []
    for row in result["rows"]:
        if "error" in row:
            rows.append(_error_row(row, "—", "—", "—", "—", "—"))
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
                _x(row.get("ratio_evalsha")),
                _x(row["ratio_median"]),
                _x(row["ratio_p99"]),
                note,
            ]
        )
    return _section(
        result,
        intro,
        [
            "peer",
            "median",
            "p99",
            "x 2 EVALSHA (median)",
            "x PING (median)",
            "x PING (p99)",
            "notes",
        ],
        rows,
        "Server commands include those run inside Lua scripts (`INFO commandstats`).",
    )


def _clock_text(result: Mapping[str, Any]) -> str:
    clock = result.get("clock_check", {})
    return (
        f"CLOCK_MONOTONIC shared across processes: {'yes' if clock.get('shared') else 'NO'} "
        f"({clock.get('inside_bracket')}/{clock.get('exchanges')} readings inside their bracket)."
    )


def _handoff_section(result: Mapping[str, Any], intro: str) -> list[str]:
    """B2's and B7's table (one row per peer, ratios to the floor) and the hop split."""
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
    lines = _section(
        result,
        intro,
        ["peer", "median", "p99", "x floor (median)", "x floor (p99)", "notes"],
        rows,
        "Commands per handoff are approximate: they include set-up, warm-up and "
        "Lua-internal commands (see B3 for client commands per handoff).",
    )
    return lines + _b2_hops(result)


def _b2(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"Two processes ping-pong one lock; latency = release started → waiter's acquire "
        f"returned. Hold {config['hold_base_ms']:g} ms + jitter of one polling period. "
        f"Reference: {result['reference']}. Target: {target['text']} — {_verdict(target)} "
        f"({target.get('value_text')}). {_clock_text(result)}"
    )
    return _handoff_section(result, intro)


def _b7(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"B2's ping-pong on a Redis Cluster of {config['primaries']} primaries and "
        f"{config['replicas']} replicas (formed in {config['formed_s']:g} s), a `RedisCluster` "
        f"client in each process: every name of the run on slot {config['slot']}, primary "
        f"{config['node']}, so the floor and the locks go through the same node. "
        f"{config['fast_handoffs']} handoffs per peer in {config['fast_rounds']} interleaved "
        f"rounds; hold {config['hold_base_ms']:g} ms + 2 ms jitter. Reference: "
        f"{result['reference']}. Target: {target['text']} — {_verdict(target)} "
        f"({target.get('value_text')}). {_clock_text(result)}"
    )
    return _handoff_section(result, intro)


def _b6(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"One task's `acquire(); release()` cycles on {config['masters']} servers of the run's "
        f"binary: {config['cycles']:,} per row in {_rounds(config)} (interleaved), then "
        f"one master SIGSTOPped ({config['stopped_cycles']} cycles of ours, "
        f"{config['peer_stopped_cycles']} of pottery's). Every cycle is bounded by "
        f"{config['hang_after_s']:g} s (else: a hang). Reference: {result['reference']}; "
        f"PING {_us(result['ping_median_us'])}, RedLock's node timeout "
        f"{result['node_timeout_s'] * 1000:g} ms, so the bound with one master stopped is "
        f"{result['stopped_bound_ms']:.1f} ms. Target: {target['text']} — {_verdict(target)} "
        f"({target.get('value_text')})."
    )
    rows = []
    for row in result["rows"]:
        if "acquire" not in row:
            what = f"hang (> {row['hang_after_s']:g} s)" if "hang_after_s" in row else "—"
            problem = f"error: {row['error']}" if row.get("error") else "no cycle completed"
            rows.append([row["label"], what, "—", "—", "—", "—", "—", problem])
            continue
        acquire = row["acquire"]
        notes = [f"{row['cycles']:,} cycles"]
        if "hang_after_s" in row:
            notes.append(f"then a hang (> {row['hang_after_s']:g} s)")
        if row.get("error"):
            notes.append(f"then error: {row['error']}")
        rows.append(
            [
                row["label"],
                _ms(acquire["median_us"]),
                _ms(acquire["p99_us"]),
                _ms(row["release_median_us"]),
                _x(row.get("ratio_median")),
                _x(row.get("ratio_p99")),
                _x(row.get("ratio_own_single")),
                "; ".join(notes),
            ]
        )
    return _section(
        result,
        intro,
        [
            "configuration",
            "acquire median",
            "acquire p99",
            "release median",
            "x RedLock 1 master (median)",
            "x RedLock 1 master (p99)",
            "x its own 1 master (median)",
            "notes",
        ],
        rows,
        "Acquire and release are timed separately; every ratio is of the acquire.",
    )


def _b2_hops(result: Mapping[str, Any]) -> list[str]:
    """Where a handoff's time goes, from both workers' client traces (medians per hop)."""
    traced = [row for row in result["rows"] if row.get("hops_median_us")]
    if not traced:
        return []
    rows = []
    for row in traced:
        hops = row["hops_median_us"]
        parts = hops["release"] + hops["server"] + hops["wake"]
        writes = row["hop_first_write"].items()
        first = ", ".join(f"{k.removeprefix('send:')} {v}" for k, v in writes)
        rows.append(
            [
                row["label"],
                _us(hops["release"]),
                _us(hops["server"]),
                _us(hops["wake"]),
                _us(parts),
                _us(row["summary"]["median_us"]),
                f"{row['hop_waiter_writes_mean']:g}",
                _us(hops.get("reply", float("nan"))),
                f"{row['hops_n']} handoffs; holder's first write: {first}",
            ]
        )
    return [
        "",
        "### Where a handoff's time goes (medians of each hop)",
        "",
        "From timestamps both workers' clients take as they write a request and read a reply "
        "or message (`benchmarks/_metering.py`): **release** = t0 → the holder's request "
        "(release script, RPUSH, PUBLISH or SPUBLISH) is written; **server** = written → the "
        "waiter's client has read its wake-up (pub/sub message, BLPOP reply): the server's "
        "work and both kernels' and event loops' wake-ups; **wake** = read → the waiter's "
        "acquire returned (the library's dispatch). Medians do not add up exactly to the median "
        "total.",
        "",
        *_table(
            [
                "peer",
                "release",
                "server",
                "wake",
                "sum of medians",
                "median total",
                "waiter writes before acquire returned",
                "holder's own reply",
                "notes",
            ],
            rows,
        ),
    ]


def _b4(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"Window {config['window_s']:g} s after the set-up settled (every waiter in place as "
        "far as the server shows it, then a steady command rate); holder silent "
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
        if "in_place" in row:
            ours = row["key"].startswith("redis-locks-async")
            what = "locks subscribed and registered" if ours else "connections blocked in BLPOP"
            parts.append(f"{row['in_place']:,}/{row['in_place_needed']:,} {what} before the window")
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


def _b3(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"Waiters spread over {config['processes']} processes wait on one lock held by a gate; "
        "once all wait the gate opens and every waiter cycles: acquire, release at once, pause "
        f"{config['think_ms']:g} ms, queue again. After {config['warmup_s']:g} s a steady "
        f"window of {config['window_s']:g} s is measured: client commands and round trips are "
        "counted in the clients (`benchmarks/_metering.py`), server script calls and commands "
        "are `INFO commandstats` (the total includes the commands Lua scripts run inside the "
        "server); each is divided by the handoffs in the window (acquisitions by another "
        "waiter than the previous holder). "
        f"Target: {target['text']} — {_verdict(target)} ({target.get('value_text')})."
    )
    rows = []
    for row in result["rows"]:
        waiters = f"{row['waiters']:,} / {row['processes']}"
        if "client_commands_per_handoff" not in row:
            rows.append(_error_row(row, waiters, "—", "—", "—", "—", "—", "—"))
            continue
        parts = [
            row.get("note", ""),
            "client: " + _commands(row["client_by_type_per_handoff"], 5),
            "server: " + _commands(row["server_by_type_per_handoff"], 5),
            f"{row['handoffs']:,} handoffs in {row['window_s']:g} s "
            f"(≈ {row['pausing_mean']:g} waiters pausing at a time)",
        ]
        if row.get("leases_lost"):
            parts.append(
                f"on_lost ran {row['leases_lost']} times, for 60 s leases released at once "
                "without error (a library race, see the README)!"
            )
        if row.get("repeats"):
            parts.append(f"{row['repeats']} re-acquisitions by the releaser not counted")
        if "tokens_increase" in row:
            parts.append(
                f"fencing tokens increased in acquisition order ({row['holds']:,} holds)"
                if row["tokens_increase"]
                else "fencing tokens NOT increasing!"
            )
        if row.get("overlaps"):
            parts.append(f"{row['overlaps']} holds began before the previous release began!")
        if row.get("failed"):
            parts.append(f"{row['failed']} waiters failed: {row.get('errors')}")
        gap = (
            f"{_ms(row['gap_median_us'])} / {_ms(row['gap_p99_us'])}"
            if "gap_median_us" in row
            else "—"
        )
        rows.append(
            [
                row["label"],
                waiters,
                f"{row['client_commands_per_handoff']:g}",
                f"{row['client_round_trips_per_handoff']:g}",
                f"{row['server_script_calls_per_handoff']:g}",
                f"{row['server_commands_per_handoff']:g}",
                f"{row['handoffs_per_s']:,.0f}",
                gap,
                "; ".join(p for p in parts if p),
            ]
        )
    return _section(
        result,
        intro,
        [
            "peer",
            "waiters / processes",
            "client commands per handoff",
            "client round trips per handoff",
            "server script calls per handoff",
            "server commands per handoff (incl. Lua-internal)",
            "handoffs/s",
            "release → next acquire (median / p99)",
            "notes",
        ],
        rows,
        "A poller's commands per handoff grow with its waiters and with the time between "
        "handoffs (waiters x gap / sleep); an event-driven lock's do not. Set-up (first "
        "attempts, subscribing, connections' handshakes) and the stop at the end are outside "
        "the window.",
    )


def _lag(lag: Mapping[str, Any]) -> str:
    if not lag.get("n"):
        return "—"
    return f"p50 {lag['p50_ms']:g} ms, p99 {lag['p99_ms']:g} ms, max {lag['max_ms']:g} ms"


def _b5(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    row = result["rows"][0]
    config = result["config"]
    intro = (
        f"{config['locks']:,} tasks each hold their own `Lock(..., lease={config['lease_s']:g})` "
        f"(renewed every lease/3 = one tick) in one process on a BlockingConnectionPool of "
        f"{config['pool_size']} (acquisitions and releases paced at "
        f"{config.get('in_flight_gate', '?')} in flight); measured over {config['leases']} "
        "leases once all are held, from a quiet moment between two renewal bursts. "
        f"Target: {target['text']} — {_verdict(target)} ({target.get('value_text')})."
    )
    if "alive_on_server" not in row:
        return [f"## B5 — {result['title']}", "", intro, "", f"Failed: {result.get('failures')}"]
    table = [
        ["locks held", f"{row['locks']:,} (all acquired in {row['acquire_s']:g} s)"],
        [
            f"alive after {config['leases']} leases",
            f"{row['alive_on_server']:,} on the server (token and TTL checked), "
            f"{row['lost_locally']} lost locally",
        ],
        [
            "renewal round trips per tick",
            f"{row['round_trips_per_tick']:g} ({row['client_round_trips']} in "
            f"{row['window_s']:g} s = {row['ticks']:g} ticks"
            + (
                "; no quiet moment between bursts: the window may cut a tick"
                if row.get("window_between_bursts") is False
                else ""
            )
            + ")",
        ],
        ["… per 1,000 locks", f"**{row['round_trips_per_tick_per_1000']:g}**"],
        [
            "round trips per 1,000 renewals",
            f"{row['round_trips_per_1000_renewals']:g} (the batching alone, whatever the "
            "renewal period)",
        ],
        [
            "renewals per lock per tick",
            f"{row['renewals_per_lock_per_tick']:g} (client EVALSHA {row['renewals_client']:,}; "
            f"server evalsha {row['renewals_server']:,})",
        ],
        [
            "renewals per round trip (pipeline size)",
            f"mean {row['pipeline_size_mean']}, min {row['pipeline_size_min']}, "
            f"max {row['pipeline_size_max']} (the library's batch limit is 1,000)",
        ],
        ["event-loop lag while holding", _lag(row["lag_window"])],
        ["event-loop lag while acquiring", _lag(row["lag_acquiring"])],
        [
            "release of all",
            f"{row.get('release_s', '?')} s, {row.get('release_failed', 0)} failed"
            + (f" ({row['release_errors'][0]})" if row.get("release_errors") else "")
            + f"; {row.get('left_after_release', '?')} keys left; client close "
            f"{row.get('close_s', '?')} s",
        ],
    ]
    lines = [f"## B5 — {result['title']}", "", intro, ""]
    lines += _table(["", "redis-locks-async Lock"], table)
    lines += [
        "",
        "Round trips are requests the client wrote (a pipeline is one), counted in the client. "
        f"Lag: overshoot of a {config['lag_tick_ms']:g} ms `asyncio.sleep` in a ticker task.",
    ]
    return lines


def _b8(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"{config['tasks']} tasks in one process, each {config['cycles_per_task']} x "
        f"`acquire(); release()` per round ({config['rounds']} rounds, peers alternating), "
        f"own lock object per task, a BlockingConnectionPool of {config['pool_size']} per peer. "
        f"Target: {target['text']} — {_verdict(target)} ({target.get('value_text')})."
    )
    rows = []
    for row in result["rows"]:
        mode = f"{row['mode']} ({row['tasks']} tasks on {row['names']} names)"
        if "per_s" not in row:
            rows.append(_error_row(row, mode, "—", "—", "—", "—"))
            continue
        parts = ["client: " + _commands(row["client_by_type_per_acquisition"], 4)]
        parts.append(f"{row['acquisitions']:,} acquisitions in {row['seconds']:g} s")
        if row.get("overlaps") or row.get("token_regressions"):
            parts.append(
                f"{row.get('overlaps')} overlaps, {row.get('token_regressions')} token regressions!"
            )
        elif "overlaps" in row:
            parts.append("no overlap, tokens increasing per name")
        if row.get("leases_lost"):
            parts.append(
                f"on_lost ran {row['leases_lost']} times, for 30 s leases released at once "
                "without error (a library race, see the README)!"
            )
        rows.append(
            [
                row["label"],
                mode,
                f"{row['per_s']:,.0f}",
                _x(row.get("ratio_vs_redis_py")),
                f"{row['client_commands_per_acquisition']:g}",
                f"{row['client_round_trips_per_acquisition']:g}",
                f"{row['server_commands_per_acquisition']:g}",
                "; ".join(parts),
            ]
        )
    return _section(
        result,
        intro,
        [
            "peer",
            "mode",
            "acquisitions/s",
            "x redis-py",
            "client commands per acquisition",
            "client round trips per acquisition",
            "server commands per acquisition (incl. Lua-internal)",
            "notes",
        ],
        rows,
        "Client commands are counted in the client (`benchmarks/_metering.py`); server "
        "commands from `INFO commandstats` include those Lua scripts run inside the server.",
    )


def _rounds(config: Mapping[str, Any]) -> str:
    count = int(config["rounds"])
    return f"{count} round{'s' if count != 1 else ''}"


def _per_acquisition_cells(row: Mapping[str, Any]) -> list[str]:
    return [
        f"{row['client_commands_per_acquisition']:g}",
        f"{row['client_round_trips_per_acquisition']:g}",
        f"{row['server_commands_per_acquisition']:g}",
    ]


def _b9(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"{config['readers']} reader tasks on {config['names']} names (one `ReadWriteLock` per "
        f"name, shared by its readers) loop `async with rw.read` around a "
        f"{config['read_hold_ms']:g} ms read; with the writer, one more task loops: pause "
        f"{config['write_pause_ms']:g} ms, `async with rw.write` on the next name for "
        f"{config['write_hold_ms']:g} ms. One process, a BlockingConnectionPool of "
        f"{config['pool_size']}; {_rounds(config)} of a {config['window_s']:g} s steady window "
        f"per phase, phases alternating. Target: {target['text']} — {_verdict(target)} "
        f"({target.get('value_text')})."
    )
    rows = []
    for row in result["rows"]:
        if "client_commands_per_acquisition" not in row:
            rows.append(_error_row(row, "—", "—", "—", "—", "—", "—", "—", "—"))
            continue
        parts = ["client: " + _commands(row["client_by_type_per_acquisition"], 3)]
        parts.append(
            f"{row['reads']:,} reads and {row['writes']:,} writes in {row['seconds']:g} s; up to "
            f"{row['peak_readers_per_name']} readers at once on a name"
        )
        if row.get("overlaps"):
            parts.append(f"{row['overlaps']} times a writer was not alone!")
        elif row.get("writer"):
            parts.append("the writer was always alone")
        if row.get("leases_lost"):
            parts.append(f"on_lost ran {row['leases_lost']} times!")
        if row.get("error"):
            parts.append(f"error: {row['error']}")
        wait = (
            f"{row['write_wait_median_ms']:,.1f} / {row['write_wait_p99_ms']:,.1f} ms"
            if "write_wait_median_ms" in row
            else "—"
        )
        rows.append(
            [
                row["label"],
                f"{row['reads_per_s']:,.0f}",
                _x(row.get("read_ratio")),
                f"{row['writes_per_s']:,.1f}",
                wait,
                f"{row.get('reader_cycle_ms', 0):,.1f} ms",
                *_per_acquisition_cells(row),
                "; ".join(parts),
            ]
        )
    return _section(
        result,
        intro,
        [
            "phase",
            "reads/s",
            "x readers alone",
            "writes/s",
            "writer's wait (median / p99)",
            "reader cycle (mean)",
            "client commands per acquisition",
            "client round trips per acquisition",
            "server commands per acquisition (incl. Lua-internal)",
            "notes",
        ],
        rows,
        "Per acquisition = per read or write. The writer's wait runs from its `acquire` call to "
        "its return; with writer preference new readers queue behind it, so it waits for the "
        "readers already inside to leave — about one reader cycle (200 readers / reads/s), "
        "which on a saturated 2-core machine is far longer than the 1 ms read itself.",
    )


def _b10(result: Mapping[str, Any]) -> list[str]:
    target = result["target"]
    config = result["config"]
    intro = (
        f"{config['tasks']} tasks in one process share one `Semaphore(N)` and loop `async with "
        f"sem` around a {config['hold_ms']:g} ms hold; a BlockingConnectionPool of "
        f"{config['pool_size']}; {_rounds(config)} of a {config['window_s']:g} s steady window "
        "per N, in alternating order. Peak concurrency: the most tasks inside at once, "
        f"counted in-process. Target: {target['text']} — {_verdict(target)} "
        f"({target.get('value_text')})."
    )
    rows = []
    for row in result["rows"]:
        if "client_commands_per_acquisition" not in row:
            rows.append(_error_row(row, "—", "—", "—", "—", "—", "—", "—"))
            continue
        parts = ["client: " + _commands(row["client_by_type_per_acquisition"], 3)]
        parts.append(f"{row['acquisitions']:,} acquisitions in {row['seconds']:g} s")
        if row.get("leases_lost"):
            parts.append(f"on_lost ran {row['leases_lost']} times!")
        if row.get("error"):
            parts.append(f"error: {row['error']}")
        peak = f"{row['peak_concurrency']} of {row['permits']}"
        if row["peak_concurrency"] != row["permits"]:
            peak = f"**{peak}**"
        rows.append(
            [
                row["label"],
                f"{row['per_s']:,.0f}",
                _x(row.get("ratio_vs_1")),
                f"{row['ceiling_per_s']:,.0f}",
                peak,
                *_per_acquisition_cells(row),
                "; ".join(parts),
            ]
        )
    return _section(
        result,
        intro,
        [
            "permits",
            "acquisitions/s",
            "x N=1",
            "ceiling N / hold",
            "peak concurrency",
            "client commands per acquisition",
            "client round trips per acquisition",
            "server commands per acquisition (incl. Lua-internal)",
            "notes",
        ],
        rows,
        "The ceiling is what the hold time alone would allow; below it, the gap is the "
        "handoff (a release hands its permit to the first waiter in line) and, as N grows, "
        "the client's CPU (one process, 2 cores shared with the server).",
    )


_RENDER = {
    "B1": _b1,
    "B2": _b2,
    "B3": _b3,
    "B4": _b4,
    "B5": _b5,
    "B6": _b6,
    "B7": _b7,
    "B8": _b8,
    "B9": _b9,
    "B10": _b10,
}


def markdown(results: Mapping[str, Any], chart: str = "", no_chart: str = "") -> str:
    """The whole ``results.md`` (``chart``: the chart's file name, else ``no_chart`` says
    why there is none)."""
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
        "Compare ratios, not absolute times: every ratio's reference (two bare EVALSHA, PING, "
        "the one-hop floor, redis-py's Lock) is measured in the same run on the same server. "
        "The machine is shared (2 cores, other jobs running): single figures are noisy. See "
        "`benchmarks/README.md`.",
        "",
        f"![handoff latency, commands per handoff, lock family throughput]({chart})"
        if chart
        else f"No chart: {no_chart}.",
        "",
    ]
    for key, result in results["scenarios"].items():
        render = _RENDER.get(key)
        if "not_run" in result:
            lines += [f"## {key}", "", f"Not run: {result['not_run']}.", ""]
            continue
        if "rows" not in result or render is None:
            lines += [f"## {key}", "", f"Failed: {result.get('failures')}", ""]
            continue
        lines += render(result)
        if result.get("failures"):
            lines += ["", "**Failures:** " + "; ".join(result["failures"])]
        lines.append("")
    return "\n".join(lines)


def write(results: Mapping[str, Any], out: Path) -> tuple[Path, Path, Path | None]:
    """Write ``results.json``, ``results.png`` (when matplotlib is there) and ``results.md``
    into ``out``; return their paths (``None`` for a chart that was not drawn)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    md_path = out / "results.md"
    png_path = out / "results.png"
    json_path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    png_path.unlink(missing_ok=True)
    try:
        no_chart = write_chart(results, png_path)
    except Exception as exc:  # a chart is a nicety: never lose the results over it
        no_chart = f"drawing it failed ({type(exc).__name__}: {exc})"
    chart = png_path.name if not no_chart else ""
    md_path.write_text(markdown(results, chart, no_chart), encoding="utf-8")
    return json_path, md_path, (png_path if chart else None)
