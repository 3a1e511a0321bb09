"""Redis Cluster: every primitive on a real 3-primary cluster (`RedisCluster` client).

The cluster is three ``--cluster-enabled`` servers of the run's binary on loopback ports, slots
split with ``CLUSTER ADDSLOTSRANGE`` and joined with ``CLUSTER MEET`` (no ``redis-cli`` needed;
``tests.servers.running_cluster``).
Names are chosen so that every primary serves some lock: scripts must touch one slot per lock,
announcements travel by sharded pub/sub from the lock's own node, and the lease keeper renews
through one pipeline per node.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import signal
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from redis_locks_async import FairLock, Lease, Lock, LockError, ReadWriteLock, Semaphore
from redis_locks_async._cluster import Cluster
from redis_locks_async._keys import LockKeys
from redis_locks_async._notify import presence_channel
from redis_locks_async._runtime import existing_runtime
from tests import _introspect
from tests.faultproxy import FaultProxy
from tests.servers import ServerProcess, ServerStartError, _admin, running_cluster
from tests.test_keys import woken_by_release
from tests.test_lock_faults import until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(autouse=True)
def _quiet_garbage() -> Iterator[None]:
    """After each test here (set up first, so torn down last): collect the cluster clients'
    garbage with ``ResourceWarning`` silenced. redis-py's cluster client drops the
    ``ClusterNode`` objects of an old slot map (a redirection, a migration, a failover)
    without closing their connections; collected during a later test, in another module,
    they failed it (``filterwarnings = error``: seen once, in ``test_family.py``)."""
    _introspect.CLUSTER_GARBAGE[0] = True
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture(scope="module")
def cluster_nodes(server_binary: Path) -> Iterator[list[ServerProcess]]:
    """Three primaries covering every slot (module-wide: a cluster takes a second to form)."""
    with running_cluster(server_binary, primaries=3) as nodes:
        yield nodes


@pytest.fixture
async def cluster(cluster_nodes: list[ServerProcess]) -> AsyncIterator[list[RedisCluster]]:
    """Two cluster clients (two "processes"), closed after the test."""
    first = cluster_nodes[0]
    clients = [RedisCluster(host=first.host, port=first.port) for _ in range(2)]
    for client in clients:
        await client.initialize()
    try:
        yield clients
    finally:
        for client in clients:
            await client.aclose()


def _names_on_every_node(client: RedisCluster, prefix: str) -> list[str]:
    """One lock name per primary (so every node serves one of the test's locks)."""
    names: dict[str, str] = {}
    index = 0
    while len(names) < 3:
        name = f"{prefix}:{index}"
        node = client.get_node_from_key(name)
        assert node is not None
        names.setdefault(node.name, name)
        index += 1
    return list(names.values())


async def test_handoff_between_clients_on_every_node(cluster: list[RedisCluster]) -> None:
    """A waiter on another client is woken by the release (sharded pub/sub from the lock's own
    node), long before the holder's lease would end."""
    a, b = cluster
    for name in _names_on_every_node(a, "handoff"):
        holder, waiter = Lock(a, name, lease=30.0), Lock(b, name, lease=30.0)
        assert await holder.acquire(blocking=False)
        acquired_at: list[float] = []

        async def contend(lock: Lock = waiter, log: list[float] = acquired_at) -> None:
            assert await lock.acquire(timeout=20)
            log.append(time.monotonic())
            assert await lock.locked()
            await lock.release()

        contender = asyncio.create_task(contend())
        await asyncio.sleep(0.3)
        assert not acquired_at, "the waiter got a held lock"
        released_at = time.monotonic()
        await holder.release()
        await asyncio.wait_for(contender, 10)
        assert acquired_at[0] - released_at < 5.0  # woken, not the 30 s lease fallback
        assert not await holder.locked()


async def test_renewal_keeps_locks_on_every_node(cluster: list[RedisCluster]) -> None:
    """The keeper renews locks spread over the three primaries (one pipeline per node)."""
    a, b = cluster
    locks = [Lock(a, name, lease=0.6) for name in _names_on_every_node(a, "renew")]
    for lock in locks:
        assert await lock.acquire(blocking=False)
    await asyncio.sleep(2.0)  # more than three leases
    for lock in locks:
        assert lock.owned()
        lease = lock.current_lease
        assert lease is not None and not lease.lost
        assert not await Lock(b, lock.name).acquire(blocking=False)
    for lock in locks:
        await lock.release()
    assert _introspect.renewal_round_trips(a) >= 2


async def test_a_waiting_process_is_present_on_its_locks_node(
    cluster: list[RedisCluster],
) -> None:
    """While a task waits, its process keeps the lock's presence channel subscribed on the
    node that owns the lock's slot (``SSUBSCRIBE``), where the scripts look for it with
    ``PUBSUB SHARDNUMSUB`` — else every hand-over would take it for dead and skip it."""
    a, b = cluster
    for name in _names_on_every_node(a, "presence"):
        holder = FairLock(a, name)
        assert await holder.acquire(blocking=False)
        waiter = asyncio.create_task(_hold_briefly(FairLock(b, name)))
        channel = presence_channel(LockKeys.for_name(name).channel)
        node = a.get_node_from_key(name)
        await until(
            lambda: _shard_subscribers(a, node, channel),  # noqa: B023
            what="the waiter's presence on the lock's node",
        )
        await holder.release()
        assert await asyncio.wait_for(waiter, 10)


@pytest.mark.parametrize("kind", [Lock, FairLock], ids=["Lock", "FairLock"])
async def test_waiting_on_two_slots_of_one_node(
    cluster: list[RedisCluster], kind: type[Lock]
) -> None:
    """Regression (contract probe: one process waiting on two locks whose slots differ but
    live on one node — its hub (re)connected with every channel in one ``SSUBSCRIBE``, which
    a cluster refuses (CROSSSLOT): the waiters failed at once with ``LockError``, or, after a
    pub/sub kill, never got their subscriptions back and timed out while the locks were
    free). The hub now subscribes one slot per command."""
    a, b = cluster
    first = "twoslots:0"
    node = a.get_node_from_key(first)
    second = next(
        name
        for name in (f"twoslots:{i}" for i in range(1, 1000))
        if a.get_node_from_key(name) == node and a.keyslot(name) != a.keyslot(first)
    )
    for kill in (False, True):
        holders = [kind(a, first), kind(a, second)]
        for holder in holders:
            assert await holder.acquire(blocking=False)
        waiters = [
            asyncio.create_task(_hold_briefly(kind(b, name), timeout=10))
            for name in (first, second)
        ]
        await asyncio.sleep(0.3)  # both wait: their hub connected, subscribing both channels
        assert not any(w.done() for w in waiters), [w for w in waiters if w.done()]
        if kill:
            await a.execute_command("CLIENT", "KILL", "TYPE", "pubsub", target_nodes=node)
            await asyncio.sleep(0.5)  # the hub reconnects, subscribing both again
        loop = asyncio.get_running_loop()
        released = loop.time()
        for holder in holders:
            await holder.release()
        assert await asyncio.wait_for(asyncio.gather(*waiters), 12) == [True, True]
        assert loop.time() - released < 2.0, f"kill={kill}: woken only by a fallback"


async def _shard_subscribers(client: RedisCluster, node: Any, channel: str) -> int:
    reply = await client.execute_command("PUBSUB", "SHARDNUMSUB", channel, target_nodes=node)
    return int(reply[1]) if isinstance(reply, list) else int(dict(reply).get(channel, 0))


async def test_every_primitive_on_a_cluster(cluster: list[RedisCluster]) -> None:
    """FairLock, ReadWriteLock and Semaphore work on a cluster (one slot per lock)."""
    a, b = cluster
    fair_name, rw_name, sem_name = _names_on_every_node(a, "family")

    fair_a, fair_b = FairLock(a, fair_name), FairLock(b, fair_name)
    assert await fair_a.acquire(blocking=False)
    contender = asyncio.create_task(_hold_briefly(fair_b))
    await asyncio.sleep(0.2)
    await fair_a.release()
    assert await asyncio.wait_for(contender, 10)

    rw_a, rw_b = ReadWriteLock(a, rw_name), ReadWriteLock(b, rw_name)
    assert await rw_a.read.acquire(blocking=False)
    assert await rw_b.read.acquire(blocking=False)  # readers share

    async def try_write() -> bool:
        return await ReadWriteLock(b, rw_name).write.acquire(blocking=False)

    assert not await asyncio.create_task(try_write())  # another task: readers exclude writers
    await rw_a.read.release()
    await rw_b.read.release()
    assert await rw_b.write.acquire(blocking=False)
    await rw_b.write.release()

    sem_a, sem_b = Semaphore(a, sem_name, 2), Semaphore(b, sem_name, 2)
    assert await sem_a.acquire(blocking=False)
    assert await sem_b.acquire(blocking=False)
    assert await sem_b.free_permits() == 0
    waiter = asyncio.create_task(_hold_briefly(Semaphore(b, sem_name, 2)))
    await asyncio.sleep(0.2)
    await sem_a.release()
    assert await asyncio.wait_for(waiter, 10)
    await sem_b.release()


async def _hold_briefly(lock: Lock | FairLock | Semaphore, timeout: float = 10) -> bool:
    if not await lock.acquire(timeout=timeout):
        return False
    await lock.release()
    return True


async def test_keys_share_the_lock_slot(cluster: list[RedisCluster]) -> None:
    """A waiting acquisition writes its registration next to the lock: same slot, no CROSSSLOT
    error, and the keys are on the node that owns the name."""
    a, b = cluster
    name = "slot:{user42}:cart"
    holder = Lock(a, name)
    assert await holder.acquire(blocking=False)
    assert not await Lock(b, name).acquire(timeout=0.3)
    slot = a.keyslot(name)
    for key in _introspect.aux_keys(name):
        assert a.keyslot(key) == slot
    await holder.release()


async def test_close_leaves_nothing_running(cluster: list[RedisCluster]) -> None:
    """Closing a cluster client stops its keeper and hubs and closes the per-node connections."""
    a, b = cluster
    holder = Lock(a, "close:x")
    assert await holder.acquire(blocking=False)
    waiter = asyncio.create_task(_hold_briefly(Lock(b, "close:x")))
    await asyncio.sleep(0.3)
    await b.aclose()
    with pytest.raises(LockError):
        await asyncio.wait_for(waiter, 10)
    assert not _introspect.background_tasks(b)
    await holder.release()


async def test_redis_py_resetting_its_slot_map_is_not_a_close(
    cluster: list[RedisCluster], cluster_nodes: list[ServerProcess]
) -> None:
    """Regression (contract probe of the cluster topology): redis-py's ``RedisCluster`` calls
    its own ``aclose()`` to refresh its slot map — on ``CLUSTERDOWN`` or an uncovered slot,
    and on every fifth ``MOVED`` — and goes on serving. The library took that for the user
    closing the client: every hold on the client dropped (``owned()`` False, the keys left to
    expire), every waiter failed, and every later ``Lock`` refused the client for good."""
    client = cluster[0]
    holder = Lock(client, "reset:held", lease=5.0)
    assert await holder.acquire(blocking=False)
    held_on = client.get_node_from_key("reset:held")
    other = next(
        key
        for key in (f"reset:user:{index}" for index in range(1000))
        if client.get_node_from_key(key) != held_on
    )
    slot = str(client.keyslot(other))
    other_node = client.get_node_from_key(other)
    assert other_node is not None
    owner = next(n for n in cluster_nodes if n.port == other_node.port)
    for node in cluster_nodes:
        with contextlib.suppress(ServerStartError):
            _admin(node, "CLUSTER", "DELSLOTS", slot)
    try:
        await asyncio.sleep(0.2)
        with pytest.raises((RedisError, RedisClusterException)):
            await client.get(other)  # not served: redis-py resets its slot map ("closes")
    finally:
        _admin(owner, "CLUSTER", "ADDSLOTS", slot)
    deadline = time.monotonic() + 10
    while True:
        try:
            await client.get(other)
            break
        except (RedisError, RedisClusterException):
            assert time.monotonic() < deadline, "the slot was not served again"
            await asyncio.sleep(0.1)
    lease = holder.current_lease
    assert holder.owned() and lease is not None and not lease.lost
    fresh = Lock(client, "reset:fresh")
    assert await fresh.acquire(blocking=False)
    await fresh.release()
    await holder.release()


@contextlib.asynccontextmanager
async def _cluster_and_two_clients(
    server_binary: Path,
) -> AsyncIterator[tuple[list[ServerProcess], RedisCluster, RedisCluster]]:
    """A cluster of 3 primaries with a replica each, and two clients of it — one for the
    holders, one for the waiters (two "processes") — initialized, and closed afterwards."""
    with running_cluster(server_binary, primaries=3, replicas_per_primary=1) as nodes:
        first = nodes[0]
        holding, waiting = (RedisCluster(host=first.host, port=first.port) for _ in range(2))
        try:
            await holding.initialize()
            await waiting.initialize()
            yield nodes, holding, waiting
        finally:
            await holding.aclose()
            await waiting.aclose()


def _primary_and_replica(
    nodes: list[ServerProcess], client: RedisCluster, name: str
) -> tuple[ServerProcess, ServerProcess]:
    """The primary that serves ``name`` and its replica (``running_cluster`` starts the
    replicas after the primaries, round-robin)."""
    served_by = client.get_node_from_key(name)
    assert served_by is not None
    index = [node.port for node in nodes].index(int(served_by.port))
    return nodes[index], nodes[index + len(nodes) // 2]


async def _promoted(replica: ServerProcess, started: float) -> None:
    """Wait until ``replica`` is a primary (at most 30 s after ``started``, monotonic).

    The cluster's own election promotes it about 4 s after its primary failed (node timeout
    2 s); if it has not by 6 s, the replica is told to take over (``CLUSTER FAILOVER
    TAKEOVER``: no vote). Once in a CI run (stop 31, two test passes side by side) the
    election had not promoted it after 30 s; how the replica is promoted is the cluster's
    business, what these tests check is what the client does once it was."""
    told = False
    while "role:master" not in _admin(replica, "INFO", "replication"):
        waited = time.monotonic() - started
        if waited > 6.0 and not told:
            _admin(replica, "CLUSTER", "FAILOVER", "TAKEOVER")
            told = True
        assert waited < 30, "the replica was not promoted:\n" + _admin(replica, "CLUSTER", "NODES")
        await asyncio.sleep(0.1)


@contextlib.contextmanager
def _killed(primary: ServerProcess) -> Iterator[None]:
    """``primary`` is dead (killed) from now on."""
    primary.kill()
    yield


@contextlib.contextmanager
def _hung(primary: ServerProcess) -> Iterator[None]:
    """``primary`` hangs (``SIGSTOP``: its connections stay open, nothing answers) inside."""
    assert primary.pid is not None
    os.kill(primary.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(primary.pid, signal.SIGCONT)


async def _hold_kept_across_a_promotion(
    server_binary: Path,
    name: str,
    fault: Callable[[ServerProcess], contextlib.AbstractContextManager[None]],
    **client_options: Any,
) -> None:
    """A ``Lock`` (8 s lease) held while ``fault`` takes its primary down and the replica is
    promoted: past a lease later it is still held — locally and on the new primary — and
    releases there."""
    with running_cluster(server_binary, primaries=3, replicas_per_primary=1) as nodes:
        first = nodes[0]
        client = RedisCluster(host=first.host, port=first.port, **client_options)
        await client.initialize()
        try:
            primary, replica = _primary_and_replica(nodes, client, name)
            lost: list[object] = []
            lock = Lock(client, name, lease=8.0, on_lost=lost.append)
            assert await lock.acquire(blocking=False)
            started = time.monotonic()
            await asyncio.sleep(0.3)  # replicated
            with fault(primary):
                await _promoted(replica, started)
                await asyncio.sleep(max(0.0, started + 8.0 + 2.0 - time.monotonic()))  # a lease
                lease = lock.current_lease
                assert not lost and lease is not None and not lease.lost
                assert lock.owned() and await lock.locked()
                await lock.release()
                assert not await lock.locked()
        finally:
            await client.aclose()


async def test_holds_survive_a_primary_killed_and_its_replica_promoted(
    server_binary: Path,
) -> None:
    """Regression (contract probe of the cluster topology): when the primary of a held lock
    was killed and its replica promoted, the lease keeper's per-node pipeline kept trying the
    dead node — only redirections were sent through the cluster client — so redis-py never
    refreshed its slot map and the hold was signalled lost at its lease end, while the lock
    was on the new primary all along. A failing node now gets one call through the cluster
    client, which finds the new primary."""
    await _hold_kept_across_a_promotion(server_binary, "{failover}:orders", _killed)


async def test_holds_survive_a_hung_primary_replaced_when_the_client_has_a_socket_timeout(
    server_binary: Path,
) -> None:
    """What README's *Topologies* says of a primary that hangs (``SIGSTOP``: its connections
    stay open, nothing answers) until its replica is promoted: with the client's
    ``socket_timeout`` set, redis-py re-reads its slot map after a timeout, and the keeper's
    renewals (retried until the lease would end) reach the new primary — the hold is kept.
    (Without a ``socket_timeout`` every command to that slot waits on the hung node, and the
    hold is signalled lost at its lease end: documented, not tested.)"""
    await _hold_kept_across_a_promotion(
        server_binary, "{hung}:orders", _hung, socket_timeout=0.5
    )


async def test_a_stopped_primary_costs_only_the_holds_it_serves(server_binary: Path) -> None:
    """Regression (attack pass, stop 26): with one primary SIGSTOPped past a renewal, every
    lease of the client was signalled lost — also those on the running primaries, which had
    renewed them. Two causes: the keeper judged a batch over all nodes only once every node
    had answered (the stopped one: at its bound, after the leases had ended locally); and a
    node that answered ``NOSCRIPT`` (the renewal script not loaded there yet, or flushed) had
    it loaded through the cluster client, which sends ``SCRIPT LOAD`` to every primary and
    waited for the stopped one. Now each node's renewals are judged on their own, and a script
    is loaded on the node that lacks it."""
    with running_cluster(server_binary, primaries=3) as nodes:
        first = nodes[0]
        client = RedisCluster(host=first.host, port=first.port)
        await client.initialize()
        try:
            lost: list[str] = []
            locks = [
                Lock(client, f"stopped:{i}", lease=1.2, on_lost=lambda gone: lost.append(gone.name))
                for i in range(30)
            ]
            for lock in locks:
                assert await lock.acquire(blocking=False)
            victim = nodes[0]
            on_victim = {
                lock.name for lock in locks if _process_of(nodes, client, lock.name) is victim
            }
            assert 0 < len(on_victim) < len(locks)
            for node in nodes:  # every node answers the next renewals NOSCRIPT
                _admin(node, "SCRIPT", "FLUSH")
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(1.6)  # past a lease, short of cluster-node-timeout (2 s)
            finally:
                os.kill(victim.pid, signal.SIGCONT)
            healthy = [lock for lock in locks if lock.name not in on_victim]
            assert not [name for name in lost if name not in on_victim], lost
            assert all(lock.owned() for lock in healthy)
            assert set(lost) == on_victim  # signalled: their node never answered in time
            for lock in healthy:
                assert await lock.locked()
                await lock.release()
        finally:
            await client.aclose()


async def test_waiters_follow_their_lock_to_a_promoted_replica(server_binary: Path) -> None:
    """Regression (known limit of the previous release, then an attack pass on its fix): when
    the primary of a held lock died and its replica was promoted, the waiters stayed on the
    dead node's pub/sub and woke only at their fallback bound — the holder's lease, 30 s here
    — not at the release. A client that only waits sends nothing that would show it the new
    primary, so the hub, unable to reconnect, has the client look the slot up, gives the
    channel up, and the waiters follow it to the new primary.

    Also a regression found on the way: redis-py resets its slot map by "closing" the client
    from its pipelines too — which serve multi-key commands such as ``exists(a, b)`` — and
    that was taken for the user's close: every lock of the client failed ("the redis client
    was closed")."""
    async with _cluster_and_two_clients(server_binary) as (nodes, holding, waiting):
        name = "{failover}:follow"
        primary, replica = _primary_and_replica(nodes, holding, name)
        lock = Lock(holding, name, lease=30.0)
        assert await lock.acquire(blocking=False)
        waiter = asyncio.create_task(_hold_briefly(Lock(waiting, name), timeout=60))
        await asyncio.sleep(0.3)  # replicated; the waiter is subscribed
        started = time.monotonic()
        primary.kill()
        with contextlib.suppress(RedisError, RedisClusterException):
            await waiting.exists(name, "elsewhere")  # a pipeline, reset by the dead node
        await _promoted(replica, started)
        while True:  # the holder's client finds the lock on the new primary
            with contextlib.suppress(RedisError, RedisClusterException, LockError):
                if await lock.locked():
                    break
            assert time.monotonic() - started < 30, "the lock is not on the new primary"
            await asyncio.sleep(0.1)
        channel = lock._policy.keys.channel
        await until(
            lambda: _subscribed_on(replica, channel),
            what="the waiter to follow its lock to the new primary",
            within=10.0,
        )
        assert not waiter.done()
        released = time.monotonic()
        await lock.release()
        assert await asyncio.wait_for(waiter, 10) is True
        assert time.monotonic() - released < 2.0, "the waiter was not woken by the release"


def _migrate_slot(
    nodes: list[ServerProcess],
    slot: int,
    source: ServerProcess,
    target: ServerProcess,
    window: float,
    *,
    source_first: float | None = None,
    split: bool = False,
    move_first: bool = True,
    first: Sequence[bytes] = (),
) -> None:
    """Move ``slot`` from ``source`` to ``target`` the way a live resharding does — IMPORTING /
    MIGRATING, ``MIGRATE`` its keys, then ``SETSLOT NODE`` everywhere — keeping the window
    between the keys' move and the end open ``window`` seconds (blocking: run it in a
    thread). ``source_first``: tell the source of its new owner that many seconds before the
    others (redis-cli tells the target first). ``split``: move only the first key before the
    window, the rest after it (a resharding of a slot with many keys: scripts that touch
    keys on both nodes are refused with ``TRYAGAIN`` meanwhile). ``move_first=False``: move no
    key before the window (the slot MIGRATING with all its keys still on the source).
    ``first``: the keys to move before the window (the rest after it)."""
    import redis as sync_redis

    def connect(node: ServerProcess) -> Any:
        return sync_redis.Redis(host=node.host, port=node.port, socket_timeout=5)

    src, dst = connect(source), connect(target)
    src_id = src.execute_command("CLUSTER", "MYID").decode()
    dst_id = dst.execute_command("CLUSTER", "MYID").decode()
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if first:
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *first)
    elif keys and move_first:
        now = keys[:1] if split else keys
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *now)
    time.sleep(window)
    rest = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if rest:
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *rest)
    if source_first is not None:
        src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        time.sleep(source_first)
    for node in nodes:
        connect(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def _process_of(nodes: list[ServerProcess], client: RedisCluster, name: str) -> ServerProcess:
    node = client.get_node_from_key(name)
    assert node is not None
    return next(proc for proc in nodes if proc.port == node.port)


def _two_slots_of_one_node(
    nodes: list[ServerProcess], client: RedisCluster, prefix: str
) -> tuple[str, str, ServerProcess, ServerProcess]:
    """``(moved, stay, source, target)``: a name whose slot a test moves from ``source`` to
    ``target``, and a name in another slot of ``source`` (which stays)."""
    moved = f"{prefix}:0"
    source = _process_of(nodes, client, moved)
    target = next(p for p in nodes if p is not source)
    stay = next(
        name
        for name in (f"{prefix}:{i}" for i in range(1, 2000))
        if _process_of(nodes, client, name) is source
        and client.keyslot(name) != client.keyslot(moved)
    )
    return moved, stay, source, target


async def test_a_slot_migration_does_not_fail_waits_on_other_slots(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster]
) -> None:
    """Regression (cluster probe: a waiter on a lock whose slot moved to another node made
    the old node answer ``MOVED`` to the hub's re-subscription; the hub took it for a refusal
    (as of an ACL) and failed every unconfirmed channel — a new wait on a lock of another slot,
    which never moved, raised "the server refused to subscribe" — and reconnected in a loop, 12
    connections every 10 s). The moved channel is given up on that node; the others go on."""
    a, b = cluster
    moved, stay, source, target = _two_slots_of_one_node(cluster_nodes, a, "migrate")
    holders = [Lock(a, moved, lease=5.0), Lock(a, stay, lease=5.0)]
    for holder in holders:
        assert await holder.acquire(blocking=False)
    waiting_moved = asyncio.create_task(_hold_briefly(Lock(b, moved), timeout=30))
    await asyncio.sleep(0.3)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(
        None, _migrate_slot, cluster_nodes, a.keyslot(moved), source, target, 0.0
    )
    await asyncio.sleep(1.0)  # the old node drops the shard channel; the hub hears of it
    waiting_stay = asyncio.create_task(_hold_briefly(Lock(b, stay), timeout=10))
    await asyncio.sleep(0.5)
    assert not waiting_stay.done(), waiting_stay  # not failed as "refused"
    released = loop.time()
    await holders[1].release()
    assert await asyncio.wait_for(waiting_stay, 5) is True
    assert loop.time() - released < 1.5, "the other slot's waiter was not woken"
    await holders[0].release()
    # The moved lock's waiter: woken at the latest when the holder's lease would have ended
    # (README, known limits).
    assert await asyncio.wait_for(waiting_moved, 10) is True


@pytest.mark.parametrize("kind", ["lock", "fair", "read", "write", "semaphore"])
async def test_a_fresh_acquire_waits_out_a_slot_migration_window(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster], kind: str
) -> None:
    """Regression (contract probe, stop 19): ``acquire(timeout=10)`` of a free lock whose slot
    was being migrated (its keys split between two nodes: every script refused with
    ``TRYAGAIN``) raised ``LockError("… TTL exhausted.")`` within 0.2 s, though a migration
    is transient (README, Topologies). A fresh acquisition now waits it out within its
    timeout, as a waiter already did."""
    a, _ = cluster
    name = f"window-fresh:{kind}"
    lock = _primitive(kind, a, name)
    assert await lock.acquire(timeout=5.0)  # its auxiliary keys exist: the slot has several
    await lock.release()
    source = _process_of(cluster_nodes, a, name)
    target = next(p for p in cluster_nodes if p is not source)
    loop = asyncio.get_running_loop()
    migrate = functools.partial(
        _migrate_slot, cluster_nodes, a.keyslot(name), source, target, 2.0, split=True
    )
    migrating = loop.run_in_executor(None, migrate)
    try:
        await asyncio.sleep(0.3)  # inside the window
        started = loop.time()
        assert await lock.acquire(timeout=10.0)
        assert loop.time() - started < 6.0
        await lock.release()
    finally:
        await migrating


def _primitive(kind: str, client: RedisCluster, name: str) -> Any:
    if kind == "lock":
        return Lock(client, name, lease=10.0)
    if kind == "fair":
        return FairLock(client, name, lease=10.0)
    if kind == "semaphore":
        return Semaphore(client, name, 2, lease=10.0)
    rw = ReadWriteLock(client, name, lease=10.0)
    return rw.read if kind == "read" else rw.write


async def test_a_slot_migration_keeps_the_pubsub_connection_of_other_slots(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster]
) -> None:
    """Regression (contract probe, stop 19): when a waited-for lock's slot moved away, its
    node refused the hub's re-subscription (``MOVED``) and the hub dropped its whole
    connection to that node — the waiters of every other lock there were away meanwhile
    (presence: a hand-over could skip them, a FairLock waiter went to the back of its line).
    README, Topologies: the hub gives the channel up on the old node; its other channels go
    on."""
    import redis as sync_redis

    a, b = cluster
    moved, stay, source, target = _two_slots_of_one_node(cluster_nodes, a, "keep-conn")
    holders = [Lock(a, moved, lease=10.0), Lock(a, stay, lease=10.0)]
    for holder in holders:
        assert await holder.acquire(blocking=False)
    waiters = [asyncio.create_task(_hold_briefly(Lock(b, n), timeout=30)) for n in (moved, stay)]
    admin = sync_redis.Redis(host=source.host, port=source.port)

    def pubsub_ids() -> set[str]:
        return {str(entry["id"]) for entry in admin.client_list(_type="pubsub")}

    try:
        await asyncio.sleep(0.5)
        before = pubsub_ids()
        assert before, "the waiters' hub is connected to the source node"
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            None, _migrate_slot, cluster_nodes, a.keyslot(moved), source, target, 0.0
        )
        await asyncio.sleep(1.5)  # the old node drops the shard channel; the hub hears of it
        assert before <= pubsub_ids(), "the pub/sub connection to the source node was re-made"
        for holder in holders:
            await holder.release()
        assert await asyncio.wait_for(asyncio.gather(*waiters), 10) == [True, True]
    finally:
        admin.close()
        for holder in holders:
            with contextlib.suppress(LockError):
                await holder.release()


@pytest.mark.parametrize("kind", [Lock, FairLock])
async def test_waiters_of_a_moved_lock_are_woken_on_its_new_node(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster], kind: type[Lock]
) -> None:
    """Regression (known limit of the previous release: the waiters of a lock whose slot
    migrated were not subscribed on its new node — they woke only when the holder's lease
    would have ended, 20 s here — and the waiters parked behind the first one, on the hub that
    gave the channel up, failed with a ``KeyError`` when their turn came). The waiters follow
    the slot: the release on the new node wakes them at once, parked ones included."""
    a, b = cluster
    name = f"follow:{kind.__name__}:0"
    source = _process_of(cluster_nodes, a, name)
    target = next(p for p in cluster_nodes if p is not source)
    holder = kind(a, name, lease=20.0)
    assert await holder.acquire(blocking=False)
    order: list[int] = []

    async def wait_for_it(index: int) -> None:
        async with kind(b, name, lease=5.0, timeout=15):
            order.append(index)

    waiters = [asyncio.create_task(wait_for_it(i)) for i in range(3)]
    await asyncio.sleep(0.3)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(
        None, _migrate_slot, cluster_nodes, a.keyslot(name), source, target, 0.0
    )
    await asyncio.sleep(1.5)  # the old node drops the shard channel; the waiters follow it
    channel = holder._policy.keys.channel
    await until(lambda: _subscribed_on(target, channel), what="the waiters to follow the slot")
    released = loop.time()
    await holder.release()
    await asyncio.wait_for(asyncio.gather(*waiters), 10)
    assert sorted(order) == [0, 1, 2]
    assert loop.time() - released < 3.0, "the waiters were not woken by the release"


async def test_waiters_that_followed_a_moved_lock_leave_no_subscription(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster]
) -> None:
    """Regression (attack pass on the follow: a waiter parked behind the first one kept the
    hub it joined, so when it gave up after the lot moved, it told the old node's hub — the
    new node's hub never started its linger, kept the channel subscribed for good, and made
    ``aclose()`` wait 2 s for waiters that were long gone)."""
    a, b = cluster
    name = "follow:leak:0"
    source = _process_of(cluster_nodes, a, name)
    target = next(p for p in cluster_nodes if p is not source)
    holder = Lock(a, name, lease=30.0)
    assert await holder.acquire(blocking=False)
    loop = asyncio.get_running_loop()
    waiters = []
    for _ in range(2):  # the first waits at the head of the lot, the second parked behind it
        waiters.append(asyncio.create_task(_hold_briefly(Lock(b, name, lease=5.0), 60)))
        await asyncio.sleep(0.3)
    await loop.run_in_executor(
        None, _migrate_slot, cluster_nodes, a.keyslot(name), source, target, 0.0
    )
    channel = holder._policy.keys.channel
    await until(lambda: _subscribed_on(target, channel), what="the waiters to follow the slot")
    for waiter in waiters:  # the first one, then the one parked behind it
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    await holder.release()

    async def unsubscribed() -> bool:
        return not await _subscribed_on(target, channel)

    await until(unsubscribed, what="the channel's linger to end", within=5.0)
    started = loop.time()
    await b.aclose()
    assert loop.time() - started < 1.0, "aclose() waited for waiters that had left"


async def test_a_waiter_that_follows_its_lock_behind_a_newcomer_takes_its_grant(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster]
) -> None:
    """Regression (attack pass on the follow: a waiter registered on the server followed its
    lock to the new node, found a lot a newcomer of its process had made there, and joined it
    at its end — waiting for its turn, deaf to the grant the server then sent it as the oldest
    registration, while the newcomer heard "later" and slept out the claim window: the lock
    stalled ``claim_timeout`` (6 s here) after the release). A grant gives a waiter its turn."""
    holding, waiting = cluster
    name = "follow:newcomer:0"
    holder = Lock(holding, name, lease=3.0)
    assert await holder.acquire(blocking=False)
    source = _process_of(cluster_nodes, holding, name)
    target = next(p for p in cluster_nodes if p is not source)
    loop = asyncio.get_running_loop()
    got: list[float] = []

    async def wait_for_it() -> None:
        lock = Lock(waiting, name, lease=5.0, claim_timeout=6.0)
        assert await lock.acquire(timeout=30)
        got.append(loop.time())
        await lock.release()

    waiters = [asyncio.create_task(wait_for_it())]
    await asyncio.sleep(0.5)  # registered on the old node
    # The new owner is told to the old node 0.6 s before the others: meanwhile the two nodes
    # redirect to each other and the first waiter backs off; a newcomer subscribes first.
    await loop.run_in_executor(
        None,
        functools.partial(_migrate_slot, source_first=0.6),
        cluster_nodes,
        holding.keyslot(name),
        source,
        target,
        0.0,
    )
    waiters.append(asyncio.create_task(wait_for_it()))
    await asyncio.sleep(4.5)  # the move is over; the first waiter re-checked at the holder's TTL
    released = loop.time()
    await holder.release()
    await asyncio.wait_for(asyncio.gather(*waiters), 20)
    assert max(got) - released < 2.0, "the lock stalled after the release"


async def _subscribed_on(node: ServerProcess, channel: str) -> bool:
    from redis.asyncio import Redis

    client = Redis(host=node.host, port=node.port)
    try:
        counts = await client.execute_command("PUBSUB", "SHARDNUMSUB", channel)  # type: ignore[no-untyped-call]
    finally:
        await client.aclose()
    return int(counts[1]) > 0


async def test_a_release_in_a_slot_migration_window_frees_the_lock_after_it(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster]
) -> None:
    """Regression (cluster probe: a release while the lock's slot was being migrated — its
    scripts refused, ``TRYAGAIN``/``ASK``, for as long as the window stays open — was retried
    in the background only about 2 s: a window of 3 s or more left the lock held until its
    lease ended, 21 s after its holder released it). The release is retried until the lease
    would end."""
    a, b = cluster
    name = "window:0"
    source = _process_of(cluster_nodes, a, name)
    target = next(p for p in cluster_nodes if p is not source)
    holder = Lock(a, name, lease=20.0)
    assert await holder.acquire(blocking=False)
    loop = asyncio.get_running_loop()
    migrating = loop.run_in_executor(
        None, _migrate_slot, cluster_nodes, a.keyslot(name), source, target, 3.0
    )
    await asyncio.sleep(0.5)  # inside the window
    with contextlib.suppress(LockError):  # "retried in the background"
        await holder.release()
    await migrating
    closed = loop.time()
    rival = Lock(b, name, lease=5.0)
    assert await rival.acquire(timeout=5.0)
    assert loop.time() - closed < 2.5, "the lock stayed held after its release"
    await rival.release()


@pytest.mark.parametrize("moved", ["holders", "meta"])
async def test_a_semaphore_permit_is_renewed_through_a_split_migration_window(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster], moved: str
) -> None:
    """Bug (helper-80): a semaphore's renewal names its holders and its meta hash (it keeps
    meta alive); in a migration window that had moved one of them and not the other (a slow
    or interrupted resharding), every renewal was refused (``TRYAGAIN``, then redis-py's "TTL
    exhausted") and the permit was lost at its lease's end — a ``Lock``, whose renewal names
    one key, rode through. The renewal now names the holders alone in such a window."""
    a, b = cluster
    name = f"split-renew:{moved}"
    lost: list[Lease] = []
    sem = Semaphore(a, name, 2, lease=2.0, on_lost=lost.append)
    assert await sem.acquire(blocking=False)
    keys = LockKeys.for_name(name, "sem")
    source = _process_of(cluster_nodes, a, name)
    target = next(p for p in cluster_nodes if p is not source)
    migrate = functools.partial(
        _migrate_slot, cluster_nodes, a.keyslot(name), source, target, 4.0,
        first=(keys.key if moved == "holders" else keys.meta,),
    )
    await asyncio.get_running_loop().run_in_executor(None, migrate)
    assert not lost, "the permit was lost in the window"
    assert sem.owned()
    await sem.release()  # (a lost permit's release raises LockLostError)
    assert not await b.exists(keys.key)


async def test_a_release_while_no_node_answers_is_retried_until_they_do(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster]
) -> None:
    """Bug (helper-81): with every node of the cluster stopped, ``release()`` raised redis-py's
    bare ``RedisClusterException`` ("Redis Cluster cannot be connected"), and the release's
    clean-up in the background died of the same exception ("background task failed"): the
    lock stayed held for the rest of its lease after the nodes came back. It is a
    ``LockError`` now ("retried in the background"), and the lock is freed once they answer."""
    _, b = cluster
    first = cluster_nodes[0]
    client = RedisCluster(host=first.host, port=first.port, socket_timeout=0.5)
    await client.initialize()
    lock = Lock(client, "all-stopped", lease=60.0)
    loop = asyncio.get_running_loop()
    try:
        assert await lock.acquire(blocking=False)
        with contextlib.ExitStack() as stack:
            for node in cluster_nodes:
                stack.enter_context(_hung(node))
            stopped = loop.time()
            quick = RedisCluster(host=first.host, port=first.port, socket_timeout=0.05)
            try:
                # (helper-83: redis-py's exception reached the caller of locked() raw)
                with pytest.raises(LockError):
                    await Lock(quick, "all-stopped").locked()
            finally:
                await quick.aclose()
            with pytest.raises(LockError, match="retried in the background"):
                await lock.release()
            await asyncio.sleep(max(0.0, stopped + 4.0 - loop.time()))
        resumed = loop.time()
        rival = Lock(b, "all-stopped")
        assert await rival.acquire(timeout=5.0), "the lock stayed held after the nodes resumed"
        assert loop.time() - resumed < 4.0
        await rival.release()
    finally:
        await client.aclose()


async def test_clean_ups_take_their_turns_per_node(cluster: list[RedisCluster]) -> None:
    """Clean-ups in an outage take turns (one try a second in all: helper-79), but per node:
    a node that does not answer — each of its clean-ups' tries waiting out a socket timeout —
    holds up no clean-up of another node's locks."""
    a, _ = cluster
    names = _names_on_every_node(a, "gates")
    await _hold_briefly(Lock(a, names[0]))  # (the client's runtime)
    runtime = existing_runtime(a)
    assert runtime is not None
    turns = [runtime.undo_turn(name) for name in names]
    assert len({id(turn) for turn in turns}) == len(names)
    assert runtime.undo_turn(names[0]) is turns[0]


def _contents(node: ServerProcess, keys: tuple[str | bytes, ...]) -> dict[object, object]:
    """What ``node`` stores under ``keys`` (TTLs left out; a key missing in a migrating slot
    reads as ``None``: the node answers ``ASK``)."""
    import redis as sync_redis

    admin = sync_redis.Redis(host=node.host, port=node.port, socket_timeout=5)
    seen: dict[object, object] = {}
    try:
        for key in keys:
            try:
                kind = admin.type(key).decode()  # type: ignore[union-attr]
                if kind == "hash":
                    seen[key] = admin.hgetall(key)
                elif kind == "zset":
                    seen[key] = admin.zrange(key, 0, -1, withscores=True)
                else:
                    seen[key] = kind
            except RedisError:  # ASK: not on this node
                seen[key] = None
    finally:
        admin.close()
    return seen


@pytest.mark.parametrize("kind", ["lock", "fair", "write", "semaphore"])
async def test_a_release_in_a_migration_window_changes_nothing_half_way(
    cluster_nodes: list[ServerProcess], cluster: list[RedisCluster], kind: str
) -> None:
    """Regression (stop 25's helper, reproduced in stop 26): with the lock's slot MIGRATING
    and all of its keys still on the source, the release script ran there — and failed half
    way ("Script attempted to access a non local key") at the first command on a key it had
    itself deleted or emptied (the lock's DEL, then its HSET for the hand-over; the last
    waiter's ZREM, then a ZRANGE of the queue), its earlier writes kept: the lock freed but
    handed to nobody, the caller told ``LockError``, a FairLock's head out of its place (the
    second waiter was served first). Every script that may empty a key now declares one that
    never exists: the migrating node refuses it before it runs (``TRYAGAIN``), and the release,
    retried in the background, hands the lock over once the slot has moved."""
    a, b = cluster
    name = f"window-half:{kind}"
    # No renewal rewrites a key while the test compares them: the keeper may renew a new hold
    # early, to put it on its beat (a read/write lock's `wx`, a semaphore holder's score).
    options: dict[str, Any] = {"lease": 30.0, "auto_renew": False}

    def make(client: RedisCluster, side: str = "w") -> Any:
        if kind == "lock":
            return Lock(client, name, **options)
        if kind == "fair":
            return FairLock(client, name, **options)
        if kind == "semaphore":
            return Semaphore(client, name, 1, **options)
        rw = ReadWriteLock(client, name, **options)
        return rw.write if side == "w" else rw.read

    layout = {"lock": "lock", "fair": "lock", "write": "rw", "semaphore": "sem"}[kind]
    keys = LockKeys.for_name(name, layout)
    source = _process_of(cluster_nodes, a, name)
    target = next(p for p in cluster_nodes if p is not source)
    holder = make(a)
    assert await holder.acquire(timeout=5.0)
    assert not await make(b, "r").acquire(timeout=0.2)  # gave up: the `done` key exists
    order: list[int] = []

    async def wait(index: int) -> None:
        lock = make(b, "r")
        assert await lock.acquire(timeout=30.0)
        order.append(index)
        await lock.release()

    waiters = []
    for index in range(2 if kind == "fair" else 1):
        waiters.append(asyncio.create_task(wait(index)))
        await _introspect.until_registered(a, name, index + 1, layout)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    migrate = functools.partial(
        _migrate_slot, cluster_nodes, a.keyslot(name), source, target, 2.0, move_first=False
    )
    migrating = loop.run_in_executor(None, migrate)
    try:
        await asyncio.sleep(0.3)  # inside the window: every key still on the source
        watched = (keys.name, *keys.aux_keys)
        before = _contents(source, watched)
        assert None not in before.values()
        try:
            await holder.release()
        except LockError as exc:  # "retried in the background": the window is still open
            assert "non local key" not in str(exc)
        assert _contents(source, watched) == before, "a script ran half-way"
    finally:
        await migrating
    await asyncio.wait_for(asyncio.gather(*waiters), 10.0)
    assert order == sorted(order), order  # a FairLock's line kept its order


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "observed"])
async def test_scripts_go_straight_to_the_lock_s_node_unless_observed(
    cluster: list[RedisCluster], observed: bool
) -> None:
    """A lock's scripts go straight to the primary that owns its slot, by the short way on a
    connection pool of the library's own for that node (B7: redis-py's cluster path cost a
    hand-over ~60-80 µs per script call) — unless something observes the cluster client's
    commands (a tracer's wrapper, a subclass's override): it then sees them all, as before."""
    client = cluster[0]
    seen: list[object] = []
    if observed:
        real = client.execute_command

        async def spy(*args: Any, **kwargs: Any) -> Any:
            seen.append(args[0])
            return await real(*args, **kwargs)

        client.execute_command = spy  # type: ignore[method-assign]
    names = _names_on_every_node(client, "straight")
    for name in names:
        async with Lock(client, name, auto_renew=False) as lease:
            assert lease.fencing_token > 0
    runtime = existing_runtime(client)
    assert runtime is not None
    used = set(runtime.topology._nodes)  # type: ignore[attr-defined]
    if observed:
        assert seen.count("EVALSHA") == 2 * len(names) and not used
    else:
        assert used == {str(client.get_node_from_key(name).name) for name in names}  # type: ignore[union-attr]


async def test_command_line_on_a_cluster(
    cluster: list[RedisCluster], cluster_nodes: list[ServerProcess]
) -> None:
    """``inspect``, ``list`` and ``force-unlock`` given any node of a cluster: each lock is read
    and freed on the primary serving its slot, ``list`` finds the locks of every primary, and
    a forced unlock wakes the waiter (through the node's sharded channel) at once."""
    from tests.test_cli import cli

    a, b = cluster
    url = f"redis://{cluster_nodes[0].host}:{cluster_nodes[0].port}"
    names = _names_on_every_node(a, "cli")
    held = [Lock(a, name, lease=60.0) for name in names]
    for lock in held:
        assert await lock.acquire(timeout=5)
    sem = Semaphore(a, "{cli}:sem", 2, lease=60.0)
    assert await sem.acquire(timeout=5)
    got, stop = asyncio.Event(), asyncio.Event()

    async def wait_then_hold() -> None:
        async with Lock(b, names[-1], lease=60.0, timeout=30):
            got.set()
            await stop.wait()

    waiting = asyncio.create_task(wait_then_hold())
    try:
        for lock in held:
            lease = lock.current_lease
            assert lease is not None
            result = await cli(url, "inspect", lock.name, "--json")
            assert result.code == 0, result
            view = result.json()
            assert view["kind"] == "lock"
            assert [h["token"] for h in view["holders"]] == [lease.fencing_token]

        listed = await cli(url, "list", "*cli*", "--json")
        assert listed.code == 0, listed
        assert {lock["name"] for lock in listed.json()["locks"]} == {*names, "{cli}:sem"}
        assert not listed.json()["truncated"]
        limited = await cli(url, "list", "*cli*", "--json", "--limit", "2")
        assert len(limited.json()["locks"]) == 2 and limited.json()["truncated"], limited

        victim = held[-1]
        lease = victim.current_lease
        assert lease is not None
        freed = await cli(url, "force-unlock", victim.name, "--yes")
        assert freed.code == 0, freed
        assert f"(token {lease.fencing_token})" in freed.out
        # the waiter's lease-bounded timer is a minute away: only the announcement wakes it
        await asyncio.wait_for(got.wait(), 10)
        with pytest.raises(LockError):
            await victim.release()
        stop.set()
        await asyncio.wait_for(waiting, 10)
        gone = await cli(url, "inspect", victim.name)
        assert gone.code == 1, gone
    finally:
        stop.set()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        for lock in held[:-1]:
            await lock.release()
        await sem.release()
        # (the waiter was woken by the announcement of a forced unlock: it must not be
        # mistaken for one woken by its timer)


async def test_a_client_with_another_encoding_renews_and_wakes_on_a_cluster(
    cluster_nodes: list[ServerProcess],
) -> None:
    """Regression (helper-45, after the UTF-8 keys fix): a ``RedisCluster`` client built with
    ``encoding="latin-1"`` looked a lock's node up from its name in latin-1, not in the UTF-8
    its keys and channel go out in. A name latin-1 cannot encode (``锁``) killed the lease
    keeper — every hold of the client was lost, an ASCII one too; a name whose latin-1 slot
    lies on another node (``résumé``) was subscribed there, refused with ``MOVED``, and its
    waiters re-checked once a second instead of being woken."""
    first = cluster_nodes[0]
    clients = [
        RedisCluster(host=first.host, port=first.port, encoding="latin-1") for _ in range(2)
    ]
    try:
        for client in clients:
            await client.initialize()
        holds = [Lock(clients[0], name, lease=1.5) for name in ("锁", "plain:ascii")]
        for lock in holds:
            assert await lock.acquire(timeout=5)
        await asyncio.sleep(3.0)  # two leases: renewed, or lost
        for lock in holds:
            await lock.release()  # LockLostError if a renewal failed

        holder, waiter = (Lock(client, "résumé", lease=10) for client in clients)
        # (waiting 1.5 s: subscribed — and, before, refused and given up on)
        await woken_by_release([holder], [waiter], waiting_for=1.5, within=0.5)
    finally:
        for client in clients:
            await client.aclose()


async def test_a_cancelled_waits_clean_up_on_a_silent_node_ends(server_binary: Path) -> None:
    """Regression (helper-45): the bound on clean-ups of clients without a ``socket_timeout``
    (see ``test_lock_faults.py::…::test_a_cancelled_waits_clean_up_on_a_silent_connection_ends``)
    missed ``RedisCluster`` clients: a waiter cancelled while its node's connections were
    silent (half-open) left its clean-up waiting for ever, and its registration on the server."""
    name = "orders:7"
    with running_cluster(server_binary, primaries=3) as nodes:
        holder_client = RedisCluster(host=nodes[0].host, port=nodes[0].port)
        await holder_client.initialize()
        node = holder_client.get_node_from_key(name)
        assert node is not None
        proxy = await FaultProxy(node.host, int(node.port)).start()
        quiet: RedisCluster | None = None
        try:
            holder = Lock(holder_client, name, lease=30)
            assert await holder.acquire(timeout=5)
            # The lock's node announces the proxy: the quiet client reaches it through it.
            owner = next(n for n in nodes if n.port == node.port)
            _admin(owner, "CONFIG", "SET", "cluster-announce-port", str(proxy.port))
            with redis.Redis(host=owner.host, port=owner.port) as admin:
                await until(
                    lambda: str(proxy.port) in str(admin.execute_command("CLUSTER", "SLOTS")),
                    what="the node announcing the proxy",
                    within=10.0,
                )
            # (Its slot map read from the lock's node itself: the others learn it by gossip.)
            quiet = RedisCluster(host=owner.host, port=owner.port, socket_timeout=None)
            await quiet.initialize()
            lock = Lock(quiet, name)

            async def wait() -> None:
                await lock.acquire(timeout=60)

            waiting = asyncio.create_task(wait())
            queue = LockKeys.for_name(name).queue
            await until(
                lambda: holder_client.zcard(queue), what="the waiter registered", within=5.0
            )
            assert proxy.blackhole_where(b"") >= 1
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)

            async def unregistered() -> bool:
                return await holder_client.zcard(queue) == 0

            await until(unregistered, what="the cancelled waiter's registration gone", within=12.0)
            proxy.heal()
            await holder.release()
        finally:
            if quiet is not None:
                await quiet.aclose()
            await holder_client.aclose()
            await proxy.close()


@pytest.mark.parametrize("stale_map", [False, True])
async def test_waiters_follow_their_lock_through_a_graceful_failover(
    server_binary: Path, monkeypatch: pytest.MonkeyPatch, stale_map: bool
) -> None:
    """Regression (helper-46): after ``CLUSTER FAILOVER`` the demoted primary stays up as a
    replica and drops its shard subscriptions (an unasked ``SUNSUBSCRIBE``). The hub subscribed
    them again there — a replica accepts them — so the waiters' presence was no longer seen
    by the new primary's scripts: their registrations were taken for away, and a
    ``Semaphore``'s or ``ReadWriteLock``'s waiters were served only at their timers (1.5 to
    2.5 s late here). The hub now asks the node itself and follows the slot to the new
    primary. ``stale_map`` (helper-47): the client's slot map still names the old node — redis-py
    rebuilt it from a node that had not heard of the failover yet (here: the look-up through
    the client learns nothing) — which the first fix trusted, and subscribed on the replica
    again."""
    if stale_map:

        async def learns_nothing(self: Any, key: str) -> None:
            return None

        monkeypatch.setattr(Cluster, "refresh", learns_nothing)
    async with _cluster_and_two_clients(server_binary) as (nodes, holding, waiting):
        tag = "{graceful}"
        primary, replica = _primary_and_replica(nodes, holding, tag)
        held: list[Lock | Semaphore] = [
            Lock(holding, tag + "lock", lease=3),
            Semaphore(holding, tag + "sem", 1, lease=3),
        ]
        waiters: list[Lock | Semaphore] = [
            Lock(waiting, tag + "lock"),
            Semaphore(waiting, tag + "sem", 1),
        ]
        for lock in held:
            assert await lock.acquire(blocking=False)
        waits = [asyncio.create_task(_hold_briefly(lock, timeout=30)) for lock in waiters]
        await asyncio.sleep(0.3)  # subscribed, registered
        _admin(replica, "CLUSTER", "FAILOVER")
        await _promoted(replica, time.monotonic())
        for lock in waiters:
            await until(
                functools.partial(_subscribed_on, replica, lock._policy.keys.channel),
                what=f"{lock.name} to follow its slot to the new primary",
                within=10.0,
            )
        assert not any(task.done() for task in waits)
        released = time.monotonic()
        for lock in held:
            await lock.release()
        for task in waits:
            assert await asyncio.wait_for(task, 10) is True
        assert time.monotonic() - released < 1.0, "a waiter was not woken by the release"
        assert not await _subscribed_on(primary, waiters[0]._policy.keys.channel)
