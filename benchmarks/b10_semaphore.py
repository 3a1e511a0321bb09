"""B10 — ``Semaphore(N)``: throughput against N, and the peak concurrency it allows.

One process, one client (a ``BlockingConnectionPool`` of 64 metered connections). For each N in
1, 2, 4, 8, 16: 64 tasks share one ``Semaphore(client, name, N)`` and loop ``async with sem``
around a 2 ms hold. Each N is measured over a steady window (``_steady``), in rounds that visit
the N in alternating order (fresh names each time) so the machine's drift hits them alike.
Reported per N: acquisitions/s (and as x N=1), the ceiling the hold alone allows (N / hold),
client commands and round trips per acquisition, server commands per acquisition, and the
**peak concurrency** — the most tasks inside the semaphore at once, counted in-process (every
holder is in this process, and a task counts itself in only after its acquire returned and out
before its release starts, so the count can never exceed the server's). It must equal N: more
is a broken semaphore (the run fails), fewer means the load never filled it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from ._console import Log
from ._metering import Meter, Reading, metered_client
from ._stats import ratio
from ._steady import Window, measure, per_acquisition, stop

POOL = 64
TASKS = 64
HOLD_S = 0.002
PERMITS = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class B10Config:
    """How much to measure."""

    rounds: int
    warmup_s: float
    window_s: float


FULL = B10Config(rounds=2, warmup_s=0.3, window_s=1.5)
QUICK = B10Config(rounds=1, warmup_s=0.1, window_s=0.3)
WARM = B10Config(rounds=1, warmup_s=0.1, window_s=0.2)


@dataclass(slots=True)
class _Tally:
    seconds: float = 0.0
    acquisitions: int = 0
    client: Reading = field(default_factory=lambda: Reading({}, 0))
    server: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, window: Window) -> None:
        self.seconds += window.seconds
        self.acquisitions += window.counts["acquisitions"]
        self.client = self.client + window.client
        for command, calls in window.server.items():
            self.server[command] = self.server.get(command, 0) + calls


async def _one_window(
    client: aioredis.Redis,
    meter: Meter,
    observer: aioredis.Redis,
    name: str,
    permits: int,
    config: B10Config,
    tally: _Tally,
) -> None:
    from redis_locks_async import Semaphore

    def lost(lease: object) -> None:
        tally.lost += 1

    sem = Semaphore(client, name, permits, timeout=60.0, on_lost=lost)
    inside = {"now": 0, "acquisitions": 0}
    stopping = asyncio.Event()

    async def cycle() -> None:
        while not stopping.is_set():
            async with sem:
                inside["now"] += 1
                tally.peak = max(tally.peak, inside["now"])
                await asyncio.sleep(HOLD_S)
                inside["now"] -= 1
                inside["acquisitions"] += 1

    tasks = [asyncio.create_task(cycle()) for _ in range(TASKS)]
    try:
        window = await measure(
            observer,
            meter,
            lambda: {"acquisitions": inside["acquisitions"]},
            config.warmup_s,
            config.window_s,
        )
    finally:
        stopping.set()
        tally.errors += await stop(tasks)
    tally.add(window)


def _row(permits: int, tally: _Tally) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": f"N={permits}",
        "label": f"Semaphore({permits})",
        "permits": permits,
        "tasks": TASKS,
        "hold_ms": HOLD_S * 1000,
        "seconds": round(tally.seconds, 3),
        "acquisitions": tally.acquisitions,
        "peak_concurrency": tally.peak,
        "leases_lost": tally.lost,
        "ceiling_per_s": round(permits / HOLD_S, 1),
    }
    if tally.errors:
        row["error"] = "; ".join(tally.errors[:3])
        row["failed"] = len(tally.errors)
    if tally.seconds > 0:
        row["per_s"] = round(tally.acquisitions / tally.seconds, 1)
    server = {k: v for k, v in tally.server.items() if k != "info"}
    row.update(
        per_acquisition(Window(tally.seconds, {}, {}, tally.client, server), tally.acquisitions)
    )
    return row


async def _run(url: str, prefix: str, config: B10Config, log: Log) -> list[dict[str, Any]]:
    meter = Meter()
    client = metered_client(url, meter, max_connections=POOL)
    observer = aioredis.Redis.from_url(url)
    tallies = {permits: _Tally() for permits in PERMITS}
    try:
        # warm-up: connections opened, scripts loaded, the runtime and subscription created
        await _one_window(client, meter, observer, f"{prefix}b10:warm", 4, WARM, _Tally())
        for round_index in range(config.rounds):
            order = PERMITS if round_index % 2 == 0 else PERMITS[::-1]
            for permits in order:
                tally = tallies[permits]
                if tally.errors:
                    continue
                name = f"{prefix}b10:{permits}:{round_index}"
                await _one_window(client, meter, observer, name, permits, config, tally)
            log(f"B10: round {round_index + 1}/{config.rounds} done")
    finally:
        await client.aclose()
        await observer.aclose()
    return [_row(permits, tallies[permits]) for permits in PERMITS]


def run(url: str, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B10 and return its JSON-ready result."""
    config = QUICK if quick else FULL
    rows = asyncio.run(_run(url, prefix, config, log))
    base = rows[0].get("per_s", 0.0)
    for row in rows:
        row["ratio_vs_1"] = ratio(row.get("per_s", 0.0), base)
        log(
            f"B10: {row['label']}: {row.get('per_s')} acquisitions/s (= {row['ratio_vs_1']} x "
            f"N=1; ceiling {row['ceiling_per_s']:g}/s), "
            f"{row.get('client_commands_per_acquisition')} client commands each, "
            f"peak concurrency {row['peak_concurrency']}"
        )
    fatal: list[str] = []
    for row in rows:
        if "error" in row:
            fatal.append(f"{row['label']}: {row['error']}")
        if row["peak_concurrency"] > row["permits"]:
            fatal.append(
                f"{row['label']}: {row['peak_concurrency']} holders at once, "
                f"more than its {row['permits']} permits"
            )
        if row["leases_lost"]:
            log(
                f"B10: {row['label']}: on_lost ran {row['leases_lost']} times for leases "
                "released at once without error",
                style="yellow",
            )
    peaks = [row["peak_concurrency"] for row in rows]
    exact = all(row["peak_concurrency"] == row["permits"] for row in rows)
    return {
        "scenario": "B10",
        "title": "Semaphore(N) throughput against N",
        "config": {
            "tasks": TASKS,
            "hold_ms": HOLD_S * 1000,
            "permits": list(PERMITS),
            "rounds": config.rounds,
            "warmup_s": config.warmup_s,
            "window_s": config.window_s,
            "pool_size": POOL,
        },
        "rows": rows,
        "skipped": {},
        "target": {
            "text": "peak concurrency = N for every N (no SPEC figure for the throughput)",
            "value": peaks,
            "value_text": "peaks "
            + ", ".join(f"{row['peak_concurrency']}/{row['permits']}" for row in rows)
            + "; acquisitions/s "
            + ", ".join(f"N={row['permits']}: {row.get('per_s')}" for row in rows),
            "met": exact and not fatal,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
