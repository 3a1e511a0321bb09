"""Generic properties of the lock family (issue 7, item 4; SPEC §3, §4, §6).

``TestEveryPrimitive`` runs each property against every exclusive primitive — ``Lock``,
``FairLock``, the write side of ``ReadWriteLock`` and ``Semaphore(permits=1)`` — through one
factory, ``make(client, name, **options)``: exclusion across processes (hold intervals and
fencing tokens), timeouts and ``blocking=False``, cancellation with a reply parked at every
step of an acquisition and its release, liveness after a holder's SIGKILL (lease + 1 s) and
after a registered waiter's SIGKILL (the dead-waiter bound, ``claim_timeout``), and no keys
or tasks left behind. The other classes hold what only one primitive promises: strict FIFO
(``FairLock``), shared readers, exclusive and unstarved writers (``ReadWriteLock``), and a
peak concurrency of exactly N (``Semaphore``).

Worker processes are ``tests/_lockworker.py`` (``--kind`` picks the primitive); every one a
test starts is killed when the test ends, whatever happened (the ``spawn`` fixture).
``TestFoundHere`` keeps the regression tests of the bugs these tests exposed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import pytest
import redis.asyncio as aioredis

from redis_locks_async import (
    Lock,
    LockLostError,
    LockNotOwnedError,
    LockTimeout,
    ReadWriteLock,
    Semaphore,
)
from redis_locks_async._lock import LOCK_RENEW
from redis_locks_async._rwlock import RW_RENEW
from redis_locks_async._semaphore import SEM_RENEW
from tests import _introspect as introspect
from tests._lockworker import LAYOUT, Primitive, make_lock
from tests._workers import (
    Hold,
    Spawn,
    assert_exclusive,
    contend,
    readline,
    reap,
    worker_process,
)
from tests.test_lock import WAIT_FOR_WAYS, assert_wait_for_hands_the_hold_up
from tests.test_lock_faults import HoldingTask, finish, settle, step, until

if TYPE_CHECKING:
    from tests.conftest import Connect
    from tests.faultproxy import FaultProxy

_T = TypeVar("_T")

PRIMITIVES: Final = ("lock", "fair", "rw-write", "sem")
_RENEWALS: Final = frozenset(script.sha for script in (LOCK_RENEW, RW_RENEW, SEM_RENEW))

# What the README documents: auxiliary keys expire "a minute after the state they describe";
# the longest state is a waiter's registration, which lives for the holder's remaining lease
# plus claim_timeout plus the registration grace (2 s).
AUX_TAIL: Final = 60.0
REGISTRATION_GRACE: Final = 2.0


class Make(Protocol):
    """``make(client, name, **options)``: the lock object of the primitive under test."""

    def __call__(self, client: aioredis.Redis, name: str, **options: Any) -> Primitive: ...


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(params=PRIMITIVES)
def kind(request: pytest.FixtureRequest) -> str:
    """The primitive under test (a ``tests._lockworker`` kind)."""
    value: str = request.param
    return value


@pytest.fixture
def make(kind: str) -> Make:
    """The factory of the primitive under test (a semaphore gets one permit)."""

    def build(client: aioredis.Redis, name: str, **options: Any) -> Primitive:
        return make_lock(kind, client, name, **options)

    return build


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A lock name unique to this test, without glob characters (so ``SCAN MATCH`` finds
    exactly its keys)."""
    return f"family:{re.sub(r'[^A-Za-z0-9_-]', '_', request.node.name)}:{secrets.token_hex(4)}"


@pytest.fixture
async def spawn(redis_url: str) -> AsyncIterator[Spawn]:
    """Start worker processes on the standalone server; all are killed at teardown."""
    started: list[asyncio.subprocess.Process] = []

    async def start(name: str, *args: str, stdin: int | None = None) -> asyncio.subprocess.Process:
        proc = await worker_process(redis_url, name, *args, stdin=stdin)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        await reap(started)


@pytest.fixture
async def proxied(fault_proxy: FaultProxy, client: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    """A client whose connections run through ``fault_proxy``, connected, scripts loaded; at
    teardown it is closed and must leave no background task behind."""
    for source in introspect.script_sources():
        await client.script_load(source)
    conn = aioredis.Redis.from_url(fault_proxy.url)
    await conn.ping()
    try:
        yield conn
    finally:
        fault_proxy.heal()
        await conn.aclose()
    assert not introspect.background_tasks(conn), "tasks survived the closed client"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


async def holding(lock: Primitive) -> HoldingTask:
    """A :class:`HoldingTask` of ``lock`` that holds it already."""
    holder = HoldingTask(lock)
    assert await holder.wait_acquired() is not None
    return holder


def peak(holds: list[Hold]) -> int:
    """The most holds that were inside at one moment."""
    events = sorted([(start, 1) for start, _, _ in holds] + [(end, -1) for _, end, _ in holds])
    inside = top = 0
    for _, delta in events:
        inside += delta
        top = max(top, inside)
    return top


async def registered(inspector: aioredis.Redis, name: str, kind: str) -> int:
    return await introspect.registered_count(inspector, name, LAYOUT[kind])


async def assert_no_leaked_keys(
    inspector: aioredis.Redis, name: str, kind: str, longest_state: float
) -> None:
    """The README's promise ("Keys in Redis"): once everything is released, the lock's own key
    is gone, and every key left is one of its auxiliary keys, with a TTL of at most a minute
    past ``longest_state`` seconds (never a key without a TTL)."""
    assert not await inspector.exists(name), f"{name!r} still exists after the last release"
    allowed = set(introspect.aux_keys(name, LAYOUT[kind]))
    found = [key async for key in inspector.scan_iter(match=f"*{name}*", count=1000)]
    assert set(found) <= allowed, f"unexpected keys: {set(found) - allowed}"
    for key in found:
        ttl = await inspector.pttl(key)
        assert 0 < ttl <= (AUX_TAIL + longest_state) * 1000, f"{key!r} has PTTL {ttl}"


# --------------------------------------------------------------------------------------------
# Every primitive
# --------------------------------------------------------------------------------------------


class TestEveryPrimitive:
    """One property per test, for ``Lock``, ``FairLock``, ``rw.write`` and ``Semaphore(1)``."""

    async def test_exclusion_across_processes(self, spawn: Spawn, kind: str, name: str) -> None:
        """S1 without faults: 3 processes x 3 tasks; no two holds overlap, and the fencing
        tokens increase in the order the holds happened."""
        holds = await contend(spawn, name, [kind] * 3, tasks=3, rounds=8)
        assert_exclusive(list(itertools.chain.from_iterable(holds)))

    async def test_timeouts_on_a_held_lock(
        self, connect: Connect, client: aioredis.Redis, make: Make, kind: str, name: str
    ) -> None:
        """``acquire(timeout=t)`` gives up with ``False`` after about ``t``; ``async with`` a
        lock whose ``timeout`` passes raises ``LockTimeout``; neither leaves a registration."""
        holder = await holding(make(connect(), name))
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert not await make(client, name).acquire(timeout=0.2)
            took = loop.time() - started
            assert 0.2 <= took < 1.5, f"acquire(timeout=0.2) returned after {took:.2f} s"

            started = loop.time()
            with pytest.raises(LockTimeout, match=re.escape(name)):
                async with make(client, name, timeout=0.2):
                    raise AssertionError("entered a held lock")
            took = loop.time() - started
            assert 0.2 <= took < 1.5, f"async with (timeout 0.2) gave up after {took:.2f} s"
            await settle(client)
            assert await registered(client, name, kind) == 0
        finally:
            await holder.end()
        assert await make(client, name).acquire(timeout=0)
        await make(client, name).release()

    async def test_blocking_false(
        self, connect: Connect, client: aioredis.Redis, make: Make, kind: str, name: str
    ) -> None:
        """One attempt: ``True`` on a free lock, ``False`` at once on a held one, and nothing
        registered."""
        lock = make(client, name)
        assert await lock.acquire(blocking=False)
        lease = lock.current_lease
        assert lease is not None and not lease.lost
        other = make(connect(), name)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert not await other.acquire(blocking=False)
        assert not await other.acquire(timeout=0)
        assert loop.time() - started < 1.0
        assert await registered(client, name, kind) == 0
        await lock.release()
        assert await other.acquire(blocking=False)
        await other.release()
        await assert_no_leaked_keys(client, name, kind, 30.0 + 2.0 + REGISTRATION_GRACE)

    @pytest.mark.parametrize("contended", [False, True], ids=["free", "contended"])
    async def test_cancellation_at_every_reply(
        self,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        make: Make,
        kind: str,
        name: str,
        contended: bool,
    ) -> None:
        """S3: a task acquires (waiting behind a holder, if ``contended``) and releases,
        through a fresh client whose connections run through the fault proxy; it is cancelled
        while the k-th reply it needs — of a connection handshake, an attempt, ``SUBSCRIBE``,
        the hand-over message, the confirmation, the release — is parked at the proxy, for
        every k until the task gets through. Afterwards: the task ended cancelled, nothing is
        held or registered, no cleanup is pending, the lock is free at once, and closing the
        client leaves no task behind."""
        for source in introspect.script_sources():
            await client.script_load(source)
        other = connect()
        for k in itertools.count():
            assert k < 40, "the acquisition never got through"
            key = f"{name}:{k}"
            holder = await holding(make(other, key)) if contended else None
            conn = aioredis.Redis.from_url(fault_proxy.url)
            try:
                await conn.ping()  # the first connection is up: its handshake is not a step
                lock = make(conn, key)

                async def acquire_and_release(lock: Primitive = lock) -> None:
                    assert await lock.acquire(timeout=10)
                    await lock.release()

                fault_proxy.hold_replies()
                task = asyncio.create_task(acquire_and_release())
                parked = await _park_reply(fault_proxy, task, k, client, key, kind, holder)
                task.cancel()
                fault_proxy.release_replies()
                done, _ = await asyncio.wait((task,), timeout=10)
                assert done, f"k={k}: the cancelled task did not end"
                if parked:
                    assert task.cancelled(), f"k={k}: the cancellation was swallowed"
                else:
                    task.result()  # it got through before a k-th reply: the last round
                fault_proxy.heal()
                await settle(conn)
                if holder is not None and not holder.ended:
                    await holder.end()
                assert await registered(client, key, kind) == 0, f"k={k}: a registration is left"
                free = make(client, key)
                assert await free.acquire(blocking=False), f"k={k}: the lock is still held"
                await free.release()
            finally:
                fault_proxy.heal()
                if holder is not None and not holder.ended:
                    await holder.end()
                await conn.aclose()
            assert not introspect.background_tasks(conn), f"k={k}: tasks survived the close"
            if not parked:
                assert k >= (6 if contended else 2), f"only {k} replies: the steps were merged"
                return

    async def test_holder_sigkill_liveness(
        self, spawn: Spawn, client: aioredis.Redis, make: Make, kind: str, name: str
    ) -> None:
        """S2: the holder's process is SIGKILLed; a waiter gets the lock within its lease
        (1 s) + 1 s, with a higher fencing token."""
        lease_s = 1.0
        proc = await spawn(name, "--lease", str(lease_s), "--kind", kind, "hold")
        line = await readline(proc)
        assert line.startswith("held "), line
        dead_token = int(line.split()[1])
        waiter = HoldingTask(make(client, name), timeout=10)
        try:
            await until(lambda: registered(client, name, kind), what="the waiter's registration")
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            loop = asyncio.get_running_loop()
            killed_at = loop.time()
            lease = await waiter.wait_acquired(within=lease_s + 3)
            took = loop.time() - killed_at
            assert lease is not None
            assert took <= lease_s + 1.0, f"took over {took:.2f} s after the SIGKILL"
            assert lease.fencing_token > dead_token
        finally:
            await waiter.end()
        await settle(client)

    @pytest.mark.parametrize("how", ["extend", "reenter"])
    async def test_a_shortened_lease_that_ends_wakes_the_waiters(
        self, connect: Connect, client: aioredis.Redis, make: Make, kind: str, name: str, how: str
    ) -> None:
        """Regression (known limit of the previous release, found by an attack pass: a waiter
        sleeps until the end of the holder's lease as its last attempt saw it — 30 s here; a
        holder that then shortened its lease to 1 s, by ``extend`` or by a re-entry through an
        object of a shorter lease, and stopped renewing announced nothing, so the waiter slept
        on for 29 s after the lock was free). A lease made shorter is announced ("r": the
        waiters re-check)."""
        if how == "reenter" and kind == "sem":
            pytest.skip("a semaphore's permits are not re-entered")
        holder = make(client, name, lease=30.0, auto_renew=False)
        assert await holder.acquire(blocking=False)
        other = await connect()
        waiter = HoldingTask(make(other, name), timeout=20)
        try:
            await until(lambda: registered(client, name, kind), what="the waiter's registration")
            await asyncio.sleep(0.2)  # its attempt's reply (the 30 s bound) has arrived
            loop = asyncio.get_running_loop()
            shortened_at = loop.time()
            if how == "extend":
                await holder.extend(1.0)
            else:
                assert await make(client, name, lease=1.0, auto_renew=False).acquire()
            lease = await waiter.wait_acquired(within=5.0)
            took = loop.time() - shortened_at
            assert lease is not None
            assert took < 2.0, f"the waiter got in {took:.2f} s after the 1 s lease began"
        finally:
            await waiter.end()
            for _ in range(2 if how == "reenter" else 1):
                with contextlib.suppress(LockLostError):
                    await holder.release()
        await settle(client)

    async def test_a_shorter_lease_never_sent_is_announced_by_the_renewal(
        self, connect: Connect, make: Make, kind: str, name: str
    ) -> None:
        """Regression (attack pass on the announcement of shortened leases: an
        ``extend(shorter)`` given up on before it was sent still made the hold's lease the
        shorter one, so the lease keeper's next renewal cut the server's lease — without a
        word: the waiters slept until the longer lease they had seen would have ended, 3 s
        after the holder's process died). A renewal that shortens a lease announces it too."""
        holding, waiting = await connect(), await connect()
        holder = make(holding, name, lease=6.0)
        assert await holder.acquire(blocking=False)
        waiter = HoldingTask(make(waiting, name), timeout=20)
        real = holding.evalsha
        stalled: list[bool] = []

        async def never_sent(script: str, numkeys: int, *rest: Any) -> object:
            if script in _RENEWALS and "1000" in map(str, rest[numkeys:]) and not stalled:
                stalled.append(True)  # the extend: waits for a connection that never comes
                await asyncio.sleep(3600)
            return await real(script, numkeys, *rest)

        try:
            await until(lambda: registered(holding, name, kind), what="the waiter's registration")
            await asyncio.sleep(0.2)  # its attempt's reply (the 6 s bound) has arrived
            holding.evalsha = never_sent
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(holder.extend(1.0), 0.1)
            del holding.evalsha
            assert stalled
            await asyncio.sleep(0.5)  # the keeper renews: 1 s from now on the server
            loop = asyncio.get_running_loop()
            died_at = loop.time()
            await holding.aclose()  # the holder's process dies: no release, no renewal
            lease = await waiter.wait_acquired(within=5.0)
            took = loop.time() - died_at
            assert lease is not None
            assert took < 1.8, f"the waiter got in {took:.2f} s after the holder died"
        finally:
            await waiter.end()
        await settle(waiting)

    @pytest.mark.parametrize("dead", [1, 3])
    async def test_waiter_sigkill_does_not_stall_the_next(
        self,
        dead: int,
        spawn: Spawn,
        connect: Connect,
        client: aioredis.Redis,
        make: Make,
        kind: str,
        name: str,
    ) -> None:
        """A waiter process is SIGKILLed while registered ahead of a live waiter; on release
        the live waiter gets the lock within the dead one's ``claim_timeout`` (+ 1 s), not
        after its lease (30 s).

        With three waiting tasks in the killed process — regression (a killed process's
        waiters were each handed the lock in turn, one claim window apiece): the first one's
        unconfirmed grant gets its whole process taken for dead, so the line is delayed by one
        claim window, not three — neither for the first live waiter nor, at the next release,
        for the second."""
        claim = 1.5
        holder = await holding(make(connect(), name))
        live: HoldingTask | None = None
        second: HoldingTask | None = None
        # every waiter registers, except a Lock's: one per process
        expected = 1 if kind == "lock" else dead
        try:
            proc = await spawn(
                name, "--kind", kind, "--claim-timeout", str(claim), "wait", "--tasks", str(dead)
            )
            assert await readline(proc) == "waiting"
            await until(
                lambda: _at_least(registered(client, name, kind), expected),
                what="the worker's registrations",
                within=10,
            )
            live = HoldingTask(make(client, name), timeout=15)
            await until(
                lambda: _at_least(registered(client, name, kind), expected + 1),
                what="the live waiter's registration",
            )
            second = HoldingTask(make(connect(), name), timeout=15)
            await until(
                lambda: _at_least(registered(client, name, kind), expected + 2),
                what="the second live waiter's registration",
            )
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            loop = asyncio.get_running_loop()
            released_at = loop.time()
            await holder.end()
            # Only FairLock serves the two in order: whichever gets in first, the other next.
            both = (live.acquired, second.acquired)
            await asyncio.wait(both, timeout=claim + 5, return_when=asyncio.FIRST_COMPLETED)
            waited = loop.time() - released_at
            first, then = (live, second) if live.acquired.done() else (second, live)
            assert first.acquired.done() and first.acquired.result() is not None
            assert waited <= claim + 1.0, f"the first live waiter waited {waited:.2f} s"
            released_at = loop.time()
            await first.end()
            assert await then.wait_acquired(within=2 * claim + 5) is not None
            waited = loop.time() - released_at
            assert waited < claim * 2 / 3, f"the second live waiter waited {waited:.2f} s"
        finally:
            if not holder.ended:
                await holder.end()
            for task in (live, second):
                if task is not None and not task.ended:
                    await task.end()
        await settle(client)

    async def test_killed_waiting_processes_are_skipped_at_once(
        self,
        spawn: Spawn,
        connect: Connect,
        client: aioredis.Redis,
        make: Make,
        kind: str,
        name: str,
    ) -> None:
        """Regression (SPEC §4, a waiter killed in a rolling deploy must not stall the lock —
        default bound 5 s: a FairLock line with three killed waiting processes ahead of a live
        waiter handed the lock to each dead process in turn, one claim window apiece — 3 x 2 s
        by default). A killed process is no longer present on the server (its presence
        subscription went with its connection), so a hand-over skips its registrations at
        once: the live waiter gets the lock well within one claim window (3 s here)."""
        claim = 3.0
        holder = await holding(make(connect(), name))
        procs = []
        try:
            for count in range(1, 4):
                proc = await spawn(
                    name, "--kind", kind, "--claim-timeout", str(claim), "wait", "--tasks", "1"
                )
                procs.append(proc)
                assert await readline(proc) == "waiting"
                await until(
                    lambda: _at_least(registered(client, name, kind), count),  # noqa: B023
                    what="the worker's registration",
                    within=10,
                )
            await _handed_past_killed(client, name, kind, make, holder, procs, claim)
        finally:
            if not holder.ended:
                await holder.end()
        await settle(client)

    async def test_a_killed_waiting_process_with_a_forked_child_is_skipped(
        self,
        spawn: Spawn,
        connect: Connect,
        client: aioredis.Redis,
        make: Make,
        kind: str,
        name: str,
    ) -> None:
        """Regression (attack on the presence change: a waiting process that had forked a
        helper — a worker pool — was still present after its SIGKILL: the child's copy of the
        pub/sub socket kept the connection open, so each such process cost a claim window
        again). A forked child now lets go of its copies of the hubs' sockets."""
        claim = 3.0
        holder = await holding(make(connect(), name))
        child = 0
        try:
            proc = await spawn(
                name,
                "--kind", kind, "--claim-timeout", str(claim), "wait", "--fork-helper",
                stdin=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert await readline(proc) == "waiting"
            await until(
                lambda: _at_least(registered(client, name, kind), 1),
                what="the worker's registration",
                within=10,
            )
            assert proc.stdin is not None
            proc.stdin.write(b"fork\n")
            await proc.stdin.drain()
            line = await readline(proc)
            assert line.startswith("child "), line
            child = int(line.split()[1])
            await _handed_past_killed(client, name, kind, make, holder, [proc], claim)
        finally:
            if child:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            if not holder.ended:
                await holder.end()
        await settle(client)

    async def test_no_leaked_keys_or_tasks(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        make: Make,
        kind: str,
        name: str,
    ) -> None:
        """After holds, hand-overs, a timed-out and a cancelled waiter and a cancelled
        release, everything is released: the lock's key is gone and only its auxiliary keys
        are left, expiring as documented; no library task survives the clients' close (the
        ``proxied`` fixture checks that)."""
        lease, claim = 5.0, 2.0
        clients = [proxied, connect(), connect()]

        def lock(i: int, **options: Any) -> Primitive:
            return make(clients[i % 3], name, lease=lease, claim_timeout=claim, **options)

        holder = await holding(lock(0))
        waiters = [asyncio.create_task(_visit(lock(i))) for i in range(1, 4)]
        await until(lambda: _at_least(registered(client, name, kind), 1), what="a registration")
        assert not await lock(1).acquire(timeout=0.1)  # a waiter that times out
        cancelled = asyncio.create_task(_acquiring(lock(2)))
        await until(lambda: _at_least(registered(client, name, kind), 2), what="registrations")
        cancelled.cancel()
        await asyncio.wait((cancelled,), timeout=5)
        await holder.end()
        assert all(await asyncio.wait_for(asyncio.gather(*waiters), 10))

        # a release cancelled while its reply is parked at the proxy still releases
        releasing = await holding(lock(0))
        fault_proxy.hold_replies()
        releasing._end.set()
        await fault_proxy.wait_held()
        releasing.task.cancel()
        fault_proxy.release_replies()
        await asyncio.wait((releasing.task,), timeout=5)

        for conn in clients:
            await settle(conn)
        assert await registered(client, name, kind) == 0
        await assert_no_leaked_keys(client, name, kind, lease + claim + REGISTRATION_GRACE)

    async def test_a_hold_lost_to_a_closed_client_says_so_on_release(
        self, redis_url: str, make: Make, name: str
    ) -> None:
        """Bug (contract probe): after ``client.aclose()`` the holds it had were marked lost,
        ``on_lost`` ran — and then forgotten: the task's ``release()`` (in its ``finally``)
        raised ``LockNotOwnedError`` ("not held by this task") where every other loss says
        ``LockLostError``, as leaving ``async with`` did."""
        client = aioredis.Redis.from_url(redis_url)
        lost: list[bool] = []
        lock = make(client, name, on_lost=lambda lease: lost.append(lease.lost))
        await lock.acquire()
        lease = lock.current_lease
        assert lease is not None
        await client.aclose()
        await asyncio.wait_for(lease.wait_lost(), 5)
        assert lost == [True]
        assert lock.current_lease is lease
        with pytest.raises(LockLostError, match="closed"):
            await lock.release()
        after: object = lock.current_lease
        assert after is None
        with pytest.raises(LockNotOwnedError):
            await lock.release()  # told once per acquire: then it is no longer held

    @pytest.mark.parametrize("way", WAIT_FOR_WAYS)
    async def test_a_hold_taken_in_a_wait_for_helper_goes_to_its_caller(
        self, connect: Connect, make: Make, name: str, way: str
    ) -> None:
        """Bug (contract probe, two holders): on Python 3.10/3.11 ``asyncio.wait_for`` runs its
        coroutine in a helper task. When that coroutine was not ``acquire()`` itself —
        ``stack.enter_async_context(lock)``, ``lock.__aenter__()``, a coroutine of the
        caller's around ``await lock.acquire()`` — the helper owned the hold and released it as
        it returned: the caller had ``True`` (a lease) for a lock the next task then took."""
        lock = make(connect(), name, lease=5)
        rival = make(connect(), name, lease=5)
        await assert_wait_for_hands_the_hold_up(lock, rival, way)

    async def test_a_wait_for_caller_cancelled_as_the_helper_returns_still_holds(
        self, connect: Connect, make: Make, name: str
    ) -> None:
        """Bug (attack on the hand-up above, two holders): the task awaiting ``wait_for`` was
        cancelled in the loop iteration in which the helper returned holding the lock;
        ``wait_for`` (3.10/3.11) then returns the result anyway — but the caller had left
        ``wait_for`` when the helper's end was handled, so it was not found and the hold was
        released: the caller held ``True`` for a free lock. The heir is noted when the hold
        is taken."""
        lock = make(connect(), name, lease=5)
        rival = make(connect(), name, lease=5)
        gate = asyncio.get_running_loop().create_future()
        tasks: dict[str, asyncio.Task[None]] = {}
        outcome: dict[str, object] = {}

        async def cancel_the_caller() -> None:
            await gate  # its callback was added first: it runs just before the helper's step
            tasks["caller"].cancel()

        async def take() -> bool:
            got = await lock.acquire(timeout=5)
            await gate  # the helper's last step runs in the same iteration
            return got

        async def caller() -> None:
            try:
                outcome["got"] = await asyncio.wait_for(take(), 10)
            except asyncio.CancelledError:
                outcome["got"] = "cancelled"
                return
            await asyncio.sleep(0.1)
            outcome["owned"] = lock.owned()
            outcome["rival"] = await rival.acquire(blocking=False)
            await lock.release()

        tasks["canceller"] = asyncio.create_task(cancel_the_caller())
        await asyncio.sleep(0)
        tasks["caller"] = asyncio.create_task(caller())
        await asyncio.sleep(0.3)  # the lock is taken; the helper waits at the gate
        gate.set_result(None)
        await asyncio.wait_for(asyncio.gather(*tasks.values()), 10)
        if outcome["got"] != "cancelled":  # (3.12+: the cancellation wins)
            assert outcome == {"got": True, "owned": True, "rival": False}, outcome

    async def test_a_task_of_the_application_that_ends_holding_releases_under_wait_for(
        self, connect: Connect, make: Make, name: str
    ) -> None:
        """Bug (attack on the hand-up above, a leak): a task the application created and awaited
        with ``wait_for``, which took the lock and returned something else, forgetting to
        release, handed its hold to the awaiting task — renewed for as long as that one lived.
        Only a helper that returns the lock (``True`` or its lease) hands it up."""
        lock = make(connect(), name, lease=1)
        rival = make(connect(), name, lease=1)

        async def work() -> str:
            assert await lock.acquire(timeout=5)
            return "done"

        worker = asyncio.create_task(work())
        assert await asyncio.wait_for(worker, 10) == "done"
        await asyncio.sleep(0.05)
        assert not lock.owned()
        assert await rival.acquire(timeout=5)
        await rival.release()

    async def test_guarded_entered_through_wait_for_is_cancelled_on_loss(
        self, client: aioredis.Redis, connect: Connect, make: Make, kind: str, name: str
    ) -> None:
        """Bug (attack on the hand-up above): ``wait_for(stack.enter_async_context(
        lock.guarded()))`` — the hand-up moved the hold but not the guard, so when the lease
        was lost the cancellation went to the helper that had ended, and the block ran on."""
        lock = make(connect(), name, lease=1)
        ran_on = False
        with pytest.raises(LockLostError):
            async with contextlib.AsyncExitStack() as stack:
                await asyncio.wait_for(stack.enter_async_context(lock.guarded()), 5)
                await client.delete(name)  # the lease is lost at the next renewal
                await asyncio.sleep(3)
                ran_on = True
        assert not ran_on

    @pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for runs no helper task")
    async def test_a_wait_for_helper_that_fails_holding_releases(
        self, connect: Connect, make: Make, name: str
    ) -> None:
        """The hand-over above is only for a helper that returned: one that raised after
        acquiring returned nothing to its caller, so its hold is released as before."""
        lock = make(connect(), name, lease=5)
        rival = make(connect(), name, lease=5)

        async def take_then_fail() -> None:
            assert await lock.acquire(timeout=5)
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            await asyncio.wait_for(take_then_fail(), 5)
        assert lock.current_lease is None
        assert await rival.acquire(timeout=5)
        await rival.release()

    async def test_a_grant_heard_after_its_claim_window_is_no_hold(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        make: Make,
        kind: str,
        name: str,
    ) -> None:
        """Regression (S1 chaos run, 45 µs overlap): a waiter handed the lock counted its
        claim window from the moment it *read* the grant, not from the grant. When the grant
        reached it late (a loaded machine, a paused process; here a 1 s delay), the server's
        claim had ended and the next waiter held the lock, while the late one's ``acquire``
        still returned a lease it believed valid until its confirmation came back "lost"."""
        claim = 0.3
        first = await holding(make(connect(), name, lease=10))
        late = HoldingTask(make(proxied, name, lease=10, claim_timeout=claim), timeout=4.0)
        await until(lambda: _at_least(registered(client, name, kind), 1), what="a registration")
        await asyncio.sleep(0.1)  # its reply is back
        fault_proxy.delay(1.0)  # from now on the late waiter hears everything 1 s late
        other = HoldingTask(make(connect(), name, lease=10))
        await until(lambda: _at_least(registered(client, name, kind), 2), what="the second one")
        await first.end()  # hands the lock to the late waiter, for `claim` s unless it confirms
        assert await other.wait_acquired(within=5.0) is not None  # the claim ran out: its turn
        held = await late.wait_acquired(within=8.0)
        assert held is None, (
            f"acquire returned a lease (remaining {held.remaining():.3f} s, lost={held.lost}) "
            "while another task held the lock"
        )
        await other.end()
        await late.end()


async def _handed_past_killed(
    client: aioredis.Redis,
    name: str,
    kind: str,
    make: Make,
    holder: HoldingTask,
    procs: list[asyncio.subprocess.Process],
    claim: float,
) -> None:
    """A live waiter registers behind the waiting worker ``procs`` (one registration each),
    the workers are SIGKILLed and ``holder`` releases: the live waiter must get the lock well
    within one claim window — the killed processes are skipped, not waited out."""
    live = HoldingTask(make(client, name, claim_timeout=claim), timeout=20)
    try:
        await until(
            lambda: _at_least(registered(client, name, kind), len(procs) + 1),
            what="the live waiter's registration",
        )
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        await asyncio.sleep(0.2)  # the server has dropped their connections
        loop = asyncio.get_running_loop()
        released_at = loop.time()
        await holder.end()
        assert await live.wait_acquired(within=(len(procs) + 1) * claim + 5) is not None
        waited = loop.time() - released_at
        assert waited < claim / 2, f"the live waiter waited {waited:.2f} s"
    finally:
        if not live.ended:
            await live.end()


async def _at_least(value: Awaitable[int], least: int) -> bool:
    return await value >= least


async def _acquiring(lock: Primitive) -> bool:
    return await lock.acquire()


async def _visit(lock: Primitive) -> bool:
    """Acquire ``lock`` (waiting at most 10 s) and release it at once."""
    if not await lock.acquire(timeout=10):
        return False
    await lock.release()
    return True


async def _park_reply(
    proxy: FaultProxy,
    task: asyncio.Task[None],
    k: int,
    inspector: aioredis.Redis,
    name: str,
    kind: str,
    holder: HoldingTask | None,
) -> bool:
    """With replies held at ``proxy``, deliver the first ``k`` replies ``task`` waits for and
    park the next one: ``True`` once a reply is parked, ``False`` if the task finished first.

    The holder (if any) releases once the task is registered and nothing is in flight (it
    sleeps), so that the hand-over message and its confirmation are steps of their own."""
    for delivered in range(k + 1):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        idle = 0
        while True:
            if task.done():
                return False
            if proxy.stats.bytes_pending_down > 0:
                break
            idle += 1
            if (
                idle > 5  # nothing pending for a while: the task sleeps (or the lock is free)
                and holder is not None
                and not holder.ended
                and await registered(inspector, name, kind)
            ):
                await holder.end()
            assert loop.time() < deadline, f"no reply to park after {delivered} of {k}"
            await asyncio.sleep(0.002)
        if delivered < k:
            await step(proxy)
    return True


# --------------------------------------------------------------------------------------------
# One primitive each
# --------------------------------------------------------------------------------------------


class TestFairLockOrder:
    async def test_strict_fifo_across_three_processes(
        self, spawn: Spawn, client: aioredis.Redis, name: str
    ) -> None:
        """Three processes register one after the other behind a holder; the grants follow
        that order exactly, with increasing fencing tokens."""
        holder = await holding(make_lock("fair", client, name))
        procs = []
        try:
            for i in range(3):
                proc = await spawn(name, "--kind", "fair", "wait", "--release-after", "0.05")
                assert await readline(proc) == "waiting"
                await introspect.until_registered(client, name, i + 1, within=10)
                procs.append(proc)
        finally:
            await holder.end()
        grants = []
        for i, proc in enumerate(procs):
            held = (await readline(proc)).split()
            assert held[0] == "held", held
            grants.append((int(held[2]), int(held[1]), i))  # (when, token, arrival)
            assert await readline(proc) == "released"
        grants.sort()
        assert [arrival for _, _, arrival in grants] == [0, 1, 2]
        tokens = [token for _, token, _ in grants]
        assert tokens == sorted(tokens) and len(set(tokens)) == 3


class TestReadWriteLockSides:
    async def test_readers_overlap_writers_exclude_across_processes(
        self, spawn: Spawn, name: str
    ) -> None:
        """Two reader and two writer processes contend: a write hold overlaps no other hold,
        and every hold that ended before a write began had a lower token (and every hold that
        began after it, a higher one)."""
        readers, writers = await _split(
            contend(spawn, name, ["rw-read", "rw-write"] * 2, tasks=2, rounds=8), 2
        )
        everything = readers + writers
        for write in writers:
            start, end, token = write
            for other in everything:
                if other == write:
                    continue
                assert other[1] < start or other[0] > end, f"write {token} overlaps {other[2]}"
                if other[1] < start:
                    assert other[2] < token, f"token {other[2]} before write {token}"
                else:
                    assert other[2] > token, f"token {other[2]} after write {token}"

    async def test_readers_are_inside_together_and_a_writer_alone(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Four readers on two clients are measured inside at the same time; a writer that
        asked meanwhile gets in only after the last one left, and alone."""
        clients = [connect(), connect()]
        inside = 0
        all_in = asyncio.Event()
        holds: list[tuple[str, float, float]] = []
        loop = asyncio.get_running_loop()

        async def read(i: int) -> None:
            nonlocal inside
            async with ReadWriteLock(clients[i % 2], name).read:
                start = loop.time()
                inside += 1
                if inside == 4:
                    all_in.set()
                await asyncio.wait_for(all_in.wait(), 5)
                await asyncio.sleep(0.05)
                inside -= 1
                holds.append(("r", start, loop.time()))

        async def write() -> None:
            async with ReadWriteLock(client, name).write:
                start = loop.time()
                await asyncio.sleep(0.02)
                holds.append(("w", start, loop.time()))

        readers = [asyncio.create_task(read(i)) for i in range(4)]
        await asyncio.wait_for(all_in.wait(), 5)
        writer = asyncio.create_task(write())
        await asyncio.wait_for(asyncio.gather(*readers, writer), 10)
        ((_, w_start, w_end),) = [h for h in holds if h[0] == "w"]
        for side, start, end in holds:
            if side == "r":
                assert end <= w_start or start >= w_end, "a reader was inside with the writer"

    @pytest.mark.parametrize("prefer_writers", [True, False])
    async def test_writer_not_starved_by_a_stream_of_readers(
        self, connect: Connect, client: aioredis.Redis, name: str, prefer_writers: bool
    ) -> None:
        """Readers keep arriving (one every 20 ms, each inside for 80 ms: never a moment
        without one). With writer preference (default) a writer gets in within 2 s while the
        stream goes on; without it, it does not get in at all (the contrast shows the stream
        would starve it)."""
        clients = [connect(), connect()]
        stop = asyncio.Event()
        readers: set[asyncio.Task[None]] = set()
        arrived = 0

        async def read(i: int) -> None:
            async with ReadWriteLock(clients[i % 2], name, prefer_writers=prefer_writers).read:
                await asyncio.sleep(0.08)

        async def stream() -> None:
            nonlocal arrived
            for i in itertools.count():
                if stop.is_set():
                    return
                readers.add(asyncio.create_task(read(i)))
                arrived += 1
                await asyncio.sleep(0.02)

        feeder = asyncio.create_task(stream())
        writer = ReadWriteLock(client, name, prefer_writers=prefer_writers).write
        try:
            await asyncio.sleep(0.2)  # the stream is flowing
            before = arrived
            got = await writer.acquire(timeout=2.0 if prefer_writers else 0.6)
            assert arrived > before  # readers kept arriving while the writer waited
            if prefer_writers:
                assert got, "the writer starved behind the readers"
                await writer.release()
            else:
                assert not got, "no moment without a reader, yet the writer got in"
        finally:
            stop.set()
            await finish(feeder, 2, "reader stream")
            done, _ = await asyncio.wait(readers, timeout=10)
            assert len(done) == len(readers)
            for task in readers:
                task.result()


class TestSemaphorePeak:
    async def test_peak_concurrency_is_exactly_n(self, connect: Connect, name: str) -> None:
        """Semaphore(3): 15 tasks on 3 clients; each, once inside, waits (at most 0.5 s) for
        the count inside to reach 3. The measured peak is 3 — never more, and reached."""
        permits = 3
        clients = [connect() for _ in range(3)]
        inside = top = 0
        changed = asyncio.Condition()

        async def worker(i: int) -> None:
            nonlocal inside, top
            async with Semaphore(clients[i % 3], name, permits):
                async with changed:
                    inside += 1
                    top = max(top, inside)
                    changed.notify_all()
                    # (the last few tasks time out: nobody is left to fill the permits)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(changed.wait_for(lambda: inside >= permits), 0.5)
                await asyncio.sleep(0.01)
                async with changed:
                    inside -= 1

        await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(15))), 20)
        assert top == permits

    async def test_peak_across_processes_never_exceeds_n(self, spawn: Spawn, name: str) -> None:
        """Semaphore(3) in 3 processes x 3 tasks: at no moment more than 3 holds, and every
        acquisition has a token of its own."""
        holds = await contend(spawn, name, ["sem"] * 3, tasks=3, rounds=6, permits="3")
        flat = list(itertools.chain.from_iterable(holds))
        assert peak(flat) <= 3
        assert len({token for _, _, token in flat}) == len(flat)


async def _split(holds: Awaitable[list[list[Hold]]], period: int) -> tuple[list[Hold], list[Hold]]:
    """The holds of workers started as ``[reader, writer] * n``: (reader holds, writer holds)."""
    per_worker = await holds
    readers = [h for i, w in enumerate(per_worker) if i % period == 0 for h in w]
    writers = [h for i, w in enumerate(per_worker) if i % period == 1 for h in w]
    return readers, writers


# --------------------------------------------------------------------------------------------
# Found by these tests
# --------------------------------------------------------------------------------------------


def _start_now(coro: Coroutine[Any, Any, _T]) -> asyncio.Future[_T]:
    """Run ``coro`` up to its first suspension right now, synchronously (what an eager task
    does on Python 3.12+), then let it go on in a task."""
    loop = asyncio.get_running_loop()
    try:
        first = coro.send(None)
    except StopIteration as stop:
        done: asyncio.Future[_T] = loop.create_future()
        done.set_result(stop.value)
        return done

    async def rest(pending: Any) -> _T:
        while True:
            if pending is None:  # a bare yield (asyncio.sleep(0))
                await asyncio.sleep(0)
            else:
                pending._asyncio_future_blocking = False
                await asyncio.wait((pending,))
            try:
                pending = coro.send(None)
            except StopIteration as stop:
                result: _T = stop.value
                return result

    return asyncio.ensure_future(rest(first))


def _runs(task: asyncio.Task[Any], qualname: str) -> bool:
    return getattr(task.get_coro(), "__qualname__", "") == qualname


class TestFoundHere:
    @pytest.mark.skipif(
        sys.version_info >= (3, 12), reason="wait_for swallows a cancellation on <= 3.11 only"
    )
    async def test_close_as_a_renewal_reply_arrives_is_prompt(
        self, connect: Connect, name: str
    ) -> None:
        """Regression (closing a client took 10 s): ``aclose()`` cancels the lease keeper;
        when the cancellation landed as the keeper's renewal reply arrived, Python <= 3.11's
        ``asyncio.wait_for`` swallowed it, and the keeper lingered for its idle time (10 s)
        before it noticed the close. Seen in ``test_no_leaked_keys_or_tasks`` teardowns."""
        conn = connect()
        lock = Lock(conn, name, lease=0.3)  # renewed every 0.1 s
        assert await lock.acquire()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        renewal: list[asyncio.Task[Any]] = []
        while not renewal:  # a renewal round trip in flight (wait_for's inner task)
            assert loop.time() < deadline, "no renewal seen"
            await asyncio.sleep(0)
            renewal = [t for t in asyncio.all_tasks() if _runs(t, "run_pipeline")]
        closing: list[asyncio.Future[None]] = []
        # Runs right after wait_for learnt of the reply, before the keeper resumes: the close
        # cancels the keeper exactly then.
        renewal[0].add_done_callback(lambda _: closing.append(_start_now(conn.aclose())))
        await until(lambda: closing, what="the reply")
        started = loop.time()
        await asyncio.wait_for(closing[0], 15)
        took = loop.time() - started
        assert took < 3.0, f"aclose() took {took:.1f} s"
        assert not introspect.background_tasks(conn)
