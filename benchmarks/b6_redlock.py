"""B6 — RedLock acquire latency on 5 masters against one, and with one master stopped.

``python -m benchmarks.b6_redlock [--quick] [--out DIR]`` starts five throwaway servers (the
benchmarks' embedded server), then measures one task's ``acquire(); release()`` cycles:

* ``Lock`` on one master and ``RedLock`` over one master (the single-master acquire);
* ``RedLock`` over five masters — SPEC §5 asks for ≤ 1.5 x the single-master acquire (median);
* the same with one master SIGSTOPped (its process id read from ``INFO server``): SPEC §5 asks
  for an acquire within ``node_timeout`` + 2 RTT (the median ``PING`` of a live master);
* pottery's ``AIORedlock`` over the same masters, both ways, every cycle under a hard timeout
  (:data:`HANG_AFTER` s) so that a hang is reported, not waited for; aioredlock likewise when it
  is installed (it is not, in this environment).

Acquire and release are timed separately; the ratios use the acquire. Writes ``b6.json`` and
``b6.md`` into ``--out`` (default: the current directory) and prints progress. Not yet wired into
``python -m benchmarks`` (that runner drives one server; this scenario needs five).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from redis_locks_async import Lock, RedLock

from ._peers import available
from ._server import embedded_server
from ._stats import summarize_ns

HANG_AFTER = 12.0  # seconds a peer's single acquire may take before it is reported as a hang
MASTERS = 5
TARGET_RATIO = 1.5

Cycle = Callable[[], Awaitable[tuple[int, int]]]


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f}"


async def _ping_ns(client: aioredis.Redis, count: int) -> float:
    samples = []
    for _ in range(count):
        start = time.perf_counter_ns()
        await client.ping()
        samples.append(time.perf_counter_ns() - start)
    return summarize_ns(samples).median_us


def _ours(lock: Lock | RedLock) -> Cycle:
    async def cycle() -> tuple[int, int]:
        start = time.perf_counter_ns()
        if not await lock.acquire(timeout=HANG_AFTER):
            raise TimeoutError("acquire timed out")
        mid = time.perf_counter_ns()
        await lock.release()
        return mid - start, time.perf_counter_ns() - mid

    return cycle


def _pottery(masters: Sequence[aioredis.Redis], name: str) -> Cycle:
    from pottery import AIORedlock

    lock = AIORedlock(key=name, masters=set(masters), auto_release_time=10)

    async def cycle() -> tuple[int, int]:
        start = time.perf_counter_ns()
        if not await lock.acquire(timeout=HANG_AFTER):
            raise TimeoutError("acquire timed out")
        mid = time.perf_counter_ns()
        await lock.release()
        return mid - start, time.perf_counter_ns() - mid

    return cycle


async def _measure(label: str, cycle: Cycle, count: int, warmup: int) -> dict[str, Any]:
    acquires: list[int] = []
    releases: list[int] = []
    started = time.perf_counter()
    try:
        for i in range(warmup + count):
            acquire_ns, release_ns = await asyncio.wait_for(cycle(), HANG_AFTER)
            if i >= warmup:
                acquires.append(acquire_ns)
                releases.append(release_ns)
    except (asyncio.TimeoutError, TimeoutError):
        waited = time.perf_counter() - started
        print(f"  {label}: HANG (no acquire+release within {HANG_AFTER} s)", flush=True)
        return {"label": label, "hang": True, "waited_s": round(waited, 1)}
    except Exception as exc:  # a peer failing is a result, not a crash of the benchmark
        print(f"  {label}: ERROR {exc!r}", flush=True)
        return {"label": label, "error": repr(exc)}
    acquire = summarize_ns(acquires)
    release = summarize_ns(releases)
    print(
        f"  {label}: acquire median {_ms(acquire.median_us)} ms p99 {_ms(acquire.p99_us)} ms, "
        f"release median {_ms(release.median_us)} ms",
        flush=True,
    )
    return {
        "label": label,
        "acquire_median_ms": acquire.median_us / 1e3,
        "acquire_p99_ms": acquire.p99_us / 1e3,
        "release_median_ms": release.median_us / 1e3,
        "cycles": count,
    }


async def _run(urls: Sequence[str], quick: bool) -> dict[str, Any]:
    count, warmup = (200, 20) if quick else (2000, 100)
    clients = [aioredis.Redis.from_url(url) for url in urls]
    rows: list[dict[str, Any]] = []
    try:
        rtt = await _ping_ns(clients[0], 200)
        five = RedLock(clients, "b6:five")
        print(f"B6: {count} cycles each; PING median {_ms(rtt)} ms", flush=True)
        rows.append(
            await _measure("Lock, 1 master", _ours(Lock(clients[0], "b6:lock")), count, warmup)
        )
        rows.append(
            await _measure(
                "RedLock, 1 master", _ours(RedLock(clients[:1], "b6:one")), count, warmup
            )
        )
        rows.append(await _measure("RedLock, 5 masters", _ours(five), count, warmup))
        has_pottery = available("pottery")
        if has_pottery:
            rows.append(
                await _measure(
                    "pottery AIORedlock, 1 master", _pottery(clients[:1], "b6:p1"), count, warmup
                )
            )
            rows.append(
                await _measure(
                    "pottery AIORedlock, 5 masters", _pottery(clients, "b6:p5"), count, warmup
                )
            )
        info = await clients[-1].info("server")
        pid = int(info["process_id"])
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped = RedLock(clients, "b6:stopped")
            rows.append(
                await _measure(
                    "RedLock, 5 masters, 1 stopped", _ours(stopped), count // 4, warmup // 4
                )
            )
            if has_pottery:
                rows.append(
                    await _measure(
                        "pottery AIORedlock, 5 masters, 1 stopped",
                        _pottery(clients, "b6:pstopped"),
                        3,
                        0,
                    )
                )
        finally:
            os.kill(pid, signal.SIGCONT)
        node_timeout = five.node_timeout
    finally:
        for client in clients:
            with contextlib.suppress(Exception):
                await client.aclose()
    by = {row["label"]: row for row in rows}
    single = by["RedLock, 1 master"].get("acquire_median_ms")
    multi = by["RedLock, 5 masters"].get("acquire_median_ms")
    stopped_ms = by["RedLock, 5 masters, 1 stopped"].get("acquire_median_ms")
    bound_ms = node_timeout * 1000 + 2 * rtt / 1e3
    return {
        "rows": rows,
        "ping_median_ms": rtt / 1e3,
        "node_timeout_s": node_timeout,
        "ratio_5_vs_1": (multi / single) if multi and single else None,
        "ratio_5_vs_lock": (multi / by["Lock, 1 master"]["acquire_median_ms"]) if multi else None,
        "stopped_acquire_ms": stopped_ms,
        "stopped_bound_ms": bound_ms,
        "aioredlock": "installed" if available("aioredlock") else "not installed here",
    }


def _markdown(result: dict[str, Any]) -> str:
    lines = ["# B6 — RedLock, 5 masters", ""]
    lines += ["| scenario | acquire median ms | p99 ms | release median ms |", "|---|---|---|---|"]
    for row in result["rows"]:
        if row.get("hang"):
            lines.append(f"| {row['label']} | **hang** (> {HANG_AFTER:g} s) | | |")
        elif row.get("error"):
            lines.append(f"| {row['label']} | error: {row['error']} | | |")
        else:
            lines.append(
                f"| {row['label']} | {row['acquire_median_ms']:.3f} | {row['acquire_p99_ms']:.3f} "
                f"| {row['release_median_ms']:.3f} |"
            )
    ratio = result["ratio_5_vs_1"]
    lines += [
        "",
        f"- 5 masters vs 1 (RedLock, median acquire): **{ratio:.2f} x** (target ≤ {TARGET_RATIO} x)"
        if ratio
        else "- 5 vs 1: n/a",
        f"- one master stopped: median acquire {result['stopped_acquire_ms']:.3f} ms; bound "
        f"node_timeout + 2 RTT = {result['stopped_bound_ms']:.1f} ms",
        f"- aioredlock: {result['aioredlock']}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run B6 (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.b6_redlock", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(embedded_server()) for _ in range(MASTERS)]
        result = asyncio.run(_run(urls, args.quick))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "b6.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = _markdown(result)
    (args.out / "b6.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
