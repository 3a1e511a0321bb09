"""A lock-holding worker process for the cross-process fault tests (``tests/test_lock_faults.py``).

Run as ``python -m tests._lockworker --url URL --name NAME [--lease S] MODE``, or with
``--redlock URL1,URL2,URL3`` instead of ``--url`` to use a ``RedLock`` over those masters
(``tests/test_redlock.py``):

``hold``
    Acquire the lock, print ``held <fencing token>`` (flushed), then sleep until killed. The
    lease is auto-renewed, so the lock outlives its lease only while this process lives: the
    test SIGKILLs it and measures how soon a waiter takes over.
``wait``
    Print ``waiting`` (flushed), then wait for the lock with no timeout; once it holds it, print
    ``held <fencing token>`` and sleep until killed. The test SIGKILLs it while it waits (its
    registration on the server) to play a worker killed in a rolling deploy.
``contend --tasks T --rounds R``
    Print ``ready`` and wait for a line on stdin (the test's start signal, so every process
    contends at once); then T tasks each acquire the lock R times. Each hold is recorded as
    ``hold <start ns> <end ns> <token>`` with :func:`time.monotonic_ns` (one clock for every
    process on the machine), taken strictly inside the hold: after ``acquire`` returned and
    before ``release`` is called. The lines are printed at the end, then ``done``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from redis_locks_async import Lock, RedLock


class _Clients:
    """The client(s) of one worker: one server (``--url``) or N masters (``--redlock``)."""

    def __init__(self, url: str) -> None:
        self.redlock = url.startswith("redlock:")
        urls = url.removeprefix("redlock:").split(",")
        self.clients = [aioredis.Redis.from_url(u) for u in urls]

    def lock(self, name: str, lease: float, timeout: float | None = None) -> Lock | RedLock:
        if self.redlock:
            return RedLock(self.clients, name, lease=lease, timeout=timeout)
        return Lock(self.clients[0], name, lease=lease, timeout=timeout)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


async def _hold(url: str, name: str, lease: float) -> None:
    lock = _Clients(url).lock(name, lease=lease)
    await lock.acquire()
    held = lock.current_lease
    assert held is not None
    print(f"held {held.fencing_token}", flush=True)
    await asyncio.Event().wait()  # until SIGKILL


async def _wait(url: str, name: str, lease: float) -> None:
    lock = _Clients(url).lock(name, lease=lease)
    print("waiting", flush=True)
    await lock.acquire()
    held = lock.current_lease
    assert held is not None
    print(f"held {held.fencing_token}", flush=True)
    await asyncio.Event().wait()  # until SIGKILL


async def _contend(url: str, name: str, lease: float, tasks: int, rounds: int) -> None:
    clients = _Clients(url)
    lock = clients.lock(name, lease=lease, timeout=30)
    records: list[tuple[int, int, int]] = []

    async def one_task() -> None:
        for _ in range(rounds):
            async with lock as held:
                start = time.monotonic_ns()
                # A short, uneven stay inside the lock gives overlaps every chance to show.
                await asyncio.sleep(random.random() * 0.002)
                end = time.monotonic_ns()
            records.append((start, end, held.fencing_token))

    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await asyncio.gather(*(one_task() for _ in range(tasks)))
    await clients.aclose()
    for start, end, token in records:
        print(f"hold {start} {end} {token}")
    print("done", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests._lockworker", description=__doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url")
    where.add_argument("--redlock", help="comma-separated URLs of independent masters")
    parser.add_argument("--name", required=True)
    parser.add_argument("--lease", type=float, default=30.0)
    modes = parser.add_subparsers(dest="mode", required=True)
    modes.add_parser("hold")
    modes.add_parser("wait")
    contend = modes.add_parser("contend")
    contend.add_argument("--tasks", type=int, default=3)
    contend.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    url = args.url if args.url is not None else "redlock:" + args.redlock
    if args.mode == "hold":
        asyncio.run(_hold(url, args.name, args.lease))
    elif args.mode == "wait":
        asyncio.run(_wait(url, args.name, args.lease))
    else:
        asyncio.run(_contend(url, args.name, args.lease, args.tasks, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
