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
