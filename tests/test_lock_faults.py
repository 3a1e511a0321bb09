"""``Lock`` under faults: cancellation, lost pub/sub, dead holders, renewal, restarts, close.

SPEC §4 (Cancellation, Waiting, Leases) and §6 S2 (liveness) and S3 (no leaks). Every test runs
against a real server. Network faults come from ``tests/faultproxy.py``: a test that cancels
"during" a command holds the replies at the proxy, lets them through one at a time until the
server shows that the command of interest ran (:func:`hold_reply_of`), cancels, and only then
lets the reply flow — so the cancellation lands exactly between the command reaching Redis and
its reply reaching the client, the window where a ghost holder would be born. Process faults
use real processes (``tests/_lockworker.py``). Real time is waited for only where it is the
point: leases expiring or being renewed, timeouts running out.

After each scenario the tests check the two S3 invariants: no key is owned (or waited for) by
an owner id that no live task stands behind (:func:`assert_no_ghost`), and the library's
background tasks settle (:func:`settle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import secrets
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisClusterException, ResponseError

from redis_locks_async import (
    FairLock,
    Lease,
    Lock,
    LockError,
    LockLostError,
    ReadWriteLock,
    Semaphore,
    _core,
    _notify,
)
from redis_locks_async._keys import LockKeys
from redis_locks_async._lock import LOCK_ACQUIRE
from tests import _introspect as introspect
from tests._lockworker import Primitive, make_lock
from tests._workers import assert_exclusive, contend, worker_process
from tests.faultproxy import FaultProxy
from tests.servers import ServerFactory, ServerProcess, free_port

if TYPE_CHECKING:
    from tests.conftest import Connect

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


async def until(predicate: Callable[[], object], *, what: str, within: float = 5.0) -> None:
    """Wait until ``predicate()`` (or what it returns, if awaitable) is truthy, polling every
    2 ms; fail naming ``what`` after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.002)


class Takeable(Protocol):
    """What :func:`rival_takes` needs of a lock object (every primitive has it)."""

    async def acquire(self, *, blocking: bool = ...) -> bool: ...

    async def release(self) -> None: ...


async def rival_takes(lock: Takeable, stop_at: float, hold: float = 0.0) -> float | None:
    """Try ``lock`` every 2 ms until ``stop_at`` (loop time); once taken, hold it ``hold``
    seconds and release it: the loop time it was taken at, or ``None``."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        if await lock.acquire(blocking=False):
            taken_at = loop.time()
            await asyncio.sleep(hold)
            await lock.release()
            return taken_at
        await asyncio.sleep(0.002)
    return None


async def step(proxy: FaultProxy) -> None:
    """Deliver the replies held right now (one chunk per connection), then hold again.

    The hold is back on as soon as the first byte is delivered — before the client has even
    read it — so a command the client sends in reaction is held in its turn.
    """
    delivered = proxy.stats.bytes_down
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    proxy.release_replies()
    while proxy.stats.bytes_down == delivered:
        assert loop.time() < deadline, "held replies were not delivered"
        await asyncio.sleep(0)
    proxy.hold_replies()


async def hold_reply_of(proxy: FaultProxy, ran: Callable[[], Awaitable[bool]]) -> None:
    """With replies held, let them through one by one until ``ran()`` shows (on the server)
    that the command of interest executed; its reply is then held at the proxy.

    The command of interest is sent only after the client saw the reply before it, so it
    cannot slip through a :func:`step`.
    """
    while True:
        await proxy.wait_held()
        if await ran():
            return
        await step(proxy)


async def quiesce(proxy: FaultProxy) -> None:
    """Wait until no reply is pending at the proxy, then give the client a few loop turns to
    read what was delivered and act on it (a wake-up, a sleep)."""
    await until(lambda: proxy.stats.bytes_pending_down == 0, what="replies to be delivered")
    for _ in range(20):
        await asyncio.sleep(0)


def live_ids(*clients: aioredis.Redis) -> set[str]:
    """Owner ids some live local task stands behind: held leases and queued waiters."""
    ids: set[str] = set()
    for client in clients:
        ids |= introspect.live_owner_ids(client)
    return ids


async def assert_no_ghost(inspector: aioredis.Redis, name: str, *clients: aioredis.Redis) -> None:
    """Neither the lock nor a waiter registration of ``name`` belongs to a dead owner."""
    live = live_ids(*clients)
    owner = await owner_of(inspector, name)
    assert owner is None or owner in live, f"{name!r} is held by ghost {owner!r}"
    registered = await introspect.registered_waiters(inspector, name)
    assert registered <= live, f"dead waiters still registered on {name!r}: {registered - live}"


async def settle(client: aioredis.Redis) -> None:
    """Let the library's cleanups finish; then nothing is held, waited for, or being cleaned up.

    (The keeper and listener tasks linger a few seconds after their last lease or waiter, by
    design; that nothing survives ``aclose()`` is checked in ``TestClientClose``.)
    """
    await introspect.drain(client)
    await until(
        lambda: (
            introspect.pending_cleanups(client) == 0
            and not introspect.held_leases(client)
            and not introspect.local_waiters(client)
        ),
        what=f"no pending cleanups (have {introspect.pending_cleanups(client)}), holds or waiters",
        within=2.0,
    )


def _text(value: object) -> str:
    assert isinstance(value, bytes)
    return value.decode()


async def owner_of(inspector: aioredis.Redis, name: str) -> str | None:
    owner = await inspector.hget(name, "owner")
    return None if owner is None else _text(owner)


async def registered(inspector: aioredis.Redis, name: str) -> int:
    return len(await introspect.registered_waiters(inspector, name))


async def subscribers(inspector: aioredis.Redis, name: str, layout: str = "lock") -> int:
    channel = introspect.channel_of(name, layout)
    reply = await inspector.pubsub_numsub(channel)
    return int(reply[0][1])


async def park_unregistered(
    proxy: FaultProxy,
    inspector: aioredis.Redis,
    proxied: aioredis.Redis,
    lock: Primitive,
    layout: str = "lock",
) -> HoldingTask:
    """A task waiting for ``lock`` (of ``proxied``, a client through ``proxy`` that has not
    subscribed to the lock's channel yet) that the server does not know of: its first attempt
    answered "held", its subscription made but not confirmed, so its registering attempt is
    not sent. Replies stay held; :meth:`FaultProxy.release_replies` lets it go on."""
    proxy.hold_replies()
    waiter = HoldingTask(lock)
    await hold_reply_of(proxy, lambda: _subscribed(inspector, lock.name, layout))
    assert introspect.local_waiters(proxied) == 1
    return waiter


async def try_once(lock: Primitive, *, patience: float | None = 0) -> bool:
    """``lock.acquire(timeout=patience)`` (default: a try); released at once if it was taken
    (a task's whole body may not be a bare acquire)."""
    if not await lock.acquire(timeout=patience):
        return False
    await lock.release()
    return True


async def _subscribed(inspector: aioredis.Redis, name: str, layout: str) -> bool:
    return await subscribers(inspector, name, layout) > 0


async def blocked_clients(inspector: aioredis.Redis) -> int:
    """Clients the server holds back (blocked, or postponed by ``CLIENT PAUSE``)."""
    return int((await inspector.info("clients"))["blocked_clients"])


async def kill_pubsub(inspector: aioredis.Redis) -> int:
    """``CLIENT KILL TYPE pubsub``: how many pub/sub connections the server dropped."""
    killed = await inspector.execute_command("CLIENT", "KILL", "TYPE", "pubsub")  # type: ignore[no-untyped-call]
    return int(killed)


async def finish(task: asyncio.Task[Any], within: float, what: str) -> None:
    """Wait for ``task``; if it hangs, cancel it and fail (instead of hanging the run)."""
    done, _ = await asyncio.wait((task,), timeout=within)
    if not done:
        task.cancel()
        await asyncio.wait((task,), timeout=1.0)
        raise AssertionError(f"{what}: still running after {within} s")


async def take(conn: aioredis.Redis, name: str) -> Lock:
    """``Lock(conn, name)``, acquired by the calling task (so that task can release it)."""
    lock = Lock(conn, name)
    await lock.acquire()
    return lock


async def cancel_held_up(task: asyncio.Task[Any], proxy: FaultProxy) -> None:
    """Cancel ``task`` while the reply it waits for is held at ``proxy``, then let the replies
    flow: the task must end cancelled."""
    task.cancel()
    proxy.release_replies()
    with pytest.raises(asyncio.CancelledError):
        await task


async def acquiring(lock: Lock, **kwargs: Any) -> bool:
    """``lock.acquire(**kwargs)`` as the body of a task to cancel (a bare ``acquire()`` as a
    task's whole body is refused: that task could never hold the lock)."""
    return await lock.acquire(**kwargs)


class HoldingTask:
    """A task that acquires ``lock`` (its own task is the owner) and holds it until :meth:`end`
    (the one such helper of the suite: ``test_family`` and ``test_regressions`` use it too)."""

    def __init__(self, lock: Primitive, *, timeout: float | None = None) -> None:
        self.lock = lock
        self.acquired: asyncio.Future[Lease | None] = asyncio.get_running_loop().create_future()
        self._end = asyncio.Event()
        self.task = asyncio.create_task(self._run(timeout))

    async def _run(self, wait: float | None) -> None:
        if not await self.lock.acquire(timeout=wait):
            self.acquired.set_result(None)
            return
        self.acquired.set_result(self.lock.current_lease)
        await self._end.wait()
        await self.lock.release()

    async def wait_acquired(self, within: float = 5.0) -> Lease | None:
        """The lease once acquired (``None`` if the acquire timed out); fails after
        ``within`` s, or with what the acquire raised."""
        await asyncio.wait(
            (self.acquired, self.task), timeout=within, return_when=asyncio.FIRST_COMPLETED
        )
        if self.acquired.done():
            return self.acquired.result()
        if self.task.done():
            self.task.result()  # raises what the acquire raised
        raise AssertionError(f"{self.lock.name!r} not acquired within {within} s")

    @property
    def ended(self) -> bool:
        """Whether :meth:`end` was called."""
        return self._end.is_set()

    async def end(self) -> None:
        """Release (if held) and wait for the task."""
        self._end.set()
        await finish(self.task, 5.0, "releasing task")
        self.task.result()

    async def cancel(self) -> None:
        """Cancel the task (waiting, or holding) and wait for it; its outcome is ignored."""
        self.task.cancel()
        await asyncio.wait((self.task,), timeout=5.0)
        if self.task.done() and not self.task.cancelled():
            self.task.exception()  # retrieved


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture
async def holder(connect: Connect) -> aioredis.Redis:
    """A second direct client, for the task that holds the lock the others want."""
    return connect()


# --------------------------------------------------------------------------------------------
# 1. Cancellation at every await of acquire and release (S3)
# --------------------------------------------------------------------------------------------


class TestCancellation:
    async def test_cancel_during_try_on_free_lock_leaves_no_ghost(
        self, proxied: aioredis.Redis, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(proxied, name)
        fault_proxy.hold_replies()
        task = asyncio.create_task(acquiring(lock))
        # the lock is taken; its reply is held, so the client can't know
        await hold_reply_of(fault_proxy, lambda: equals(client.exists(name), 1))
        await cancel_held_up(task, fault_proxy)

        await settle(proxied)
        assert not await client.exists(name), "the cancelled 'try' left the lock held"
        await assert_no_ghost(client, name, proxied)

    async def test_cancel_during_try_on_held_lock(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        name: str,
    ) -> None:
        held = await take(holder, name)
        fault_proxy.hold_replies()
        task = asyncio.create_task(acquiring(Lock(proxied, name)))
        await fault_proxy.wait_held()  # a warm connection: the only reply is the 'try' attempt's
        await cancel_held_up(task, fault_proxy)

        await settle(proxied)
        lease = held.current_lease
        assert lease is not None
        assert await owner_of(client, name) == introspect.lease_owner_id(lease)
        await assert_no_ghost(client, name, proxied, holder)
        await held.release()
        assert not await client.exists(name), "the release handed the lock to a cancelled task"

    @pytest.mark.parametrize("live_waiter", [False, True], ids=["alone", "with-live-waiter"])
    async def test_cancel_while_waiting_deregisters(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        name: str,
        live_waiter: bool,
    ) -> None:
        held = await take(holder, name)
        task = asyncio.create_task(acquiring(Lock(proxied, name)))
        await until(lambda: registered(client, name), what="the waiter's registration")
        await quiesce(fault_proxy)  # its registering reply is read: it sleeps now
        other = None
        if live_waiter:
            other = HoldingTask(Lock(client, name), timeout=5.0)
            await until(
                lambda: equals(registered(client, name), 2), what="the live waiter's registration"
            )

        task.cancel()  # it sleeps in the wait, registered in Redis
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await registered(client, name) == (1 if live_waiter else 0)
        await settle(proxied)
        await assert_no_ghost(client, name, proxied, holder, client)

        await held.release()
        if other is None:
            assert not await client.exists(name), "the release handed the lock to a cancelled task"
            return
        lease = await other.wait_acquired()
        assert lease is not None, "the live waiter never got the lock"
        assert await owner_of(client, name) == introspect.lease_owner_id(lease)
        await other.end()
        assert not await client.exists(name)
        await settle(client)

    @pytest.mark.parametrize("handed_over", [False, True], ids=["still-held", "handed-over"])
    async def test_cancel_during_registering_wait_attempt(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        name: str,
        handed_over: bool,
    ) -> None:
        held = await take(holder, name)
        fault_proxy.hold_replies()
        task = asyncio.create_task(acquiring(Lock(proxied, name)))
        # through the 'try', the pub/sub handshake and SUBSCRIBE, up to the 'wait' attempt
        await hold_reply_of(fault_proxy, lambda: equals(registered(client, name), 1))
        if handed_over:
            # The release hands the lock to the registration whose reply is still in flight.
            holder_id = _owner_id(held)
            await held.release()
            assert await owner_of(client, name) not in (None, holder_id)
        await cancel_held_up(task, fault_proxy)

        await settle(proxied)
        assert await registered(client, name) == 0
        await assert_no_ghost(client, name, proxied, holder)
        if not handed_over:
            await held.release()
        assert not await client.exists(name), "the cancelled waiter kept (or got) the lock"

    async def test_cancel_during_release_still_releases(
        self, proxied: aioredis.Redis, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(proxied, name)
        acquired, go = asyncio.Event(), asyncio.Event()

        async def hold_then_release() -> None:
            await lock.acquire()
            acquired.set()
            await go.wait()
            await lock.release()

        task = asyncio.create_task(hold_then_release())
        await acquired.wait()
        fault_proxy.hold_replies()
        go.set()
        await hold_reply_of(fault_proxy, lambda: equals(client.exists(name), 0))  # released
        await cancel_held_up(task, fault_proxy)

        await settle(proxied)
        assert not await client.exists(name)
        assert not introspect.held_leases(proxied)
        await assert_no_ghost(client, name, proxied)

    async def test_cancel_as_release_starts_still_releases(
        self, proxied: aioredis.Redis, client: aioredis.Redis, name: str
    ) -> None:
        """Cancelled before the release command is even sent, by a task that survives the
        cancellation (so no task-exit safety net): the lock must still be released."""
        lock = Lock(proxied, name)
        acquired, go, cancelled, leave = (asyncio.Event() for _ in range(4))

        async def hold_then_release() -> None:
            await lock.acquire()
            acquired.set()
            await go.wait()
            try:
                await lock.release()
            except asyncio.CancelledError:
                cancelled.set()
            await leave.wait()

        task = asyncio.create_task(hold_then_release())
        await acquired.wait()
        go.set()
        await asyncio.sleep(0)  # the task runs up to the release's first await, no further
        task.cancel()
        await cancelled.wait()
        try:
            await until(lambda: equals(client.exists(name), 0), what="the release", within=2.0)
            await settle(proxied)
            assert not introspect.held_leases(proxied)
        finally:
            leave.set()
            await task

    async def test_cancel_during_reentry_restores_hold_count(
        self, proxied: aioredis.Redis, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(proxied, name)
        first, reenter, cancelled, done = (asyncio.Event() for _ in range(4))

        async def owner() -> None:
            await lock.acquire()
            first.set()
            await reenter.wait()
            try:
                await lock.acquire()
            except asyncio.CancelledError:
                uncancel = getattr(asyncio.current_task(), "uncancel", None)
                if uncancel is not None:
                    uncancel()
                cancelled.set()
            else:
                raise AssertionError("the re-entry was not cancelled")
            await done.wait()
            await lock.release()

        task = asyncio.create_task(owner())
        await first.wait()
        fault_proxy.hold_replies()
        reenter.set()
        await hold_reply_of(
            fault_proxy, lambda: equals(introspect.server_hold_count(client, name), 2)
        )
        task.cancel()
        fault_proxy.release_replies()
        await cancelled.wait()

        await until(
            lambda: equals(introspect.server_hold_count(client, name), 1),
            what="the unseen re-entry to be undone (count back to 1)",
        )
        lease = introspect.lease_of(proxied, name, task)
        assert lease is not None
        assert lease.hold_count == 1
        assert await owner_of(client, name) == introspect.lease_owner_id(lease)
        done.set()
        await finish(task, 5.0, "release after the cancelled re-entry")
        task.result()
        assert not await client.exists(name), "one release did not free a lock entered once"
        await settle(proxied)

    async def test_move_on_after_while_waiting_leaks_nothing(
        self, proxied: aioredis.Redis, client: aioredis.Redis, holder: aioredis.Redis, name: str
    ) -> None:
        held = await take(holder, name)
        with anyio.move_on_after(0.2) as scope:
            await Lock(proxied, name).acquire()
        assert scope.cancelled_caught

        await settle(proxied)
        assert await registered(client, name) == 0
        await assert_no_ghost(client, name, proxied, holder)
        await held.release()
        assert not await client.exists(name)

    async def test_cancel_scope_during_try_leaks_nothing(
        self, proxied: aioredis.Redis, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        """anyio keeps re-cancelling a task until it leaves the scope: the cleanup must not
        depend on the cancelled task living on."""
        fault_proxy.hold_replies()

        with anyio.CancelScope() as scope:

            async def cancel_when_taken() -> None:
                await hold_reply_of(fault_proxy, lambda: equals(client.exists(name), 1))
                scope.cancel()
                await asyncio.sleep(0.01)  # let anyio's cancellation land first
                fault_proxy.release_replies()

            helper = asyncio.create_task(cancel_when_taken())
            await Lock(proxied, name).acquire()
        await helper
        assert scope.cancelled_caught

        await settle(proxied)
        assert not await client.exists(name)
        await assert_no_ghost(client, name, proxied)

    async def test_grant_arriving_while_the_waiter_gives_up(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        name: str,
    ) -> None:
        """The holder hands the lock to the registered waiter, but the announcement is held
        back until the waiter's deadline has passed and it gave up: the give-up must pass the
        lock on (here: free it), and the late grant must not make the waiter a holder."""
        held = await take(holder, name)
        fault_proxy.hold_replies()
        waiter = HoldingTask(Lock(proxied, name), timeout=0.3)
        await _reach_sleep(fault_proxy, client, name)
        holder_id = _owner_id(held)
        await held.release()  # the handover's announcement is held back
        assert await owner_of(client, name) not in (None, holder_id)
        await until(lambda: equals(owner_of(client, name), None), what="the give-up to pass it on")
        fault_proxy.release_replies()
        assert await waiter.wait_acquired() is None
        await _check_outcome(waiter, client, name, proxied)

    async def test_handover_just_before_giving_up(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        name: str,
    ) -> None:
        """The exact race of a release with a timeout: the waiter's time is up, and the
        holder's release (handing the lock to it) runs on the server just before the waiter's
        give-up script. The give-up must pass the lock on.

        ``CLIENT PAUSE WRITE`` orders the two scripts: both are postponed, then run in order.
        """
        holding = HoldingTask(Lock(holder, name))
        assert await holding.wait_acquired() is not None
        fault_proxy.hold_replies()
        waiter = HoldingTask(Lock(proxied, name), timeout=0.3)
        await _reach_sleep(fault_proxy, client, name)

        await client.execute_command("CLIENT", "PAUSE", "5000", "WRITE")  # type: ignore[no-untyped-call]
        try:
            release = asyncio.create_task(holding.end())
            await until(lambda: equals(blocked_clients(client), 1), what="the release to queue")
            await until(lambda: equals(blocked_clients(client), 2), what="the give-up to queue")
        finally:
            await client.execute_command("CLIENT", "UNPAUSE")  # type: ignore[no-untyped-call]
        await finish(release, 2.0, "the holder's release")
        fault_proxy.release_replies()  # the handover announcement comes too late to matter

        # Either outcome must be real (no ghost): the waiter gave up and its give-up passed the
        # lock on (the usual case), or — about one run in ten on a loaded machine — the grant
        # reached it before its deadline and it holds the lock, as the server says.
        await _check_outcome(waiter, client, name, proxied)

    @pytest.mark.parametrize("offset_ms", [-6, -3, -1, 0, 1, 2, 4, 8])
    async def test_release_racing_the_waiters_timeout(
        self,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        connect: Connect,
        name: str,
        offset_ms: int,
    ) -> None:
        """Real-time race: the holder releases around the moment the waiter's timeout ends."""
        waiting = connect()
        held = await take(holder, name)
        loop = asyncio.get_running_loop()
        # 0.5 s: time enough to subscribe and register first even on a loaded machine.
        deadline = loop.time() + 0.5
        waiter = HoldingTask(Lock(waiting, name), timeout=0.5)
        await until(lambda: registered(client, name), what="the waiter's registration")
        await asyncio.sleep(max(0.0, deadline + offset_ms / 1000 - loop.time()))
        await held.release()
        await _check_outcome(waiter, client, name, waiting)


async def _reach_sleep(proxy: FaultProxy, inspector: aioredis.Redis, name: str) -> None:
    """With replies held from the start of an acquire: let everything through up to and
    including the registering attempt's reply; the waiter then sleeps until its deadline
    (nothing else wakes it), when it gives up."""
    await hold_reply_of(proxy, lambda: equals(registered(inspector, name), 1))
    await step(proxy)


async def _check_outcome(
    waiter: HoldingTask, inspector: aioredis.Redis, name: str, client: aioredis.Redis
) -> None:
    """Either the waiter holds the lock (really) or nobody does; never a ghost."""
    lease = await waiter.wait_acquired()
    if lease is not None:
        assert await owner_of(inspector, name) == introspect.lease_owner_id(lease)
        assert int(await inspector.hget(name, "token") or 0) == lease.fencing_token
        await waiter.end()
    else:
        await finish(waiter.task, 2.0, "timed-out waiter")
    await settle(client)
    assert not await inspector.exists(name), "the lock was left to a ghost"
    assert await registered(inspector, name) == 0


def _owner_id(lock: Lock) -> str:
    lease = lock.current_lease
    assert lease is not None
    return introspect.lease_owner_id(lease)


async def equals(value: Awaitable[object], expected: object) -> bool:
    """Whether ``value`` resolves to ``expected`` (a predicate for :func:`until`)."""
    return await value == expected


# --------------------------------------------------------------------------------------------
# 2. The pub/sub connection is killed (S2)
# --------------------------------------------------------------------------------------------


async def _all_proceed(workers: list[HoldingTask], within: float) -> list[int]:
    """Let every worker acquire in turn (each releasing at once); the tokens, in order."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    tokens: list[int] = []
    pending = list(workers)
    while pending:
        left = max(0.0, deadline - loop.time())
        done, _ = await asyncio.wait(
            [w.acquired for w in pending], timeout=left, return_when=asyncio.FIRST_COMPLETED
        )
        if not done:
            for worker in pending:
                if worker.task.done():
                    worker.task.result()  # an acquire that failed: show why
            raise AssertionError(f"{len(pending)} of {len(workers)} waiters stuck for {within} s")
        for worker in [w for w in pending if w.acquired.done()]:
            lease = worker.acquired.result()
            assert lease is not None
            tokens.append(lease.fencing_token)
            await worker.end()
            pending.remove(worker)
    assert tokens == sorted(tokens)
    return tokens


async def _three_waiters(
    conn: aioredis.Redis, inspector: aioredis.Redis, name: str
) -> list[HoldingTask]:
    """Three tasks of ``conn`` waiting for ``name``: all queued locally, the head registered."""
    lock = Lock(conn, name)
    workers = [HoldingTask(lock, timeout=10) for _ in range(3)]
    await until(lambda: introspect.local_waiters(conn) == 3, what="three local waiters")
    await until(lambda: registered(inspector, name), what="the head's registration")
    return workers


async def _released_once_resubscribed(
    client: aioredis.Redis,
    waiting: aioredis.Redis,
    held: Lock,
    workers: list[HoldingTask],
    name: str,
) -> None:
    """Once the waiters' process is subscribed again, release ``held``: every waiter proceeds
    within 1 s, and nothing is left held or waiting."""
    await until(lambda: subscribers(client, name), what="the re-subscription")
    loop = asyncio.get_running_loop()
    released = loop.time()
    await held.release()
    await _all_proceed(workers, within=1.0)
    assert loop.time() - released < 1.0
    await settle(waiting)
    assert not await client.exists(name)


def _silence_noticed_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """A silent pub/sub connection is found dead within ~0.6 s, and a waiter's attempt is
    given up after 1 s (``ATTEMPT_PATIENCE``)."""
    monkeypatch.setattr(_notify, "_READ_SLICE", 0.1)
    monkeypatch.setattr(_notify, "PING_AFTER", 0.3)
    monkeypatch.setattr(_notify, "PING_TIMEOUT", 0.3)
    monkeypatch.setattr(_core, "ATTEMPT_PATIENCE", 1.0)


class TestPubSubKilled:
    async def test_waiters_proceed_after_pubsub_kill(
        self, client: aioredis.Redis, holder: aioredis.Redis, connect: Connect, name: str
    ) -> None:
        waiting = connect()
        held = await take(holder, name)
        workers = await _three_waiters(waiting, client, name)

        assert await kill_pubsub(client) == 1
        await _released_once_resubscribed(client, waiting, held, workers, name)

    @pytest.mark.parametrize(
        "error",
        [
            AttributeError("'NoneType' object has no attribute 'writelines'"),
            TypeError("'NoneType' object is not callable"),
        ],
        ids=["AttributeError", "TypeError"],
    )
    async def test_a_broken_read_does_not_end_the_listener(
        self,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        connect: Connect,
        name: str,
        error: Exception,
    ) -> None:
        """Regression (attack passes on the short way: ``pool.disconnect()`` under a waiting
        client made redis-py's pub/sub read fail with asyncio's raw error for a torn-down
        transport — ``AttributeError: 'NoneType' object has no attribute 'writelines'``, and
        on Python 3.13 ``TypeError: 'NoneType' object is not callable`` — which ended the
        listener task: the waiters heard no release and slept until their fallback bound, or
        for ever while one waited for a subscription nothing would confirm). The listener
        takes any error of a pub/sub call for a broken connection, reconnects, and the
        waiters proceed at the release. (A client with health checks: its hub reads with
        ``get_message``; see ``TestSubscriptionReading`` for the hub's own reader.)"""
        waiting = connect(health_check_interval=30)
        held = await take(holder, name)
        workers = await _three_waiters(waiting, client, name)
        (hub,) = introspect.hubs(waiting)
        pubsub = hub._pubsub
        assert pubsub is not None
        real = pubsub.get_message
        broken: list[bool] = []

        async def torn_down(*args: Any, **kwargs: Any) -> Any:
            if not broken:
                broken.append(True)
                raise error
            return await real(*args, **kwargs)

        pubsub.get_message = torn_down
        await until(lambda: bool(broken), what="the broken read")
        await _released_once_resubscribed(client, waiting, held, workers, name)

    async def test_waiters_re_check_past_a_silent_command_connection(
        self,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        connect: Connect,
        name: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (contract probe, stop 32): every connection of a waiting client went
        silent at once (half-open: a NAT dropped them; no ``socket_timeout``) and the lock was
        released meanwhile. The health check found the pub/sub connection dead and reconnected,
        and the waiters re-checked — on a pooled connection that was silent too, where the
        attempt waited for ever: the lock stayed free and nobody took it (an acquire without a
        timeout would never have returned). A waiting attempt not answered within
        ``ATTEMPT_PATIENCE`` now gives its connection up, and the waiter waits on under a new
        owner id (see the next test), on a new connection.
        (redis-py 8 sets a 5 s ``socket_timeout`` by default, which ended such an attempt:
        this client turns it off.)"""
        _silence_noticed_soon(monkeypatch)
        waiting = connect(url=fault_proxy.url, socket_timeout=None)
        held = await take(holder, name)
        workers = await _three_waiters(waiting, client, name)
        assert fault_proxy.blackhole_where(b"") >= 2  # the pub/sub connection and the pool's
        await held.release()  # announced into the void
        await _all_proceed(workers, within=8.0)
        fault_proxy.heal()
        await settle(waiting)
        assert not await client.exists(name)

    async def test_an_attempt_given_up_takes_nothing_when_it_lands_late(
        self,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        connect: Connect,
        name: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (attack pass on the test above's fix, stop 32): a waiting attempt given
        up after ``ATTEMPT_PATIENCE`` was sent again under the same owner id; a copy of the
        first that reached the server late (held on its way, not lost) — after the task had
        taken the lock with the second and released it — found the lock free and took it
        again for that owner: a ghost hold for a whole lease, nobody to release it (a helper's
        proxy showed it for every primitive). The wait now goes on under a new owner id, and
        the one given up is fenced off by its clean-up: its late copy (replayed here) takes
        nothing."""
        _silence_noticed_soon(monkeypatch)
        waiting = connect(url=fault_proxy.url, socket_timeout=None)
        held = await take(holder, name)
        worker = HoldingTask(Lock(waiting, name), timeout=10)
        await until(lambda: registered(client, name), what="the waiter's registration")
        (given_up,) = await introspect.registered_waiters(client, name)
        assert fault_proxy.blackhole_where(b"") >= 2  # its re-check after the release is lost
        await held.release()
        lease = await asyncio.wait_for(worker.acquired, 8.0)
        assert lease is not None
        assert introspect.lease_owner_id(lease) != given_up  # waited on as a new owner
        await worker.end()
        fault_proxy.heal()
        await settle(waiting)
        late = await LOCK_ACQUIRE.run(
            client, LockKeys.for_name(name).script_keys, (given_up, 30_000, "wait", 2_000, 2_000)
        )
        assert isinstance(late, list) and int(late[0]) == -1, late  # a late duplicate: refused
        assert not await client.exists(name)

    async def test_a_first_attempt_on_a_silent_connection_is_sent_again(
        self,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        connect: Connect,
        name: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (stop 32, beside the waiters' case above): on a client with
        ``socket_timeout=None`` the first, uncontended attempt of an acquire went out on a
        pooled connection gone silent (half-open) and waited there until the caller's
        deadline — for ever without one — though the lock was free. Such a client's first
        attempt is bounded by ``ATTEMPT_PATIENCE`` too: the acquire goes on as a waiter, on a
        new connection. (A client with a ``socket_timeout`` keeps its own bound: no timer is
        added to its uncontended acquisitions.)"""
        monkeypatch.setattr(_core, "ATTEMPT_PATIENCE", 1.0)
        quiet = connect(url=fault_proxy.url, socket_timeout=None)
        await quiet.ping()  # the pool's one connection, idle
        assert fault_proxy.blackhole_where(b"") == 1
        lock = Lock(quiet, name)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await lock.acquire(timeout=8)
        assert loop.time() - started < 4.0
        fault_proxy.heal()
        await lock.release()
        await settle(quiet)
        assert not await client.exists(name)

    async def test_a_cancelled_waits_clean_up_on_a_silent_connection_ends(
        self,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        connect: Connect,
        name: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (helper-43): on a client with ``socket_timeout=None`` whose connections
        went silent (half-open), a waiter cancelled meanwhile sent its clean-up (the abandon)
        on the silent pooled connection and waited for its reply for ever: the task lived on,
        the connection stayed out of the pool (three such cancellations used up a pool of
        three: no acquire could run again), and the waiter's registration stayed on the
        server. Each clean-up call now gets ``ATTEMPT_PATIENCE``; the next try takes a new
        connection."""
        monkeypatch.setattr(_core, "ATTEMPT_PATIENCE", 1.0)
        quiet = connect(url=fault_proxy.url, socket_timeout=None, max_connections=2)
        held = await take(holder, name)
        lock = Lock(quiet, name)

        async def wait() -> None:
            await lock.acquire(timeout=30)

        waiting = asyncio.create_task(wait())
        await introspect.until_registered(client, name, 1)
        assert fault_proxy.blackhole_where(b"") >= 2  # the pub/sub connection and the pool's
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        queue = LockKeys.for_name(name).queue

        async def unregistered() -> bool:
            return await client.zcard(queue) == 0

        await until(unregistered, what="the cancelled waiter's registration gone", within=6.0)
        pool: Any = quiet.connection_pool
        await until(lambda: not pool._in_use_connections, what="the pooled connection back")
        await held.release()
        assert not await client.exists(name)  # (not handed to the waiter that gave up)
        assert await lock.acquire(timeout=5)
        await lock.release()
        fault_proxy.heal()
        await settle(quiet)

    async def test_release_while_pubsub_down_is_not_missed(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        name: str,
    ) -> None:
        """The pub/sub connection is killed and its reconnection stalls in the handshake
        (replies held), so the release is announced to nobody — and finds the waiters' process
        absent from the server (no presence subscription), so it drops their registrations
        and leaves the lock free; once the connection is back the waiters must re-check and
        take it."""
        held = await take(holder, name)
        workers = await _three_waiters(proxied, client, name)

        fault_proxy.hold_replies()  # the pub/sub reconnection stalls in its handshake
        assert await kill_pubsub(client) == 1
        await fault_proxy.wait_held()
        assert await subscribers(client, name) == 0
        holder_id = _owner_id(held)
        await held.release()  # announces to nobody
        assert await subscribers(client, name) == 0
        assert await owner_of(client, name) != holder_id

        loop = asyncio.get_running_loop()
        reconnecting = loop.time()
        fault_proxy.release_replies()
        await _all_proceed(workers, within=1.0)
        assert loop.time() - reconnecting < 1.0
        await settle(proxied)
        assert not await client.exists(name)


    @pytest.mark.parametrize("kind", [Lock, FairLock])
    async def test_a_subscription_never_confirmed_does_not_keep_a_waiter_from_a_free_lock(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        holder: aioredis.Redis,
        name: str,
        kind: type[Lock],
    ) -> None:
        """Regression (helper-57): a pub/sub path that hangs while commands pass (every
        connection that sends SUBSCRIBE goes silent, the hub's reconnections too) kept a
        waiter's first attempt waiting for the confirmation until its timeout — a lock
        released a second into the wait stayed untaken for the whole timeout, and for ever
        without one. The attempt goes ahead without the subscription after
        ``SUBSCRIBE_PATIENCE``, its timers the fallback."""
        held = kind(holder, name, lease=5.0)
        assert await held.acquire()
        fault_proxy.blackhole_sending(b"subscribe")
        waiter = kind(proxied, name)
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def wait_then_release() -> float:
            assert await waiter.acquire(timeout=20)
            took = loop.time() - started
            await waiter.release()
            return took

        waiting = asyncio.ensure_future(wait_then_release())
        await asyncio.sleep(1.0)
        await held.release()
        assert await asyncio.wait_for(waiting, 10) < _core.SUBSCRIBE_PATIENCE + 1.0
        fault_proxy.heal()


# --------------------------------------------------------------------------------------------
# 3. Holder processes: SIGKILL, and exclusion across processes (S1, S2)
# --------------------------------------------------------------------------------------------


class TestSubscriptionReading:
    """The hub reads its pub/sub connection in a protocol callback of its own where it can
    (``_notify._Tap``), else with redis-py's ``get_message``."""

    async def test_a_quiet_healthy_connection_outlives_its_health_checks(
        self,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        connect: Connect,
        name: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (the hub reading in a callback, stop 27): the listener looked for an
        answer to its health-check ``PING`` only among what arrived while it next waited; the
        answer had come before (while the ``PING`` was being sent), so every health check of
        a quiet, healthy connection ended in "no answer to PING" and a reconnection."""
        monkeypatch.setattr(_notify, "_READ_SLICE", 0.05)
        monkeypatch.setattr(_notify, "PING_AFTER", 0.1)
        monkeypatch.setattr(_notify, "PING_TIMEOUT", 0.3)
        pings: list[str] = []
        command = _notify.SubscriptionHub._command

        async def counted(hub: Any, pubsub: Any, what: str, *args: str) -> Any:
            if what != "ping" or hub._tap is None:
                return await command(hub, pubsub, what, *args)
            pings.append(what)
            before = hub._tap.received
            sent = await command(hub, pubsub, what, *args)
            # The answer is in before the listener looks again (a busy machine's timing).
            await until(lambda: hub._tap.received > before, what="the PING's answer")
            return sent

        monkeypatch.setattr(_notify.SubscriptionHub, "_command", counted)
        waiting = connect()
        held = await take(holder, name)
        workers = await _three_waiters(waiting, client, name)
        (hub,) = introspect.hubs(waiting)
        assert hub._tap is not None  # (a plain RESP2 client: read in the callback)
        await until(lambda: len(pings) >= 5, what="five health checks")
        assert hub.reconnects == 0
        await held.release()
        await _all_proceed(workers, within=1.0)

    async def test_waiting_on_ever_new_names_keeps_no_record_of_each(
        self,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        connect: Connect,
        name: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (the hub reading in a callback, stop 27): subscriptions sent through
        redis-py's ``PubSub`` object are recorded there, and only its own reader — no longer
        run — forgets a channel when its unsubscription is confirmed: a process waiting on
        ever new names (a lock per order) would have kept every channel it ever waited on."""
        monkeypatch.setattr(_notify, "_LINGER", 0.01)
        waiting = connect()
        anchor = await take(holder, name)  # waited for all along: the connection stays
        workers = await _three_waiters(waiting, client, name)
        (hub,) = introspect.hubs(waiting)
        pubsub = hub._pubsub
        for i in range(12):
            other = f"{name}:{i}"
            held = await take(holder, other)
            worker = HoldingTask(Lock(waiting, other), timeout=10)
            await until(lambda: introspect.local_waiters(waiting) == 4, what="a fourth waiter")
            await held.release()
            assert await worker.wait_acquired() is not None
            await worker.end()
            await until(lambda: introspect.local_waiters(waiting) == 3, what="the waiter gone")
        await until(lambda: len(hub.lots()) == 1, what="the other channels unsubscribed")
        assert hub._pubsub is pubsub and hub.reconnects == 0
        records = (
            len(pubsub.channels)
            + len(pubsub.shard_channels)
            + len(pubsub.pending_unsubscribe_channels)
            + len(pubsub.pending_unsubscribe_shard_channels)
        )
        assert records <= 2  # (none with the tap; the waited lock and its presence without)
        await anchor.release()
        await _all_proceed(workers, within=1.0)

    async def test_an_unreadable_frame_costs_a_reconnection_not_the_waiters(
        self, client: aioredis.Redis, holder: aioredis.Redis, connect: Connect, name: str
    ) -> None:
        """What the hub's reader cannot parse (a protocol error) leaves nothing on the
        connection to trust: the hub drops it, subscribes anew, and the waiters proceed at
        the release."""
        waiting = connect()
        held = await take(holder, name)
        workers = await _three_waiters(waiting, client, name)
        (hub,) = introspect.hubs(waiting)
        tap = hub._tap
        assert tap is not None
        tap.data_received(b"?not a RESP frame\r\n")
        await until(lambda: hub.reconnects == 1, what="the reconnection")
        await _released_once_resubscribed(client, waiting, held, workers, name)

    @pytest.mark.parametrize("protocol", [2, 3])
    async def test_junk_on_a_lock_channel_costs_no_reconnection(
        self,
        client: aioredis.Redis,
        holder: aioredis.Redis,
        connect: Connect,
        name: str,
        protocol: int,
    ) -> None:
        """Regression (attack pass on the hub's reader, stop 27): on a client with
        ``decode_responses=True`` the hub's reader decoded frames strictly, so a message that
        is not UTF-8 — anyone allowed to publish on a lock's channel can send one — failed
        the connection: a reconnection per message (redis-py's ``get_message`` did the
        same). The hub reads bytes and replaces what does not decode."""
        waiting = connect(decode_responses=True, protocol=protocol)
        held = await take(holder, name)
        workers = await _three_waiters(waiting, client, name)
        (hub,) = introspect.hubs(waiting)
        assert hub._tap is not None
        channel = introspect.channel_of(name)
        for _ in range(5):
            await client.publish(channel, b"\xff\xfe junk")
        await client.publish(channel, "f:1")  # well-formed but empty news: a re-check
        await asyncio.sleep(0.2)
        assert hub.reconnects == 0
        loop = asyncio.get_running_loop()
        released = loop.time()
        await held.release()
        await _all_proceed(workers, within=1.0)
        assert loop.time() - released < 1.0

    async def test_a_client_with_health_checks_is_read_by_redis_py(
        self, client: aioredis.Redis, holder: aioredis.Redis, connect: Connect, name: str
    ) -> None:
        """A client with ``health_check_interval`` has redis-py read replies itself (its
        health check sends a ``PING`` and reads the answer): the hub reads with
        ``get_message`` then, and waiters are woken at the release all the same."""
        waiting = connect(health_check_interval=30)
        held = await take(holder, name)
        workers = await _three_waiters(waiting, client, name)
        (hub,) = introspect.hubs(waiting)
        assert hub._tap is None
        loop = asyncio.get_running_loop()
        released = loop.time()
        await held.release()
        await _all_proceed(workers, within=1.0)
        assert loop.time() - released < 1.0


class TestProcesses:
    async def test_waiter_takes_over_within_lease_after_holder_sigkill(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        lease_s = 1.0
        proc = await worker_process(redis_url, name, "--lease", str(lease_s), "hold")
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 15)
            assert line.startswith(b"held "), line
            dead_token = int(line.split()[1])
            waiter = HoldingTask(Lock(client, name), timeout=10)
            await until(lambda: registered(client, name), what="the waiter's registration")

            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            loop = asyncio.get_running_loop()
            killed_at = loop.time()
            lease = await waiter.wait_acquired(within=lease_s + 2)
            took = loop.time() - killed_at
            assert lease is not None
            assert took <= lease_s + 1.0, f"took over {took:.2f} s after the SIGKILL"
            assert lease.fencing_token > dead_token
            await waiter.end()
            await settle(client)
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.communicate()

    async def test_exclusion_across_processes(self, redis_url: str, name: str) -> None:
        def spawn(
            name: str, *args: str, stdin: int | None = None
        ) -> Awaitable[asyncio.subprocess.Process]:
            return worker_process(redis_url, name, *args, stdin=stdin)

        holds = await contend(spawn, name, ["lock"] * 3, tasks=3, rounds=20)
        assert_exclusive(list(itertools.chain.from_iterable(holds)))


# --------------------------------------------------------------------------------------------
# 4. Renewal under faults
# --------------------------------------------------------------------------------------------


class TestRenewal:
    @pytest.mark.slow
    async def test_renewal_keeps_lease_through_proxy(
        self, proxied: aioredis.Redis, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(proxied, name, lease=1.0)
        await lock.acquire()
        lease = lock.current_lease
        assert lease is not None
        await asyncio.sleep(3.5)  # three and a half leases: only renewal keeps it
        assert not lease.lost, lease.lost_reason
        assert await owner_of(client, name) == introspect.lease_owner_id(lease)
        assert await client.pttl(name) > 0
        assert introspect.renewals(proxied) >= 6
        await lock.release()
        assert not await client.exists(name)
        await settle(proxied)

    async def test_a_wait_cut_off_mid_way_times_out_on_time(
        self, fault_proxy: FaultProxy, proxied: aioredis.Redis, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (contract probe of SPEC §4, "every acquire(timeout=t) returns within
        about t whatever the network does"): a waiter whose server stopped answering mid-wait
        returned 0.5 s late — it gave its clean-up (the abandon of its registration) half a
        second to be answered, which never comes in a blackhole (0.8 s for a 0.3 s timeout)."""
        holder = Lock(client, name)
        assert await holder.acquire()
        waiter = Lock(proxied, name)

        async def wait() -> bool:
            return await waiter.acquire(timeout=1.0)

        loop = asyncio.get_running_loop()
        started = loop.time()
        task = asyncio.create_task(wait())
        await asyncio.sleep(0.3)  # waiting, subscribed and registered
        fault_proxy.blackhole()
        try:
            assert not await task
            assert loop.time() - started < 1.0 + 0.3
        finally:
            fault_proxy.heal()
        await holder.release()

    @pytest.mark.parametrize("kind", ["Lock", "FairLock", "read", "write", "Semaphore"])
    async def test_locked_is_bounded_when_the_server_is_silent(
        self, fault_proxy: FaultProxy, proxied: aioredis.Redis, name: str, kind: str
    ) -> None:
        """Bug (attack pass, stop 30): ``locked()`` waited for ever on a server that stopped
        answering (a paused server, a partition; no ``socket_timeout``). It is bounded like a
        single attempt now: a ``LockError`` after about a second, and it works again after."""
        rw = ReadWriteLock(proxied, name)
        lock: Any = {
            "Lock": Lock(proxied, name), "FairLock": FairLock(proxied, name),
            "read": rw.read, "write": rw.write, "Semaphore": Semaphore(proxied, name, 2),
        }[kind]  # fmt: skip
        assert await lock.locked() is False
        loop = asyncio.get_running_loop()
        fault_proxy.blackhole()
        started = loop.time()
        try:
            with pytest.raises(LockError, match=r"cannot inspect .*no reply"):
                await lock.locked()
            assert loop.time() - started < 1.5
        finally:
            fault_proxy.heal()
        assert await lock.locked() is False

    @pytest.mark.parametrize("call", ["free_permits", "set_permits"])
    async def test_a_semaphores_server_calls_are_bounded_like_locked(
        self, fault_proxy: FaultProxy, proxied: aioredis.Redis, name: str, call: str
    ) -> None:
        """Bug (helper-70): ``Semaphore.free_permits()`` and ``set_permits()`` had no bound of
        their own: on a silent server a minute under redis-py's default retry, for ever with
        ``socket_timeout=None`` — where ``locked()``, listed beside them, gives up after about
        a second. They are bounded the same way now."""
        sem = Semaphore(proxied, name, 2)
        assert await sem.free_permits() == 2

        async def run() -> object:
            return await (sem.free_permits() if call == "free_permits" else sem.set_permits(3))

        loop = asyncio.get_running_loop()
        fault_proxy.blackhole()
        started = loop.time()
        try:
            with pytest.raises(LockError, match=r"no reply from the server"):
                await run()
            assert loop.time() - started < 1.5
        finally:
            fault_proxy.heal()
        await sem.set_permits(3)
        assert await sem.free_permits() == 3

    @pytest.mark.parametrize(
        "socket_timeout",
        [pytest.param(None, id="no-socket-timeout"),
         pytest.param(0.25, id="socket-timeout")],
    )  # fmt: skip
    async def test_blackhole_loses_the_lease(
        self, fault_proxy: FaultProxy, client: aioredis.Redis, name: str,
        socket_timeout: float | None,
    ) -> None:  # fmt: skip
        conn = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=socket_timeout)
        try:
            lost: list[Lease] = []
            lock = Lock(conn, name, lease=1.0, on_lost=lost.append)
            await lock.acquire()
            lease = lock.current_lease
            assert lease is not None
            fault_proxy.blackhole()
            loop = asyncio.get_running_loop()
            cut_at = loop.time()
            await asyncio.wait((asyncio.ensure_future(lease.wait_lost()),), timeout=2.0)
            assert lease.lost, f"not marked lost {loop.time() - cut_at:.2f} s into a blackhole"
            assert loop.time() - cut_at <= lease.lease + 0.3
            assert lost == [lease]
            with pytest.raises(LockLostError):
                await lock.release()
            # The local estimate ends first (it counts from the renewal's send time); the
            # server's copy follows within a round trip.
            await until(lambda: equals(client.exists(name), 0), what="server expiry", within=0.5)
        finally:
            fault_proxy.heal()
            await conn.aclose()

    @pytest.mark.parametrize(
        "socket_timeout",
        [pytest.param(None, id="no-socket-timeout"),
         pytest.param(0.25, id="socket-timeout")],
    )  # fmt: skip
    async def test_guarded_block_is_cancelled_when_lost(
        self, fault_proxy: FaultProxy, name: str, socket_timeout: float | None
    ) -> None:
        conn = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=socket_timeout)
        lock = Lock(conn, name, lease=1.0)
        reached: list[str] = []

        async def guarded_work() -> None:
            async with lock.guarded():
                fault_proxy.blackhole()
                await asyncio.sleep(30)
                reached.append("past the loss")

        task = asyncio.create_task(guarded_work())
        try:
            await finish(task, 2.5, "guarded block after its lease was lost")
        finally:
            fault_proxy.heal()
            await conn.aclose()
        with pytest.raises(LockLostError):
            task.result()
        assert reached == []

    async def test_renewal_survives_script_flush(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name, lease=1.0)
        await lock.acquire()
        lease = lock.current_lease
        assert lease is not None
        await client.script_flush()
        before = introspect.renewals(client)
        await asyncio.sleep(1.5)  # longer than the lease: only renewals after NOSCRIPT keep it
        assert not lease.lost, lease.lost_reason
        assert introspect.renewals(client) > before
        assert await owner_of(client, name) == introspect.lease_owner_id(lease)
        await lock.release()
        assert not await client.exists(name)
        await settle(client)

    async def test_external_delete_is_lost_at_next_tick(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lost: list[Lease] = []
        lock = Lock(client, name, lease=1.0, on_lost=lost.append)
        await lock.acquire()
        lease = lock.current_lease
        assert lease is not None
        await client.delete(name)
        loop = asyncio.get_running_loop()
        deleted_at = loop.time()
        await asyncio.wait_for(lease.wait_lost(), timeout=1.0)
        assert loop.time() - deleted_at <= lease.lease / 3 + 0.15
        assert "renewal" in lease.lost_reason
        assert lost == [lease]
        with pytest.raises(LockLostError):
            await lock.release()
        await settle(client)


# --------------------------------------------------------------------------------------------
# 5. Server restart while a task waits
# --------------------------------------------------------------------------------------------


class TestLateReplies:
    @pytest.mark.parametrize("kind", ["Lock", "FairLock", "Semaphore"])
    async def test_an_answer_that_comes_after_its_lease_is_not_a_hold(
        self,
        fault_proxy: FaultProxy,
        proxied: aioredis.Redis,
        client: aioredis.Redis,
        name: str,
        kind: str,
    ) -> None:
        """Bug (helper-59): an attempt whose "taken" reply came after the lease it gave had
        ended (replies delayed 0.5 s, a lease of 0.3 s) made ``acquire()`` return True — state
        held, ``lease.lost`` false — while a rival already held the lock; the loss came in the
        next loop iteration. Such an answer is given up now (fenced): a try returns False, a
        wait goes on as a new owner, and a rival's hold is never shared."""

        def make(redis: aioredis.Redis, lease: float) -> Lock | FairLock | Semaphore:
            if kind == "Semaphore":
                return Semaphore(redis, name, 1, lease=lease)
            return (Lock if kind == "Lock" else FairLock)(redis, name, lease=lease)

        late = make(proxied, 0.3)
        fault_proxy.delay(0.5)
        assert not await late.acquire(blocking=False)
        assert not late.owned() and late.current_lease is None
        rival = make(client, 5.0)
        loop = asyncio.get_running_loop()
        contender = asyncio.create_task(rival_takes(rival, loop.time() + 2.0, hold=0.6))
        try:
            assert not await late.acquire(timeout=1.5)  # (every answer comes after its lease)
            assert not late.owned() and late.current_lease is None
        finally:
            took = await contender
            fault_proxy.delay(0)
        assert took is not None  # the rival's hold was never shared: the late answers were given up
        await settle(proxied)


class TestServerRestart:
    async def test_waiter_acquires_after_restart(
        self, server_factory: ServerFactory, connect: Connect, name: str
    ) -> None:
        private = server_factory()
        inspector = connect(private.url)
        holding = connect(private.url)
        waiting = connect(private.url)
        held = Lock(holding, name)
        await held.acquire()
        waiter = HoldingTask(Lock(waiting, name), timeout=15)
        await until(lambda: registered(inspector, name), what="the waiter's registration")

        await asyncio.to_thread(private.restart)  # no persistence: the lock is gone
        await inspector.connection_pool.disconnect()  # its connection died with the server
        loop = asyncio.get_running_loop()
        back_at = loop.time()
        lease = await waiter.wait_acquired(within=5)
        assert lease is not None
        assert loop.time() - back_at < 2.0
        assert await owner_of(inspector, name) == introspect.lease_owner_id(lease)
        await waiter.end()
        await settle(waiting)


    @pytest.mark.parametrize("kind", ["lock", "fair", "rw-write", "sem"])
    async def test_a_server_that_cannot_be_reached_leaves_nothing_to_clean_up(
        self, name: str, kind: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Bug (helper-76): an acquire that failed because no connection could be had (the
        server down: connection refused; a wrong password) started seconds of clean-up
        retries in the background for a command that never left the client — a "gave up;
        its lease ends by itself" warning, and ``aclose()`` waited ~2 s for them. Nothing
        was sent: nothing is undone now."""
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}")
        lock = make_lock(kind, client, name, permits=2)
        loop = asyncio.get_running_loop()
        with caplog.at_level(logging.INFO, logger="redis_locks_async"):
            for attempt in ({"blocking": False}, {"timeout": 0.3}):
                with pytest.raises(LockError, match="connecting"):
                    await lock.acquire(**attempt)
            assert introspect.pending_cleanups(client) == 0
            started = loop.time()
            await client.aclose()
            assert loop.time() - started < 0.5
        assert not [r for r in caplog.records if "clean" in r.getMessage()], caplog.text


    @pytest.mark.parametrize("kind", ["lock", "fair", "rw-write", "sem"])
    async def test_a_cleanup_outlasts_an_outage_longer_than_its_first_tries(
        self, server: ServerProcess, client: aioredis.Redis, name: str, kind: str
    ) -> None:
        """Bug (helper-78): the undo of an acquisition whose reply was lost (the connection
        dropped after the script ran) tried five times in ~2 s and gave up, so a 3 s outage
        left its ghost hold in place for the rest of the lease — nobody could take the lock.
        An undo now goes on, once a second, until the lease it may have granted has ended."""
        listen = free_port()
        proxy = await FaultProxy(server.host, server.port, port=listen).start()
        conn = aioredis.Redis.from_url(proxy.url)
        try:
            for source in introspect.script_sources():
                await client.script_load(source)
            await conn.ping()
            lease = 12.0
            lock = make_lock(kind, conn, name, permits=1, lease=lease)
            proxy.hold_replies()
            trying = asyncio.create_task(try_once(lock))
            await proxy.wait_held()
            await proxy.close()  # the script ran; its reply is lost, and the port refuses
            with pytest.raises(LockError):
                await trying
            assert introspect.pending_cleanups(conn) == 1
            loop = asyncio.get_running_loop()
            outage_ends = loop.time() + 3.0
            rival = make_lock(kind, client, name, permits=1)
            assert not await try_once(rival)  # (the ghost hold)
            await asyncio.sleep(outage_ends - loop.time())
            proxy = await FaultProxy(server.host, server.port, port=listen).start()
            assert await try_once(rival, patience=lease / 2), "the ghost outlived the outage"
        finally:
            await proxy.close()
            await conn.aclose()

    async def test_the_release_of_an_extended_hold_outlasts_an_outage(
        self, server: ServerProcess, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (helper-79): the background release of a hold extended past the lock's lease
        (``extend(lease=…)``) by a task that ended holding it gave up at the lock's lease from
        then — in an outage longer than that, the lock stayed held until the extended lease
        ended. It is retried until the hold's own end on the server."""
        listen = free_port()
        proxy = await FaultProxy(server.host, server.port, port=listen).start()
        conn = aioredis.Redis.from_url(proxy.url)
        lock = Lock(conn, name, lease=1.0, auto_renew=False)
        extended, down = asyncio.Event(), asyncio.Event()

        async def ends_holding() -> None:
            assert await lock.acquire(blocking=False)
            await lock.extend(lease=20.0)
            extended.set()
            await down.wait()

        try:
            holding = asyncio.create_task(ends_holding())
            await asyncio.wait_for(extended.wait(), 5.0)
            await proxy.close()  # the port refuses: the release fails, and is retried
            down.set()
            await holding
            await asyncio.sleep(3.5)
            proxy = await FaultProxy(server.host, server.port, port=listen).start()
            rival = Lock(client, name)
            assert await try_once(rival, patience=4.0), "the released hold outlived the outage"
        finally:
            await proxy.close()
            await conn.aclose()

    async def test_a_cleanup_waits_out_an_exhausted_pool_without_spending_its_tries(
        self, client: aioredis.Redis, name: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Bug (helper-78): a clean-up's tries that found the connection pool exhausted (an
        outage fills it with connections being torn down) each spent one of its few retries
        — after a handful of them and a brief refusal it "gave up", leaving a ghost hold for
        the lease. Waiting for a connection spends none. (A unit of the retry schedule: the
        command is a stand-in that fails as the client would.)"""
        outcomes: list[BaseException | None] = [
            *(MaxConnectionsError("Too many connections") for _ in range(3)),
            *(RedisConnectionError("Connection refused") for _ in range(4)),
            None,
        ]
        calls = 0

        async def command() -> None:
            nonlocal calls
            outcome = outcomes[calls]
            calls += 1
            if outcome is not None:
                raise outcome

        lock = Lock(client, name, lease=10)
        loop = asyncio.get_running_loop()
        with caplog.at_level(logging.INFO, logger="redis_locks_async"):
            await lock._retrying(command, "cleanup", until=loop.time() + 1.0)
        assert calls == len(outcomes)
        assert "gave up" not in caplog.text


    async def test_a_cleanup_that_keeps_failing_holds_up_no_other(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (helper-83): clean-ups that kept failing for a reason of their own key (its key
        overwritten with a list: ``WRONGTYPE``) marked the node as failing, and each held the
        node's turn for a second at a time: after an outage of 4 s, 200 other clean-ups were
        held up 10 s behind 10 such (20 s behind 20). Only the node's trouble makes them take
        turns. (A unit of the retry schedule: the commands are stand-ins that fail as the
        client would.)"""
        await try_once(Lock(client, name))  # (the client's runtime)
        up = False

        async def poisoned() -> None:
            raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

        async def command() -> None:
            if not up:
                raise RedisConnectionError("Connection refused")
            await asyncio.sleep(0.02)  # (a round trip)

        loop = asyncio.get_running_loop()
        stuck = [
            asyncio.create_task(Lock(client, f"{name}:x{i}", lease=60)._retrying(poisoned, "c"))
            for i in range(10)
        ]
        cleanups = [
            asyncio.create_task(Lock(client, f"{name}:{i}", lease=60)._retrying(command, "c"))
            for i in range(50)
        ]
        try:
            await asyncio.sleep(sum(_core._ERROR_BACKOFF) + 2.0)  # (past their quick tries)
            up = True
            started = loop.time()
            await asyncio.wait_for(asyncio.gather(*cleanups), 15.0)
            assert loop.time() - started < 2.5, "held up behind the failing ones"
        finally:
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)

    @pytest.mark.parametrize(
        "refusal",
        [
            ResponseError("NOREPLICAS Not enough good replicas to write."),
            ResponseError("MISCONF Errors writing to the AOF file"),
            RedisClusterException("Redis Cluster cannot be connected."),
        ],
        ids=["noreplicas", "misconf", "cluster-down"],
    )
    async def test_a_cleanup_outlasts_refusals_that_clear_by_themselves(
        self, client: aioredis.Redis, name: str, refusal: Exception
    ) -> None:
        """Bug (helper-81): past its quick tries a clean-up stopped at an error not counted
        as transient — ``NOREPLICAS`` while a replica was away for 3 s: "gave up", and its
        ghost hold kept the lock for the rest of its lease; and redis-py's
        ``RedisClusterException`` (no node of a stopped cluster answers) killed the clean-up
        ("background task failed"). Every error is retried until the lease ends."""
        await try_once(Lock(client, name))  # (the client's runtime)
        failures = len(_core._ERROR_BACKOFF) + 2
        tries = 0

        async def command() -> None:
            nonlocal tries
            tries += 1
            if tries <= failures:
                raise refusal

        lock = Lock(client, name, lease=10)
        await asyncio.wait_for(lock._retrying(command, "cleanup"), 8.0)
        assert tries == failures + 1

    async def test_cleanups_in_an_outage_take_turns(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (helper-79, of the clean-ups made to outlast an outage): 2,000 clean-ups of a
        client whose server was gone each retried on their own, and each try that found the
        pool exhausted polled it every 50 ms — a core kept busy for the whole lease, the loop
        lagging until healthy leases of the process were lost. Past their quick tries the
        clean-ups of a client take turns: one try a second in all. Once the server answers
        they all go at once (helper-81: one at a time, 100 of them kept their ghost holds 10 s
        longer at a 0.1 s round trip). (A unit of the retry schedule: the command is a
        stand-in that fails as the client would.)"""
        await try_once(Lock(client, name))  # (the client's runtime)
        tries = 0
        up = False

        async def command() -> None:
            nonlocal tries
            tries += 1
            if not up:
                raise RedisConnectionError("Connection refused")
            await asyncio.sleep(0.02)  # (a round trip)

        loop = asyncio.get_running_loop()
        locks = [Lock(client, f"{name}:{i}", lease=30) for i in range(200)]
        cleanups = [asyncio.create_task(lock._retrying(command, "cleanup")) for lock in locks]
        await asyncio.sleep(sum(_core._ERROR_BACKOFF) + 0.5)  # (every quick try made)
        quick = tries
        assert quick >= 200 * len(_core._ERROR_BACKOFF), quick
        await asyncio.sleep(3.0)
        assert tries - quick <= 5, f"{tries - quick} tries in 3 s of an outage"
        up = True
        started = loop.time()
        await asyncio.wait_for(asyncio.gather(*cleanups), 5.0)
        assert loop.time() - started < 1.5, "one at a time"


# --------------------------------------------------------------------------------------------
# 6. Closing the client
# --------------------------------------------------------------------------------------------


class TestClientClose:
    async def test_a_close_inside_a_guarded_block_still_closes_the_client(
        self, redis_url: str, name: str
    ) -> None:
        """Bug (helper-66): ``aclose()`` inside ``async with lock.guarded():`` — the close
        marks the hold lost, which cancels the block, and with it the caller's ``aclose()``
        before redis-py's own close of the client ran: a pooled connection stayed open."""
        tag = f"guarded-{secrets.token_hex(4)}"
        conn = aioredis.Redis.from_url(redis_url, client_name=tag)
        lock = Lock(conn, name)
        with pytest.raises(LockLostError, match="client was closed"):
            async with lock.guarded():
                await conn.aclose()
        inspector = aioredis.Redis.from_url(redis_url)
        try:
            assert tag not in str(await inspector.client_list())
        finally:
            await inspector.aclose()

    async def test_a_close_awaited_by_on_lost_is_prompt(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        """Bug (helper-66, in this session's close-in-a-task fix): an ``on_lost`` callback (a
        background task of the library) that awaited ``client.aclose()`` made the close wait
        for that very task — its whole 2 s grace."""
        conn = aioredis.Redis.from_url(redis_url)
        took: list[float] = []
        loop = asyncio.get_running_loop()

        async def close(_: Lease) -> None:
            started = loop.time()
            await conn.aclose()
            took.append(loop.time() - started)

        lock = Lock(conn, name, lease=1.5, on_lost=close)
        assert await lock.acquire()
        await client.delete(name)  # the next renewal finds it gone: on_lost closes the client
        await until(lambda: took, what="the close in on_lost", within=5.0)
        assert took[0] < 1.0, took

    async def test_a_cancelled_close_goes_on_and_a_second_one_waits_for_it(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        """Bug (helper-63): an ``aclose()`` cancelled part-way (a ``wait_for`` around it, a
        shutdown) left the client half-closed — its waiters waiting until their holder's lease
        ended, its listener running, a connection open — and a second ``aclose()`` returned at
        once. The close goes on in a task of its own now, and every call waits for it."""
        holder = Lock(client, name, lease=30.0)
        assert await holder.acquire()
        conn = aioredis.Redis.from_url(redis_url)
        mine = Lock(conn, f"{name}:mine")
        waiting = Lock(conn, name)

        async def wait() -> object:
            try:
                got = await waiting.acquire(timeout=20)
            except LockError as exc:
                return exc
            if got:
                await waiting.release()
            return got

        try:
            assert await mine.acquire()
            waiters = [asyncio.create_task(wait()) for _ in range(2)]
            await until(lambda: waiting.statistics().waiting == 2, what="two waiters")
            closing = asyncio.create_task(conn.aclose())
            await asyncio.sleep(0)
            closing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closing
            await conn.aclose()
            assert not introspect.background_tasks(conn)
            results = await asyncio.wait_for(asyncio.gather(*waiters), 5)
            assert all(isinstance(r, LockError) for r in results), results
        finally:
            await holder.release()

    @pytest.mark.parametrize("kind", ["Lock", "FairLock", "Semaphore", "ReadWriteLock"])
    async def test_locked_on_a_closed_client_is_refused(
        self, redis_url: str, name: str, kind: str
    ) -> None:
        """Bug (helper-65): ``locked()`` on a client closed on this loop opened a connection
        the closed client no longer tracked (an unclosed connection, a ``ResourceWarning``)
        and answered; ``acquire()`` there raises ``LockError`` — and so does ``locked()``."""
        tag = f"closed-{secrets.token_hex(4)}"
        conn = aioredis.Redis.from_url(redis_url, client_name=tag)
        lock: Any
        if kind == "Semaphore":
            lock = Semaphore(conn, name, 2)
        elif kind == "ReadWriteLock":
            lock = ReadWriteLock(conn, name).read
        else:
            lock = (Lock if kind == "Lock" else FairLock)(conn, name)
        async with lock:
            pass
        await conn.aclose()
        with pytest.raises(LockError, match="client was closed"):
            await lock.locked()
        inspector = aioredis.Redis.from_url(redis_url)
        try:
            assert tag not in str(await inspector.client_list())  # no connection reopened
        finally:
            await inspector.aclose()

    @pytest.mark.parametrize("turned", [True, False], ids=["kept", "keeping-pending"])
    async def test_close_while_holding_leaves_no_task(
        self, redis_url: str, name: str, turned: bool
    ) -> None:
        """Closed while holding: no task is left and the lease is lost — once the keeper has
        the hold (the loop turned after the acquisition), and also before, while the hold's
        handing to the keeper is still pending (``LeaseKeeper.add_soon``), when no keeper may
        be started afterwards."""
        baseline = asyncio.all_tasks()
        conn = aioredis.Redis.from_url(redis_url)
        lock = Lock(conn, name, lease=2.0)
        await lock.acquire()
        lease = lock.current_lease
        assert lease is not None
        if turned:
            await asyncio.sleep(0)  # (the hold is handed to the keeper at the next iteration)
            assert len(introspect.background_tasks(conn)) >= 1  # the keeper
        await conn.aclose()
        if not turned:
            await asyncio.sleep(0.05)  # (time for a pending hand-off that should not happen)
        leftover = [t for t in asyncio.all_tasks() - baseline if not t.done()]
        assert leftover == []
        assert lease.lost
        with pytest.raises(LockError):
            await lock.acquire()

    async def test_close_while_waiting_fails_the_waiter(
        self, client: aioredis.Redis, holder: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        held = await take(holder, name)
        await asyncio.sleep(0)  # (the holder's keeper starts: another client's, not counted)
        baseline = asyncio.all_tasks()
        conn = aioredis.Redis.from_url(redis_url)
        task = asyncio.create_task(acquiring(Lock(conn, name)))
        await until(lambda: registered(client, name), what="the waiter's registration")

        await conn.aclose()
        await finish(task, 2.0, "waiter after its client was closed")
        with pytest.raises(LockError):
            task.result()
        leftover = [t for t in asyncio.all_tasks() - baseline if not t.done()]
        assert leftover == []

        await held.release()
        assert not await client.exists(name), "the lock was handed to a closed client's waiter"


async def test_cancellation_swallowed_by_redis_py_is_still_a_cancellation(
    fault_proxy: FaultProxy, client: aioredis.Redis, name: str
) -> None:
    """Regression (an attack pass, Python 3.11: redis-py's ``wait_for`` around a command's
    write swallows a cancellation that lands as the write completes; the acquire then waited
    for the held reply and, when the client's socket timeout ended the read, raised
    ``LockError`` — the caller's cancellation was lost). The caller sees ``CancelledError``
    (on 3.11 when the command's answer or error comes; at once elsewhere), and the attempt is
    undone."""
    for source in introspect.script_sources():
        await client.script_load(source)
    conn = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=0.5)
    try:
        await conn.ping()
        lock = Lock(conn, name)
        loop = asyncio.get_running_loop()
        outcome: list[object] = []

        async def cancelled_at_once() -> None:
            me = asyncio.current_task()
            assert me is not None
            loop.call_soon(me.cancel)  # lands at acquire's first await: the command's write
            try:
                await lock.acquire()
                outcome.append("acquired")
            except asyncio.CancelledError:
                outcome.append("cancelled")
            except LockError as exc:
                outcome.append(exc)

        fault_proxy.hold_replies()
        await asyncio.create_task(cancelled_at_once())
        fault_proxy.heal()
        assert outcome == ["cancelled"]
        await introspect.drain(conn)
        assert not await Lock(client, name).locked()
    finally:
        fault_proxy.heal()
        await conn.aclose()
