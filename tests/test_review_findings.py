"""Regression tests from a hostile review of RedLock, the cluster topology, replica sync and
``max_hold`` (and their compositions with the core). Each test's docstring names the bug and
the scenario that exposed it; a test marked ``xfail(strict=True)`` documents a bug that is not
fixed yet (it must keep failing until it is).
"""

from __future__ import annotations

import asyncio
import gc
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from redis_locks_async import Lock, LockError, LockLostError, RedLock
from tests.conftest import ProxyFactory
from tests.faultproxy import FaultProxy
from tests.servers import ServerProcess, running_servers

Clients = Callable[..., list[aioredis.Redis]]


@pytest.fixture(scope="module")
def masters(server_binary: Path) -> Iterator[list[ServerProcess]]:
    """Three independent masters for the module."""
    with running_servers(server_binary, 3) as procs:
        yield procs


@pytest.fixture(autouse=True)
def _heal(masters: list[ServerProcess]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in masters:
            proc.ensure_running()


@pytest.fixture
async def clients(masters: list[ServerProcess]) -> AsyncIterator[Clients]:
    """``clients(**kwargs)``: a fresh client per master; all closed at teardown."""
    opened: list[aioredis.Redis] = []

    def open_clients(**kwargs: object) -> list[aioredis.Redis]:
        made = [
            aioredis.Redis.from_url(proc.url, socket_connect_timeout=1.0, **kwargs)  # type: ignore[arg-type]
            for proc in masters
        ]
        opened.extend(made)
        return made

    try:
        yield open_clients
    finally:
        for client in opened:
            await client.aclose()


@pytest.fixture
async def proxies(masters: list[ServerProcess], proxy_factory: ProxyFactory) -> list[FaultProxy]:
    """A fault proxy in front of each master."""
    return [await proxy_factory(proc.host, proc.port) for proc in masters]


@pytest.fixture
def name() -> str:
    return f"review:{secrets.token_hex(6)}"


async def _until(
    probe: Callable[[], Awaitable[object]], wanted: object, what: str, within: float
) -> None:
    """Poll ``probe()`` every 50 ms until it returns ``wanted``; fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if await probe() == wanted:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.05)


async def _hold_elsewhere(
    others: list[aioredis.Redis], name: str
) -> tuple[asyncio.Task[None], asyncio.Event]:
    """A task holding ``name`` through other clients (another process, as far as the locks
    under test can tell), until the returned event is set."""
    held, done = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with RedLock(others, name):
            held.set()
            await done.wait()

    task = asyncio.create_task(hold())
    await asyncio.wait_for(held.wait(), 5)
    return task, done


class TestRedLockObjects:
    async def test_redlock_per_call_does_not_exhaust_the_pool(
        self, clients: Clients, name: str
    ) -> None:
        """Bug: a ``RedLock`` built per call (per request) leaked one pooled connection per
        master every time it waited: each object's fan-out (kept only weakly) opened its own
        pub/sub connections and was garbage-collected without closing them, so they stayed
        "in use" in the masters' pools. With ``max_connections`` the pools ran dry and every
        command on those clients (a plain PING) failed with ``MaxConnectionsError``."""
        masters = clients(max_connections=4)
        task, done = await _hold_elsewhere(clients(), name)
        try:
            for _ in range(6):
                lock = RedLock(masters, name)
                assert not await lock.acquire(timeout=0.2)
                del lock
                gc.collect()
            assert await asyncio.wait_for(masters[0].ping(), 5)
        finally:
            done.set()
            await task

    async def test_reentry_through_a_redlock_with_another_lease(
        self, clients: Clients, name: str
    ) -> None:
        """Regression (RedLock objects shared holds only with the same fan-out: the same
        masters in the same order and the same node_timeout). Bug: re-entry through another
        ``RedLock`` object on the same masters deadlocked the holder against itself when the
        other object had a different lease (its default ``node_timeout`` differed, so it got
        a fan-out of its own with an empty table of holds) or listed the masters in another
        order: ``acquire()`` waited for a lock the calling task held, until its timeout (for
        ever without one). ``Lock`` re-enters through any object on the same client, whatever
        its lease."""
        masters = clients()
        first = RedLock(masters, name, lease=30.0)
        other = RedLock(masters, name, lease=5.0)
        reordered = RedLock(list(reversed(masters)), name, lease=30.0)
        async with first:
            assert await other.acquire(timeout=1.0)
            await other.release()
            assert await reordered.acquire(timeout=1.0)
            await reordered.release()


class TestExtend:
    async def test_failed_shorter_extend_does_not_leave_a_stale_valid_lease(
        self, clients: Clients, proxies: list[FaultProxy], name: str
    ) -> None:
        """Bug: ``extend(shorter)`` that fails after it may have run (replies late or lost:
        here two of three masters apply it but answer after ``node_timeout``) raised, and the
        hold kept the local expiry of the old lease. The masters' keys expired with the short
        lease, another client took the lock, and the first holder still saw itself as the
        valid owner (``lost`` false, ~28 s ``remaining()``) until its next renewal, a third of
        the old lease later: two holders at once, the loss unsignalled."""
        via_proxies = [
            aioredis.Redis.from_url(proxy.url, socket_connect_timeout=1.0) for proxy in proxies
        ]
        direct = clients()
        lock = RedLock(via_proxies, name, lease=30.0)
        try:
            async with lock as lease:
                await lock.extend()  # the renewal script is known everywhere from now on
                for client in via_proxies:
                    await client.ping()  # and each pool has a connected connection
                proxies[1].hold_replies()
                proxies[2].hold_replies()
                with pytest.raises(LockError):
                    await lock.extend(1.0)
                for proxy in proxies:
                    proxy.heal()
                await asyncio.sleep(1.5)
                other = RedLock(direct, name, lease=30.0)
                taken = await other.acquire(blocking=False)
                if taken:
                    await other.release()
                # Either the hold is still the quorum's (its renewal restored it), or its
                # loss has been signalled — never both "valid here" and "taken there".
                assert not (taken and not lease.lost), (
                    f"another client took {name!r} while the holder's lease says it is valid "
                    f"for {lease.remaining():.1f} s more"
                )
        except LockError:
            pass  # leaving the block after the loss
        finally:
            for client in via_proxies:
                await client.aclose()


class TestLostOnAMajority:
    async def test_lost_reentry_gives_up_the_minority_copies(
        self, clients: Clients, name: str
    ) -> None:
        """Bug: a re-entry (or ``extend``) that finds the hold gone on a majority of masters
        signalled the loss but left the copy on the minority alone — keyed by nobody, kept for
        the whole lease (a master fewer for every other client, one failure from no quorum),
        and the fan-out's record of the owner was never dropped (a small leak per loss).
        Scenario: two of three masters lose the key (restarted empty; here an external
        ``DEL``), the holder re-enters, gets ``LockLostError`` and leaves its block."""
        masters, direct = clients(), clients()
        lock = RedLock(masters, name, lease=30.0)
        with pytest.raises(LockLostError):
            async with lock:
                await direct[0].delete(name)
                await direct[1].delete(name)
                await lock.acquire()
        await _until(lambda: direct[2].exists(name), 0, "the minority's copy to go", 5.0)


class TestMaxHold:
    async def test_reentry_does_not_carry_the_hold_past_max_hold(
        self, clients: Clients, name: str
    ) -> None:
        """Bug: a re-entry renewed the server's lease to the full ``lease`` without looking at
        ``max_hold`` (``extend()`` refuses that), so re-entering shortly before the cap kept
        the lock held — on the server and locally, not lost — well past ``max_hold``.
        Scenario: lease 1 s, max_hold 1.2 s, re-enter at 0.8 s, look at 1.5 s."""
        client = clients()[0]
        lock = Lock(client, name, lease=1.0, max_hold=1.2)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await lock.acquire()
        lease = lock.current_lease
        assert lease is not None
        await asyncio.sleep(0.8)
        assert await lock.acquire()
        await asyncio.sleep(max(0.0, start + 1.6 - loop.time()))
        assert lease.lost, f"still held {loop.time() - start:.2f} s after acquiring (max_hold 1.2)"
        assert not await client.exists(name)

    def test_max_hold_below_the_lease_is_refused(self) -> None:
        """Bug: ``max_hold`` shorter than ``lease`` was accepted, and the hold then lasted the
        whole lease (the acquisition itself sets it), e.g. 5 s for ``max_hold=0.5`` — the cap
        silently meant nothing. It must be refused at the call (a ``ValueError``)."""
        with pytest.raises(ValueError, match="max_hold"):
            Lock(aioredis.Redis(), "x", lease=5.0, max_hold=0.5)


class TestOneMasterRefusing:
    async def test_a_master_refusing_writes_does_not_fail_waiting_acquires(
        self, clients: Clients, name: str
    ) -> None:
        """Bug: one master of three that refuses the script (here out of memory under
        ``maxmemory`` with ``noeviction``; a wrong-type key under the name does the same) made
        every *contended* RedLock acquire raise ``LockError`` at once instead of waiting, while
        an uncontended acquire on the same masters succeeded: a failed round re-raised any
        non-transient error of any master, although the quorum tolerates N - quorum failed
        masters."""
        masters, others = clients(), clients()
        await masters[2].config_set("maxmemory-policy", "noeviction")
        await masters[2].config_set("maxmemory", "1")
        try:
            task, done = await _hold_elsewhere(others, name)
            lock = RedLock(masters, name)
            try:
                for _ in range(3):
                    assert not await lock.acquire(timeout=0.3)
            finally:
                done.set()
                await task
            assert await lock.acquire(timeout=5)
            await lock.release()
        finally:
            await masters[2].config_set("maxmemory", "0")

    async def test_a_wrong_type_key_on_every_master_is_still_an_error(
        self, clients: Clients, name: str
    ) -> None:
        """The guard of the fix above: refused on every master, no quorum is possible and the
        caller hears why (a ``LockError`` naming the key), without waiting for its timeout."""
        masters = clients()
        for client in masters:
            await client.set(name, "not a lock")
        with pytest.raises(LockError, match=r"wrong|type|WRONGTYPE"):
            await RedLock(masters, name).acquire(timeout=5)

    async def test_release_names_a_wrong_type_key_on_every_master(
        self, clients: Clients, name: str
    ) -> None:
        """Regression (contract probe, SPEC §3 "a key of the wrong type under a lock's name is
        a LockError that names the key"): a hold whose key was replaced by another type on
        every master released with "cannot confirm the release (network:QuorumError): it is
        retried in the background" — no key named, and a network blamed."""
        masters, direct = clients(), clients()
        lock = RedLock(masters, name, lease=30.0)
        await lock.acquire()
        for client in direct:
            await client.delete(name)
            await client.set(name, "not a lock")
        with pytest.raises(LockError) as info:
            await lock.release()
        assert f"key '{name}'" in str(info.value), info.value
        assert "QuorumError" not in str(info.value)
        assert not lock.owned()
        for client in direct:
            assert await client.get(name) == b"not a lock"
        # And ``locked()`` (it asked ``EXISTS``: True) names it too.
        with pytest.raises(LockError) as info:
            await lock.locked()
        assert f"key '{name}'" in str(info.value), info.value


class TestLateExtensionOfALock:
    @pytest.mark.parametrize("how", ["re-entry", "extend"])
    async def test_lease_set_too_late_is_not_held(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
        how: str,
    ) -> None:
        """Regression (an extension confirmed after the lease it set ended counted as held).
        Bug: a ``Lock`` re-entered through a ``Lock`` object of a shorter lease, or
        extended to a shorter lease, whose reply arrives after that lease ended: the core
        takes the reply as success — ``acquire()`` returns True, ``extend()`` returns — and
        the lease, with nothing left (``remaining()`` 0), is not lost until the lease keeper
        notices. The key is already gone and another client takes the lock meanwhile. (The
        same for ``RedLock`` is fixed in its fan-out, where an extension counts only within
        its validity.)"""
        lock = Lock(proxied, name, lease=30.0)
        short = Lock(proxied, name, lease=0.5)
        await lock.acquire()
        fault_proxy.delay(0.8)  # the reply comes after the new lease ended
        try:
            with pytest.raises(LockLostError):
                if how == "re-entry":
                    await short.acquire(timeout=10.0)
                else:
                    await lock.extend(0.5)
        finally:
            fault_proxy.heal()
        rival = Lock(client, name)
        assert await rival.acquire(timeout=5.0)
        await rival.release()
