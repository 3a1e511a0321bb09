"""A lock-holding worker process for the cross-process tests (``tests/test_lock_faults.py``,
``tests/test_family.py``, ``tests/test_regressions.py``).

Run as ``python -m tests._lockworker --url URL --name NAME [--lease S] [--kind K] MODE``, or
with ``--redlock URL1,URL2,URL3`` instead of ``--url`` for a ``RedLock`` over those masters.
``--kind`` picks the primitive (:func:`make_lock`): ``lock`` (default), ``fair``, ``rw-write``,
``rw-read`` (the two sides of a ``ReadWriteLock``) or ``sem`` (a ``Semaphore`` of ``--permits``
permits, default 1); ``--claim-timeout`` sets the lock's dead-waiter bound (default 2 s).

``hold [--release-on-line]``
    Acquire the lock, print ``held <fencing token>`` (flushed), then sleep until killed. The
    lease is auto-renewed, so the lock outlives its lease only while this process lives: the
    test SIGKILLs it and measures how soon a waiter takes over. With ``--release-on-line``:
    on a line on stdin, release it, print ``released`` and exit.
``wait [--release-after S] [--tasks T] [--fork-helper]``
    Print ``waiting`` (flushed), then wait for the lock with no timeout (``--fork-helper``: on
    a line on stdin, fork a child that sleeps a minute, and print ``child <pid>``); once it
    holds it, print ``held <fencing token> <monotonic ns>``. Without ``--release-after`` it
    then sleeps until killed (the test SIGKILLs it while it waits — its registration on the
    server — to play a worker killed in a rolling deploy); with it, it holds ``S`` seconds,
    releases, prints
    ``released`` and exits.
``contend --tasks T --rounds R [--stay-ms M]``
    Print ``ready`` and wait for a line on stdin (the test's start signal, so every process
    contends at once); then T tasks each acquire the lock R times. Each hold is recorded as
    ``hold <start ns> <end ns> <token>`` with :func:`time.monotonic_ns` (one clock for every
    process on the machine), taken strictly inside the hold: after ``acquire`` returned and
    before ``release`` is called. A hold stays a random time below M ms (default 2). The lines
    are printed at the end, then ``done``.
``chaos --tasks T --seconds S --fence FILE [--cancel-rate P] [--pause-at K] [--stick-at K]``
    For ``tests/test_chaos.py`` (S1). Print ``ready``, wait for a line on stdin, then T tasks
    contend for S seconds: each ``async with lock`` is cancelled at a random point with
    probability P (``anyio.move_on_after``: in ``acquire`` or in the hold), and each hold writes
    its fencing token twice to a **fenced resource** — ``FILE``, which keeps the highest token
    it accepted and rejects lower ones (check-and-set under ``flock``) — once after ``acquire``
    and once before leaving. Every event is printed (flushed) as it happens, so a process
    killed mid-run leaves its record: ``begin PID START TOKEN VALID``,
    ``write PID TOKEN T ok|rejected VALID`` (``VALID``: when the lease ends by the holder's own
    conservative clock, :meth:`Lease.remaining`),
    ``end PID START END TOKEN`` (times from :func:`time.monotonic_ns`), ``lost PID TOKEN``,
    ``error PID TEXT``, and at the end ``done PID``. Faults on demand: the K-th hold of the
    process (``--pause-at``) prints ``stopping PID T TOKEN VALID`` after its first write
    and stops the process with SIGSTOP — the test continues it once its lease is gone, and its
    second write must then be rejected; the K-th hold (``--stick-at``) prints ``stuck PID T
    TOKEN`` and keeps the lock (renewed) until the test SIGKILLs the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import math
import multiprocessing
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol

import anyio
import redis.asyncio as aioredis

from redis_locks_async import (
    FairLock,
    Lease,
    Lock,
    LockError,
    LockLostError,
    ReadWriteLock,
    RedLock,
    Semaphore,
)

KINDS: Final = ("lock", "fair", "rw-write", "rw-read", "sem")
# Each kind's key layout (tests._introspect's ``layout`` argument).
LAYOUT: Final = {"lock": "lock", "fair": "lock", "rw-write": "rw", "rw-read": "rw", "sem": "sem"}


class Primitive(Protocol):
    """What the tests use of a lock object, whichever primitive it is."""

    @property
    def name(self) -> str: ...

    @property
    def current_lease(self) -> Lease | None: ...

    async def acquire(
        self,
        timeout: float | None = ...,  # noqa: ASYNC109 - the library's own signature
        *,
        blocking: bool = ...,
    ) -> bool: ...

    async def release(self) -> None: ...

    async def extend(self, lease: float | None = None) -> None: ...

    def owned(self) -> bool: ...

    def guarded(self) -> contextlib.AbstractAsyncContextManager[Lease]: ...

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
    if not args.release_on_line:
        await asyncio.Event().wait()  # until SIGKILL
    await asyncio.to_thread(sys.stdin.readline)
    await lock.release()
    print("released", flush=True)


def _sleeping_helper() -> None:
    """A forked helper's body: it sleeps a minute, away from the test's pipes (so the test
    sees its parent's output end when the parent dies)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    time.sleep(60)


async def _wait(args: argparse.Namespace) -> None:
    lock, clients = _open(args)
    print("waiting", flush=True)

    async def one() -> None:
        await lock.acquire()
        held = lock.current_lease
        assert held is not None
        print(f"held {held.fencing_token} {time.monotonic_ns()}", flush=True)
        if args.release_after is None:
            await asyncio.Event().wait()  # until SIGKILL
        await asyncio.sleep(args.release_after)
        await lock.release()

    waiting = [asyncio.create_task(one()) for _ in range(args.tasks)]
    if args.fork_helper:
        # While waiting, start a helper process the way a worker pool does (fork): it inherits
        # every open socket — the pub/sub connection too — and outlives a SIGKILLed parent.
        await asyncio.to_thread(sys.stdin.readline)
        helper = multiprocessing.get_context("fork").Process(target=_sleeping_helper)
        helper.start()
        print(f"child {helper.pid}", flush=True)
    await asyncio.gather(*waiting)
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


def fenced_write(resource: Path, token: int) -> bool:
    """Write ``token`` to the fenced resource unless it has seen a higher one (check-and-set
    under an exclusive ``flock``, so processes never interleave). ``True`` when accepted."""
    with resource.open("r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        text = handle.read().strip()
        if text and token < int(text):
            return False
        handle.seek(0)
        handle.truncate()
        handle.write(str(token))
        return True


async def _chaos(url: str, name: str, lease: float, args: argparse.Namespace) -> None:
    client = aioredis.Redis.from_url(url)
    lock = Lock(client, name, lease=lease, timeout=5)
    pid = os.getpid()
    resource = Path(args.fence)
    holds = 0

    def say(*words: object) -> None:
        print(*words, flush=True)

    def valid(lease: Lease) -> int:
        # When the lease ends by the holder's own conservative clock (counted from when the
        # acquire or renewal was sent, so never later than on the server); now if lost.
        now = time.monotonic_ns()
        return now + int(lease.remaining() * 1e9)

    def write(lease: Lease) -> None:
        until = valid(lease)
        ok = fenced_write(resource, lease.fencing_token)
        at = time.monotonic_ns()
        say("write", pid, lease.fencing_token, at, "ok" if ok else "rejected", until)

    async def hold(lease: Lease) -> None:
        nonlocal holds
        holds += 1
        start, token = time.monotonic_ns(), lease.fencing_token
        say("begin", pid, start, token, valid(lease))
        try:
            write(lease)
            if holds == args.pause_at:
                # The holder's own view of how long its lease lasts (counted from when the
                # acquire was sent, so it never ends later than the server's lease).
                say("stopping", pid, time.monotonic_ns(), token, valid(lease))
                os.kill(pid, signal.SIGSTOP)  # the test continues us after our lease ended
                write(lease)  # at once: nothing (no renewal, no cancellation) runs before it
                return
            if holds == args.stick_at:
                say("stuck", pid, time.monotonic_ns(), token)
                with anyio.CancelScope(shield=True):  # no random cancellation ends this hold
                    await anyio.sleep_forever()  # until SIGKILL
            await asyncio.sleep(random.random() * 0.01)
            write(lease)
        finally:
            say("end", pid, start, time.monotonic_ns(), token)

    async def one_task(deadline: float) -> None:
        while time.monotonic() < deadline:
            cancel = random.random() < args.cancel_rate
            token = None
            try:
                with anyio.move_on_after(random.random() * 0.02 if cancel else math.inf):
                    async with lock as lease:
                        token = lease.fencing_token
                        await hold(lease)
            except LockLostError:
                say("lost", pid, token)
            except LockError as exc:  # a timeout, or the server restarting
                say("error", pid, type(exc).__name__)
                await asyncio.sleep(0.05)

    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    deadline = time.monotonic() + args.seconds
    await asyncio.gather(*(one_task(deadline) for _ in range(args.tasks)))
    with contextlib.suppress(Exception):
        await client.aclose()
    say("done", pid)


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
    hold = modes.add_parser("hold")
    hold.add_argument(
        "--release-on-line", action="store_true", help="release on a line on stdin, and exit"
    )
    wait = modes.add_parser("wait")
    wait.add_argument("--release-after", type=float, default=None)
    wait.add_argument("--tasks", type=int, default=1, help="waiting tasks (all on one lock)")
    wait.add_argument(
        "--fork-helper", action="store_true", help="fork a sleeping child on a line on stdin"
    )
    contend = modes.add_parser("contend")
    contend.add_argument("--tasks", type=int, default=3)
    contend.add_argument("--rounds", type=int, default=20)
    contend.add_argument("--stay-ms", type=float, default=2.0)
    chaos = modes.add_parser("chaos")
    chaos.add_argument("--tasks", type=int, default=3)
    chaos.add_argument("--seconds", type=float, default=10.0)
    chaos.add_argument("--fence", required=True, help="the fenced resource (a file)")
    chaos.add_argument("--cancel-rate", type=float, default=0.2)
    chaos.add_argument("--pause-at", type=int, default=0, help="SIGSTOP self in this hold")
    chaos.add_argument("--stick-at", type=int, default=0, help="keep this hold until killed")
    args = parser.parse_args(argv)
    if args.mode == "chaos":
        asyncio.run(_chaos(args.url, args.name, args.lease, args))
        return 0
    run = {"hold": _hold, "wait": _wait, "contend": _contend}[args.mode]
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
