"""B2 worker process: one side of a cross-process ping-pong over one lock.

Two of these run at once (``spawn`` start method). Handoff ``i`` goes from worker ``i % 2`` to
worker ``1 - i % 2``: the holder sleeps a hold time, reads the clock (``t0``) as the last thing
before releasing, and releases; the waiter, already blocked in acquire, reads the clock (``t1``)
as the first thing after its acquire returns. Only then does it tell the former holder "got
``i``" over a pipe between the two workers, and the former holder calls acquire again while the
new holder sleeps through its hold time — so it is waiting when the next handoff comes, and it
never re-takes a lock it just released before the waiter got it (a non-fair lock would let it
barge in). That note travels after the measurement, never on the critical path; the timestamps
go to the parent after the run. ``time.monotonic_ns`` is CLOCK_MONOTONIC on Linux, one clock
for every process of the machine (the parent checks this before trusting cross-process
differences). For the floor, the pub/sub hop and ours (``Lock`` and ``FairLock``, the same code
with the class the peer key names) a run with ``RunSpec.traced`` also has the client's
connections record when each request's write began and when each reply or message was read
(``_metering``), so the parent can split a handoff into its hops. Tracing is not free, and it
is not the same tax on every peer (a connection class that overrides how commands are sent
and read takes our script calls off their short way, ``_wire``): the latencies the parent
reports come from runs without it. With ``RunSpec.cluster`` (B7)
the URL is a cluster node and every peer's client is a ``RedisCluster``; the pub/sub hop then
uses sharded pub/sub (``SPUBLISH``/``SSUBSCRIBE``), as our locks do on a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Protocol
from urllib.parse import urlparse

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from ._common import OUR_KINDS, describe, is_ours, our_lock_class, recv
from ._metering import Meter, hub_reads_traced, metered_connection

HOLDING = "holding"
READY = "ready"
GO = "go"


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One ping-pong run, as sent to each of the two workers."""

    peer: str
    url: str
    name: str
    role: int
    handoffs: int
    hold_base_s: float
    hold_jitter_s: float
    seed: int
    acquire_timeout_s: float
    cluster: bool = False  # url is a cluster node: connect with a RedisCluster client (B7)
    traced: bool = False  # record the client's writes and reads (TRACED peers only)


@dataclass(slots=True)
class RunResult:
    """What one worker saw: ``released[i] = t0``, ``received[i] = (t_call, t1, token)``, and
    for the traced peers every write and read of its client (``(monotonic_ns, event)``)."""

    role: int
    released: dict[int, int] = field(default_factory=dict)
    received: dict[int, tuple[int, int, int | None]] = field(default_factory=dict)
    trace: list[tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RunError:
    """A run failed in this worker."""

    role: int
    error: str


# -- peers -----------------------------------------------------------------------------------


class AsyncPeer(Protocol):
    def hold(self) -> AbstractAsyncContextManager[int | None]: ...

    async def aclose(self) -> None: ...


class SyncPeer(Protocol):
    def hold(self) -> AbstractContextManager[int | None]: ...

    def close(self) -> None: ...


@contextlib.asynccontextmanager
async def _acquired(
    acquire: Callable[[], Awaitable[bool]], release: Callable[[], Awaitable[object]], what: str
) -> AsyncIterator[int | None]:
    """Hold a lock whose ``acquire()`` returns ``False`` when it times out (``what`` timed out)."""
    if not await acquire():
        raise TimeoutError(f"{what} timed out")
    try:
        yield None
    finally:
        await release()


TRACED = frozenset({"floor", "pubsub-hop", *OUR_KINDS})


def _connect(spec: RunSpec, meter: Meter | None) -> aioredis.Redis | RedisCluster:
    """The peer's client (a ``RedisCluster`` for ``spec.cluster``); with a ``meter``, its
    connections record when they write and read."""
    if spec.cluster:
        cluster = RedisCluster.from_url(spec.url)
        if meter is not None:
            # redis-py's RedisCluster takes no connection_class: give it to the start-up node
            # and to the settings the nodes it discovers are built with.
            metered = metered_connection(meter)
            cluster.connection_kwargs["connection_class"] = metered
            for node in cluster.get_nodes():
                node.connection_class = metered
        return cluster
    if meter is None:
        return aioredis.Redis.from_url(spec.url)
    return aioredis.Redis.from_url(spec.url, connection_class=metered_connection(meter))


class _Ours:
    """Our ``Lock`` or ``FairLock``, as ``spec.peer`` names it."""

    def __init__(self, spec: RunSpec, meter: Meter | None) -> None:
        self._client = _connect(spec, meter)
        kind = our_lock_class(spec.peer)
        self._lock = kind(self._client, spec.name, lease=30.0, timeout=spec.acquire_timeout_s)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[int | None]:
        async with self._lock as lease:
            yield lease.fencing_token

    async def aclose(self) -> None:
        await self._client.aclose()


class _RedisPy:
    def __init__(self, spec: RunSpec, sleep: float) -> None:
        from redis.asyncio.lock import Lock as RedisPyLock

        self._client = aioredis.Redis.from_url(spec.url)
        self._lock = RedisPyLock(
            self._client,
            spec.name,
            timeout=30.0,
            sleep=sleep,
            blocking_timeout=spec.acquire_timeout_s,
        )

    def hold(self) -> AbstractAsyncContextManager[int | None]:
        return _acquired(self._lock.acquire, self._lock.release, "redis-py Lock.acquire")

    async def aclose(self) -> None:
        await self._client.aclose()


class _Pottery:
    def __init__(self, spec: RunSpec) -> None:
        from pottery import AIORedlock

        self._client = aioredis.Redis.from_url(spec.url)
        self._timeout = spec.acquire_timeout_s
        self._lock = AIORedlock(key=spec.name, masters={self._client}, auto_release_time=30.0)

    def hold(self) -> AbstractAsyncContextManager[int | None]:
        return _acquired(
            lambda: self._lock.acquire(timeout=self._timeout),
            self._lock.release,
            "pottery AIORedlock.acquire",
        )

    async def aclose(self) -> None:
        await self._client.aclose()


class _Aioredlock:
    def __init__(self, spec: RunSpec) -> None:
        from aioredlock import Aioredlock

        parts = urlparse(spec.url)
        # Its lock() retries with random 0.1-0.3 s sleeps: enough retries to cover the timeout.
        retries = max(3, math.ceil(spec.acquire_timeout_s / 0.1))
        self._manager = Aioredlock(
            [{"host": parts.hostname, "port": parts.port}], retry_count=retries
        )
        self._name = spec.name

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[int | None]:
        lock = await self._manager.lock(self._name, lock_timeout=30)
        try:
            yield None
        finally:
            await self._manager.unlock(lock)

    async def aclose(self) -> None:
        await self._manager.destroy()


class _Floor:
    """The one-hop floor: a bare token passed with RPUSH, waited for with BLPOP."""

    def __init__(self, spec: RunSpec, meter: Meter | None) -> None:
        self._client = _connect(spec, meter)
        self._mine = f"{spec.name}:to:{spec.role}"
        self._theirs = f"{spec.name}:to:{1 - spec.role}"
        self._timeout = spec.acquire_timeout_s
        self._seed = spec.role == 0

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[int | None]:
        if self._seed:  # worker 0 starts as the holder: put the token in its own list
            self._seed = False
            await self._client.rpush(self._mine, "token")
        got = await self._client.blpop([self._mine], timeout=self._timeout)
        if got is None:
            raise TimeoutError("BLPOP timed out")
        yield None
        await self._client.rpush(self._theirs, "token")

    async def aclose(self) -> None:
        await self._client.aclose()


class _Hop:
    """A token passed by a message to a channel the other side is subscribed to: ``hold``
    waits for the message (worker 0 starts with the token), and passing it on is a publish."""

    def __init__(self, spec: RunSpec) -> None:
        self._mine = f"{spec.name}:ch:{spec.role}"
        self._theirs = f"{spec.name}:ch:{1 - spec.role}"
        self._seed = spec.role == 0

    async def subscribe(self) -> None:
        """Subscribe to this side's channel: before the other side may publish to it (a
        message published earlier is lost), so before this worker says it is ready."""
        await self._subscribe()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[int | None]:
        if self._seed:  # worker 0 starts as the holder
            self._seed = False
        else:
            while not await self._message_came():
                pass  # bounded by the parent, which stops a run that overstays its budget
        yield None
        await self._publish()

    async def _subscribe(self) -> None:
        raise NotImplementedError

    async def _message_came(self) -> bool:
        raise NotImplementedError

    async def _publish(self) -> None:
        raise NotImplementedError


class _PubSubHop(_Hop):
    """A second reference: the token travels as a PUBLISH to a channel the other side reads
    with ``PubSub.get_message`` (the transport our ``Lock`` wakes waiters with)."""

    def __init__(self, spec: RunSpec, meter: Meter | None) -> None:
        super().__init__(spec)
        self._client = _connect(spec, meter)
        assert isinstance(self._client, aioredis.Redis)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)

    async def _subscribe(self) -> None:
        await self._pubsub.subscribe(self._mine)

    async def _message_came(self) -> bool:
        message = await self._pubsub.get_message(timeout=None)
        return message is not None and message.get("type") == "message"

    async def _publish(self) -> None:
        await self._client.publish(self._theirs, "token")

    async def aclose(self) -> None:
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        await self._client.aclose()


class _ShardedPubSubHop(_Hop):
    """The pub/sub hop on a cluster: ``SPUBLISH`` to a shard channel the other side reads with
    ``ClusterPubSub.get_sharded_message`` — the transport our ``Lock`` wakes waiters with there
    (sharded pub/sub on the node that owns the channel's slot)."""

    def __init__(self, spec: RunSpec, meter: Meter | None) -> None:
        super().__init__(spec)
        self._client = _connect(spec, meter)
        assert isinstance(self._client, RedisCluster)
        self._pubsub = self._client.pubsub()

    async def _subscribe(self) -> None:
        await self._client.initialize()  # ssubscribe looks the node up without initializing
        await self._pubsub.ssubscribe(self._mine)

    async def _message_came(self) -> bool:
        message = await self._pubsub.get_sharded_message(
            ignore_subscribe_messages=True, timeout=60.0
        )
        return message is not None and message.get("type") == "smessage"

    async def _publish(self) -> None:
        await self._client.spublish(self._theirs, "token")

    async def aclose(self) -> None:
        await self._pubsub.aclose()
        await self._client.aclose()


class _PythonRedisLock:
    def __init__(self, spec: RunSpec) -> None:
        import redis_lock

        self._client = redis.Redis.from_url(spec.url)
        self._lock = redis_lock.Lock(self._client, spec.name, expire=60)
        self._timeout = min(spec.acquire_timeout_s, 59.0)

    @contextlib.contextmanager
    def hold(self) -> Iterator[int | None]:
        if not self._lock.acquire(timeout=self._timeout):
            raise TimeoutError("python-redis-lock acquire timed out")
        try:
            yield None
        finally:
            self._lock.release()

    def close(self) -> None:
        self._client.close()


def _async_peer(spec: RunSpec, meter: Meter | None) -> AsyncPeer:
    if spec.peer == "floor":
        return _Floor(spec, meter)
    if spec.peer == "pubsub-hop":
        return _ShardedPubSubHop(spec, meter) if spec.cluster else _PubSubHop(spec, meter)
    if is_ours(spec.peer):
        return _Ours(spec, meter)
    if spec.peer == "redis-py":
        return _RedisPy(spec, sleep=0.1)
    if spec.peer == "redis-py/sleep=0.001":
        return _RedisPy(spec, sleep=0.001)
    if spec.peer == "pottery":
        return _Pottery(spec)
    if spec.peer == "aioredlock":
        return _Aioredlock(spec)
    raise ValueError(f"unknown asyncio peer {spec.peer!r}")


SYNC_PEERS = frozenset({"python-redis-lock"})


# -- the ping-pong ---------------------------------------------------------------------------


class _Side:
    """One worker's bookkeeping through a run. The asyncio and the sync loop below share it and
    differ only in how they hold the lock, sleep and wait for a message."""

    def __init__(self, spec: RunSpec, conn: Connection, other: Connection) -> None:
        self.spec = spec
        self.result = RunResult(spec.role)
        self.wait = spec.acquire_timeout_s + 30.0  # for the other worker's "got"
        self._conn = conn
        self._other = other
        self._rng = random.Random(spec.seed * 2 + spec.role)

    def handoffs(self) -> range:
        """The handoffs this worker receives (-1: worker 0's first hold, not a handoff)."""
        return range(self.spec.role - 1, self.spec.handoffs, 2)

    def calling_acquire(self, received: int) -> int:
        """Right before acquiring for handoff ``received`` (worker 1's first tells the parent it
        is ready): the clock when acquire is called."""
        if received == 0:
            self._conn.send(READY)
        return time.monotonic_ns()

    def took(self, received: int, t_call: int, t1: int, token: int | None) -> bool:
        """Record handoff ``received`` and tell the former holder "got" it. Worker 0's first
        hold instead tells the parent it holds the lock: ``False``, now wait for "go"."""
        if received < 0:
            self._conn.send(HOLDING)
            return False
        self.result.received[received] = (t_call, t1, token)
        self._other.send(("got", received))
        return True

    def hold_time(self) -> float:
        return self.spec.hold_base_s + self._rng.uniform(0.0, self.spec.hold_jitter_s)


def _expect(message: object, wanted: object) -> None:
    if message != wanted:
        raise RuntimeError(f"protocol: expected {wanted!r}, got {message!r}")


async def _play_async(spec: RunSpec, conn: Connection, other: Connection) -> RunResult:
    meter = Meter(trace=[]) if spec.traced and spec.peer in TRACED else None
    peer = _async_peer(spec, meter)
    side = _Side(spec, conn, other)
    clock = time.monotonic_ns
    with contextlib.ExitStack() as stack:
        if meter is not None and is_ours(spec.peer):
            stack.enter_context(hub_reads_traced(meter))
        await _play(spec, conn, other, peer, side, clock)
    if meter is not None and meter.trace is not None:
        side.result.trace = meter.trace
    return side.result


async def _play(
    spec: RunSpec,
    conn: Connection,
    other: Connection,
    peer: AsyncPeer,
    side: _Side,
    clock: Callable[[], int],
) -> None:
    try:
        if isinstance(peer, _Hop):
            await peer.subscribe()
        for received in side.handoffs():
            t_call = side.calling_acquire(received)
            async with peer.hold() as token:
                t1 = clock()
                if not side.took(received, t_call, t1, token):
                    _expect(await recv(conn, 60.0), GO)
                released = received + 1
                if released < spec.handoffs:
                    await asyncio.sleep(side.hold_time())
                    side.result.released[released] = clock()
            if released < spec.handoffs:
                _expect(await recv(other, side.wait), ("got", released))
    finally:
        await peer.aclose()


def _recv_blocking(source: Connection, timeout: float) -> object:
    if not source.poll(timeout):
        raise TimeoutError("no message within the time limit")
    return source.recv()


def _play_sync(spec: RunSpec, conn: Connection, other: Connection) -> RunResult:
    """:func:`_play_async` for the sync peer, blocking."""
    peer: SyncPeer = _PythonRedisLock(spec)
    side = _Side(spec, conn, other)
    clock = time.monotonic_ns
    try:
        for received in side.handoffs():
            t_call = side.calling_acquire(received)
            with peer.hold() as token:
                t1 = clock()
                if not side.took(received, t_call, t1, token):
                    _expect(_recv_blocking(conn, 60.0), GO)
                released = received + 1
                if released < spec.handoffs:
                    time.sleep(side.hold_time())
                    side.result.released[released] = clock()
            if released < spec.handoffs:
                _expect(_recv_blocking(other, side.wait), ("got", released))
    finally:
        peer.close()
    return side.result


def worker_main(conn: Connection, other: Connection) -> None:
    """Serve the parent over ``conn``: ``"clock"`` → ``monotonic_ns()``, a :class:`RunSpec` →
    a run's result, ``"exit"`` (or a closed pipe) → return. ``other`` leads to the other worker.
    """
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if message == "clock":
            conn.send(time.monotonic_ns())
        elif message == "exit":
            return
        elif isinstance(message, RunSpec):
            outcome: RunResult | RunError
            try:
                if message.peer in SYNC_PEERS:
                    outcome = _play_sync(message, conn, other)
                else:
                    outcome = asyncio.run(_play_async(message, conn, other))
            except KeyboardInterrupt:  # Ctrl-C reaches the whole process group
                return
            except Exception as exc:
                outcome = RunError(message.role, describe(exc))
            try:
                conn.send(outcome)
            except (EOFError, OSError):
                return
