"""B5 — many held, auto-renewed locks in one process: alive, renewal round trips, loop lag.

One process, one ``redis.asyncio`` client (a ``BlockingConnectionPool`` of 64 metered
connections, ``_metering``). N tasks each take their own lock with a short lease (``Lock(...,
lease=3.0)``, renewed every lease/3 by the library) and hold it in ``async with``; all of them
start at once, their acquisitions (and releases, at the end) paced below the pool's size. When
every lock is held, a tick later, and when a renewal burst has just ended, a window of three
leases begins (whole ticks: it ends between two bursts too), during which nothing but renewal
talks to the server.
Measured over the window:

- **alive**: at its end no ``Lease`` may be lost (nor ``on_lost`` have run), and on the server
  every lock's hash (the key layout the README documents: the lock's name, fields ``owner`` and
  ``token``) must still carry ``token`` equal to ``lease.fencing_token`` with a TTL left (a lock
  that was not renewed would have expired twice over);
- **renewal round trips**: requests written by the client (a pipeline is one), counted in the
  client, per renewal tick (lease/3) per 1,000 locks; the renewal calls themselves (EVALSHA,
  client-side) are cross-checked against ``INFO commandstats`` on the server (whose other
  commands are the ones the renewal script runs inside the server), and the sizes of the
  pipelines that carried them are recorded;
- **event-loop lag**: a ticker task sleeps 5 ms again and again; its overshoot is the lag
  (p50 / p99 / max), over the window and, separately, during the acquisition burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ._console import Log
from ._metering import Meter, Reading, metered_client
from ._stats import command_delta, percentile

TICK_S = 0.005  # the lag ticker's sleep
POOL = 64
# Acquisitions (at the start) and releases (at the end) in flight at once: fewer than the
# pool's connections, so that the lease keeper always finds one free.
GATE = POOL * 3 // 4
TARGET_ROUND_TRIPS = 1.0  # per renewal tick per 1,000 locks (one node)
TARGET_LAG_MS = 20.0


@dataclass(frozen=True, slots=True)
class B5Config:
    """How many locks, how long a lease, how many leases to watch."""

    locks: int
    lease_s: float
    leases: int
    acquire_limit_s: float


FULL = B5Config(locks=10_000, lease_s=3.0, leases=3, acquire_limit_s=120.0)
QUICK = B5Config(locks=1_000, lease_s=1.5, leases=3, acquire_limit_s=30.0)


class _Ticker:
    """Measures how late ``asyncio.sleep(TICK_S)`` wakes up, continuously."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (started at, lag in seconds)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        clock = time.perf_counter
        while True:
            started = clock()
            await asyncio.sleep(TICK_S)
            self.samples.append((started, clock() - started - TICK_S))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def between(self, begin: float, end: float) -> dict[str, Any]:
        lags = sorted(lag * 1000 for at, lag in self.samples if begin <= at < end)
        if not lags:
            return {"n": 0}
        return {
            "n": len(lags),
            "p50_ms": round(statistics.median(lags), 3),
            "p99_ms": round(percentile(lags, 99.0), 3),
            "max_ms": round(lags[-1], 3),
        }


async def _between_bursts(meter: Meter, tick_s: float) -> bool:
    """Wait a tick (the lease keeper may still be catching up with the renewals that fell due
    while the locks were being taken), then until a renewal burst has begun and ended — no
    request for a quarter of a tick: one pipeline's round trip on a loaded machine can take a
    tenth. A window of whole ticks that begins then also ends between two bursts, so it counts
    every tick's round trips once; begun at any moment, it would now and then catch a part of
    one more tick (91 round trips instead of 90). ``False`` if no quiet moment came within
    three ticks (the window then begins anyway)."""
    await asyncio.sleep(tick_s)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 3 * tick_s
    seen = meter.round_trips
    quiet_since = loop.time()
    burst = False
    while loop.time() < give_up:
        await asyncio.sleep(0.002)
        if meter.round_trips != seen:
            seen, burst, quiet_since = meter.round_trips, True, loop.time()
        elif burst and loop.time() - quiet_since >= tick_s / 4:
            return True
    return False


async def _verify(client: Any, names: list[str], tokens: list[int]) -> tuple[int, int]:
    """(alive, wrong): locks whose hash still holds the lease's token with a TTL left, and
    locks that do not."""
    alive = wrong = 0
    for start in range(0, len(names), 1000):
        pipe = client.pipeline(transaction=False)
        chunk = names[start : start + 1000]
        for name in chunk:
            pipe.hget(name, "token")
            pipe.pttl(name)
        replies = await pipe.execute()
        for offset in range(len(chunk)):
            token, ttl = replies[2 * offset], replies[2 * offset + 1]
            if token is not None and int(token) == tokens[start + offset] and int(ttl) > 0:
                alive += 1
            else:
                wrong += 1
    return alive, wrong


async def _run(url: str, prefix: str, config: B5Config, log: Log) -> dict[str, Any]:
    from redis_locks_async import Lease, Lock

    meter = Meter()
    client = metered_client(url, meter, max_connections=POOL)
    names = [f"{prefix}b5:{index}" for index in range(config.locks)]
    leases: list[Lease | None] = [None] * config.locks
    errors: list[str] = []
    stop = asyncio.Event()
    held = 0
    all_held = asyncio.Event()
    on_lost_calls = 0

    def on_lost(lease: Lease) -> None:
        nonlocal on_lost_calls
        on_lost_calls += 1

    # The acquisitions at the start and the releases at the end go through gates: commands
    # queued for the pool's connections (redis-py serves them first come, first served) keep
    # the lease keeper's renewal pipelines waiting behind them, one after the other, and
    # 10,000 tasks starting their acquire at once block the loop for up to a second — a burst
    # the application should pace, not a renewal cost. Unpaced, runs whose acquisitions took
    # 5 to 8 s lost most of their leases; paced at 256 with 64 connections, on a loaded
    # machine, some were lost while the 10,000 released.
    admission = asyncio.Semaphore(GATE)
    gate = asyncio.Semaphore(GATE)

    async def hold(index: int) -> None:
        nonlocal held
        entered = False
        try:
            async with contextlib.AsyncExitStack() as stack:
                async with admission:
                    lock = Lock(client, names[index], lease=config.lease_s, on_lost=on_lost)
                    lease = await stack.enter_async_context(lock)
                leases[index] = lease
                held += 1
                if held == config.locks:
                    all_held.set()
                await stop.wait()
                await gate.acquire()
                entered = True
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            all_held.set()
        finally:
            if entered:
                gate.release()

    ticker = _Ticker()
    ticker.start()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    result: dict[str, Any] = {}
    try:
        burst_began = time.perf_counter()
        acquire_began = loop.time()
        tasks = [asyncio.create_task(hold(index)) for index in range(config.locks)]
        await asyncio.wait_for(all_held.wait(), config.acquire_limit_s)
        if errors:
            raise RuntimeError(f"{len(errors)} acquisitions failed: {errors[:3]}")
        acquire_s = loop.time() - acquire_began
        burst_ended = time.perf_counter()
        log(
            f"B5: {config.locks:,} locks held after {acquire_s:.1f} s; watching "
            f"{config.leases} leases of {config.lease_s:g} s…"
        )
        window_s = config.leases * config.lease_s
        aligned = await _between_bursts(meter, config.lease_s / 3)
        before_stats: dict[str, Any] = await client.info("commandstats")
        before = meter.reading()
        meter.sizes = []
        window_began = time.perf_counter()
        await asyncio.sleep(window_s)
        window_ended = time.perf_counter()
        sizes, meter.sizes = meter.sizes, None
        after = meter.reading()
        after_stats: dict[str, Any] = await client.info("commandstats")
        lost = max(on_lost_calls, sum(1 for lease in leases if lease is None or lease.lost))
        tokens = [lease.fencing_token if lease is not None else -1 for lease in leases]
        alive, wrong = await _verify(client, names, tokens)
        result = _summarize(
            config,
            aligned,
            acquire_s,
            window_ended - window_began,
            after - before,
            command_delta(before_stats, after_stats),
            sizes,
            lost,
            alive,
            wrong,
            ticker.between(window_began, window_ended),
            ticker.between(burst_began, burst_ended),
        )
    finally:
        releasing = loop.time()
        failed_before = len(errors)
        stop.set()
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        result["release_s"] = round(loop.time() - releasing, 2)
        result["release_errors"] = errors[failed_before:][:5]
        result["release_failed"] = len(errors) - failed_before
        await ticker.stop()
        remaining = 0
        for start in range(0, len(names), 1000):
            remaining += int(await client.exists(*names[start : start + 1000]))
        result["left_after_release"] = remaining
        closing = loop.time()
        await client.aclose()
        result["close_s"] = round(loop.time() - closing, 2)
    return result


def _summarize(
    config: B5Config,
    aligned: bool,
    acquire_s: float,
    window_s: float,
    client: Reading,
    server: dict[str, int],
    sizes: list[int],
    lost: int,
    alive: int,
    wrong: int,
    lag: dict[str, Any],
    burst_lag: dict[str, Any],
) -> dict[str, Any]:
    tick_s = config.lease_s / 3
    ticks = window_s / tick_s
    per_thousand = config.locks / 1000
    round_trips_per_tick = client.round_trips / ticks
    return {
        "locks": config.locks,
        "lease_s": config.lease_s,
        "tick_s": round(tick_s, 3),
        "acquire_s": round(acquire_s, 2),
        "window_s": round(window_s, 2),
        "window_between_bursts": aligned,
        "ticks": round(ticks, 2),
        "lost_locally": lost,
        "alive_on_server": alive,
        "not_alive_on_server": wrong,
        "client_round_trips": client.round_trips,
        "client_commands_by_type": client.commands,
        "server_commands_by_type": {k: v for k, v in sorted(server.items()) if k != "info"},
        "renewals_client": client.commands.get("EVALSHA", 0),
        "renewals_server": server.get("evalsha", 0),
        "renewals_per_lock_per_tick": round(
            client.commands.get("EVALSHA", 0) / config.locks / ticks, 3
        ),
        "round_trips_per_tick": round(round_trips_per_tick, 2),
        "round_trips_per_tick_per_1000": round(round_trips_per_tick / per_thousand, 3),
        # batching alone, whatever the renewal period: round trips per 1,000 renewals
        "round_trips_per_1000_renewals": round(
            client.round_trips / max(1, client.commands.get("EVALSHA", 0)) * 1000, 3
        ),
        "pipeline_size_mean": round(statistics.fmean(sizes), 1) if sizes else None,
        "pipeline_size_max": max(sizes, default=None),
        "pipeline_size_min": min(sizes, default=None),
        "lag_window": lag,
        "lag_acquiring": burst_lag,
    }


def run(url: str, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B5 and return its JSON-ready result."""
    config = QUICK if quick else FULL
    row = asyncio.run(_run(url, prefix, config, log))
    fatal: list[str] = []
    if row.get("lost_locally") or row.get("not_alive_on_server"):
        fatal.append(
            f"{row.get('lost_locally')} leases lost locally, {row.get('not_alive_on_server')} "
            f"locks not alive on the server after {config.leases} leases"
        )
    if row.get("left_after_release"):
        fatal.append(f"{row['left_after_release']} locks still present after release")
    if row.get("release_failed"):
        fatal.append(f"{row['release_failed']} releases failed: {row.get('release_errors')}")
    lag_p99 = row.get("lag_window", {}).get("p99_ms")
    per_thousand = row.get("round_trips_per_tick_per_1000")
    log(
        f"B5: {row.get('alive_on_server')}/{config.locks} alive after {config.leases} leases; "
        f"{row.get('round_trips_per_tick')} round trips per tick = {per_thousand} per 1,000 "
        f"locks (pipelines of {row.get('pipeline_size_mean')} renewals on average); loop lag "
        f"p99 {lag_p99} ms (acquiring: {row.get('lag_acquiring', {}).get('p99_ms')} ms)"
    )
    met = (
        not fatal
        and per_thousand is not None
        and per_thousand <= TARGET_ROUND_TRIPS
        and lag_p99 is not None
        and lag_p99 < TARGET_LAG_MS
    )
    return {
        "scenario": "B5",
        "title": "Many held auto-renewed locks in one process",
        "config": {
            "locks": config.locks,
            "lease_s": config.lease_s,
            "leases": config.leases,
            "pool_size": POOL,
            "in_flight_gate": GATE,
            "lag_tick_ms": TICK_S * 1000,
        },
        "rows": [row],
        "skipped": {},
        "target": {
            "text": f"all alive after {config.leases} leases; ≤ {TARGET_ROUND_TRIPS:g} round "
            f"trip per tick per 1,000 locks; loop lag p99 < {TARGET_LAG_MS:g} ms",
            "value": [row.get("alive_on_server"), per_thousand, lag_p99],
            "value_text": f"{row.get('alive_on_server')}/{config.locks} alive, {per_thousand} "
            f"round trips per tick per 1,000, lag p99 {lag_p99} ms",
            "met": met,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
