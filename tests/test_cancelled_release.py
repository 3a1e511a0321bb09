"""A release cancelled after its command ran, then another owner in between: not a loss.

Found by ``examples/anyio_tasks.py``: ``anyio.move_on_after`` around ``async with lock:`` whose
body overruns cancels the body and then, anyio's cancellation being level-triggered, the
release in ``__aexit__`` as well. The release is then re-sent in the background (releases are
idempotent). When another task acquires and releases the lock before the re-send arrives, the
re-send finds the lock not held and the release record in ``meta`` overwritten, and the lease
that was released cleanly is reported lost: a "lease ... lost" warning, ``on_lost`` called,
``statistics().lost`` counted. The lock itself is handled correctly (no ghost holder); only the
report is wrong.

The interleaving is driven by the fault proxy: the release's reply is held after the command
ran, another client takes and releases the lock, then the scope is cancelled.
"""

from __future__ import annotations

import asyncio

import anyio

from redis_locks_async import Lease, Lock
from tests.conftest import Connect
from tests.faultproxy import FaultProxy

POLL = 0.002
BOUND = 5.0


async def _until_free(lock: Lock) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND
    while await lock.locked():
        assert loop.time() < deadline, "the release never ran on the server"
        await asyncio.sleep(POLL)


async def test_cancelled_release_then_another_owner_is_no_loss(
    fault_proxy: FaultProxy, connect: Connect, name: str
) -> None:
    """Bug: a release cancelled after its command ran on the server, re-sent after another owner
    took and released the lock, reported the cleanly released lease as lost (warning, on_lost,
    statistics().lost)."""
    lost: list[Lease] = []
    lock = Lock(connect(fault_proxy.url), name, on_lost=lost.append)
    other = Lock(connect(), name)  # straight to the server, past the proxy
    acquired, go = asyncio.Event(), asyncio.Event()
    scope = anyio.CancelScope()
    assert await lock.acquire()  # loads the scripts and warms the pool: no reply held later
    await lock.release()  # is needed before the release command itself is sent

    async def holder() -> None:
        await lock.acquire()
        acquired.set()
        await go.wait()
        with scope:
            await lock.release()

    task = asyncio.create_task(holder())
    try:
        await asyncio.wait_for(acquired.wait(), BOUND)
        fault_proxy.hold_replies()
        go.set()
        await _until_free(other)  # the release ran; its reply is held at the proxy
        await fault_proxy.wait_held()
        assert await other.acquire(timeout=BOUND)  # another owner, in between
        await other.release()
        scope.cancel()  # the holder gives up waiting for the reply: the release is re-sent
        await asyncio.wait_for(task, BOUND)
        fault_proxy.release_replies()

        loop = asyncio.get_running_loop()
        deadline = loop.time() + BOUND
        while lock.statistics().releases + lock.statistics().lost < 2:
            assert loop.time() < deadline, "the background release never finished"
            await asyncio.sleep(POLL)
        assert lost == [], "on_lost was called for a lock released normally"
        assert lock.statistics().lost == 0
        assert lock.statistics().releases == 2
    finally:
        fault_proxy.heal()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,), timeout=1.0)


async def _nested_holder(lock: Lock, held: asyncio.Event, go: asyncio.Event) -> None:
    """Take ``lock`` twice (a nested hold), say so, and wait for ``go``."""
    assert await lock.acquire()
    assert await lock.acquire()
    held.set()
    await go.wait()


async def _cancelled_release(lock: Lock, fault_proxy: FaultProxy) -> None:
    """Release one level of ``lock``, cancelled once its reply is held at ``fault_proxy``
    (the release goes on in the background)."""
    scope = anyio.CancelScope()

    async def cancel_when_held() -> None:
        await fault_proxy.wait_held()
        scope.cancel()

    canceller = asyncio.create_task(cancel_when_held())
    with scope:
        await lock.release()
    await canceller


async def test_outer_release_after_a_cancelled_inner_release_frees_the_lock(
    fault_proxy: FaultProxy, connect: Connect, name: str
) -> None:
    """Bug: with an inner release of a nested hold cancelled while its reply was held (it goes
    on in the background), the task's next ``release()`` picked the innermost level *before*
    that release was done — the same level — found it released once it was, and returned
    without releasing the outer hold: the lock stayed held (and renewed) for as long as the
    task lived, while the task believed it had released it."""
    lock = Lock(connect(fault_proxy.url), name)
    other = Lock(connect(), name)  # straight to the server, past the proxy
    assert await lock.acquire()  # loads the scripts and warms the pool
    await lock.release()
    held, go, done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    cancelled_inner = asyncio.Event()

    async def holder() -> None:
        await _nested_holder(lock, held, go)
        await _cancelled_release(lock, fault_proxy)  # the inner level
        cancelled_inner.set()
        await lock.release()  # the outer level: must free the lock
        assert lock.current_lease is None
        done.set()
        await asyncio.Event().wait()  # the task lives on: nothing releases for it

    task = asyncio.create_task(holder())
    try:
        await asyncio.wait_for(held.wait(), BOUND)
        fault_proxy.hold_replies()
        go.set()
        await asyncio.wait_for(cancelled_inner.wait(), BOUND)
        fault_proxy.release_replies()
        await asyncio.wait_for(done.wait(), BOUND)
        await _until_free(other)
    finally:
        fault_proxy.heal()
        task.cancel()
        await asyncio.wait((task,), timeout=BOUND)


async def test_release_cancelled_while_an_earlier_release_finishes_still_releases(
    fault_proxy: FaultProxy, connect: Connect, name: str
) -> None:
    """Bug: a ``release()`` cancelled while it waited for an earlier, cancelled release of the
    same hold (a nested hold's inner level, going on in the background) was dropped: the
    outer hold stayed held and renewed for as long as the task lived. A cancelled release
    still releases (SPEC §4), so it now runs after the earlier one."""
    lock = Lock(connect(fault_proxy.url), name)
    other = Lock(connect(), name)
    assert await lock.acquire()
    await lock.release()
    held, go, waiting = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        await _nested_holder(lock, held, go)
        await _cancelled_release(lock, fault_proxy)  # the inner level
        with anyio.CancelScope() as scope:
            scope.cancel()  # cancelled at its first await: waiting for the inner release
            await lock.release()
        waiting.set()
        await asyncio.Event().wait()  # the task lives on: nothing releases for it

    task = asyncio.create_task(holder())
    try:
        await asyncio.wait_for(held.wait(), BOUND)
        fault_proxy.hold_replies()
        go.set()
        await asyncio.wait_for(waiting.wait(), BOUND)
        fault_proxy.release_replies()
        await _until_free(other)
    finally:
        fault_proxy.heal()
        task.cancel()
        await asyncio.wait((task,), timeout=BOUND)
