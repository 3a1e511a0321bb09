"""The one place where tests look inside the library (everything else uses the public API).

Invariant checks (no ghost holders, no orphan tasks, no renewal loop left running) need a few
views the public API does not offer. They are collected here so that a refactoring of the
library's internals changes this module only, never the tests that use it.

All functions take the ``redis.asyncio`` client the locks were built on and look at the
library's state for that client *on the running event loop*.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from redis_locks_async import Lease
from redis_locks_async._core import LockBase as LockBase
from redis_locks_async._fair import FAIR_ACQUIRE
from redis_locks_async._keys import LockKeys
from redis_locks_async._lease import Hold
from redis_locks_async._lock import SCRIPTS
from redis_locks_async._owners import PROCESS_TAG_LEN
from redis_locks_async._runtime import Runtime, existing_runtime
from redis_locks_async._rwlock import SCRIPTS as RW_SCRIPTS
from redis_locks_async._semaphore import SCRIPTS as SEM_SCRIPTS
from redis_locks_async._wire import fast_pool

Client = aioredis.Redis | RedisCluster  # what the library's runtimes are keyed by

__all__ = (
    "LockBase",
    "aux_keys",
    "background_tasks",
    "channel_of",
    "drain",
    "judge_renewal",
    "keeper",
    "keeper_size",
    "lease_owner_id",
    "lease_side",
    "live_owner_ids",
    "local_waiters",
    "owner_in_redis",
    "pending_cleanups",
    "quorum_hold_count",
    "quorum_holders",
    "redlock_client",
    "redlock_debts",
    "redlock_owners",
    "register_ghost",
    "registered_waiters",
    "renewal_round_trips",
    "script_sources",
    "server_holders",
    "task_leases",
)


# Set once a Redis Cluster test ran: redis-py's cluster client drops the ``ClusterNode``
# objects of an old slot map without closing them, and they are collected at random later
# (see tests/conftest.py, ``_quiet_cluster_garbage``).
CLUSTER_GARBAGE = [False]


def _state(client: Client) -> Runtime | None:
    return existing_runtime(client)


def script_sources() -> Sequence[str]:
    """The source of every Lua script the library runs (to ``SCRIPT LOAD`` them up front)."""
    return [script.source for script in (*SCRIPTS, FAIR_ACQUIRE, *RW_SCRIPTS, *SEM_SCRIPTS)]


async def register_ghost(
    inspector: aioredis.Redis, name: str, owner: str, *, lease_ms: int, claim_ms: int
) -> Any:
    """Register ``owner`` as a ``FairLock`` waiter of ``name`` that will never confirm a grant
    (a waiter whose process hangs: still connected, so still present on the server — a killed
    one is skipped at once); the lock must be held (the registration is checked). Returns the
    pub/sub connection that keeps its process present: ``aclose()`` it at the end."""
    keys = LockKeys.for_name(name)
    presence = inspector.pubsub()
    await presence.subscribe(keys.channel + ":" + owner[:PROCESS_TAG_LEN])
    grace_ms = 2000 + claim_ms
    args = (owner, lease_ms, "wait", grace_ms, claim_ms, keys.channel, 0)
    reply = await FAIR_ACQUIRE.run(inspector, keys.script_keys, args)
    assert isinstance(reply, list), reply
    assert int(reply[0]) == 0, f"the ghost was not registered: {reply!r}"
    return presence


def background_tasks(client: Client) -> set[asyncio.Task[Any]]:
    """The library's background tasks for ``client`` that are not done (listener, keeper,
    cleanups, releases in flight)."""
    state = _state(client)
    return set() if state is None else state.background_tasks


def pending_cleanups(client: Client) -> int:
    """Background cleanups and releases still running (not the long-lived keeper/listener)."""
    state = _state(client)
    return 0 if state is None else state.pending_cleanups


async def drain(client: Client, timeout: float = 5.0) -> None:
    """Wait (at most ``timeout`` s) for pending cleanups and releases of ``client``."""
    state = _state(client)
    if state is not None:
        await state.drain(timeout)


async def retire_lane(client: Client, timeout: float = 5.0) -> None:
    """Have ``client``'s pipelined lane (``_lane``), if one is open, give its connection back
    to the pool now, and wait until it is there — for tests that take a pool's connections
    themselves, or that test the per-call path on an idle connection."""
    fast = fast_pool(client)
    lane = fast.lane if fast is not None else None
    if fast is None or lane is None:
        return
    deadline = asyncio.get_running_loop().time() + timeout
    while not lane.retire():  # calls are in flight on it: wait for their replies
        assert asyncio.get_running_loop().time() < deadline, "the lane never went quiet"
        await asyncio.sleep(0.002)
    pool: Any = fast.pool
    while lane.conn not in pool._available_connections:
        assert asyncio.get_running_loop().time() < deadline, "the lane's connection not back"
        await asyncio.sleep(0.002)


def renewal_round_trips(client: Client) -> int:
    """Renewal round trips the lease keeper of ``client`` made so far."""
    state = _state(client)
    return 0 if state is None else state.keeper.renewal_round_trips


def keeper(client: Client) -> Any:
    """The lease keeper of ``client``'s runtime (it must have one)."""
    state = _state(client)
    assert state is not None
    return state.keeper


def keeper_size(client: Client) -> int:
    """How many leases the keeper of ``client`` is renewing or watching."""
    state = _state(client)
    return 0 if state is None else len(state.keeper)


def lease_owner_id(lease: Lease) -> str:
    """The owner id a lease holds its lock under (what the server stores as the owner)."""
    return lease._hold.owner


def live_owner_ids(client: Client) -> set[str]:
    """Owner ids a live local task stands behind: held (not lost) leases — a task's earlier
    ``Semaphore`` permits too, which wait underneath its newest (``Hold.outer``) — and waiting
    tasks."""
    state = _state(client)
    if state is None:
        return set()
    ids: set[str] = set()
    for top in state.holds.values():
        hold: Hold | None = top
        while hold is not None:
            if hold.live:
                ids.add(hold.owner)
            hold = hold.outer
    for hub in state.hubs():
        for lot in hub.lots():
            ids |= set(lot.by_owner)
    return ids


def lease_side(lease: Lease) -> str:
    """ "r" or "w" for a side of a ``ReadWriteLock``, else ""."""
    key = lease._hold.key
    return str(key[2]) if isinstance(key, tuple) and len(key) == 3 else ""


def held_leases(client: Client) -> list[Lease]:
    """Every lease the library holds locally for ``client`` (any task, any lock)."""
    state = _state(client)
    return [] if state is None else [hold.view for hold in state.holds.values()]


def task_leases(client: Client) -> list[tuple[asyncio.Task[Any], Lease]]:
    """Every hold of ``client`` with the task holding it, a task's older permits included."""
    state = _state(client)
    found: list[tuple[asyncio.Task[Any], Lease]] = []
    for (_, task), hold in [] if state is None else state.holds.items():
        current: Hold | None = hold
        while current is not None:
            found.append((task, current.view))
            current = current.outer
    return found


def hubs(client: Client) -> list[Any]:
    """The subscription hubs of ``client``'s runtime (one per node)."""
    state = _state(client)
    return [] if state is None else list(state.hubs())


def local_waiters(client: Client) -> int:
    """Tasks waiting (queued locally) for any lock of ``client``."""
    state = _state(client)
    return 0 if state is None else sum(hub.waiting for hub in state.hubs())


def aux_keys(name: str, layout: str = "lock") -> tuple[str | bytes, ...]:
    """Every Redis key the lock ``name`` uses besides ``name`` itself (meta, queue, done).

    ``layout``: "lock" for ``Lock``/``FairLock``, "rw" for ``ReadWriteLock``, "sem" for
    ``Semaphore``."""
    return LockKeys.for_name(name, layout).aux_keys


def channel_of(name: str, layout: str = "lock") -> str | bytes:
    """The pub/sub channel the lock ``name`` announces releases on (``layout``: see
    :func:`aux_keys`)."""
    return LockKeys.for_name(name, layout).channel


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def owner_in_redis(inspector: aioredis.Redis, name: str) -> str | None:
    """The owner id the server has for the lock ``name`` (``None`` when free)."""
    owner = await inspector.hget(name, "owner")
    return None if owner is None else _text(owner)


async def registered_waiters(
    inspector: aioredis.Redis, name: str, layout: str = "lock"
) -> set[str]:
    """Owner ids registered in Redis as waiting for ``name`` (see :func:`aux_keys`)."""
    keys = LockKeys.for_name(name, layout)
    return {_text(member) for member in await inspector.zrange(keys.queue, 0, -1)}


def renewals(client: Client) -> int:
    """Successful renewals the keeper of ``client`` made so far."""
    state = _state(client)
    return 0 if state is None else state.keeper.renewals


async def server_hold_count(inspector: aioredis.Redis, name: str) -> int:
    """The hold count the server has for the lock ``name`` (0 when free)."""
    if await inspector.hget(name, "owner") is None:
        return 0
    return int(await inspector.hlen(name)) - 1


def lease_of(client: Client, name: str, task: asyncio.Task[Any]) -> Lease | None:
    """The lease ``task`` holds on the ``Lock`` called ``name`` (through ``client``)."""
    state = _state(client)
    hold = None if state is None else state.holds.get((("lock", name), task))
    return None if hold is None else hold.view


async def registered_count(inspector: aioredis.Redis, name: str, layout: str = "lock") -> int:
    """How many waiters are registered in Redis for the lock ``name`` (see :func:`aux_keys`)."""
    return int(await inspector.zcard(LockKeys.for_name(name, layout).queue))


async def until_registered(
    inspector: aioredis.Redis, name: str, count: int, layout: str = "lock", within: float = 5.0
) -> None:
    """Wait until at least ``count`` waiters are registered for ``name`` (fail after
    ``within`` seconds)."""

    async def poll() -> None:
        while await registered_count(inspector, name, layout) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), within)


async def server_holders(
    inspector: aioredis.Redis, name: str, layout: str = "lock"
) -> dict[str, int]:
    """Who holds ``name`` on the server now: owner id -> milliseconds its hold has left.

    ``layout``: "lock" (``Lock``/``FairLock``: the hash's owner and the key's PTTL), "rw" (the
    live writer and readers of a ``ReadWriteLock``), "sem" (the live permits of a ``Semaphore``).
    """
    clock: Any = await inspector.time()
    now_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000
    if layout == "lock":
        owner = await owner_in_redis(inspector, name)
        return {} if owner is None else {owner: int(await inspector.pttl(name))}
    if layout == "sem":
        members: list[Any] = await inspector.zrange(name, 0, -1, withscores=True)
        return {_text(m): int(s) - now_ms for m, s in members if int(s) > now_ms}
    found: dict[str, int] = {}
    fields = {_text(k): _text(v) for k, v in (await inspector.hgetall(name)).items()}
    if "w" in fields and int(fields.get("wx", "0")) > now_ms:
        found[fields["w"]] = int(fields["wx"]) - now_ms
    for field, value in fields.items():
        expiry = int(value.split(":", 1)[0]) if field.startswith("r:") else 0
        if expiry > now_ms:
            found[field[2:]] = expiry - now_ms
    return found


def redlock_client(lock: Any) -> Any:
    """The client object a ``RedLock``'s state lives under (its fan-out over the masters): pass
    it to the other functions here."""
    return lock._redis


def redlock_owners(fan: Any) -> int:
    """How many acquisitions a ``RedLock`` fan-out (:func:`redlock_client`) still keeps state
    for: held, in flight, or with round values not yet cleaned up on the masters."""
    return len(fan._owners)


def redlock_debts(fan: Any) -> int:
    """How many clean-ups (abandons of round values) the masters of a ``RedLock`` fan-out are
    owed and that are not settled yet (confirmed, or given up)."""
    return sum(
        1
        for janitor in fan._janitors.values()
        for debt in janitor._debts.values()
        if not debt.settled.done()
    )


async def _quorum_view(
    inspectors: Sequence[aioredis.Redis], name: str
) -> tuple[int, dict[str, list[tuple[int, frozenset[str]]]]]:
    """The quorum, and per owner id the (PTTL, re-entries) of each master whose ``name`` has
    one of that owner's round values (``<owner id>:<round>``); re-entries are the hash's
    ``e:<id>`` fields."""
    found: dict[str, list[tuple[int, frozenset[str]]]] = {}
    for inspector in inspectors:
        value = await owner_in_redis(inspector, name)
        if value is not None:
            ttl = int(await inspector.pttl(name))
            fields = {_text(field) for field in await inspector.hkeys(name)}
            entries = frozenset(field for field in fields if field.startswith("e:"))
            found.setdefault(value.rsplit(":", 1)[0], []).append((ttl, entries))
    return len(inspectors) // 2 + 1, found


async def quorum_holders(inspectors: Sequence[aioredis.Redis], name: str) -> dict[str, int]:
    """Who holds the ``RedLock`` ``name`` on a quorum of the masters ``inspectors``: owner id ->
    milliseconds until fewer than a quorum of its keys are left."""
    quorum, found = await _quorum_view(inspectors, name)
    return {
        owner: sorted((ttl for ttl, _ in held), reverse=True)[quorum - 1]
        for owner, held in found.items()
        if len(held) >= quorum
    }


async def quorum_hold_count(inspectors: Sequence[aioredis.Redis], name: str) -> int:
    """The hold count of the ``RedLock`` ``name``'s quorum holder as a quorum of the masters
    has it: 1 + the re-entries present on a quorum of them (0 when no owner holds a quorum).

    Not the count a quorum has at least: a re-entry or an inner release counts once a quorum
    confirmed it, so two of them confirmed by different quorums leave the masters' counts
    apart — on three masters, two inner releases of a count-3 hold, the first not reaching
    master C, the second not reaching master B, leave counts 1, 2, 2 for a hold of count 1 —
    while each re-entry the hold still has is on a quorum and each released one on a minority.
    """
    quorum, found = await _quorum_view(inspectors, name)
    for held in found.values():
        if len(held) >= quorum:
            seen = collections.Counter(entry for _, entries in held for entry in entries)
            return 1 + sum(1 for times in seen.values() if times >= quorum)
    return 0


def judge_renewal(
    client: Client, lease: Lease, result: object, length: float | None = None
) -> None:
    """Hand ``client``'s lease keeper a renewal answer for ``lease``, as if a renewal round trip
    sent just now had returned ``result`` (1: renewed, 0: not held, an exception: failed) — one
    setting ``length`` seconds, if given (an extend changed the hold's lease meanwhile)."""
    state = _state(client)
    assert state is not None
    now = asyncio.get_running_loop().time()
    state.keeper.judge(lease._hold, result, now, now, length)
