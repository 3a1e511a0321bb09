"""B9 — ``ReadWriteLock``: read throughput with one writer, against readers alone.

One process, one client (a ``BlockingConnectionPool`` of 64 metered connections). 200 reader
tasks on 4 names (50 each, sharing that name's ``ReadWriteLock``) loop ``async with rw.read``
around a 1 ms read. In the second phase one writer task joins them: it pauses 20 ms, takes
``rw.write`` on the next name (round-robin), holds it 1 ms, releases, again. The two phases
alternate in rounds (fresh names each time) so the machine's drift hits both alike; each is
measured over a steady window (``_steady``): reads/s, writes/s, client commands and round trips
per acquisition (reads and writes together), server commands per acquisition, the writer's wait
(acquire called → returned), a reader's average cycle time, and the most readers seen inside one
name at once (they share). The headline is the read throughput with the writer as a fraction of
readers alone. 200 looping readers keep the process's event loop (and its 64 connections)
saturated, so a reader's cycle takes far longer than its 1 ms hold; a writer that registers
waits for the readers inside to leave, which is about one such cycle — the writer's wait is to
be read against the reader cycle time, not against the hold.

Checked on the way: a writer is never inside a name while a reader is (in-process counters: all
holders are in this process), readers do overlap, and the writer is not starved (it completes
writes in every window: writer preference keeps new readers out while it waits). ``on_lost``
calls are counted (30 s leases released within milliseconds should never be lost).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from ._console import Log
from ._metering import Meter, Reading, metered_client
from ._stats import percentile, ratio
from ._steady import Window, measure, per_acquisition, stop

POOL = 64
NAMES = 4
READERS = 200
READ_HOLD_S = 0.001
WRITE_HOLD_S = 0.001
WRITE_PAUSE_S = 0.020


@dataclass(frozen=True, slots=True)
class B9Config:
    """How much to measure."""

    rounds: int
    warmup_s: float
    window_s: float


FULL = B9Config(rounds=3, warmup_s=0.5, window_s=2.0)
QUICK = B9Config(rounds=1, warmup_s=0.2, window_s=0.5)
WARM = B9Config(rounds=1, warmup_s=0.1, window_s=0.2)

PHASES = (("readers", "200 readers alone", False), ("writer", "200 readers + 1 writer", True))


@dataclass(slots=True)
class _Tally:
    seconds: float = 0.0
    reads: int = 0
    writes: int = 0
    client: Reading = field(default_factory=lambda: Reading({}, 0))
    server: dict[str, int] = field(default_factory=dict)
    write_waits_ms: list[float] = field(default_factory=list)
    peak_readers: int = 0
    overlaps: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, window: Window, waits_ms: list[float]) -> None:
        self.seconds += window.seconds
        self.reads += window.counts["reads"]
        self.writes += window.counts["writes"]
        self.client = self.client + window.client
        for command, calls in window.server.items():
            self.server[command] = self.server.get(command, 0) + calls
        self.write_waits_ms += waits_ms


async def _one_window(
    client: aioredis.Redis,
    meter: Meter,
    observer: aioredis.Redis,
    names: list[str],
    writer: bool,
    config: B9Config,
    tally: _Tally,
) -> None:
    from redis_locks_async import ReadWriteLock

    def lost(lease: object) -> None:
        tally.lost += 1

    locks = {name: ReadWriteLock(client, name, timeout=60.0, on_lost=lost) for name in names}
    readers = dict.fromkeys(names, 0)
    writing = dict.fromkeys(names, 0)
    counts = {"reads": 0}
    waits_ms: list[float] = []
    stopping = asyncio.Event()

    async def read(name: str) -> None:
        rw = locks[name]
        while not stopping.is_set():
            async with rw.read:
                readers[name] += 1
                tally.peak_readers = max(tally.peak_readers, readers[name])
                if writing[name]:
                    tally.overlaps += 1
                await asyncio.sleep(READ_HOLD_S)
                readers[name] -= 1
                counts["reads"] += 1

    async def write() -> None:
        turn = 0
        while not stopping.is_set():
            await asyncio.sleep(WRITE_PAUSE_S)
            name = names[turn % len(names)]
            turn += 1
            called = time.perf_counter()
            async with locks[name].write:
                waits_ms.append((time.perf_counter() - called) * 1000)
                writing[name] += 1
                if readers[name] or writing[name] > 1:
                    tally.overlaps += 1
                await asyncio.sleep(WRITE_HOLD_S)
                writing[name] -= 1

    tasks = [asyncio.create_task(read(names[i % len(names)])) for i in range(READERS)]
    if writer:
        tasks.append(asyncio.create_task(write()))
    try:
        window = await measure(
            observer,
            meter,
            lambda: {"reads": counts["reads"], "writes": len(waits_ms)},
            config.warmup_s,
            config.window_s,
        )
    finally:
        stopping.set()
        tally.errors += await stop(tasks)
    first = window.start["writes"]
    tally.add(window, waits_ms[first : first + window.counts["writes"]])


def _row(key: str, label: str, tally: _Tally) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": key,
        "label": label,
        "readers": READERS,
        "names": NAMES,
        "writer": key == "writer",
        "seconds": round(tally.seconds, 3),
        "reads": tally.reads,
        "writes": tally.writes,
        "peak_readers_per_name": tally.peak_readers,
        "overlaps": tally.overlaps,
        "leases_lost": tally.lost,
    }
    if tally.errors:
        row["error"] = "; ".join(tally.errors[:3])
        row["failed"] = len(tally.errors)
    if tally.seconds > 0:
        row["reads_per_s"] = round(tally.reads / tally.seconds, 1)
        row["writes_per_s"] = round(tally.writes / tally.seconds, 1)
    if tally.reads:
        # How long one reader's cycle takes on average (every reader loops without pause):
        # what a writer waits for the readers already inside to leave, once new ones queue.
        row["reader_cycle_ms"] = round(READERS * tally.seconds / tally.reads * 1000, 2)
    server = {k: v for k, v in tally.server.items() if k != "info"}
    window = Window(tally.seconds, {}, {}, tally.client, server)
    row.update(per_acquisition(window, tally.reads + tally.writes))
    if tally.write_waits_ms:
        waits = sorted(tally.write_waits_ms)
        row["write_wait_median_ms"] = round(statistics.median(waits), 3)
        row["write_wait_p99_ms"] = round(percentile(waits, 99.0), 3)
        row["write_wait_max_ms"] = round(waits[-1], 3)
    return row


async def _run(url: str, prefix: str, config: B9Config, log: Log) -> list[dict[str, Any]]:
    meter = Meter()
    client = metered_client(url, meter, max_connections=POOL)
    observer = aioredis.Redis.from_url(url)
    tallies = {key: _Tally() for key, _, _ in PHASES}
    try:
        # warm-up: connections opened, scripts loaded, the runtime and subscription created
        warm = [f"{prefix}b9:warm:{i}" for i in range(NAMES)]
        await _one_window(client, meter, observer, warm, True, WARM, _Tally())
        for round_index in range(config.rounds):
            order = PHASES if round_index % 2 == 0 else PHASES[::-1]
            for key, _, writer in order:
                tally = tallies[key]
                if tally.errors:
                    continue
                names = [f"{prefix}b9:{key}:{round_index}:{i}" for i in range(NAMES)]
                await _one_window(client, meter, observer, names, writer, config, tally)
            log(f"B9: round {round_index + 1}/{config.rounds} done")
    finally:
        await client.aclose()
        await observer.aclose()
    return [_row(key, label, tallies[key]) for key, label, _ in PHASES]


def run(url: str, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B9 and return its JSON-ready result."""
    config = QUICK if quick else FULL
    rows = asyncio.run(_run(url, prefix, config, log))
    alone, mixed = rows
    value = ratio(mixed.get("reads_per_s", 0.0), alone.get("reads_per_s", 0.0))
    mixed["read_ratio"] = value
    alone["read_ratio"] = 1.0 if "reads_per_s" in alone else None
    for row in rows:
        log(
            f"B9: {row['label']}: {row.get('reads_per_s')} reads/s, {row.get('writes_per_s')} "
            f"writes/s, {row.get('client_commands_per_acquisition')} client commands per "
            f"acquisition; up to {row['peak_readers_per_name']} readers at once on a name"
            + (
                f"; writer waited {row['write_wait_median_ms']} ms (median), "
                f"{row['write_wait_p99_ms']} ms (p99)"
                if "write_wait_median_ms" in row
                else ""
            )
        )
    fatal: list[str] = []
    for row in rows:
        if "error" in row:
            fatal.append(f"{row['label']}: {row['error']}")
        if row["overlaps"]:
            fatal.append(
                f"{row['label']}: a writer overlapped other holders {row['overlaps']} times"
            )
        if row["leases_lost"]:
            log(
                f"B9: {row['label']}: on_lost ran {row['leases_lost']} times for leases "
                "released at once without error",
                style="yellow",
            )
    starved = not mixed.get("writes")
    if starved:
        fatal.append(f"{mixed['label']}: the writer completed no write in the windows")
    shared = alone["peak_readers_per_name"] > 1
    return {
        "scenario": "B9",
        "title": "ReadWriteLock read throughput with one writer",
        "config": {
            "readers": READERS,
            "names": NAMES,
            "read_hold_ms": READ_HOLD_S * 1000,
            "write_hold_ms": WRITE_HOLD_S * 1000,
            "write_pause_ms": WRITE_PAUSE_S * 1000,
            "rounds": config.rounds,
            "warmup_s": config.warmup_s,
            "window_s": config.window_s,
            "pool_size": POOL,
        },
        "rows": rows,
        "skipped": {},
        "target": {
            "text": "no SPEC figure: reads/s with one writer as x readers alone; readers "
            "share a name, the writer excludes them and is not starved",
            "value": value,
            "value_text": f"{'—' if value is None else f'{value:.2f}'} x readers alone, "
            f"{mixed.get('writes_per_s')} writes/s, up to {alone['peak_readers_per_name']} "
            "readers at once",
            "met": value is not None and shared and not fatal,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
