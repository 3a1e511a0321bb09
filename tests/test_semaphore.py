"""``Semaphore``: N permits, per-holder leases, k freed permits wake k waiters, changes of the
count at run time — against a real server."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from redis_locks_async import LockError, LockNotOwnedError, ReadWriteLock, Semaphore
from redis_locks_async._core import Attempt
from redis_locks_async._keys import LockKeys
from tests import _introspect as introspect
from tests.test_lock_faults import HoldingTask, until

if TYPE_CHECKING:
    from tests.conftest import Connect
    from tests.faultproxy import FaultProxy


async def _assert_untouched(client: aioredis.Redis, name: str, scores: dict[str, float]) -> None:
    """The user's sorted set ``scores`` under ``name`` is as it was: every member, no TTL."""
    assert await client.zrange(name, 0, -1, withscores=True) == sorted(
        ((k.encode(), v) for k, v in scores.items()), key=lambda item: item[1]
    )
    assert await client.pttl(name) == -1


class TestSemaphore:
    @pytest.mark.parametrize("permits", [1, 3])
    async def test_peak_concurrency_equals_permits(
        self, connect: Connect, name: str, permits: int
    ) -> None:
        inside = peak = 0
        clients = [connect() for _ in range(3)]

        async def worker(i: int) -> None:
            nonlocal inside, peak
            async with Semaphore(clients[i % 3], name, permits):
                inside += 1
                peak = max(peak, inside)
                await asyncio.sleep(0.02)
                inside -= 1

        await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(12))), 20)
        assert peak == permits

    async def test_a_task_may_hold_several_permits(self, client: aioredis.Redis, name: str) -> None:
        sem = Semaphore(client, name, 2)
        assert await sem.acquire() and await sem.acquire()
        assert await sem.locked() and await sem.free_permits() == 0
        assert not await Semaphore(client, name, 2).acquire(blocking=False)
        await sem.release()
        assert await sem.free_permits() == 1
        await sem.release()
        with pytest.raises(LockNotOwnedError):
            await sem.release()
        assert not await client.exists(name)

    @pytest.mark.parametrize("how", ["blocking=False", "timeout=0"])
    async def test_concurrent_tries_each_ask_the_server(
        self, client: aioredis.Redis, name: str, how: str
    ) -> None:
        """Regression (contract probe): three tasks trying a ``Semaphore`` of 3 free permits at
        once got ``[True, False, False]``: a try made while another attempt on the name was
        in flight in the process answered ``False`` from the local queue, without asking the
        server. Each try now makes its one attempt."""
        sem = Semaphore(client, name, 3)
        tried: list[bool] = []
        done = asyncio.Event()

        async def attempt() -> None:
            if how == "timeout=0":
                held = await sem.acquire(timeout=0)
            else:
                held = await sem.acquire(blocking=False)
            tried.append(held)
            await done.wait()
            if held:
                await sem.release()

        tasks = [asyncio.create_task(attempt()) for _ in range(4)]
        await until(lambda: len(tried) == 4, what="every try answered", within=10)
        assert sorted(tried) == [False, True, True, True]
        assert await sem.free_permits() == 0
        done.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert await sem.free_permits() == 3

    async def test_freed_permits_wake_that_many_waiters(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        holder = Semaphore(client, name, 1)
        await holder.acquire()
        entered = 0
        leave = asyncio.Event()

        async def waiter() -> None:
            nonlocal entered
            async with Semaphore(connect(), name, 1):
                entered += 1
                await leave.wait()

        tasks = [asyncio.create_task(waiter()) for _ in range(3)]
        await introspect.until_registered(client, name, 3, "sem")
        await holder.set_permits(3)  # two more permits: two waiters in at once
        await asyncio.sleep(0.3)
        assert entered == 2
        await holder.release()  # and the third gets the released one
        await asyncio.sleep(0.3)
        assert entered == 3
        leave.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)

    async def test_a_dead_holders_permit_comes_back_with_its_lease(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        await Semaphore(connect(), name, 1, lease=0.3, auto_renew=False).acquire()
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await Semaphore(client, name, 1).acquire(timeout=2)
        assert loop.time() - started < 1.0

    async def test_bad_permits(self, client: aioredis.Redis, name: str) -> None:
        # 2**63 (regression, contract probe): accepted, then an idle semaphore counted
        # -9223372036854775808 free permits and was "locked".
        bad_ones = ((0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError))
        for bad, error in (*bad_ones, (2**63, ValueError), (2**31, ValueError)):
            with pytest.raises(error):
                Semaphore(client, name, bad)  # type: ignore[arg-type]
        sem = Semaphore(client, name, 2)
        for bad in (0, 2**63):
            with pytest.raises(ValueError):
                await sem.set_permits(bad)
        assert sem.permits == 2
        most = Semaphore(client, f"{name}:most", 2**31 - 1)
        assert await most.free_permits() == 2**31 - 1
        assert not await most.locked()

    async def test_permits_are_renewed(self, client: aioredis.Redis, name: str) -> None:
        async with Semaphore(client, name, 1, lease=0.3) as lease:
            await asyncio.sleep(1.0)
            assert not lease.lost, lease.lost_reason
            assert await Semaphore(client, name, 1).locked()

    async def test_a_users_sorted_set_under_the_name_is_refused_and_left_alone(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (contract probe, SPEC §3): a user's sorted set under a semaphore's name was taken
        for its holders — ``free_permits()`` counted a member scored far ahead as a holder for
        good, ``acquire`` dropped the members scored in the past as expired leases and set a TTL
        on the key, ``set_permits`` dropped them too. Now each refuses it with a ``LockError``
        naming the key, and nothing changes."""
        scores = {"carol": 5.0, "alice": 100.0, "bob": 9e15}
        await client.zadd(name, scores)
        sem = Semaphore(client, name, 5, lease=5)
        for call, action in (
            (sem.free_permits, "inspect"),
            (sem.locked, "inspect"),
            (lambda: sem.acquire(blocking=False), "acquire"),
            (lambda: sem.set_permits(3), "set permits of"),
        ):
            with pytest.raises(LockError, match=f"cannot {action} .*is not a lock of this kind"):
                await call()
        await _assert_untouched(client, name, scores)

    async def test_an_abandon_leaves_a_users_sorted_set_alone(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (found reviewing the leak below): an abandon — what a cancelled or timed-out
        acquisition sends — over a user's sorted set under the semaphore's name went on to
        admit waiters, dropping the user's members scored in the past as expired holders."""
        scores = {"carol": 5.0, "alice": 100.0, "bob": 9e15}
        await client.zadd(name, scores)
        policy = Semaphore(client, name, 5)._policy
        reply = await policy.release("ab" * 20, "abandon", "", False).run(client)
        assert reply == [0, 0]
        await _assert_untouched(client, name, scores)

    async def test_permits_that_end_without_a_release_leave_no_trace(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (attack pass): a permit whose lease ended without a release (lost, or its
        process killed) left its token field ``t:<owner>`` in the semaphore's meta hash for as
        long as the semaphore stayed in use — one field per such permit, without bound (300
        lost permits: 305 fields). Holders whose lease ended are dropped with their tokens:
        by the next acquisition, and by the release that finds its permit gone."""
        keeper = Semaphore(client, name, 3, lease=10)
        assert await keeper.acquire()  # someone keeps the semaphore (and its meta) in use
        policy = keeper._policy
        meta = policy.keys.meta

        async def lose_two() -> None:
            brief = Semaphore(client, name, 3, lease=0.05, auto_renew=False)
            assert await brief.acquire() and await brief.acquire()
            await asyncio.sleep(0.08)  # both leases end
            for _ in range(2):
                with pytest.raises(LockNotOwnedError):
                    await brief.release()

        for round_ in range(6):
            if round_ % 2:
                await lose_two()
            else:  # holders that vanish (a killed process): permits taken, never released
                for owner in (f"{round_:040x}", f"{round_ + 100:040x}"):
                    attempt = Attempt(owner, 50, False, 2000, 2000, False, "")
                    reply = await policy.attempt(attempt).run(client)
                    assert isinstance(reply, list) and reply[0] == 1
                await asyncio.sleep(0.08)  # (the next acquisition drops them)
        assert await keeper.acquire(timeout=2)  # (drops what expired meanwhile)
        fields = await client.hkeys(meta)
        tokens = [field for field in fields if isinstance(field, bytes) and field.startswith(b"t:")]
        assert len(tokens) == 2  # the keeper's two permits
        assert await client.zcard(name) == 2
        await keeper.release()
        await keeper.release()

    async def test_a_pool_that_never_frees_up_in_time_is_a_timeout(
        self, redis_url: str, name: str
    ) -> None:
        """Bug (attack pass): when the caller's timeout ran out while it waited for a free
        connection of a full pool (back-pressure, README *Connections*), ``acquire(timeout=t)``
        raised ``LockError("… Too many connections")`` instead of returning ``False``."""
        small = aioredis.Redis.from_url(redis_url, max_connections=4)
        try:
            lock = Semaphore(small, name, 3)
            outcomes: list[object] = []

            async def attempt(i: int) -> None:
                try:
                    got = await lock.acquire(timeout=0.05 if i % 2 else 2)
                except LockError as exc:
                    outcomes.append(exc)
                    return
                outcomes.append(got)
                if got:
                    await asyncio.sleep(0.001)
                    await lock.release()

            await asyncio.gather(*(attempt(i) for i in range(300)))
            errors = [o for o in outcomes if isinstance(o, Exception)]
            assert not errors, errors[:3]
            assert True in outcomes and False in outcomes
        finally:
            await small.aclose()


class TestTokensAndForeignKeys:
    """helper-71's findings on a semaphore's meta hash (tokens, fence, a foreign key there)."""

    async def test_a_permit_whose_token_record_is_gone_gets_a_new_token(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug: a permit re-checked (a re-sent acquire, a waiter that missed its hand-over's
        message) after the meta hash was evicted or deleted was answered with fencing token
        **0** — the token lives in meta only — and its release then recorded 0 as the fence."""
        keeper = Semaphore(client, name, 3, lease=10)
        assert await keeper.acquire()
        assert keeper.current_lease is not None
        first = keeper.current_lease.fencing_token
        policy = keeper._policy
        attempt = Attempt("ab" * 20, 10_000, False, 2000, 2000, False, "")
        taken = await policy.attempt(attempt).run(client)
        assert isinstance(taken, list) and taken[0] == 1 and int(taken[1]) > first
        await client.delete(policy.keys.meta)  # (evicted)
        again = await policy.attempt(attempt).run(client)  # the same call, re-sent
        assert isinstance(again, list) and again[0] == 1
        assert int(again[1]) > int(taken[1])
        released = await policy.release(attempt.owner, "final", "", False).run(client)
        assert isinstance(released, list) and released[0] == 0
        assert int(await client.hget(policy.keys.meta, "fence") or 0) == int(again[1])
        assert await keeper.acquire()
        assert keeper.current_lease is not None
        assert keeper.current_lease.fencing_token > int(again[1])
        await keeper.release()
        await keeper.release()

    async def test_the_fence_never_goes_down_when_an_older_permit_is_released_last(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (a suspicion of helper-71): a release recorded its own token as the fence
        floor, so the older of two permits, released last, lowered it below a token already
        issued (tokens stayed increasing only through the floor from server time)."""
        sem = Semaphore(client, name, 2, lease=10)
        older = HoldingTask(sem)
        first = await older.wait_acquired()
        newer = HoldingTask(sem)
        second = await newer.wait_acquired()
        assert first is not None and second is not None
        assert first.fencing_token < second.fencing_token
        await newer.end()
        await older.end()
        meta = LockKeys.for_name(name, "sem").meta
        assert int(await client.hget(meta, "fence") or 0) == second.fencing_token

    async def test_a_renewal_gives_no_ttl_to_a_foreign_key_at_meta(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug: with a user's string at the semaphore's meta key, ``extend()`` (and every
        renewal) gave that key a TTL — it vanished a minute later. A renewal leaves a key
        of another type alone; the release refuses it, naming it, and changes nothing."""
        sem = Semaphore(client, name, 2, lease=10)
        assert await sem.acquire()
        meta = LockKeys.for_name(name, "sem").meta
        await client.delete(meta)
        await client.set(meta, "user data")
        await sem.extend(20)
        assert await client.pttl(meta) == -1
        with pytest.raises(LockError, match=r"sem\.meta"):
            await sem.release()
        assert await client.get(meta) == b"user data"
        await client.delete(meta, name)


class TestDeadGrantees:
    @pytest.mark.parametrize("kind", ["sem", "rw"])
    async def test_every_local_waiter_gets_in_once_dead_grantees_claims_end(
        self,
        client: aioredis.Redis,
        connect: Connect,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        name: str,
        kind: str,
    ) -> None:
        """The holds of a ``Semaphore(2)`` (of a write side) are handed to waiters of a client
        that hangs (its replies and messages held back), whose claim windows then end
        unconfirmed: both waiters of another client — tasks of one parking lot, behind the
        hung ones — get in soon after, not when their timers end (the holds they registered
        behind, 20 s on). (An attack pass reported the second waiter stranded; not reproduced
        here, this keeps it checked.)"""
        claim = 0.5
        other = connect()  # the holders, then two waiters: tasks of one client (one parking lot)
        if kind == "sem":

            def make(c: aioredis.Redis) -> Any:
                return Semaphore(c, name, 2, lease=20, claim_timeout=claim)

            holders = [HoldingTask(make(other)) for _ in range(2)]
            hang = [make(proxied) for _ in range(2)]
            live = [make(other) for _ in range(2)]
        else:
            holders = [HoldingTask(ReadWriteLock(other, name, lease=20).write)]
            hang = [ReadWriteLock(proxied, name, claim_timeout=claim).write]
            live = [ReadWriteLock(other, name, lease=20).read for _ in range(2)]
        for holder in holders:
            assert await holder.wait_acquired() is not None
        hung = [HoldingTask(lock, timeout=30) for lock in hang]
        await introspect.until_registered(client, name, len(hung), kind)
        await asyncio.sleep(0.1)  # their registrations' replies are back
        fault_proxy.hold_replies()  # from now on they hear nothing, and confirm nothing
        waiting = [HoldingTask(lock, timeout=8) for lock in live]
        await introspect.until_registered(client, name, len(hung) + 2, kind)
        for holder in holders:
            await holder.end()  # handed to the hung waiters, for `claim` s each
        for task in waiting:
            assert await task.wait_acquired(within=4.0) is not None
        for task in waiting:
            await task.end()
        fault_proxy.heal()
        for task in hung:
            task.task.cancel()
            await asyncio.gather(task.task, return_exceptions=True)


class TestIdle:
    async def test_the_permit_count_is_forgotten_a_minute_after_the_last_release(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (attack pass, stop 25): every acquisition and renewal kept the key that
        records the permit count alive for the holder's lease plus a minute, and nothing
        shortened it when the semaphore fell idle — used once with a 150 s lease, its count
        outlived the documented minute by the lease (with a lease of days, for days), and a
        new user's ``permits`` did not apply. Now the last release (nobody holding or
        waiting) leaves it a minute; while a permit is held it stays."""
        meta = LockKeys.for_name(name, "sem").meta
        first, second = Semaphore(client, name, 2, lease=150), Semaphore(client, name, 2, lease=150)
        assert await first.acquire(blocking=False)
        assert await second.acquire(blocking=False)
        await first.release()
        assert await client.pttl(meta) > 120_000  # a permit is still held for 150 s
        await second.release()
        assert 0 < await client.pttl(meta) <= 60_000
