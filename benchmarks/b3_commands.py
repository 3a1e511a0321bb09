"""B3 — Redis commands per handoff with many waiters spread over four processes.

Four worker processes (``spawn``, see ``_b3_worker``) wait on one lock: worker 0 first takes it
(the *gate*), then every worker starts its share of the waiters; once they are all waiting (the
server's command counter has gone quiet), the parent reads every worker's client-side counts and
the server's ``INFO commandstats``, and opens the gate. Each waiter takes the lock once and
releases it at once, so N waiters make N handoffs (the gate's release and the waiters' own). When
all are done the counts are read again:

- **client commands per handoff**: what the four clients wrote to their sockets (counted in a
  redis-py ``Connection`` subclass, ``_metering``: every command packed, pipelines included, plus
  connection set-up and health checks), divided by N;
- **round trips per handoff**: requests written (a pipeline is one);
- **server commands per handoff**: ``INFO commandstats`` over the same window, which also counts
  the commands Lua scripts run inside the server (not round trips), minus the parent's own INFO.

Every hold's ``(acquired, release started, fencing token)`` comes back: paired by token order
(ours) or by acquisition time (peers), no hold may begin before the previous one's release
began, and our tokens must increase. The gaps between one release and the next acquisition are
reported too (handoff latency under load). redis-py's ``Lock(sleep=0.001)`` and python-redis-lock
run the same way (the quick run uses fewer waiters, and only 40 pollers; the table says how many
waiters each had).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any

import redis

from ._b3_worker import CLOSE, OPEN, SNAPSHOT, START, B3Spec, Done, worker_main
from ._common import WorkerError, receive, stop_process
from ._console import Log
from ._metering import ZERO, Reading
from ._peers import available
from ._stats import command_delta, percentile

PROCESSES = 4
TARGET = 8.0  # client commands per handoff


@dataclass(frozen=True, slots=True)
class Case:
    """One B3 measurement."""

    key: str
    label: str
    peer: str
    requires: str
    waiters: int
    note: str = ""


@dataclass(frozen=True, slots=True)
class B3Config:
    """Cases and limits."""

    cases: tuple[Case, ...]
    timeout_s: float
    settle_max_s: float


_OURS = "redis-locks-async"
FULL = B3Config(
    cases=(
        Case(_OURS, "redis-locks-async Lock", _OURS, _OURS, 1_000, "pub/sub wake-up"),
        Case(
            "python-redis-lock",
            "python-redis-lock (threads)",
            "python-redis-lock",
            "python-redis-lock",
            1_000,
            "one thread (and connection) per waiter, BLPOP wake-up",
        ),
        Case(
            "redis-py/sleep=0.001",
            "redis-py asyncio Lock (sleep=0.001)",
            "redis-py/sleep=0.001",
            "redis-py",
            1_000,
            "polls every 1 ms (1,000 pollers keep both cores busy)",
        ),
    ),
    timeout_s=120.0,
    settle_max_s=10.0,
)
QUICK = B3Config(
    cases=(
        Case(_OURS, "redis-locks-async Lock", _OURS, _OURS, 200, "pub/sub wake-up"),
        Case(
            "redis-py/sleep=0.001",
            "redis-py asyncio Lock (sleep=0.001)",
            "redis-py/sleep=0.001",
            "redis-py",
            40,
            "polls every 1 ms; a smaller scale (its commands grow with waiters x time)",
        ),
    ),
    timeout_s=60.0,
    settle_max_s=4.0,
)


class _Fleet:
    """The worker processes and the parent's ends of their pipes."""

    def __init__(self, size: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[SpawnProcess] = []
        for index in range(size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(child_end,), daemon=True, name=f"b3-worker-{index}"
            )
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def send(self, index: int, message: object) -> None:
        try:
            self.conns[index].send(message)
        except (OSError, EOFError) as exc:
            raise WorkerError(f"worker {index} is gone: {exc!r}") from exc

    def expect(self, index: int, kind: str, timeout: float) -> tuple[Any, ...]:
        message = receive(self.conns[index], timeout, f"worker {index}")
        if isinstance(message, tuple) and message and message[0] == "error":
            raise WorkerError(f"worker {index}: {message[1]}")
        if not isinstance(message, tuple) or not message or message[0] != kind:
            raise WorkerError(f"worker {index}: expected {kind!r}, got {message!r}")
        return message

    def everyone(self, message: object, kind: str, timeout: float) -> list[tuple[Any, ...]]:
        for index in range(len(self.conns)):
            self.send(index, message)
        deadline = time.monotonic() + timeout
        return [
            self.expect(index, kind, max(1.0, deadline - time.monotonic()))
            for index in range(len(self.conns))
        ]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, EOFError):
                conn.send("exit")
        for proc in self.procs:
            stop_process(proc, grace_s=5, force_s=3)
        for conn in self.conns:
            conn.close()


def _server_counts(client: redis.Redis) -> dict[str, Any]:
    reply: dict[str, Any] = client.info("stats", "commandstats")
    return reply


def _settle(client: redis.Redis, limit_s: float) -> float:
    """Wait until the server's command counter stands still for 0.3 s (besides our own INFO
    calls), at most ``limit_s``; return the seconds waited."""
    started = time.monotonic()
    last = int(_server_counts(client)["total_commands_processed"])
    quiet = 0
    while time.monotonic() - started < limit_s:
        time.sleep(0.1)
        now = int(_server_counts(client)["total_commands_processed"])
        quiet = quiet + 1 if now - last <= 2 else 0  # 1 = our own INFO
        last = now
        if quiet >= 3:
            break
    return time.monotonic() - started


def _order(holds: list[tuple[int, int, int | None]], by_token: bool) -> dict[str, Any]:
    """Check the holds one after another and measure the gaps between them."""
    ordered = sorted(holds, key=lambda h: (h[2] if by_token and h[2] is not None else h[0], h[0]))
    overlaps = 0
    tokens_increase = True
    gaps: list[float] = []
    for previous, current in itertools.pairwise(ordered):
        if current[0] <= previous[1]:
            overlaps += 1
        else:
            gaps.append((current[0] - previous[1]) / 1000)
        if by_token and (current[2] is None or previous[2] is None or current[2] <= previous[2]):
            tokens_increase = False
        if by_token and current[0] <= previous[0]:
            tokens_increase = False
    span_ns = max(h[1] for h in holds) - min(h[0] for h in holds) if holds else 0
    gaps.sort()
    result: dict[str, Any] = {
        "overlaps": overlaps,
        "span_s": round(span_ns / 1e9, 3),
    }
    if by_token:
        result["tokens_increase"] = tokens_increase
    if gaps:
        result["gap_median_us"] = round(gaps[len(gaps) // 2], 1)
        result["gap_p99_us"] = round(percentile(gaps, 99.0), 1)
    return result


def _run_case(
    fleet: _Fleet, case: Case, url: str, prefix: str, config: B3Config, log: Log
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": case.key,
        "label": case.label,
        "note": case.note,
        "waiters": case.waiters,
        "processes": PROCESSES,
    }
    name = f"{prefix}b3:{case.key}"
    shares = [
        case.waiters // PROCESSES + (1 if i < case.waiters % PROCESSES else 0)
        for i in range(PROCESSES)
    ]
    observer = redis.Redis.from_url(url)
    try:
        for index, share in enumerate(shares):
            fleet.send(
                index,
                B3Spec(
                    case.peer,
                    url,
                    name,
                    share,
                    index == 0,
                    f"rla-bench-b3-{index}",
                    config.timeout_s,
                ),
            )
        for index in range(PROCESSES):
            fleet.expect(index, "prepared", 60.0)
        joining = _server_counts(observer)
        started = fleet.everyone(START, "started", 120.0)
        joining_clients = [message[3] for message in started]
        failed_at_start = sum(int(message[2]) for message in started)
        if failed_at_start:
            raise WorkerError(f"{failed_at_start} waiters failed while starting")
        if case.peer == _OURS:
            settle_s = _settle(observer, config.settle_max_s)
        else:
            time.sleep(0.3)
            settle_s = 0.3
        # The server first: a poller's commands between the two readings then count on the
        # server's side (which already includes more) rather than only on the clients'.
        before = _server_counts(observer)
        before_clients = [message[1] for message in fleet.everyone(SNAPSHOT, "reading", 30.0)]
        log(
            f"B3: {case.label}: {case.waiters} waiters over {PROCESSES} processes waiting "
            f"(settled in {settle_s:.1f} s); opening the gate…"
        )
        opened = time.monotonic()
        fleet.send(0, OPEN)
        deadline = time.monotonic() + config.timeout_s + 60
        dones: list[Done] = []
        for index in range(PROCESSES):
            message = fleet.expect(index, "done", max(1.0, deadline - time.monotonic()))
            dones.append(message[1])
        elapsed = time.monotonic() - opened
        after = _server_counts(observer)
        fleet.everyone(CLOSE, "closed", 30.0)
    except WorkerError as exc:
        row["error"] = str(exc)
        log(f"B3: {case.label}: {exc}", style="red")
        return row
    finally:
        observer.close()
    client = ZERO
    client_all = ZERO
    for done, earlier, first in zip(dones, before_clients, joining_clients, strict=True):
        assert isinstance(earlier, Reading) and isinstance(first, Reading)
        client = client + (done.reading - earlier)
        client_all = client_all + (done.reading - first)
    holds = [hold for done in dones for hold in done.holds]
    errors = [error for done in dones for error in done.errors]
    handoffs = len(holds) - 1  # the gate's hold was not handed over to anyone
    server = command_delta(before, after)
    server.pop("info", None)
    server_all = command_delta(joining, after)
    server_all.pop("info", None)
    row.update(
        handoffs=handoffs,
        elapsed_s=round(elapsed, 3),
        client_commands=client.total,
        client_round_trips=client.round_trips,
        client_commands_by_type={k: v for k, v in client.commands.items()},
        server_commands=sum(server.values()),
        server_commands_by_type=dict(sorted(server.items())),
        **_order(holds, by_token=case.peer == _OURS),
    )
    if errors:
        row["errors"] = errors[:5]
        row["failed"] = len(errors)
    if handoffs > 0:
        row["client_commands_per_handoff"] = round(client.total / handoffs, 2)
        row["client_round_trips_per_handoff"] = round(client.round_trips / handoffs, 2)
        row["server_commands_per_handoff"] = round(sum(server.values()) / handoffs, 2)
        row["client_by_type_per_handoff"] = {
            k: round(v / handoffs, 3) for k, v in client.commands.items()
        }
        row["server_by_type_per_handoff"] = {
            k: round(v / handoffs, 3) for k, v in sorted(server.items())
        }
        row["joining_settle_s"] = round(settle_s, 2)
        row["client_commands_per_acquisition_with_joining"] = round(client_all.total / handoffs, 2)
        row["client_by_type_per_acquisition_with_joining"] = {
            k: round(v / handoffs, 3) for k, v in client_all.commands.items()
        }
        row["server_commands_per_acquisition_with_joining"] = round(
            sum(server_all.values()) / handoffs, 2
        )
        log(
            f"B3: {case.label}: {handoffs} handoffs in {elapsed:.1f} s; "
            f"{row['client_commands_per_handoff']} client commands "
            f"({row['client_round_trips_per_handoff']} round trips), "
            f"{row['server_commands_per_handoff']} server commands per handoff; "
            f"{row['client_commands_per_acquisition_with_joining']} client commands per "
            "acquisition counting from the waiters' start"
        )
    return row


def run(url: str, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B3 and return its JSON-ready result."""
    config = QUICK if quick else FULL
    cases = [case for case in config.cases if available(case.requires)]
    skipped = {case.key: "not available" for case in config.cases if case not in cases}
    log(f"B3: starting {PROCESSES} worker processes")
    fleet = _Fleet(PROCESSES)
    rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            row = _run_case(fleet, case, url, prefix, config, log)
            rows.append(row)
            if "error" in row:  # a worker may be stuck mid-protocol: start afresh
                fleet.close()
                fleet = _Fleet(PROCESSES)
    finally:
        fleet.close()
    ours = next((row for row in rows if row["key"] == _OURS), {})
    fatal: list[str] = []
    if "error" in ours:
        fatal.append(f"{ours['label']}: {ours['error']}")
    if ours.get("failed"):
        fatal.append(f"{ours['label']}: {ours['failed']} waiters failed: {ours.get('errors')}")
    if ours.get("overlaps"):
        fatal.append(f"{ours['label']}: {ours['overlaps']} holds began before the previous release")
    if ours.get("tokens_increase") is False:
        fatal.append(f"{ours['label']}: fencing tokens did not increase in acquisition order")
    value = ours.get("client_commands_per_handoff")
    return {
        "scenario": "B3",
        "title": "Redis commands per handoff, many waiters over 4 processes",
        "config": {"processes": PROCESSES, "timeout_s": config.timeout_s},
        "rows": rows,
        "skipped": skipped,
        "target": {
            "text": f"Lock ≤ {TARGET:g} client commands per handoff "
            f"({ours.get('waiters', '?')} waiters over {PROCESSES} processes)",
            "limit": TARGET,
            "value": value,
            "value_text": "—" if value is None else f"{value:.2f} commands/handoff",
            "met": value is not None and value <= TARGET and not fatal,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
