"""``FairLock``: strict FIFO by arrival, direct hand-over, no barging, dead waiters skipped."""

from __future__ import annotations

import asyncio
import shlex
from asyncio import FIRST_COMPLETED
from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from redis_locks_async import FairLock, Lease, Lock, LockError
from redis_locks_async._fair import FAIR_ACQUIRE
from redis_locks_async._keys import LockKeys
from redis_locks_async._lock import LOCK_RELEASE
from redis_locks_async._owners import process_tag
from tests import _introspect as introspect
from tests._workers import readline, reap, worker_process
from tests.test_lock_faults import (
    HoldingTask,
    park_unregistered,
    try_once,
    until,
)

if TYPE_CHECKING:
    from tests.conftest import Connect
    from tests.faultproxy import FaultProxy

FAIR_ACQUIRE_SHA = FAIR_ACQUIRE.sha


async def fair_attempt(
    client: aioredis.Redis, keys: LockKeys, owner: str, mode: str, arrival: int = 0
) -> list[Any]:
    """``fair_acquire.lua`` run by hand (lease 30 s, grace 1 s, claim 2 s; loaded first)."""
    args = (owner, 30_000, mode, 1_000, 2_000, keys.channel, 0, arrival)
    return await client.evalsha(FAIR_ACQUIRE_SHA, 5, *keys.script_keys, *args)  # type: ignore[no-any-return]


class TestFairLock:
    async def test_grants_in_order_of_arrival_across_clients(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Every waiter, in whichever client, is served in the order it arrived."""
        holder = FairLock(client, name)
        await holder.acquire()
        order: list[int] = []
        clients = [connect() for _ in range(3)]

        async def waiter(i: int) -> None:
            async with FairLock(clients[i % 3], name):
                order.append(i)
                await asyncio.sleep(0.01)

        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(waiter(i)))
            await introspect.until_registered(client, name, i + 1)  # arrival order is known
        await holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert order == list(range(6))
        assert not await client.exists(name)

    @pytest.mark.parametrize("kind", [Lock, FairLock], ids=lambda k: k.__name__)
    async def test_tasks_arriving_together_are_served_in_call_order(
        self, connect: Connect, client: aioredis.Redis, name: str, kind: type[Lock]
    ) -> None:
        """Bug (contract probe): tasks of one process that call ``acquire()`` one right after
        the other while the lock is held were served out of order. The first one's attempt was
        still in flight as the others queued, and it queued behind them when it came back
        "held" (``Lock``, whose waiting line is local: FIFO per process); and the waiters of a
        ``FairLock`` sent their registrations at once, over several connections, so the server
        dated them in any order."""
        own = connect()
        holder = kind(connect(), name, lease=10)
        assert await holder.acquire()
        lock = kind(own, name, lease=10)
        assert not await lock.acquire(blocking=False)  # the connections and pub/sub are warm
        calls: list[int] = []
        grants: list[int] = []

        async def waiter(i: int) -> None:
            calls.append(i)
            async with lock:
                grants.append(i)
                await asyncio.sleep(0.002)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(waiter(i)))
            await asyncio.sleep(0)  # task i runs into acquire() before task i + 1 exists
            assert len(calls) == i + 1
        await asyncio.sleep(0.3)  # everybody waits now
        await holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert grants == calls == list(range(5))

    @pytest.mark.parametrize("alias", [False, True], ids=["same-url", "localhost"])
    @pytest.mark.parametrize("held", [True, False], ids=["held", "free"])
    async def test_tasks_of_one_process_on_two_clients_are_served_in_call_order(
        self, connect: Connect, redis_url: str, name: str, held: bool, alias: bool
    ) -> None:
        """Bug (contract probe): the tasks of one process registered one after the other, in
        the order they called ``acquire()``, only among the tasks of one client. Tasks calling
        it 1 ms apart (or back to back) alternately through two clients of the same server were
        granted in an order like 0, 2, 4, 1, 6, 3: the first waiter of the second client
        subscribed (a new connection) before registering, and the first client's later tasks
        registered meanwhile. ``alias``: the second client names the server ``localhost``, the
        first ``127.0.0.1`` (stop 26: not recognised as one server before)."""
        assert "127.0.0.1" in redis_url
        other = redis_url.replace("127.0.0.1", "localhost") if alias else redis_url
        clients = [connect(), connect(other)]
        holder = FairLock(clients[0], name, lease=10)  # (the first client is warm)
        if held:
            assert await holder.acquire()
        calls: list[int] = []
        grants: list[int] = []

        async def waiter(i: int) -> None:
            calls.append(i)
            async with FairLock(clients[i % 2], name, lease=10):
                grants.append(i)
                await asyncio.sleep(0.002)

        tasks = []
        for i in range(10):
            tasks.append(asyncio.create_task(waiter(i)))
            await asyncio.sleep(0.001 if held else 0)
            assert len(calls) == i + 1
        if held:
            await asyncio.sleep(0.3)  # everybody waits now
            await holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert grants == calls == list(range(10))

    async def test_a_stuck_client_does_not_hold_back_another_client_of_the_server(
        self, redis_url: str, connect: Connect, name: str
    ) -> None:
        """Regression (attack pass on the cross-client order, stop 24): a client whose only
        pooled connection was taken by the application's own BLPOP had a FairLock attempt
        stuck for good; every FairLock of another, healthy client of the same server then
        waited for it — a try on the free lock answered False, ``acquire(timeout=2)`` timed
        out, ``acquire()`` never returned. The order across clients is kept for at most
        ``KIN_PATIENCE`` now; tries never look at other clients. (Second attack pass: each
        acquisition of the healthy client still waited ``KIN_PATIENCE``, one after the other,
        and ``acquire(timeout=0.1)`` on the free lock timed out. Nothing is waited for longer
        than ``KIN_PATIENCE`` after it began now, nor for more than half of the caller's time.)"""
        loop = asyncio.get_running_loop()
        stuck = aioredis.Redis.from_pool(
            aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=None)
        )
        healthy = connect()
        await stuck.ping()
        blpop: asyncio.Future[Any] = asyncio.ensure_future(stuck.blpop([f"{name}:list"], 0))
        attempt = asyncio.create_task(try_once(FairLock(stuck, name), patience=None))
        try:
            await asyncio.sleep(0.1)
            assert not attempt.done()
            lock = FairLock(healthy, name)
            assert await try_once(lock)
            for timeout in (0.1, 2.0, None):  # (0.1: also within KIN_PATIENCE of the attempt)
                started = loop.time()
                assert await asyncio.wait_for(lock.acquire(timeout=timeout), 5)
                assert loop.time() - started < 1.0
                await lock.release()
        finally:
            await healthy.lpush(f"{name}:list", "go")  # the stuck client goes on
            assert await asyncio.wait_for(blpop, 5)
            assert await asyncio.wait_for(attempt, 5)
            await stuck.aclose()

    async def test_a_waiter_leaving_unanswered_keeps_the_order_behind_it(
        self, connect: Connect, name: str
    ) -> None:
        """Regression (second attack pass on the cross-client order, stop 24): a waiter that
        left before its registration was answered let the waiter behind it register at once —
        here a task of another client that arrived after 30 waiters of the first client and
        waited for the last of them, which was cancelled: it was granted 4th. It registers once
        the waiter ahead of the one that left has had its answer (``Waiter.pass_on``)."""
        first, second = connect(), connect()
        holder = FairLock(connect(), name, lease=10)
        assert await holder.acquire()
        grants: list[str] = []

        async def waiter(client: aioredis.Redis, label: str) -> None:
            async with FairLock(client, name, lease=10):
                grants.append(label)

        early = [asyncio.create_task(waiter(first, f"b{i}")) for i in range(30)]
        await asyncio.sleep(0.003)
        late = asyncio.create_task(waiter(second, "a"))
        await asyncio.sleep(0)  # it queues behind the 30: the last of them is its mark
        early[-1].cancel()
        await asyncio.sleep(0.5)
        await holder.release()
        await asyncio.wait_for(asyncio.gather(*early, late, return_exceptions=True), 10)
        assert grants == [f"b{i}" for i in range(29)] + ["a"]

    async def test_a_queue_of_the_wrong_type_fails_an_attempt_with_nothing_changed(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Bug (helper-71): with a grantee on record that holds nothing (its claim or lease
        ran out, meta field ``c``) and a user's string at the queue key, an attempt cleared
        ``c`` in meta and only then failed on the queue — "nothing was changed", yet meta
        had changed. Every key is read before the first write now."""
        keys = LockKeys.for_name(name, "lock")
        await client.hset(keys.meta, mapping={"c": "f" * 40, "fence": 7})
        await client.set(keys.queue, "user data")
        before = await client.hgetall(keys.meta)
        with pytest.raises(LockError, match="queue"):
            await FairLock(client, name).acquire(blocking=False)
        assert await client.hgetall(keys.meta) == before
        assert await client.get(keys.queue) == b"user data"
        await client.delete(keys.meta, keys.queue)

    async def test_a_newcomer_never_barges_in(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """A free lock owed to a registered waiter is handed to it, not taken by a try."""
        holder = FairLock(connect(), name, lease=0.3, auto_renew=False)
        assert await holder.acquire()
        got: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()

        async def wait() -> None:
            async with FairLock(connect(), name) as lease:
                got.set_result(lease)
                await asyncio.sleep(0.3)

        task = asyncio.create_task(wait())
        await introspect.until_registered(client, name, 1)
        await client.delete(name)  # the holder's lease is gone without a release
        # a newcomer finds the lock free, but a waiter is first in line: it hands it over
        assert not await FairLock(client, name).acquire(blocking=False)
        lease = await asyncio.wait_for(got, 2)
        assert await introspect.owner_in_redis(client, name) == introspect.lease_owner_id(lease)
        await asyncio.wait_for(task, 5)

    async def test_a_try_never_overtakes_an_earlier_local_waiter(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (attack pass, stop 22): a try made beside a waiting task of the same
        process whose registration had not reached the server yet took the lock freed in
        between — a newcomer barging in ahead of an earlier arrival. It answers False now."""
        holder = FairLock(connect(), name)
        assert await holder.acquire()
        waiter = await park_unregistered(fault_proxy, client, proxied, FairLock(proxied, name))
        assert await introspect.registered_count(client, name) == 0
        await holder.release()  # free, and nobody registered
        trier = asyncio.create_task(try_once(FairLock(proxied, name)))
        await asyncio.sleep(0.05)
        fault_proxy.release_replies()
        assert await asyncio.wait_for(trier, 5) is False
        assert await waiter.wait_acquired() is not None
        await waiter.end()

    @pytest.mark.parametrize("newcomer", ["try", "blocking"])
    async def test_a_waiter_whose_registration_failed_keeps_its_place(
        self, redis_url: str, client: aioredis.Redis, name: str, newcomer: str
    ) -> None:
        """Regression (attack pass, stop 23): a waiter whose registering attempt failed with a
        connection error counted as answered; while it backed off, a newcomer of the same
        process (a try, or a blocking acquire registering behind it) found the lock free and
        nobody in line, and took it first. The waiter keeps its place now."""
        failing = asyncio.Event()

        class Flaky(aioredis.Redis):
            """Fails the first waiter's "wait" attempts for 0.5 s with a connection error."""

            until: float | None = None
            owner: object = None

            async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
                args = keys_and_args[numkeys:]
                if len(args) > 2 and args[2] == "wait":
                    now = asyncio.get_running_loop().time()
                    if Flaky.until is None:
                        Flaky.until, Flaky.owner = now + 0.5, args[0]
                        failing.set()
                    if now < Flaky.until and args[0] == Flaky.owner:
                        raise RedisConnectionError("injected: connection reset by peer")
                return await super().evalsha(sha, numkeys, *keys_and_args)

        flaky = Flaky.from_url(redis_url)
        try:
            holder = FairLock(client, name)
            assert await holder.acquire()
            first = HoldingTask(FairLock(flaky, name), timeout=10)
            await asyncio.wait_for(failing.wait(), 5)
            await holder.release()  # the lock is free, and nobody is registered
            await asyncio.sleep(0.05)
            if newcomer == "try":
                assert not await try_once(FairLock(flaky, name))
            else:
                late = HoldingTask(FairLock(flaky, name), timeout=10)
                await asyncio.sleep(0.1)
                assert not late.acquired.done()
            assert await first.wait_acquired() is not None
            if newcomer != "try":
                assert not late.acquired.done()
            await first.end()
            if newcomer != "try":
                assert await late.wait_acquired() is not None
                await late.end()
        finally:
            await flaky.aclose()

    async def test_a_cancelled_waiter_leaves_the_line(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """The first in line gives up: the release goes to the next one at once."""
        holder = FairLock(client, name)
        await holder.acquire()

        async def acquiring(lock: FairLock) -> bool:
            return await lock.acquire()

        first = asyncio.create_task(acquiring(FairLock(connect(), name)))
        await introspect.until_registered(client, name, 1)
        second_lock = FairLock(connect(), name)
        second = asyncio.create_task(acquiring(second_lock))
        await introspect.until_registered(client, name, 2)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await holder.release()
        assert await asyncio.wait_for(second, 5)
        assert loop.time() - started < 1.0

    async def test_a_process_away_for_a_moment_keeps_its_place_in_line(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        redis_url: str,
        name: str,
    ) -> None:
        """Regression (CI of stop 28: a FairLock's line served out of order across a cluster
        slot migration). A hand-over that found a waiting process away — not subscribed on the
        server: its pub/sub connection being re-made, or its subscriptions following a slot
        that moved — dropped all of its registrations at once; its waiters came back at the
        back of the line, behind everyone who arrived before they were back, and in whatever
        order their attempts reached the server. An away process is now only skipped: its
        registrations keep their arrival (for a claim window), and its waiters, back, are
        served in their order and before the waiters that arrived after them. (The holders and
        the other waiters are processes of their own: a script counts the process running it
        as there.)"""
        keys = LockKeys.for_name(name)
        workers: list[asyncio.subprocess.Process] = []

        async def worker(*args: str) -> asyncio.subprocess.Process:
            stdin = asyncio.subprocess.PIPE
            workers.append(
                await worker_process(redis_url, name, "--kind", "fair", *args, stdin=stdin)
            )
            return workers[-1]

        try:
            holder = await worker("hold", "--release-on-line")
            assert (await readline(holder)).startswith("held ")
            away = []  # this process's waiters: 1st and 2nd in line
            for i in range(2):
                away.append(HoldingTask(FairLock(proxied, name, claim_timeout=5.0), timeout=30))
                await introspect.until_registered(client, name, i + 1)
            for count in (3, 4):  # the 3rd is served while this process is away
                await worker("wait", "--release-after", "2.5" if count == 3 else "0")
                assert await readline(workers[-1]) == "waiting"
                await introspect.until_registered(client, name, count)
            taker, later = workers[-2:]
            line = await client.zrange(keys.queue, 0, 1, withscores=True)

            fault_proxy.hold_replies()  # the pub/sub reconnection stalls in its handshake
            assert fault_proxy.reset_where(b"subscribe") == 1  # this process's, not the workers'
            await fault_proxy.wait_held()
            assert holder.stdin is not None
            holder.stdin.write(b"release\n")
            assert await readline(holder) == "released"  # finds this process away: skipped
            assert (await readline(taker)).startswith("held ")
            assert await client.zrange(keys.queue, 0, 1, withscores=True) == line

            fault_proxy.release_replies()  # back: its waiters re-check (and refresh)
            tokens = []
            for task in away:  # at the taker's release
                lease = await task.wait_acquired(within=15)
                assert lease is not None
                tokens.append(lease.fencing_token)
                await task.end()
            tokens.append(int((await readline(later)).split()[1]))
            assert tokens == sorted(tokens), "served out of their order of arrival"
        finally:
            await reap(workers)

    async def test_an_attempt_counts_its_own_process_as_there(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (with the one above: a process coming back from away re-checks its
        waiters, and on a cluster whose slot moved their attempts may reach the new node before
        the process's presence there). An attempt that found a free lock owed to the first in
        line took the first's process — the attempt's own — for gone: it dropped both
        registrations and took the lock, ahead of its own process's earlier waiter. The process
        running the script is there: the lock is handed to that earlier waiter."""
        keys = LockKeys.for_name(name)
        first, second = ("2" * 8 + f"{i:032x}" for i in (1, 2))  # one process, never subscribed

        async def attempt(owner: str, mode: str) -> list[Any]:
            return await fair_attempt(client, keys, owner, mode)

        await client.script_load(FAIR_ACQUIRE.source)
        assert (await attempt("1" * 40, "try"))[0] == 1  # another process holds it
        for owner in (first, second):
            assert (await attempt(owner, "wait"))[0] == 0
        await client.delete(name)  # its lease ran out
        assert (await attempt(second, "wait"))[0] == 0
        assert await client.hget(name, "owner") == first.encode()
        assert await introspect.registered_waiters(client, name) == {second}

    async def test_a_registration_found_gone_is_put_back_unless_its_owner_was_served(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """``fair_acquire.lua`` with the arrival the server gave a waiter's first registration
        (ARGV[8]): a registration found gone (the server dropped it) is put back at that
        arrival, ahead of those who came later, and the reply says so (-3). But a late
        duplicate of an attempt of an owner that was served and released (a retrying client's)
        is not put back at the front, where it would be handed the lock for a claim window:
        it goes to the back, like any late attempt (helper-38's finding)."""
        keys = LockKeys.for_name(name)
        queue = keys.queue
        # (One process: the releasing one counts as there, so its waiters are handed the lock.)
        owners = {who: "7" * 8 + f"{i:032x}" for i, who in enumerate("xabcd")}

        async def attempt(who: str, mode: str, arrival: int = 0) -> list[Any]:
            return await fair_attempt(client, keys, owners[who], mode, arrival)

        async def release(who: str) -> None:
            args = (owners[who], "final", "", keys.channel, "0")
            assert await client.evalsha(LOCK_RELEASE.sha, 5, *keys.script_keys, *args) == [0, 0]

        await client.script_load(FAIR_ACQUIRE.source)
        await client.script_load(LOCK_RELEASE.source)
        assert (await attempt("x", "try"))[0] == 1
        arrival = {}
        for who in "ab":
            status, arrival[who], _, _ = await attempt(who, "wait")
            assert status == 0
        await client.zrem(queue, owners["a"])  # the server lost a's registration
        assert (await attempt("a", "wait", arrival["a"]))[0] == -3  # put back in its place
        assert await client.zscore(queue, owners["a"]) == arrival["a"]
        assert (await attempt("a", "wait", arrival["a"]))[0] == 0  # (there: a refresh)
        await release("x")  # hands it to a
        await release("a")  # a was served: hands it to b
        await release("b")
        assert (await attempt("c", "try"))[0] == 1
        assert (await attempt("d", "wait"))[0] == 0
        late = await attempt("a", "wait", arrival["a"])  # a's attempt, re-sent late
        assert late[0] == 0
        assert await client.zrange(queue, 0, -1) == [owners["d"].encode(), owners["a"].encode()]

    async def test_lock_and_fairlock_of_one_name_are_one_lock(
        self, client: aioredis.Redis, name: str
    ) -> None:
        async with Lock(client, name):
            # the same task re-enters through the other kind
            assert await FairLock(client, name).acquire()
            assert await introspect.server_hold_count(client, name) == 2
            await FairLock(client, name).release()
        assert not await client.exists(name)


class TestWaitingCost:
    async def test_only_the_first_local_waiter_watches_a_claim_window(
        self, client: aioredis.Redis, connect: Connect, name: str
    ) -> None:
        """Regression (B3: 4 commands per FairLock hand-over, target 3): every registered
        waiter re-checked when the claim window it saw at registration ended — under steady
        hand-overs, about one extra attempt per waiter per window. Only the first waiter of a
        process watches the holds ahead (an attempt that finds the lock free hands it to the
        first in line), and the next takes the watch over when it leaves; the others'
        registrations outlive their own lease, so they wait without a command until their turn.

        A ghost (a waiter that died) is handed the lock for a 0.5 s claim window while five
        waiters of one client register behind it; when the window ends the first one's
        re-check takes the lock. Until a second after that, the four others sent nothing but
        their registration (seen with ``MONITOR``)."""
        conn = connect()
        claim = 0.5
        holder = FairLock(client, name, claim_timeout=claim)
        assert await holder.acquire()
        ghost = await introspect.register_ghost(client, name, "ghost", lease_ms=30000, claim_ms=500)
        await holder.release()  # hands the lock to the ghost, for `claim` s
        attempts: Counter[str] = Counter()
        watching = asyncio.Event()

        async def monitor() -> None:
            async with connect().monitor() as feed:
                watching.set()
                async for command in feed.listen():
                    words = shlex.split(str(command.get("command", "")))
                    # EVALSHA sha 5 <5 keys> owner lease mode ...: see fair_acquire.lua
                    if words[:2] == ["EVALSHA", FAIR_ACQUIRE_SHA] and words[10] == "wait":
                        attempts[words[8]] += 1  # the owner id

        spy = asyncio.create_task(monitor())
        first_in: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done = asyncio.Event()

        async def wait(i: int) -> None:
            async with FairLock(conn, name, claim_timeout=claim):
                if i == 0:
                    first_in.set_result(None)
                await done.wait()

        try:
            await asyncio.wait_for(watching.wait(), 5)
            waiters = []
            for i in range(5):
                waiters.append(asyncio.create_task(wait(i)))
                await introspect.until_registered(client, name, i + 1)
            await asyncio.wait_for(first_in, 5)
            await asyncio.sleep(1.0)  # a re-check timer any other waiter had has fired by now
            done.set()
            await asyncio.wait_for(asyncio.gather(*waiters), 10)
        finally:
            spy.cancel()
            await asyncio.wait((spy,), timeout=5)
            await ghost.aclose()
        assert len(attempts) == 5, attempts
        assert sorted(attempts.values())[:4] == [1, 1, 1, 1], attempts

    async def test_a_shortened_lease_wakes_only_the_watcher(
        self, client: aioredis.Redis, connect: Connect, name: str
    ) -> None:
        """Regression (attack pass on the announcement of shortened leases: "r" woke every
        registered waiter of a process — 201 attempts for one ``extend(shorter)`` with 200
        waiters; SPEC §4: one Redis attempt per process per wake-up). Only the waiter that
        watches the holds ahead for its process re-checks (seen with ``MONITOR``)."""
        conn = connect()
        holder = FairLock(client, name, lease=30.0)
        assert await holder.acquire()
        done = asyncio.Event()
        attempts: list[str] = []
        watching = asyncio.Event()

        async def monitor() -> None:
            async with connect().monitor() as feed:
                watching.set()
                async for command in feed.listen():
                    text = str(command.get("command", ""))
                    if text.startswith(f"EVALSHA {FAIR_ACQUIRE_SHA} "):
                        attempts.append(text)

        async def wait() -> None:
            async with FairLock(conn, name, timeout=30):
                await done.wait()

        waiters = [asyncio.create_task(wait()) for _ in range(20)]
        spy: asyncio.Task[None] | None = None
        try:
            await introspect.until_registered(client, name, 20)
            await asyncio.sleep(0.5)  # every registration's reply is in
            spy = asyncio.create_task(monitor())
            await asyncio.wait_for(watching.wait(), 5)
            await holder.extend(5.0)
            await asyncio.sleep(0.5)
            assert len(attempts) <= 1, attempts
        finally:
            if spy is not None:
                spy.cancel()
                await asyncio.wait((spy,), timeout=5)
            done.set()
            await holder.release()
            await asyncio.wait_for(asyncio.gather(*waiters), 20)

    async def test_a_paused_process_taken_for_dead_registers_again(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """A process whose grantee does not confirm within ``claim_timeout`` is taken for dead
        and its registrations dropped (so a killed process delays the line by one claim window,
        however many of its tasks waited). One that was only slow for a while — here, a client
        that hears everything 1.5 s late until the eviction — is told so ("x:<tag>") and
        registers its waiters again: none is stranded until its registration's refresh
        (~lease). (A process slower than ``claim_timeout`` for good is taken for dead again at
        each grant: it still makes progress, slowly.)"""
        claim = 0.5
        holder = HoldingTask(FairLock(connect(), name, claim_timeout=claim))
        assert await holder.wait_acquired() is not None
        slow = []
        for i in range(3):  # the grantee; the next, woken by the grant anyway; one more
            slow.append(HoldingTask(FairLock(proxied, name, claim_timeout=claim), timeout=20))
            await introspect.until_registered(client, name, i + 1)
        await asyncio.sleep(0.1)  # their replies are back
        fault_proxy.delay(1.5)
        live = HoldingTask(FairLock(connect(), name, claim_timeout=claim), timeout=20)
        await introspect.until_registered(client, name, 4)
        await holder.end()  # hands the lock to slow[0], which hears of it too late
        assert await live.wait_acquired(within=10) is not None  # the slow ones were evicted
        fault_proxy.delay(0)  # what is on its way still arrives late, the rest at once
        await live.end()
        pending = list(slow)  # re-registered in any order: serve whichever holds
        while pending:
            await asyncio.wait(
                [task.acquired for task in pending], timeout=10, return_when=FIRST_COMPLETED
            )
            served = [task for task in pending if task.acquired.done()]
            assert served, f"{len(pending)} waiters stranded"
            for task in served:
                assert task.acquired.result() is not None
                await task.end()
                pending.remove(task)

    @pytest.mark.parametrize("announced", [True, False], ids=["evicted", "dropped-silently"])
    async def test_waiters_whose_registrations_were_dropped_register_again_in_their_order(
        self, connect: Connect, client: aioredis.Redis, name: str, announced: bool
    ) -> None:
        """Bug: when the server dropped the registrations of a process's FairLock waiters — the
        process was taken for dead ("x:<tag>": a grantee of it did not confirm within
        ``claim_timeout``, it was paused), or they were lost unannounced (a failover to a
        replica that missed them; the "x:" lost with a pub/sub connection) — each waiter
        registered again at the back of the line at its next attempt, whenever that came (a
        waiter with a shorter lease refreshes sooner): not in their order of arrival, and they
        were served in that order. Now an attempt carries the arrival the server gave the
        waiter's first registration, a registration found gone is put back in that place, and
        the process's other waiters re-check at once (the one with the long lease too)."""
        holder = HoldingTask(FairLock(connect(), name, lease=1.0))
        assert await holder.wait_acquired() is not None
        waiting = connect()
        served: list[int] = []

        async def wait_in_line(index: int, lease: float) -> None:
            async with FairLock(waiting, name, lease=lease, timeout=30):
                served.append(index)

        # The first watches the holder's lease (re-checks when it may end); the second, with a
        # long lease, would refresh its registration last; the third, one with a short lease,
        # refreshes it before the second.
        leases = [1.0, 20.0, 1.0, 20.0]
        tasks = []
        for index, lease in enumerate(leases):
            tasks.append(asyncio.create_task(wait_in_line(index, lease)))
            await introspect.until_registered(client, name, index + 1)
        meta, queue = introspect.aux_keys(name)[:2]
        # What evict_vanished does to a process taken for dead (prelude.lua, drop_process).
        drop = (
            "for _, w in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do "
            "redis.call('ZREM', KEYS[2], w) redis.call('HDEL', KEYS[1], 'w:' .. w) end "
            "if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[1], ARGV[2]) end"
        )
        announcement = f"x:{process_tag()}" if announced else ""
        await client.eval(drop, 2, meta, queue, introspect.channel_of(name), announcement)
        await introspect.until_registered(client, name, len(leases), within=8)
        await holder.end()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert served == list(range(len(leases)))

class TestWatchHandOver:
    async def test_a_first_waiter_leaving_before_its_first_reply_passes_the_watch_on(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (FairLock one-watcher: a waiter stranded while the lock is free): the
        first waiter of a process left the line before its first reply — cancelled, timed out
        — with no watch to pass on, so the next one, registered as a mere follower (its
        re-check due only at its registration's refresh: its own lease + 2 s), slept on after
        the holder's lease ended unannounced, while the lock was free.

        Here the holder (another client, not renewing) holds for 4 s; the follower's lease is
        60 s. It must get the lock soon after the holder's lease ends, not ~a minute later."""
        holder = HoldingTask(FairLock(connect(), name, lease=4.0, auto_renew=False))
        assert await holder.wait_acquired() is not None
        # The proxied client subscribes the lock's channel; it lingers after this waiter left.
        assert not await FairLock(proxied, name).acquire(timeout=0.2)
        await asyncio.gather(*(proxied.ping() for _ in range(4)))  # connections ready in the pool
        fault_proxy.hold_replies()
        # `first` makes the one uncontended attempt (its reply held); `follower`, arriving
        # meanwhile, queues in the parking lot, and `first` goes ahead of it when that reply
        # comes back "held". (Registrations go out in that order: the follower's waits for the
        # answer to the first's.)
        first = HoldingTask(FairLock(proxied, name, lease=7.777))
        await fault_proxy.wait_held()
        await asyncio.sleep(0.05)  # the proxy waits to deliver it (so a release delivers it)
        follower = HoldingTask(FairLock(proxied, name, lease=60.0), timeout=30)
        await until(lambda: introspect.local_waiters(proxied) == 1, what="follower in the lot")
        fault_proxy.release_replies()  # the first's "try" answer, and only that:
        fault_proxy.hold_replies()  # its registering attempt's reply is held
        await introspect.until_registered(client, name, 1)
        assert fault_proxy.blackhole_where(b"$4\r\n7777\r\n") == 1  # `first` never hears back
        fault_proxy.release_replies()
        await asyncio.sleep(0.1)
        assert await introspect.registered_count(client, name) == 1  # the follower waits its turn
        await first.cancel()
        # The holder's lease ends in ~4 s, unannounced; the follower is the one left to watch.
        assert await follower.wait_acquired(within=15) is not None
        await follower.end()
        await holder.cancel()

    async def test_a_lock_waiter_between_fair_waiters_does_not_leave_them_unwatched(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (FairLock one-watcher with a ``Lock`` of the same name: a waiter stranded
        while the lock is free): in one process, a ``Lock`` waiter queued between two
        ``FairLock`` waiters. The second fair waiter left the watching to the first; when the
        first left, it passed the watch to the ``Lock`` waiter (which passes nothing on), and
        when that one gave up too, nobody watched: the holder's lease ended unannounced and the
        second fair waiter slept on until its registration's refresh (its own lease + 2 s).
        The watch goes to the next *fair* waiter."""
        holder = HoldingTask(FairLock(connect(), name, lease=4.0, auto_renew=False))
        assert await holder.wait_acquired() is not None
        conn = connect()
        first = HoldingTask(FairLock(conn, name))
        await introspect.until_registered(client, name, 1)
        plain = HoldingTask(Lock(conn, name))
        await introspect.until_registered(client, name, 2)
        follower = HoldingTask(FairLock(conn, name, lease=60.0), timeout=30)
        await introspect.until_registered(client, name, 3)
        await asyncio.sleep(0.1)  # the follower has read its reply: it follows `first`
        await first.cancel()
        await plain.cancel()
        # The holder's lease ends in ~4 s, unannounced; the follower is the one left to watch.
        assert await follower.wait_acquired(within=15) is not None
        await follower.end()
        await holder.cancel()
