"""B4 — idle cost of waiting: commands per second and connections while tasks wait.

A holder process takes the locks with a long lease and no renewal, then goes silent. A waiter
process starts N tasks (threads for the sync peer) that wait on those locks, spread round-robin.
Once the waiter's traffic has settled — every waiter in place as far as the server can tell
(ours: every lock's channel subscribed by the waiter's connections and a waiter registered in
every lock's queue; python-redis-lock: every thread blocked in ``BLPOP``; a poller shows
nothing of the kind), then a steady command rate —
the parent reads ``INFO stats``/``INFO commandstats`` at the start and the end of a window: the
difference, minus the parent's own ``INFO`` calls, is everything the waiting process sent (the
holder sends nothing). At the end of the window ``CLIENT LIST`` gives the waiter's connections
(found by client name): *open* ones, and the ones *in use* during the window (subscribed,
blocked in a blocking command, or with a command less than the window ago).

Every asyncio waiter uses a ``BlockingConnectionPool`` of 64 connections, the same for every
peer: redis-py 8's default pool raises "Too many connections" past 100 concurrent commands, and
N waiters starting at once issue N concurrent first attempts. Connections the pool opened during
that burst stay open (idle) afterwards; "in use" is the cost of waiting itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any

import redis

from ._b4_worker import REPORT, STOP, HolderSpec, WaiterReport, WaiterSpec, holder_main, waiter_main
from ._common import WorkerError, receive, stop_process
from ._console import Log
from ._peers import available
from ._stats import command_delta

POOL_SIZE = 64
LEASE_S = 300.0


@dataclass(frozen=True, slots=True)
class Case:
    """One B4 measurement."""

    key: str
    label: str
    peer: str
    tasks: int
    locks: int
    note: str = ""


@dataclass(frozen=True, slots=True)
class B4Config:
    """Cases and timing."""

    cases: tuple[Case, ...]
    window_s: float
    settle_max_s: float


_OURS_ONE = Case("redis-locks-async/200x1", "redis-locks-async Lock", "redis-locks-async", 200, 1)
_REDIS_PY = Case(
    "redis-py",
    "redis-py asyncio Lock (default sleep=0.1)",
    "redis-py",
    200,
    1,
    "polls every 100 ms",
)
FULL = B4Config(
    cases=(
        Case("redis-locks-async", "redis-locks-async Lock", "redis-locks-async", 10_000, 1_000),
        _OURS_ONE,
        _REDIS_PY,
        Case(
            "python-redis-lock",
            "python-redis-lock (threads)",
            "python-redis-lock",
            200,
            1,
            "one thread blocked in BLPOP per waiter; sync client with socket_timeout=None",
        ),
    ),
    window_s=10.0,
    settle_max_s=30.0,
)
QUICK = B4Config(
    cases=(
        Case("redis-locks-async", "redis-locks-async Lock", "redis-locks-async", 2_000, 200),
        _OURS_ONE,
        _REDIS_PY,
    ),
    window_s=5.0,
    settle_max_s=8.0,
)


def _receive(conn: Connection, timeout: float, what: str) -> object:
    message = receive(conn, timeout, what)
    if isinstance(message, tuple) and message and message[0] == "error":
        raise WorkerError(f"{what}: {message[1]}")
    return message


def _stop(proc: SpawnProcess, conn: Connection) -> str:
    """Ask a worker to stop; terminate it if it has not exited after 15 s. Returns "" or a note
    saying it had to be terminated (it happens after the measurement, so it is only a note)."""
    if proc.pid is None:  # never started
        conn.close()
        return ""
    with contextlib.suppress(OSError, EOFError):
        conn.send(STOP)
    terminated = stop_process(proc, grace_s=15, force_s=5)
    conn.close()
    if terminated:
        return f"{proc.name} did not exit within 15 s of 'stop' and was terminated"
    return ""


def _snapshot(client: redis.Redis) -> tuple[float, dict[str, Any]]:
    reply: dict[str, Any] = client.info("stats", "commandstats")
    return time.monotonic(), reply


def _others(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, dict[str, int]]:
    """Commands between two snapshots, without the observer's own ``INFO`` calls."""
    delta = command_delta(before, after)
    own = delta.pop("info", 0)
    total = int(after["total_commands_processed"]) - int(before["total_commands_processed"])
    return total - own, delta


def _queue_key(name: str) -> bytes:
    """A ``Lock``'s queue of registered waiters, as the README's key layout documents it (for
    a name without braces: ``{name}``, the byte 0xFF, ``queue``)."""
    return b"{" + name.encode() + b"}\xffqueue"


def _in_place(
    client: redis.Redis, case: Case, client_name: str, names: tuple[str, ...]
) -> tuple[int, int] | None:
    """How many of the waiter's waits the server shows in place, against how many there must
    be. Ours: the locks whose channel the waiter's connections subscribe *and* in whose queue
    a waiter is registered (one of each per lock and process: the head of a lock's local
    queue subscribes, then registers; the other waiters of that lock in the process queue
    locally and send nothing). python-redis-lock: its connections blocked in ``BLPOP`` (one
    per thread). ``None`` for a peer that shows nothing (a poller)."""
    if case.peer not in ("redis-locks-async", "python-redis-lock"):
        return None
    entries: list[dict[str, Any]] = client.client_list()
    mine = [entry for entry in entries if entry.get("name") == client_name]
    if case.peer == "python-redis-lock":
        return sum(1 for entry in mine if "b" in str(entry.get("flags", ""))), case.tasks
    channels = sum(int(entry.get("sub", 0)) + int(entry.get("ssub", 0)) for entry in mine)
    registered = 0
    for start in range(0, len(names), 1000):
        pipe = client.pipeline(transaction=False)
        for name in names[start : start + 1000]:
            pipe.zcard(_queue_key(name))
        registered += sum(1 for count in pipe.execute() if int(count) > 0)
    return min(channels, registered), case.locks


def _settle(
    client: redis.Redis, limit_s: float, in_place: Callable[[], tuple[int, int] | None]
) -> tuple[float, int, tuple[int, int] | None]:
    """Wait until every waiter is in place (:func:`_in_place`), then until the command rate is
    steady — or ``limit_s`` in all; return (seconds, commands, what was in place).

    The rate alone once settled on the tail of the set-up (10,000 waiters: subscriptions and
    registrations still arriving, 432 and 319 commands/s counted as the idle cost): a trickle
    can be as steady as silence over two half-seconds — and the registrations go on for
    seconds after the last channel is subscribed."""
    started, first = _snapshot(client)
    placed = in_place()
    while placed is not None and placed[0] < placed[1] and time.monotonic() - started < limit_s:
        time.sleep(0.2)
        placed = in_place()
    last_at, last = _snapshot(client)
    previous_rate: float | None = None
    while True:
        time.sleep(0.5)
        now, current = _snapshot(client)
        count, _ = _others(last, current)
        rate = count / (now - last_at)
        steady = previous_rate is not None and abs(rate - previous_rate) <= max(
            5.0, 0.15 * previous_rate
        )
        last_at, last, previous_rate = now, current, rate
        if steady or now - started >= limit_s:
            return now - started, _others(first, current)[0], placed


def _connections(client: redis.Redis, name: str, window_s: float) -> tuple[int, int]:
    entries: list[dict[str, Any]] = client.client_list()
    mine = [entry for entry in entries if entry.get("name") == name]
    in_use = [
        entry
        for entry in mine
        if int(entry.get("sub", 0))
        or int(entry.get("psub", 0))
        or int(entry.get("ssub", 0))
        or "b" in str(entry.get("flags", ""))  # blocked in BLPOP & co.
        or int(entry.get("idle", 0)) < int(window_s)
    ]
    return len(mine), len(in_use)


def _run_case(case: Case, url: str, prefix: str, config: B4Config, log: Log) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    names = tuple(f"{prefix}b4:{case.key}:{index}" for index in range(case.locks))
    client_name = f"rla-bench-b4-{case.key.replace('/', '-')}"
    observer = redis.Redis.from_url(url)
    holder_conn, holder_end = ctx.Pipe()
    holder = ctx.Process(
        target=holder_main,
        daemon=True,
        name="b4-holder",
        args=(holder_end, HolderSpec(case.peer, url, names, LEASE_S)),
    )
    waiter_conn, waiter_end = ctx.Pipe()
    pool = case.tasks + 16 if case.peer == "python-redis-lock" else POOL_SIZE
    waiter = ctx.Process(
        target=waiter_main,
        daemon=True,
        name="b4-waiter",
        args=(
            waiter_end,
            WaiterSpec(case.peer, url, names, case.tasks, client_name, pool, LEASE_S, LEASE_S - 10),
        ),
    )
    row: dict[str, Any] = {
        "key": case.key,
        "label": case.label,
        "tasks": case.tasks,
        "locks": case.locks,
        "note": case.note,
        "pool_size": pool,
    }
    try:
        holder.start()
        holder_end.close()
        _receive(holder_conn, 120.0, "holder")
        baseline = int(observer.info("clients")["connected_clients"])
        waiter.start()
        waiter_end.close()
        started = _receive(waiter_conn, 120.0, "waiter")
        if isinstance(started, tuple) and len(started) == 3 and started[2]:
            raise WorkerError(f"waiter: {started[2]} tasks failed while starting")
        settle_s, setup_commands, placed = _settle(
            observer, config.settle_max_s, lambda: _in_place(observer, case, client_name, names)
        )
        row.update(settle_s=round(settle_s, 2), setup_commands=setup_commands)
        if placed is not None:
            row.update(in_place=placed[0], in_place_needed=placed[1])
            if placed[0] < placed[1]:
                log(
                    f"B4: {case.label}: only {placed[0]} of {placed[1]} waits in place after "
                    f"{config.settle_max_s:g} s; measuring anyway",
                    style="yellow",
                )
        log(
            f"B4: {case.label} ({case.tasks} waiters on {case.locks} locks): settled after "
            f"{settle_s:.1f} s; measuring {config.window_s:.0f} s…"
        )
        begin_at, begin = _snapshot(observer)
        time.sleep(config.window_s)
        end_at, end = _snapshot(observer)
        count, by_command = _others(begin, end)
        elapsed = end_at - begin_at
        open_count, in_use = _connections(observer, client_name, config.window_s)
        clients = observer.info("clients")
        waiter_conn.send(REPORT)
        report = _receive(waiter_conn, 60.0, "waiter")
        if not isinstance(report, WaiterReport):
            raise WorkerError(f"waiter sent {report!r}")
        row.update(
            window_s=round(elapsed, 2),
            commands=count,
            commands_per_s=round(count / elapsed, 2),
            commands_by_type_per_s={
                cmd: round(calls / elapsed, 2) for cmd, calls in sorted(by_command.items())
            },
            connections_open=open_count,
            connections_in_use=in_use,
            connected_clients_delta=int(clients["connected_clients"]) - baseline,
            blocked_clients=int(clients.get("blocked_clients", 0)),
            waiting_at_end=report.waiting,
            acquired=report.acquired,
            failed=report.failed,
        )
        if report.errors:
            row["errors"] = list(report.errors)
        log(
            f"B4: {case.label} ({case.tasks} waiters): {row['commands_per_s']} commands/s, "
            f"{in_use} connections in use ({open_count} open)"
        )
    except WorkerError as exc:
        row["error"] = str(exc)
        log(f"B4: {case.label}: {exc}", style="red")
    finally:
        notes = [note for note in (_stop(waiter, waiter_conn), _stop(holder, holder_conn)) if note]
        if notes:
            row["stop_notes"] = notes
            for note in notes:
                log(f"B4: {case.label}: {note}", style="yellow")
        try:
            keys = list(observer.scan_iter(match=f"*{prefix}b4:{case.key}:*", count=1000))
            for start in range(0, len(keys), 500):
                observer.unlink(*keys[start : start + 500])
        finally:
            observer.close()
    return row


def run(url: str, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B4 and return its JSON-ready result."""
    config = QUICK if quick else FULL
    cases = [case for case in config.cases if available(case.peer)]
    skipped = {case.key: "not available" for case in config.cases if case not in cases}
    rows = [_run_case(case, url, prefix, config, log) for case in cases]
    main = next((row for row in rows if row["key"] == "redis-locks-async"), {})
    fatal: list[str] = []
    for row in rows:
        if not row["key"].startswith("redis-locks-async"):
            continue
        if "error" in row:
            fatal.append(f"{row['label']} ({row['tasks']} waiters): {row['error']}")
        elif row.get("failed") or row.get("waiting_at_end") != row["tasks"]:
            fatal.append(
                f"{row['label']} ({row['tasks']} waiters): {row.get('failed')} failed, "
                f"{row.get('waiting_at_end')} still waiting at the end"
            )
    met = (
        "error" not in main
        and main.get("connections_in_use", 99) <= 2
        and main.get("commands_per_s", 99.0) < 1.0
    )
    return {
        "scenario": "B4",
        "title": "Idle cost of waiting",
        "config": {
            "window_s": config.window_s,
            "settle_max_s": config.settle_max_s,
            "pool_size": POOL_SIZE,
            "holder_lease_s": LEASE_S,
        },
        "rows": rows,
        "skipped": skipped,
        "target": {
            "text": "Lock: ≤ 2 connections in use, ~0 commands/s (< 1/s)",
            "value": [main.get("connections_in_use"), main.get("commands_per_s")],
            "met": met,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
