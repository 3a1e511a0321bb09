"""Sentinel: locks on a Sentinel-managed master (``Sentinel.master_for``), and a failover.

A master, one replica and one Sentinel (quorum 1) of the run's binary on loopback ports. The
client from ``master_for`` is an ordinary ``redis.asyncio.Redis`` whose pool asks the Sentinel
where the master is; after a failover its commands reach the promoted replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.sentinel import Sentinel

from redis_locks_async import Lock, LockError, LockLostError
from tests import _introspect
from tests.servers import ServerProcess
from tests.test_regressions import assert_loops_one_after_another

pytestmark = pytest.mark.timeout(90)

SERVICE = "locks"


class Trio:
    """A master, its replica and a Sentinel watching them."""

    def __init__(self, binary: Path) -> None:
        fast_sync = ["--repl-diskless-sync-delay", "0"]  # default: wait 5 s for more replicas
        self.master = ServerProcess(binary, extra_args=fast_sync).start()
        self.replica = ServerProcess(
            binary,
            extra_args=[*fast_sync, "--replicaof", self.master.host, str(self.master.port)],
        ).start()
        config = (
            f"sentinel monitor {SERVICE} {self.master.host} {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 4000\n"
        )
        self.sentinel = ServerProcess(binary, config=config, extra_args=["--sentinel"]).start()
        self._wait(self._replica_synced, "the replica to sync")
        self._wait(self._replica_known, "the Sentinel to see the replica")

    def cleanup(self) -> None:
        for proc in (self.sentinel, self.replica, self.master):
            proc.cleanup()

    def _replica_synced(self) -> bool:
        with redis.Redis(host=self.replica.host, port=self.replica.port) as replica:
            info = replica.info("replication")
            return bool(info.get("master_link_status") == "up")

    def _sentinel(self) -> redis.Redis:
        return redis.Redis(host=self.sentinel.host, port=self.sentinel.port)

    def _replica_known(self) -> bool:
        with self._sentinel() as sentinel:
            replicas: list[dict[str, Any]] = sentinel.sentinel_slaves(SERVICE)
            return any("s_down" not in str(r.get("flags", "")) for r in replicas)

    def master_port(self) -> int:
        with self._sentinel() as sentinel:
            _, port = sentinel.sentinel_get_master_addr_by_name(SERVICE)
            return int(port)

    def failover(self) -> None:
        with self._sentinel() as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
        self._wait(lambda: self.master_port() == self.replica.port, "the failover")

    def wait_demoted(self) -> None:
        """Wait until Sentinel has turned the old master into a replica."""

        def demoted() -> bool:
            with redis.Redis(host=self.master.host, port=self.master.port) as old:
                return bool(old.info("replication").get("role") == "slave")

        self._wait(demoted, "the old master's demotion")

    @staticmethod
    def _wait(check: Any, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"sentinel set-up: waited {timeout} s for {what}")


@pytest.fixture
def trio(server_binary: Path) -> Iterator[Trio]:
    """A fresh master / replica / Sentinel set per test (a failover changes the roles)."""
    setup = Trio(server_binary)
    try:
        yield setup
    finally:
        setup.cleanup()


@pytest.fixture
async def masters(trio: Trio) -> AsyncIterator[list[Any]]:
    """Two clients (two "processes") of the Sentinel-managed master, closed after the test."""
    address = (trio.sentinel.host, trio.sentinel.port)
    sentinel = Sentinel([address], socket_timeout=2.0)  # type: ignore[no-untyped-call]
    clients = [sentinel.master_for(SERVICE, socket_timeout=2.0) for _ in range(2)]
    try:
        yield clients
    finally:
        for client in clients:
            await client.aclose()
        for connection in sentinel.sentinels:
            await connection.aclose()


async def test_locks_on_a_sentinel_master(masters: list[Any]) -> None:
    """Acquire, wait (pub/sub wake-up), renew and release through ``master_for`` clients."""
    a, b = masters
    holder, waiter = Lock(a, "sentinel:x", lease=0.6), Lock(b, "sentinel:x", lease=30.0)
    assert await holder.acquire(blocking=False)
    got: list[float] = []

    async def contend() -> None:
        assert await waiter.acquire(timeout=20)
        got.append(time.monotonic())
        await waiter.release()

    task = asyncio.create_task(contend())
    await asyncio.sleep(2.0)  # three leases: renewed through the Sentinel-managed pool
    assert not got and holder.owned()
    released = time.monotonic()
    await holder.release()
    await asyncio.wait_for(task, 10)
    assert got[0] - released < 5.0


async def test_a_held_lock_after_a_failover_is_kept_or_lost_loudly(
    trio: Trio, masters: list[Any]
) -> None:
    """Across a failover a held lease is never silently wrong: once the old master has been
    demoted, within a lease the hold is either valid on the new master (its renewals reach
    it) or signalled lost — never "held" locally while the new master has no such owner.

    (Until Sentinel demotes the old master, the client's pooled connections may keep renewing
    there: the usual split-brain window of asynchronous replication. README, *Topologies*.)
    """
    a, b = masters
    lock = Lock(a, "sentinel:failover", lease=2.0)
    assert await lock.acquire(blocking=False)
    lease = lock.current_lease
    assert lease is not None
    await asyncio.sleep(0.3)  # replicated
    await asyncio.to_thread(trio.failover)
    await asyncio.to_thread(trio.wait_demoted)
    await asyncio.sleep(3.0)  # more than a lease after the demotion
    new_master = redis.asyncio.Redis(host=trio.replica.host, port=trio.replica.port)
    try:
        owner = await _introspect.owner_in_redis(new_master, lock.name)
        if not lease.lost:
            assert owner == _introspect.lease_owner_id(lease), "held locally, not on the master"

            async def other() -> bool:
                return await Lock(b, lock.name).acquire(blocking=False)

            assert not await asyncio.create_task(other())
            await lock.release()
            assert await _introspect.owner_in_redis(new_master, lock.name) is None
        else:
            assert owner != _introspect.lease_owner_id(lease)
            with pytest.raises(LockLostError):
                await lock.release()
        # Either way the lock works on the new master.
        fresh = Lock(b, "sentinel:after")
        assert await fresh.acquire(timeout=5)
        await fresh.release()
    finally:
        await new_master.aclose()


async def test_a_sentinel_client_used_on_one_event_loop_after_another(trio: Trio) -> None:
    """Regression (helper-50): a ``master_for`` client used under one ``asyncio.run`` after
    another. The second loop's acquire raised a bare ``RuntimeError('Event loop is closed')``
    after its script had run on the master (redis-py's path sent it on a pooled connection of
    the first loop): no clean-up, and the lock held by nobody for its whole lease."""
    for kind in ("Lock", "Semaphore"):
        await assert_loops_one_after_another(
            f"{trio.sentinel.host}:{trio.sentinel.port}",
            f"loops:{kind}",
            kind,
            f"sentinel:{SERVICE}",
        )


async def test_a_fresh_acquisition_waits_out_a_failover_within_its_timeout(
    trio: Trio, masters: list[Any]
) -> None:
    """Found by helper-50: with the master killed, a fresh ``acquire(timeout=20)`` raised
    ``LockError`` ("No master found", "Error 111 connecting") at once, while Sentinel was
    about to promote the replica — the waiters already waiting rode the failover out. On a
    Sentinel-managed master a failover under way is now waited out within the caller's
    timeout (as a cluster's is); without a timeout left, it still fails at once."""
    a, _ = masters
    assert await Lock(a, "sentinel:warm").acquire(blocking=False)  # a pooled connection
    trio.master.cleanup()  # killed: Sentinel promotes the replica within a few seconds
    with pytest.raises(LockError):
        await Lock(a, "sentinel:try", lease=5.0).acquire(blocking=False)

    async def fresh() -> bool:
        lock = Lock(a, "sentinel:fresh", lease=5.0)
        if not await lock.acquire(timeout=20):
            return False
        await lock.release()
        return True

    assert await asyncio.wait_for(asyncio.create_task(fresh()), 25)
    assert trio.master_port() == trio.replica.port
