"""The core's seams, proven by a primitive the core has never seen.

``Permits`` below is the skeleton of a counting semaphore written *only* as a policy (its own
keys, admission of several waiters, one hold per acquisition, its own Lua scripts) over the
unchanged core: if it needs a change to the core to work, the seam is wrong. It is a test of
the seam, not the library's ``Semaphore``: no fencing discipline, no writer preference, no
permit changes at run time.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Final

import pytest
import redis.asyncio as aioredis

from redis_locks_async import LockError
from redis_locks_async._core import Attempt, LockBase, Policy
from redis_locks_async._scripts import Call, Script
from redis_locks_async._validation import to_ms

_ACQUIRE: Final = Script(
    "test_permit_acquire.lua",
    """
    -- KEYS: holders ZSET owner -> expiry ms, meta HASH, queue ZSET, done ZSET
    -- ARGV: owner, lease ms, mode, grace ms, claim ms, permits
    -- returns {1, token, 1, ttl} | {0, at, 0, ttl of the soonest permit} | {-1, 0, 0, 0}
    --         (at: server time in us when registered in "wait" mode, else 0)
    local holders, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
    local me, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]
    local now = now_us()
    local now_ms = math.floor(now / 1000)
    redis.call('ZREMRANGEBYSCORE', holders, '-inf', now_ms)
    local mine = redis.call('ZSCORE', holders, me)
    if mine then
        return {1, tonumber(redis.call('HGET', meta, 't:' .. me) or '0'), 1,
                tonumber(mine) - now_ms}
    end
    if is_done(done, me) then
        return {-1, 0, 0, 0}
    end
    if redis.call('ZCARD', holders) < tonumber(ARGV[6]) then
        local token = next_fence(meta, now)
        redis.call('ZADD', holders, now_ms + lease, me)
        redis.call('HSET', meta, 'fence', int(token), 't:' .. me, int(token))
        keep(meta, lease + AUX_TAIL_MS)
        redis.call('PEXPIRE', holders, lease + AUX_TAIL_MS)
        unregister(meta, queue, me)
        return {1, token, 1, lease}
    end
    local soonest = tonumber(redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')[2]) - now_ms
    if mode == 'wait' then
        register(meta, queue, me, now, lease, tonumber(ARGV[5]), tonumber(ARGV[4]), soonest)
        return {0, now, 0, soonest}
    end
    return {0, 0, 0, soonest}
    """,
)

_RELEASE: Final = Script(
    "test_permit_release.lua",
    """
    -- KEYS: as _ACQUIRE; ARGV: owner, mode, entry, channel, sharded
    -- returns {0, 0} released | {-1, 0} not held
    local holders, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
    local me, mode, channel, sharded = ARGV[1], ARGV[2], ARGV[4], ARGV[5]
    local now = now_us()
    local had = redis.call('ZREM', holders, me)
    if mode == 'abandon' then
        unregister(meta, queue, me)
        mark_done(done, me, now)
    end
    if had == 0 then
        if mode == 'abandon' or redis.call('HGET', meta, 'last') == me then
            return {0, 0}
        end
        return {-1, 0}
    end
    redis.call('HSET', meta, 'last', me)
    local now_ms = math.floor(now / 1000)
    while true do
        local head = redis.call('ZRANGE', queue, 0, 0)[1]
        if not head then
            break
        end
        local entry = redis.call('HGET', meta, 'w:' .. head)
        unregister(meta, queue, head)
        local deadline, lease, claim = parse_registration(entry)
        if deadline and deadline >= now_ms then
            local ttl = math.min(lease, claim)
            local token = next_fence(meta, now)
            redis.call('ZADD', holders, now_ms + ttl, head)
            redis.call('HSET', meta, 'fence', int(token), 't:' .. head, int(token))
            announce(channel, sharded,
                     'g:' .. int(ttl) .. ':' .. int(now) .. ':' .. head .. ':' .. int(token))
            return {0, 0}
        end
    end
    announce(channel, sharded, 'f:1')
    return {0, 0}
    """,
)

_RENEW: Final = Script(
    "test_permit_renew.lua",
    """
    -- KEYS: holders ZSET; ARGV: owner, lease ms; returns 1 renewed | 0 lost
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
    if not expiry or tonumber(expiry) <= now_ms then
        return 0
    end
    redis.call('ZADD', KEYS[1], 'XX', now_ms + tonumber(ARGV[2]), ARGV[1])
    return 1
    """,
)

_REFUSE: Final = Script("test_permit_reenter.lua", "return {-1, 0, 0, 0}")


class PermitPolicy(Policy):
    """N permits, one hold per acquisition, N active waiters (the skeleton under test)."""

    kind = "permit"
    active_waiters: ClassVar[int] = 2
    reentrant = False
    permits: ClassVar[int] = 2
    __slots__ = ()

    @property
    def key_types(self) -> tuple[tuple[str | bytes, str], ...]:
        keys = self.keys
        return ((keys.name, "zset"), (keys.meta, "hash"), (keys.queue, "zset"), (keys.done, "zset"))

    def attempt(self, a: Attempt) -> Call:
        mode = "wait" if a.wait else "try"
        args = (a.owner, a.lease_ms, mode, a.grace_ms, a.claim_ms, self.permits)
        return Call(_ACQUIRE, self.keys.script_keys, args)

    def reenter(self, owner: str, entry: str, lease_ms: int, sharded: bool = False) -> Call:
        return Call(_REFUSE, (self.keys.name,), ())

    def release(self, owner: str, mode: str, entry: str, sharded: bool) -> Call:
        args = (owner, mode, entry, self.keys.channel, "1" if sharded else "0")
        return Call(_RELEASE, self.keys.script_keys, args)

    def renew(self, owner: str, lease: float, sharded: bool | None) -> Call:
        return Call(_RENEW, (self.keys.name,), (owner, to_ms(lease)))

    async def locked(self, client: Any) -> bool:
        return bool(await client.zcard(self.keys.name))


class Permits(LockBase):
    """Two permits (``async with``, ``acquire``, ``release``: the core's public surface)."""

    _policy_class = PermitPolicy
    __slots__ = ()


async def holders(client: aioredis.Redis, name: str) -> int:
    return int(await client.zcard(name))


class TestPermitPolicySkeleton:
    async def test_two_holders_then_a_grant(self, client: aioredis.Redis, name: str) -> None:
        """Two permits held; a third waiter is handed one by a release (a grant it reads and
        takes as its hold, no round trip).

        Regression (the skeleton's release read registrations without their role suffix
        (``parse_registration``), so it dropped every one as dead: no grant was ever made, and
        the third waiter got in only by re-checking after "f:1")."""
        permits = Permits(client, name)
        entered: list[asyncio.Event] = [asyncio.Event() for _ in range(3)]
        leave: list[asyncio.Event] = [asyncio.Event() for _ in range(3)]

        async def worker(i: int) -> None:
            async with permits:
                entered[i].set()
                await leave[i].wait()

        tasks = [asyncio.create_task(worker(i)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(entered[0].wait(), entered[1].wait()), 5)
        assert await holders(client, name) == 2
        third = asyncio.create_task(worker(2))
        await asyncio.sleep(0.2)
        assert not entered[2].is_set(), "a third holder got in while both permits were taken"
        leave[0].set()
        await asyncio.wait_for(entered[2].wait(), 2)  # handed over by the release
        assert permits.statistics().handovers == 1  # the grant was read and taken as a hold
        assert await holders(client, name) == 2
        for event in leave:
            event.set()
        await asyncio.wait_for(asyncio.gather(*tasks, third), 5)
        assert await holders(client, name) == 0

    async def test_a_task_may_hold_several(self, client: aioredis.Redis, name: str) -> None:
        permits = Permits(client, name)
        first = await permits.acquire()
        second = await permits.acquire()  # not a re-entry: a second permit
        assert first and second
        assert await holders(client, name) == 2
        assert not await Permits(client, name).acquire(blocking=False) or pytest.fail(
            "a third permit was granted"
        )
        await permits.release()
        assert await holders(client, name) == 1
        await permits.release()
        assert await holders(client, name) == 0
        with pytest.raises(LockError):
            await permits.release()

    async def test_permits_are_renewed(self, client: aioredis.Redis, name: str) -> None:
        permits = Permits(client, name, lease=0.4)
        async with permits as lease:
            await asyncio.sleep(1.2)
            assert not lease.lost, lease.lost_reason
            assert await holders(client, name) == 1
        assert await holders(client, name) == 0
