"""The pipelined lane (``_lane``): many tasks' script calls on one connection, each reply to its
own caller — also with callers cancelled mid-flight, a connection that breaks or goes silent, a
client closed, a lane left idle — on a real server."""

from __future__ import annotations

import asyncio
import gc
import random
import warnings
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from redis_locks_async import Lock, LockError
from redis_locks_async import _lane as lane_module
from redis_locks_async._lane import IDLE, STALL, Lane
from redis_locks_async._wire import LANE_OPEN_PATIENCE, FastPool, fast_pool, run_script
from tests import _introspect as introspect

from .conftest import Connect
from .faultproxy import FaultProxy
from .servers import ServerFactory
from .test_lock_faults import HoldingTask, equals, subscribers, until

ECHO = "return ARGV[1]"
FAIL = "return redis.error_reply('NOPE ' .. ARGV[1])"


async def _loaded(client: aioredis.Redis, source: str) -> str:
    return str(await client.script_load(source))


def _fresh(connect: Connect, url: str | None = None, **kwargs: Any) -> aioredis.Redis:
    """A client with no connection yet: its first calls find no idle connection in the pool,
    so they take the lane (a pool with an idle connection serves a lone call directly)."""
    return connect(url, **kwargs)


def _fast(client: aioredis.Redis) -> FastPool:
    fast = fast_pool(client)
    assert fast is not None and fast.laned
    return fast


def _lane(client: aioredis.Redis) -> Lane:
    lane = _fast(client).lane
    assert lane is not None
    return lane


async def test_every_caller_gets_its_own_reply(connect: Connect) -> None:
    """300 concurrent calls, a third of them cancelled at random moments, some failing on the
    server: every call that completes gets the reply to its own command (never a neighbour's),
    and the lane stays usable and in step."""
    loader = connect()
    echo, fail = await _loaded(loader, ECHO), await _loaded(loader, FAIL)
    client = _fresh(connect, decode_responses=True)
    fast = _fast(client)
    mismatches: list[tuple[int, object]] = []

    async def call(i: int) -> None:
        if i % 7 == 0:
            with pytest.raises(ResponseError, match=f"NOPE {i}$"):
                await run_script(fast, fail, (), (i,))
            return
        reply = await run_script(fast, echo, (), (f"n{i}",))
        if reply != f"n{i}":
            mismatches.append((i, reply))

    for _ in range(3):
        tasks = [asyncio.create_task(call(i)) for i in range(300)]
        for _ in range(100):
            await asyncio.sleep(random.random() * 0.0005)
            random.choice(tasks).cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert not mismatches
    lane = _lane(client)
    assert lane.closed is None
    assert await run_script(fast, echo, (), ("after",)) == "after"


async def test_a_burst_of_acquisitions_shares_few_connections(
    connect: Connect, name: str
) -> None:
    """200 tasks each cycling its own lock: one holder per name at a time, tokens rising, and
    the client keeps to a handful of connections (not one per task)."""
    observer = connect()
    for source in introspect.script_sources():  # no NOSCRIPT fallback through redis-py's way
        await observer.script_load(source)
    client = _fresh(connect)
    tokens: dict[int, list[int]] = {}

    async def worker(i: int) -> None:
        lock = Lock(client, f"{name}:{i}", auto_renew=False)
        for _ in range(10):
            async with lock as lease:
                tokens.setdefault(i, []).append(lease.fencing_token)

    await asyncio.gather(*(worker(i) for i in range(200)))
    for seen in tokens.values():
        assert seen == sorted(seen) and len(set(seen)) == len(seen) == 10
    pool: Any = client.connection_pool
    assert len(pool._available_connections) + len(pool._in_use_connections) <= 4
    assert not await observer.keys(f"{name}*")


async def test_a_lane_that_breaks_fails_its_calls_and_the_retry_takes_a_new_one(
    fault_proxy: FaultProxy, connect: Connect
) -> None:
    """The lane's connection reset with 100 calls in flight: each call fails as a connection
    error, the client's ``Retry`` re-sends it on a new lane, and every call completes with its
    own reply."""
    echo = await _loaded(connect(), ECHO)
    client = _fresh(connect, fault_proxy.url, decode_responses=True, retry=Retry(NoBackoff(), 3))
    fast = _fast(client)
    await run_script(fast, echo, (), ("warm",))
    first = _lane(client)
    fault_proxy.hold_replies()
    tasks = [asyncio.create_task(run_script(fast, echo, (), (str(i),))) for i in range(100)]
    await fault_proxy.wait_held()
    assert fault_proxy.reset_all() >= 1
    fault_proxy.release_replies()
    assert await asyncio.gather(*tasks) == [str(i) for i in range(100)]
    assert first.closed is not None and not first.retired
    assert _lane(client) is not first


async def test_a_silent_lane_is_left_behind(
    fault_proxy: FaultProxy, connect: Connect, name: str
) -> None:
    """A lane whose replies stop coming (a half-open connection) holds up only the calls already
    on it: after :data:`STALL` the next call opens a new lane and completes, and the stalled
    lane closes once nobody waits for what it owes."""
    direct = connect()
    echo = await _loaded(direct, ECHO)
    client = _fresh(connect, fault_proxy.url)
    fast = _fast(client)
    assert await run_script(fast, echo, (), ("warm",)) == b"warm"
    stalled = _lane(client)
    fault_proxy.hold_replies()
    stuck = asyncio.create_task(run_script(fast, echo, (), ("stuck",)))
    await fault_proxy.wait_held()
    assert fault_proxy.blackhole_held() == 1
    fault_proxy.release_replies()
    await asyncio.sleep(STALL + 0.1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await run_script(fast, echo, (), ("fresh",)) == b"fresh"
    assert loop.time() - started < 1.0
    assert _lane(client) is not stalled and stalled.demoted
    assert not stuck.done()
    stuck.cancel()
    await until(lambda: stalled.closed is not None, what="the stalled lane closed")


async def test_socket_timeout_bounds_a_silent_lane(
    fault_proxy: FaultProxy, connect: Connect
) -> None:
    """With ``socket_timeout`` set, a call on a lane that stops answering fails with redis-py's
    ``TimeoutError`` once that time has passed, as a call on a connection of its own does."""
    direct = connect()
    echo = await _loaded(direct, ECHO)
    client = connect(fault_proxy.url, socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    fast = _fast(client)
    await run_script(fast, echo, (), ("warm",))
    fault_proxy.hold_replies()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(RedisTimeoutError):
        await run_script(fast, echo, (), ("late",))
    assert 0.25 < loop.time() - started < 1.5
    fault_proxy.heal()
    assert await run_script(fast, echo, (), ("again",)) == b"again"


async def test_an_idle_lane_gives_its_connection_back(connect: Connect) -> None:
    """After :data:`IDLE` seconds without a call the lane's connection goes back to the pool,
    connected and usable by redis-py's own commands."""
    echo = await _loaded(connect(), ECHO)
    client = _fresh(connect)
    fast = _fast(client)
    await run_script(fast, echo, (), ("x",))
    lane = _lane(client)
    pool: Any = client.connection_pool
    assert lane.conn in pool._in_use_connections
    await until(lambda: lane.closed is not None, what="the lane retired", within=IDLE + 2)
    assert lane.retired
    await until(lambda: lane.conn in pool._available_connections, what="connection back")
    assert lane.conn.is_connected
    assert await client.ping()
    assert await client.get("no-such-key-at-all") is None


async def test_closing_the_client_under_lane_calls_leaves_nothing_hanging(
    connect: Connect, name: str
) -> None:
    """``aclose()`` of the client while 50 calls are on its lane: each ends (a reply or a
    connection error, never a hang) and the client works again afterwards."""
    echo = await _loaded(connect(), "redis.call('PING') return ARGV[1]")
    client = _fresh(connect, retry=Retry(NoBackoff(), 0))
    fast = _fast(client)
    tasks = [asyncio.create_task(run_script(fast, echo, (), (str(i),))) for i in range(50)]
    await asyncio.sleep(0)
    await client.aclose()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    for i, outcome in enumerate(done):
        assert outcome == str(i).encode() or isinstance(outcome, RedisConnectionError), outcome
    assert await run_script(fast, echo, (), ("after",)) == b"after"


@pytest.mark.parametrize("protocol", [2, 3])
async def test_both_protocols(connect: Connect, name: str, protocol: int) -> None:
    """RESP2 and RESP3 connections both carry a lane, with replies and errors as redis-py's."""
    loader = connect()
    echo, fail = await _loaded(loader, ECHO), await _loaded(loader, FAIL)
    client = _fresh(connect, protocol=protocol)
    fast = _fast(client)
    replies = await asyncio.gather(*(run_script(fast, echo, (), (str(i),)) for i in range(20)))
    assert replies == [str(i).encode() for i in range(20)]
    with pytest.raises(ResponseError, match="NOPE x"):
        await run_script(fast, fail, (), ("x",))
    async with Lock(client, name) as lease:
        assert lease.fencing_token > 0


def test_a_client_used_under_one_event_loop_after_another(redis_url: str, name: str) -> None:
    """A lane opened under an earlier ``asyncio.run`` is not used under the next one: its
    connection goes back to the pool and a new lane carries the calls."""
    client = aioredis.Redis.from_url(redis_url)

    async def cycle() -> None:
        await asyncio.gather(*(_hold(Lock(client, f"{name}:{i}")) for i in range(20)))

    async def again_and_close() -> Lane:
        try:
            await cycle()
            return _lane(client)
        finally:
            await client.aclose()  # on the loop that used it last (see the README)

    with warnings.catch_warnings():
        # The first loop's connection cannot be closed once that loop is (redis-py's affair,
        # as for any pooled connection: see the README); it is let go, unclosed.
        warnings.simplefilter("ignore", ResourceWarning)
        asyncio.run(cycle())
        first = _lane(client)
        second = asyncio.run(again_and_close())
        assert second is not first
        pool: Any = client.connection_pool
        assert first.conn not in pool._in_use_connections
        del first
        gc.collect()


def test_a_lane_left_open_by_an_ended_run_gives_its_connection_back(
    redis_url: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (helper-52): a lane still open when its ``asyncio.run`` ended (within its
    idle time) kept its connection *in use* through the next run, for as long as the library's
    calls there found idle connections and never asked for a lane — a pool of three was one
    short: the application's ``SET`` failed with ``MaxConnectionsError``, and ``aclose()``
    raised "Event loop is closed". The first lock used on the new loop gives it back."""
    # (The lane must still be open when the run ends: on a loaded machine its idle time
    # passed first — "no lane was left open" in a fresh-clone run.)
    monkeypatch.setattr(lane_module, "IDLE", 30.0)
    client = aioredis.Redis.from_url(redis_url, max_connections=3)
    pool: Any = client.connection_pool

    async def burst() -> None:
        await client.set(f"{name}:app", 1)  # (one idle connection, besides the lane)
        await asyncio.gather(*(_hold(Lock(client, f"{name}:{i}")) for i in range(20)))

    async def one_at_a_time() -> None:
        try:
            await _hold(Lock(client, f"{name}:alone"))  # on the idle connection
            # (A moment for what the hold's end still runs: on Python 3.13 the connection of its
            # last call was found still in use 1 run in 10, and free a few loop turns later.)
            for _ in range(50):
                if not pool._in_use_connections:
                    break
                await asyncio.sleep(0.01)
            assert not pool._in_use_connections, "the ended run's lane still holds one"
            subscribers = [client.pubsub() for _ in range(2)]
            for pubsub in subscribers:
                await pubsub.subscribe(f"{name}:channel")
            assert await client.set(f"{name}:app", 2)  # the pool's third connection
            for pubsub in subscribers:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
        finally:
            await client.aclose()  # on the loop that used it last: no "Event loop is closed"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # (see the test above)
        asyncio.run(burst())
        if not pool._in_use_connections:  # (the calls never crowded the pool: a slow machine)
            asyncio.run(one_at_a_time())
            pytest.skip("no lane was left open by the first run: the test proves nothing")
        asyncio.run(one_at_a_time())
        gc.collect()


async def test_a_server_stalled_past_the_lane_s_patience_is_waited_out(
    server_factory: ServerFactory, name: str
) -> None:
    """Regression (helper-52, of the bound put on a lane's opening): a fresh client's first
    call opens a lane; a server stalled for longer than :data:`LANE_OPEN_PATIENCE` (a
    ``CLIENT PAUSE``, a slow fork) failed ``acquire(timeout=10)`` at that bound with "a new
    connection did not answer its handshake within 2 s" — on clients built ``from_url``, whose
    ``Retry`` makes no retries. The call now goes on without a lane and gets the lock once the
    server answers, within its timeout."""
    server = server_factory()
    admin = aioredis.Redis.from_url(server.url)
    client = aioredis.Redis.from_url(server.url)
    try:
        pause_ms = int((LANE_OPEN_PATIENCE + 1) * 1000)
        await admin.execute_command("CLIENT", "PAUSE", pause_ms, "ALL")  # type: ignore[no-untyped-call]
        loop = asyncio.get_running_loop()
        started = loop.time()
        lock = Lock(client, name, auto_renew=False)
        assert await lock.acquire(timeout=10)
        assert loop.time() - started >= LANE_OPEN_PATIENCE
        await lock.release()
    finally:
        await client.aclose()
        await admin.aclose()


async def _hold(lock: Lock) -> None:
    async with lock:
        await asyncio.sleep(0)


async def test_a_script_the_server_lost_is_sent_whole_on_the_same_path(
    connect: Connect, name: str
) -> None:
    """After ``SCRIPT FLUSH`` 50 concurrent acquisitions get ``NOSCRIPT`` and send the script
    whole (``EVAL``) the way they came — no call falls over to redis-py's path, which would
    open a connection per call — and each gets its own lock."""
    admin = connect()
    for source in introspect.script_sources():
        await admin.script_load(source)
    client = _fresh(connect)
    await asyncio.gather(*(_hold(Lock(client, f"{name}:warm:{i}")) for i in range(5)))
    await admin.script_flush()
    tokens = await asyncio.gather(*(_token(Lock(client, f"{name}:{i}")) for i in range(50)))
    assert all(token > 0 for token in tokens)
    pool: Any = client.connection_pool
    assert len(pool._available_connections) + len(pool._in_use_connections) <= 3
    assert not await admin.keys(f"{name}*")


async def _token(lock: Lock) -> int:
    async with lock as lease:
        return lease.fencing_token


@pytest.mark.parametrize("blocking", [False, True])
async def test_a_pool_of_one_connection_is_not_kept_from_the_application(
    redis_url: str, name: str, blocking: bool
) -> None:
    """Bug (found while building the lane): on a pool of ``max_connections=1`` the lane kept the
    only connection after its call was answered, and the application's own command inside
    ``async with lock:`` failed with "Too many connections" (a ``BlockingConnectionPool``
    waited out its timeout). An idle lane on a pool with no connection left to give hands its
    connection back at once, ready for the next command."""
    pool_class = aioredis.BlockingConnectionPool if blocking else aioredis.ConnectionPool
    pool = pool_class.from_url(redis_url, max_connections=1, **({"timeout": 1} if blocking else {}))
    client = aioredis.Redis(connection_pool=pool)
    try:
        lock = Lock(client, name, auto_renew=False)
        for i in range(20):
            async with lock:
                await client.set(f"{name}:data", i)
            assert await client.get(f"{name}:data") == str(i).encode()
        await client.delete(f"{name}:data")
    finally:
        await client.aclose()
        await pool.disconnect()


@pytest.mark.parametrize("blocking", [False, True])
async def test_waiting_never_takes_a_connection_of_the_clients_pool(
    redis_url: str, connect: Connect, name: str, blocking: bool
) -> None:
    """Bug (contract probe and attack pass, stops 22 and 23): the subscription that wakes waiters
    took its connection from the client's pool, for good. On a pool of ``max_connections=1``
    — or of 2 with one kept by the application (its own pub/sub) — the first task that had
    to wait took the last connection: every command of the client was stuck after it (the
    waiter's attempts, a holder's release and renewals, the application's own). The
    subscriptions now have a pool of their own, made like the client's."""
    pool_class = aioredis.BlockingConnectionPool if blocking else aioredis.ConnectionPool
    pool = pool_class.from_url(redis_url, max_connections=2, **({"timeout": 1} if blocking else {}))
    client = aioredis.Redis(connection_pool=pool)
    own = client.pubsub()  # the application keeps one connection of the two
    await own.subscribe(f"{name}:app")
    try:
        holder = Lock(client, name)
        waiter = HoldingTask(Lock(client, name), timeout=10)
        assert await holder.acquire()
        await until(lambda: introspect.local_waiters(client) == 1, what="the task waits")
        inspector = connect()
        await until(lambda: equals(subscribers(inspector, name), 1), what="the subscription")
        await client.set(f"{name}:data", 1)  # the application's commands still go through
        await holder.release()
        assert await waiter.wait_acquired() is not None
        await waiter.end()
        await client.delete(f"{name}:data")
    finally:
        await own.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()
        await pool.disconnect()


class _CustomPool(aioredis.ConnectionPool):
    """A pool of a kind the library does not copy for its subscriptions."""


@pytest.mark.parametrize("kind", [aioredis.ConnectionPool, _CustomPool])
async def test_waiting_on_a_pool_of_one_connection(
    redis_url: str, name: str, kind: type[aioredis.ConnectionPool]
) -> None:
    """The same on a pool of a single connection: waiting works, the application's commands
    too; a pool kind the library does not copy (a subclass) is refused with a ``LockError``
    that says why, before anything is sent."""
    pool = kind.from_url(redis_url, max_connections=1)
    client = aioredis.Redis(connection_pool=pool)
    try:
        holder = Lock(client, name)
        assert await holder.acquire()
        waiter = HoldingTask(Lock(client, name), timeout=10)
        if kind is _CustomPool:
            with pytest.raises(LockError, match=r"max_connections >= 2") as raised:
                await waiter.wait_acquired()
            assert raised.value.name == name
            assert introspect.local_waiters(client) == 0
            await holder.release()
            return
        await until(lambda: introspect.local_waiters(client) == 1, what="the task waits")
        await asyncio.sleep(0.05)
        assert await client.set(f"{name}:data", 1)
        await holder.release()
        assert await waiter.wait_acquired() is not None
        await waiter.end()
        await client.delete(f"{name}:data")
    finally:
        await client.aclose()
        await pool.disconnect()


async def test_an_error_of_a_connection_kind_is_raised_not_returned(connect: Connect) -> None:
    """Bug (attack pass on the lane): a ``-LOADING`` reply (a server restarted with a large
    dataset), which redis-py's parser turns into ``BusyLoadingError`` — a *connection* error
    kind, not a ``ResponseError`` — was handed to the caller as the reply value; the lock then
    failed with "unexpected script reply" instead of the client's ``Retry`` retrying it. Every
    error reply is raised."""
    loader = connect()
    loading = await _loaded(loader, "return redis.error_reply('LOADING fake ' .. ARGV[1])")
    client = _fresh(connect, retry=Retry(NoBackoff(), 0))
    fast = _fast(client)

    async def call(i: int) -> None:
        with pytest.raises(BusyLoadingError, match=f"fake {i}"):
            await run_script(fast, loading, (), (str(i),))

    await asyncio.gather(*(call(i) for i in range(10)))
    assert _lane(client) is not None


async def test_a_lane_whose_connection_never_answers_is_given_up(
    fault_proxy: FaultProxy, connect: Connect
) -> None:
    """Regression (helper-51): the lane's opener, a task of its own, connected through the
    pool's ``get_connection()`` with no bound. To a server that accepted the connection but
    never answered its handshake (a silent network, a paused server; no socket timeouts) it
    waited for ever — past the client's close, and past the network's repair (the handshake's
    bytes were lost) — and a connection it finally opened went back into the closed client's
    pool. The opener now gives a handshake ``LANE_OPEN_PATIENCE`` (2 s), and drops the
    connection it could not open."""
    # (A client that retries, as ``Redis(host=...)`` does by default: the close's disconnect
    # failed the connect, which the retry began again.)
    client = _fresh(connect, fault_proxy.url, retry=Retry(NoBackoff(), 3))
    fault_proxy.blackhole()
    assert not await Lock(client, "lane:silent").acquire(timeout=1.0)
    await client.aclose()

    def library_tasks() -> list[str]:
        coroutines = [task.get_coro() for task in asyncio.all_tasks()]
        return [
            getattr(coro, "__qualname__", "?")
            for coro in coroutines
            if "redis_locks_async" in getattr(getattr(coro, "cr_code", None), "co_filename", "")
        ]

    # (README: after the close no task of the library is left, within 2 s + 2 s.)
    await until(lambda: not library_tasks(), what="the library's tasks to end", within=4.5)
    pool: Any = client.connection_pool
    connections = [*pool._available_connections, *pool._in_use_connections]
    assert not [conn for conn in connections if conn.is_connected]
