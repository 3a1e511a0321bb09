"""B3 worker process: many waiters on one lock, each taking it once.

Four of these run at once (``spawn``), each serving one run after another. In a run, worker 0
first takes the lock itself (the *gate*), so that every waiter of every worker is really waiting
before the first handoff; then each worker starts its waiters (asyncio tasks, or threads for the
sync peer), reports them started, reports its client's command counts (the parent's "before"),
and — when the parent opens the gate — lets them go: each waiter acquires, records the clock and
its fencing token, releases at once (reading the clock as the last thing before the release),
and ends. When all of its waiters are done the worker reports every hold and its counts again.

Protocol, parent → worker: a :class:`B3Spec`, then ``"start"``, ``"snapshot"``, ``"open"`` (the
gate's worker only), ``"close"``; worker → parent: ``("prepared",)``,
``("started", n, errors, Reading)`` (the counts before the waiters started), ``("reading",
Reading)``, ``("done", Done)``, ``("closed",)`` — or ``("error", text)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import redis
import redis.asyncio as aioredis

from ._common import describe, recv
from ._metering import Meter, Reading, metered_client, metered_sync_connection

START = "start"
SNAPSHOT = "snapshot"
OPEN = "open"
CLOSE = "close"
LEASE_S = 60.0


@dataclass(frozen=True, slots=True)
class B3Spec:
    """One run, as one worker plays it."""

    peer: str
    url: str
    name: str
    waiters: int
    gate: bool
    client_name: str
    timeout_s: float


@dataclass(slots=True)
class Done:
    """What one worker saw: ``holds`` as ``(t1 acquired, t0 release started, token)``; the
    gate's hold is among them (worker 0)."""

    holds: list[tuple[int, int, int | None]] = field(default_factory=list)
    reading: Reading = field(default_factory=lambda: Reading({}, 0))
    errors: list[str] = field(default_factory=list)


class ProtocolError(RuntimeError):
    """The parent sent something out of order."""


def _expect(message: object, wanted: str) -> None:
    if message != wanted:
        raise ProtocolError(f"expected {wanted!r}, got {message!r}")


# -- asyncio peers ---------------------------------------------------------------------------

class _Once:
    """Take the lock once (calling ``started()`` right before it may wait) and release it — at
    once, or (the gate) when ``gate`` is set; ``held`` is set once the gate holds the lock."""

    def __init__(
        self,
        spec: B3Spec,
        client: aioredis.Redis,
        started: Callable[[], None],
        gate: asyncio.Event | None = None,
    ) -> None:
        self._spec = spec
        self._client = client
        self._started = started
        self._gate = gate
        self.held = asyncio.Event()

    async def _hold(self) -> None:
        if self._gate is not None:
            self.held.set()
            await self._gate.wait()

    async def __call__(self) -> tuple[int, int, int | None]:
        spec, clock = self._spec, time.monotonic_ns
        if spec.peer == "redis-locks-async":
            from redis_locks_async import Lock

            lock = Lock(self._client, spec.name, lease=LEASE_S, timeout=spec.timeout_s)
            self._started()
            async with lock as lease:
                t1 = clock()
                await self._hold()
                t0 = clock()
            return t1, t0, lease.fencing_token
        if spec.peer == "redis-py/sleep=0.001":
            from redis.asyncio.lock import Lock as RedisPyLock

            rlock = RedisPyLock(
                self._client,
                spec.name,
                timeout=LEASE_S,
                sleep=0.001,
                blocking_timeout=spec.timeout_s,
            )
            self._started()
            if not await rlock.acquire():
                raise TimeoutError("redis-py Lock.acquire timed out")
            t1 = clock()
            await self._hold()
            t0 = clock()
            await rlock.release()
            return t1, t0, None
        raise ValueError(f"unknown asyncio peer {spec.peer!r}")


async def _play_async(spec: B3Spec, conn: Connection) -> None:
    meter = Meter()
    client = metered_client(spec.url, meter, client_name=spec.client_name)
    done = Done()
    started = 0
    all_started = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    def count_start() -> None:
        nonlocal started
        started += 1
        if started == spec.waiters:
            all_started.set()

    async def waiter(hold: _Once) -> None:
        try:
            done.holds.append(await hold())
        except Exception as exc:
            done.errors.append(describe(exc))
            all_started.set()

    try:
        opened = asyncio.Event()
        if spec.gate:
            gate = _Once(spec, client, lambda: None, opened)
            tasks.append(asyncio.create_task(waiter(gate)))
            await asyncio.wait_for(gate.held.wait(), 30)
        conn.send(("prepared",))
        _expect(await recv(conn), START)
        hold = _Once(spec, client, count_start)
        joining = meter.reading()
        tasks += [asyncio.create_task(waiter(hold)) for _ in range(spec.waiters)]
        await asyncio.wait_for(all_started.wait(), 60)
        await asyncio.sleep(0)  # let the last one reach its first await
        conn.send(("started", started, len(done.errors), joining))
        _expect(await recv(conn), SNAPSHOT)
        conn.send(("reading", meter.reading()))
        if spec.gate:
            _expect(await recv(conn), OPEN)
            opened.set()
        _, pending = await asyncio.wait(tasks, timeout=spec.timeout_s + 30)
        if pending:
            done.errors.append(f"{len(pending)} waiters still waiting at the end")
        done.reading = meter.reading()
        conn.send(("done", done))
        _expect(await recv(conn), CLOSE)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.wait_for(client.aclose(), 10)
    conn.send(("closed",))


# -- the sync peer (python-redis-lock, one thread per waiter) --------------------------------


def _play_threads(spec: B3Spec, conn: Connection) -> None:
    import redis_lock

    meter = Meter()
    # socket_timeout=None: redis-py's default socket timeout would abort a long BLPOP.
    pool = redis.BlockingConnectionPool.from_url(
        spec.url,
        max_connections=spec.waiters + 16,
        timeout=120,
        socket_timeout=None,
        client_name=spec.client_name,
        connection_class=metered_sync_connection(meter),
    )
    client = redis.Redis(connection_pool=pool)
    done = Done()
    guard = threading.Lock()
    counts = {"started": 0}
    all_started = threading.Event()
    # python-redis-lock refuses a wait longer than its lease when it does not renew.
    wait = min(spec.timeout_s, LEASE_S - 5)

    def one() -> None:
        try:
            lock = redis_lock.Lock(client, spec.name, expire=int(LEASE_S))
            with guard:
                counts["started"] += 1
                if counts["started"] == spec.waiters:
                    all_started.set()
            if not lock.acquire(timeout=wait):
                raise TimeoutError("python-redis-lock acquire timed out")
            t1 = time.monotonic_ns()
            t0 = time.monotonic_ns()
            lock.release()
            with guard:
                done.holds.append((t1, t0, None))
        except Exception as exc:
            with guard:
                done.errors.append(describe(exc))
            all_started.set()

    threads: list[threading.Thread] = []
    try:
        gate = None
        gate_t1 = 0
        if spec.gate:
            gate = redis_lock.Lock(client, spec.name, expire=int(LEASE_S))
            if not gate.acquire(blocking=False):
                raise RuntimeError("the gate could not take the lock")
            gate_t1 = time.monotonic_ns()
        conn.send(("prepared",))
        _expect(conn.recv(), START)
        threads = [threading.Thread(target=one, daemon=True) for _ in range(spec.waiters)]
        joining = meter.reading()
        for thread in threads:
            thread.start()
        all_started.wait(60)
        time.sleep(0.05)  # let the last ones reach their BLPOP
        conn.send(("started", counts["started"], len(done.errors), joining))
        _expect(conn.recv(), SNAPSHOT)
        conn.send(("reading", meter.reading()))
        if gate is not None:
            _expect(conn.recv(), OPEN)
            gate_t0 = time.monotonic_ns()
            gate.release()
            done.holds.append((gate_t1, gate_t0, None))
        deadline = time.monotonic() + spec.timeout_s + 30
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = sum(1 for thread in threads if thread.is_alive())
        if alive:
            done.errors.append(f"{alive} waiters still waiting at the end")
        done.reading = meter.reading()
        conn.send(("done", done))
        _expect(conn.recv(), CLOSE)
    finally:
        if any(thread.is_alive() for thread in threads):
            # Threads blocked in BLPOP cannot be interrupted: leave with the process.
            with contextlib.suppress(OSError):
                conn.send(("error", "waiter threads left behind"))
            conn.close()
            os._exit(1)
        client.close()
    conn.send(("closed",))


SYNC_PEERS = frozenset({"python-redis-lock"})


def worker_main(conn: Connection) -> None:
    """Serve runs until ``"exit"`` or a closed pipe; report a run's error as ``("error", text)``."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if message == "exit":
            return
        if not isinstance(message, B3Spec):
            with contextlib.suppress(EOFError, OSError):
                conn.send(("error", f"unexpected {message!r}"))
            continue
        try:
            if message.peer in SYNC_PEERS:
                _play_threads(message, conn)
            else:
                asyncio.run(_play_async(message, conn))
        except KeyboardInterrupt:
            return
        except (EOFError, OSError):
            return
        except Exception as exc:
            with contextlib.suppress(EOFError, OSError):
                conn.send(("error", describe(exc)))
