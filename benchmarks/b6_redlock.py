"""B6 — RedLock acquire latency on 5 masters against one, and with one master stopped.

The scenario starts five servers of its own (the run's binary, ``tests.servers.running_servers``)
and times one task's ``acquire(); release()`` cycles, acquire and release separately:

* ``Lock`` on one master, and ``RedLock`` over one master — the **single-master acquire**, the
  reference of every ratio;
* ``RedLock`` over the five masters — SPEC §5 asks for ≤ 1.5 x the single-master acquire
  (median);
* pottery's ``AIORedlock`` over one and over five masters, side by side.

These run in interleaved rounds, each round in a rotated order, so the machine's drift falls on
all of them alike. Then one master is SIGSTOPped (it keeps its connections but answers nothing)
and ``RedLock`` and ``AIORedlock`` over the five run again: SPEC §5 asks that ours still
acquires within ``node_timeout`` + 2 RTT (RTT: the median ``PING`` of a live master). Every
cycle runs under a hard time limit (:data:`HANG_AFTER`) so that a hang is reported, not waited
for. aioredlock is listed as not measured (it does not install here).

The run fails when one of ours errors or hangs; a peer's error or hang is a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from redis_locks_async import Lock, RedLock
from tests.servers import running_servers

from ._common import OURS, describe
from ._console import Log
from ._peers import available
from ._stats import fmt_ratio, ratio, summarize_ns

HANG_AFTER = 12.0  # seconds one acquire + release may take before it is reported as a hang
MASTERS = 5
TARGET = 1.5  # x the single-master RedLock acquire (median)
REFERENCE = f"{OURS}/redlock:1"

Cycle = Callable[[], Awaitable[tuple[int, int]]]


@dataclass(frozen=True, slots=True)
class B6Config:
    """How much to measure."""

    cycles: int  # per row, split over the rounds
    rounds: int
    warmup: int  # per row, before its first round
    stopped_cycles: int  # ours, one master stopped
    peer_stopped_cycles: int  # pottery, one master stopped (each cycle may wait seconds)
    pings: int


FULL = B6Config(2000, 4, 100, 500, 3, 200)
QUICK = B6Config(100, 1, 10, 25, 0, 50)


@dataclass(slots=True)
class _Row:
    """One measured configuration and its samples."""

    key: str
    label: str
    cycle: Cycle
    acquires: list[int] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)
    error: str = ""
    hang: bool = False

    @property
    def done(self) -> bool:
        return self.hang or bool(self.error)


def _timed(
    acquire: Callable[[], Awaitable[bool]], release: Callable[[], Awaitable[object]]
) -> Cycle:
    async def cycle() -> tuple[int, int]:
        start = time.perf_counter_ns()
        if not await acquire():
            raise TimeoutError("acquire timed out")
        mid = time.perf_counter_ns()
        await release()
        return mid - start, time.perf_counter_ns() - mid

    return cycle


def _ours(lock: Lock | RedLock) -> Cycle:
    return _timed(lambda: lock.acquire(timeout=HANG_AFTER), lock.release)


def _pottery(masters: Sequence[aioredis.Redis], name: str) -> Cycle:
    from pottery import AIORedlock

    lock = AIORedlock(key=name, masters=set(masters), auto_release_time=10)
    return _timed(lambda: lock.acquire(timeout=HANG_AFTER), lock.release)


async def _measure(row: _Row, count: int, warmup: int, log: Log) -> None:
    """``warmup`` untimed then ``count`` timed cycles of ``row``; a hang or an error ends it."""
    started = time.perf_counter()
    try:
        for i in range(warmup + count):
            acquire_ns, release_ns = await asyncio.wait_for(row.cycle(), HANG_AFTER)
            if i >= warmup:
                row.acquires.append(acquire_ns)
                row.releases.append(release_ns)
    except (asyncio.TimeoutError, TimeoutError):
        row.hang = True
        log(
            f"B6: {row.label}: HANG (no acquire + release within {HANG_AFTER:g} s; "
            f"{time.perf_counter() - started:.1f} s in this round)",
            style="yellow",
        )
    except Exception as exc:  # a peer failing is a result, not a crash of the benchmark
        row.error = describe(exc)
        log(f"B6: {row.label}: {row.error}", style="red")


async def _ping_median_us(client: aioredis.Redis, count: int) -> float:
    samples = []
    for _ in range(count):
        start = time.perf_counter_ns()
        await client.ping()
        samples.append(time.perf_counter_ns() - start)
    return summarize_ns(samples).median_us


async def _play(
    urls: Sequence[str],
    pause: Callable[[], None],
    resume: Callable[[], None],
    prefix: str,
    config: B6Config,
    log: Log,
) -> tuple[list[_Row], float, float]:
    """Measure every row; returns the rows, the median PING (µs) and RedLock's node timeout."""
    opened: list[aioredis.Redis] = []

    def connect() -> list[aioredis.Redis]:
        clients = [aioredis.Redis.from_url(url) for url in urls]
        opened.extend(clients)
        return clients

    clients = connect()
    name = f"{prefix}b6:"
    try:
        rtt_us = await _ping_median_us(clients[0], config.pings)
        five = RedLock(clients, f"{name}redlock:5")
        rows = [
            _Row(f"{OURS}/lock:1", "Lock, 1 master", _ours(Lock(clients[0], f"{name}lock:1"))),
            _Row(REFERENCE, "RedLock, 1 master", _ours(RedLock(clients[:1], f"{name}redlock:1"))),
            _Row(f"{OURS}/redlock:5", "RedLock, 5 masters", _ours(five)),
        ]
        has_pottery = available("pottery")
        if has_pottery:
            rows += [
                _Row(
                    "pottery:1", "pottery AIORedlock, 1 master", _pottery(clients[:1], f"{name}p1")
                ),
                _Row("pottery:5", "pottery AIORedlock, 5 masters", _pottery(clients, f"{name}p5")),
            ]
        per_round = max(1, config.cycles // config.rounds)
        log(
            f"B6: {per_round * config.rounds} cycles per row in {config.rounds} rounds; "
            f"PING median {rtt_us / 1000:.3f} ms"
        )
        for round_index in range(config.rounds):
            shift = round_index % len(rows)
            for row in rows[shift:] + rows[:shift]:
                if not row.done:
                    warmup = config.warmup if round_index == 0 else 0
                    await _measure(row, per_round, warmup, log)
        # With a master stopped, requests to it stay in flight (until redis-py's socket time-out)
        # and hold their pooled connections; once the pool's 100 are taken, every request to
        # that master fails at once. So each library gets fresh clients of its own here, each
        # with one connection already open per master, as a running application has.
        ours_clients = connect()
        stopped_lock = RedLock(ours_clients, f"{name}redlock:stopped")
        ours_stopped = _Row(
            f"{OURS}/redlock:5-stopped", "RedLock, 5 masters, 1 stopped", _ours(stopped_lock)
        )
        stopped = [(ours_stopped, config.stopped_cycles, config.warmup // 4)]
        if has_pottery and config.peer_stopped_cycles:
            pottery_stopped = _Row(
                "pottery:5-stopped",
                "pottery AIORedlock, 5 masters, 1 stopped",
                _pottery(connect(), f"{name}p-stopped"),
            )
            stopped.append((pottery_stopped, config.peer_stopped_cycles, 0))
        await asyncio.gather(*(client.ping() for client in opened[len(clients) :]))
        log(
            "B6: one master SIGSTOPped; "
            + ", ".join(f"{row.label}: {cycles} cycles" for row, cycles, _ in stopped)
        )
        pause()
        try:
            for row, cycles, warmup in stopped:
                await _measure(row, cycles, warmup, log)
        finally:
            resume()
        return rows + [row for row, _, _ in stopped], rtt_us, five.node_timeout
    finally:
        for client in opened:
            with contextlib.suppress(Exception):
                await client.aclose()


def _single_reference(key: str) -> str:
    """The 1-master row a row's "x its own 1 master" ratio is taken to."""
    return "pottery:1" if key.startswith("pottery") else REFERENCE


def _result_rows(rows: Sequence[_Row], log: Log) -> list[dict[str, Any]]:
    summaries = {row.key: summarize_ns(row.acquires) for row in rows if row.acquires}
    reference = summaries.get(REFERENCE)
    out: list[dict[str, Any]] = []
    for row in rows:
        entry: dict[str, Any] = {"key": row.key, "label": row.label}
        if row.hang:
            entry["hang_after_s"] = HANG_AFTER
        if row.error:
            entry["error"] = row.error
        acquire = summaries.get(row.key)
        if acquire is not None:
            own = summaries.get(_single_reference(row.key))
            entry.update(
                cycles=acquire.n,
                acquire=acquire.as_dict(),
                release_median_us=round(summarize_ns(row.releases).median_us, 3),
            )
            if reference is not None:
                entry["ratio_median"] = ratio(acquire.median_us, reference.median_us)
                entry["ratio_p99"] = ratio(acquire.p99_us, reference.p99_us)
            if own is not None:
                entry["ratio_own_single"] = ratio(acquire.median_us, own.median_us)
            log(
                f"B6: {row.label:<42} acquire median {acquire.median_us / 1000:7.3f} ms  "
                f"p99 {acquire.p99_us / 1000:7.3f} ms  = {entry.get('ratio_median')} x "
                f"RedLock on 1 master"
            )
        elif not row.hang:
            entry.setdefault("error", "no samples")
        out.append(entry)
    return out


def run(binary: Path, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B6 on five servers of ``binary`` and return its JSON-ready result."""
    config = QUICK if quick else FULL
    with running_servers(binary, MASTERS) as servers:
        log(f"B6: {MASTERS} masters on ports {', '.join(str(s.port) for s in servers)}")
        urls = [server.url for server in servers]
        stopped_server = servers[-1]  # SIGSTOPped for the last rows
        measured, rtt_us, node_timeout = asyncio.run(
            _play(urls, stopped_server.pause, stopped_server.resume, prefix, config, log)
        )
    rows = _result_rows(measured, log)
    by_key = {row["key"]: row for row in rows}
    five = by_key.get(f"{OURS}/redlock:5", {}).get("ratio_median")
    stopped_acquire = by_key.get(f"{OURS}/redlock:5-stopped", {}).get("acquire")
    stopped_ms = None if stopped_acquire is None else stopped_acquire["median_us"] / 1000
    bound_ms = node_timeout * 1000 + 2 * rtt_us / 1000
    five_met = five is not None and five <= TARGET
    stopped_met = stopped_ms is not None and stopped_ms <= bound_ms
    stopped_text = "—" if stopped_ms is None else f"{stopped_ms:.3f} ms"
    skipped = {} if available("aioredlock") else {"aioredlock": "not installed"}
    if not config.peer_stopped_cycles:
        skipped["pottery AIORedlock, 5 masters, 1 stopped"] = (
            "not in a quick run: a cycle can take seconds"
        )
    fatal = [
        f"{row['label']}: " + ("hang" if row.get("hang_after_s") else str(row.get("error")))
        for row in rows
        if row["key"].startswith(OURS) and ("error" in row or "hang_after_s" in row)
    ]
    return {
        "scenario": "B6",
        "title": "RedLock on 5 masters",
        "config": {
            "masters": MASTERS,
            "cycles": config.cycles,
            "rounds": config.rounds,
            "stopped_cycles": config.stopped_cycles,
            "peer_stopped_cycles": config.peer_stopped_cycles,
            "hang_after_s": HANG_AFTER,
        },
        "reference": "RedLock on 1 master (acquire), same run",
        "ping_median_us": round(rtt_us, 1),
        "node_timeout_s": node_timeout,
        "stopped_bound_ms": round(bound_ms, 3),
        "rows": rows,
        "skipped": skipped,
        "target": {
            "text": f"RedLock on 5 masters ≤ {TARGET} x RedLock on 1 master (median acquire); "
            "with one master SIGSTOPped, acquires within node_timeout + 2 RTT (median)",
            "limit": TARGET,
            "value": [five, stopped_ms],
            "value_text": f"{fmt_ratio(five)} x — {'met' if five_met else 'not met'}; "
            f"stopped: {stopped_text} against {bound_ms:.1f} ms — "
            f"{'met' if stopped_met else 'not met'}",
            "met": five_met and stopped_met,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
