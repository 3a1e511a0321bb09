"""SPEC §6 S4: a lock lost on failover without replica sync, and the replica-sync policy.

A master and one replica of the run's binary. The failure is made deterministic with the
recipe of the spec: stop the replica (SIGSTOP), cut its replication link (``CLIENT KILL TYPE
replica`` on the master), acquire, kill the master, resume the replica and promote it. The
replica never saw the acquisition, so a client of the promoted replica takes the same lock
while the first holder still believes it holds it. With ``replicas=1`` the same acquisition
fails (and gives the lock up) because no replica acknowledges it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from redis_locks_async import Lock, LockError
from tests import _introspect
from tests._lockworker import KINDS, make_lock
from tests.faultproxy import FaultProxy
from tests.servers import ServerProcess
from tests.test_lock_faults import rival_takes

pytestmark = pytest.mark.timeout(60)


class Pair:
    """A master and its replica (synced before the test starts)."""

    def __init__(self, binary: Path) -> None:
        fast_sync = ["--repl-diskless-sync-delay", "0"]  # default: wait 5 s for more replicas
        self.master = ServerProcess(binary, extra_args=fast_sync).start()
        self.replica = ServerProcess(
            binary,
            extra_args=[*fast_sync, "--replicaof", self.master.host, str(self.master.port)],
        ).start()
        deadline = time.monotonic() + 20
        while not self._synced():
            assert time.monotonic() < deadline, "the replica did not sync within 20 s"
            time.sleep(0.05)

    def _synced(self) -> bool:
        with redis.Redis(host=self.replica.host, port=self.replica.port) as replica:
            return bool(replica.info("replication").get("master_link_status") == "up")

    def cut_replica(self) -> None:
        """Stop the replica and drop its link: the master's next writes reach no replica."""
        self.replica.pause()
        with redis.Redis(host=self.master.host, port=self.master.port) as master:
            master.client_kill_filter(_type="replica")

    def fail_over(self) -> None:
        """Kill the master, resume the replica and promote it."""
        self.master.kill()
        self.replica.resume()
        with redis.Redis(host=self.replica.host, port=self.replica.port) as replica:
            replica.replicaof("NO", "ONE")

    def cleanup(self) -> None:
        for proc in (self.replica, self.master):
            proc.cleanup()


@pytest.fixture
def pair(server_binary: Path) -> Iterator[Pair]:
    """A fresh master/replica pair per test (each test kills or pauses one)."""
    setup = Pair(server_binary)
    try:
        yield setup
    finally:
        setup.cleanup()


async def test_failover_without_replica_sync_loses_the_lock(pair: Pair) -> None:
    """The demonstration: without replica sync, a failover at the wrong moment lets a second
    holder in — the acquisition never reached the replica that became the master."""
    old = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    new = aioredis.Redis(host=pair.replica.host, port=pair.replica.port)
    try:
        await asyncio.to_thread(pair.cut_replica)
        first = Lock(old, "s4:orders", lease=5.0)
        assert await first.acquire(blocking=False)
        await asyncio.to_thread(pair.fail_over)
        second = Lock(new, "s4:orders", lease=5.0)
        assert await second.acquire(blocking=False)  # two holders: the lock was lost
        lease = first.current_lease
        assert lease is not None and not lease.lost  # the first holder does not know yet
        assert (second.current_lease or lease).fencing_token != lease.fencing_token
        await second.release()
    finally:
        await new.aclose()
        await old.aclose()


async def test_replica_sync_refuses_an_acquisition_no_replica_has(pair: Pair) -> None:
    """With ``replicas=1`` the same acquisition fails with a ``LockError`` saying how many
    replicas acknowledged it, and the lock is given up on the master."""
    client = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    try:
        await asyncio.to_thread(pair.cut_replica)
        lock = Lock(client, "s4:synced", replicas=1, replica_timeout=0.3)
        started = time.monotonic()
        with pytest.raises(LockError, match="only 0 of 1 replicas acknowledged"):
            await lock.acquire(blocking=False)
        assert time.monotonic() - started < 3.0
        assert not lock.owned()
        await _introspect.drain(client)
        assert await _introspect.owner_in_redis(client, "s4:synced") is None
        assert not await lock.locked()
    finally:
        pair.replica.resume()
        await client.aclose()


async def test_replica_sync_on_an_empty_script_cache_keeps_its_time_and_gives_up_first(
    pair: Pair,
) -> None:
    """Regression (two findings of a contract probe): on a server that did not know the
    renewal script yet (fresh, flushed, restarted, failed over) the renewal-and-``WAIT``
    pipeline failed on the script and was sent again — ``WAIT`` twice, so a failing sync took
    twice ``replica_timeout`` (2.1 s for 1 s); and the ``LockError`` came before the lock was
    given up on the server (a background task), so another client still saw it held."""
    client = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    try:
        await client.script_flush()
        await asyncio.to_thread(pair.cut_replica)
        lock = Lock(client, "s4:flushed", replicas=1, replica_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(LockError, match="only 0 of 1 replicas acknowledged it"):
            await lock.acquire(blocking=False)
        assert time.monotonic() - started < 1.8  # one replica_timeout, and a little
        assert await _introspect.owner_in_redis(client, "s4:flushed") is None  # at once
    finally:
        pair.replica.resume()
        await client.aclose()


async def test_replica_sync_ends_with_the_callers_timeout(pair: Pair) -> None:
    """Review finding: the replica sync waited ``replica_timeout`` (+1 s) whatever the caller's
    ``acquire(timeout=…)``; it now ends with the caller's deadline. Regression (contract probe,
    SPEC §4 "returns within about t"): it was given at least a second — ``timeout=0.2``
    returned after 1.0-1.2 s; now at most 50 ms past the deadline."""
    client = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    try:
        await asyncio.to_thread(pair.cut_replica)
        lock = Lock(client, "s4:deadline", replicas=1, replica_timeout=10.0)
        started = time.monotonic()
        with pytest.raises(LockError, match="replicas acknowledged"):
            await lock.acquire(timeout=0.2)
        assert time.monotonic() - started < 0.2 + 0.4
        await _introspect.drain(client)
        assert not await lock.locked()
    finally:
        pair.replica.resume()
        await client.aclose()


async def test_replica_sync_keeps_the_callers_bound_when_the_server_goes_silent(
    pair: Pair,
) -> None:
    """Bug (helper-59): a server that went silent during the replica sync's ``WAIT`` (a
    partition) made ``acquire(timeout=1)`` (and ``blocking=False``) fail only after 3 s: the
    pipeline was awaited a second past the WAIT, and the give-up a second more. Now the
    caller's bound holds (the WAIT's reply is allowed the server's timer and a round trip)."""
    proxy = await FaultProxy(pair.master.host, pair.master.port).start()
    client = aioredis.Redis(host=proxy.host, port=proxy.port)
    try:
        await asyncio.to_thread(pair.cut_replica)
        for name, limit in (("s4:silent-wait", 1.0), ("s4:silent-try", None)):
            lock = Lock(client, name, replicas=1, replica_timeout=10.0)
            assert not await lock.locked()  # (connected, the scripts' keys warmed up)

            async def partition() -> None:
                await asyncio.sleep(0.3)
                proxy.blackhole()

            cut = asyncio.create_task(partition())
            started = time.monotonic()
            with pytest.raises(LockError, match=r"replica sync failed.*no reply within"):
                if limit is None:
                    await lock.acquire(blocking=False)  # (a try allows the sync a second)
                else:
                    await lock.acquire(timeout=limit)
            assert time.monotonic() - started < 1.0 + 0.5, name
            await cut
            assert not lock.owned()
            assert not _introspect.held_leases(client)
            proxy.heal()
    finally:
        pair.replica.resume()
        await client.aclose()
        await proxy.close()


async def test_replica_sync_that_outlasts_the_lease_fails(pair: Pair) -> None:
    """Bug (helper-59): with ``auto_renew=False`` and a lease shorter than the WAIT, the
    acquisition returned True — ``lease.replicas == 1`` — for a lease that had ended during
    the WAIT (``on_lost`` had run, and a rival held the lock). It fails now, and leaves no
    hold behind."""
    client = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    rival_client = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    lost: list[object] = []
    try:
        lock = Lock(
            client,
            "s4:short",
            lease=0.3,
            auto_renew=False,
            replicas=1,
            replica_timeout=3.0,
            on_lost=lost.append,
        )
        async with Lock(client, "s4:warm", replicas=1):  # (the renewal script is loaded)
            pass
        pair.replica.pause()  # the link stays: the replica acknowledges once resumed
        resume = asyncio.get_running_loop().call_later(1.0, pair.replica.resume)
        rival = Lock(rival_client, "s4:short", lease=5.0)
        loop = asyncio.get_running_loop()
        contender = asyncio.create_task(rival_takes(rival, loop.time() + 5.0))
        try:
            with pytest.raises(LockError, match="lease ended while the replicas were awaited"):
                await lock.acquire(timeout=5)
            taken = await asyncio.wait_for(contender, 5)
            assert taken is not None  # (the lock was free to take)
        finally:
            resume.cancel()
            pair.replica.resume()
            contender.cancel()
        assert lost  # (its loss was signalled when the lease ended)
        assert not lock.owned()
        assert lock.current_lease is None  # nothing left to release
    finally:
        await rival_client.aclose()
        await client.aclose()


async def test_cancelled_during_replica_sync_holds_nothing(pair: Pair) -> None:
    """Cancelling an acquisition while it waits for its replicas gives the lock up: the
    caller gets its ``CancelledError`` and no ghost holds the lock."""
    client = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    try:
        await asyncio.to_thread(pair.cut_replica)
        lock = Lock(client, "s4:cancelled", replicas=1, replica_timeout=5.0)

        async def take() -> None:
            await lock.acquire(blocking=False)

        task = asyncio.create_task(take())
        await asyncio.sleep(0.3)  # the lock is taken; WAIT is waiting for the replica
        assert await lock.locked()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _introspect.drain(client)
        assert not await lock.locked()
        assert not _introspect.held_leases(client)
    finally:
        pair.replica.resume()
        await client.aclose()


async def test_replica_sync_reports_the_acknowledgements(pair: Pair) -> None:
    """With a live replica the acquisition succeeds and the lease says how many replicas
    acknowledged it; the replica has the lock. Handed-over acquisitions are synced too."""
    client = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    replica = aioredis.Redis(host=pair.replica.host, port=pair.replica.port)
    try:
        lock = Lock(client, "s4:ok", replicas=1)
        async with lock as lease:
            assert lease.replicas == 1
            owner = _introspect.lease_owner_id(lease)
            assert await _introspect.owner_in_redis(replica, "s4:ok") == owner

            async def wait_for_it() -> int | None:
                async with Lock(client, "s4:ok", replicas=1) as handed:
                    return handed.replicas

            waiter = asyncio.create_task(wait_for_it())
            await asyncio.sleep(0.2)
        assert await asyncio.wait_for(waiter, 10) == 1
        # WAITAOF counts replicas that fsynced their append-only file: these run without one
        # (and Redis 7.0 has no WAITAOF): the acquisition fails and is given up.
        aof = Lock(client, "s4:aof", replicas=1, replica_timeout=0.2, replica_fsync=True)
        with pytest.raises(LockError, match="replica"):
            await aof.acquire(blocking=False)
        await _introspect.drain(client)
        assert not await aof.locked()
        assert Lock(client, "s4:plain").current_lease is None
        async with Lock(client, "s4:plain") as plain:
            assert plain.replicas is None
    finally:
        await replica.aclose()
        await client.aclose()


async def test_the_renewal_replica_sync_waits_on_always_reaches_the_replication_stream(
    pair: Pair,
) -> None:
    """Bug (a suspicion of helper-59, shown at the script level): replica sync pipelines the
    kind's renewal and a ``WAIT``, which counts acknowledgements of the *connection's* last
    write that reached the replication stream. ``sem_renew.lua`` run in the same server
    millisecond as the write it renews (a hand-over, an acquisition on another pooled
    connection) changed nothing — the same score, a TTL already long enough — so nothing
    was propagated, and the ``WAIT`` counted a stopped replica that had acknowledged some
    earlier write (Valkey 8.1: 3 of 12 tries). Every kind's renewal now always writes."""
    client = aioredis.Redis(host=pair.master.host, port=pair.master.port)
    kinds: dict[str, Any] = {
        kind: make_lock(kind, client, f"s4:{kind}", permits=2, lease=5.0, auto_renew=False)
        for kind in KINDS
    }
    for lock in kinds.values():
        await client.script_load(lock._policy.renew("x", 5.0, None).script.code)
    await asyncio.to_thread(pair.replica.pause)  # the link stays: the master counts it
    counted: dict[str, int] = {}
    try:
        for label, lock in kinds.items():
            counted[label] = 0
            for _ in range(25):
                # A connection that never wrote: every replica has acknowledged "its last
                # write", so WAIT counts the stopped one unless the renewal propagates.
                other = aioredis.Redis(
                    host=pair.master.host, port=pair.master.port, single_connection_client=True
                )
                try:
                    await other.ping()
                    assert await lock.acquire()
                    assert lock.current_lease is not None
                    owner = _introspect.lease_owner_id(lock.current_lease)
                    call = lock._policy.renew(owner, 5.0, None)
                    # (right after the acquisition: often in the same server millisecond)
                    await other.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
                    counted[label] += await other.execute_command(  # type: ignore[no-untyped-call]
                        "WAIT", 1, 20
                    )
                    await lock.release()
                finally:
                    await other.aclose()
        assert counted == dict.fromkeys(counted, 0)
    finally:
        pair.replica.resume()
        await client.aclose()


def test_replica_arguments_are_checked() -> None:
    """Bad replica-sync arguments fail at construction, before any I/O."""
    client = aioredis.Redis()
    with pytest.raises(ValueError, match="replicas"):
        Lock(client, "x", replicas=-1)
    with pytest.raises(TypeError, match="replicas"):
        Lock(client, "x", replicas=True)
    with pytest.raises(ValueError, match="replica_timeout"):
        Lock(client, "x", replicas=1, replica_timeout=0)
    with pytest.raises(TypeError, match="replica_fsync"):
        Lock(client, "x", replica_fsync=1)  # type: ignore[arg-type]
