"""A lock-holding worker process for the cross-process tests (``tests/test_lock_faults.py``,
``tests/test_family.py``, ``tests/test_regressions.py``).

Run as ``python -m tests._lockworker --url URL --name NAME [--lease S] [--kind K] MODE``, or
with ``--redlock URL1,URL2,URL3`` instead of ``--url`` for a ``RedLock`` over those masters.
``--kind`` picks the primitive (:func:`make_lock`): ``lock`` (default), ``fair``, ``rw-write``,
``rw-read`` (the two sides of a ``ReadWriteLock``) or ``sem`` (a ``Semaphore`` of ``--permits``
permits, default 1); ``--claim-timeout`` sets the lock's dead-waiter bound (default 2 s).

``hold``
    Acquire the lock, print ``held <fencing token>`` (flushed), then sleep until killed. The
    lease is auto-renewed, so the lock outlives its lease only while this process lives: the
    test SIGKILLs it and measures how soon a waiter takes over.
``wait [--release-after S]``
    Print ``waiting`` (flushed), then wait for the lock with no timeout; once it holds it, print
    ``held <fencing token> <monotonic ns>``. Without ``--release-after`` it then sleeps until
    killed (the test SIGKILLs it while it waits — its registration on the server — to play a
    worker killed in a rolling deploy); with it, it holds ``S`` seconds, releases, prints
    ``released`` and exits.
``contend --tasks T --rounds R [--stay-ms M]``
    Print ``ready`` and wait for a line on stdin (the test's start signal, so every process
    contends at once); then T tasks each acquire the lock R times. Each hold is recorded as
    ``hold <start ns> <end ns> <token>`` with :func:`time.monotonic_ns` (one clock for every
    process on the machine), taken strictly inside the hold: after ``acquire`` returned and
    before ``release`` is called. A hold stays a random time below M ms (default 2). The lines
    are printed at the end, then ``done``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final, Protocol

import redis.asyncio as aioredis

from redis_locks_async import FairLock, Lease, Lock, ReadWriteLock, RedLock, Semaphore

KINDS: Final = ("lock", "fair", "rw-write", "rw-read", "sem")


class Primitive(Protocol):
    """What the tests use of a lock object, whichever primitive it is."""

    @property
    def current_lease(self) -> Lease | None: ...

    async def acquire(self, timeout: float | None = ..., *, blocking: bool = ...) -> bool: ...

    async def release(self) -> None: ...

    async def __aenter__(self) -> Lease: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def make_lock(
    kind: str, client: aioredis.Redis, name: str, *, permits: int = 1, **kw: Any
) -> Primitive:
    """The lock object of primitive ``kind`` (see :data:`KINDS`) on ``name``; ``kw`` are the
    lock's options (``lease``, ``timeout``, ``claim_timeout``, …)."""
    if kind == "lock":
        return Lock(client, name, **kw)
    if kind == "fair":
        return FairLock(client, name, **kw)
    if kind == "rw-write":
        return ReadWriteLock(client, name, **kw).write
    if kind == "rw-read":
        return ReadWriteLock(client, name, **kw).read
    if kind == "sem":
        return Semaphore(client, name, permits, **kw)
    raise ValueError(f"unknown kind {kind!r}")


def _open(args: argparse.Namespace, **kw: Any) -> tuple[Primitive, list[aioredis.Redis]]:
    """The worker's lock and the clients to close at the end."""
    if args.redlock is not None:
        masters = [aioredis.Redis.from_url(url) for url in args.redlock.split(",")]
        return RedLock(masters, args.name, lease=args.lease, **kw), masters
    client = aioredis.Redis.from_url(args.url)
    lock = make_lock(
        args.kind,
        client,
        args.name,
        permits=args.permits,
        lease=args.lease,
        claim_timeout=args.claim_timeout,
        **kw,
    )
    return lock, [client]


async def _close(clients: list[aioredis.Redis]) -> None:
    for client in clients:
        await client.aclose()


async def _hold(args: argparse.Namespace) -> None:
    lock, _ = _open(args)
    await lock.acquire()
    held = lock.current_lease
    assert held is not None
    print(f"held {held.fencing_token}", flush=True)
    await asyncio.Event().wait()  # until SIGKILL


async def _wait(args: argparse.Namespace) -> None:
    lock, clients = _open(args)
    print("waiting", flush=True)
    await lock.acquire()
    held = lock.current_lease
    assert held is not None
    print(f"held {held.fencing_token} {time.monotonic_ns()}", flush=True)
    if args.release_after is None:
        await asyncio.Event().wait()  # until SIGKILL
    await asyncio.sleep(args.release_after)
    await lock.release()
    await _close(clients)
    print("released", flush=True)


async def _contend(args: argparse.Namespace) -> None:
    lock, clients = _open(args, timeout=30)
    records: list[tuple[int, int, int]] = []
    stay = args.stay_ms / 1000

    async def one_task() -> None:
        for _ in range(args.rounds):
            async with lock as held:
                start = time.monotonic_ns()
                # A short, uneven stay inside the lock gives overlaps every chance to show.
                await asyncio.sleep(random.random() * stay)
                end = time.monotonic_ns()
            records.append((start, end, held.fencing_token))

    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await asyncio.gather(*(one_task() for _ in range(args.tasks)))
    await _close(clients)
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
    parser.add_argument("--kind", choices=KINDS, default="lock")
    parser.add_argument("--permits", type=int, default=1)
    parser.add_argument("--claim-timeout", type=float, default=2.0)
    modes = parser.add_subparsers(dest="mode", required=True)
    modes.add_parser("hold")
    wait = modes.add_parser("wait")
    wait.add_argument("--release-after", type=float, default=None)
    contend = modes.add_parser("contend")
    contend.add_argument("--tasks", type=int, default=3)
    contend.add_argument("--rounds", type=int, default=20)
    contend.add_argument("--stay-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    run = {"hold": _hold, "wait": _wait, "contend": _contend}[args.mode]
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
