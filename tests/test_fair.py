"""``FairLock``: strict FIFO by arrival, direct hand-over, no barging, dead waiters skipped."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from redis_locks_async import FairLock, Lease, Lock
from tests import _introspect as introspect

if TYPE_CHECKING:
    from tests.conftest import Connect


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

    async def test_lock_and_fairlock_of_one_name_are_one_lock(
        self, client: aioredis.Redis, name: str
    ) -> None:
        async with Lock(client, name):
            # the same task re-enters through the other kind
            assert await FairLock(client, name).acquire()
            assert await introspect.server_hold_count(client, name) == 2
            await FairLock(client, name).release()
        assert not await client.exists(name)
