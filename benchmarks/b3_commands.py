"""B3 — Redis commands per handoff with many waiters spread over four processes.

Four worker processes (``spawn``, see ``_b3_worker``) wait on one lock: worker 0 first takes it
(the *gate*), then every worker starts its share of the waiters; once they are all waiting (for
our ``Lock``: the server's command counter has gone quiet) the parent opens the gate. From then on
every waiter cycles — acquire, release at once, pause (20 ms; 5 ms in the quick run), queue
again — so nearly all N waiters are always waiting (the pause only keeps a polling peer's
releaser from winning its own lock straight back). After a warm-up the parent measures a
**steady window**: it reads the server's ``INFO commandstats`` and every worker's client-side
counts at both ends, and counts the handoffs in between (acquisitions whose acquire returned
inside the window, by a waiter other than the previous holder):

- **client commands per handoff**: what the four clients wrote to their sockets (counted in a
  redis-py ``Connection`` subclass, ``_metering``: every command packed, pipelines included, plus
  connection set-up and health checks) / handoffs — the SPEC figure;
- **round trips per handoff**: requests written (a pipeline is one);
- **server script calls** and **server commands per handoff**: ``INFO commandstats`` over the same
  window (minus the parent's own ``INFO``); the total also counts the commands Lua scripts run
  inside the server, which are not round trips.

Every hold's ``(acquired, release started, fencing token)`` comes back: ordered by token (ours;
tokens are not consecutive) or by acquisition time (peers), no hold may begin before the
previous one's release began, and our tokens must increase with acquisition time. The gaps
between a release and the next acquisition are reported too (handoff latency under load).
Ours run twice, as ``Lock`` (target ≤ 8) and as ``FairLock`` (target ≤ 3: a release hands the
lock to the head waiter inside the script, so a handoff is the release, the new holder's
confirmation and the returning waiter's registration), with the same worker code.
Peers: python-redis-lock (a thread per waiter) and redis-py's ``Lock`` with ``sleep=0.001``
and its default ``sleep=0.1``, all with the same number of waiters as ours in the full run; the
quick run has fewer (the table says how many each had). For a polling peer a handoff is not
always to a waiter that was polling: a waiter queuing again after its pause makes one immediate
attempt, which takes a lock released a moment earlier before any poller's next poll. Either
way every command sent in the window is counted, so the figure is what that lock costs per
change of holder under this load.
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

from ._b3_worker import (
    CLOSE,
    GATE,
    OPEN,
    SNAPSHOT,
    START,
    STOP,
    B3Spec,
    Done,
    Hold,
    worker_main,
)
from ._common import OURS, WorkerError, is_ours, receive, stop_process
from ._console import Log
from ._metering import ZERO, Reading
from ._peers import available
from ._stats import command_delta, percentile

PROCESSES = 4
TARGET = 8.0  # client commands per handoff, Lock
FAIR_TARGET = 3.0  # the same, FairLock
SCRIPT_CALLS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


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
    """Cases and timings."""

    cases: tuple[Case, ...]
    warmup_s: float
    window_s: float
    think_s: float  # a waiter's pause between its release and its next acquire
    timeout_s: float
    settle_max_s: float


_OURS = OURS
_FAIR = f"{OURS}/fair"
_PRL = "python-redis-lock"
_FAST = "redis-py/sleep=0.001"
_DEFAULT = "redis-py/sleep=0.1"


def _cases(ours: int, prl: int, fast: int, default: int) -> tuple[Case, ...]:
    cases = [
        Case(_OURS, "redis-locks-async Lock", _OURS, _OURS, ours, "pub/sub wake-up"),
        Case(
            _FAIR,
            "redis-locks-async FairLock",
            _FAIR,
            _OURS,
            ours,
            "FIFO, every waiter registered, direct hand-over to the head",
        ),
        Case(
            _PRL,
            "python-redis-lock (threads)",
            _PRL,
            _PRL,
            prl,
            "one thread (and connection) per waiter, BLPOP wake-up",
        ),
        Case(
            _FAST,
            "redis-py asyncio Lock (sleep=0.001)",
            _FAST,
            "redis-py",
            fast,
            "polls every 1 ms",
        ),
        Case(
            _DEFAULT,
            "redis-py asyncio Lock (default sleep=0.1)",
            _DEFAULT,
            "redis-py",
            default,
            "polls every 100 ms",
        ),
    ]
    return tuple(case for case in cases if case.waiters)


FULL = B3Config(
    cases=_cases(1_000, 1_000, 1_000, 1_000),
    warmup_s=1.0,
    window_s=5.0,
    think_s=0.02,
    timeout_s=120.0,
    settle_max_s=10.0,
)
QUICK = B3Config(
    cases=_cases(200, 0, 40, 40),
    warmup_s=0.3,
    window_s=1.0,
    think_s=0.005,
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


def _order(holds: list[Hold], by_token: bool) -> dict[str, Any]:
    """Check that the holds of the whole run followed one another: none began before the
    previous one's release began and (``by_token``, ours) the fencing tokens increase with
    acquisition time. Ordered by token for ours, by acquisition time for the peers."""
    ordered = sorted(holds, key=lambda h: (h[2] if by_token and h[2] is not None else h[0], h[0]))
    overlaps = 0
    tokens_increase = True
    for previous, current in itertools.pairwise(ordered):
        if current[0] <= previous[1]:
            overlaps += 1
        if by_token and (current[2] is None or previous[2] is None or current[2] <= previous[2]):
            tokens_increase = False
        if by_token and current[0] <= previous[0]:
            tokens_increase = False
    result: dict[str, Any] = {"holds": len(holds), "overlaps": overlaps}
    if by_token:
        result["tokens_increase"] = tokens_increase
    return result


def _window(holds: list[Hold], begin_ns: int, end_ns: int) -> dict[str, Any]:
    """The handoffs whose acquire returned in ``[begin_ns, end_ns)``: a hold taken by another
    waiter than the previous holder (a waiter taking the lock again right after its own
    release is a *repeat*, not a handoff), and the gaps from a release to the next acquire."""
    ordered = sorted(holds)
    handoffs = repeats = 0
    gaps: list[float] = []
    for previous, current in itertools.pairwise(ordered):
        if not begin_ns <= current[0] < end_ns:
            continue
        if current[3] == previous[3]:
            repeats += 1
            continue
        handoffs += 1
        gaps.append(max(0, current[0] - previous[1]) / 1000)
    gaps.sort()
    result: dict[str, Any] = {"handoffs": handoffs, "repeats": repeats}
    if gaps:
        result["gap_median_us"] = round(gaps[len(gaps) // 2], 1)
        result["gap_p99_us"] = round(percentile(gaps, 99.0), 1)
    return result


def _snapshot(fleet: _Fleet, observer: redis.Redis) -> tuple[int, dict[str, Any], list[Reading]]:
    """One end of the window: the clock, the server's counts, then every worker's."""
    at = time.monotonic_ns()
    server = _server_counts(observer)
    readings = [message[1] for message in fleet.everyone(SNAPSHOT, "reading", 30.0)]
    assert all(isinstance(reading, Reading) for reading in readings)
    return at, server, readings


def _run_case(
    fleet: _Fleet, case: Case, url: str, prefix: str, config: B3Config, log: Log
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": case.key,
        "label": case.label,
        "note": case.note,
        "waiters": case.waiters,
        "processes": PROCESSES,
        "think_ms": config.think_s * 1000,
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
                    config.think_s,
                ),
            )
        for index in range(PROCESSES):
            fleet.expect(index, "prepared", 60.0)
        started = fleet.everyone(START, "started", 120.0)
        failed_at_start = sum(int(message[2]) for message in started)
        if failed_at_start:
            raise WorkerError(f"{failed_at_start} waiters failed while starting")
        if is_ours(case.peer):
            settle_s = _settle(observer, config.settle_max_s)
        else:
            time.sleep(0.3)
            settle_s = 0.3
        log(
            f"B3: {case.label}: {case.waiters:,} waiters over {PROCESSES} processes waiting "
            f"(settled in {settle_s:.1f} s); opening the gate, measuring {config.window_s:g} s "
            f"after {config.warmup_s:g} s…"
        )
        fleet.send(0, OPEN)
        time.sleep(config.warmup_s)
        begin_ns, before, before_clients = _snapshot(fleet, observer)
        time.sleep(config.window_s)
        end_ns, after, after_clients = _snapshot(fleet, observer)
        stopping = time.monotonic()
        deadline = stopping + config.timeout_s + 60
        for index in range(PROCESSES):
            fleet.send(index, STOP)
        dones: list[Done] = []
        for index in range(PROCESSES):
            message = fleet.expect(index, "done", max(1.0, deadline - time.monotonic()))
            dones.append(message[1])
        stop_s = time.monotonic() - stopping
        fleet.everyone(CLOSE, "closed", 30.0)
    except WorkerError as exc:
        row["error"] = str(exc)
        log(f"B3: {case.label}: {exc}", style="red")
        return row
    finally:
        observer.close()
    client = ZERO
    for earlier, later in zip(before_clients, after_clients, strict=True):
        client = client + (later - earlier)
    # Waiter numbers are per worker: make them unique across the four.
    holds = [
        (t1, t0, token, index * 1_000_000 + (number if number != GATE else 999_999))
        for index, done in enumerate(dones)
        for t1, t0, token, number in done.holds
    ]
    errors = [error for done in dones for error in done.errors]
    lost = sum(done.lost for done in dones)
    server = command_delta(before, after)
    server.pop("info", None)
    window_s = (end_ns - begin_ns) / 1e9
    row.update(
        window_s=round(window_s, 3),
        stop_s=round(stop_s, 2),
        settle_s=round(settle_s, 2),
        client_commands=client.total,
        client_round_trips=client.round_trips,
        client_commands_by_type=dict(client.commands),
        server_commands=sum(server.values()),
        server_commands_by_type=dict(sorted(server.items())),
        **_order(holds, by_token=is_ours(case.peer)),
        **_window(holds, begin_ns, end_ns),
    )
    if errors:
        row["errors"] = errors[:5]
        row["failed"] = len(errors)
    if is_ours(case.peer):
        row["leases_lost"] = lost
        if lost:
            log(
                f"B3: {case.label}: on_lost ran {lost} times over {len(holds):,} holds of a 60 s "
                "lease, each released at once without error",
                style="yellow",
            )
    handoffs = int(row["handoffs"])
    if handoffs > 0:
        rate = handoffs / window_s
        scripts = sum(server.get(command, 0) for command in SCRIPT_CALLS)
        row.update(
            handoffs_per_s=round(rate, 1),
            # Waiters pausing between their release and their next acquire, on average.
            pausing_mean=round(min(case.waiters, rate * config.think_s), 1),
            client_commands_per_handoff=round(client.total / handoffs, 2),
            client_round_trips_per_handoff=round(client.round_trips / handoffs, 2),
            server_script_calls_per_handoff=round(scripts / handoffs, 2),
            server_commands_per_handoff=round(sum(server.values()) / handoffs, 2),
            client_by_type_per_handoff={
                k: round(v / handoffs, 3) for k, v in client.commands.items()
            },
            server_by_type_per_handoff={
                k: round(v / handoffs, 3) for k, v in sorted(server.items())
            },
        )
        log(
            f"B3: {case.label}: {handoffs:,} handoffs in {window_s:.1f} s "
            f"({row['repeats']} repeats); {row['client_commands_per_handoff']} client commands "
            f"({row['client_round_trips_per_handoff']} round trips), "
            f"{row['server_script_calls_per_handoff']} script calls and "
            f"{row['server_commands_per_handoff']} server commands per handoff"
        )
    else:
        log(f"B3: {case.label}: no handoff in the window", style="yellow")
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
    fair = next((row for row in rows if row["key"] == _FAIR), {})
    fatal: list[str] = []
    for row in (ours, fair):
        if not row:
            continue
        if "error" in row:
            fatal.append(f"{row['label']}: {row['error']}")
        if row.get("failed"):
            fatal.append(f"{row['label']}: {row['failed']} waiters failed: {row.get('errors')}")
        if row.get("overlaps"):
            fatal.append(
                f"{row['label']}: {row['overlaps']} holds began before the previous release"
            )
        if row.get("tokens_increase") is False:
            fatal.append(f"{row['label']}: fencing tokens did not increase in acquisition order")
        if "error" not in row and not row.get("handoffs"):
            fatal.append(f"{row['label']}: no handoff in the measuring window")
    value = ours.get("client_commands_per_handoff")
    fair_value = fair.get("client_commands_per_handoff")
    lock_met = value is not None and value <= TARGET
    fair_met = fair_value is not None and fair_value <= FAIR_TARGET
    waiters = ours.get("waiters")
    scale = f"{waiters:,}" if isinstance(waiters, int) else "?"

    def shown(figure: float | None) -> str:
        return "—" if figure is None else f"{figure:.2f}"

    return {
        "scenario": "B3",
        "title": "Redis commands per handoff, many waiters over 4 processes",
        "config": {
            "processes": PROCESSES,
            "warmup_s": config.warmup_s,
            "window_s": config.window_s,
            "think_ms": config.think_s * 1000,
            "timeout_s": config.timeout_s,
        },
        "rows": rows,
        "skipped": skipped,
        "target": {
            "text": f"Lock ≤ {TARGET:g}, FairLock ≤ {FAIR_TARGET:g} client commands per "
            f"handoff ({scale} waiters over {PROCESSES} processes)",
            "limit": TARGET,
            "fair_limit": FAIR_TARGET,
            "value": value,
            "fair_value": fair_value,
            "value_text": f"Lock {shown(value)}, FairLock {shown(fair_value)} commands/handoff",
            "met": lock_met and fair_met and not fatal,
            "lock_met": lock_met,
            "fair_met": fair_met,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
