"""Regression tests for issue 5: one test (or one parametrised property) per finding.

Each test's docstring starts with ``Regression (issue 5 #N):`` and names the bug; the test
asserts the fixed contract (SPEC §3, §4, §6 S5/S6). Each was checked to fail on the library as
it was before the issue-5 rewrite (the only exceptions: the ``{T}X}b`` name pair, which guards
the new key layout, and is marked as such). They use only the public API,
``tests/_introspect.py`` (the one look inside the library), the fault proxy, real servers and
real worker processes.

Interleavings are driven by the proxy — replies held until the server shows that a command ran,
replies lost under redis-py's retry, delayed or blackholed connections — and by events, not by
sleeps. Real time is waited for only where it is the point: leases running out or being
renewed, timeouts, health checks. Every wait has a bound (:func:`finish`, :func:`until`), so a
regression fails fast instead of hanging the run.

Groups: :class:`TestTwoHolders` (findings 1-9: two tasks believing they hold one lock, or a
hold dropped silently), :class:`TestHangs` (10-16: held forever, hangs, busy loops, partial
writes), :class:`TestMinor`, :class:`TestDeadWaiters`, :class:`TestFencingAcrossRestart`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.crc import key_slot

from redis_locks_async import (
    FairLock,
    HoldState,
    Lease,
    Lock,
    LockError,
    LockLostError,
    LockNotOwnedError,
    ReadWriteLock,
    Semaphore,
)
from redis_locks_async._wire import let_go
from tests import _introspect as introspect
from tests._workers import worker_process
from tests.faultproxy import FaultProxy
from tests.servers import ServerProcess
from tests.test_lock_faults import HoldingTask, equals, finish, until

if TYPE_CHECKING:
    from tests.conftest import Connect

_T = TypeVar("_T")

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


async def outcome(
    call: Callable[[], Awaitable[_T]], within: float, what: str
) -> tuple[_T | BaseException, float]:
    """Run ``call()`` in a task of its own, bounded by ``within`` s: what it returned or
    raised, and how long it took."""
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def body() -> _T:
        return await call()

    task = asyncio.ensure_future(body())
    await finish(task, within, what)
    elapsed = loop.time() - started
    if task.cancelled():
        return asyncio.CancelledError(), elapsed
    exc = task.exception()
    return (exc if exc is not None else task.result()), elapsed


def _code_file(task: asyncio.Task[Any]) -> str:
    """The file of the coroutine ``task`` runs ("" if it does not tell)."""
    code = getattr(task.get_coro(), "cr_code", None)
    return "" if code is None else str(code.co_filename)


async def acquiring(lock: Lock, **kwargs: Any) -> bool:
    """``lock.acquire(**kwargs)`` as the body of a task (the task owns what it acquires)."""
    return await lock.acquire(**kwargs)


async def held_lease(lock: Lock) -> Lease:
    """The calling task's lease on ``lock`` (it must hold it)."""
    lease = lock.current_lease
    assert lease is not None, f"the task does not hold {lock.name!r}"
    return lease


async def in_scope(scope: anyio.CancelScope, call: Callable[[], Awaitable[_T]]) -> _T | None:
    """``call()`` inside ``scope``; ``None`` if the scope was cancelled."""
    with scope:
        return await call()
    return None


class Actor:
    """A task that runs the coroutine functions it is handed, one at a time, in itself — so it
    owns what it acquires — while the test drives faults from its own task."""

    def __init__(self) -> None:
        self._jobs: asyncio.Queue[
            tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]] | None
        ] = asyncio.Queue()
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while (job := await self._jobs.get()) is not None:
            call, result = job
            try:
                value = await call()
            except Exception as exc:  # handed to the test, which asserts on it
                result.set_exception(exc)
            else:
                result.set_result(value)

    def submit(self, call: Callable[[], Awaitable[_T]]) -> asyncio.Future[_T]:
        """Queue ``call``; the future resolves with what it returned or raised."""
        result: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._jobs.put_nowait((call, result))
        return result

    async def run(self, call: Callable[[], Awaitable[_T]], within: float = 5.0) -> _T:
        """Run ``call`` in the actor and return its result (fail after ``within`` s)."""
        return await settled(self.submit(call), within, "actor job")

    async def stop(self) -> None:
        """Let the actor's task end (after the jobs queued so far)."""
        self._jobs.put_nowait(None)
        await finish(self.task, 5.0, "actor")


async def settled(future: asyncio.Future[_T], within: float, what: str) -> _T:
    """``future``'s result, failing (without cancelling it) if it takes over ``within`` s."""
    done, _ = await asyncio.wait((future,), timeout=within)
    if not done:
        raise AssertionError(f"{what}: no result after {within} s")
    return future.result()


async def owner_of(inspector: aioredis.Redis, name: str) -> str | None:
    return await introspect.owner_in_redis(inspector, name)


async def hold_count(inspector: aioredis.Redis, name: str) -> int:
    return await introspect.server_hold_count(inspector, name)


async def is_free(inspector: aioredis.Redis, name: str) -> bool:
    return not await inspector.exists(name)


async def assert_nothing_held(client: aioredis.Redis, name: str) -> None:
    """Once ``client``'s clean-ups ran: the lock ``name`` is free on the server, and nothing of
    the client's holds it here (a refused acquisition leaves no trace)."""
    await introspect.drain(client)
    assert await is_free(client, name)
    assert not introspect.held_leases(client)


async def lose_reply_of(proxy: FaultProxy, ran: Callable[[], Awaitable[bool]]) -> None:
    """With replies held: once ``ran()`` shows the command executed on the server and its reply
    reached the proxy, drop that reply with a RST (a retrying client sends the command again);
    then let replies flow. The lock must not be auto-renewed: the lease keeper may renew a new
    hold early, to put it on its beat — on a connection of its own, whose handshake's reply was
    held too (1 run in 60: "expected exactly one connection with a held reply")."""
    try:
        await until(ran, what="the command to run on the server")
        await proxy.wait_held()
        assert proxy.lose_held() == 1, "expected exactly one connection with a held reply"
    finally:
        proxy.release_replies()


async def load_scripts(client: aioredis.Redis) -> None:
    """``SCRIPT LOAD`` every script, so the first reply to a lock command is the script's own."""
    for source in introspect.script_sources():
        await client.script_load(source)


async def registered(inspector: aioredis.Redis, name: str) -> int:
    return len(await introspect.registered_waiters(inspector, name))


async def snapshot(
    inspector: aioredis.Redis, keys: Sequence[str | bytes]
) -> list[tuple[object, object, bool]]:
    """Each key's type, serialized value and whether it has a TTL: what a script could change."""
    state: list[tuple[object, object, bool]] = []
    for key in keys:
        state.append(
            (await inspector.type(key), await inspector.dump(key), await inspector.pttl(key) > 0)
        )
    return state


def key_label(key: str | bytes, siblings: Sequence[str | bytes]) -> str:
    """What tells ``key`` apart from its ``siblings`` (their common prefix stripped), as text."""
    raw = [k.encode() if isinstance(k, str) else k for k in siblings]
    mine = key.encode() if isinstance(key, str) else key
    common = 0
    while all(len(k) > common and k[common] == raw[0][common] for k in raw):
        common += 1
    return mine[common:].decode("utf-8", "backslashreplace")


def tag_for(name: str) -> str:
    """The smallest decimal tag hashing to ``name``'s cluster slot (how a name with a stray
    ``}`` got its auxiliary prefix before issue 5: ``{tag}:name``)."""
    slot = key_slot(name.encode())
    candidate = 0
    while key_slot(str(candidate).encode()) != slot:
        candidate += 1
    return str(candidate)


async def server_ms(inspector: aioredis.Redis) -> int:
    seconds, micros = await inspector.time()
    return int(seconds) * 1000 + int(micros) // 1000


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture
async def retrying(
    fault_proxy: FaultProxy, client: aioredis.Redis
) -> AsyncIterator[aioredis.Redis]:
    """``Redis(host=…, port=…)`` through ``fault_proxy``: redis-py's default retry re-sends a
    command whose reply was lost. Connected, scripts loaded."""
    await load_scripts(client)
    conn = aioredis.Redis(host=fault_proxy.host, port=fault_proxy.port)
    await conn.ping()
    try:
        yield conn
    finally:
        fault_proxy.heal()
        await conn.aclose()


# --------------------------------------------------------------------------------------------
# Findings 1-9: two holders at once, or a hold dropped without a signal
# --------------------------------------------------------------------------------------------

# Name pairs that shared keys, a queue, a fence or a channel before issue 5: ``X`` is a fresh
# name, ``T`` the tag the old layout gave ``X}b``. Each pair is tried in both orders.
_NAME_PAIRS = [
    ("X", "{X}"),
    ("X", "{X}:fence"),  # the old fence key of X
    ("X}b", "{T}:X}b"),
    ("X}b", "{T}X}b"),  # not a collision before issue 5: the same trap for the new prefix
]


def _name_cases() -> list[Any]:
    cases = []
    for a, b in _NAME_PAIRS:
        cases.append(pytest.param(a, b, id=f"{a}|{b}"))
        cases.append(pytest.param(b, a, id=f"{b}|{a}"))
    return cases


class TestTwoHolders:
    @pytest.mark.parametrize(("template_a", "template_b"), _name_cases())
    async def test_names_never_share_a_lock(
        self, connect: Connect, client: aioredis.Redis, template_a: str, template_b: str
    ) -> None:
        """Regression (issue 5 #1): ``x`` and ``{x}`` (likewise ``a}b`` and ``{tag}:a}b``)
        shared queue, fence and channel, so releasing one handed it to a waiter of the other,
        and a lock named ``{x}:fence`` made ``x`` unusable."""
        base = f"rx{secrets.token_hex(4)}"
        tag = tag_for(base + "}b")

        def materialize(template: str) -> str:
            return template.replace("X", base).replace("T", tag)

        a, b = materialize(template_a), materialize(template_b)
        inspector = client
        holder_b = HoldingTask(Lock(connect(), b))
        lease_b = await holder_b.wait_acquired()
        assert lease_b is not None
        waiter_b = HoldingTask(Lock(connect(), b), timeout=10.0)
        await until(lambda: registered(inspector, b), what=f"a waiter registered for {b!r}")

        # Both names can be held at once, by different clients.
        holder_a = HoldingTask(Lock(connect(), a))
        lease_a = await holder_a.wait_acquired()
        assert lease_a is not None, f"{a!r} is free but could not be acquired"
        assert await owner_of(inspector, a) == introspect.lease_owner_id(lease_a)
        assert await owner_of(inspector, b) == introspect.lease_owner_id(lease_b)

        # Releasing one frees it; the waiter of the other neither gets it nor wakes as owner.
        await holder_a.end()
        assert await is_free(inspector, a), f"releasing {a!r} handed it to a waiter of {b!r}"
        await asyncio.sleep(0.2)
        assert not waiter_b.acquired.done(), f"releasing {a!r} made a waiter own {b!r}"
        assert await owner_of(inspector, b) == introspect.lease_owner_id(lease_b)

        # The other lock still works: its own release hands it to its own waiter.
        await holder_b.end()
        lease_w = await waiter_b.wait_acquired()
        assert lease_w is not None
        assert await owner_of(inspector, b) == introspect.lease_owner_id(lease_w)
        await waiter_b.end()
        assert await is_free(inspector, a)
        assert await is_free(inspector, b)

    async def test_release_with_lost_reply_under_retry_drops_one_hold(
        self,
        retrying: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (issue 5 #2): redis-py's retry re-ran a release whose reply was lost,
        so one release freed a lock held twice."""
        lock = Lock(retrying, name, auto_renew=False)  # (see lose_reply_of)
        assert await lock.acquire()
        assert await lock.acquire()
        lease = await held_lease(lock)

        fault_proxy.hold_replies()
        fault = asyncio.create_task(
            lose_reply_of(fault_proxy, lambda: equals(hold_count(client, name), 1))
        )
        await lock.release()
        await finish(fault, 5.0, "losing the release's reply")
        fault.result()

        assert await owner_of(client, name) == introspect.lease_owner_id(lease), (
            "one release (sent twice by the retry) freed a lock held twice"
        )
        assert await hold_count(client, name) == 1
        await lock.release()
        assert await is_free(client, name)

    async def test_reentry_with_lost_reply_under_retry_counts_once(
        self,
        retrying: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (issue 5 #2): redis-py's retry re-ran a re-entry whose reply was lost,
        so it counted twice and two releases never freed the lock."""
        lock = Lock(retrying, name, auto_renew=False)  # (see lose_reply_of)
        assert await lock.acquire()

        fault_proxy.hold_replies()
        fault = asyncio.create_task(
            lose_reply_of(fault_proxy, lambda: equals(hold_count(client, name), 2))
        )
        assert await lock.acquire()
        await finish(fault, 5.0, "losing the re-entry's reply")
        fault.result()

        assert await hold_count(client, name) == 2, "the re-sent re-entry counted twice"
        await lock.release()
        await lock.release()
        assert await is_free(client, name), "two releases did not free a lock entered twice"

    async def test_final_release_with_lost_reply_under_retry_succeeds(
        self,
        retrying: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (issue 5 #2): a final release re-sent by redis-py's retry found the lock
        gone and reported a spurious LockLostError and on_lost."""
        lost: list[Lease] = []
        lock = Lock(retrying, name, on_lost=lost.append, auto_renew=False)  # (see lose_reply_of)
        assert await lock.acquire()
        lease = await held_lease(lock)

        fault_proxy.hold_replies()
        fault = asyncio.create_task(lose_reply_of(fault_proxy, lambda: is_free(client, name)))
        await lock.release()  # must not raise LockLostError
        await finish(fault, 5.0, "losing the release's reply")
        fault.result()

        assert lost == [], "on_lost was called for a lock released normally"
        assert not lease.lost
        assert await is_free(client, name)

    async def test_failed_inner_release_keeps_the_outer_hold(
        self, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #3): a nested release that failed on a network error marked the
        whole hold released and abandoned it on the server, silently, while the task was still
        inside its outer block."""
        await load_scripts(client)
        conn = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=0.5)
        try:
            await conn.ping()
            lock = Lock(conn, name)
            assert await lock.acquire()
            assert await lock.acquire()
            lease = await held_lease(lock)

            fault_proxy.blackhole()
            loop = asyncio.get_running_loop()
            heal = loop.call_later(1.0, fault_proxy.heal)
            try:
                with contextlib.suppress(LockError):
                    await lock.release()  # the inner one
            finally:
                await asyncio.sleep(max(0.0, heal.when() - loop.time()))
                fault_proxy.heal()
            await introspect.drain(conn)
            await asyncio.sleep(0.2)

            if not lease.lost:
                assert await owner_of(client, name) == introspect.lease_owner_id(lease), (
                    "the outer hold was dropped on the server without a loss signal"
                )
                assert lock.owned(), "the outer hold was dropped locally without a loss signal"
                await lock.release()  # the outer one frees it
                assert await is_free(client, name)
        finally:
            fault_proxy.heal()
            await conn.aclose()

    @pytest.mark.parametrize("how", ["extend", "reenter"])
    async def test_shortened_lease_is_renewed(
        self, connect: Connect, client: aioredis.Redis, name: str, how: str
    ) -> None:
        """Regression (issue 5 #4): ``extend(0.5)`` on a 30 s hold, or a re-entry through a
        ``Lock(…, lease=0.5)``, set a short server TTL that the keeper never renewed, so
        another client acquired the lock under a live holder."""
        lock = Lock(client, name)
        assert await lock.acquire()
        lease = await held_lease(lock)
        inner = Lock(client, name, lease=0.5)
        if how == "extend":
            await lock.extend(0.5)
        else:
            assert await inner.acquire()  # re-enters the same hold

        await asyncio.sleep(1.6)  # three shortened leases
        other = Lock(connect(), name)
        assert not await other.acquire(blocking=False), "another client took a held lock"
        assert await owner_of(client, name) == introspect.lease_owner_id(lease)
        assert not lease.lost
        if how == "reenter":
            await inner.release()
        await lock.release()
        assert await is_free(client, name)

    async def test_nested_guarded_keeps_the_outer_guard(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #5): leaving a nested ``guarded()`` block disarmed the outer
        one, so losing the lease no longer cancelled the outer block."""
        lock = Lock(client, name, lease=0.6)
        carried_on = asyncio.Event()

        async def work() -> None:
            async with lock.guarded():
                async with lock.guarded():
                    pass
                await client.delete(name)  # the lease is gone; renewal will notice
                await asyncio.sleep(10)
                carried_on.set()

        task = asyncio.create_task(work())
        await finish(task, 3.0, "the outer guarded block after its lease was lost")
        assert not carried_on.is_set()
        with pytest.raises(LockLostError):
            task.result()

    async def test_cancelled_reentry_undo_spares_a_later_reentry(
        self, proxied: aioredis.Redis, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #6): the undo of a cancelled re-entry reset the hold count to a
        value captured before a later successful re-entry, so one release freed the lock under
        the outer hold."""
        lock = Lock(proxied, name, auto_renew=False)  # (no renewal's handshake is delayed too)
        actor = Actor()
        try:
            assert await actor.run(lock.acquire)
            lease = await actor.run(lambda: held_lease(lock))

            # Re-entry A reaches the server; its reply is delayed at the proxy; A is cancelled.
            fault_proxy.delay(1.0)
            scope = anyio.CancelScope()
            first = actor.submit(lambda: in_scope(scope, lock.acquire))
            await until(lambda: equals(hold_count(client, name), 2), what="re-entry A to run")
            await fault_proxy.wait_pending_down()
            fault_proxy.delay(0)
            scope.cancel()
            assert await settled(first, 5.0, "cancelled re-entry") is None

            # Re-entry B succeeds while A's reply is still on its way.
            assert await actor.run(lock.acquire)
            await until(
                lambda: fault_proxy.stats.bytes_pending_down == 0,
                what="re-entry A's reply to be delivered",
            )
            await introspect.drain(proxied)

            await actor.run(lock.release)  # releases B: the outer hold remains
            assert await owner_of(client, name) == introspect.lease_owner_id(lease), (
                "the undo of the cancelled re-entry undid the later one too: the inner release "
                "freed the lock under the outer hold"
            )
            assert await hold_count(client, name) == 1
            await actor.run(lock.release)
            assert await is_free(client, name)
        finally:
            await actor.stop()

    async def test_handover_found_by_an_attempt_uses_the_reply_ttl(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (issue 5 #7): a waiter that missed its grant message and found itself
        owner on a re-check took its expiry as ``now + lease`` instead of the reply's PTTL, so
        its first renewal came after the server had expired the lock."""
        lease_s = 1.5
        holder = Lock(connect(), name, lease=lease_s, auto_renew=False)
        assert await holder.acquire()
        waiter = HoldingTask(Lock(proxied, name, lease=lease_s))
        await until(lambda: registered(client, name), what="the waiter's registration")
        assert fault_proxy.blackhole_where(b"SUBSCRIBE") == 1  # the grant will be missed
        await asyncio.sleep(0.1)
        await holder.release()  # hands the lock to the waiter, whose grant message is lost

        lease = await waiter.wait_acquired(within=2 * lease_s)
        assert lease is not None
        await asyncio.sleep(2 * lease_s)
        assert not lease.lost, f"the handed-over lease was lost: {lease.lost_reason}"
        assert await owner_of(client, name) == introspect.lease_owner_id(lease)
        fault_proxy.heal()
        await waiter.end()
        assert await is_free(client, name)

    async def test_wait_for_acquire_is_owned_by_the_caller(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #8): ``await asyncio.wait_for(lock.acquire(), t)`` on Python
        3.10/3.11 ran acquire in a helper task whose end released the lock at once, while the
        caller got ``True`` (its release then raised LockNotOwnedError)."""
        lock = Lock(client, name)
        assert await asyncio.wait_for(lock.acquire(), 5.0)
        lease = await held_lease(lock)
        for _ in range(20):
            await asyncio.sleep(0)  # let a helper task's end run its callbacks
        assert lock.owned()
        assert await owner_of(client, name) == introspect.lease_owner_id(lease)
        assert not await Lock(connect(), name).acquire(blocking=False)
        await lock.release()
        assert await is_free(client, name)

    async def test_acquire_as_a_whole_task_is_refused(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #8): ``await asyncio.create_task(lock.acquire())`` returned
        ``True`` for a lock the ending task then released at once."""
        lock = Lock(client, name)
        with pytest.raises(LockError):
            await asyncio.create_task(lock.acquire())
        await assert_nothing_held(client, name)

    async def test_acquire_as_the_whole_of_an_anyio_task_is_refused(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (contract probe): anyio (≥ 4.11) runs a task group's child in a wrapper that
        awaits it, so ``tg.start_soon(lock.acquire)`` was not seen as a task whose whole body is
        ``acquire()``: the lock was taken and released as the task ended, with a warning, where
        ``asyncio.create_task(lock.acquire())`` raises ``LockError``."""
        lock = Lock(client, name)
        caught: BaseException | None = None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(lock.acquire)
        except BaseException as exc:  # an exception group (a backport's on Python 3.10)
            caught = exc
        assert caught is not None, "not refused"
        inner = getattr(caught, "exceptions", (caught,))
        assert any(isinstance(exc, LockError) for exc in inner), repr(caught)
        await assert_nothing_held(client, name)

        async def work() -> None:  # a task that works under the lock is of course fine
            async with lock:
                assert lock.owned()

        async with anyio.create_task_group() as group:
            group.start_soon(work)
        assert await is_free(client, name)

    async def test_acquire_run_by_anyio_from_thread_is_refused(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (helper-53): ``anyio.from_thread.run(lock.acquire)`` from a worker thread
        returned ``True`` for a lock already released — anyio runs the function's coroutine in
        a task of its own, through a wrapper that only awaits it, which ended holding the lock.
        Refused at the call, like ``asyncio.create_task(lock.acquire())``."""
        lock = Lock(client, name)

        def in_thread() -> object:
            return anyio.from_thread.run(lock.acquire)

        with pytest.raises(LockError, match="whole body"):
            await anyio.to_thread.run_sync(in_thread)
        await assert_nothing_held(client, name)

        async def work() -> bool:  # a coroutine that works under the lock is of course fine
            async with lock:
                return lock.owned()

        assert await anyio.to_thread.run_sync(lambda: anyio.from_thread.run(work))
        assert await is_free(client, name)

    async def test_acquire_under_wait_for_as_a_whole_task_is_refused(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (helper-53): ``await asyncio.create_task(asyncio.wait_for(lock.acquire(),
        5))`` returned ``True`` for a lock already released, on every Python: the task whose
        body is the ``wait_for`` ends as soon as it returns (3.10/3.11 took that task for the
        owner; on 3.12+ ``wait_for`` runs ``acquire()`` in it, its frame between the two)."""
        lock = Lock(client, name)
        with pytest.raises(LockError, match="whole body"):
            await asyncio.create_task(asyncio.wait_for(lock.acquire(), 5))
        await assert_nothing_held(client, name)
        assert await asyncio.wait_for(lock.acquire(), 5)  # awaited in the task: its hold
        assert lock.owned() and not await is_free(client, name)
        await lock.release()

    async def test_a_release_in_a_task_of_its_own_says_why_it_is_refused(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (helper-53): ``await asyncio.shield(lock.release())`` said only "not held by
        this task" though the caller held the lock: ``shield`` runs the release in a task of
        its own. The message names the cause and the fix; the hold is intact."""
        lock = Lock(client, name)
        async with lock:
            with pytest.raises(LockNotOwnedError, match=r"whole body of task .*transfer"):
                await asyncio.shield(lock.release())
            assert lock.owned()
        assert await is_free(client, name)

    async def test_transfer_to_a_task_of_another_loop_is_refused(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (helper-63): ``transfer()`` accepted a task running on another event loop (in
        another thread): its ``release()`` said "not held by this task", and its end was seen
        on that thread, which started the release on this loop from there (with debug on:
        "Non-thread-safe operation", nothing released). It is refused at the call now."""
        started, stop = threading.Event(), threading.Event()
        other: list[asyncio.Task[Any]] = []

        def run_other() -> None:
            async def idle() -> None:
                task = asyncio.current_task()
                assert task is not None
                other.append(task)
                started.set()
                await asyncio.to_thread(stop.wait, 10)

            asyncio.run(idle())

        thread = threading.Thread(target=run_other)
        thread.start()
        try:
            assert await asyncio.to_thread(started.wait, 5)
            lock = Lock(client, name)
            async with lock:
                with pytest.raises(LockError, match="another event loop"):
                    lock.transfer(other[0])
                assert lock.owned()
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 5)
        assert await is_free(client, name)

    async def test_cancel_during_inner_release(
        self, proxied: aioredis.Redis, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #9): cancelling a task during an inner release replaced its
        CancelledError with LockNotOwnedError and left a ghost hold renewed forever."""
        lock = Lock(proxied, name)
        entered, go = asyncio.Event(), asyncio.Event()

        async def nested() -> None:
            async with lock, lock:  # entered twice: an outer and an inner hold
                entered.set()
                await go.wait()

        task = asyncio.create_task(nested())
        await settled(asyncio.ensure_future(entered.wait()), 5.0, "entering twice")
        fault_proxy.hold_replies()
        go.set()
        await until(lambda: equals(hold_count(client, name), 1), what="the inner release")
        await fault_proxy.wait_held()
        task.cancel()
        fault_proxy.release_replies()
        await finish(task, 5.0, "the cancelled task")
        if not task.cancelled():
            raise AssertionError(f"the task's CancelledError was replaced by {task.exception()!r}")

        await introspect.drain(proxied)
        await until(lambda: is_free(client, name), what="the lock to be released", within=3.0)
        await until(
            lambda: introspect.keeper_size(proxied) == 0,
            what="the keeper to let go of the hold",
            within=3.0,
        )


# --------------------------------------------------------------------------------------------
# Findings 10-16: held forever, hangs, busy loops, partial writes
# --------------------------------------------------------------------------------------------


class TestHangs:
    async def test_acquisition_completing_during_close(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (issue 5 #10): an acquisition whose reply arrived while
        ``client.aclose()`` was under way returned ``True`` with a lease never marked lost.

        (Test flake, CI of stop 14: the acquisition sometimes needed a new connection, whose
        handshake reply was held, so it never reached the server; the pool is warmed first.)"""
        other = name + ":other"
        # Idle connections ready: once replies are held a new connection would stall in its
        # handshake, and the waiter's own connections may still be busy (its reply in flight).
        await asyncio.gather(*(proxied.ping() for _ in range(4)))
        blocker = Lock(connect(), other)
        assert await blocker.acquire()
        # A waiter on the closing client keeps the close busy for a moment (it cleans up).
        waiting = asyncio.create_task(acquiring(Lock(proxied, other), timeout=10.0))
        await until(lambda: registered(client, other), what="the waiter's registration")

        fault_proxy.hold_replies()
        attempt = asyncio.create_task(acquiring(Lock(proxied, name, lease=1.0)))
        await until(lambda: client.exists(name), what="the acquisition to run on the server")
        await fault_proxy.wait_held()
        closing = asyncio.create_task(proxied.aclose())
        await asyncio.sleep(0.1)  # the close is under way
        fault_proxy.release_replies()
        await finish(closing, 5.0, "aclose()")
        await finish(attempt, 5.0, "the acquisition")
        await finish(waiting, 5.0, "the waiter")

        with pytest.raises(LockError):
            attempt.result()
        assert introspect.background_tasks(proxied) == set()
        await until(lambda: is_free(client, name), what="the key to expire unrenewed", within=2.5)
        if not waiting.cancelled():
            waiting.exception()  # retrieved: LockError (or False) is fine
        await blocker.release()

    @pytest.mark.parametrize(
        "kwargs",
        [{}, {"timeout": 5.0}, {"blocking": False}],
        ids=["no-timeout", "timeout", "try"],
    )
    async def test_acquisition_in_flight_when_close_ends(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
        kwargs: dict[str, Any],
    ) -> None:
        """Regression (issue 5 #10): an acquisition still waiting for its reply when
        ``client.aclose()`` finished must end in LockError — not hang, not ``True``, and not a
        CancelledError in a task nobody cancelled — leaving nothing held or renewed.

        Regression (contract probe, stop 19: a ghost hold for a whole lease): the undo of such
        an acquisition was spawned on the closed runtime, which cancelled it before it
        started, so the lock stayed taken until its lease ended. It is undone now, and the
        acquisition raises once the undo is done."""
        lock = Lock(proxied, name, lease=30.0)
        assert await lock.acquire()  # the library is at work on this client
        await lock.release()

        fault_proxy.hold_replies()
        attempt = asyncio.create_task(acquiring(lock, **kwargs))
        await until(lambda: client.exists(name), what="the acquisition to run on the server")
        await fault_proxy.wait_held()
        await finish(asyncio.ensure_future(proxied.aclose()), 5.0, "aclose()")
        fault_proxy.release_replies()
        await finish(attempt, 5.0, "the acquisition")
        if attempt.cancelled():
            raise AssertionError("the acquisition ended in CancelledError; nobody cancelled it")
        with pytest.raises(LockError):
            attempt.result()
        assert introspect.background_tasks(proxied) == set()
        assert await is_free(client, name), "the acquisition that completed was not undone"

    @pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 runs the attempt in a job task")
    async def test_close_ends_an_acquisition_a_retrying_client_would_keep_resending(
        self, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (attack pass, stop 19): with a client that retries (``Redis(host=…)``)
        and a server that stopped answering, ``aclose()`` broke the acquisition's connection,
        redis-py re-sent the command on a new one, and the acquisition went on waiting after
        the close — for ever without a timeout (it should fail with ``LockError``). And the
        undo of such an acquisition, no longer cancelled by the close, lived on for the whole
        lease or longer ("no orphan tasks survive a closed client"). Now the close ends the
        acquisition, and a clean-up after the close gets the close's grace (2 s)."""
        await load_scripts(client)
        retrying = aioredis.Redis(host=fault_proxy.host, port=fault_proxy.port)
        lock = Lock(retrying, name, lease=30.0)
        assert await lock.acquire()  # the library is at work on this client
        await lock.release()
        before = set(asyncio.all_tasks())

        fault_proxy.hold_replies()  # the server "stops answering"
        attempt = asyncio.create_task(acquiring(lock))
        await until(lambda: client.exists(name), what="the acquisition to run on the server")
        await finish(asyncio.ensure_future(retrying.aclose()), 5.0, "aclose()")
        await finish(attempt, 3.0, "the acquisition")
        with pytest.raises(LockError, match="closed"):
            attempt.result()
        await asyncio.sleep(2.5)  # the clean-up's grace
        left = {
            task
            for task in asyncio.all_tasks() - before
            if not task.done() and "redis_locks_async" in _code_file(task)
        }
        assert not left, left
        fault_proxy.heal()

    async def test_try_completing_after_close_on_a_caller_owned_pool(
        self, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #10): on a client with a caller-owned ConnectionPool (which
        ``aclose()`` leaves open), a ``blocking=False`` acquire whose reply arrived after the
        close returned ``True`` and started a new keeper that renewed the lock forever."""
        await load_scripts(client)
        pool = aioredis.ConnectionPool.from_url(fault_proxy.url)
        conn = aioredis.Redis(connection_pool=pool)
        try:
            lock = Lock(conn, name, lease=1.0)
            assert await lock.acquire()  # the library is at work on this client
            await lock.release()

            fault_proxy.hold_replies()
            attempt = asyncio.create_task(acquiring(lock, blocking=False))
            await until(lambda: client.exists(name), what="the attempt to run on the server")
            await fault_proxy.wait_held()
            await finish(asyncio.ensure_future(conn.aclose()), 5.0, "aclose()")
            fault_proxy.release_replies()
            await finish(attempt, 5.0, "the attempt")
            with pytest.raises(LockError):
                attempt.result()

            with pytest.raises(LockError):  # and after the close, no new acquisition
                await Lock(conn, name + ":new", lease=1.0).acquire(blocking=False)
            assert introspect.background_tasks(conn) == set()
            await until(
                lambda: is_free(client, name), what="the key to expire unrenewed", within=2.5
            )
            assert await is_free(client, name + ":new")
        finally:
            fault_proxy.heal()
            await pool.disconnect()

    async def test_new_wait_on_a_silently_dead_pubsub_is_bounded(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (issue 5 #11): with the pub/sub connection silently dead (half-open),
        ``acquire(timeout=1)`` on another held lock waited for a subscribe confirmation with no
        bound and never returned."""
        holder = connect()
        first, second = name + ":a", name + ":b"
        blockers = [Lock(holder, first), Lock(holder, second)]
        for blocker in blockers:
            assert await blocker.acquire()
        waiting = asyncio.create_task(acquiring(Lock(proxied, first), timeout=10.0))
        await until(lambda: registered(client, first), what="the first waiter's registration")
        assert fault_proxy.blackhole_where(b"SUBSCRIBE") == 1

        result, elapsed = await outcome(
            lambda: Lock(proxied, second).acquire(timeout=1.0), 4.0, "acquire(timeout=1)"
        )
        assert result is False or isinstance(result, LockError), result
        assert elapsed <= 1.6, f"acquire(timeout=1) took {elapsed:.2f} s"
        waiting.cancel()
        await asyncio.wait((waiting,), timeout=5.0)
        for blocker in blockers:
            await blocker.release()

    @pytest.mark.slow
    async def test_waiter_on_a_silently_dead_pubsub_proceeds(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (issue 5 #11): a waiter whose pub/sub connection died silently (no
        health check) missed the release and slept until the holder's whole lease ended."""
        holder = Lock(connect(), name)  # a 30 s lease
        assert await holder.acquire()
        waiter = HoldingTask(Lock(proxied, name))  # no timeout
        await until(lambda: registered(client, name), what="the waiter's registration")
        assert fault_proxy.blackhole_where(b"SUBSCRIBE") == 1
        loop = asyncio.get_running_loop()
        released_at = loop.time()
        await holder.release()

        lease = await waiter.wait_acquired(within=7.0)
        assert lease is not None
        waited = loop.time() - released_at
        assert waited <= 6.5, f"the waiter took {waited:.2f} s after the release"
        fault_proxy.heal()
        await waiter.end()

    async def test_close_ends_a_wait_stuck_on_a_silently_dead_pubsub(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (issue 5 #11): ``aclose()`` did not end an acquisition stuck waiting for
        a subscribe confirmation on a silently dead pub/sub connection."""
        holder = connect()
        first, second = name + ":a", name + ":b"
        blockers = [Lock(holder, first), Lock(holder, second)]
        for blocker in blockers:
            assert await blocker.acquire()
        waiting = asyncio.create_task(acquiring(Lock(proxied, first)))
        await until(lambda: registered(client, first), what="the first waiter's registration")
        assert fault_proxy.blackhole_where(b"SUBSCRIBE") == 1
        stuck = asyncio.create_task(acquiring(Lock(proxied, second)))  # no timeout
        await asyncio.sleep(0.3)

        await finish(asyncio.ensure_future(proxied.aclose()), 4.0, "aclose()")
        await finish(stuck, 2.0, "the acquisition on the closed client")
        await finish(waiting, 2.0, "the waiter on the closed client")
        for task in (stuck, waiting):
            with pytest.raises(LockError):
                task.result()
        assert introspect.background_tasks(proxied) == set()
        for blocker in blockers:
            await blocker.release()

    async def test_extend_finding_the_lease_gone_does_not_spin(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #12): ``extend()`` that found the lease gone left it in the
        keeper, which then looped without delay (about 10,000 round trips in 2 s)."""
        lock = Lock(client, name, lease=1.2)
        assert await lock.acquire()
        await client.delete(name)
        with pytest.raises(LockLostError):
            await lock.extend()

        before = introspect.renewal_round_trips(client)
        await asyncio.sleep(1.5)
        spent = introspect.renewal_round_trips(client) - before
        assert spent <= 3, f"{spent} renewal round trips in 1.5 s for a lost lease"
        assert introspect.keeper_size(client) == 0

    @pytest.mark.parametrize("socket_timeout", [None, 5.0], ids=["no-socket-timeout", "5s"])
    @pytest.mark.parametrize("held", [False, True], ids=["free", "held"])
    async def test_acquire_timeout_is_bounded_in_a_partition(
        self,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
        socket_timeout: float | None,
        held: bool,
    ) -> None:
        """Regression (issue 5 #13): in a partition ``acquire(timeout=1)`` waited for redis-py's
        socket timeout (5 s, or forever with ``socket_timeout=None``), not its own timeout."""
        await load_scripts(client)
        blocker = Lock(connect(), name)
        if held:
            assert await blocker.acquire()
        conn = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=socket_timeout)
        try:
            await conn.ping()
            fault_proxy.blackhole()
            result, elapsed = await outcome(
                lambda: Lock(conn, name).acquire(timeout=1.0), 3.0, "acquire(timeout=1)"
            )
            assert result is False or isinstance(result, LockError), result
            assert elapsed <= 1.6, f"acquire(timeout=1) took {elapsed:.2f} s"
        finally:
            fault_proxy.heal()
            await conn.aclose()
            if held:
                await blocker.release()

    async def test_hung_release_does_not_churn_connections(
        self, proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str
    ) -> None:
        """Regression (issue 5 #13): during a release hung in a partition the keeper spun on
        the releasing hold, opening about 65 connections a second."""
        lock = Lock(proxied, name, lease=1.0)
        actor = Actor()
        try:
            assert await actor.run(lock.acquire)
            fault_proxy.blackhole()
            release = actor.submit(lock.release)
            await asyncio.sleep(0.3)
            before = fault_proxy.stats.connections_total
            await asyncio.sleep(2.0)
            opened = fault_proxy.stats.connections_total - before
            assert opened <= 10, f"{opened} connections opened in 2 s during a hung release"
        finally:
            fault_proxy.heal()
            await proxied.aclose()  # ends the release, hung on a silent connection
            with contextlib.suppress(Exception):
                await settled(release, 5.0, "the hung release")
            await actor.stop()

    async def test_waiter_rechecks_at_once_on_a_zero_ttl(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #14): a waiter whose attempt saw a PTTL of 0 (the holder's lease
        ending within the millisecond) slept a whole lease although the lock was free 1 ms
        later.

        The holder's key is made to expire at a server millisecond E while a Lua loop keeps the
        server busy until E: the waiter's re-check, queued behind it, runs at E and sees 0.
        """
        holder = Lock(connect(), name, lease=1.0, auto_renew=False)
        assert await holder.acquire()
        loop = asyncio.get_running_loop()
        acquired_at = loop.time()
        waiter = HoldingTask(Lock(connect(), name, lease=3.0), timeout=10.0)
        await until(lambda: registered(client, name), what="the waiter's registration")
        # The waiter re-checks when the holder's lease ends (about 1 s after it acquired):
        # keep the server busy from 0.7 s to 1.3 s, with the lock expiring at the very end.
        # Valkey freezes TIME inside a script until the script counts as busy (after
        # busy-reply-threshold, 5 s by default): let it count as busy at once there.
        info = await client.info("server")
        valkey = "valkey" in str(info.get("server_name", "")).lower()
        threshold = "5000"
        if valkey:
            config = await client.config_get("busy-reply-threshold")
            threshold = str(config["busy-reply-threshold"])
            await client.config_set("busy-reply-threshold", 20)
        try:
            await asyncio.sleep(max(0.0, acquired_at + 0.7 - loop.time()))
            expire_at = await server_ms(client) + 600
            await client.eval(_BUSY_UNTIL_EXPIRY, 1, name, expire_at)
        finally:
            if valkey:
                await client.config_set("busy-reply-threshold", threshold)
        assert not waiter.acquired.done(), "the waiter did not wait for the busy server"

        lease = await waiter.wait_acquired(within=0.5)
        assert lease is not None
        await waiter.end()
        with contextlib.suppress(LockError):
            await holder.release()

    async def test_wrong_type_aux_key_fails_a_try_cleanly(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #15): with an auxiliary key of the wrong type a try on a free
        lock took the lock (and a fencing token) *then* failed, leaving it held by nobody;
        every auxiliary key must be checked before the first write and named in the error."""
        failures = []
        for index in range(len(introspect.aux_keys(name))):
            lock_name = f"{name}:{index}"
            aux = introspect.aux_keys(lock_name)
            key = aux[index]
            label = key_label(key, aux)
            keys = [lock_name, *aux]
            await client.rpush(key, "not a lock")
            before = await snapshot(client, keys)
            lock = Lock(client, lock_name)
            try:
                await lock.acquire(blocking=False)
            except LockError as exc:
                if label not in str(exc):
                    failures.append(f"{label}: the error does not name the key: {exc}")
                if await snapshot(client, keys) != before:
                    failures.append(f"{label}: the failed try changed the lock's keys")
            else:
                failures.append(f"{label}: a try with this key of the wrong type succeeded")
                try:
                    await lock.release()
                except LockError as exc:
                    failures.append(f"{label}: ... and the lock it took cannot be released: {exc}")
            await client.delete(*keys)
        assert not failures, "\n".join(failures)

    async def test_wrong_type_aux_key_fails_a_release_cleanly(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5 #15): with an auxiliary key of the wrong type (and a waiter
        registered) a release deleted the lock, then failed without announcing it."""
        failures = []
        for index in range(len(introspect.aux_keys(name))):
            lock_name = f"{name}:{index}"
            aux = introspect.aux_keys(lock_name)
            key = aux[index]
            label = key_label(key, aux)
            keys = [lock_name, *aux]
            lock = Lock(client, lock_name)
            assert await lock.acquire()
            lease = await held_lease(lock)
            waiter = HoldingTask(Lock(connect(), lock_name), timeout=10.0)
            await until(lambda: registered(client, lock_name), what="a registered waiter")  # noqa: B023
            await client.delete(key)
            await client.rpush(key, "not a lock")
            before = await snapshot(client, keys)
            try:
                await lock.release()
            except LockError as exc:
                if label not in str(exc):
                    failures.append(f"{label}: the error does not name the key: {exc}")
                if await snapshot(client, keys) != before:
                    failures.append(f"{label}: the failed release changed the lock's keys")
            else:
                if await owner_of(client, lock_name) == introspect.lease_owner_id(lease):
                    failures.append(f"{label}: the release returned but the lock is still held")
            await waiter.cancel()
            await client.delete(*keys)
        assert not failures, "\n".join(failures)

    async def test_hung_attempt_cleanup_runs(
        self,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Regression (issue 5 #16): the cleanup after an attempt that hung longer than the
        lease raised InvalidStateError (``job.exception()`` right after ``job.cancel()``), so
        it never ran."""
        caplog.set_level(logging.INFO, logger="redis_locks_async")
        await load_scripts(client)
        conn = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=1.0)
        try:
            await conn.ping()
            fault_proxy.blackhole()
            sent = fault_proxy.stats.bytes_dropped_up
            attempt = asyncio.create_task(acquiring(Lock(conn, name, lease=0.5)))
            await until(
                lambda: fault_proxy.stats.bytes_dropped_up > sent, what="the attempt to be sent"
            )
            attempt.cancel()
            await asyncio.wait((attempt,), timeout=5.0)
            await asyncio.sleep(0.8)  # longer than the lease
            fault_proxy.heal()
            await introspect.drain(conn)
            await until(lambda: introspect.pending_cleanups(conn) == 0, what="the cleanup")
            assert await is_free(client, name)
            assert await registered(client, name) == 0
        finally:
            fault_proxy.heal()
            await conn.aclose()
        invalid = [
            record
            for record in caplog.records
            if "InvalidStateError" in record.getMessage()
            or (
                record.exc_info is not None
                and isinstance(record.exc_info[1], asyncio.InvalidStateError)
            )
        ]
        assert not invalid, f"logged: {[r.getMessage() for r in invalid]}"


# Keep the server busy until millisecond ARGV[1], with KEYS[1] expiring at exactly that
# millisecond: a command queued meanwhile runs at ARGV[1] and sees a PTTL of 0.
_BUSY_UNTIL_EXPIRY = """
local deadline = tonumber(ARGV[1])
redis.call('PEXPIREAT', KEYS[1], deadline)
while true do
    local t = redis.call('TIME')
    if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) >= deadline then
        return 1
    end
end
"""


# --------------------------------------------------------------------------------------------
# Minor findings
# --------------------------------------------------------------------------------------------


class TestMinor:
    @pytest.mark.parametrize("then", ["acquire", "extend"])
    async def test_during_a_cancelled_release_in_flight(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
        then: str,
    ) -> None:
        """Regression (issue 5, minor): re-acquiring or extending while a cancelled release
        was still in flight raised LockLostError with an empty reason (nothing was lost)."""
        lock = Lock(proxied, name)
        actor = Actor()
        try:
            assert await actor.run(lock.acquire)
            fault_proxy.hold_replies()
            scope = anyio.CancelScope()
            release = actor.submit(lambda: in_scope(scope, lock.release))
            await until(lambda: is_free(client, name), what="the release to run")
            await fault_proxy.wait_held()
            scope.cancel()
            await settled(release, 5.0, "the cancelled release")

            follow = actor.submit(lock.acquire if then == "acquire" else lock.extend)
            for _ in range(20):
                await asyncio.sleep(0)  # the follow-up starts while the release is in flight
            fault_proxy.release_replies()
            done, _ = await asyncio.wait((follow,), timeout=5.0)
            assert done, f"{then} after a cancelled release hung"
            error = follow.exception()
            assert not isinstance(error, LockLostError), f"{then} raised {error!r}"
            if then == "acquire":
                assert error is None
                assert follow.result() is True
                lease = await actor.run(lambda: held_lease(lock))
                assert await owner_of(client, name) == introspect.lease_owner_id(lease)
                await actor.run(lock.release)
            else:
                assert isinstance(error, LockNotOwnedError), error
            assert await is_free(client, name)
        finally:
            fault_proxy.heal()
            await actor.stop()

    def test_sync_client_is_refused_at_construction(self, server: ServerProcess) -> None:
        """Regression (issue 5, minor): a synchronous ``redis.Redis`` was accepted and failed
        deep inside the first acquire."""
        sync_client = redis.Redis(host=server.host, port=server.port)
        try:
            with pytest.raises(TypeError):
                Lock(sync_client, "sync-client")
        finally:
            sync_client.close()

    async def test_renewal_runs_every_third_of_the_lease(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5, minor): renewal ran every lease/6 instead of the documented
        lease/3."""
        lease_s = 0.9
        lock = Lock(client, name, lease=lease_s)
        assert await lock.acquire()
        before = introspect.renewal_round_trips(client)
        await asyncio.sleep(3 * lease_s)
        renewals = introspect.renewal_round_trips(client) - before
        await lock.release()
        # every lease/3: 9 in three leases (lease/4 would be 12, lease/6 18)
        assert 6 <= renewals <= 10, f"{renewals} renewals in three leases"

    async def test_async_on_lost_is_awaited(self, client: aioredis.Redis, name: str) -> None:
        """Regression (issue 5, minor): an ``async def on_lost`` was called but never awaited."""
        called = asyncio.Event()

        async def on_lost(lease: Lease) -> None:
            await asyncio.sleep(0)
            called.set()

        lock = Lock(client, name, lease=0.6, on_lost=on_lost)
        assert await lock.acquire()
        await client.delete(name)
        await settled(asyncio.ensure_future(called.wait()), 3.0, "the async on_lost callback")
        with pytest.raises(LockLostError):
            await lock.release()


# --------------------------------------------------------------------------------------------
# Dead waiters (a waiting process killed in a rolling deploy)
# --------------------------------------------------------------------------------------------


class TestFoundByReview:
    """Bugs found in the rewritten core by the review, the harness and the benchmarks."""

    async def test_release_in_a_partition_is_bounded_by_the_lease(
        self, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (review): with ``socket_timeout=None`` (redis-py's default) a release in a
        partition never returned — even after the lease was lost — so leaving ``async with``
        hung for ever."""
        await load_scripts(client)
        conn = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=None)
        try:
            lock = Lock(conn, name, lease=0.6)
            assert await lock.acquire()
            fault_proxy.blackhole()
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(LockError):
                await asyncio.wait_for(lock.release(), 5)
            assert loop.time() - started < 2.5
        finally:
            fault_proxy.heal()
            await conn.aclose()

    @pytest.mark.parametrize("method", ["release", "extend"])
    async def test_wait_for_around_release_and_extend(
        self, client: aioredis.Redis, name: str, method: str
    ) -> None:
        """Regression (review): ``asyncio.wait_for(lock.release(), t)`` (and ``extend``) raised
        LockNotOwnedError on Python 3.10/3.11, where wait_for runs them in a helper task."""
        lock = Lock(client, name)
        assert await lock.acquire()
        await asyncio.wait_for(getattr(lock, method)(), 5)
        if method == "release":
            assert await is_free(client, name)
        else:
            assert lock.owned()
            await lock.release()

    async def test_a_lost_lease_still_alive_on_the_server_is_released(
        self, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (review): a lease marked lost because its renewals went unanswered (the
        lock still alive on the server) stayed held until it expired after the release."""
        await load_scripts(client)
        conn = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=0.2)
        try:
            lock = Lock(conn, name, lease=1.2)
            assert await lock.acquire()
            lease = lock.current_lease
            assert lease is not None
            fault_proxy.blackhole()
            await until(lambda: lease.lost, what="the lease to be marked lost", within=5)
            await client.pexpire(name, 60_000)  # the server still has it (here: for long)
            fault_proxy.heal()
            with pytest.raises(LockLostError):
                await lock.release()
            await until(lambda: is_free(client, name), what="the lost lease's clean-up")
        finally:
            fault_proxy.heal()
            await conn.aclose()

    async def test_outer_guard_stays_armed_when_the_inner_loss_is_handled(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (S6 harness): when a lease was lost inside nested ``guarded()`` blocks of
        one lock, the innermost block turned the cancellation into ``LockLostError``; code that
        handled that error inside the outer block then ran on unguarded — the outer block was
        never cancelled, although its lease was gone."""
        lock = Lock(client, name, lease=0.3, auto_renew=False)
        carried_on = asyncio.Event()

        async def work() -> None:
            async with lock.guarded():
                with contextlib.suppress(LockLostError):
                    async with lock.guarded():
                        await asyncio.sleep(10)  # the lease ends meanwhile
                await asyncio.sleep(1)
                carried_on.set()

        task = asyncio.create_task(work())
        await finish(task, 3.0, "the outer guarded block after its lease was lost")
        assert not carried_on.is_set()
        with pytest.raises(LockLostError):
            task.result()

    async def test_renewal_resent_after_a_longer_reentry_keeps_no_stale_lease(
        self,
        retrying: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (S6 soak, ``Lock``): the keeper sent a renewal with the hold's short lease
        (0.6 s); a re-entry through a ``Lock(…, lease=3.0)`` then set 3 s on the server; the
        renewal's connection broke and redis-py's retry re-sent it, so the server ran it last
        and kept 0.6 s — but the keeper counted its success as a renewal of the new 3 s lease.
        The key expired under a lease the holder believed valid for seconds more (another
        client could take the lock: two holders), and no loss was signalled."""
        short = Lock(retrying, name, lease=0.6)
        longer = Lock(retrying, name, lease=3.0)
        assert await short.acquire()
        lease = await held_lease(short)
        fault_proxy.blackhole()  # the keeper's renewal (due at 0.2 s) goes nowhere for now
        await until(lambda: fault_proxy.stats.bytes_dropped_up > 0, what="the renewal")
        fault_proxy.heal()
        assert await longer.acquire()  # re-enters: 3 s on the server
        assert lease.hold_count == 2 and lease.lease == 3.0
        fault_proxy.reset_all()  # redis-py re-sends the renewal (0.6 s): the server runs it last

        await asyncio.sleep(0.8)  # past the re-sent 0.6 s, before a renewal due a third of 3 s
        assert not lease.lost
        assert await owner_of(client, name) == introspect.lease_owner_id(lease), (
            f"{lease!r} valid, but its key is gone from the server"
        )
        assert lease.remaining() <= await client.pttl(name) / 1000 + 0.05
        await longer.release()
        await short.release()
        assert await is_free(client, name)

    async def test_cancelled_shorter_reentry_is_followed_by_renewal(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (S6 review of the soak finding): a re-entry through a shorter-lease
        ``Lock`` that was cancelled after it reached the server left the server's TTL at the
        short lease (its undo drops the entry, not the TTL) while the holder kept its long
        local estimate: the key expired under a lease the holder believed valid."""
        outer = Lock(proxied, name, lease=6.0)
        inner = Lock(proxied, name, lease=0.5)
        assert await outer.acquire()
        lease = await held_lease(outer)
        fault_proxy.hold_replies()
        with pytest.raises(asyncio.TimeoutError):  # runs on the server (500 ms), reply held
            await asyncio.wait_for(inner.acquire(), 0.2)
        assert 0 < await client.pttl(name) <= 500
        fault_proxy.release_replies()

        await asyncio.sleep(0.8)  # past the 0.5 s, before a renewal due a third of 6 s
        assert not lease.lost, lease.lost_reason
        assert await owner_of(client, name) == introspect.lease_owner_id(lease), (
            f"{lease!r} valid, but its key is gone from the server"
        )
        assert await hold_count(client, name) == 1 and lease.hold_count == 1
        await outer.release()
        assert await is_free(client, name)


class TestDeadWaiters:
    @pytest.mark.slow
    async def test_waiter_process_killed_while_registered(
        self, redis_url: str, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5, dead waiters): a waiter process killed while registered was
        handed the lock on release and kept it for its whole lease, stalling live waiters."""
        holder = Lock(connect(), name)  # a 30 s lease
        assert await holder.acquire()
        dead = await worker_process(redis_url, name, "wait")
        try:
            assert dead.stdout is not None
            line = await asyncio.wait_for(dead.stdout.readline(), 10.0)
            assert line.strip() == b"waiting", line
            await until(
                lambda: equals(registered(client, name), 1),
                what="the worker's registration",
                within=10.0,
            )
            live = HoldingTask(Lock(connect(), name), timeout=15.0)
            await until(
                lambda: equals(registered(client, name), 2), what="the live waiter's registration"
            )
            dead.send_signal(signal.SIGKILL)
            await asyncio.wait_for(dead.wait(), 5.0)

            loop = asyncio.get_running_loop()
            released_at = loop.time()
            await holder.release()
            lease = await live.wait_acquired(within=5.0)
            assert lease is not None
            waited = loop.time() - released_at
            assert await owner_of(client, name) == introspect.lease_owner_id(lease)
            await live.end()
            assert waited <= 5.0
        finally:
            if dead.returncode is None:
                dead.kill()
                await dead.wait()


# --------------------------------------------------------------------------------------------
# Fencing across restarts and evictions
# --------------------------------------------------------------------------------------------


class TestFencingAcrossRestart:
    async def test_token_rises_across_a_restart_without_persistence(
        self, server: ServerProcess, connect: Connect, name: str
    ) -> None:
        """Regression (issue 5, fencing): after a server restart without persistence tokens
        started again from 1, below tokens already handed out."""
        before_client = connect(server.url)
        async with Lock(before_client, name) as lease:
            before = lease.fencing_token
        await before_client.aclose()
        server.restart()
        after_client = connect(server.url)
        async with Lock(after_client, name) as lease:
            after = lease.fencing_token
        assert after > before

    async def test_token_rises_after_the_aux_keys_are_evicted(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (issue 5, fencing): evicting the lock's fence record (an auxiliary key)
        sent tokens back to 1."""
        lock = Lock(client, name)
        async with lock as lease:
            before = lease.fencing_token
        await client.delete(*introspect.aux_keys(name))
        async with lock as lease:
            after = lease.fencing_token
        assert after > before


class TestFoundByBenchmarks:
    """Bugs the benchmarks' own checks reported."""

    async def test_confirmation_answered_after_the_release_is_no_loss(
        self, fault_proxy: FaultProxy, connect: Connect, name: str
    ) -> None:
        """Bug: a task that released a lock right after getting it (a hand-over, B3/B10) got
        ``on_lost``: the keeper's renewal (the hand-over's confirmation), in flight while the
        release ran, found the lock already gone and reported the released lease as lost."""
        lost: list[Lease] = []
        client = connect(fault_proxy.url)
        lock = Lock(client, name, on_lost=lost.append)
        other = Lock(connect(), name)
        acquired, go = asyncio.Event(), asyncio.Event()
        assert await lock.acquire()  # warm-up: scripts loaded, connections open
        await lock.release()

        async def holder() -> None:
            await lock.acquire()
            acquired.set()
            await go.wait()
            await lock.release()

        task = asyncio.create_task(holder())
        await asyncio.wait_for(acquired.wait(), 5)
        lease = introspect.lease_of(client, name, task)
        assert lease is not None
        fault_proxy.hold_replies()
        go.set()
        for _ in range(500):  # the release ran on the server; its reply is held
            if not await other.locked():
                break
            await asyncio.sleep(0.01)
        assert not await other.locked()
        state = lease.state
        assert state is HoldState.RELEASING
        introspect.judge_renewal(client, lease, 0)  # the renewal in flight: "not held"
        assert not lease.lost
        fault_proxy.release_replies()
        await asyncio.wait_for(task, 5)
        assert lease.state is HoldState.RELEASED and not lost


class TestFoundByTheHarness:
    """Bugs the stateful harness (tests/test_stateful.py) found."""

    async def test_close_marks_every_permit_of_a_task_lost(
        self, connect: Connect, name: str
    ) -> None:
        """Bug: closing the client marked only a task's newest ``Semaphore`` permit lost; its
        earlier permits (held underneath) stayed "held" although nothing renewed them any more."""
        client = connect()
        first = Semaphore(client, name, 2, lease=2.0)
        second = Semaphore(client, name, 2, lease=0.5)
        assert await first.acquire()
        older = first.current_lease
        assert await second.acquire()
        newer = second.current_lease
        assert older is not None and newer is not None and older is not newer
        await client.aclose()
        assert newer.lost and older.lost

    async def test_renewal_finding_a_release_done_stops_renewing(
        self, fault_proxy: FaultProxy, connect: Connect, name: str
    ) -> None:
        """Regression (S6 harness, soak on Redis 7.0, "renewal keeper spinning: 45 in 0.20 s"):
        the lease keeper spun while a release was in flight. The release ran on the server but
        its reply was lost, and redis-py waited out its retry back-off before sending it again;
        the keeper's renewal, due meanwhile, found the lock gone. For a releasing hold that is
        rightly no loss (the release's answer settles it), but the keeper kept the hold due
        and renewed it again at once, round trip after round trip, until the release's answer
        came back. Now a releasing hold the server no longer has is not renewed any more."""
        lost: list[Lease] = []
        # The client's retry re-sends a command after a connection error, a while later.
        # (Lease and back-off leave the keeper's renewal well clear of the held phase: on a slow
        # machine one due 0.5 s in had its reply held and lost as well, and the test failed.)
        client = connect(fault_proxy.url, retry=Retry(ConstantBackoff(2.0), 1))
        lock = Lock(client, name, lease=3.0, on_lost=lost.append)  # renewed 1 s in
        other = Lock(connect(), name)
        assert await lock.acquire()  # warm-up: scripts (renewal's too) loaded, connections open
        await lock.extend()
        await lock.release()
        acquired, go = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            await lock.acquire()
            acquired.set()
            await go.wait()
            await lock.release()

        task = asyncio.create_task(holder())
        await asyncio.wait_for(acquired.wait(), 5)
        lease = introspect.lease_of(client, name, task)
        assert lease is not None
        fault_proxy.hold_replies()
        go.set()
        await until(lambda: equals(other.locked(), False), what="the release to run")
        state = lease.state  # (a name of its own: mypy would narrow lease.state for good)
        assert state is HoldState.RELEASING
        trips = introspect.renewal_round_trips(client)
        # The release's reply, resent in 2 s (and, now and then, the reply to a renewal that
        # fell due in these few milliseconds: renewals sit on a beat of random phase).
        assert fault_proxy.lose_held() >= 1
        fault_proxy.heal()
        # The keeper's renewal (due 1 s after the acquisition) finds the lock gone.
        await until(
            lambda: (
                introspect.keeper_size(client) == 0
                or introspect.renewal_round_trips(client) > trips + 5
            ),
            what="the keeper to drop the released hold",
        )
        assert introspect.renewal_round_trips(client) - trips <= 1, "keeper spinning"
        await finish(task, 5, "the release")
        assert lease.state is HoldState.RELEASED and not lost


    @pytest.mark.parametrize("kind", ["Lock", "FairLock", "read", "write", "Semaphore"])
    async def test_a_resent_release_after_others_released_is_no_loss(
        self, fault_proxy: FaultProxy, connect: Connect, name: str, kind: str
    ) -> None:
        """Regression (attack pass, stop 22): a final release ran, its reply was lost, and
        before redis-py sent it again another client took the lock and released it; the
        re-sent release found that release's owner in ``meta`` (which kept only the last
        one) and answered "not held": ``LockLostError`` and ``on_lost`` for a release that had
        worked. The owners of the latest releases are kept now."""

        def make(conn: aioredis.Redis, **options: Any) -> Any:
            if kind in ("read", "write"):
                return getattr(ReadWriteLock(conn, name, **options), kind)
            if kind == "Semaphore":
                return Semaphore(conn, name, 1, **options)
            return {"Lock": Lock, "FairLock": FairLock}[kind](conn, name, **options)

        lost: list[Lease] = []
        client = connect(fault_proxy.url, retry=Retry(ConstantBackoff(1.0), 1))
        lock = make(client, on_lost=lost.append)
        other = make(connect())
        assert await lock.acquire()  # warm-up: scripts loaded, connections open
        await lock.release()
        holding = HoldingTask(lock)
        assert await holding.wait_acquired() is not None
        fault_proxy.hold_replies()
        release = asyncio.create_task(holding.end())
        await fault_proxy.wait_held()  # the release ran; its reply is held
        assert fault_proxy.lose_held() == 1  # and lost: re-sent in 1 s
        fault_proxy.heal()
        for _ in range(3):  # meanwhile others take the lock and release it
            assert await other.acquire(timeout=5)
            await other.release()
        await finish(release, 5, "the release")
        release.result()  # no LockLostError
        assert not lost
        assert await other.acquire(blocking=False)  # free: nothing of it held
        await other.release()
        # The record of the latest releases stays small: a compact hash after many releases
        # (one field of 16 whole owner ids made it a hash table, 7 times the memory).
        for _ in range(20):
            assert await other.acquire(timeout=5)
            await other.release()
        layout = {"read": "rw", "write": "rw", "Semaphore": "sem"}.get(kind, "lock")
        meta = introspect.aux_keys(name, layout)[0]
        inspector = connect()
        assert await inspector.object("encoding", meta) in (b"listpack", b"ziplist")


_LOOPS_ONE_AFTER_ANOTHER = """
import asyncio, logging, sys
import redis.asyncio as aioredis
from redis_locks_async import FairLock, Lock, Semaphore

logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
url, name, kind, how = sys.argv[1:5]
if how.startswith("sentinel:"):  # url: the Sentinel's host:port
    from redis.asyncio.sentinel import Sentinel

    host, port = url.rsplit(":", 1)
    client = Sentinel([(host, int(port))]).master_for(how.split(":", 1)[1])
else:
    client = aioredis.Redis.from_url(url)
if how == "observed":  # redis-py's own command path (the library does not go around it)
    own = client.execute_command

    async def observed(*args, **options):
        return await own(*args, **options)

    client.execute_command = observed
if kind == "Semaphore":
    lock = Semaphore(client, name, permits=1, lease=5)
else:
    lock = (FairLock if kind == "FairLock" else Lock)(client, name, lease=5)
holders = []

async def contend():
    async def one():
        async with lock:
            holders.append(1)
            assert len(holders) == 1
            await asyncio.sleep(0.005)
            holders.pop()

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(4))), 20)

for _ in range(3):
    asyncio.run(contend())
print("done")
"""


@pytest.mark.parametrize("how", ["plain", "observed"])
@pytest.mark.parametrize("kind", ["Lock", "FairLock", "Semaphore"])
async def test_a_client_used_on_one_event_loop_after_another(
    redis_url: str, name: str, kind: str, how: str
) -> None:
    """A client and its locks used under ``asyncio.run`` again and again (a sync application
    running each job on a fresh loop, tests with a loop each): every loop's contended cycles
    work, with nothing to warn about. Bug: from the second loop on, ``acquire`` could fail with
    ``LockError`` ("the connection failed under the call: RuntimeError('Event loop is
    closed')"): the short way sent the script on a pooled connection of the earlier loop, whose
    read failed, and dropping that connection for the retry failed too. The subscription hub
    also logged a dropped pub/sub connection and an error with a traceback ("background task
    failed": closing a connection of the closed loop).

    In a process of its own: the client is not closed (redis-py cannot close a pool holding
    connections of closed loops), and what the closed loops leave behind stays there.

    Bug (helper-50, ``observed``: a client whose commands go through redis-py's own path, as a
    Sentinel client's do — ``tests/test_sentinel.py`` has that one): the second loop's acquire
    raised a bare ``RuntimeError('Event loop is closed')`` after its script had run on the
    server — no clean-up was sent, and the lock was held by nobody for its whole lease. A
    client's connections of earlier loops are now forgotten when its locks are first used on
    a loop, and that error on redis-py's path is a connection failure (the undo is sent)."""
    await assert_loops_one_after_another(redis_url, name, kind, how)


async def assert_loops_one_after_another(url: str, name: str, kind: str, how: str) -> None:
    """``_LOOPS_ONE_AFTER_ANOTHER`` in a process of its own: done, nothing logged."""
    err = await _script_says_done(_LOOPS_ONE_AFTER_ANOTHER, (url, name, kind, how), 120)
    logged = [line for line in err.splitlines() if line.startswith("redis_locks_async")]
    assert not logged, logged


async def _script_says_done(script: str, args: Sequence[str], within: float) -> str:
    """Run ``script`` with ``args`` in a Python process of its own; it must exit 0 after
    printing "done". Returns what it wrote to stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), within)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.decode().strip() == "done"
    return err.decode()


_FORKED_CHILD_USES_THE_PARENTS_CLIENT = """
import asyncio, os, sys
import redis.asyncio as aioredis
from redis_locks_async import Lock

url, name = sys.argv[1:3]

async def child(client):
    async with Lock(client, name + ":child", lease=1.0):
        await asyncio.sleep(1.5)  # renewed (a renewal pipeline) on the parent's pool

async def main():
    client = aioredis.Redis.from_url(url)
    await asyncio.gather(*(client.blpop([name + ":nothing"], timeout=0.05) for _ in range(6)))
    pid = os.fork()
    if pid == 0:
        asyncio.run(child(client))
        os._exit(0)
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        await asyncio.sleep(0.05)
    replies = await asyncio.wait_for(
        asyncio.gather(*(client.blpop([name + ":nothing"], timeout=0.05) for _ in range(6))), 5
    )
    assert replies == [None] * 6, replies
    lock = Lock(client, name, lease=1.5)
    assert await lock.acquire(timeout=3)
    await asyncio.sleep(1.0)
    await lock.release()
    await client.aclose()
    print("done")

asyncio.run(main())
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
async def test_a_forked_child_using_the_parents_client_leaves_the_parent_working(
    redis_url: str, name: str
) -> None:
    """Regression (attack pass, stop 23): a child forked from a running application that used
    the parent's client under its own ``asyncio.run`` closed the parent's pooled connections
    it found "opened under another loop" (the renewal pipeline's clean-up, and a script call
    picking one): closing a transport of the parent's loop, copied by the fork, took the
    parent's socket out of the epoll both processes share, and the parent's commands on those
    connections hung for good (its next ``acquire(timeout=3)`` timed out on a free lock). The
    child now forgets such connections without closing them."""
    await _script_says_done(_FORKED_CHILD_USES_THE_PARENTS_CLIENT, (redis_url, name), 60)


async def test_an_idle_subscription_hub_keeps_no_connection(
    redis_url: str, connect: Connect, name: str
) -> None:
    """Regression (attack pass, stop 23): the subscription's connection, in a pool of its own
    since this stop, stayed open after every waiter had left — an application that closes its
    pool with ``pool.disconnect()`` (not ``client.aclose()``), or drops a client per job over
    a shared pool without closing it, kept one connection per client open for good. The hub
    closes it once its last channel's linger is over; the next wait opens one."""
    admin = connect()
    label = f"idle-{secrets.token_hex(4)}"
    pool = aioredis.ConnectionPool.from_url(redis_url, client_name=label)
    client = aioredis.Redis(connection_pool=pool)

    async def mine() -> list[dict[str, Any]]:
        return [c for c in await admin.client_list() if c.get("name") == label]

    try:
        holder = Lock(client, name)
        assert await holder.acquire()
        waiter = HoldingTask(Lock(client, name), timeout=10)
        await asyncio.sleep(0.2)
        assert any(int(c["sub"]) > 0 for c in await mine())  # the subscription
        await holder.release()
        assert await waiter.wait_acquired() is not None
        await waiter.end()
        await until(lambda: _no_subscriber(mine), what="the idle hub to close", within=6.0)
        await pool.disconnect()
        # (The server may list a connection the pool has just closed a moment longer.)
        await until(lambda: _none_left(mine), what="every connection closed", within=3.0)
        # And it opens again for the next wait.
        assert await holder.acquire()
        waiter = HoldingTask(Lock(client, name), timeout=10)
        await asyncio.sleep(0.2)
        await holder.release()
        assert await waiter.wait_acquired() is not None
        await waiter.end()
    finally:
        await client.aclose()
        await pool.disconnect()


@pytest.mark.parametrize("blocking", [False, True])
async def test_clean_ups_after_the_close_leave_no_connection_in_the_applications_pool(
    fault_proxy: FaultProxy, connect: Connect, name: str, blocking: bool
) -> None:
    """Regression (attack pass, stop 26): an application that passes its own pool
    (``Redis(connection_pool=...)``) and closes the client, then the pool, while acquisitions
    are in flight: the library's clean-ups after the close (undoing what those acquisitions
    may have taken) connected some of the pool's connections anew, and closing the client
    again — all the library did afterwards — leaves a pool the client does not own open (3
    connections open for good). Once its clean-ups are done, the library closes the idle
    connections of such a pool, and gives its lane's connection back first."""
    admin = connect()
    label = f"owned-{secrets.token_hex(4)}"
    pool_class = aioredis.BlockingConnectionPool if blocking else aioredis.ConnectionPool
    pool = pool_class.from_url(fault_proxy.url, client_name=label, max_connections=3)
    client = aioredis.Redis(connection_pool=pool)

    async def mine() -> list[dict[str, Any]]:
        return [c for c in await admin.client_list() if c.get("name") == label]

    async def hold(index: int) -> None:
        async with Lock(client, f"{name}:{index}", lease=2.0):
            await asyncio.sleep(3600)

    await client.ping()
    fault_proxy.delay(0.3)  # replies come late: the acquisitions are in flight at the close
    holders = [asyncio.create_task(hold(index)) for index in range(20)]
    await asyncio.sleep(0.1)
    await client.aclose()
    await pool.aclose()  # the application closes its own pool too
    await asyncio.gather(*holders, return_exceptions=True)
    fault_proxy.delay(0.0)
    await asyncio.sleep(2.5)  # the clean-ups run for at most two seconds after the close
    await until(lambda: _none_left(mine), what="the pool's connections to close", within=3.0)


async def test_closing_one_client_of_a_shared_pool_leaves_the_others_commands_alone(
    redis_url: str,
) -> None:
    """Regression (attack pass on the fix above, stop 26): closing the idle connections of the
    application's pool with redis-py's ``disconnect(inuse_connections=False)`` closes them in
    tasks that start later; another client of that pool took one meanwhile, and its command
    failed ("Connection lost"; a lock of that client: ``LockError`` "Connection closed by
    server" — 1 to 142 errors per close under load). Each connection is now taken out of the
    pool while it closes."""
    pool = aioredis.ConnectionPool.from_url(redis_url)
    closed, other = aioredis.Redis(connection_pool=pool), aioredis.Redis(connection_pool=pool)
    try:
        await asyncio.gather(*(other.ping() for _ in range(5)))  # five idle connections
        assert len(pool._available_connections) == 5
        await closed.aclose()
        letting_go = asyncio.create_task(let_go(closed))  # (what a late clean-up ends with)
        await asyncio.sleep(0)  # it has begun
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        await letting_go
        try:
            assert conn.is_connected, "the other client's connection was closed under it"
            await conn.send_command("PING")
            assert await conn.read_response() == b"PONG"
        finally:
            await pool.release(conn)
        assert await other.ping()
    finally:
        await other.aclose()
        await pool.aclose()


async def _none_left(mine: Callable[[], Awaitable[list[dict[str, Any]]]]) -> bool:
    return not await mine()


async def _no_subscriber(mine: Callable[[], Awaitable[list[dict[str, Any]]]]) -> bool:
    """No connection of ``mine`` is a pub/sub one (subscribed, or left after unsubscribing)."""
    pubsub = ("subscribe", "unsubscribe", "ping")
    return all(int(c["sub"]) == 0 and c["cmd"] not in pubsub for c in await mine())


class TestFoundByContractProbe:
    """Deviations from SPEC/README found by a probe that knew only those documents."""

    @pytest.mark.parametrize("body", ["swallows", "converts"])
    async def test_a_guarded_block_takes_back_its_cancellation_whatever_the_body_made_of_it(
        self, client: aioredis.Redis, name: str, body: str
    ) -> None:
        """Bug: a guarded block whose body swallowed the loss's cancellation, or turned it
        into an error of its own, left the task's cancel count raised (``cancelling()`` 1):
        the task's next guarded block then took its own loss for a cancellation from outside
        — a bare ``CancelledError`` instead of ``LockLostError``, and the task ended
        cancelled. Leaving the block now takes the cancellation back, as a cancel scope
        does."""
        lock = Lock(client, name, lease=0.3, auto_renew=False)

        class JobFailed(Exception):
            pass

        async def job(first: bool) -> None:
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                if not first:
                    raise
                if body == "converts":
                    raise JobFailed("interrupted") from None

        async def worker() -> list[str]:
            outcomes = []
            for first in (True, False):
                try:
                    async with lock.guarded():
                        await job(first)
                    outcomes.append("returned")
                except LockLostError:
                    outcomes.append("lost")
                except JobFailed:
                    outcomes.append("failed")
                cancelling = getattr(asyncio.current_task(), "cancelling", None)
                assert cancelling is None or cancelling() == 0  # (Python >= 3.11)
            return outcomes

        outcomes = await asyncio.wait_for(asyncio.create_task(worker()), 5.0)
        assert outcomes == ["lost" if body == "swallows" else "failed", "lost"]

    @pytest.mark.parametrize("side", ["write", "read"])
    async def test_a_downgraded_hold_is_not_split_between_tasks(
        self, client: aioredis.Redis, name: str, side: str
    ) -> None:
        """Bug (two holders): a task holding both sides of a ReadWriteLock (write, then read:
        a downgrade) could transfer one side to another task — a writer and a reader then held
        it at once in two tasks. ``transfer()`` refuses while the task holds the other side."""
        rw = ReadWriteLock(client, name)
        worker = asyncio.create_task(asyncio.Event().wait())
        try:
            assert await rw.write.acquire()
            assert await rw.read.acquire()  # downgrade
            moved = rw.write if side == "write" else rw.read
            with pytest.raises(LockError, match="downgrade"):
                moved.transfer(worker)
            assert rw.write.owned() and rw.read.owned()
            await rw.write.release()
            assert rw.read.transfer(worker) is not None  # one side only: fine
        finally:
            worker.cancel()
            await asyncio.wait((worker,), timeout=5.0)
        await introspect.drain(client)
        assert not await rw.write.locked()

    async def test_a_shorter_reentry_never_cuts_a_hold_nothing_renews(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug: a hold taken with ``auto_renew=False`` (lease 5 s) and re-entered through a
        lock object of a 0.3 s lease was cut to 0.3 s on the server, and nothing renewed it:
        the hold was lost after 0.3 s. A re-entry never ends a hold that nothing renews sooner
        than it was to end (SPEC §4: a shortened lease is followed by renewal)."""
        outer = Lock(client, name, lease=5.0, auto_renew=False)
        inner = Lock(client, name, lease=0.3)
        assert await outer.acquire()
        lease = outer.current_lease
        assert lease is not None
        assert await inner.acquire()
        assert await client.pttl(name) > 4000
        await asyncio.sleep(0.8)
        assert not lease.lost
        await inner.release()
        await outer.release()
        assert not await outer.locked()
