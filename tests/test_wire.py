"""The script calls' short way to the server (``_wire``): which clients take it, and that it
keeps redis-py's contract — retries, dropped connections, encodings, fallbacks — on a real
server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import re
import weakref
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from redis_locks_async import Lock, LockError
from redis_locks_async._errors import describe
from redis_locks_async._fanout import _no_quorum
from redis_locks_async._wire import PIPELINE_STEP, fast_pool, loop_error, run_pipeline, run_script
from tests import _introspect as introspect

from .conftest import Connect
from .faultproxy import FaultProxy
from .servers import ServerFactory
from .test_lock_faults import until

_EVALSHA_SEEN: list[object] = []


class _Counting(aioredis.Redis):
    """A plain client that notes the ``EVALSHA`` calls made through redis-py's own path."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args and str(args[0]).upper() == "EVALSHA":
            _EVALSHA_SEEN.append(self)
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


async def _cycle(lock: Lock, times: int = 3) -> None:
    for _ in range(times):
        async with lock:
            pass


async def test_a_plain_client_takes_the_short_way(connect: Connect, name: str) -> None:
    """Acquire, release and re-entry reach the server without redis-py's command path (its
    ``execute_command`` never sees them), on one pooled connection."""
    client = connect()
    assert fast_pool(client) is not None
    seen: list[object] = []
    real = aioredis.Redis.execute_command

    async def spy(self: aioredis.Redis, *args: Any, **options: Any) -> Any:
        seen.append(args[0])
        return await real(self, *args, **options)  # type: ignore[no-untyped-call]

    lock = Lock(client, name, auto_renew=False)
    await _cycle(lock, 1)  # the first call opens the pool's connection through redis-py
    await introspect.retire_lane(client)  # (calls that find no idle connection: test_lane)
    pool: Any = client.connection_pool
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aioredis.Redis, "execute_command", spy)
        assert fast_pool(client) is None  # wrapped: redis-py's way, seen by the wrapper
        await _cycle(lock, 1)
        assert "EVALSHA" in seen
    seen.clear()
    await _cycle(lock)
    async with lock, lock:
        pass
    assert seen == []
    assert len(pool._available_connections) == 1
    assert not pool._in_use_connections


def test_pipelines_and_strangers_never_take_the_short_way(redis_url: str) -> None:
    """What a client's class is (a ``Redis``, no ``Pipeline``) is remembered per class, so the
    check costs no ``Protocol`` isinstance per call — and answers the same the second time."""
    client = aioredis.Redis.from_url(redis_url)
    pipeline = client.pipeline()
    for _ in range(2):
        assert fast_pool(pipeline) is None
        assert fast_pool(object()) is None
        assert fast_pool(client) is not None


@pytest.mark.parametrize("kind", ["subclass", "instance", "single_connection"])
async def test_other_clients_take_redis_pys_way(redis_url: str, name: str, kind: str) -> None:
    """A client whose commands are observed (a subclass overriding ``execute_command``, an
    ``evalsha`` replaced on the instance) and a single-connection client keep redis-py's own
    path — and work."""
    _EVALSHA_SEEN.clear()
    client: aioredis.Redis
    if kind == "single_connection":
        client = _Counting.from_url(redis_url, single_connection_client=True)
    else:
        client = _Counting.from_url(redis_url)
    if kind == "instance":
        real = aioredis.Redis.evalsha

        async def counted(*args: Any) -> Any:
            _EVALSHA_SEEN.append(client)
            return await real(client, *args)

        client.evalsha = counted  # type: ignore[method-assign,assignment]
    try:
        lock = Lock(client, name, auto_renew=False)
        await _cycle(lock)
        assert _EVALSHA_SEEN.count(client) >= 6
        assert not await lock.locked()
    finally:
        await client.aclose()


async def test_a_connection_class_that_observes_commands_sees_them(
    redis_url: str, name: str
) -> None:
    """A connection class of the application's that overrides how commands are packed and sent
    (a meter, a tracer at connection level) sees every script call: the short way goes through
    its methods."""
    sent: list[bytes] = []

    class Observed(aioredis.Connection):
        def pack_command(self, *args: Any) -> list[bytes]:
            sent.append(str(args[0]).encode())
            return super().pack_command(*args)

    client = aioredis.Redis.from_url(redis_url, connection_class=Observed)
    try:
        lock = Lock(client, name, auto_renew=False)
        await _cycle(lock)
        fast = fast_pool(client)
        assert fast is not None and not fast.raw
        assert sent.count(b"EVALSHA") >= 6
        assert not await lock.locked()
    finally:
        await client.aclose()


async def test_a_blocking_pool_keeps_its_queue(redis_url: str, name: str) -> None:
    """On a ``BlockingConnectionPool`` the short way takes an idle connection only while no
    task queues for one, and wakes a queued task when it gives its connection back: 60 tasks
    cycling 5 locks over 2 connections all finish, one holder per lock at a time, and no
    connection is left taken."""
    pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=2, timeout=20)
    client = aioredis.Redis(connection_pool=pool)
    holding: dict[int, int] = {}
    most = 0

    async def worker(index: int) -> None:
        nonlocal most
        lock = Lock(client, f"{name}:{index % 5}", auto_renew=False)
        for _ in range(10):
            async with lock:
                holding[index % 5] = holding.get(index % 5, 0) + 1
                most = max(most, holding[index % 5])
                await asyncio.sleep(0)
                holding[index % 5] -= 1

    try:
        await _cycle(Lock(client, name, auto_renew=False), 1)
        assert fast_pool(client) is not None
        await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(60))), 60)
        assert most == 1
        internals: Any = pool
        # At most the waiters' pub/sub connection (lingering a moment) stays in use, once the
        # lease keeper has confirmed the last hand-over.
        await until(lambda: len(internals._in_use_connections) <= 1, what="connections back")
        assert len(internals._available_connections) + len(internals._in_use_connections) <= 2
        assert not internals._condition._waiters
    finally:
        await client.aclose()
        await pool.disconnect()


async def _kill_pool_connections(client: aioredis.Redis, killer: aioredis.Redis) -> int:
    pool: Any = client.connection_pool
    ids = [await _client_id(conn) for conn in pool._available_connections]
    for client_id in ids:
        await killer.client_kill_filter(_id=str(client_id))
    return len(ids)


async def _client_id(conn: Any) -> int:
    await conn.send_command("CLIENT", "ID")
    return int(await conn.read_response())


async def test_a_connection_the_server_dropped_is_retried(
    connect: Connect, client: aioredis.Redis, name: str
) -> None:
    """An idle pooled connection the server closed (``CLIENT KILL``, an idle ``timeout``)
    fails the first send; the client's ``Retry`` reconnects and the call succeeds, as through
    redis-py."""
    user = connect(retry=Retry(NoBackoff(), 2))
    lock = Lock(user, name, auto_renew=False)
    await _cycle(lock, 1)
    await introspect.retire_lane(user)  # this tests the per-call path
    assert await _kill_pool_connections(user, client) == 1
    async with lock as lease:
        assert lease.fencing_token > 0
    assert not await lock.locked()


async def test_without_retries_a_dropped_connection_fails_cleanly(
    connect: Connect, client: aioredis.Redis, name: str
) -> None:
    """A client configured without retries sees the dropped connection as an error (a
    :class:`LockError` naming the lock, no hidden retry) — and the next call reconnects."""
    user = connect(retry=Retry(NoBackoff(), 0))
    lock = Lock(user, name, auto_renew=False)
    await _cycle(lock, 1)
    await introspect.retire_lane(user)  # this tests the per-call path
    assert await _kill_pool_connections(user, client) == 1
    with pytest.raises(LockError, match=re.escape(name)):
        await lock.acquire()
    await _cycle(lock, 1)
    assert not await lock.locked()


@pytest.mark.parametrize("timeout", [None, 8.0])
async def test_a_server_that_died_is_given_up_on_like_redis_py_does(
    server_factory: ServerFactory, name: str, timeout: float | None
) -> None:
    """Regression (attack pass on the short way: the server died while the pool's connection
    was idle; each of the command's retries ran a connect() with the connection's own Retry
    inside — 11 x 10 attempts, 44 s, where redis-py makes 10 — and ``acquire(timeout=8)``
    returned False, the dead server passed off as a busy lock). One connection attempt per
    retry: the call fails with an error naming the lock, in the time redis-py takes."""
    server = server_factory()
    client = aioredis.Redis(host=server.host, port=server.port, retry=Retry(NoBackoff(), 3))
    try:
        lock = Lock(client, name, auto_renew=False)
        await _cycle(lock, 1)
        await introspect.retire_lane(client)  # this tests the per-call path
        assert fast_pool(client) is not None
        pool: Any = client.connection_pool
        (idle,) = pool._available_connections
        attempts = 0
        real = idle._connect

        async def counted() -> None:
            nonlocal attempts
            attempts += 1
            await real()

        idle._connect = counted
        server.kill()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(LockError, match=re.escape(name)):
            await lock.acquire(timeout=timeout)
        assert attempts <= 4  # redis-py: 1 + 3 retries
        assert loop.time() - started < 3.0
        assert not pool._in_use_connections
    finally:
        await client.aclose()


class _TornWriter:
    """A transport writer torn down under the call, as asyncio leaves it after
    ``pool.disconnect()`` (3.13's form of the error)."""

    def write(self, data: bytes) -> None:
        raise TypeError("'NoneType' object is not callable")

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


@pytest.mark.parametrize("retries", [0, 1])
async def test_a_connection_torn_down_under_the_call_is_a_connection_error(
    connect: Connect, name: str, retries: int
) -> None:
    """Regression (attack pass on the short way: under ``pool.disconnect()``, asyncio's raw
    ``AttributeError``/``TypeError`` for a torn-down transport escaped ``acquire()`` and
    ``release()`` — not a ``LockError``, not retried, nothing undone). It is a connection
    error: retried by the client's ``Retry``, else a :class:`LockError` naming the lock."""
    user = connect(retry=Retry(NoBackoff(), retries))
    lock = Lock(user, name, auto_renew=False)
    await _cycle(lock, 1)
    await introspect.retire_lane(user)  # this tests the per-call path
    pool: Any = user.connection_pool
    (idle,) = pool._available_connections
    idle._writer.close()  # what pool.disconnect() does, the writer left behind half-way
    idle._writer = _TornWriter()
    if retries:
        await _cycle(lock, 1)
    else:
        with pytest.raises(LockError, match=re.escape(name)):
            await lock.acquire()
        await _cycle(lock, 1)
    assert not await lock.locked()


async def test_a_cancelled_call_leaves_no_reply_behind(
    proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str
) -> None:
    """Cancelled while its reply is owed, the call drops its connection: the next command on
    that client reads its own reply, never the acquire's."""
    lock = Lock(proxied, name, auto_renew=False)
    fault_proxy.hold_replies()
    task = asyncio.create_task(_cycle(lock, 1))
    await fault_proxy.wait_held()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fault_proxy.release_replies()
    await proxied.set(f"{name}:probe", "x")
    for _ in range(5):
        assert await proxied.get(f"{name}:probe") == b"x"
    # The undo sent in the background frees what the cancelled acquire took.
    for _ in range(100):
        if not await lock.locked():
            break
        await asyncio.sleep(0.02)
    assert not await lock.locked()


@pytest.mark.parametrize(
    ("options", "lock_name"),
    [
        ({"encoding": "latin-1"}, "café:ÿ"),
        ({"decode_responses": True}, "naïve:lock"),
    ],
)
async def test_keys_and_replies_as_the_client_encodes_them(
    connect: Connect, redis_url: str, name: str, options: dict[str, Any], lock_name: str
) -> None:
    """A lock's key is its name in UTF-8 whatever the client's ``encoding`` (stop 33: it was
    the client's encoding, and a latin-1 name could be another lock's auxiliary key), and a
    client that decodes replies gets the same lock."""
    user = connect(**options)
    full = f"{name}:{lock_name}"
    lock = Lock(user, full)
    # Regression (attack pass): with a latin-1 client the scripts' EVAL fallback (a server
    # without them) failed with a raw UnicodeEncodeError — their comments are not ASCII. They
    # are sent as UTF-8 bytes whatever the client's encoding.
    await user.script_flush()
    async with lock as lease:
        assert lease.fencing_token > 0
        raw = connect()
        assert await raw.exists(full.encode("utf-8")) == 1
    assert not await lock.locked()


async def test_a_cancelled_give_back_still_wakes_a_queued_task(redis_url: str, name: str) -> None:
    """Bug: a script call that gave its connection back to a ``BlockingConnectionPool`` and was
    cancelled while waiting for the pool's condition (to tell a queued task) never told it:
    the queued task slept beside the idle connection until the pool's timeout (20 s here)."""
    pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=20)
    client = aioredis.Redis(connection_pool=pool)
    admin = aioredis.Redis.from_url(redis_url)
    internals: Any = pool
    condition: Any = internals._condition
    try:
        await _cycle(Lock(client, name, auto_renew=False), 1)  # one connection, idle
        sha = await client.script_load("return 1")
        fast = fast_pool(client)
        assert fast is not None
        await admin.client_pause(400, all=True)  # the call waits...
        # A bare script call: a lock's call, cancelled, would send an undo, whose own turn
        # at the pool would wake the queued task and hide the bug.
        holder = asyncio.ensure_future(run_script(fast, sha, (), ()))
        await until(lambda: not internals._available_connections, what="connection taken")
        queued = asyncio.ensure_future(client.ping())  # ...while a task queues for the pool
        await until(lambda: bool(condition._waiters), what="a task queued")
        await condition.acquire()  # the give-back will have to wait for the condition
        try:
            await until(lambda: bool(condition._lock._waiters), what="the give-back waiting")
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
        finally:
            condition.release()
        assert await asyncio.wait_for(queued, 2) is True  # not after the pool's 20 s
    finally:
        await client.aclose()
        await pool.disconnect()
        await admin.aclose()


async def test_a_client_that_is_let_go_is_collected(redis_url: str, name: str) -> None:
    """Bug: what the short way learnt about a pool was kept in a weak mapping keyed by the
    pool, in a value that referred to the pool: every pool ever used stayed alive for good,
    with its connections (an application creating a client per job grew without bound)."""
    client = aioredis.Redis.from_url(redis_url)
    await _cycle(Lock(client, name, auto_renew=False), 2)
    assert fast_pool(client) is not None
    pool = weakref.ref(client.connection_pool)
    await client.aclose()
    del client
    gc.collect()
    assert pool() is None, "the pool outlived its client"


# -- batches (the lease keeper's renewals): run_pipeline -------------------------------------

_PEXPIRE = "return redis.call('PEXPIRE', KEYS[1], ARGV[1])"


async def _batch_of(client: aioredis.Redis, name: str, count: int) -> list[tuple[str, Any, Any]]:
    sha = await client.script_load(_PEXPIRE)
    keys = [f"{name}:{index}" for index in range(count)]
    await client.mset(dict.fromkeys(keys, 1))
    return [(sha, (key,), (60_000,)) for key in keys]


@contextlib.asynccontextmanager
async def _stepped_reads(redis_url: str) -> AsyncIterator[tuple[aioredis.Redis, list[int]]]:
    """A client whose every reply read is noted with the count of event-loop steps another task
    has taken so far (a ticker that does nothing but step): equal counts in a row are replies
    read in one stretch of the loop. The client is closed on the way out."""
    ticks = 0
    seen: list[int] = []

    class Observed(aioredis.Connection):
        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            reply = await super().read_response(*args, **kwargs)
            seen.append(ticks)
            return reply

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    client = aioredis.Redis.from_url(redis_url, connection_class=Observed)
    other = asyncio.create_task(ticker())
    try:
        yield client, seen
    finally:
        other.cancel()
        await client.aclose()


def _longest_stretch(seen: list[int]) -> int:
    """The most replies :func:`_stepped_reads` saw read in one stretch of the event loop."""
    return max(len(list(group)) for _, group in itertools.groupby(seen))


async def test_a_batch_is_one_request_whose_replies_come_in_order(
    redis_url: str, name: str
) -> None:
    """A batch is written as one request (a connection class that observes what is written sees
    one write of every command), and each call gets its own reply in order — a server's error
    reply (here an unknown script) in its call's place, the others unharmed."""
    writes: list[int] = []

    class Observed(aioredis.Connection):
        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            writes.append(sum(bytes(part).count(b"EVALSHA") for part in command))
            await super().send_packed_command(command, check_health)

    client = aioredis.Redis.from_url(redis_url, connection_class=Observed)
    try:
        fast = fast_pool(client)
        assert fast is not None
        calls = await _batch_of(client, name, 250)
        calls[7] = ("0" * 40, calls[7][1], calls[7][2])
        calls[3] = (calls[3][0], (f"{name}:absent",), calls[3][2])
        writes.clear()
        replies = await run_pipeline(fast, calls)
        assert writes == [250]
        assert isinstance(replies[7], NoScriptError)
        assert replies[3] == 0
        assert [r for i, r in enumerate(replies) if i not in (3, 7)] == [1] * 248
        assert await client.pttl(f"{name}:0") > 50_000
    finally:
        await client.aclose()


async def test_a_long_batch_lets_the_event_loop_run(redis_url: str, name: str) -> None:
    """Regression (B5's event-loop lag): a redis-py pipeline packs every command, then reads
    and parses every reply, without giving the event loop a step — 1,000 renewals held every
    other task of the process for one long stretch. Now other tasks run at least once per
    ``PIPELINE_STEP`` replies read."""
    async with _stepped_reads(redis_url) as (client, seen):
        fast = fast_pool(client)
        assert fast is not None
        calls = await _batch_of(client, name, 1_000)
        seen.clear()
        assert await run_pipeline(fast, calls) == [1] * 1_000
        assert _longest_stretch(seen) <= PIPELINE_STEP


async def test_a_batch_cancelled_with_replies_owed_leaves_none_behind(
    proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str
) -> None:
    """Cancelled (a renewal round trip timed out) while replies are owed, a batch drops its
    connection: the next command on the client reads its own reply, never a renewal's."""
    fast = fast_pool(proxied)
    assert fast is not None
    calls = await _batch_of(proxied, name, 300)
    fault_proxy.hold_replies()
    task = asyncio.create_task(run_pipeline(fast, calls))
    await fault_proxy.wait_held()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fault_proxy.release_replies()
    await proxied.set(f"{name}:probe", "x")
    for _ in range(5):
        assert await proxied.get(f"{name}:probe") == b"x"
    assert await run_pipeline(fast, calls) == [1] * 300


async def test_the_lease_keeper_lets_the_event_loop_run(redis_url: str, name: str) -> None:
    """The lease keeper's batches take the stepping way (:func:`run_pipeline`): 300 leases
    renewed together never have their replies read in one stretch of the event loop."""
    async with _stepped_reads(redis_url) as (client, seen), contextlib.AsyncExitStack() as stack:
        locks = [Lock(client, f"{name}:{index}", lease=0.9) for index in range(300)]
        for lock in locks:
            await stack.enter_async_context(lock)
        seen.clear()
        await asyncio.sleep(0.7)  # every lease renewed at least once (every 0.3 s)
        assert len(seen) >= 300 and all(lock.owned() for lock in locks)
        assert _longest_stretch(seen) <= PIPELINE_STEP


async def test_renewals_of_a_wrapped_pipeline_take_redis_pys_way(
    connect: Connect, name: str
) -> None:
    """A client whose ``pipeline`` is wrapped (a tracer, a test) has the lease keeper's
    batches go through it, as they did before the keeper had a way of its own."""
    client = connect()
    built: list[object] = []
    real = client.pipeline

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        built.append(args)
        return real(*args, **kwargs)

    lock = Lock(client, name, lease=0.6)
    async with lock:
        client.pipeline = wrapped  # type: ignore[method-assign]
        try:
            await until(lambda: bool(built), what="a renewal through the wrapped pipeline")
        finally:
            del client.pipeline
        assert lock.owned()


def test_only_event_loop_errors_are_connection_failures() -> None:
    """What redis-py's own path lets through for a connection of a closed or another event
    loop is taken for a connection failure (its command may have been written: the caller
    sends the undo); any other ``RuntimeError`` stays what it is."""
    assert loop_error(RuntimeError("Event loop is closed"))
    assert loop_error(RuntimeError("Task got Future <Future> attached to a different loop"))
    assert not loop_error(RuntimeError("something else"))
    assert not loop_error(ValueError("Event loop is closed"))


async def test_a_try_on_a_server_at_maxclients_names_the_refusal(
    server_factory: ServerFactory, name: str
) -> None:
    """Regression (lead of stop 34): a try (``blocking=False``) on a server at ``maxclients``
    raised "no reply from the server within 1 s" and nothing more — the server's "max number
    of clients reached" was retried inside the client's ``Retry`` (redis-py's default backs
    off for seconds) and never reached the caller. The message now names the last connection
    error the call met, with its text (redis-py 8 prints its errors without it)."""
    server = server_factory(extra_args=("--maxclients", "1"))
    hog = aioredis.Redis(host=server.host, port=server.port)
    client = aioredis.Redis(host=server.host, port=server.port)
    try:
        await hog.ping()  # the server's only client
        lock = Lock(client, name, auto_renew=False)
        with pytest.raises(LockError, match="max number of clients reached") as caught:
            await lock.acquire(blocking=False)
        assert name in str(caught.value)
        await hog.aclose()  # room again: the same lock works (once the server saw it go)
        for _ in range(50):
            with contextlib.suppress(LockError):
                if await lock.acquire(blocking=False):
                    break
            await asyncio.sleep(0.2)
        else:
            pytest.fail("the lock never became available again")
        await lock.release()
    finally:
        await client.aclose()
        await hog.aclose()


def test_errors_are_described_with_their_text() -> None:
    """redis-py 8's errors print as ``network:ConnectionError``: the library's messages and
    logs name an error with its text instead."""
    error = RedisConnectionError("max number of clients reached")
    assert describe(error) == "ConnectionError('max number of clients reached')"
    assert describe(None) == "None"
    quorum = _no_quorum([error, [1, 2, 0, 100]], "renew")  # a RedLock round's summary
    assert "ConnectionError('max number of clients reached')" in str(quorum)
