"""Core behaviour of :class:`Lock` against a real server (faults live in test_lock_faults)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import secrets
import sys
from typing import TYPE_CHECKING, Final

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

import redis_locks_async
from redis_locks_async import (
    FairLock,
    Lease,
    Lock,
    LockError,
    LockLostError,
    LockNotOwnedError,
    LockState,
    LockTimeout,
    ReadWriteLock,
    Semaphore,
)
from redis_locks_async._core import Attempt, LockBase, _wait_for_caller
from redis_locks_async._lock import LockPolicy
from redis_locks_async._validation import MAX_LEASE
from tests import _introspect as introspect
from tests._lockworker import LAYOUT, Primitive, make_lock

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from tests.conftest import Connect


def test_all_is_exactly_the_public_names() -> None:
    assert set(redis_locks_async.__all__) == {
        "FairLock",
        "HoldState",
        "Lease",
        "Lock",
        "LockError",
        "LockLostError",
        "LockNotOwnedError",
        "LockState",
        "LockStatistics",
        "LockTimeout",
        "ReadWriteLock",
        "RedLock",
        "Semaphore",
    }
    for name in redis_locks_async.__all__:
        assert getattr(redis_locks_async, name).__doc__, name


class TestAcquireRelease:
    async def test_async_with_holds_and_frees(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        async with lock as lease:
            assert isinstance(lease, Lease)
            assert lease.name == name
            assert lock.owned()
            assert lock.state is LockState.HELD
            assert await lock.locked()
            assert await introspect.server_hold_count(client, name) == 1
            assert int(await client.hget(name, "token") or 0) == lease.fencing_token
            assert 29_000 < await client.pttl(name) <= 30_000
        assert not await lock.locked()
        assert not lock.owned()
        assert lock.state.value == LockState.IDLE.value  # (a fresh look, not the narrowed one)

    async def test_acquire_returns_bool_and_release(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(client, name)
        assert await lock.acquire(timeout=1) is True
        try:
            assert await lock.locked()
        finally:
            await lock.release()
        assert not await lock.locked()

    async def test_non_blocking_attempt(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        await lock.acquire()

        async def other() -> bool:
            return await lock.acquire(blocking=False)

        assert await asyncio.create_task(other()) is False
        await lock.release()
        assert await asyncio.create_task(other()) is True

    async def test_timeout_returns_false_and_async_with_raises(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(client, name, timeout=0.2)
        await lock.acquire()

        async def waiter() -> None:
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await lock.acquire(timeout=0.1) is False
            assert 0.1 <= loop.time() - started < 1.0
            with pytest.raises(LockTimeout) as info:
                async with lock:
                    pass  # pragma: no cover
            assert info.value.name == name
            assert isinstance(info.value, TimeoutError)

        await asyncio.create_task(waiter())
        await lock.release()
        assert not await introspect.registered_waiters(client, name)

    async def test_release_by_non_owner(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        with pytest.raises(LockNotOwnedError, match="not held by this task"):
            await lock.release()
        await lock.acquire()

        async def stranger() -> None:
            with pytest.raises(LockNotOwnedError):
                await lock.release()

        await asyncio.create_task(stranger())
        assert await lock.locked()
        await lock.release()


class TestStatistics:
    @pytest.mark.parametrize("kind", ["Lock", "Semaphore"])
    async def test_held_never_counts_a_hold_whose_release_is_on_its_way(
        self, client: aioredis.Redis, name: str, kind: str
    ) -> None:
        """Bug (helper-76): ``held`` counted holds whose last release was still in flight
        (the hold is no longer the task's): during a hand-over a ``Semaphore(2)`` showed 3
        holders — more than its permits."""
        permits = 1 if kind == "Lock" else 2
        lock: Lock | Semaphore = (
            Lock(client, name) if kind == "Lock" else Semaphore(client, name, permits)
        )
        seen: list[int] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                seen.append(lock.statistics().held)
                await asyncio.sleep(0)

        async def work() -> None:
            for _ in range(25):
                async with lock:
                    await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(work() for _ in range(4 * permits)))
        stop.set()
        await watcher
        assert max(seen) == permits, sorted(set(seen))
        assert lock.statistics().held == 0

    async def test_counts_what_this_lock_object_saw(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(client, name)
        assert lock.statistics().acquisitions == 0
        async with lock, lock:
            stats = lock.statistics()
            assert (stats.acquisitions, stats.reentries, stats.held) == (1, 1, 1)
        assert not await lock.locked()
        stats = lock.statistics()
        assert (stats.releases, stats.held, stats.waiting, stats.lost) == (2, 0, 0, 0)
        assert stats.name == name

    async def test_wait_time_counts_a_wait_that_timed_out(
        self, connect: Connect, name: str
    ) -> None:
        """Regression (contract probe): ``wait_time`` is "seconds waited in total" (README), but
        only waits that ended holding the lock were counted."""
        holder = Lock(connect(), name)
        assert await holder.acquire()
        waiter = Lock(connect(), name)
        try:
            assert not await waiter.acquire(timeout=0.3)
            stats = waiter.statistics()
            assert stats.timeouts == 1
            assert 0.25 <= stats.wait_time < 2.0, stats
        finally:
            await holder.release()

    async def test_a_thread_without_a_loop_sees_what_the_loop_sees(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (helper-64): from a thread other than the loop's — a metrics collector's scrape —
        ``statistics()`` said ``held=0`` and ``waiting=0`` while the lock was held and tasks
        waited for it (it looked for the client's runtime on the calling thread's loop)."""
        lock = Lock(client, name)
        assert await lock.acquire()

        async def wait() -> None:
            if await lock.acquire(timeout=10):
                await lock.release()

        waiters = [asyncio.create_task(wait()) for _ in range(2)]
        try:
            for _ in range(500):
                if lock.statistics().waiting == 2:
                    break
                await asyncio.sleep(0.01)
            on_loop = lock.statistics()
            off_loop = await asyncio.to_thread(lock.statistics)
            assert (on_loop.held, on_loop.waiting) == (1, 2)
            assert off_loop == on_loop
        finally:
            await lock.release()
            await asyncio.gather(*waiters)


class TestOwnership:
    def test_a_main_task_that_ends_holding_says_what_became_of_the_release(
        self, redis_url: str, name: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Bug (helpers 63, 65): a task that ended holding a lock as its ``asyncio.run`` ended
        (here its main task) was logged "releasing it", but the run's end cancelled the release
        before it was sent, silently: the lock stayed held for its lease. On Python 3.12+ the
        release starts at once and is written before the run's end (an idle connection at
        hand); on 3.10/3.11 a second warning says it was not sent."""
        loop = asyncio.new_event_loop()
        client = aioredis.Redis.from_url(redis_url)

        async def main() -> None:
            async with Lock(client, f"{name}:warm"):
                pass
            await asyncio.sleep(0.6)  # (a lane, if one opened, has closed: a connection is idle)
            assert await Lock(client, name, lease=10.0).acquire()  # and the run ends

        try:
            with caplog.at_level(logging.WARNING, "redis_locks_async"):
                loop.run_until_complete(main())
                ending = asyncio.all_tasks(loop)  # the end of asyncio.run: all cancelled
                for task in ending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*ending, return_exceptions=True))
            messages = [record.getMessage() for record in caplog.records]
            assert any("ended while holding" in m for m in messages), messages
            held = loop.run_until_complete(client.exists(name))
            if sys.version_info >= (3, 12):
                assert not held, messages
            else:
                assert held
                assert any("release of" in m and "was not sent" in m for m in messages), messages
        finally:
            loop.run_until_complete(client.delete(name))
            loop.run_until_complete(client.aclose())
            loop.close()

    @pytest.mark.parametrize("guarded", [False, True], ids=["with", "guarded"])
    async def test_a_block_in_an_abandoned_async_generator_releases_the_lock(
        self, client: aioredis.Redis, name: str, guarded: bool
    ) -> None:
        """Regression (attack pass, stop 20: a lock held and renewed for ever): a generator
        that yields inside ``async with lock:`` and is abandoned (``async for … break``) is
        closed by asyncio in a task of its own, where the block's exit found no matching enter
        (LockError, in a task nobody awaits) and released nothing. The lock stayed the
        iterating task's, renewed for as long as that task lived. Now the block's exit
        releases the level it entered, whichever task runs it."""
        lock = Lock(client, name, lease=1.0)

        async def rows() -> AsyncIterator[int]:
            async with lock.guarded() if guarded else lock:
                for row in range(10):
                    yield row

        async for row in rows():
            if row == 1:
                break
        gc.collect()  # (the generator is finalized: asyncio closes it in a task of its own)
        for _ in range(200):  # (2 s)
            if not await lock.locked():
                break
            await asyncio.sleep(0.01)
        assert not lock.owned()
        rival = Lock(client, name)
        assert await rival.acquire(blocking=False)
        await rival.release()

    @pytest.mark.parametrize("kind", ["Lock", "FairLock", "upgrade", "downgrade"])
    async def test_a_task_waiting_for_its_own_hold_through_another_client_is_warned(
        self, connect: Connect, name: str, kind: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Attack pass, stop 20 (a silent self-deadlock): a task holding a lock through one
        client that acquires it again, without a timeout, through another client of the same
        server waits for itself (read→write and write→read across two clients too). It is
        not refused — tests of contention do just that under an outer timeout — but it is
        no longer silent: a warning names the lock."""
        first_client, second_client = connect(), connect()
        first: LockBase
        second: LockBase
        if kind in ("upgrade", "downgrade"):
            read = ReadWriteLock(first_client, name).read
            write = ReadWriteLock(second_client, name).write
            first, second = (read, write) if kind == "upgrade" else (write, read)
        else:
            cls = Lock if kind == "Lock" else FairLock
            first, second = cls(first_client, name), cls(second_client, name)
        assert await first.acquire()
        try:
            with (
                caplog.at_level(logging.WARNING, logger="redis_locks_async"),
                pytest.raises(asyncio.TimeoutError),
            ):
                await asyncio.wait_for(second.acquire(), 0.3)
            assert any("waits for itself" in r.getMessage() for r in caplog.records)
            assert await second.acquire(blocking=False) is False
            assert await second.acquire(timeout=0.2) is False
        finally:
            await first.release()
        assert await second.acquire(timeout=1.0)  # free again: the other client takes it
        await second.release()

    async def test_permits_through_two_clients_are_still_counted_not_refused(
        self, connect: Connect, name: str
    ) -> None:
        """A task may hold several permits of a semaphore, through any clients."""
        first = Semaphore(connect(), name, permits=2)
        second = Semaphore(connect(), name, permits=2)
        assert await first.acquire()
        assert await second.acquire(timeout=2.0)
        await second.release()
        await first.release()

    async def test_a_generator_closed_while_its_task_re_enters_keeps_the_task_s_block(
        self, connect: Connect, name: str
    ) -> None:
        """Regression (attack pass on the fix above, stop 20: two holders): a generator whose
        block took the task's first level, abandoned and closed while the task re-entered the
        lock in a block of its own, released the whole hold — the task's block ran on with
        the lock free, and a rival took it. The generator's level is released, the task's
        block keeps the lock until it ends."""
        lock = Lock(connect(), name, lease=5.0)
        rival = Lock(connect(), name)

        async def rows() -> AsyncIterator[int]:
            async with lock:
                yield 1
                yield 2

        async def first_row() -> int:
            async for row in rows():
                return row  # abandoned: asyncio closes the generator in a task of its own
            raise AssertionError("no row")

        await first_row()
        async with lock:
            gc.collect()
            await asyncio.sleep(0.2)
            assert lock.owned()
            assert await rival.acquire(blocking=False) is False
        assert await rival.acquire(timeout=1.0)
        await rival.release()

    async def test_a_generator_closed_by_another_task_releases_its_own_level_only(
        self, connect: Connect, name: str
    ) -> None:
        """Regression (attack pass, stop 20: a writer among readers): task B, inside its own
        ``async with rw.read:``, closed a generator whose block task A had entered; the exit
        released B's read hold (the top of B's stack), not A's — and once A ended a writer got
        in while B read. The block that ends is matched by its statement."""
        rw = ReadWriteLock(connect(), name, lease=5.0)
        writer = ReadWriteLock(connect(), name).write
        handed: asyncio.Queue[AsyncIterator[int]] = asyncio.Queue()

        async def rows() -> AsyncIterator[int]:
            async with rw.read:
                yield 1
                yield 2

        async def task_a() -> None:
            generator = rows()
            await generator.__anext__()  # A reads through the generator, then hands it over
            await handed.put(generator)

        async def task_b() -> None:
            generator = await handed.get()
            async with rw.read:
                await generator.aclose()  # type: ignore[attr-defined]
                await asyncio.sleep(0.1)  # (A has ended)
                assert rw.read.owned()
                assert await writer.acquire(timeout=0.3) is False

        await asyncio.gather(task_a(), task_b())
        assert await writer.acquire(timeout=1.0)
        await writer.release()

    async def test_generator_blocks_closed_out_of_order_release_once_per_acquire(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (attack pass, stop 20: a hold left after every release): the block of a
        task's first level, closed out of order (a generator closed while later levels were
        open), released the innermost level in its place — an explicit ``acquire()``'s — and
        the release paired with that acquire then took a block's level: after every block
        closed and every acquire was released the task still held the lock. The hold is now
        released once every level entered after it is."""
        lock = Lock(client, name, lease=5.0)

        async def rows() -> AsyncIterator[int]:
            async with lock:
                yield 1
                yield 2

        first, second = rows(), rows()
        await first.__anext__()  # the hold's own level
        await second.__anext__()  # a re-entry
        assert await lock.acquire()  # another
        await first.aclose()  # type: ignore[attr-defined]
        assert lock.owned() and await lock.locked()
        await lock.release()
        assert lock.owned() and await lock.locked()
        await second.aclose()  # type: ignore[attr-defined]
        assert not lock.owned()
        assert not await lock.locked()

    async def test_a_permit_s_generator_closed_elsewhere_is_returned_at_once(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (attack pass, stop 20: a hang): the close of an abandoned generator
        holding a permit waited for the iterating task's acquisitions to end — and that task
        was waiting for that very permit."""
        semaphore = Semaphore(client, name, permits=1)

        async def rows() -> AsyncIterator[int]:
            async with semaphore:
                yield 1
                yield 2

        async def first_row() -> int:
            async for row in rows():
                return row
            raise AssertionError("no row")

        await first_row()
        assert await asyncio.wait_for(semaphore.acquire(), 5.0)
        await semaphore.release()

    async def test_a_generator_closed_inside_a_block_of_another_lock_object_keeps_the_lock(
        self, connect: Connect, name: str
    ) -> None:
        """Regression (attack pass, stop 20: two holders, the loss never signalled): with two
        lock objects of one name and client, a task that closed its generator (whose block,
        through the first object, took the hold's own level) inside a block of the second
        released the whole hold — each object keeps its own blocks, so the first took its
        block for the task's innermost. Blocks are now ordered on the hold itself."""
        client = connect()
        lock_a, lock_b = Lock(client, name, lease=5.0), Lock(client, name, lease=5.0)
        rival = Lock(connect(), name)

        async def rows() -> AsyncIterator[int]:
            async with lock_a:
                yield 1
                yield 2

        generator = rows()
        await generator.__anext__()
        async with lock_b:
            await generator.aclose()  # type: ignore[attr-defined]
            assert lock_b.owned()
            assert await rival.acquire(blocking=False) is False
        assert not await lock_b.locked()

    async def test_the_owed_hold_is_released_when_the_last_level_s_release_was_cancelled(
        self, connect: Connect, name: str
    ) -> None:
        """Regression (attack pass, stop 20: a lock held for as long as the task lived): the
        hold owed after a generator's block closed out of order was released only by a release
        that completed in its caller — not by one cancelled and finished in the background."""
        lock = Lock(connect(), name, lease=2.0)
        other = connect()

        async def rows() -> AsyncIterator[int]:
            async with lock:
                yield 1
                yield 2

        if not hasattr(asyncio, "timeout"):
            pytest.skip("asyncio.timeout (Python >= 3.11)")
        generator = rows()
        await generator.__anext__()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.3):
                async with lock:
                    await asyncio.ensure_future(generator.aclose())  # type: ignore[attr-defined]
                    await other.client_pause(600, all=False)  # writes wait 0.6 s
                # (leaving the block: its release waits for the server, and is cancelled)
        assert await Lock(other, name).acquire(timeout=3.0)

    async def test_an_exit_stack_closed_under_wait_for_releases_the_lock(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (attack pass, stop 20: a lock held for as long as the task lived): on
        Python 3.10/3.11 ``wait_for(stack.aclose(), t)`` runs the lock's exit in a helper task,
        which had no block of its own: "exit without a matching enter", nothing released."""
        lock = Lock(client, name, lease=2.0)
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(lock)
        await asyncio.wait_for(stack.aclose(), 5.0)
        assert not lock.owned()
        assert not await lock.locked()

    async def test_an_outer_hold_survives_an_abandoned_generator_block(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """The generator's block entered one level of the task's hold: only that level goes."""
        lock = Lock(client, name, lease=1.0)

        async def rows() -> AsyncIterator[int]:
            async with lock:
                yield 1
                yield 2

        async with lock:
            async for _ in rows():
                break
            gc.collect()
            await asyncio.sleep(0.05)
            assert lock.owned() and await lock.locked()
            assert lock.current_lease is not None and lock.current_lease.hold_count == 1
        assert not await lock.locked()

    async def test_wait_for_around_a_coroutine_that_acquires(
        self, connect: Connect, name: str
    ) -> None:
        """The ``Lock`` case of ``test_family``'s wait_for-helper regression (two holders on
        Python 3.10/3.11), here so that the 3.10 subset runs it."""
        lock, rival = Lock(connect(), name), Lock(connect(), name)
        for way in WAIT_FOR_WAYS:
            await assert_wait_for_hands_the_hold_up(lock, rival, way)

    @pytest.mark.parametrize("way", ["acquire", "enter", "stack"])
    async def test_wait_for_returns_the_hold_when_its_caller_is_cancelled_just_then(
        self, client: aioredis.Redis, name: str, way: str
    ) -> None:
        """Bug (Python 3.10/3.11, found by a probe): when the task awaiting ``wait_for`` was
        cancelled in the loop step its helper returned holding the lock, ``wait_for`` handed
        it the result (``True``, a lease) before the helper's end handed it the hold — so
        ``owned()`` was False, ``release()`` raised ``LockNotOwnedError`` and ``__aexit__``
        "exit without a matching enter", and the hold arrived a step later, held until the
        task ended. The task now receives it as soon as it looks. (Python 3.12+ runs no
        helper: the same test checks plain ownership there.)"""
        lock = Lock(client, name)
        outcome: list[object] = []

        async def caller() -> None:
            me = asyncio.current_task()
            assert me is not None
            stack = contextlib.AsyncExitStack()

            async def get() -> object:
                if way == "acquire":
                    got: object = await lock.acquire()
                elif way == "enter":
                    got = await lock.__aenter__()
                else:
                    got = await stack.enter_async_context(lock)
                me.cancel()  # the caller is cancelled just as the helper returns
                return got

            try:
                got = await asyncio.wait_for(get(), 5.0)
            except asyncio.CancelledError:
                outcome.append("cancelled")  # (Python 3.12+: wait_for raises it)
                return
            outcome.append(lock.owned())
            if way == "acquire":
                assert got is True
                await lock.release()
            elif way == "enter":
                await lock.__aexit__(None, None, None)
            else:
                await stack.aclose()
            outcome.append(lock.owned())

        task = asyncio.create_task(caller())
        await asyncio.wait((task,), timeout=5.0)
        assert task.done()
        if task.cancelled():
            outcome.append("cancelled")
        else:
            task.result()
        # Python 3.12+ runs no helper: wait_for may raise the cancellation, or return and
        # leave it to the next await (the release, which still releases).
        assert outcome in (["cancelled"], [True, False], [True, "cancelled"]), outcome
        await introspect.drain(client)
        assert not await lock.locked(), "the lock is still held"

    async def test_reentrant_in_one_task(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        async with lock as outer:
            async with lock as inner:
                assert inner is outer
                assert inner.hold_count == 2
                assert await introspect.server_hold_count(client, name) == 2
            assert await lock.locked()
            assert await introspect.server_hold_count(client, name) == 1
        assert not await lock.locked()

    async def test_reentrant_across_lock_objects_of_one_client(
        self, client: aioredis.Redis, name: str
    ) -> None:
        first, second = Lock(client, name), Lock(client, name)
        async with first as a, second as b:
            assert a is b
            assert a.hold_count == 2
        assert not await first.locked()

    async def test_tasks_sharing_one_lock_exclude_each_other(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(client, name)
        inside = 0
        peak = 0
        tokens: list[int] = []

        async def worker() -> None:
            nonlocal inside, peak
            for _ in range(5):
                async with lock as lease:
                    inside += 1
                    peak = max(peak, inside)
                    tokens.append(lease.fencing_token)
                    await asyncio.sleep(0)
                    inside -= 1

        await asyncio.gather(*(worker() for _ in range(8)))
        assert peak == 1
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == len(tokens) == 40

    async def test_clients_exclude_each_other(self, redis_url: str, name: str) -> None:
        clients = [aioredis.Redis.from_url(redis_url) for _ in range(3)]
        inside = 0
        peak = 0

        async def worker(client: aioredis.Redis) -> None:
            nonlocal inside, peak
            for _ in range(10):
                async with Lock(client, name, timeout=10):
                    inside += 1
                    peak = max(peak, inside)
                    await asyncio.sleep(0.001)
                    inside -= 1

        try:
            await asyncio.gather(*(worker(c) for c in clients for _ in range(2)))
        finally:
            for c in clients:
                await c.aclose()
        assert peak == 1

    async def test_transfer_to_a_background_task(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        proceed = asyncio.Event()

        async def finish() -> int:
            await proceed.wait()
            assert lock.owned()
            token = lock.current_lease.fencing_token if lock.current_lease else -1
            await lock.release()
            return token

        async with lock as lease:
            worker = asyncio.create_task(finish())
            assert lock.transfer(worker) is lease
            assert not lock.owned()
        assert await lock.locked(), "leaving the block must not release a transferred hold"
        proceed.set()
        assert await worker == lease.fencing_token
        assert not await lock.locked()

    async def test_transfer_back_to_the_task_running_the_test(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (``transfer()`` refused a task of another asyncio Task class with
        ``TypeError``): on Python 3.10, pytest-asyncio runs the test in
        ``backports.asyncio.runner``'s ``Task``, which is not an ``asyncio.Task``, so a worker
        could not hand its hold back to the test's own task."""
        lock = Lock(client, name)
        me = asyncio.current_task()
        assert me is not None

        async def take_and_hand_back() -> Lease:
            assert await lock.acquire()
            lease = lock.current_lease
            assert lease is not None
            assert lock.transfer(me) is lease
            return lease

        lease = await asyncio.create_task(take_and_hand_back())
        assert lock.owned() and lock.current_lease is lease
        await lock.release()
        assert not await lock.locked()

    @pytest.mark.parametrize("kind", ["Lock", "Semaphore"])
    async def test_transfer_to_a_task_waiting_for_the_lock_is_refused(
        self, client: aioredis.Redis, name: str, kind: str
    ) -> None:
        """Regression (a task handed the lock while waiting in acquire() waited for itself):
        the transferred hold became the waiting task's, and its acquire() went on waiting for
        the lock that hold kept taken — ``False`` at its timeout, for ever without one (the
        hold renewed all the while). The transfer is refused now; the hold stays with the
        caller, and the waiter gets the lock once it is released. Bug (attack pass, stop 30):
        a ``Semaphore``'s permit was still handed over (the check was for reentrant locks
        only), its last permit to a task waiting for it."""

        def make() -> Lock | Semaphore:
            return Lock(client, name) if kind == "Lock" else Semaphore(client, name, 1)

        lock = make()

        async def wait_then_release() -> bool:
            other = make()
            took = await other.acquire(timeout=10)
            if took:
                await other.release()
            return took

        async with lock:
            waiter = asyncio.create_task(wait_then_release())
            await asyncio.sleep(0.1)  # the waiter is parked
            with pytest.raises(LockError, match="waiting in acquire"):
                lock.transfer(waiter)
            assert lock.owned()
        assert await asyncio.wait_for(waiter, 10) is True
        assert not await lock.locked()

    async def test_transfer_requires_holding(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        other = asyncio.create_task(asyncio.sleep(0))
        with pytest.raises(LockNotOwnedError):
            lock.transfer(other)
        await other

    async def test_transfer_to_a_non_task_is_a_type_error(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (``transfer(None)`` raised ``AttributeError`` from deep inside; bad
        arguments raise ``TypeError``/``ValueError`` at the call, SPEC §3)."""
        lock = Lock(client, name)
        async with lock:
            for bad in (None, "task", asyncio.sleep(0)):
                with pytest.raises(TypeError, match=r"asyncio\.Task"):
                    lock.transfer(bad)  # type: ignore[arg-type]
                if asyncio.iscoroutine(bad):
                    bad.close()
            assert lock.owned()

    async def test_task_ending_while_holding_releases(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(client, name)

        async def forgetful() -> None:
            await lock.acquire()

        await asyncio.create_task(forgetful())
        await asyncio.sleep(0)  # the task's done-callbacks run after this test resumed
        await introspect.drain(client)
        assert not await lock.locked()
        # Regression (a probe): that release was not counted in statistics().releases.
        stats = lock.statistics()
        assert (stats.acquisitions, stats.releases, stats.held) == (1, 1, 0)


class TestFencing:
    async def test_tokens_strictly_increase_even_after_expiry(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lock = Lock(client, name, auto_renew=False)
        seen = []
        for _ in range(3):
            async with lock as lease:
                seen.append(lease.fencing_token)
        await lock.acquire()
        seen.append(lock.current_lease.fencing_token if lock.current_lease else 0)
        await client.pexpire(name, 1)  # emulate the lease running out
        await asyncio.sleep(0.01)
        with pytest.raises(LockLostError):
            await lock.release()
        async with lock as lease:
            seen.append(lease.fencing_token)
        assert seen == sorted(set(seen))
        assert len(seen) == 5

    async def test_reentry_keeps_the_token(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        async with lock as outer, lock as inner:
            assert inner.fencing_token == outer.fencing_token


class TestLeases:
    async def test_renewal_keeps_a_short_lease_alive(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lost: list[Lease] = []
        lock = Lock(client, name, lease=0.5, on_lost=lost.append)
        async with lock as lease:
            await asyncio.sleep(1.8)
            assert (await client.hget(name, "owner")) is not None
            assert 0 < await client.pttl(name) <= 500
            assert not lease.lost
        assert not lost
        assert introspect.renewal_round_trips(client) >= 3

    async def test_expiry_without_renewal(self, client: aioredis.Redis, name: str) -> None:
        lost: list[Lease] = []
        lock = Lock(client, name, lease=0.3, auto_renew=False, on_lost=lost.append)
        await lock.acquire()
        lease = lock.current_lease
        assert lease is not None
        await asyncio.wait_for(lease.wait_lost(), 2)
        assert lost == [lease]
        await asyncio.sleep(0.05)  # the local estimate ends first, by design
        assert not await lock.locked()
        with pytest.raises(LockLostError):
            await lock.release()
        assert not lock.owned()

    async def test_guarded_block_is_cancelled_when_the_lease_is_lost(
        self, client: aioredis.Redis, name: str
    ) -> None:
        lost: list[Lease] = []
        lock = Lock(client, name, lease=0.3, on_lost=lost.append)
        reached_end = False
        with pytest.raises(LockLostError, match="lost") as info:
            async with lock.guarded() as lease:
                await client.delete(name)  # taken away behind the holder's back
                await asyncio.sleep(5)
                reached_end = True  # pragma: no cover
        assert not reached_end
        assert lease.lost and lost == [lease]
        assert isinstance(info.value.__cause__, asyncio.CancelledError)
        assert not lock.owned()
        current = asyncio.current_task()
        assert current is not None
        assert getattr(current, "cancelling", lambda: 0)() == 0  # no cancellation left pending

    async def test_extend(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name, lease=1, auto_renew=False)
        async with lock:
            await lock.extend(5)
            assert 4000 < await client.pttl(name) <= 5000
        with pytest.raises(LockNotOwnedError):
            await lock.extend()


    @pytest.mark.parametrize("kind", [Lock, FairLock])
    async def test_reentries_through_a_shorter_auto_renewing_lock_keep_the_holds_end(
        self, client: aioredis.Redis, name: str, kind: type[Lock]
    ) -> None:
        """Bug (helper-77, a regression of the lease margin): a hold without renewal,
        re-entered through an auto-renewing lock object of a shorter lease, is never cut
        shorter (README, *Leases*) — but each re-entry set the server's lease to the hold's
        *local* remainder, a margin short of the server's, and the hold took another margin
        off that: 20 re-entries cut an hour's hold by 11 minutes, and a thousand ended a
        10 s hold after 5 s with ``LockLostError``."""
        outer = kind(client, name, lease=3600.0, auto_renew=False)
        inner = kind(client, name, lease=1.0)
        async with outer as lease:
            remaining, pttl = lease.remaining(), await client.pttl(name)
            for _ in range(20):
                async with inner:
                    pass
            assert lease.remaining() == pytest.approx(remaining, abs=0.5)
            assert await client.pttl(name) == pytest.approx(pttl, abs=500)

    @pytest.mark.parametrize(
        ("how", "kind"),
        [
            *(("extend", kind) for kind in ("lock", "fair", "rw-write", "sem")),
            *(("reenter", kind) for kind in ("lock", "fair", "rw-write")),  # (no permit is)
        ],
    )
    async def test_a_lease_set_right_after_a_hand_over_is_kept(
        self, client: aioredis.Redis, redis_url: str, name: str, kind: str, how: str
    ) -> None:
        """Bug (helper-84): a waiter handed the lock, without renewal, that set a longer lease
        at once (``extend(5.0)``, or a re-entry through an object of that lease) was told it
        succeeded — but the hand-over's confirmation, sent by the lease keeper with the lock's
        own lease and run by the server after it, put the lease back: the hold was lost at the
        shorter lease. A crossing of the two now has the longer lease set again."""
        other = aioredis.Redis.from_url(redis_url)
        try:
            holder = make_lock(kind, client, name, lease=1.0)
            waiter = make_lock(kind, other, name, lease=1.0, auto_renew=False)
            longer = make_lock(kind, other, name, lease=5.0, auto_renew=False)
            held = asyncio.Event()

            async def hand_over() -> None:
                assert await holder.acquire(blocking=False)
                held.set()
                await introspect.until_registered(client, name, 1, LAYOUT[kind])
                await holder.release()

            releasing = asyncio.create_task(hand_over())
            await asyncio.wait_for(held.wait(), 5.0)
            async with waiter as lease:
                if how == "extend":
                    await waiter.extend(5.0)
                else:
                    await longer.acquire()
                await asyncio.sleep(1.5)
                assert not lease.lost, lease.lost_reason
                assert not await make_lock(kind, client, name).acquire(blocking=False)
                if how == "reenter":
                    await longer.release()
            await releasing
        finally:
            await other.aclose()


class TestWaiting:
    async def test_release_hands_over_to_a_waiter(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        other = aioredis.Redis.from_url(redis_url)
        try:
            holder = Lock(client, name)
            await holder.acquire()
            got: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()

            async def wait() -> None:
                async with Lock(other, name) as lease:
                    got.set_result(lease)
                    await asyncio.sleep(0.05)

            task = asyncio.create_task(wait())
            while not await introspect.registered_waiters(client, name):  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            token_before = holder.current_lease.fencing_token if holder.current_lease else 0
            await holder.release()
            lease = await asyncio.wait_for(got, 1)
            assert lease.fencing_token > token_before
            await task
        finally:
            await other.aclose()

    async def test_idle_waiters_send_almost_nothing(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        holder = aioredis.Redis.from_url(redis_url)
        waiters = aioredis.Redis.from_url(redis_url, client_name="idle-waiters")
        try:
            await Lock(holder, name, lease=60, auto_renew=False).acquire()
            lock = Lock(waiters, name)
            tasks = [asyncio.create_task(_acquiring(lock, timeout=30)) for _ in range(200)]
            await asyncio.sleep(0.5)
            before = await _commands_of(client, "idle-waiters")
            await asyncio.sleep(2)
            after = await _commands_of(client, "idle-waiters")
            # at most the pub/sub health check's PING (one per 3 s of silence) and noise
            assert after - before <= 3, "idle waiters must not poll"
            conns = await _connections_of(client, "idle-waiters")
            assert conns <= 2
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await waiters.aclose()
            await holder.aclose()

    async def test_burst_beyond_the_connection_pool_waits(self, redis_url: str, name: str) -> None:
        """Regression: a burst of acquisitions larger than the pool failed with "Too many
        connections" instead of waiting for a connection."""
        small = aioredis.Redis.from_url(redis_url, max_connections=4)
        try:
            locks = [Lock(small, f"{name}:{i % 20}", timeout=10) for i in range(60)]

            async def cycle(lock: Lock) -> None:
                async with lock:
                    await asyncio.sleep(0.01)

            await asyncio.gather(*(cycle(lock) for lock in locks))
        finally:
            await small.aclose()

    async def test_waiter_wakes_when_the_holder_lease_ends(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        """Expiry publishes nothing: the waiter's sleep is bounded by the holder's lease."""
        holder = aioredis.Redis.from_url(redis_url)
        try:
            await Lock(holder, name, lease=0.4, auto_renew=False).acquire()
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with Lock(client, name, timeout=3):
                assert loop.time() - started < 1.4
        finally:
            await holder.aclose()


WAIT_FOR_WAYS: Final = ("enter_async_context", "__aenter__", "wrapper")


async def assert_wait_for_hands_the_hold_up(lock: Primitive, rival: Primitive, way: str) -> None:
    """``lock`` taken through ``asyncio.wait_for`` in one of :data:`WAIT_FOR_WAYS` (a helper
    task on Python 3.10/3.11) is the caller's: held after the helper ended, kept from ``rival``,
    and released by the caller's exit."""

    async def take() -> bool:
        return await lock.acquire(timeout=5)

    async with contextlib.AsyncExitStack() as stack:
        if way == "enter_async_context":
            await asyncio.wait_for(stack.enter_async_context(lock), 5)
        elif way == "__aenter__":
            await asyncio.wait_for(lock.__aenter__(), 5)
            stack.push_async_exit(lock.__aexit__)
        else:
            assert await asyncio.wait_for(take(), 5)
            stack.push_async_callback(lock.release)
        await asyncio.sleep(0.05)  # the helper task (if any) has ended by now
        lease = lock.current_lease
        assert lease is not None and not lease.lost
        assert not await rival.acquire(blocking=False)
    assert await rival.acquire(blocking=False)  # the caller's exit released it
    await rival.release()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for's helper task: 3.10/3.11")
async def test_wait_for_s_caller_is_found_after_its_deadline_released_it() -> None:
    """Regression (helper-53): on 3.10/3.11, ``wait_for(lock.__aenter__(), t)`` returned a
    ``Lease`` already released, ~3 times in 80 when the deadline fell on the hand-over. The
    deadline had released ``wait_for``'s waiter in the step the helper task got the lock, so
    the waiter no longer listed the caller, the hold had no heir, and it was released as the
    helper ended. The caller is then found suspended in ``wait_for`` (a pure unit: the state
    is made by hand, as the deadline's callback makes it)."""
    found: list[object] = []

    async def helper_body() -> None:
        helper = asyncio.current_task()
        assert helper is not None
        for entry in getattr(helper, "_callbacks", None) or ():
            callback = entry[0] if isinstance(entry, tuple) else entry
            if getattr(callback, "func", None) is asyncio.tasks._release_waiter:  # type: ignore[attr-defined]
                callback(helper)  # what wait_for's deadline does: the waiter is released
        found.append(_wait_for_caller(helper))
        await asyncio.sleep(5)  # (cancelled by wait_for, which times out)

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(helper_body(), 5)
    assert found == [asyncio.current_task()]


async def test_nested_wait_for_around_acquire_is_the_caller_s(
    client: aioredis.Redis, name: str
) -> None:
    """Regression (helper-58, of this stop's refusal of ``create_task(wait_for(lock.acquire(),
    t))``): on 3.10/3.11, ``wait_for(wait_for(lock.acquire(), 5), 10)`` — an overall deadline
    around a per-try one — was refused ("whole body of task"): the inner ``wait_for``'s helper
    task, awaited by the outer one's, was taken for a task of its own. The caller holds the
    lock; the same nesting as a task's whole body is still refused, on every Python."""
    lock = Lock(client, name)
    assert await asyncio.wait_for(asyncio.wait_for(lock.acquire(), 5), 10)
    await asyncio.sleep(0.05)  # (the helper tasks, if any, have ended)
    assert lock.owned() and await lock.locked()
    await lock.release()
    with pytest.raises(LockError, match="whole body"):
        await asyncio.create_task(asyncio.wait_for(asyncio.wait_for(lock.acquire(), 5), 10))
    assert not await lock.locked()


async def _acquiring(lock: Lock, timeout: float) -> bool:
    return await lock.acquire(timeout=timeout)


async def _client_entries(client: aioredis.Redis, client_name: str) -> list[dict[str, str]]:
    raw = await client.execute_command("CLIENT", "LIST")  # type: ignore[no-untyped-call]
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    entries = []
    for line in text.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if fields.get("name") == client_name:
            entries.append(fields)
    return entries


async def _commands_of(client: aioredis.Redis, client_name: str) -> int:
    # `tot-cmds` is not in every server's CLIENT LIST; fall back to the server-wide count.
    entries = await _client_entries(client, client_name)
    if entries and all("tot-cmds" in e for e in entries):
        return sum(int(e["tot-cmds"]) for e in entries)
    info = await client.info("stats")
    return int(info["total_commands_processed"]) - 2  # our own INFO and CLIENT LIST


async def _connections_of(client: aioredis.Redis, client_name: str) -> int:
    return len(await _client_entries(client, client_name))


class TestBadInput:
    """Bad arguments fail at the call, before any I/O (the client points nowhere)."""

    @pytest.fixture
    def nowhere(self) -> aioredis.Redis:
        return aioredis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))

    @pytest.mark.parametrize(
        ("kwargs", "error"),
        [
            ({"lease": 0}, ValueError),
            ({"lease": -1}, ValueError),
            ({"lease": math.nan}, ValueError),
            ({"lease": math.inf}, ValueError),
            # Regression (contract probe): a huge finite lease passed, and the script wrote
            # the lock before the server refused the expiry (1e+17 ms): held for ever.
            ({"lease": 1e15}, ValueError),
            ({"claim_timeout": 1e15}, ValueError),
            ({"lease": "30"}, TypeError),
            ({"lease": True}, TypeError),
            ({"timeout": -0.5}, ValueError),
            ({"timeout": math.nan}, ValueError),
            ({"auto_renew": 1}, TypeError),
            # Regression (contract probe, stop 20): an int beyond any float raised
            # OverflowError, which ``except ValueError`` does not catch.
            ({"lease": 10**400}, ValueError),
            ({"max_hold": 10**400}, ValueError),
            ({"replica_timeout": 10**400}, ValueError),
            # Regression (contract probe, stop 20): replicas beyond WAIT's range were accepted,
            # and the acquisition took the lock before WAIT refused the count.
            ({"replicas": 2**63}, ValueError),
        ],
    )
    def test_constructor(
        self, nowhere: aioredis.Redis, kwargs: dict[str, object], error: type
    ) -> None:
        with pytest.raises(error):
            Lock(nowhere, "n", **kwargs)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("bad", "error"),
        [("", ValueError), (b"x", TypeError), (None, TypeError), ("\ud800", ValueError)],
    )
    def test_names(self, nowhere: aioredis.Redis, bad: object, error: type) -> None:
        with pytest.raises(error):
            Lock(nowhere, bad)  # type: ignore[arg-type]

    async def test_huge_extend_is_refused_at_the_call(self, nowhere: aioredis.Redis) -> None:
        with pytest.raises(ValueError, match="at most"):
            await Lock(nowhere, "n").extend(1e15)

    def test_longest_lease_is_accepted(self, nowhere: aioredis.Redis) -> None:
        assert Lock(nowhere, "n", lease=MAX_LEASE).lease == MAX_LEASE

    async def test_acquire_arguments(self, nowhere: aioredis.Redis) -> None:
        lock = Lock(nowhere, "n")
        with pytest.raises(ValueError):
            await lock.acquire(timeout=-1)
        with pytest.raises(TypeError):
            await lock.acquire(timeout="1")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await lock.extend(lease=0)
        with pytest.raises(ValueError, match="finite"):
            await lock.extend(lease=10**400)

    def test_a_timeout_beyond_any_float_waits_for_ever(self, nowhere: aioredis.Redis) -> None:
        """Regression (contract probe, stop 20): ``timeout=10**400`` raised OverflowError; it
        is a wait without end, like ``math.inf`` — and ``-10**400`` is a negative timeout."""
        assert Lock(nowhere, "n", timeout=10**400).timeout is None
        with pytest.raises(ValueError, match=">= 0"):
            Lock(nowhere, "n", timeout=-(10**400))

    async def test_connection_refused_is_a_lock_error(self, nowhere: aioredis.Redis) -> None:
        with pytest.raises(LockError, match="cannot acquire 'n'") as info:
            await Lock(nowhere, "n").acquire()
        assert info.value.__cause__ is not None
        await nowhere.aclose()

    async def test_wrong_type_key_is_named(self, client: aioredis.Redis, name: str) -> None:
        await client.set(name, "not a lock")
        with pytest.raises(LockError, match="holds a value of the wrong type") as info:
            await Lock(client, name).acquire()
        assert repr(name) in str(info.value)
        assert info.value.name == name
        assert await client.get(name) == b"not a lock"

    @pytest.mark.parametrize("kind", [Lock, FairLock], ids=lambda k: k.__name__)
    async def test_locked_names_a_wrong_type_key(
        self, kind: type[Lock], client: aioredis.Redis, name: str
    ) -> None:
        """Regression (``locked()`` answered True for a string under the lock's name — it
        only asked ``EXISTS`` — where every other call raises a ``LockError`` naming the key;
        found by a contract probe of SPEC §3)."""
        await client.set(name, "not a lock")
        with pytest.raises(LockError, match="wrong type") as info:
            await kind(client, name).locked()
        assert repr(name) in str(info.value)
        assert await client.get(name) == b"not a lock"
        assert not await kind(client, f"{name}:free").locked()

    @pytest.mark.parametrize("kind", [Lock, FairLock])
    async def test_foreign_hash_is_left_alone(
        self, client: aioredis.Redis, name: str, kind: type[Lock] | type[FairLock]
    ) -> None:
        """Also ``locked()`` refuses it (bug, attack pass of stop 30: it answered "held", for a
        hash no attempt could take, where a read/write lock's and a semaphore's refuse)."""
        await client.hset(name, "field", "value")
        with pytest.raises(LockError, match="is not a lock"):
            await kind(client, name).acquire()
        with pytest.raises(LockError, match=r"cannot inspect .* is not a lock") as info:
            await kind(client, name).locked()
        assert f"key '{name}'" in str(info.value)
        assert await client.hgetall(name) == {b"field": b"value"}

    async def test_wrong_type_fence_key(self, client: aioredis.Redis, name: str) -> None:
        """The auxiliary key is named as ``redis-cli`` and the README spell it: ``{name}\\xffmeta``
        with one backslash (regression, contract probe: it was escaped twice)."""
        await client.rpush(introspect.aux_keys(name)[0], "x")
        with pytest.raises(LockError, match=r"\{") as info:
            await Lock(client, name).acquire()
        assert f"key '{{{name}}}\\xffmeta'" in str(info.value), info.value
        assert not await client.exists(name)


class TestScripts:
    async def test_late_attempts_stay_fenced_after_a_burst_of_give_ups(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (the fence against late attempts — the ``done`` ZSET of owners that gave
        up — kept only the last 64 owners of a name: after a burst of give-ups, contenders
        timing out or RedLock rounds failing, the first one's attempt, re-sent late by a
        retrying client, took the lock for a whole lease with nobody holding it)."""
        policy = LockPolicy(name)
        owners = [secrets.token_hex(16) for _ in range(200)]
        for owner in owners:
            await policy.release(owner, "abandon", "", False).run(client)
        late = Attempt(owners[0], 30_000, False, 1_000, 2_000, False, "")
        reply = await policy.attempt(late).run(client)
        # A late duplicate: refused, nothing taken.
        assert isinstance(reply, list) and int(reply[0]) == -1, reply
        assert not await client.exists(name)

    async def test_survives_script_flush(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        async with lock:
            await client.script_flush()
        await client.script_flush()
        async with lock, lock:
            await client.script_flush()
        assert not await lock.locked()

    async def test_repr(self, client: aioredis.Redis, name: str) -> None:
        lock = Lock(client, name)
        assert name in repr(lock) and "idle" in repr(lock)
        async with lock as lease:
            assert "held" in repr(lock)
            assert str(lease.fencing_token) in repr(lease)
