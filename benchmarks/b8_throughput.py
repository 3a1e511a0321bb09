"""B8 — throughput: 200 tasks on 200 names (uncontended) and on 50 names (4 tasks each).

One process. Every task repeats ``acquire(); release()`` a fixed number of times on its name,
with nothing in between (the critical section is empty), through its own lock object; all tasks
start together and the time until the last one finishes gives acquisitions per second. Each
peer has its own ``redis.asyncio`` client on a ``BlockingConnectionPool`` of 64 plain
connections for the timed rounds, and another on 64 metered connections (``_metering``:
client-side commands and round trips) for one counting round per mode after them — a
connection class that observes commands makes redis-locks-async send its scripts one
connection per call (it must see each), so a metered client would time another path than a
user's. Peers: our ``Lock`` and
redis-py's ``Lock(sleep=0.001)`` (one lock object per task: redis-py keeps the token in a
thread-local, which every task of one thread would share). The two run alternately, in rounds,
so that the machine's drift hits both alike.

Checked on the way (ours): a name is never held by two tasks at once (an in-process counter),
and each name's fencing tokens increase in the order its acquisitions returned.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from ._console import Log
from ._metering import Meter, Reading, metered_client
from ._stats import command_delta, ratio

POOL = 64
TASKS = 200


@dataclass(frozen=True, slots=True)
class B8Config:
    """How much to measure."""

    cycles_per_task: int
    rounds: int


FULL = B8Config(cycles_per_task=40, rounds=3)
QUICK = B8Config(cycles_per_task=5, rounds=1)

MODES = (("uncontended", TASKS), ("4-way contended", TASKS // 4))
PEERS = (
    ("redis-locks-async", "redis-locks-async Lock"),
    ("redis-py/sleep=0.001", "redis-py asyncio Lock (sleep=0.001)"),
)


@dataclass(slots=True)
class _Tally:
    acquisitions: int = 0
    seconds: float = 0.0
    client: Reading = field(default_factory=lambda: Reading({}, 0))
    counted: int = 0  # acquisitions of the counting round (the denominator of ``client``)
    server: dict[str, int] = field(default_factory=dict)
    overlaps: int = 0
    token_regressions: int = 0
    lost: int = 0  # our ``on_lost`` callbacks (30 s leases released at once: should be none)
    errors: list[str] = field(default_factory=list)


async def _one_block(
    peer: str, client: aioredis.Redis, names: list[str], cycles: int, tally: _Tally
) -> None:
    """``TASKS`` tasks, task ``i`` on ``names[i % len(names)]``, ``cycles`` cycles each."""
    holders = dict.fromkeys(names, 0)
    last_token = dict.fromkeys(names, -1)
    go = asyncio.Event()

    async def ours(name: str) -> None:
        from redis_locks_async import Lock

        def lost(lease: object) -> None:
            tally.lost += 1

        lock = Lock(client, name, lease=30.0, timeout=60.0, on_lost=lost)
        await go.wait()
        for _ in range(cycles):
            async with lock as lease:
                holders[name] += 1
                if holders[name] > 1:
                    tally.overlaps += 1
                if lease.fencing_token <= last_token[name]:
                    tally.token_regressions += 1
                last_token[name] = lease.fencing_token
                holders[name] -= 1

    async def redis_py(name: str) -> None:
        from redis.asyncio.lock import Lock as RedisPyLock

        lock = RedisPyLock(client, name, timeout=30.0, sleep=0.001, blocking_timeout=60.0)
        await go.wait()
        for _ in range(cycles):
            if not await lock.acquire():
                raise TimeoutError("redis-py Lock.acquire timed out")
            holders[name] += 1
            if holders[name] > 1:
                tally.overlaps += 1
            holders[name] -= 1
            await lock.release()

    body = ours if peer == "redis-locks-async" else redis_py
    tasks = [asyncio.create_task(body(names[i % len(names)])) for i in range(TASKS)]
    await asyncio.sleep(0)
    began = time.perf_counter()
    go.set()
    done, _ = await asyncio.wait(tasks)
    tally.seconds += time.perf_counter() - began
    failed = [exc for exc in (task.exception() for task in done) if exc is not None]
    tally.errors += [f"{type(exc).__name__}: {exc}" for exc in failed]
    tally.acquisitions += (TASKS - len(failed)) * cycles


async def _run(url: str, prefix: str, config: B8Config, log: Log) -> list[dict[str, Any]]:
    meters = {peer: Meter() for peer, _ in PEERS}
    clients = {peer: _plain_client(url) for peer, _ in PEERS}
    metered = {peer: metered_client(url, meters[peer], max_connections=POOL) for peer, _ in PEERS}
    tallies = {(mode, peer): _Tally() for mode, _ in MODES for peer, _ in PEERS}
    try:
        # warm-up: connections opened, scripts loaded, runtimes created
        for peer, _ in PEERS:
            await _one_block(peer, clients[peer], [f"{prefix}b8:warm:{peer}"], 1, _Tally())
        for round_index in range(config.rounds):
            order = PEERS if round_index % 2 == 0 else PEERS[::-1]
            for mode, count in MODES:
                for peer, _ in order:
                    tally = tallies[(mode, peer)]
                    if tally.errors:
                        continue
                    names = [f"{prefix}b8:{peer}:{mode[:3]}:{index}" for index in range(count)]
                    stats_before: dict[str, Any] = await clients[peer].info("commandstats")
                    await _one_block(peer, clients[peer], names, config.cycles_per_task, tally)
                    stats_after: dict[str, Any] = await clients[peer].info("commandstats")
                    for command, calls in command_delta(stats_before, stats_after).items():
                        tally.server[command] = tally.server.get(command, 0) + calls
            log(f"B8: round {round_index + 1}/{config.rounds} done")
        for mode, count in MODES:  # the counting round
            for peer, _ in PEERS:
                tally = tallies[(mode, peer)]
                if tally.errors:
                    continue
                names = [f"{prefix}b8:{peer}:{mode[:3]}:{index}" for index in range(count)]
                counting = _Tally()
                before = meters[peer].reading()
                await _one_block(peer, metered[peer], names, config.cycles_per_task, counting)
                tally.client = meters[peer].reading() - before
                tally.counted = counting.acquisitions
                tally.errors += counting.errors
                tally.overlaps += counting.overlaps
                tally.token_regressions += counting.token_regressions
        log("B8: counting round done")
    finally:
        for client in (*clients.values(), *metered.values()):
            await client.aclose()
    rows: list[dict[str, Any]] = []
    for mode, count in MODES:
        for peer, label in PEERS:
            tally = tallies[(mode, peer)]
            server = {k: v for k, v in tally.server.items() if k != "info"}
            sent = tally.client
            row: dict[str, Any] = {
                "key": peer,
                "label": label,
                "mode": mode,
                "names": count,
                "tasks": TASKS,
                "acquisitions": tally.acquisitions,
                "seconds": round(tally.seconds, 3),
            }
            if tally.errors:
                row["error"] = "; ".join(tally.errors[:3])
                row["failed"] = len(tally.errors)
            if tally.acquisitions and tally.seconds > 0 and tally.counted:
                row.update(
                    per_s=round(tally.acquisitions / tally.seconds, 1),
                    client_commands_per_acquisition=round(sent.total / tally.counted, 2),
                    client_round_trips_per_acquisition=round(sent.round_trips / tally.counted, 2),
                    client_by_type_per_acquisition={
                        k: round(v / tally.counted, 3) for k, v in sent.commands.items()
                    },
                    server_commands_per_acquisition=round(
                        sum(server.values()) / tally.acquisitions, 2
                    ),
                    server_by_type_per_acquisition={
                        k: round(v / tally.acquisitions, 3) for k, v in sorted(server.items())
                    },
                )
            if peer == "redis-locks-async":
                row["overlaps"] = tally.overlaps
                row["token_regressions"] = tally.token_regressions
                row["leases_lost"] = tally.lost
            rows.append(row)
    return rows


def _plain_client(url: str) -> aioredis.Redis:
    """A ``redis.asyncio`` client on a ``BlockingConnectionPool`` of ``POOL`` connections."""
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=POOL, timeout=120)
    return aioredis.Redis.from_pool(pool)


def run(url: str, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B8 and return its JSON-ready result."""
    config = QUICK if quick else FULL
    rows = asyncio.run(_run(url, prefix, config, log))
    by = {(row["mode"], row["key"]): row for row in rows}
    verdicts: list[bool] = []
    values: list[float | None] = []
    for mode, count in MODES:
        ours, theirs = by[(mode, "redis-locks-async")], by[(mode, "redis-py/sleep=0.001")]
        value = ratio(ours.get("per_s", 0.0), theirs.get("per_s", 0.0))
        ours["ratio_vs_redis_py"] = value
        theirs["ratio_vs_redis_py"] = 1.0 if "per_s" in theirs else None
        values.append(value)
        ours_sent = ours.get("client_commands_per_acquisition", 99.0)
        theirs_sent = theirs.get("client_commands_per_acquisition", 0.0)
        # Uncontended, an acquire + release is two commands for every library (SET/EVALSHA and
        # a release): "fewer" can only be had contended; uncontended asks for no more (within
        # the counting round's handful of connection handshakes).
        fewer = ours_sent < theirs_sent if count < TASKS else ours_sent <= theirs_sent * 1.05
        verdicts.append(value is not None and value >= 1.0 and fewer)
        log(
            f"B8: {mode}: ours {ours.get('per_s')} acquisitions/s "
            f"({ours.get('client_commands_per_acquisition')} client commands each), redis-py "
            f"{theirs.get('per_s')}/s ({theirs.get('client_commands_per_acquisition')} each) "
            f"= {value} x"
        )
    fatal: list[str] = []
    for row in rows:
        if row["key"] != "redis-locks-async":
            continue
        if "error" in row:
            fatal.append(f"{row['label']} ({row['mode']}): {row['error']}")
        if row.get("overlaps"):
            fatal.append(f"{row['label']} ({row['mode']}): {row['overlaps']} overlapping holds")
        if row.get("token_regressions"):
            fatal.append(
                f"{row['label']} ({row['mode']}): fencing tokens did not increase "
                f"{row['token_regressions']} times"
            )
        if row.get("leases_lost"):
            log(
                f"B8: {row['label']} ({row['mode']}): on_lost ran {row['leases_lost']} times "
                "for leases released at once without error",
                style="yellow",
            )
    texts = [
        f"{mode}: {'—' if value is None else f'{value:.2f}'} x redis-py"
        for (mode, _), value in zip(MODES, values, strict=True)
    ]
    return {
        "scenario": "B8",
        "title": "Throughput, 200 tasks in one process",
        "config": {
            "tasks": TASKS,
            "cycles_per_task": config.cycles_per_task,
            "rounds": config.rounds,
            "pool_size": POOL,
        },
        "rows": rows,
        "skipped": {},
        "target": {
            "text": "Lock acquisitions/s ≥ redis-py's Lock (sleep=0.001), uncontended and 4-way "
            "contended, with fewer client commands per acquisition contended (no more "
            "uncontended: two for every library)",
            "value": values,
            "value_text": ", ".join(texts),
            "met": all(verdicts) and not fatal,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
