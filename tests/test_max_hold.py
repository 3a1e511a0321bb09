"""``max_hold``: a cap on the total time a hold is renewed (every primitive, RedLock included)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from redis_locks_async import Lease, Lock, LockError, LockLostError, RedLock, Semaphore
from redis_locks_async._core import LockBase

pytestmark = pytest.mark.timeout(30)

Factory = Callable[..., LockBase]

FACTORIES: dict[str, Factory] = {
    "lock": lambda client, name, **kw: Lock(client, name, **kw),
    "semaphore": lambda client, name, **kw: Semaphore(client, name, 1, **kw),
    "redlock": lambda client, name, **kw: RedLock([client], name, **kw),
}


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest) -> Factory:
    """Each primitive's constructor."""
    return FACTORIES[request.param]


async def test_renewal_stops_at_max_hold(client: aioredis.Redis, name: str, make: Factory) -> None:
    """Renewed while within ``max_hold``, then left to expire: the loss is signalled (on_lost,
    LockLostError at release) and the server lets the lock go."""
    lost: list[Lease] = []
    lock = make(client, name, lease=0.3, max_hold=0.9, on_lost=lost.append)
    started = time.monotonic()
    assert await lock.acquire(blocking=False)
    lease = lock.current_lease
    assert lease is not None
    await asyncio.sleep(0.6)  # two leases: renewed
    assert not lost and await lock.locked()
    await asyncio.wait_for(lease.wait_lost(), 3.0)  # the hold was not renewed past max_hold
    await asyncio.sleep(0)  # on_lost runs right after
    held_for = time.monotonic() - started
    assert 0.5 < held_for < 1.6
    assert "max_hold" in lost[0].lost_reason
    for _ in range(50):  # the server's lease ends a moment later (RedLock: by the drift)
        if not await lock.locked():
            break
        await asyncio.sleep(0.01)
    assert not await lock.locked()
    with pytest.raises(LockLostError):
        await lock.release()


async def test_extend_past_max_hold_is_refused(client: aioredis.Redis, name: str) -> None:
    """``extend()`` within the cap works; past it, a ``LockError`` and the hold is untouched."""
    lock = Lock(client, name, lease=1.0, max_hold=3.0)
    async with lock as lease:
        await lock.extend(1.5)
        with pytest.raises(LockError, match="max_hold"):
            await lock.extend(10.0)
        assert not lease.lost and lock.owned()


@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (-1.0, ValueError), ("1", TypeError)]
)
def test_max_hold_is_checked(value: Any, error: type[Exception]) -> None:
    """A bad ``max_hold`` fails at construction, before any I/O."""
    with pytest.raises(error, match="max_hold"):
        Lock(aioredis.Redis(), "x", max_hold=value)
