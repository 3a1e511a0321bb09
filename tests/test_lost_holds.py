"""What a task can do with a hold it lost: every release says "lost", a new acquire is fresh.

Found by a contract probe written from SPEC §3/§4 alone ("then the lease is lost: `release()`
raises `LockLostError`"; `acquire()` returns a bool); and, on the way, a Semaphore permit leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import MaxConnectionsError

from redis_locks_async import FairLock, Lock, LockError, LockLostError, LockNotOwnedError, Semaphore
from redis_locks_async import _renewal as renewal
from redis_locks_async._lock import LOCK_REENTER, LOCK_RENEW
from tests import _introspect as introspect
from tests._lockworker import make_lock
from tests.faultproxy import FaultProxy
from tests.test_lock_faults import HoldingTask, rival_takes

KINDS = [Lock, FairLock]


async def _lose(lock: Lock | FairLock, client: aioredis.Redis, name: str) -> None:
    """The calling task takes ``lock`` and loses it (the key deleted behind its back)."""
    assert await lock.acquire(blocking=False)
    await client.delete(name)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
class TestLost:
    async def test_release_after_extend_reported_the_loss(
        self, kind: type[Lock], client: aioredis.Redis, name: str
    ) -> None:
        """Regression (an ``extend()`` that found the hold lost forgot it, so the
        ``release()`` in the caller's ``finally`` raised ``LockNotOwnedError`` ("not held by
        this task") and replaced the ``LockLostError`` a handler was waiting for)."""
        lock = kind(client, name, lease=30.0)
        await _lose(lock, client, name)
        with pytest.raises(LockLostError):
            await lock.extend()
        with pytest.raises(LockLostError):
            await lock.release()
        with pytest.raises(LockNotOwnedError) as raised:
            await lock.release()  # once per acquire
        assert not isinstance(raised.value, LockLostError)

    async def test_every_release_of_a_nested_lost_hold_says_lost(
        self, kind: type[Lock], client: aioredis.Redis, name: str
    ) -> None:
        """Regression (a re-entry that found the hold lost forgot it: the inner release, then
        the outer one, raised ``LockNotOwnedError``). Each release, inner and outer, raises
        ``LockLostError``; then the task holds nothing."""
        lock = kind(client, name, lease=30.0)
        assert await lock.acquire(blocking=False)
        assert await lock.acquire(blocking=False)  # hold count 2
        await client.delete(name)
        with pytest.raises(LockLostError):
            await lock.acquire(blocking=False)  # the re-entry finds it gone
        for _ in range(2):
            with pytest.raises(LockLostError):
                await lock.release()
        assert lock.current_lease is None
        with pytest.raises(LockNotOwnedError):
            await lock.release()

    async def test_every_release_after_an_inner_release_found_the_loss_says_lost(
        self, kind: type[Lock], client: aioredis.Redis, name: str
    ) -> None:
        """Regression (contract probe, S6: an inner release that was the first to find the
        hold lost on the server forgot the whole hold, so the outer releases raised
        ``LockNotOwnedError`` — "not held" — instead of ``LockLostError``)."""
        lock = kind(client, name, lease=30.0)
        for _ in range(3):
            assert await lock.acquire(blocking=False)  # hold count 3
        await client.delete(name)  # renewal has not noticed yet
        for _ in range(3):
            with pytest.raises(LockLostError):
                await lock.release()
        assert lock.current_lease is None
        with pytest.raises(LockNotOwnedError):
            await lock.release()

    async def test_acquire_after_a_signalled_loss_is_fresh(
        self, kind: type[Lock], client: aioredis.Redis, name: str
    ) -> None:
        """Regression (the task's next ``acquire()`` after its lease expired raised
        ``LockLostError`` "cannot re-enter", once, though the lock was free on the server —
        ``acquire()`` returns a bool). A loss already signalled (``lease.lost``,
        ``on_lost``) is not re-entered: the task acquires afresh, with a new token, and the
        lost hold still answers its own release with ``LockLostError``."""
        lock = kind(client, name, lease=0.2, auto_renew=False)
        assert await lock.acquire()
        first = lock.current_lease
        assert first is not None
        await asyncio.wait_for(first.wait_lost(), 2.0)
        assert await lock.acquire(timeout=1.0)
        second = lock.current_lease
        assert second is not None and second is not first
        assert not second.lost and second.hold_count == 1
        assert second.fencing_token > first.fencing_token
        assert await client.exists(name)
        await lock.release()  # the fresh hold
        assert not await client.exists(name)
        with pytest.raises(LockLostError):
            await lock.release()  # the lost one underneath
        assert introspect.keeper_size(client) == 0


async def test_task_ending_with_two_permits_returns_both(client: aioredis.Redis, name: str) -> None:
    """Regression (a task that ended holding two permits of a ``Semaphore`` had only the
    last one released: the earlier permit, waiting underneath, was left to the lease keeper,
    which renewed it for as long as the process lived — a permit gone for good)."""
    sem = Semaphore(client, name, 3, lease=30.0)

    async def take_two() -> None:
        await sem.acquire()
        await sem.acquire()

    await asyncio.create_task(take_two())
    await _until_free(sem, 3)
    assert introspect.keeper_size(client) == 0


async def test_task_ending_while_releasing_returns_the_permit_underneath(
    fault_proxy: FaultProxy, proxied: aioredis.Redis, name: str
) -> None:
    """Regression (an attack on the fix above): a task that held two permits, gave its
    ``release()`` a time limit (``wait_for``: the release goes on in the background) and
    returned left the permit underneath held for good — the top permit's end-of-task callback
    saw the release in flight and left the rest to it, and the release only ever finished its
    own permit. The release in flight now hands the rest to the task's end."""
    sem = Semaphore(proxied, name, 3, lease=2.0)

    async def worker() -> None:
        await sem.acquire()
        await sem.acquire()
        fault_proxy.delay(0.3)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(sem.release(), 0.1)

    await asyncio.create_task(worker())
    await asyncio.sleep(0.5)
    fault_proxy.heal()
    await _until_free(sem, 3)
    assert introspect.keeper_size(proxied) == 0


async def test_a_permit_released_under_another_leaves_the_stack(
    fault_proxy: FaultProxy, proxied: aioredis.Redis, name: str
) -> None:
    """Regression (same attack): a permit whose release finished while the task already held
    a newer one stayed linked under it. Releasing the newer one brought the released permit
    back as the task's hold, so the next ``release()`` released it again (a spurious
    ``LockLostError``) instead of the task's oldest permit — and a task ending there left
    that oldest permit renewed for good."""
    sem = Semaphore(proxied, name, 3, lease=30.0)
    outcome: list[str] = []

    async def worker() -> None:
        await sem.acquire()  # P1
        await sem.acquire()  # P2
        fault_proxy.delay(0.2)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(sem.release(), 0.05)  # P2's release goes on in the background
        await sem.acquire()  # P3, on top of P2 while P2's release is in flight
        fault_proxy.heal()
        await asyncio.sleep(0.3)  # P2's release is done
        await sem.release()  # P3
        await sem.release()  # P1 (was: P2 again)
        outcome.append("released both")

    await asyncio.create_task(worker())
    assert outcome == ["released both"]
    await _until_free(sem, 3)
    assert introspect.keeper_size(proxied) == 0


async def test_transfer_to_a_task_whose_hold_was_lost(client: aioredis.Redis, name: str) -> None:
    """Regression (same attack): ``transfer()`` refused a target task whose only hold of the
    lock was lost ("already holds it"), though that task's own ``acquire()`` would be a fresh
    acquisition. The hold is handed over, on top of the lost one."""
    lock = Lock(client, name, lease=30.0)
    lost_it = asyncio.Event()
    go = asyncio.Event()
    outcome: list[str] = []

    async def worker() -> None:
        await _lose(lock, client, name)
        with contextlib.suppress(LockLostError):
            await lock.extend()  # the loss, reported
        lost_it.set()
        await go.wait()
        await lock.release()  # the hold handed over
        try:
            await lock.release()
        except LockLostError:
            outcome.append("lost")  # then its own, lost

    task = asyncio.create_task(worker())
    await lost_it.wait()
    assert await lock.acquire(blocking=False)
    lock.transfer(task)
    go.set()
    await task
    assert outcome == ["lost"]
    assert not await client.exists(name)


async def _until_free(sem: Semaphore, permits: int) -> None:
    for _ in range(300):
        if await sem.free_permits() == permits:
            return
        await asyncio.sleep(0.01)
    assert await sem.free_permits() == permits


async def test_owned_is_false_once_the_task_gave_its_hold_up(
    fault_proxy: FaultProxy, proxied: aioredis.Redis, name: str
) -> None:
    """Regression (contract probe of the anyio examples): after a cancel scope ended an
    ``async with`` — or a ``release()`` was cut short — the release goes on in the background,
    and ``owned()`` said True meanwhile, while ``release()`` said "not held by this task"."""
    lock = Lock(proxied, name)
    assert await lock.acquire(blocking=False)
    fault_proxy.delay(0.3)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(lock.release(), 0.05)
    assert not lock.owned()  # given up, its confirmation still on the way
    fault_proxy.heal()


async def test_loss_is_signalled_by_the_lease_end_while_a_renewal_is_unanswered(
    proxied: aioredis.Redis, fault_proxy: FaultProxy, client: aioredis.Redis, name: str
) -> None:
    """A lease whose renewals go unanswered is told lost (``on_lost``, the ``guarded()`` block
    cancelled) before another client can take the lock. (The RedLock case, where it was not:
    ``test_redlock.py::test_loss_is_signalled_before_a_rival_gets_in``.)"""
    loop = asyncio.get_running_loop()
    lost_at: list[float] = []
    lock = Lock(proxied, name, lease=0.5, on_lost=lambda _: lost_at.append(loop.time()))
    rival = Lock(client, name, lease=5.0)
    with pytest.raises(LockLostError):
        async with lock.guarded():
            fault_proxy.blackhole()  # every renewal from now on goes unanswered
            taking = asyncio.create_task(rival_takes(rival, loop.time() + 3.0))
            await asyncio.sleep(10)  # cancelled when the loss is signalled
    block_ended_at = loop.time()
    taken_at = await taking
    fault_proxy.heal()
    assert taken_at is not None, "the lease never ended on the server"
    assert lost_at and lost_at[0] <= taken_at, "another client got in before the loss was told"
    assert block_ended_at <= taken_at, "the guarded block ran beside another holder"


async def test_extend_that_failed_after_its_shorter_lease_ended_reports_the_loss(
    proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str
) -> None:
    """Regression (an ``extend(shorter)`` whose reply was lost raised a plain ``LockError``:
    the hold counted on the shorter lease it may have set, which had already ended —
    ``remaining()`` said 0 — yet the lease was not marked lost, so ``guarded()`` blocks went on
    and ``on_lost`` was never called). It raises ``LockLostError`` and marks the lease lost."""
    lost: list[object] = []
    lock = Lock(proxied, name, lease=30.0, on_lost=lost.append)
    held = asyncio.Event()

    async def holder() -> None:
        assert await lock.acquire()
        held.set()
        await asyncio.sleep(0.05)  # the test holds the replies
        try:
            with pytest.raises(LockLostError):
                await lock.extend(0.05)
            assert lock.current_lease is not None and lock.current_lease.lost and lost
        finally:
            fault_proxy.heal()
            with pytest.raises(LockLostError):
                await lock.release()

    task = asyncio.create_task(holder())
    await held.wait()
    fault_proxy.hold_replies()
    await fault_proxy.wait_held()  # the extend ran: the server's lease is now 50 ms
    await asyncio.sleep(0.1)
    fault_proxy.lose_held()  # its reply is lost with a connection error
    await task


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
async def test_reentry_under_a_silent_server_keeps_to_the_timeout(
    kind: type[Lock], proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str
) -> None:
    """Regression (a re-entry was not bounded by ``acquire(timeout=t)``: with the server
    silent, the holding task's ``acquire(timeout=1)`` was still blocked after 40 s, though
    SPEC §4 says every ``acquire(timeout=t)`` returns within about ``t`` whatever the network
    does). It returns ``False`` at the timeout, the hold intact."""
    lock = kind(proxied, name, lease=30.0)
    assert await lock.acquire()
    loop = asyncio.get_running_loop()
    fault_proxy.blackhole()
    started = loop.time()
    try:
        assert await lock.acquire(timeout=0.5) is False
        assert loop.time() - started < 1.5
        lease = lock.current_lease
        assert lease is not None and not lease.lost and lease.hold_count == 1
        assert lock.statistics().timeouts == 1
    finally:
        fault_proxy.heal()
    await lock.release()
    assert not await lock.locked()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
async def test_reentry_without_timeout_under_a_silent_server_ends_with_the_lease(
    kind: type[Lock], proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str
) -> None:
    """Regression (the same unbounded re-entry, without a timeout: it waited for the silent
    server forever, past the end of the lease it was re-entering). It raises
    ``LockLostError`` when the lease ends."""
    lock = kind(proxied, name, lease=0.6)
    assert await lock.acquire()
    loop = asyncio.get_running_loop()
    fault_proxy.blackhole()
    started = loop.time()
    try:
        with pytest.raises(LockLostError):
            await lock.acquire(timeout=None)
        assert loop.time() - started < 0.6 + 0.5
    finally:
        fault_proxy.heal()
    with pytest.raises(LockLostError):
        await lock.release()


async def test_extend_answered_after_the_lease_ended_reports_the_loss(
    proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str
) -> None:
    """Regression (an ``extend()`` whose answer came after the lease's end returned normally,
    though the loss had been signalled meanwhile — ``on_lost`` called, ``lost`` true — and the
    server kept the key for the new lease, for an owner the library treated as gone). It
    raises ``LockLostError``; the release gives the key up."""
    lost: list[object] = []
    lock = Lock(proxied, name, lease=0.5, auto_renew=False, on_lost=lost.append)
    assert await lock.acquire()
    lease = lock.current_lease
    assert lease is not None
    await asyncio.sleep(max(0.0, lease.remaining() - 0.02))
    fault_proxy.delay(0.06)  # the answer comes after the lease's end
    try:
        with pytest.raises(LockLostError):
            await lock.extend(10.0)
        assert lease.lost and lost
    finally:
        fault_proxy.heal()
    with pytest.raises(LockLostError):
        await lock.release()
    await introspect.drain(proxied)
    assert not await lock.locked()


async def test_keeper_and_watchdog_do_not_outlive_the_last_hold(
    client: aioredis.Redis, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (after the last hold of a long lease was released, the lease keeper's task
    slept until that hold's next renewal — up to lease/3 — and the expiry watchdog's timer
    stayed armed for the whole lease). Both go within the keeper's idle linger."""
    from redis_locks_async import _renewal

    monkeypatch.setattr(_renewal, "_IDLE_LINGER", 0.2)
    lock = Lock(client, name, lease=3600.0)
    assert await lock.acquire()
    await asyncio.sleep(0)  # (the keeper gets the hold at the loop's next iteration)
    keeper = introspect.keeper(client)
    assert keeper.task is not None
    await lock.release()
    assert keeper.watchdog is None
    task = keeper.task
    assert task is not None
    await asyncio.wait_for(task, 2.0)
    assert keeper.task is None


async def test_a_lease_without_renewal_never_wakes_the_keeper(
    client: aioredis.Redis, name: str
) -> None:
    """Hot path (B1 with ``auto_renew=False``): each acquisition of a lease that is not renewed
    woke the keeper's task twice (its expiry to sleep until, then the release to linger again):
    two ``asyncio.wait`` and two event-loop iterations per cycle for nothing, the watchdog's
    timer marking such a lease lost by itself. The keeper now sleeps through them, and the
    lease is still lost on time."""
    lock = Lock(client, name, lease=30.0, auto_renew=False)
    assert await lock.acquire()
    await asyncio.sleep(0)  # (the keeper gets the hold at the loop's next iteration)
    keeper = introspect.keeper(client)
    task = keeper.task
    assert task is not None
    await lock.release()
    await asyncio.sleep(0.01)
    kick = keeper._kick
    assert kick is not None and not kick.done()
    for _ in range(20):
        assert await lock.acquire()
        await lock.release()
    assert keeper._kick is kick and not kick.done(), "the keeper was woken"
    assert keeper.task is task
    lost = asyncio.Event()
    short = Lock(client, name, lease=0.3, auto_renew=False, on_lost=lambda _: lost.set())
    assert await short.acquire()
    await asyncio.wait_for(lost.wait(), 2.0)
    with pytest.raises(LockLostError):
        await short.release()


async def test_a_last_hold_lost_by_the_watchdog_ends_the_keeper(
    client: aioredis.Redis, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (attack pass, stop 22): the keeper sleeping until the renewal of a hold
    released since (lease 3600 s: 20 minutes away) was not woken when the watchdog lost the
    last hold left, one not renewed: its task outlived every hold by a third of that lease.
    It lingers no longer than ``_IDLE_LINGER`` now."""
    monkeypatch.setattr(renewal, "_IDLE_LINGER", 0.2)
    renewed = Lock(client, name, lease=3600.0)
    assert await renewed.acquire()
    short = Lock(client, name + ":short", lease=0.3, auto_renew=False)
    assert await short.acquire()
    task = introspect.keeper(client).task
    assert task is not None
    await renewed.release()
    await asyncio.wait((task,), timeout=3.0)
    assert task.done(), "the keeper outlived its last hold"
    assert not short.owned()
    with pytest.raises(LockLostError):
        await short.release()


def _slow_replies(client: aioredis.Redis, sha: str, delay: float) -> None:
    """Run ``client``'s direct calls of script ``sha`` on the server, then hold their reply
    back ``delay`` s (the lease keeper's pipelined renewals go through untouched)."""
    real = client.evalsha

    async def slow(script: str, numkeys: int, *rest: Any) -> object:
        reply = await real(script, numkeys, *rest)
        if script == sha:
            await asyncio.sleep(delay)
        return reply

    client.evalsha = slow  # type: ignore[method-assign,assignment]


async def _late_in_the_period(lease: Any, below: float) -> float:
    """Wait until ``lease`` has less than ``below`` s left (renewals keep it above lease·2/3);
    what is left then."""
    while lease.remaining() >= below:  # noqa: ASYNC110 - a renewal may come meanwhile
        await asyncio.sleep(0.01)
    return float(lease.remaining())


LEASE = 1.5  # renewed every 0.5 s: 1.0 to 1.5 s left at any time


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
async def test_slow_extend_while_renewals_go_on_is_not_a_loss(
    kind: type[Lock], connect: Any, name: str
) -> None:
    """Regression (an attack pass: ``extend()`` waited for its answer until the lease's end
    *as known when it was sent*; its answer came after that — but within the lease it set —
    while the lease keeper renewed the hold, yet the hold was marked lost at that moment:
    ``on_lost`` called, ``LockLostError``, the server holding it for a full lease). The wait
    follows the lease: the extend succeeds."""
    client = await connect()
    lost: list[object] = []
    lock = kind(client, name, lease=LEASE, on_lost=lost.append)
    assert await lock.acquire()
    lease = lock.current_lease
    assert lease is not None
    left = await _late_in_the_period(lease, 1.2)
    _slow_replies(client, LOCK_RENEW.sha, left + 0.15)  # past the end known at the send
    try:
        await lock.extend()
    finally:
        del client.evalsha
    assert not lease.lost and not lost
    assert await lock.locked()
    await lock.release()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
async def test_slow_reentry_without_timeout_is_not_a_timeout(
    kind: type[Lock], connect: Any, name: str
) -> None:
    """Regression (an attack pass: a re-entry whose answer came after the lease's end as known
    when it was sent — the keeper renewing the hold meanwhile — made ``acquire(timeout=None)``
    return ``False``, and ``acquire(timeout=60)`` give up after about a second)."""
    client = await connect()
    lock = kind(client, name, lease=LEASE)
    assert await lock.acquire()
    lease = lock.current_lease
    assert lease is not None
    for timeout in (None, 60.0):
        left = await _late_in_the_period(lease, 1.2)
        _slow_replies(client, LOCK_REENTER.sha, left + 0.15)
        try:
            assert await lock.acquire(timeout=timeout) is True
        finally:
            del client.evalsha
    assert lease.hold_count == 3 and not lease.lost
    for _ in range(3):
        await lock.release()
    assert not await lock.locked()


async def test_cancelling_a_reentry_under_a_silent_server_is_prompt(
    proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str
) -> None:
    """Regression (an attack pass, Python 3.11: redis-py's ``wait_for`` around the socket
    write swallowed a cancellation that landed as the write finished; the re-entry then
    waited for a reply that never came, until its bound — the lease's end with
    ``timeout=None``). The re-entry runs in a job task the caller merely awaits."""
    lock = Lock(proxied, name, lease=3.0)
    loop = asyncio.get_running_loop()
    outcome: list[float] = []

    async def holder() -> None:
        assert await lock.acquire()
        fault_proxy.hold_replies()
        me = asyncio.current_task()
        assert me is not None
        loop.call_soon(me.cancel)  # lands at the re-entry's first await
        started = loop.time()
        try:
            await lock.acquire(timeout=None)
        except asyncio.CancelledError:
            outcome.append(loop.time() - started)
            if hasattr(me, "uncancel"):
                me.uncancel()
        fault_proxy.heal()
        lease = lock.current_lease
        assert lease is not None and lease.hold_count == 1
        await lock.release()

    await asyncio.create_task(holder())
    assert outcome and outcome[0] < 0.5, outcome
    await introspect.drain(proxied)
    assert not await lock.locked()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
async def test_shorter_extend_in_flight_keeps_rivals_out(
    kind: type[Lock], connect: Any, name: str
) -> None:
    """Regression (an attack pass: while ``extend(0.3)`` of a 30 s hold waited for a late
    answer, the hold still counted on the 30 s lease and nobody renewed the 0.3 s one the
    server already had: a rival took the lock at +0.3 s while the holder's ``remaining()``
    said 29 s and ``guarded()`` ran on). A shorter lease counts from the send — renewed at its
    pace — and an answer that does not come within it is an error, the lease going on."""
    client, rival_client = await connect(), await connect()
    lost: list[object] = []
    lock = kind(client, name, lease=30.0, on_lost=lost.append)
    rival = kind(rival_client, name, lease=5.0)
    assert await lock.acquire()
    lease = lock.current_lease
    assert lease is not None
    _slow_replies(client, LOCK_RENEW.sha, 1.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(LockError, match="no answer") as raised:
            await lock.extend(0.3)
        assert not isinstance(raised.value, LockLostError)
        assert loop.time() - started < 0.3 + 0.3
        while loop.time() - started < 1.3:  # past the late answer: nobody else got in
            assert not await rival.acquire(blocking=False)
            assert lease.remaining() <= 0.3
            await asyncio.sleep(0.02)
    finally:
        del client.evalsha
    assert not lease.lost and not lost
    await lock.release()
    assert await rival.acquire(blocking=False)
    await rival.release()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
async def test_extend_answered_after_its_own_lease_is_an_error_not_a_loss(
    kind: type[Lock], connect: Any, name: str
) -> None:
    """Regression (an attack pass: an ``extend()`` answered after the lease it set — a
    half-open connection, redis-py's retry re-sending it after its socket timeout — marked
    the hold lost and gave the key up, though the keeper had renewed it all along; and with no
    socket timeout, an ``extend()`` that never got an answer waited forever). It ends when
    the lease it sets does, with a ``LockError``; the hold goes on."""
    client = await connect()
    lost: list[object] = []
    lock = kind(client, name, lease=LEASE, on_lost=lost.append)
    assert await lock.acquire()
    lease = lock.current_lease
    assert lease is not None
    _slow_replies(client, LOCK_RENEW.sha, LEASE + 0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(LockError, match="no answer") as raised:
            await lock.extend()
        assert not isinstance(raised.value, LockLostError)
        assert loop.time() - started < LEASE + 0.3
    finally:
        del client.evalsha
    assert not lease.lost and not lost and lock.owned()
    assert await lock.locked()
    await lock.release()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
async def test_a_shorter_setting_given_up_on_may_land_late(
    kind: type[Lock], connect: Any, name: str
) -> None:
    """Regression (an attack pass: an ``extend(2)`` given up on — no answer within its lease —
    was still on the wire; a confirmed ``extend(30)`` made the hold count on 30 s, renewed
    every 10 s, then the stale command landed and set the server's lease to 2 s: a rival took
    the lock while the holder's ``remaining()`` said 28 s). A shorter setting given up on is
    counted on, and renewed at its pace, for the rest of the hold."""
    client, rival_client = await connect(), await connect()
    lock = kind(client, name, lease=30.0)
    rival = kind(rival_client, name, lease=5.0)
    assert await lock.acquire()
    loop = asyncio.get_running_loop()
    real = client.evalsha
    late: list[asyncio.Task[object]] = []

    async def stalled(script: str, numkeys: int, *rest: Any) -> object:
        # rest: the lock's key, then owner, lease ms[, channel, sharded]
        if script == LOCK_RENEW.sha and str(rest[numkeys + 1]) == "2000" and not late:
            # On the wire, not answered: it reaches the server 2.5 s from now.
            async def lands() -> object:
                await asyncio.sleep(2.5)
                return await real(script, numkeys, *rest)

            late.append(loop.create_task(lands()))
            await asyncio.sleep(3600)
        return await real(script, numkeys, *rest)

    client.evalsha = stalled
    try:
        with pytest.raises(LockError, match="no answer"):
            await lock.extend(2.0)
        await lock.extend(30.0)  # confirmed
    finally:
        del client.evalsha
    await late[0]  # the stale 2 s lease has landed
    until = loop.time() + 3.0
    while loop.time() < until:  # past its end: nobody else got in
        assert not await rival.acquire(blocking=False)
        await asyncio.sleep(0.05)
    lease = lock.current_lease
    assert lease is not None and not lease.lost
    await lock.release()


async def test_an_extend_with_no_free_connection_changes_nothing(connect: Any, name: str) -> None:
    """Regression (attack pass: ``extend(1)`` of a 6 s hold failed with "Too many connections"
    — nothing was sent — yet the hold counted on the 1 s lease from then on; the pool still
    busy, the keeper could not renew it, and the hold was signalled lost after 1 s while the
    server's lease had 5 s to go). An extend that was never sent changes nothing."""
    client = await connect(max_connections=2)
    lock = Lock(client, name, lease=6.0)
    assert await lock.acquire()
    lease = lock.current_lease
    assert lease is not None
    await introspect.retire_lane(client)  # (a lane would carry the extend: test_lane)
    busy = [asyncio.create_task(client.blpop(f"{name}:nothing", 2)) for _ in range(2)]
    await asyncio.sleep(0.2)  # both connections wait in BLPOP
    with pytest.raises(LockError, match=r"(?i)connections"):
        await lock.extend(1.0)
    assert lease.lease == 6.0
    await asyncio.gather(*busy)
    await asyncio.sleep(0.5)
    assert not lease.lost
    assert lease.remaining() > 3.0
    await lock.release()


async def test_a_renewal_with_no_free_connection_never_crosses_an_extend(
    connect: Any, name: str
) -> None:
    """Regression (CI, 1 run in 5: the keeper sent a renewal of the 1 s lease an extend had
    just set, the pool was full, and the extend failed the same way and was put back — then
    the renewal's "no free connection" was judged as a renewal that crossed the extend and
    may have run, and the hold counted on the 1 s lease nobody had sent: lost after 1 s, the
    server's lease 5 s from its end). A renewal that was never sent changes nothing."""
    client = await connect()
    lock = Lock(client, name, lease=6.0)
    assert await lock.acquire()
    lease = lock.current_lease
    assert lease is not None
    introspect.judge_renewal(client, lease, MaxConnectionsError("Too many connections"), 1.0)
    assert lease.remaining() > 5.0
    await asyncio.sleep(1.2)
    assert not lease.lost
    await lock.release()


@pytest.mark.parametrize("kind", [Lock, FairLock, Semaphore], ids=lambda k: k.__name__)
async def test_a_loss_signalled_while_the_release_is_in_flight_stands(
    proxied: aioredis.Redis, fault_proxy: FaultProxy, name: str, kind: type[Any]
) -> None:
    """Bug (helper-62): a release whose answer was held back past the lease's end — its
    renewal meanwhile unanswered too, so the loss was signalled (``on_lost`` called,
    ``lease.lost`` true) — then gave up with a plain ``LockError`` ("cannot confirm the
    release … it is retried in the background") and set the hold back to released:
    ``lease.lost`` read False again. The loss stands now, and the release says so."""
    lost: list[object] = []
    lock = (
        Semaphore(proxied, name, 2, lease=0.6, on_lost=lost.append)
        if kind is Semaphore
        else kind(proxied, name, lease=0.6, on_lost=lost.append)
    )
    assert await lock.acquire()
    lease = lock.current_lease
    assert lease is not None
    fault_proxy.hold_replies()
    try:
        with pytest.raises(LockLostError, match="lost while the release was in flight"):
            await lock.release()
    finally:
        fault_proxy.release_replies()
    assert lost == [lease]
    assert lease.lost
    assert lock.current_lease is None and not lock.owned()
    await introspect.drain(proxied)
    assert not await lock.locked()


@pytest.mark.parametrize("kind", ["lock", "fair", "rw-write", "sem"])
async def test_the_loss_is_signalled_while_the_server_still_has_the_lock(
    client: aioredis.Redis, name: str, kind: str
) -> None:
    """Bug (helper-72): on one server the loss was signalled at the very end of the lease as
    the client counts it (the renewal's send + the lease), a millisecond or two before the
    server's — so ordinary event-loop lag at that moment ran ``on_lost`` after a rival's
    acquire had returned. The local end is kept ``lease·0.01 + 2 ms`` short of the server's
    now (as for RedLock): when ``on_lost`` runs, the server still has the hold and a rival
    cannot take it yet."""
    seen: list[bool] = []
    done = asyncio.Event()

    async def on_lost(_: object) -> None:
        rival = make_lock(kind, client, name)
        seen.append(await rival.acquire(blocking=False))
        done.set()
        if seen[-1]:
            await rival.release()

    lock = make_lock(kind, client, name, lease=3.0, auto_renew=False, on_lost=on_lost)
    assert await lock.acquire()
    await asyncio.wait_for(done.wait(), 6)
    assert seen == [False]  # (the rival's try came while the server still had the lock)
    with pytest.raises(LockLostError):
        await lock.release()


@pytest.mark.parametrize(("lease", "claim"), [(300.0, 2.0), (5.0, 0.05)])
@pytest.mark.parametrize("kind", ["lock", "fair", "rw-write", "sem"])
async def test_a_hand_over_is_taken_whatever_the_lease(
    client: aioredis.Redis,
    name: str,
    kind: str,
    lease: float,
    claim: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bug (helper-75, a regression of the margin above): the margin was computed from the
    lock's lease, not from what the server granted — a hand-over's claim window
    (``claim_timeout``) is far shorter: with ``lease=300`` (margin 3 s) and the default
    2 s window every grant was judged "answered after the lease it gave had ended", given up
    and passed on round the line — no waiter ever got the lock, thousands of warnings."""
    holder = make_lock(kind, client, name, lease=lease, claim_timeout=claim)
    other = make_lock(kind, client, name, lease=lease, claim_timeout=claim)
    assert await holder.acquire()
    waiter = HoldingTask(other, timeout=3.0)
    await asyncio.sleep(0.3)  # (waiting, registered)
    with caplog.at_level(logging.WARNING, logger="redis_locks_async"):
        await holder.release()
        assert await waiter.wait_acquired(within=5.0) is not None
        await waiter.end()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
