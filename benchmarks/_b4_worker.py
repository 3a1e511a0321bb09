"""B4 worker processes: a holder that keeps locks held without sending anything, and a waiter
process whose tasks (or threads, for the sync peer) wait on those locks.

The holder takes every lock with a long lease and no renewal, then blocks on its pipe until told
to stop, so during the measurement window the only traffic a lock-specific command counter can
see comes from the waiting process. The waiter's connections carry a client name so the parent
can find them in ``CLIENT LIST``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis

from ._common import describe, recv

STOP = "stop"
REPORT = "report"


@dataclass(frozen=True, slots=True)
class HolderSpec:
    """Hold ``names`` with ``peer``'s lock for ``lease_s`` seconds."""

    peer: str
    url: str
    names: tuple[str, ...]
    lease_s: float


@dataclass(frozen=True, slots=True)
class WaiterSpec:
    """``tasks`` waiters spread round-robin over ``names``."""

    peer: str
    url: str
    names: tuple[str, ...]
    tasks: int
    client_name: str
    pool_size: int
    lease_s: float
    timeout_s: float


@dataclass(frozen=True, slots=True)
class WaiterReport:
    """How the waiters stand when the parent asks (all should still be waiting)."""

    waiting: int
    acquired: int
    failed: int
    errors: tuple[str, ...]


SpecT = TypeVar("SpecT", HolderSpec, WaiterSpec)


# -- holder ----------------------------------------------------------------------------------


async def _hold_async(spec: HolderSpec, conn: Connection) -> None:
    client = aioredis.Redis.from_url(spec.url)
    keep: list[Any] = []
    try:
        if spec.peer == "redis-locks-async":
            from redis_locks_async import Lock

            for name in spec.names:
                lock = Lock(client, name, lease=spec.lease_s, auto_renew=False)
                if not await lock.acquire(blocking=False):
                    raise RuntimeError(f"holder could not take {name!r}")
                keep.append(lock)
        elif spec.peer == "redis-py":
            from redis.asyncio.lock import Lock as RedisPyLock

            for name in spec.names:
                rlock = RedisPyLock(client, name, timeout=spec.lease_s)
                if not await rlock.acquire(blocking=False):
                    raise RuntimeError(f"holder could not take {name!r}")
                keep.append(rlock)
        else:
            raise ValueError(f"unknown peer {spec.peer!r}")
        conn.send(("holding", len(keep)))
        # Block the whole event loop on purpose: nothing of this process runs until "stop".
        with contextlib.suppress(EOFError, OSError):
            conn.recv()
        for held in keep:  # the waiters are gone by now: nobody is woken
            await held.release()
    finally:
        await client.aclose()


def _hold_sync(spec: HolderSpec, conn: Connection) -> None:
    import redis_lock

    client = redis.Redis.from_url(spec.url)
    keep = []
    for name in spec.names:
        lock = redis_lock.Lock(client, name, expire=int(spec.lease_s))
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"holder could not take {name!r}")
        keep.append(lock)
    conn.send(("holding", len(keep)))
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    for lock in keep:
        lock.release()
    client.close()


def holder_main(conn: Connection, spec: HolderSpec) -> None:
    """Take every lock, report ``("holding", n)``, wait for anything on the pipe, exit."""
    _serve(conn, spec, _hold_sync, _hold_async)


# -- waiters ---------------------------------------------------------------------------------


async def _wait_async(spec: WaiterSpec, conn: Connection) -> None:
    pool = aioredis.BlockingConnectionPool.from_url(
        spec.url, max_connections=spec.pool_size, timeout=120, client_name=spec.client_name
    )
    client = aioredis.Redis.from_pool(pool)
    started = 0
    all_started = asyncio.Event()
    errors: list[str] = []
    acquired = 0

    def count_start() -> None:
        nonlocal started
        started += 1
        if started == spec.tasks:
            all_started.set()

    async def ours(name: str) -> None:
        from redis_locks_async import Lock

        nonlocal acquired
        lock = Lock(client, name, lease=spec.lease_s)
        count_start()
        if await lock.acquire(timeout=spec.timeout_s):
            acquired += 1

    async def redis_py(name: str) -> None:
        from redis.asyncio.lock import Lock as RedisPyLock

        nonlocal acquired
        lock = RedisPyLock(client, name, timeout=spec.lease_s, blocking_timeout=spec.timeout_s)
        count_start()
        if await lock.acquire():
            acquired += 1

    one = ours if spec.peer == "redis-locks-async" else redis_py

    async def guarded(name: str) -> None:
        try:
            await one(name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            errors.append(describe(exc))
            all_started.set()

    tasks = [
        asyncio.create_task(guarded(spec.names[i % len(spec.names)])) for i in range(spec.tasks)
    ]
    try:
        await all_started.wait()
        conn.send(("started", started, len(errors)))
        while True:
            message = await recv(conn)
            if message == REPORT:
                waiting = sum(1 for task in tasks if not task.done())
                conn.send(WaiterReport(waiting, acquired, len(errors), tuple(errors[:3])))
            elif message == STOP:
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=5)
        await asyncio.wait_for(client.aclose(), 5)


def _wait_threads(spec: WaiterSpec, conn: Connection) -> None:
    import redis_lock

    # socket_timeout=None: redis-py 8's default 5 s socket timeout would abort its long BLPOP.
    pool = redis.BlockingConnectionPool.from_url(
        spec.url,
        max_connections=spec.pool_size,
        timeout=120,
        client_name=spec.client_name,
        socket_timeout=None,
    )
    client = redis.Redis(connection_pool=pool)
    lock_state = threading.Lock()
    counts = {"started": 0, "acquired": 0}
    errors: list[str] = []
    # python-redis-lock refuses a wait longer than its lease when it does not renew.
    wait = min(spec.timeout_s, spec.lease_s - 1)

    def one(name: str) -> None:
        try:
            lock = redis_lock.Lock(client, name, expire=int(spec.lease_s))
            with lock_state:
                counts["started"] += 1
            if lock.acquire(timeout=wait):
                with lock_state:
                    counts["acquired"] += 1
        except Exception as exc:
            with lock_state:
                errors.append(describe(exc))

    threads = [
        threading.Thread(target=one, args=(spec.names[i % len(spec.names)],), daemon=True)
        for i in range(spec.tasks)
    ]
    for thread in threads:
        thread.start()
    conn.send(("started", spec.tasks, 0))
    while True:
        message = conn.recv()
        if message == REPORT:
            waiting = sum(1 for thread in threads if thread.is_alive())
            with lock_state:
                report = WaiterReport(waiting, counts["acquired"], len(errors), tuple(errors[:3]))
            conn.send(report)
        elif message == STOP:
            break
    conn.close()
    # Threads blocked in BLPOP cannot be interrupted; their connections close with the process.
    os._exit(0)


def waiter_main(conn: Connection, spec: WaiterSpec) -> None:
    """Start the waiters, report ``("started", n, errors)``, answer ``"report"``, stop on
    ``"stop"`` (or when the pipe closes)."""
    _serve(conn, spec, _wait_threads, _wait_async)


def _serve(
    conn: Connection,
    spec: SpecT,
    run_sync: Callable[[SpecT, Connection], None],
    run_async: Callable[[SpecT, Connection], Coroutine[Any, Any, None]],
) -> None:
    """Run ``spec`` (in threads for the sync peer, else in an event loop); report an error to
    the parent as ``("error", text)``, and return quietly when the pipe closes or on Ctrl-C."""
    try:
        if spec.peer == "python-redis-lock":
            run_sync(spec, conn)
        else:
            asyncio.run(run_async(spec, conn))
    except (EOFError, OSError, KeyboardInterrupt):
        return
    except Exception as exc:
        with contextlib.suppress(EOFError, OSError):
            conn.send(("error", describe(exc)))
