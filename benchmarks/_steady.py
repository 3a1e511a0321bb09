"""A steady-state window over tasks that loop on their own (B9, B10).

The tasks run from before the window to after it; the window is cut out of their run: after a
warm-up the parent reads, at each end, the tasks' own counters (acquisitions so far), the
client's meter (commands sent, ``_metering``) and the server's ``INFO commandstats`` (through a
separate, unmetered client, whose ``INFO`` calls are then left out). Differences over the window
are steady-state figures, free of the start-up burst and of the drain at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from ._metering import Meter, Reading
from ._stats import command_delta


@dataclass(frozen=True, slots=True)
class Window:
    """What happened between the two ends of a window."""

    seconds: float
    counts: dict[str, int]  # the tasks' counters, differences
    start: dict[str, int]  # the tasks' counters when the window began
    client: Reading  # what the metered client sent
    server: dict[str, int]  # INFO commandstats differences, without INFO itself

    def per_s(self, counter: str) -> float:
        """``counter`` per second of the window."""
        return self.counts.get(counter, 0) / self.seconds if self.seconds > 0 else 0.0


async def measure(
    observer: aioredis.Redis,
    meter: Meter,
    counters: Callable[[], Mapping[str, int]],
    warmup_s: float,
    window_s: float,
) -> Window:
    """Wait ``warmup_s``, then measure ``window_s`` (the tasks keep running throughout)."""
    await asyncio.sleep(warmup_s)
    stats_before: dict[str, Any] = await observer.info("commandstats")
    began = time.perf_counter()
    counts_before, client_before = dict(counters()), meter.reading()
    await asyncio.sleep(window_s)
    counts_after, client_after = dict(counters()), meter.reading()
    seconds = time.perf_counter() - began
    stats_after: dict[str, Any] = await observer.info("commandstats")
    server = command_delta(stats_before, stats_after)
    server.pop("info", None)
    return Window(
        seconds,
        {key: counts_after[key] - counts_before.get(key, 0) for key in counts_after},
        counts_before,
        client_after - client_before,
        server,
    )


async def stop(tasks: Iterable[asyncio.Task[None]], grace_s: float = 10.0) -> list[str]:
    """Let ``tasks`` (which watch a stop flag the caller has set) finish their cycle; cancel
    those still running after ``grace_s``; return the errors of those that failed."""
    pending = set(tasks)
    if not pending:
        return []
    done, waiting = await asyncio.wait(pending, timeout=grace_s)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    errors = []
    for task in done:
        if not task.cancelled() and (exc := task.exception()) is not None:
            errors.append(f"{type(exc).__name__}: {exc}")
    if waiting:
        errors.append(f"{len(waiting)} tasks did not finish within {grace_s:g} s of the stop")
    return errors


def per_acquisition(window: Window, acquisitions: int) -> dict[str, Any]:
    """Client commands, round trips and server commands per acquisition over ``window``."""
    if acquisitions <= 0:
        return {}
    client = window.client
    scripts = sum(
        window.server.get(name, 0) for name in ("evalsha", "eval", "evalsha_ro", "eval_ro")
    )
    return {
        "client_commands_per_acquisition": round(client.total / acquisitions, 2),
        "client_round_trips_per_acquisition": round(client.round_trips / acquisitions, 2),
        "server_script_calls_per_acquisition": round(scripts / acquisitions, 2),
        "server_commands_per_acquisition": round(sum(window.server.values()) / acquisitions, 2),
        "client_by_type_per_acquisition": {
            k: round(v / acquisitions, 3) for k, v in client.commands.items()
        },
        "server_by_type_per_acquisition": {
            k: round(v / acquisitions, 3) for k, v in sorted(window.server.items())
        },
    }
