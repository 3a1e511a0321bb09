"""B1 — uncontended acquire + release by one task, against two bare ``EVALSHA`` round trips.

One process, one task, one ``redis.asyncio`` client shared by the asyncio peers (the sync peer,
python-redis-lock, has its own sync client; aioredlock brings its own aioredis connection). Each
peer repeats ``acquire(); release()`` on a lock nobody else wants. To spread the machine's noise
evenly, the cycles are split into rounds and every round measures each entry once, in a rotating
order. The **reference** is two ``EVALSHA`` calls of ``return 1`` with the shape of our acquire
and release: what two script round trips cost through redis.asyncio before any lock logic.
SPEC §5 asks our ``Lock`` for ≤ 1.2 x that, and no slower than redis-py's ``Lock`` in the same
run (median). Ratios to the median ``PING`` are kept too. Commands per cycle come from
``INFO commandstats`` deltas around each block (our own ``INFO`` calls excluded).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import redis
import redis.asyncio as aioredis

from ._console import Log
from ._peers import available
from ._stats import command_delta, fmt_ratio, ratio, summarize_ns

Cycle = Callable[[], Awaitable[None]]
SyncCycle = Callable[[], None]


@dataclass(frozen=True, slots=True)
class B1Config:
    """How much to measure."""

    cycles: int
    rounds: int
    warmup: int


FULL = B1Config(cycles=2000, rounds=5, warmup=100)
QUICK = B1Config(cycles=300, rounds=3, warmup=30)
TARGET = 1.2  # x two bare EVALSHA round trips (median)


@dataclass(slots=True)
class _Entry:
    key: str
    label: str
    run_async: Cycle | None = None
    run_sync: SyncCycle | None = None
    note: str = ""
    samples: list[int] = field(default_factory=list)
    commands: dict[str, int] = field(default_factory=dict)
    cycles: int = 0
    error: str = ""


async def _ours(client: aioredis.Redis, name: str, *, auto_renew: bool) -> Cycle:
    from redis_locks_async import Lock

    lock = Lock(client, name, lease=30.0, auto_renew=auto_renew)

    async def cycle() -> None:
        if not await lock.acquire(timeout=5):
            raise RuntimeError("uncontended acquire timed out")
        await lock.release()

    return cycle


async def _redis_py(client: aioredis.Redis, name: str) -> Cycle:
    from redis.asyncio.lock import Lock as RedisPyLock

    lock = RedisPyLock(client, name, timeout=30.0)

    async def cycle() -> None:
        if not await lock.acquire():
            raise RuntimeError("uncontended acquire failed")
        await lock.release()

    return cycle


async def _pottery(client: aioredis.Redis, name: str) -> Cycle:
    from pottery import AIORedlock

    lock = AIORedlock(key=name, masters={client}, auto_release_time=30.0)

    async def cycle() -> None:
        if not await lock.acquire():
            raise RuntimeError("uncontended acquire failed")
        await lock.release()

    return cycle


async def _aioredlock(url: str, name: str) -> tuple[Cycle, Callable[[], Awaitable[None]]]:
    from aioredlock import Aioredlock

    parts = urlparse(url)
    manager = Aioredlock([{"host": parts.hostname, "port": parts.port}])

    async def cycle() -> None:
        lock = await manager.lock(name, lock_timeout=30)
        await manager.unlock(lock)

    async def close() -> None:
        await manager.destroy()

    return cycle, close


def _python_redis_lock(client: redis.Redis, name: str) -> SyncCycle:
    import redis_lock

    lock = redis_lock.Lock(client, name, expire=30)

    def cycle() -> None:
        if not lock.acquire(blocking=False):
            raise RuntimeError("uncontended acquire failed")
        lock.release()

    return cycle


async def _info(client: aioredis.Redis) -> dict[str, Any]:
    reply: dict[str, Any] = await client.info("commandstats")
    return reply


async def _measure(entry: _Entry, count: int, client: aioredis.Redis, record: bool) -> None:
    before = await _info(client)
    samples = entry.samples if record else []
    clock = time.perf_counter_ns
    if entry.run_async is not None:
        run = entry.run_async
        for _ in range(count):
            started = clock()
            await run()
            samples.append(clock() - started)
    else:
        assert entry.run_sync is not None
        run_sync = entry.run_sync
        for _ in range(count):
            started = clock()
            run_sync()
            samples.append(clock() - started)
    after = await _info(client)
    if record:
        entry.cycles += count
        for command, calls in command_delta(before, after).items():
            if command != "info":
                entry.commands[command] = entry.commands.get(command, 0) + calls


async def _run(url: str, prefix: str, config: B1Config, log: Log) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url)
    sync_client = redis.Redis.from_url(url)
    closers: list[Callable[[], Awaitable[None]]] = []

    async def ping() -> None:
        await client.ping()

    def sync_ping() -> None:
        sync_client.ping()

    trivial = await client.script_load("return 1")
    trivial_keys = tuple(f"{prefix}b1:trivial:{i}" for i in range(4))

    async def two_evalsha() -> None:
        # The same shape as our acquire + release (4 keys, 4 arguments each), no Lua work:
        # what two script round trips cost through redis.asyncio before any lock logic.
        await client.evalsha(trivial, 4, *trivial_keys, "0" * 32, 30000, "try", 2000)
        await client.evalsha(trivial, 4, *trivial_keys, "0" * 32, "channel", "one", "0")

    entries = [
        _Entry("ping", "PING (redis.asyncio)", run_async=ping),
        _Entry(
            "2x-evalsha",
            "2 EVALSHA of `return 1` (reference)",
            run_async=two_evalsha,
            note="no lock logic: the client cost of two script calls",
        ),
        _Entry(
            "redis-locks-async",
            "redis-locks-async Lock",
            run_async=await _ours(client, f"{prefix}b1:ours", auto_renew=True),
            note="auto_renew=True (default)",
        ),
        _Entry(
            "redis-locks-async/no-renew",
            "redis-locks-async Lock (auto_renew=False)",
            run_async=await _ours(client, f"{prefix}b1:ours-norenew", auto_renew=False),
        ),
        _Entry(
            "redis-py",
            "redis-py asyncio Lock",
            run_async=await _redis_py(client, f"{prefix}b1:redis-py"),
        ),
    ]
    if available("pottery"):
        cycle = await _pottery(client, f"{prefix}b1:pottery")
        entries.append(_Entry("pottery", "pottery AIORedlock (1 master)", run_async=cycle))
    if available("aioredlock"):
        cycle, close = await _aioredlock(url, f"{prefix}b1:aioredlock")
        closers.append(close)
        entries.append(
            _Entry(
                "aioredlock",
                "aioredlock (1 instance)",
                run_async=cycle,
                note="aioredis 1.x connection",
            )
        )
    entries.append(_Entry("ping-sync", "PING (sync redis-py)", run_sync=sync_ping))
    if available("python-redis-lock"):
        entries.append(
            _Entry(
                "python-redis-lock",
                "python-redis-lock (sync)",
                run_sync=_python_redis_lock(sync_client, f"{prefix}b1:prl"),
                note="sync client; ratio is to the asyncio PING",
            )
        )
    skipped = {
        key: "not available"
        for key in ("pottery", "aioredlock", "python-redis-lock")
        if not available(key)
    }

    try:
        log(f"B1: warming up {len(entries)} entries ({config.warmup} cycles each)")
        for entry in entries:
            try:
                await _measure(entry, config.warmup, client, record=False)
            except Exception as exc:
                entry.error = f"{type(exc).__name__}: {exc}"
        per_round = max(1, config.cycles // config.rounds)
        for round_index in range(config.rounds):
            order = entries[round_index % len(entries) :] + entries[: round_index % len(entries)]
            for entry in order:
                if entry.error:
                    continue
                try:
                    await _measure(entry, per_round, client, record=True)
                except Exception as exc:
                    entry.error = f"{type(exc).__name__}: {exc}"
            log(f"B1: round {round_index + 1}/{config.rounds} done ({per_round} cycles per entry)")
    finally:
        for close in closers:
            try:
                await close()
            except Exception as exc:
                log(f"B1: closing a peer failed: {exc!r}", style="yellow")
        await client.aclose()
        sync_client.close()

    by_key = {entry.key: entry for entry in entries}
    ping_summary = summarize_ns(by_key["ping"].samples) if by_key["ping"].samples else None
    if ping_summary is None:
        raise RuntimeError(f"B1: PING could not be measured: {by_key['ping'].error}")
    evalsha_entry = by_key["2x-evalsha"]
    if not evalsha_entry.samples:
        raise RuntimeError(f"B1: 2 EVALSHA could not be measured: {evalsha_entry.error}")
    evalsha_summary = summarize_ns(evalsha_entry.samples)
    rows: list[dict[str, Any]] = []
    for entry in entries:
        row: dict[str, Any] = {"key": entry.key, "label": entry.label, "note": entry.note}
        if entry.error or not entry.samples:
            row["error"] = entry.error or "no samples"
            rows.append(row)
            continue
        summary = summarize_ns(entry.samples)
        per_cycle = {cmd: round(calls / entry.cycles, 3) for cmd, calls in entry.commands.items()}
        row.update(
            summary=summary.as_dict(),
            ratio_evalsha=ratio(summary.median_us, evalsha_summary.median_us),
            ratio_median=ratio(summary.median_us, ping_summary.median_us),
            ratio_p99=ratio(summary.p99_us, ping_summary.median_us),
            commands_per_cycle=round(sum(entry.commands.values()) / entry.cycles, 3),
            commands_by_type=per_cycle,
        )
        rows.append(row)
        log(
            f"B1: {entry.label:<44} median {summary.median_us:8.1f} µs  "
            f"p99 {summary.p99_us:8.1f} µs  = {row['ratio_evalsha']} x 2 EVALSHA, "
            f"{row['ratio_median']} x PING"
        )
    ours = next(r for r in rows if r["key"] == "redis-locks-async")
    redis_py = next((r for r in rows if r["key"] == "redis-py" and "summary" in r), None)
    vs_redis_py = (
        ratio(ours["summary"]["median_us"], redis_py["summary"]["median_us"])
        if redis_py is not None and "summary" in ours
        else None
    )
    value = ours.get("ratio_evalsha")
    met = value is not None and value <= TARGET and vs_redis_py is not None and vs_redis_py <= 1.0
    return {
        "scenario": "B1",
        "title": "Uncontended acquire + release, one task",
        "cycles": config.cycles,
        "rounds": config.rounds,
        "reference": "median of two bare EVALSHA round trips (redis.asyncio), same run",
        "evalsha_median_us": round(evalsha_summary.median_us, 3),
        "ping_median_us": round(ping_summary.median_us, 3),
        "rows": rows,
        "skipped": skipped,
        "target": {
            "text": f"Lock ≤ {TARGET} x 2 EVALSHA and no slower than redis-py's Lock (median)",
            "limit": TARGET,
            "value": [value, vs_redis_py],
            "value_text": f"{fmt_ratio(value)} x 2 EVALSHA, {fmt_ratio(vs_redis_py)} x redis-py",
            "met": met,
        },
        "failed": "error" in ours,
    }


def run(url: str, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B1 and return its JSON-ready result."""
    return asyncio.run(_run(url, prefix, QUICK if quick else FULL, log))
