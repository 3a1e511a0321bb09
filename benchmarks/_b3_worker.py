"""B3 worker process: many waiters on one lock, each taking it again and again.

Four of these run at once (``spawn``), each serving one run after another. In a run, worker 0 first
takes the lock itself (the *gate*), so that every waiter of every worker is really waiting before
the first handoff; then each worker starts its waiters (asyncio tasks, or threads for the sync
peer; ours are ``Lock`` or ``FairLock``, as the peer key says). When the parent opens the gate the
waiters cycle: acquire, record the clock and the fencing token, release at once (reading the clock
as the last thing before the release), pause ``think_s``, queue again. The pause makes a release go
to a waiter that was already waiting, never straight back to its releaser (a polling lock's
releaser would otherwise win its own lock back nearly every time). While they cycle, the parent
asks for the client's counts at the two ends of its measuring window; then it stops the run:
asyncio waiters are cancelled wherever they are, threads leave after their next release. The worker
reports every hold.

Protocol, parent → worker: a :class:`B3Spec`, then ``"start"``, ``"open"`` (the gate's worker
only), ``"snapshot"`` (any number of times), ``"stop"``, ``"close"``; worker → parent:
``("prepared",)``, ``("started", n, errors)``, ``("reading", Reading)``, ``("done", Done)``,
``("closed",)`` — or ``("error", text)``.
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
from typing import TYPE_CHECKING

import redis
import redis.asyncio as aioredis

from ._common import describe, is_ours, our_lock_class, recv
from ._metering import Meter, metered_client, metered_sync_connection

if TYPE_CHECKING:
    from redis_locks_async import Lease

START = "start"
OPEN = "open"
SNAPSHOT = "snapshot"
STOP = "stop"
CLOSE = "close"
LEASE_S = 60.0
GATE = -1  # the waiter number of the gate's hold
DRAIN_S = 2.0  # at the end, how long asyncio waiters may take to leave before being cancelled

# One hold: (t1 acquired, t0 release started, fencing token or None, waiter number).
Hold = tuple[int, int, int | None, int]


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
    think_s: float


@dataclass(slots=True)
class Done:
    """What one worker saw: every hold (the gate's among them, worker 0) and the errors."""

    holds: list[Hold] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lost: int = 0  # our ``on_lost`` callbacks (60 s leases released at once: should be none)


class ProtocolError(RuntimeError):
    """The parent sent something out of order."""


def _expect(message: object, wanted: str) -> None:
    if message != wanted:
        raise ProtocolError(f"expected {wanted!r}, got {message!r}")


# -- asyncio peers ---------------------------------------------------------------------------


class _Cycles:
    """One asyncio waiter: take the lock, note the hold, release, pause, again — until
    ``stopping`` is set (checked after every release) or the task is cancelled.
    ``started()`` is called right before the first acquire may wait."""

    def __init__(
        self,
        spec: B3Spec,
        client: aioredis.Redis,
        number: int,
        done: Done,
        started: Callable[[], None],
        stopping: asyncio.Event,
    ) -> None:
        self._spec = spec
        self._client = client
        self._number = number
        self._done = done
        self._started = started
        self._stopping = stopping

    async def __call__(self) -> None:
        if is_ours(self._spec.peer):
            await self._ours()
        elif self._spec.peer.startswith("redis-py/"):
            await self._redis_py(float(self._spec.peer.removeprefix("redis-py/sleep=")))
        else:
            raise ValueError(f"unknown asyncio peer {self._spec.peer!r}")

    async def _ours(self) -> None:
        clock, holds = time.monotonic_ns, self._done.holds
        lock = our_lock_class(self._spec.peer)(
            self._client,
            self._spec.name,
            lease=LEASE_S,
            timeout=self._spec.timeout_s,
            on_lost=self._lost,
        )
        self._started()
        while not self._stopping.is_set():
            async with lock as lease:
                t1 = clock()
                t0 = clock()
                holds.append((t1, t0, lease.fencing_token, self._number))
            await asyncio.sleep(self._spec.think_s)

    def _lost(self, lease: Lease) -> None:
        self._done.lost += 1

    async def _redis_py(self, sleep: float) -> None:
        from redis.asyncio.lock import Lock as RedisPyLock

        clock, holds = time.monotonic_ns, self._done.holds
        lock = RedisPyLock(
            self._client,
            self._spec.name,
            timeout=LEASE_S,
            sleep=sleep,
            blocking_timeout=self._spec.timeout_s,
        )
        self._started()
        # The flag, not only cancellation: redis-py's acquire/release sometimes swallows a
        # CancelledError (seen with redis-py 8.1), and the waiter would then cycle on.
        while not self._stopping.is_set():
            if not await lock.acquire():
                raise TimeoutError("redis-py Lock.acquire timed out")
            t1 = clock()
            t0 = clock()
            holds.append((t1, t0, None, self._number))
            await lock.release()
            await asyncio.sleep(self._spec.think_s)


async def _gate(
    spec: B3Spec, client: aioredis.Redis, done: Done, opened: asyncio.Event
) -> asyncio.Task[None]:
    """Take the lock before any waiter starts: return, once it is held, the task that holds it
    and releases it when ``opened`` is set (its hold is recorded as :data:`GATE`)."""
    held = asyncio.Event()
    if is_ours(spec.peer):
        lock = our_lock_class(spec.peer)(client, spec.name, lease=LEASE_S)

        async def hold() -> None:
            async with lock as lease:
                t1 = time.monotonic_ns()
                held.set()
                await opened.wait()
                done.holds.append((t1, time.monotonic_ns(), lease.fencing_token, GATE))

    else:
        from redis.asyncio.lock import Lock as RedisPyLock

        rlock = RedisPyLock(client, spec.name, timeout=LEASE_S)

        async def hold() -> None:
            if not await rlock.acquire(blocking=False):
                raise RuntimeError("the gate could not take the lock")
            t1 = time.monotonic_ns()
            held.set()
            await opened.wait()
            done.holds.append((t1, time.monotonic_ns(), None, GATE))
            await rlock.release()

    task = asyncio.create_task(hold())
    holding = asyncio.create_task(held.wait())
    await asyncio.wait((task, holding), timeout=30.0, return_when=asyncio.FIRST_COMPLETED)
    holding.cancel()
    if task.done():
        task.result()  # the gate failed: raise why
    if not held.is_set():
        task.cancel()
        raise RuntimeError("the gate did not get the lock within 30 s")
    return task


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

    async def waiter(cycles: _Cycles) -> None:
        try:
            await cycles()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            done.errors.append(describe(exc))
            all_started.set()

    opened = asyncio.Event()
    stopping = asyncio.Event()
    try:
        if spec.gate:
            gate = await _gate(spec, client, done, opened)
            tasks.append(gate)
        conn.send(("prepared",))
        _expect(await recv(conn), START)
        tasks += [
            asyncio.create_task(waiter(_Cycles(spec, client, number, done, count_start, stopping)))
            for number in range(spec.waiters)
        ]
        await asyncio.wait_for(all_started.wait(), 60)
        await asyncio.sleep(0)  # let the last one reach its first await
        conn.send(("started", started, len(done.errors)))
        if spec.gate:
            _expect(await recv(conn), OPEN)
            opened.set()
        while (message := await recv(conn)) == SNAPSHOT:
            conn.send(("reading", meter.reading()))
        _expect(message, STOP)
        if spec.gate:
            if not gate.done():
                done.errors.append("the gate still held the lock at the end")
            elif not gate.cancelled() and (error := gate.exception()) is not None:
                done.errors.append(f"the gate: {describe(error)}")
        # Let the waiters leave after their next release (ours drain in well under a second);
        # then cancel the ones still waiting (pollers can take much longer to drain).
        stopping.set()
        _, waiting = await asyncio.wait(tasks, timeout=DRAIN_S)
        for task in waiting:
            task.cancel()
        _, stuck = await asyncio.wait(waiting, timeout=30) if waiting else (set(), set())
        if stuck:
            done.errors.append(f"{len(stuck)} waiters did not end when cancelled")
        conn.send(("done", done))
        _expect(await recv(conn), CLOSE)
    finally:
        opened.set()
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
    stopping = threading.Event()
    # python-redis-lock refuses a wait longer than its lease when it does not renew.
    wait = min(spec.timeout_s, LEASE_S - 5)

    def cycles(number: int) -> None:
        try:
            lock = redis_lock.Lock(client, spec.name, expire=int(LEASE_S))
            with guard:
                counts["started"] += 1
                if counts["started"] == spec.waiters:
                    all_started.set()
            while not stopping.is_set():
                if not lock.acquire(timeout=wait):
                    raise TimeoutError("python-redis-lock acquire timed out")
                t1 = time.monotonic_ns()
                t0 = time.monotonic_ns()
                lock.release()
                with guard:
                    done.holds.append((t1, t0, None, number))
                time.sleep(spec.think_s)
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
        threads = [
            threading.Thread(target=cycles, args=(number,), daemon=True)
            for number in range(spec.waiters)
        ]
        for thread in threads:
            thread.start()
        all_started.wait(60)
        time.sleep(0.05)  # let the last ones reach their BLPOP
        conn.send(("started", counts["started"], len(done.errors)))
        if gate is not None:
            _expect(conn.recv(), OPEN)
            gate_t0 = time.monotonic_ns()
            gate.release()
            with guard:
                done.holds.append((gate_t1, gate_t0, None, GATE))
        while (message := conn.recv()) == SNAPSHOT:
            conn.send(("reading", meter.reading()))
        _expect(message, STOP)
        # A thread blocked in BLPOP cannot be interrupted: each leaves after its next release
        # (the others keep releasing until the last one is through).
        stopping.set()
        deadline = time.monotonic() + spec.timeout_s + 30
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = sum(1 for thread in threads if thread.is_alive())
        if alive:
            done.errors.append(f"{alive} waiters still waiting at the end")
        with guard:
            conn.send(("done", done))
        _expect(conn.recv(), CLOSE)
    finally:
        stopping.set()
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
