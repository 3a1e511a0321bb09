"""The lease keeper's batching, counted on a real server (SPEC §4 "one round trip per node per
tick"; B5 measures the same with 10,000 locks).

Counts, never timings: a window of whole renewal ticks is cut between two renewal bursts (no
round trip for a quarter of a tick), and what the keeper sent in it is compared with what the
holds need — ceil(holds / 1,000) round trips and one renewal per hold per tick.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import redis.asyncio as aioredis

from redis_locks_async import Lease, Lock, LockLostError, Semaphore
from tests import _introspect as introspect
from tests.faultproxy import FaultProxy
from tests.test_lock_faults import until

pytestmark = pytest.mark.timeout(60)

BATCH = 1000  # renewals per pipeline (the keeper's limit)


async def _quiet_moment(client: aioredis.Redis, tick: float) -> None:
    """Return between two renewal bursts: after the keeper sent and heard something, and
    then nothing for a quarter of a tick."""
    loop = asyncio.get_running_loop()
    seen = (introspect.renewal_round_trips(client), introspect.renewals(client))
    burst = False
    quiet_since = loop.time()
    while True:
        await asyncio.sleep(tick / 50)
        now = (introspect.renewal_round_trips(client), introspect.renewals(client))
        if now != seen:
            seen, burst, quiet_since = now, True, loop.time()
        elif burst and loop.time() - quiet_since >= tick / 4:
            return


class TestBatching:
    @pytest.mark.slow
    async def test_holds_acquired_over_a_period_share_round_trips(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (B5: 1.011 round trips per tick per 1,000 locks, up to 1.09 on a loaded
        machine): holds acquired over a renewal period settled into two groups about half a
        period apart, each renewed in partial pipelines of its own, and the holds at the edge
        of each group were renewed by both (here: 14 or 15 round trips in 3 ticks). 3,000
        holds taken over one period must cost ceil(3,000 / 1,000) = 3 round trips per tick,
        each hold renewed once per tick."""
        holds, lease_s, ticks = 3000, 3.0, 3
        tick = lease_s / 3
        lost: list[Lease] = []
        locks = [
            Lock(client, f"{name}:{i}", lease=lease_s, on_lost=lost.append) for i in range(holds)
        ]
        held = 0
        all_held, stop = asyncio.Event(), asyncio.Event()
        # Acquisitions and releases paced well within the client's pool of 100 connections: past
        # it, redis-py fails commands ("Too many connections"), the keeper's renewals too.
        admission = asyncio.Semaphore(32)

        async def hold(lock: Lock) -> None:
            nonlocal held
            async with admission:
                await lock.acquire()
            try:
                held += 1
                if held == holds:
                    all_held.set()
                await stop.wait()
            finally:
                async with admission:
                    await lock.release()

        tasks: list[asyncio.Task[None]] = []
        try:
            # Twenty waves over a tick: renewal times spread over the whole period.
            for wave in range(20):
                wave_locks = locks[wave * 150 : (wave + 1) * 150]
                tasks += [asyncio.create_task(hold(lock)) for lock in wave_locks]
                await asyncio.sleep(tick / 20)
            await asyncio.wait_for(all_held.wait(), 30)
            await asyncio.sleep(2 * tick)  # every hold renewed at least once
            await _quiet_moment(client, tick)
            trips = introspect.renewal_round_trips(client)
            renewals = introspect.renewals(client)
            await asyncio.sleep(ticks * tick)  # ends at the same point between two bursts
            trips = introspect.renewal_round_trips(client) - trips
            renewals = introspect.renewals(client) - renewals
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert not lost, {lease.lost_reason for lease in lost}
        per_tick = math.ceil(holds / BATCH)
        assert trips <= ticks * per_tick, f"{trips} round trips in {ticks} ticks"
        assert renewals <= ticks * holds, f"{renewals} renewals of {holds} holds in {ticks} ticks"
        assert trips >= per_tick, "no tick in the window: nothing renewed"


class TestPoolExhausted:
    async def test_keeper_retries_soon_when_no_connection_is_free(
        self, connect: Any, name: str
    ) -> None:
        """Regression (a renewal that found the client's pool at ``max_connections`` backed off
        as after an error, 0.1 s, 0.2 s, 0.4 s, 0.8 s…, while the acquisitions competing with it
        retry every few milliseconds: in a burst, a short lease could be lost while connections
        kept coming free). "No free connection" sends nothing and is no failure: the keeper
        tries again within milliseconds, and renews as soon as a connection is free."""
        client = connect(max_connections=2)
        lost: list[Lease] = []
        lock = Lock(client, name, lease=3.0, on_lost=lost.append)
        assert await lock.acquire(blocking=False)
        pool = client.connection_pool
        await introspect.retire_lane(client)  # the test takes every connection itself
        taken = [await pool.get_connection() for _ in range(2)]
        before = introspect.renewal_round_trips(client)
        await asyncio.sleep(1.0 + 0.75)  # the first renewal is due within lease/3 = 1 s
        tries = introspect.renewal_round_trips(client) - before
        renewed = introspect.renewals(client)
        for conn in taken:
            await pool.release(conn)
        await asyncio.sleep(0.3)
        assert introspect.renewals(client) > renewed, "not renewed once a connection came free"
        # At least 0.75 s with no free connection, tried every 10 ms: dozens of tries (backing
        # off as after errors tried four or five times).
        assert tries >= 20, tries
        assert not lost and lock.owned()
        await lock.release()


async def _old_renewal_crossing_next(
    proxied: aioredis.Redis, fault_proxy: FaultProxy, client: aioredis.Redis, lease: Lease
) -> asyncio.Task[None]:
    """Just after a keeper renewal of ``lease`` (the next is a beat away, past what follows),
    hold the proxy's replies and return a task that, once the next command through the proxy
    ran on the server with its reply held, runs the keeper's renewal with the hold's old
    length (``lease.lease`` now) after it, judges it at once, then lets the replies through."""
    hold = lease._hold
    old = lease.lease
    renewals = introspect.renewals(proxied)
    await until(lambda: introspect.renewals(proxied) > renewals, what="a renewal")

    async def renewal_crossing() -> None:
        await fault_proxy.wait_held()
        assert await hold.renew(hold.owner, old, False).run(client) == 1
        introspect.judge_renewal(proxied, lease, 1)
        fault_proxy.release_replies()

    fault_proxy.hold_replies()
    return asyncio.create_task(renewal_crossing())


class TestCrossing:
    async def test_renewal_judged_while_a_longer_extend_is_in_flight_is_not_outlived(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (found reading the keeper for the S6 ``Semaphore`` diagnosis): a
        keeper's renewal with the hold's short lease (0.5 s) ran on the server *after* an
        ``extend(3.0)`` and was judged before the extend's answer came back (its reply wakes
        the caller one loop step after the job task reads it). The keeper counted it as an
        ordinary renewal; the extend then counted on 3 s from its own send — while the server
        kept the renewal's 0.5 s. The next renewal, due a third of 3 s later, found the
        permit gone: a lease lost without any fault, and until then believed valid for
        seconds past its end on the server."""
        sem = Semaphore(proxied, name, 2, lease=0.5)
        assert await sem.acquire()
        lease = sem.current_lease
        assert lease is not None
        crossing = await _old_renewal_crossing_next(proxied, fault_proxy, client, lease)
        await sem.extend(3.0)
        await crossing
        assert lease.lease == 3.0
        seconds, micros = await client.time()
        score = await client.zscore(name, introspect.lease_owner_id(lease))
        assert score is not None
        on_server = (score - (seconds * 1000 + micros / 1000)) / 1000
        assert lease.remaining() <= on_server + 0.05, (
            f"{lease!r} counts on {lease.remaining():.3f} s, the server keeps {on_server:.3f} s"
        )
        await asyncio.sleep(0.8)  # past the 0.5 s, before a renewal due a third of 3 s
        assert not lease.lost, lease.lost_reason
        assert await client.zscore(name, introspect.lease_owner_id(lease)) is not None
        await sem.release()

    async def test_renewal_judged_while_a_longer_reentry_is_in_flight_is_not_outlived(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (the re-entry sibling of the test above, ``Lock``): a renewal with the
        hold's 0.5 s lease that the server ran after a re-entry through a ``Lock(…,
        lease=3.0)``, judged before the re-entry's answer, left the holder counting on 3 s
        while the server kept 0.5 s."""
        short, longer = Lock(proxied, name, lease=0.5), Lock(proxied, name, lease=3.0)
        assert await short.acquire()
        lease = short.current_lease
        assert lease is not None
        crossing = await _old_renewal_crossing_next(proxied, fault_proxy, client, lease)
        assert await longer.acquire()
        await crossing
        assert lease.lease == 3.0 and lease.hold_count == 2
        on_server = await client.pttl(name) / 1000
        assert lease.remaining() <= on_server + 0.05, (
            f"{lease!r} counts on {lease.remaining():.3f} s, the server keeps {on_server:.3f} s"
        )
        await asyncio.sleep(0.8)  # past the 0.5 s, before a renewal due a third of 3 s
        assert not lease.lost, lease.lost_reason
        assert await client.pttl(name) > 0
        await longer.release()
        await short.release()


class TestForeignErrors:
    async def test_keeper_survives_a_non_redis_exception(self, connect: Any, name: str) -> None:
        """Regression (a renewal round trip that failed with something other than a server's
        error — a client library's bug, a wrapper's exception — killed the lease keeper's
        task): every hold it kept was never renewed again and never marked lost either, so
        ``owned()`` stayed true (and ``on_lost`` silent) after the lease had ended on the
        server — while another client could take the lock. The keeper now counts such a
        failure as its batch's renewals failing for good: the holds are lost, and told so."""
        client = connect()
        lost: list[Lease] = []
        lock = Lock(client, name, lease=1.0, on_lost=lost.append)
        assert await lock.acquire(blocking=False)

        def broken(*args: object, **kwargs: object) -> Any:
            raise RuntimeError("not a server's error")

        client.pipeline = broken
        try:
            await asyncio.sleep(0.6)  # the first renewal is due within lease/3
        finally:
            del client.pipeline
        assert lost and not lock.owned()
        with pytest.raises(LockLostError):
            await lock.release()
        # The keeper lives on: a new hold is renewed past its lease.
        lock2 = Lock(client, f"{name}:2", lease=0.6)
        assert await lock2.acquire(blocking=False)
        await asyncio.sleep(1.0)
        assert lock2.owned() and await client.exists(f"{name}:2")
        await lock2.release()

    async def test_release_cut_short_by_a_non_redis_exception_ends_the_hold(
        self, connect: Any, name: str
    ) -> None:
        """Regression (a final release that failed with something other than a server's error
        left the hold half-released): it stayed in the runtime in state ``RELEASING`` until
        its lease ended — ``owned()`` still true, the key held on the server by nobody, and the
        task's next ``acquire()`` a re-entry of that dead hold. The hold now ends there as
        after any failed release: the exception reaches the caller, and the lock is freed in
        the background."""
        client = connect()
        lock = Lock(client, name, lease=30.0)
        assert await lock.acquire(blocking=False)

        async def broken(*args: object, **kwargs: object) -> Any:
            # Once: the background abandon that follows must reach the server (on 3.10 the
            # release runs in a job task, and the abandon may start before the finally).
            del client.evalsha
            raise RuntimeError("not a server's error")

        client.evalsha = broken
        try:
            with pytest.raises(RuntimeError, match="not a server's error"):
                await lock.release()
        finally:
            client.__dict__.pop("evalsha", None)
        assert not lock.owned()
        assert lock.current_lease is None

        # Freed well within its 30 s lease, by the background abandon.
        async def freed() -> bool:
            return not await client.exists(name)

        await until(freed, what="the lock freed", within=3.0)
        async with lock as lease:  # a fresh hold, not a re-entry of the dead one
            assert lease.hold_count == 1
        assert introspect.keeper_size(client) == 0


class TestKeptFromTheNextIteration:
    """An acquisition hands its hold to the keeper at the loop's next iteration
    (``LeaseKeeper.add_soon``), so that arming the watchdog and waking the keeper do not come
    between a hand-over and its waiter's return."""

    async def test_a_hold_is_kept_once_the_loop_turns(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Counted at once, kept (the watchdog armed for it) one iteration later, renewed."""
        lock = Lock(client, name, lease=0.6)
        assert await lock.acquire(blocking=False)
        keeper = introspect.keeper(client)
        assert introspect.keeper_size(client) == 1
        await asyncio.sleep(0)
        assert keeper.watchdog is not None
        await asyncio.sleep(0.9)  # past the first lease: renewed
        assert lock.owned() and introspect.renewals(client) >= 1
        await lock.release()
        assert introspect.keeper_size(client) == 0

    async def test_a_hold_discarded_before_the_loop_turns_is_never_kept(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """A hold forgotten (released, lost) before its turn is dropped with its pending
        addition: it was never renewed nor watched after its end."""
        lock = Lock(client, name, lease=30.0)
        assert await lock.acquire(blocking=False)
        lease = lock.current_lease
        assert lease is not None
        keeper = introspect.keeper(client)
        await asyncio.sleep(0)
        hold = lease._hold  # (the seam: the keeper's own calls, on a real hold)
        keeper.discard(hold)
        keeper.add_soon(hold)
        keeper.discard(hold)
        assert len(keeper) == 0
        await asyncio.sleep(0)
        assert len(keeper) == 0 and keeper.watchdog is None
        keeper.add_soon(hold)  # kept again, so that the release below finds it as usual
        await asyncio.sleep(0)
        assert len(keeper) == 1
        await lock.release()
        assert len(keeper) == 0


class TestSilentConnection:
    @pytest.mark.parametrize("socket_timeout", [None, "default"])
    async def test_a_renewal_on_a_silent_connection_is_retried_on_another(
        self, fault_proxy: FaultProxy, name: str, socket_timeout: str | None
    ) -> None:
        """Regression (helper-54): a renewal round on a pooled connection gone silent (half-open:
        a NAT or a proxy dropped it, no RST) was given until the lease's end, and the lease was
        lost there — with ``socket_timeout=None``, or a ``socket_timeout`` longer than what
        was left of the lease (redis-py 8's 5 s against a 3 s lease) — though a new connection
        would have worked. A round gets half the time left; the next one, on another
        connection, renews the lease."""
        kwargs: dict[str, Any] = {} if socket_timeout == "default" else {"socket_timeout": None}
        client = aioredis.Redis.from_url(fault_proxy.url, **kwargs)
        lost: list[Lease] = []
        lock = Lock(client, name, lease=3.0, on_lost=lost.append)
        try:
            async with lock:
                await asyncio.sleep(0.5)  # the acquisition's connection is idle in the pool
                assert fault_proxy.blackhole_where(b"evalsha") >= 1
                await asyncio.sleep(4.0)  # past the lease: renewed on another connection
                assert not lost and lock.owned()
                lease = lock.current_lease
                assert lease is not None and lease.remaining() > 0
        finally:
            fault_proxy.heal()
            await client.aclose()


class TestSteadyLatency:
    async def test_a_renewal_that_must_connect_under_latency_keeps_the_lease(
        self, fault_proxy: FaultProxy, name: str
    ) -> None:
        """Bug (helper-62): a renewal round that had to open a connection under a steady
        latency (a reply delay of a tenth of the lease) on a server that did not know the renewal
        script yet needed six round trips — the handshake's three, its own, the script's load
        and its own again — against a bound of half the lease's time left: cut short, its
        connection dropped, each retry opening another under a bound halved again, the lease
        was lost though the server answered every command. A connection opened for the round
        has as long again for its handshake now, and a round is given at least twice what the
        last answered one took."""
        client = aioredis.Redis.from_url(fault_proxy.url)
        lost: list[Lease] = []
        lock = Lock(client, name, lease=3.0, on_lost=lost.append)
        try:
            async with lock:
                await client.connection_pool.disconnect()  # the next round connects anew
                fault_proxy.delay(0.3)
                await asyncio.sleep(5.0)  # past the lease: renewed
                assert not lost, lost[0].lost_reason
                assert lock.owned()
                fault_proxy.delay(0)
        finally:
            fault_proxy.heal()
            await client.aclose()

    async def test_one_slow_round_does_not_disarm_the_silent_connection_rule(
        self, fault_proxy: FaultProxy, name: str
    ) -> None:
        """Bug (helper-66, in this session's fix above): a round's bound was at least twice
        what the *last* answered round took; after one slow round (a latency spike) the next
        one, on a pooled connection gone silent, was given so much of what was left that no
        round on a new connection could follow within the lease, and the lease was lost. The
        floor follows the faster of the last two rounds now."""
        client = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=None)
        lost: list[Lease] = []
        lock = Lock(client, name, lease=3.0, on_lost=lost.append)
        fault_proxy.delay(0.06)
        try:
            async with lock:
                await asyncio.sleep(0.5)
                fault_proxy.delay(0.9)  # the next round is answered 0.9 s late
                await asyncio.sleep(0.7)
                before = fault_proxy.stats.bytes_down
                await until(
                    lambda: fault_proxy.stats.bytes_down != before, what="the slow round's reply"
                )
                fault_proxy.delay(0.06)
                assert fault_proxy.blackhole_where(b"evalsha") >= 1  # the pooled one goes silent
                await asyncio.sleep(4.0)  # past the lease: renewed on another connection
                assert not lost, lost[0].lost_reason
                assert lock.owned()
        finally:
            fault_proxy.heal()
            await client.aclose()
