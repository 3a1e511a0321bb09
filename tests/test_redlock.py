"""``RedLock`` over 3 and 5 real, independent masters (SPEC §4 RedLock; issue 8).

Five server processes are started once for the module; a test over three uses the first three.
Faults are real: a master killed (SIGKILL), stopped (SIGSTOP, always continued in a
``finally``), restarted empty, or blackholed / slowed by ``tests/faultproxy.py``. After each test
every master is running again (``_heal``). Leases are short (about a second) where expiry or
renewal is the point, so the module stays fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

from redis_locks_async import (
    LockError,
    LockLostError,
    LockNotOwnedError,
    LockTimeout,
    RedLock,
    _fanout,
)
from redis_locks_async._lock import LOCK_ACQUIRE, LOCK_REENTER, LOCK_RELEASE
from redis_locks_async._redlock import EvenMastersWarning
from tests import _introspect as introspect
from tests._workers import assert_exclusive, contend, worker_process
from tests.conftest import ProxyFactory
from tests.faultproxy import FaultProxy
from tests.servers import ServerProcess, running_servers
from tests.test_lock_faults import HoldingTask, rival_takes

REPO = Path(__file__).resolve().parent.parent
MASTERS = 5

Clients = Callable[..., list[aioredis.Redis]]


# --------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def masters(server_binary: Path) -> Iterator[list[ServerProcess]]:
    """Five independent masters for the module (tests over three use the first three)."""
    with running_servers(server_binary, MASTERS) as procs:
        yield procs


@pytest.fixture(autouse=True)
def _heal(masters: list[ServerProcess]) -> Iterator[None]:
    """Every master runs again after each test (resumed, or restarted empty if it died)."""
    try:
        yield
    finally:
        for proc in masters:
            proc.ensure_running()


@pytest.fixture
async def clients(masters: list[ServerProcess]) -> AsyncIterator[Clients]:
    """``clients(n)``: a fresh client per master for the first ``n`` masters (or for the
    ``urls`` given); all closed at teardown."""
    opened: list[aioredis.Redis] = []

    def open_clients(n: int = 3, urls: Sequence[str] | None = None) -> list[aioredis.Redis]:
        chosen = list(urls) if urls is not None else [proc.url for proc in masters[:n]]
        made = [aioredis.Redis.from_url(url, socket_connect_timeout=1.0) for url in chosen]
        opened.extend(made)
        return made

    try:
        yield open_clients
    finally:
        for client in opened:
            await client.aclose()


@pytest.fixture
async def proxies(masters: list[ServerProcess], proxy_factory: ProxyFactory) -> list[FaultProxy]:
    """A fault proxy in front of each of the five masters."""
    return [await proxy_factory(proc.host, proc.port) for proc in masters]


@pytest.fixture
async def inspectors(clients: Clients) -> list[aioredis.Redis]:
    """Direct clients of all five masters, to look at the keys."""
    return clients(MASTERS)


async def until(predicate: Callable[[], Awaitable[bool] | bool], what: str, within: float) -> None:
    """Wait until ``predicate()`` holds (polled every 10 ms); fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.01)


async def holders(inspectors: Sequence[aioredis.Redis], name: str) -> list[str | None]:
    """The owner value of ``name`` on each master (``None`` where the key is absent)."""
    values = []
    for client in inspectors:
        try:
            owner = await asyncio.wait_for(client.hget(name, "owner"), 1.0)
        except (redis.RedisError, OSError, asyncio.TimeoutError):
            owner = None
        values.append(owner.decode() if isinstance(owner, bytes) else owner)
    return values


async def no_key_left(inspectors: Sequence[aioredis.Redis], name: str) -> bool:
    return not any(await holders(inspectors, name))


async def settle(lock: RedLock) -> None:
    """The lock's background clean-ups finish; nothing is held or waited for any more."""
    fan = introspect.redlock_client(lock)
    await introspect.drain(fan, timeout=10.0)
    assert introspect.pending_cleanups(fan) == 0
    assert not introspect.held_leases(fan)
    assert not introspect.local_waiters(fan)


def elapsed_since(start: float) -> float:
    return asyncio.get_running_loop().time() - start


# --------------------------------------------------------------------------------------------
# Validation (before any I/O)
# --------------------------------------------------------------------------------------------


class TestValidation:
    def test_bad_masters(self, clients: Clients) -> None:
        a, b, c = clients(3)
        with pytest.raises(ValueError, match="at least one master"):
            RedLock([], "x")
        with pytest.raises(TypeError, match="list or tuple"):
            RedLock(a, "x")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="same server"):
            RedLock([a, b, a], "x")
        twin = aioredis.Redis(
            host=a.connection_pool.connection_kwargs["host"],
            port=a.connection_pool.connection_kwargs["port"],
        )
        with pytest.raises(ValueError, match="same server"):
            RedLock([a, b, twin], "x")
        # Regression (contract probe, stop 19): two databases of one server counted as two
        # independent masters — one server's failure took two votes.
        other_db = aioredis.Redis(
            host=a.connection_pool.connection_kwargs["host"],
            port=a.connection_pool.connection_kwargs["port"],
            db=1,
        )
        with pytest.raises(ValueError, match="same server"):
            RedLock([a, b, other_db], "x")
        sync = redis.Redis()
        try:
            with pytest.raises(TypeError, match=r"redis\.asyncio"):
                RedLock([a, b, sync], "x")
        finally:
            sync.close()
        with pytest.raises(ValueError, match="empty"):
            RedLock([a, b, c], "")

    def test_one_server_spelled_twice_is_one_master(self, clients: Clients) -> None:
        """Bug (attack pass, stop 30: two holders at once after one restart): a master's port
        given as a string (``port="6390"``, which redis-py accepts) or its host in another
        spelling (``127.1``, upper case) made one server two votes, and two clients of one
        Sentinel-managed master were compared as objects only — with 2 of 3 votes on one
        server, restarting it empty let a second holder in. Now each is the same server."""
        a, b = clients(2)
        host = a.connection_pool.connection_kwargs["host"]
        port = a.connection_pool.connection_kwargs["port"]
        for twin in (
            aioredis.Redis(host=host, port=str(port)),  # type: ignore[arg-type]
            aioredis.Redis(host="127.1" if host == "127.0.0.1" else host.upper(), port=port),
            aioredis.Redis(host=f" {host} ", port=port),
        ):
            with pytest.raises(ValueError, match="same server"):
                RedLock([a, b, twin], "x")
        sentinels = [(host, 26379), ("sentinel-b.example", 26380)]
        first = Sentinel(sentinels).master_for("locks")  # type: ignore[no-untyped-call]
        second = Sentinel(list(reversed(sentinels))).master_for("locks")  # type: ignore[no-untyped-call]
        elsewhere = Sentinel([(host, 26379)]).master_for("other-service")  # type: ignore[no-untyped-call]
        with pytest.raises(ValueError, match="same server"):
            RedLock([first, second, a], "x")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EvenMastersWarning)
            RedLock([first, elsewhere, a, b], "x")  # (another service: another master)

    @pytest.mark.parametrize("bad", [0, -1.0, math.nan, 0.5, math.inf])
    def test_bad_node_timeout(self, clients: Clients, bad: float) -> None:
        with pytest.raises(ValueError, match="node_timeout"):
            RedLock(clients(3), "x", lease=1.0, node_timeout=bad)

    def test_node_timeout_type_and_default(self, clients: Clients) -> None:
        with pytest.raises(TypeError, match="node_timeout"):
            RedLock(clients(3), "x", node_timeout="1")  # type: ignore[arg-type]
        assert RedLock(clients(3), "x", lease=30.0).node_timeout == 0.5
        assert RedLock(clients(3), "x", lease=1.0).node_timeout == 0.05
        lock = RedLock(clients(3), "x", lease=1.0, node_timeout=0.08)
        assert lock.node_timeout == 0.08 and lock.quorum == 2 and len(lock.masters) == 3

    def test_even_number_of_masters_warns(self, clients: Clients) -> None:
        with pytest.warns(EvenMastersWarning, match="odd"):
            RedLock(clients(4), "x")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            RedLock(clients(1), "x")  # one master is odd: no warning


# --------------------------------------------------------------------------------------------
# Quorum acquire, exclusion, re-entry, wake-up
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 5])
class TestQuorum:
    async def test_acquire_sets_one_value_everywhere_and_release_clears(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str, n: int
    ) -> None:
        lock = RedLock(clients(n), name, lease=5.0)
        assert not await lock.locked()
        async with lock as lease:
            # The acquire returns once a quorum answered: a straggler's attempt may still be on
            # its way to the last master (seen twice, on a loaded machine: give it 3 s).
            for _ in range(300):
                values = await holders(inspectors[:n], name)
                if None not in values:
                    break
                await asyncio.sleep(0.01)
            assert values[0] is not None and len(values[0]) >= 32 + 2
            assert len(set(values)) == 1, values  # one random value on every master
            assert await lock.locked()
            assert 0 < lease.remaining() <= 5.0 - (5.0 * 0.01 + 0.002)
            assert lease.fencing_token > 0
            rival = RedLock(clients(n), name, lease=5.0)
            assert not await rival.acquire(blocking=False)
        # The release returns once a quorum confirmed it; the other masters' releases finish
        # in the background. So do the rival's: its failed round is abandoned on every master
        # in the background, and an attempt of that round still on its way to a master that
        # the release reached first takes the key there until the abandon removes it.
        await settle(lock)
        await settle(rival)
        assert await no_key_left(inspectors, name)
        assert not await lock.locked()

    async def test_two_client_sets_exclude_each_other(
        self, clients: Clients, name: str, n: int
    ) -> None:
        locks = [RedLock(clients(n), name, lease=5.0, timeout=20) for _ in range(2)]
        holds: list[tuple[float, float, int]] = []
        loop = asyncio.get_running_loop()

        async def worker(lock: RedLock) -> None:
            for _ in range(8):
                async with lock as lease:
                    start = loop.time()
                    await asyncio.sleep(0.002)
                    holds.append((start, loop.time(), lease.fencing_token))

        await asyncio.wait_for(
            asyncio.gather(*(worker(lock) for lock in locks for _ in range(2))), 40
        )
        holds.sort()
        for (_, end, token), (start, _, later) in itertools.pairwise(holds):
            assert end <= start, "two holds overlapped"
            assert token < later, "fencing tokens did not increase"
        for lock in locks:
            await settle(lock)

    async def test_reentry_transfer_and_not_owned(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str, n: int
    ) -> None:
        masters = clients(n)
        lock = RedLock(masters, name, lease=5.0)
        twin = RedLock(masters, name, lease=5.0)  # same masters: shares the local state
        await lock.acquire()
        assert await twin.acquire(blocking=False)  # re-entry through the other object
        lease = lock.current_lease
        assert lease is not None and lease.hold_count == 2
        await twin.release()
        await lock.release()
        with pytest.raises(LockNotOwnedError):
            await lock.release()

        async with lock:
            done = asyncio.Event()

            async def finish() -> None:
                await done.wait()
                await lock.release()

            worker = asyncio.create_task(finish())
            lock.transfer(worker)
        assert await lock.locked()  # leaving the block released nothing: the worker holds it
        done.set()
        await worker
        await settle(lock)  # the release's stragglers (past the quorum) finish first
        assert await no_key_left(inspectors, name)

    async def test_waiter_wakes_on_release_not_on_expiry(
        self, clients: Clients, name: str, n: int
    ) -> None:
        holder = RedLock(clients(n), name, lease=10.0)
        waiter = RedLock(clients(n), name, lease=10.0)
        await holder.acquire()
        took = await _waiter_gets_it_after(waiter, holder.release, timeout=8, within=5)
        assert took < 1.5  # woken by an announcement, not the 10 s expiry
        await settle(holder)
        await settle(waiter)

    async def test_a_shortened_lease_that_ends_wakes_the_waiter(
        self, clients: Clients, name: str, n: int
    ) -> None:
        """Regression (known limit of the previous release): a holder that shortened its
        lease (``extend(1)`` of a 30 s lease) and stopped renewing announced nothing; the
        waiter slept until the 30 s lease its attempt had seen would have ended."""
        holder = RedLock(clients(n), name, lease=30.0, auto_renew=False)
        waiter = RedLock(clients(n), name, lease=10.0)
        assert await holder.acquire(blocking=False)
        took = await _waiter_gets_it_after(
            waiter, lambda: holder.extend(1.0), timeout=15, within=10
        )
        assert took < 2.0
        with contextlib.suppress(LockLostError):
            await holder.release()
        await settle(holder)
        await settle(waiter)


async def _waiter_gets_it_after(
    waiter: RedLock, action: Callable[[], Awaitable[None]], *, timeout: float, within: float
) -> float:
    """Start ``waiter``'s acquire (timeout ``timeout``), let it find the lock held, then run
    ``action`` (the holder's); seconds from the action's start until the waiter got the lock
    (it releases it at once; its task must end within ``within`` s of the action)."""
    loop = asyncio.get_running_loop()

    async def wait() -> float:
        assert await waiter.acquire(timeout=timeout)
        got_at = loop.time()
        await waiter.release()
        return got_at

    task = asyncio.create_task(wait())
    await asyncio.sleep(0.3)  # the waiter subscribed and found it held
    assert not task.done()
    started = loop.time()
    await action()
    return await asyncio.wait_for(task, within) - started


# --------------------------------------------------------------------------------------------
# Masters down: killed, stopped, blackholed
# --------------------------------------------------------------------------------------------

FAULTS = ["kill", "stop", "blackhole"]
CASES = [(3, 1, True), (3, 2, False), (5, 2, True), (5, 3, False)]


class Down:
    """Takes masters down one way, and brings them back."""

    def __init__(self, how: str, procs: list[ServerProcess], proxies: list[FaultProxy]) -> None:
        self.how, self.procs, self.proxies = how, procs, proxies
        self.down: list[int] = []

    def take(self, indices: Sequence[int]) -> None:
        for i in indices:
            self.down.append(i)
            if self.how == "kill":
                self.procs[i].kill()
            elif self.how == "stop":
                self.procs[i].pause()
            else:
                self.proxies[i].blackhole()

    def restore(self) -> None:
        for i in self.down:
            if self.how == "blackhole":
                self.proxies[i].heal()
            else:
                self.procs[i].ensure_running()
        self.down.clear()


class TestMastersDown:
    @pytest.mark.parametrize("how", FAULTS)
    @pytest.mark.parametrize(("n", "down", "acquires"), CASES)
    async def test_acquires_while_a_majority_lives(
        self,
        masters: list[ServerProcess],
        proxies: list[FaultProxy],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
        how: str,
        n: int,
        down: int,
        acquires: bool,
    ) -> None:
        # node_timeout 0.2 s (lease/10), not 0.1: on a loaded 2-core machine all three live
        # masters once missed 0.1 s in the release (a flake: the library's LockError was right).
        lock = RedLock(
            clients(urls=[p.url for p in proxies[:n]]), name, lease=2.0, node_timeout=0.2
        )
        faults = Down(how, masters, proxies)
        loop = asyncio.get_running_loop()
        try:
            faults.take(range(n - down, n))  # the last masters go down
            started = loop.time()
            got = await lock.acquire(blocking=False)
            took = loop.time() - started
            assert got is acquires
            assert took < lock.node_timeout + 1.0, f"one attempt took {took:.2f} s"
            if acquires:
                live = await holders(inspectors[: n - down], name)
                assert sum(v is not None for v in live) >= lock.quorum
                await lock.release()
            else:
                assert await lock.acquire(timeout=0.4) is False
                with pytest.raises(LockTimeout):
                    async with RedLock(lock.masters, name, lease=2.0, timeout=0.3):
                        pass
        finally:
            faults.restore()
        # Once the masters are back, nothing of ours is left on any of them (what a stopped
        # master received before its stop is cleaned up, or expires with its lease).
        await until(lambda: no_key_left(inspectors, name), "no key left", within=2.0 + 3.0)
        await settle(lock)

    async def test_masters_stopped_past_the_clean_up_time_are_cleaned_when_they_resume(
        self,
        masters: list[ServerProcess],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (contract probe; a hold nobody owns): a failed round's clean-up of a
        stopped master gave up two leases (plus a few seconds) later, taking the master's copy
        for expired — but a stopped master had not run the round's attempt yet: it ran it when
        it resumed, and the key it took lived a whole lease, held by nobody and refused to
        everybody. A master silent all along is now retried until it answers."""
        monkeypatch.setattr(_fanout, "_SWEEP_PATIENCE", 0.2)  # by time: 2.2 s after the round
        monkeypatch.setattr(_fanout, "_SWEEP_BACKOFF", (0.05, 0.1))
        lock = RedLock(clients(3), name, lease=2.0, node_timeout=0.1)
        async with lock:
            pass  # every master connected, the scripts loaded
        masters[1].pause()
        masters[2].pause()
        try:
            assert await lock.acquire(timeout=0.3) is False  # the attempts wait on their sockets
            await asyncio.sleep(4.6)  # past the clean-ups' time (2 leases + 0.2 s)
        finally:
            masters[1].resume()
            masters[2].resume()
        # The resumed masters run the attempts (a key for a lease of 2 s): cleaned up sooner.
        await until(lambda: no_key_left(inspectors, name), "no key left", within=1.5)
        await settle(lock)

    async def test_stopped_master_delays_acquire_by_at_most_node_timeout(
        self, masters: list[ServerProcess], clients: Clients, name: str
    ) -> None:
        """With 2 of 3 masters needed and one stopped, each round waits for the stopped one
        only when it must: a quorum of the others decides at once."""
        lock = RedLock(clients(3), name, lease=3.0, node_timeout=0.2)
        masters[1].pause()
        try:
            loop = asyncio.get_running_loop()
            for _ in range(3):
                started = loop.time()
                assert await lock.acquire(timeout=5)
                assert loop.time() - started < lock.node_timeout + 1.0
                await lock.release()
        finally:
            masters[1].resume()
        await settle(lock)

    async def test_clean_ups_owed_to_a_stopped_master_take_one_connection(
        self,
        masters: list[ServerProcess],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
    ) -> None:
        """Regression (a clean-up task and a pooled connection per release to a silent master):
        every release the stopped master could not confirm started its own background task
        that retried the abandon there until two leases had passed, each try holding one of the
        client's pooled connections to it. 200 quick holds left 200 tasks retrying and the
        master's pool full (100 connections "in use") for two leases; every other command on
        that client failed with "Too many connections". Now one task per master sends
        everything it is owed in one pipeline per pass, and when the master answers again it
        removes whatever of ours reached it."""
        masters_clients = clients(3)
        lock = RedLock(masters_clients, name, lease=5.0, node_timeout=0.05)
        async with lock:
            pass  # every connection pool has a connection, the scripts are loaded
        stopped = masters_clients[1].connection_pool
        masters[1].pause()
        try:
            for _ in range(200):
                async with lock:
                    pass
            # The rounds' requests to the stopped master end with node_timeout; what is left
            # are the clean-ups it is owed: one task, one connection.
            fan = introspect.redlock_client(lock)
            await until(
                lambda: (
                    introspect.pending_cleanups(fan) <= 1 and len(stopped._in_use_connections) <= 1
                ),
                "one clean-up task and one connection for the stopped master",
                within=5.0,  # before the fix: for two leases (10 s)
            )
        finally:
            masters[1].resume()
        await settle(lock)
        assert await no_key_left(inspectors, name)


# --------------------------------------------------------------------------------------------
# Validity, restarts, renewal, cancellation
# --------------------------------------------------------------------------------------------


class TestLease:
    async def test_slow_masters_shorten_the_validity(
        self, proxies: list[FaultProxy], clients: Clients, name: str
    ) -> None:
        lease_s, delay = 10.0, 0.3
        lock = RedLock(
            clients(urls=[p.url for p in proxies[:3]]), name, lease=lease_s, node_timeout=0.8
        )
        await lock.acquire()  # connections made before the delay
        await lock.release()
        proxies[0].delay(delay)
        proxies[1].delay(delay)  # a quorum needs at least one slow master
        try:
            await lock.acquire()
            held = lock.current_lease
            assert held is not None
            assert held.remaining() < lease_s - delay - (lease_s * 0.01 + 0.002)
            assert held.remaining() > lease_s - delay - 1.0
        finally:
            proxies[0].heal()
            proxies[1].heal()
        await lock.release()
        await settle(lock)

    async def test_reentries_through_a_shorter_auto_renewing_redlock_keep_the_holds_end(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        """Bug (helper-77): each re-entry of a hold without renewal through an auto-renewing
        ``RedLock`` of a shorter lease set the masters' lease to the hold's validity (the
        lease less the drift margin), and the hold took the margin off again: 20 re-entries
        cut an hour's hold by 11 minutes on every master."""
        masters = clients(3)
        outer = RedLock(masters, name, lease=3600.0, auto_renew=False)
        inner = RedLock(masters, name, lease=1.0)
        async with outer as lease:
            remaining = lease.remaining()
            for _ in range(20):
                async with inner:
                    pass
            assert lease.remaining() == pytest.approx(remaining, abs=0.5)
            for inspector in inspectors[:3]:
                assert await inspector.pttl(name) > 3_599_000
        await settle(outer)

    async def test_master_restarted_empty_during_a_hold(
        self,
        masters: list[ServerProcess],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
    ) -> None:
        """The documented outcome: the hold lives on while a majority keeps its key; another
        client gets a quorum only once a second master lost it too — and then the first
        holder's next renewal signals the loss."""
        lost: list[object] = []
        lock_clients, rival_clients = clients(3), clients(3)
        lock = RedLock(lock_clients, name, lease=1.0, on_lost=lost.append)
        rival = RedLock(rival_clients, name, lease=1.0)
        # Connections made first: on fresh clients redis-py builds each connection inside the
        # round (milliseconds of CPU each under pytest), and the third master's attempt
        # sometimes missed the 50 ms node_timeout. The hold then stood on masters 0 and 1 only,
        # and restarting master 0 lost it at the first renewal: the documented outcome for a
        # hold on a bare quorum, not the one this test is about.
        for client in (*lock_clients, *rival_clients):
            await client.ping()
        await lock.acquire()
        await until(lambda: _all_set(inspectors[:3], name), "the hold on every master", within=1.0)
        masters[0].restart()
        await asyncio.sleep(1.5)  # longer than the lease: renewals keep it on masters 1 and 2
        assert not lost
        assert not await rival.acquire(blocking=False)
        held = lock.current_lease
        assert held is not None
        owner = introspect.lease_owner_id(held)
        values = await holders(inspectors[:3], name)
        assert [bool(v and v.startswith(owner)) for v in values] == [False, True, True]

        masters[1].restart()
        assert await rival.acquire(timeout=3)  # masters 0 and 1 are free: a quorum
        await until(lambda: bool(lost), "the first holder's loss", within=1.0)
        with pytest.raises(LockLostError):
            await lock.release()
        await rival.release()
        await settle(lock)
        await settle(rival)

    async def test_renewal_keeps_it_past_several_leases(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        # node_timeout 0.1 s, not the default 0.05 s of a 1 s lease: on a loaded 2-core machine
        # a whole round of five masters sometimes missed 50 ms several times in a row.
        lock = RedLock(clients(5), name, lease=1.0, node_timeout=0.1)
        async with lock as lease:
            await asyncio.sleep(3.0)  # three leases
            assert not lease.lost, lease.lost_reason
            # Every master that answered the renewals has it (all five on a quiet machine).
            assert sum(v is not None for v in await holders(inspectors, name)) >= lock.quorum
        await settle(lock)  # the release's stragglers (past the quorum) finish first
        assert await no_key_left(inspectors, name)

    async def test_keys_gone_on_a_majority_is_a_loss(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        lost: list[object] = []
        lock = RedLock(clients(3), name, lease=0.9, on_lost=lost.append)
        await lock.acquire()
        await inspectors[0].delete(name)
        await inspectors[2].delete(name)
        # Signalled within the lease + 1 s (the contract's bound; renewal runs every lease/3,
        # so it usually comes within 0.3 s — a loaded CI machine once took over 1 s).
        await until(lambda: bool(lost), "the loss", within=0.9 + 1.0)
        with pytest.raises(LockLostError):
            await lock.release()
        await until(lambda: no_key_left(inspectors, name), "no key left", within=2.0)
        await settle(lock)

    async def test_majority_unreachable_cancels_guarded_block(
        self, masters: list[ServerProcess], clients: Clients, name: str
    ) -> None:
        lock = RedLock(clients(3), name, lease=1.0)
        loop = asyncio.get_running_loop()
        try:
            with pytest.raises(LockLostError):
                async with lock.guarded():
                    masters[1].pause()
                    masters[2].pause()
                    stopped_at = loop.time()
                    await asyncio.sleep(10)
            assert loop.time() - stopped_at < 1.0 + 0.5  # lost by the end of the lease
        finally:
            masters[1].resume()
            masters[2].resume()
        await settle(lock)

    @pytest.mark.parametrize("lease", [0.6, 1.0])
    async def test_loss_is_signalled_before_a_rival_gets_in(
        self,
        proxies: list[FaultProxy],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
        lease: float,
    ) -> None:
        """Regression (a hold was marked lost only when a renewal round *returned*: with a
        majority unreachable, the rounds fail after ``node_timeout`` and are retried ever
        closer to the lease's end, so the last one was still in flight when the validity ran
        out — the loss came up to ``node_timeout`` late, longer than the drift margin of a
        lease under ~5 s. A rival acquired while the holder's ``guarded()`` block still ran,
        5 to 12 ms, in 5 runs of 5 at a 1 s lease). The loss is told at the validity's end."""
        loop = asyncio.get_running_loop()
        lost_at: list[float] = []
        lock = RedLock(
            clients(urls=[p.url for p in proxies[:3]]),
            name,
            lease=lease,
            on_lost=lambda _: lost_at.append(loop.time()),
        )
        rival = RedLock(inspectors[:3], name, lease=5.0)

        try:
            with pytest.raises(LockLostError):
                async with lock.guarded():
                    proxies[1].blackhole()
                    proxies[2].blackhole()
                    stop_at = loop.time() + lease + 2.0
                    taking = asyncio.create_task(rival_takes(rival, stop_at))
                    await asyncio.sleep(10)  # cancelled when the loss is told
            block_ended_at = loop.time()
            taken_at = await taking
        finally:
            proxies[1].heal()
            proxies[2].heal()
        assert taken_at is not None, "the holder's keys never expired"
        assert lost_at and lost_at[0] <= taken_at, (lost_at, taken_at)
        assert block_ended_at <= taken_at, (block_ended_at, taken_at)
        await settle(lock)
        await settle(rival)

    async def test_extend_to_a_lease_shorter_than_its_round_is_a_loss(
        self, proxies: list[FaultProxy], clients: Clients, name: str
    ) -> None:
        """Regression (an ``extend(shorter)`` that got no quorum — two of three masters
        unreachable — within its own validity raised a plain ``LockError`` from the
        ``QuorumError``, though the shorter lease it may have set on the masters that answered
        had ended and ``remaining()`` said 0: the lease was not marked lost). It raises
        ``LockLostError`` and the lease is lost."""
        lost: list[object] = []
        lock = RedLock(
            clients(urls=[p.url for p in proxies[:3]]),
            name,
            lease=10.0,
            node_timeout=0.3,
            on_lost=lost.append,
        )
        await lock.acquire()
        lease = lock.current_lease
        assert lease is not None
        proxies[1].blackhole()
        proxies[2].blackhole()
        try:
            with pytest.raises(LockLostError):
                await lock.extend(0.1)  # no quorum within node_timeout, longer than 0.1 s
            assert lease.lost and lost and lease.remaining() == 0
        finally:
            proxies[1].heal()
            proxies[2].heal()
        with pytest.raises(LockLostError):
            await lock.release()
        await settle(lock)

    async def test_cancelled_acquire_leaves_nothing_behind(
        self,
        proxies: list[FaultProxy],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
    ) -> None:
        lease_s = 10.0  # (a node timeout of a second: time to cancel in the middle)
        lock = RedLock(
            clients(urls=[p.url for p in proxies[:3]]), name, lease=lease_s, node_timeout=1.0
        )
        for inspector in inspectors[:3]:  # every script known: no NOSCRIPT round trip held
            for source in introspect.script_sources():
                await inspector.script_load(source)
        await lock.acquire()  # connect first
        await lock.release()
        await settle(lock)
        for proxy in proxies[:3]:
            proxy.hold_replies()

        async def take() -> None:
            await lock.acquire()
            await lock.release()

        task = asyncio.create_task(take())
        # The attempt ran on every master (it holds the key there); the replies are held.
        await until(lambda: _all_set(inspectors[:3], name), "the attempt everywhere", within=0.9)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        loop = asyncio.get_running_loop()
        cancelled_at = loop.time()
        for proxy in proxies[:3]:
            proxy.heal()
        # Cleaned up at once (not only when the lease ends).
        await until(lambda: no_key_left(inspectors, name), "no key left", within=2.0)
        assert loop.time() - cancelled_at < lease_s
        assert lock.current_lease is None
        await settle(lock)
        fan = introspect.redlock_client(lock)
        for client in lock.masters:
            await client.aclose()  # closing a master closes the RedLock's runtime
        assert not introspect.background_tasks(fan)


async def _all_set(inspectors: Sequence[aioredis.Redis], name: str) -> bool:
    return all(await holders(inspectors, name))


# --------------------------------------------------------------------------------------------
# Clean-ups (one janitor per master) and fan-outs shared by RedLock objects
# --------------------------------------------------------------------------------------------


async def _busy(admin: aioredis.Redis) -> bool:
    """Whether the master behind ``admin`` answers BUSY (a script runs too long)."""
    try:
        await admin.ping()
    except redis.ResponseError as exc:
        return str(exc).startswith("BUSY")
    return False


async def _idle(admin: aioredis.Redis) -> bool:
    return not await _busy(admin)


async def _any_set(inspectors: Sequence[aioredis.Redis], name: str) -> bool:
    return any(await holders(inspectors, name))


class TestCleanUpsAndSharing:
    async def test_clean_ups_back_off_and_give_up_on_a_busy_master(
        self,
        masters: list[ServerProcess],
        proxies: list[FaultProxy],
        clients: Clients,
        name: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (a master's clean-ups retried at once and for ever what it answered with
        a transient error): a master that answers every command with an error worth retrying
        — BUSY (a long script), LOADING (restarted with a large data set), READONLY (demoted)
        — got the abandon pipeline again the moment the error came back, with no back-off and
        no end: the janitor's give-up (the value's key surely expired) was only checked when
        the whole pipeline failed. ~800 pipelines per second for as long as the master stayed
        busy, and the janitor task, its debts and the acquisition's state lived as long."""
        monkeypatch.setattr(_fanout, "_SWEEP_PATIENCE", 0.2)  # give up 2.2 s after the release
        lock = RedLock(
            clients(urls=[p.url for p in proxies[:3]]), name, lease=1.0, node_timeout=0.1
        )
        async with lock:
            pass  # every master connected, the scripts loaded
        admin, blocker = clients(urls=[masters[1].url, masters[1].url])
        await admin.config_set("busy-reply-threshold", 10)

        async def run_forever() -> object:
            return await blocker.eval("while true do end", 0)  # until SCRIPT KILL

        busy = asyncio.create_task(run_forever())
        try:
            await until(lambda: _busy(admin), "master 1 to answer BUSY", within=5.0)
            fan = introspect.redlock_client(lock)
            sent = proxies[1].stats.bytes_up
            async with lock:
                pass  # master 1 answers the attempt and the release with BUSY: it is owed one
            # (once the release's last master is in: a release sweeps after its stragglers)
            await until(lambda: introspect.redlock_debts(fan) >= 1, "a clean-up owed", within=2.0)
            await until(
                lambda: introspect.redlock_debts(fan) == 0, "the clean-up given up", within=10.0
            )
            # A pass is about 800 bytes: a few passes with back-off, not one per round trip.
            assert proxies[1].stats.bytes_up - sent < 64 * 1024
            await settle(lock)
        finally:
            await admin.script_kill()
            with contextlib.suppress(redis.RedisError):
                await busy
            await until(lambda: _idle(admin), "master 1 to answer again", within=5.0)
            await admin.config_set("busy-reply-threshold", 5000)

    async def test_short_lease_renewed_beside_a_patient_one_with_a_master_stopped(
        self, masters: list[ServerProcess], clients: Clients, name: str
    ) -> None:
        """Regression (one renewal pipeline per master waited the longest node_timeout of the
        batch, for every master): since RedLock objects with different node_timeouts share one
        fan-out — hence one lease keeper — a hold of a short lease is renewed in one batch
        with the holds of a patient lock. Each master's pipeline waited up to the patient
        lock's node_timeout and the batch waited for every master, so one stopped master made
        every renewal of the short hold outlast its own bound (the earliest expiry of the
        batch): all of them failed, and the short hold was lost while two of three masters
        renewed it."""
        masters_clients = clients(3)
        patient = RedLock(masters_clients, f"{name}:patient", lease=10.0, node_timeout=1.0)
        short = RedLock(masters_clients, name, lease=1.0, node_timeout=0.1)
        async with patient, short as lease:
            masters[2].pause()
            try:
                # The patient hold is ripe for renewal (half its renewal period) after 1.7 s:
                # from then on the two are renewed in one batch, and each master's pipeline
                # may take 1 s, past the short lease's bound (2/3 s after a renewal).
                await asyncio.sleep(3.5)
                assert not lease.lost, lease.lost_reason
            finally:
                masters[2].resume()
        await settle(short)

    @pytest.mark.parametrize("how", ["extend", "re-entry"])
    async def test_clean_up_outlasts_a_lease_made_longer(
        self,
        proxies: list[FaultProxy],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
        how: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Regression (a clean-up gave up after two of the *acquiring* leases): the janitor
        stops retrying an abandon once the value's key "has surely expired", which it counted
        from the lease the hold was acquired with. ``extend()`` to a longer lease, or a
        re-entry through a RedLock object with a longer lease (they share holds), makes the
        masters' key live that much longer: a release a partitioned master could not confirm
        was given up on while the key still had most of its lease there, and the key stayed
        after the partition healed. (A stopped master hides it: the passes it missed were
        buffered in its sockets and run when it continues.)"""
        monkeypatch.setattr(_fanout, "_SWEEP_PATIENCE", 0.2)
        masters_clients = clients(urls=[p.url for p in proxies[:3]])
        lock = RedLock(masters_clients, name, lease=1.0, node_timeout=0.1)
        longer = RedLock(masters_clients, name, lease=10.0)
        await lock.acquire()
        if how == "extend":
            await lock.extend(10.0)
        else:
            assert await longer.acquire(timeout=1.0)  # re-entry: the key lives 10 s now
            await longer.release()
        proxies[2].blackhole()
        try:
            await lock.release()  # masters 0 and 1 confirm it; master 2 is owed the abandon
            await asyncio.sleep(3.0)  # past two of the acquiring leases (+ the patience)
        finally:
            proxies[2].heal()
        await settle(lock)
        assert await no_key_left(inspectors, name)

    @pytest.mark.parametrize("how", ["re-entry", "extend"])
    async def test_lease_set_too_late_is_not_held(
        self,
        proxies: list[FaultProxy],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
        how: str,
    ) -> None:
        """Regression (a re-entry or an extend counted when a quorum confirmed it, however
        late): the rounds of a hold wait the ``node_timeout`` of the object that acquired it,
        so a re-entry through a RedLock of a short lease — or an ``extend()`` to one — waits
        up to a tenth of the *acquiring* lease, which may be longer than the new one. Replies
        slower than the new lease left a quorum of keys expired when the round returned:
        ``acquire()`` answered True (or ``extend()`` returned) for a lock another client
        could take at once, and did, while the holder's lease was not yet lost. An extension
        counts only if a quorum made it within its validity (SPEC §4)."""
        masters_clients = clients(urls=[p.url for p in proxies[:3]])
        lock = RedLock(masters_clients, name, lease=30.0, node_timeout=3.0)
        short = RedLock(masters_clients, name, lease=0.5)
        await lock.acquire()
        for proxy in proxies[:3]:
            proxy.delay(0.8)  # every reply comes after the new lease ended
        try:
            with pytest.raises(LockLostError):
                if how == "re-entry":
                    await short.acquire(timeout=10.0)
                else:
                    await lock.extend(0.5)
        finally:
            for proxy in proxies[:3]:
                proxy.heal()
        rival = RedLock(inspectors[:3], name, lease=5.0)
        assert await rival.acquire(timeout=5.0)
        await rival.release()
        with pytest.raises(LockLostError):
            await lock.release()  # the lost hold is the task's until released
        await settle(lock)

    @pytest.mark.parametrize("case", ["held", "in flight", "in flight, no timeout"])
    async def test_close_leaves_no_state_behind(
        self,
        masters: list[ServerProcess],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
        case: str,
    ) -> None:
        """Regression (closing a master's client left the fan-out's bookkeeping behind): the
        state of an acquisition held or in flight when the client closed stayed in the shared
        fan-out for as long as the masters' clients lived. A hold is lost on close and never
        released (nothing may be sent any more); an attempt round cut short by the close
        owed its clean-ups to janitors whose tasks the closed runtime cancelled before they
        started, so those futures were never settled and the acquisition never forgotten."""
        masters_clients = clients(3)
        # A node_timeout beyond the close's grace (2 s): the close cuts the round short.
        lock = RedLock(masters_clients, name, lease=30.0, node_timeout=2.5)
        async with lock:
            pass
        fan = introspect.redlock_client(lock)
        if case == "held":
            await lock.acquire()
            await masters_clients[0].aclose()
            with pytest.raises(LockNotOwnedError):
                await lock.release()
        else:

            async def close_in_flight() -> None:
                await until(lambda: _any_set(inspectors[:1], name), "the attempt", within=5.0)
                await masters_clients[0].aclose()

            masters[1].pause()
            masters[2].pause()
            closer = asyncio.create_task(close_in_flight())
            try:
                with pytest.raises(LockError, match="closed"):
                    await lock.acquire(timeout=10.0 if case == "in flight" else None)
                await closer
            finally:
                masters[1].resume()
                masters[2].resume()
        await until(
            lambda: introspect.redlock_owners(fan) == 0 and introspect.redlock_debts(fan) == 0,
            "the fan-out to forget the acquisition",
            within=5.0,
        )

    @pytest.mark.parametrize("closed", ["one", "all"])
    async def test_a_round_completing_during_the_close_is_undone_on_every_master(
        self,
        proxies: list[FaultProxy],
        clients: Clients,
        inspectors: list[aioredis.Redis],
        name: str,
        closed: str,
    ) -> None:
        """Regression (contract probe, stop 19: a ghost hold on every master for a whole
        lease): a round whose replies arrived after a master's client was closed failed the
        acquisition ("the redis client was closed"), but its keys stayed on all the masters —
        the fan-out's clean-ups ran on the closed runtime, which cancelled them before they
        started. SPEC §4: an acquisition that completes while the client is closing leaves
        nothing held; a failed round is released on every master."""
        masters_clients = clients(urls=[p.url for p in proxies[:3]])
        lock = RedLock(masters_clients, name, lease=30.0)
        async with lock:  # scripts loaded
            pass
        await settle(lock)  # the release's stragglers are in
        # Idle connections ready: once replies are held, a new connection stalls in its handshake.
        await asyncio.gather(*(c.ping() for c in masters_clients for _ in range(3)))
        for proxy in proxies[:3]:
            proxy.hold_replies()

        async def acquire() -> bool:
            return await lock.acquire(timeout=10.0)

        attempt = asyncio.create_task(acquire())
        try:
            await until(lambda: _all_set(inspectors[:3], name), "the round's runs", within=5.0)
            for proxy in proxies[:3]:
                await proxy.wait_held()
            to_close = masters_clients[:1] if closed == "one" else masters_clients
            closing = asyncio.gather(*(c.aclose() for c in to_close))
            await asyncio.sleep(0.05)  # the close is under way
        finally:
            for proxy in proxies[:3]:
                proxy.release_replies()
        await asyncio.wait_for(closing, 5.0)
        with pytest.raises(LockError, match="closed"):
            await asyncio.wait_for(attempt, 5.0)
        assert await no_key_left(inspectors[:3], name), await holders(inspectors[:3], name)
        rival = RedLock(clients(3), name, lease=30.0)
        assert await rival.acquire(blocking=False)
        await rival.release()


# --------------------------------------------------------------------------------------------
# Across processes
# --------------------------------------------------------------------------------------------


async def test_exclusion_across_processes(masters: list[ServerProcess], name: str) -> None:
    urls = ",".join(proc.url for proc in masters[:3])

    def spawn(
        name: str, *args: str, stdin: int | None = None
    ) -> Awaitable[asyncio.subprocess.Process]:
        return worker_process(urls, name, *args, stdin=stdin, redlock=True)

    holds = await contend(spawn, name, ["lock"] * 3, tasks=2, rounds=10)
    assert_exclusive(list(itertools.chain.from_iterable(holds)))


async def test_extend_over_a_wrong_type_key_names_the_key(
    clients: Clients, inspectors: list[aioredis.Redis], name: str
) -> None:
    """Regression (a probe: with the lock's key replaced by a string on every master,
    ``extend()`` said "no quorum to renew: 0 of 3 masters answered in time" — every master had
    answered, with WRONGTYPE — instead of naming the key of the wrong type, as ``Lock`` and
    RedLock's ``release()`` do)."""
    lock = RedLock(clients(3), name, lease=10.0)
    await lock.acquire()
    for inspector in inspectors[:3]:
        await inspector.delete(name)
        await inspector.set(name, "not a lock")
    try:
        with pytest.raises(LockError, match="wrong type") as raised:
            await lock.extend()
        assert name in str(raised.value) and "quorum" not in str(raised.value)
    finally:
        for inspector in inspectors[:3]:
            await inspector.delete(name)
    with pytest.raises(LockLostError):
        await lock.release()
    await settle(lock)


@pytest.mark.parametrize("kind", ["string", "hash"])
async def test_a_round_refused_as_a_wrong_key_changes_nothing(
    clients: Clients, inspectors: list[aioredis.Redis], name: str, kind: str
) -> None:
    """Regression (contract probe, S5): with the user's own key under the lock's name on
    every master, ``acquire`` raised "… nothing was changed", yet the failed round's clean-up
    (an abandon on every master) had written its bookkeeping key beside the user's key. A
    master whose script refused the attempt is no longer swept."""
    for inspector in inspectors[:3]:
        if kind == "string":
            await inspector.set(name, "not a lock")
        else:
            await inspector.hset(name, mapping={"foo": "bar"})
    try:
        with pytest.raises(LockError, match=r"nothing was changed|wrong type|not a lock"):
            await RedLock(clients(3), name).acquire(timeout=0.5)
        await asyncio.sleep(0.3)  # a clean-up in the background would have run by now
        for inspector in inspectors[:3]:
            mine = [key for key in await inspector.keys("*") if name.encode() in key]
            assert mine == [name.encode()]
    finally:
        for inspector in inspectors[:3]:
            await inspector.delete(name)


class TestForeignErrors:
    """A master's command that fails with something other than a server's error (a bug in a
    client library, a wrapper's exception) reaches the caller — and leaves nothing behind."""

    @staticmethod
    def _break(client: aioredis.Redis) -> None:
        async def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("not a server's error")

        client.evalsha = broken  # type: ignore[method-assign]

    async def test_acquire_round_leaves_nothing_behind(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        """Regression (an acquire round cut short by a non-Redis exception of one master kept
        its round value for good): the round raised to the caller as soon as that master
        failed — before the other masters answered — and nothing abandoned what they then
        took. The lock stayed taken on a quorum of masters, held by nobody, until its lease
        ended, and the fan-out kept the acquisition's state (``FanOut._owners``) forever."""
        masters_clients = clients(3)
        lock = RedLock(masters_clients, name, lease=5.0, node_timeout=0.2)
        fan = introspect.redlock_client(lock)
        async with lock:
            pass  # connected, the scripts loaded
        self._break(masters_clients[2])
        try:
            with pytest.raises(RuntimeError, match="not a server's error"):
                await lock.acquire()
        finally:
            del masters_clients[2].evalsha
        # Well within the 5 s lease: only an abandon removes the keys this soon.
        await until(lambda: no_key_left(inspectors[:3], name), "the round abandoned", within=2.0)
        await settle(lock)
        assert introspect.redlock_owners(fan) == 0
        async with lock:  # and free for the next holder
            pass
        await settle(lock)

    async def test_release_round_keeps_no_state(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        """Regression (a final release cut short by a non-Redis exception of one master kept
        the acquisition's state in ``FanOut._owners`` for good): the exception skipped the
        line that ends the hold in the fan-out (``state.value = None``), so when the round's
        last master was in and its sweep settled, the state — still naming a value — was
        never tidied away."""
        masters_clients = clients(3)
        lock = RedLock(masters_clients, name, lease=5.0, node_timeout=0.2)
        fan = introspect.redlock_client(lock)
        await lock.acquire()
        self._break(masters_clients[2])
        try:
            with pytest.raises(RuntimeError, match="not a server's error"):
                await lock.release()
        finally:
            del masters_clients[2].evalsha
        await until(lambda: no_key_left(inspectors[:3], name), "the hold swept", within=2.0)
        await introspect.drain(fan, timeout=10.0)
        assert introspect.redlock_debts(fan) == 0
        assert introspect.redlock_owners(fan) == 0

    async def test_renewal_failure_is_one_masters_failure(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        """Regression (one master's renewal pipeline failing with a non-Redis exception killed
        the fan-out's lease keeper): the exception left ``FanOut.renew_batch`` and ended the
        keeper's task, so the hold was never renewed again yet never marked lost — ``owned()``
        stayed true, ``on_lost`` silent, after its keys had expired on every master. The
        keeper then survived it but lost every hold of the batch, for one master's failure.
        Now it is that master's failure alone: the other two renew the hold."""
        masters_clients = clients(3)
        lost: list[object] = []
        lock = RedLock(masters_clients, name, lease=1.0, node_timeout=0.1, on_lost=lost.append)
        await lock.acquire()

        def broken(*args: object, **kwargs: object) -> Any:
            raise RuntimeError("not a server's error")

        masters_clients[2].pipeline = broken  # type: ignore[method-assign]
        try:
            await asyncio.sleep(1.5)  # past the lease: only renewals keep it
            assert not lost
            assert lock.owned()
            values = await holders(inspectors[:3], name)
            assert sum(v is not None for v in values[:2]) == 2
        finally:
            del masters_clients[2].pipeline
        await lock.release()
        await settle(lock)


class TestPoolExhausted:
    async def test_waiting_on_masters_with_pools_of_one_connection(
        self, masters: list[ServerProcess], name: str
    ) -> None:
        """Regression (attack pass, stop 23): on masters whose pools allow one connection, a
        waiter's subscriptions took each master's only connection for good: the holder's
        release failed (``QuorumError``), the waiter timed out, and the clients' own commands
        failed for ever after. The subscriptions have pools of their own now."""
        # Blocking pools: a command of the test waits while a straggling release or clean-up
        # has the connection (a plain pool of one would refuse it at once).
        pools = [
            aioredis.Redis(
                connection_pool=aioredis.BlockingConnectionPool.from_url(
                    proc.url, max_connections=1, timeout=5
                )
            )
            for proc in masters[:3]
        ]
        try:
            holder = RedLock(pools, name)
            assert await holder.acquire()
            waiter = HoldingTask(RedLock(pools, name), timeout=10)
            await until(
                lambda: introspect.local_waiters(introspect.redlock_client(holder)) == 1,
                "the task waits",
                within=5.0,
            )
            await asyncio.sleep(0.1)
            assert all([await pool.ping() for pool in pools])
            await holder.release()
            assert await waiter.wait_acquired() is not None
            await waiter.end()
            assert all([await pool.ping() for pool in pools])
            await settle(holder)
        finally:
            for pool in pools:
                await pool.aclose()
                await pool.connection_pool.disconnect()

    async def test_renewal_waits_for_a_free_connection(
        self, masters: list[ServerProcess], name: str
    ) -> None:
        """Regression (a RedLock renewal that found no free connection on a quorum's masters
        — their pools at ``max_connections`` in a burst of acquisitions — failed as a
        ``QuorumError`` and the keeper backed off as after failing masters, 0.1 s, 0.2 s,
        0.4 s…; ``Lock`` on one server already tried again within milliseconds). Now a
        quorum failure with an exhausted pool in it is retried every 10 ms as well."""
        pools = [aioredis.Redis.from_url(proc.url, max_connections=2) for proc in masters[:3]]
        try:
            lost: list[object] = []
            lock = RedLock(pools, name, lease=3.0, on_lost=lost.append)
            fan = introspect.redlock_client(lock)
            assert await lock.acquire(blocking=False)
            for client in pools[:2]:  # the test takes every connection itself
                await introspect.retire_lane(client)
            await until(  # (a straggler of the round, past the quorum, may still have one)
                lambda: not any(c.connection_pool._in_use_connections for c in pools[:2]),
                "the round's connections back in their pools",
                within=5.0,
            )
            taken = [
                (pool, await pool.get_connection())  # type: ignore[no-untyped-call]
                for client in pools[:2]
                for pool in [client.connection_pool] * 2
            ]
            before = introspect.renewal_round_trips(fan)
            await asyncio.sleep(1.0 + 0.75)  # the first renewal is due within lease/3 = 1 s
            tries = introspect.renewal_round_trips(fan) - before
            renewed = introspect.renewals(fan)
            for pool, conn in taken:
                await pool.release(conn)
            await until(
                lambda: introspect.renewals(fan) > renewed, "a renewal once free", within=1.0
            )
            # At least 0.75 s with no free connection on two masters of three, tried every
            # 10 ms: dozens of tries (backing off as after errors: four or five).
            assert tries >= 20, tries
            assert not lost and lock.owned()
            await lock.release()
            await settle(lock)
        finally:
            for client in pools:
                await client.aclose()


class TestReleaseSweep:
    async def test_attempt_resent_after_the_release_is_fenced(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        """Regression (a release swept only the masters that did not answer "released", once
        its last master was in): a master whose attempt of the hold was still in flight when
        the hold was released — its reply lost, redis-py's retry (on by default for
        ``Redis(host=...)``) re-sending it — answered the release "released", was not swept,
        and the re-sent attempt then took the key again: a released hold's key stayed on it
        until its lease ended, with every clean-up settled. (Before the release swept after
        its stragglers, the master was swept as one that had not answered when the quorum
        decided.) A master whose attempt of the hold may still be in flight is swept."""
        masters_clients = clients(3)
        lock = RedLock(masters_clients, name, lease=5.0, node_timeout=0.3)
        fan = introspect.redlock_client(lock)
        async with lock:
            pass  # connected, the scripts loaded
        await settle(lock)
        await until(lambda: no_key_left(inspectors[:3], name), "the first hold gone", within=2.0)
        real = masters_clients[2].evalsha
        released_there = asyncio.Event()
        armed = [True]

        async def retrying(sha: str, numkeys: int, *rest: Any) -> object:
            if sha == LOCK_ACQUIRE.sha and armed[0]:
                armed[0] = False
                await real(sha, numkeys, *rest)  # it runs; its reply is lost
                await released_there.wait()
                return await real(sha, numkeys, *rest)  # the client's retry sends it again
            if sha == LOCK_RELEASE.sha and rest[numkeys + 1] == "final":
                await asyncio.sleep(0.01)  # a little slower than the quorum
                try:
                    return await real(sha, numkeys, *rest)
                finally:
                    released_there.set()
            return await real(sha, numkeys, *rest)

        masters_clients[2].evalsha = retrying  # type: ignore[method-assign]
        try:
            async with lock:
                pass
            await asyncio.sleep(0.4)  # the acquire round's last master is in
            await settle(lock)
        finally:
            del masters_clients[2].evalsha
        # Well within the 5 s lease: only a clean-up removes the key this soon.
        assert await no_key_left(inspectors[:3], name), await holders(inspectors[:3], name)
        assert introspect.redlock_owners(fan) == 0


async def _entries(inspectors: Sequence[aioredis.Redis], name: str) -> list[list[str]]:
    """The re-entry fields (``e:<id>``) of ``name`` on each master."""
    found = []
    for client in inspectors:
        fields = [f.decode() if isinstance(f, bytes) else f for f in await client.hkeys(name)]
        found.append(sorted(f for f in fields if f.startswith("e:")))
    return found


class TestStrayEntries:
    """Regression (a cancelled re-entry's undo, and an inner release, finished at a quorum of
    masters: a master where the re-entry ran *after* the undo — the re-entry's command slower
    there — or where the drop timed out, kept the ``e:<id>`` entry for as long as the hold,
    and ``inspect`` showed a wrong hold count). Once every master answered both, the drop is
    sent again to each master it may have missed."""

    async def test_cancelled_reentry_leaves_no_entry(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        masters_clients = clients(3)
        lock = RedLock(masters_clients, name, lease=10.0, node_timeout=0.5)
        await lock.acquire()
        patched = []
        for index, client in enumerate(masters_clients):
            real = client.evalsha
            slow = 0.3 if index == 2 else 0.05

            async def late_reentry(
                sha: str, numkeys: int, *rest: Any, real: Any = real, slow: float = slow
            ) -> object:
                if sha == LOCK_REENTER.sha:
                    await asyncio.sleep(slow)  # the re-entry reaches this master late
                return await real(sha, numkeys, *rest)

            client.evalsha = late_reentry  # type: ignore[method-assign]
            patched.append(client)
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(lock.acquire(), 0.02)  # its undo overtakes it
            await asyncio.sleep(0.6)  # every master answered the re-entry and its undo
            # (then the drop re-sent where it may have been overtaken: a loaded machine
            # delays it past the 0.6 s once in a while — it failed once in a fresh clone.)

            async def no_entries() -> bool:
                return await _entries(inspectors[:3], name) == [[], [], []]

            await until(no_entries, "the re-entry's entries to be dropped", within=3.0)
        finally:
            for client in patched:
                del client.evalsha
        await lock.release()
        await settle(lock)
        assert await no_key_left(inspectors[:3], name)

    async def test_inner_release_that_timed_out_on_a_master_leaves_no_entry(
        self, clients: Clients, inspectors: list[aioredis.Redis], name: str
    ) -> None:
        masters_clients = clients(3)
        # (node_timeout 0.5, not 0.2: on a loaded machine a master answered the set-up's
        # re-entry after 0.2 s once — a fresh-clone run of stop 30 — and kept no entry.)
        lock = RedLock(masters_clients, name, lease=10.0, node_timeout=0.5)
        await lock.acquire()
        await lock.acquire()
        assert await _entries(inspectors[:3], name) == [["e:1"]] * 3
        client = masters_clients[2]
        real = client.evalsha
        armed = [True]

        async def slow_drop(sha: str, numkeys: int, *rest: Any) -> object:
            if sha == LOCK_RELEASE.sha and rest[numkeys + 1] == "entry" and armed[0]:
                armed[0] = False
                await asyncio.sleep(1.0)  # no answer within node_timeout: cancelled
            return await real(sha, numkeys, *rest)

        client.evalsha = slow_drop  # type: ignore[method-assign]
        try:
            await lock.release()  # the inner one: a quorum dropped it
            await until(
                lambda: _no_entries(inspectors[:3], name), "the entry dropped everywhere", 2.0
            )
        finally:
            del client.evalsha
        await lock.release()
        await settle(lock)


async def _no_entries(inspectors: Sequence[aioredis.Redis], name: str) -> bool:
    return not any(await _entries(inspectors, name))


async def test_masters_refusing_the_channel_fail_the_wait(
    masters: list[ServerProcess], clients: Clients
) -> None:
    """Regression (attack on the per-lock refusal, stop 29): when every master refused a
    ``RedLock``'s channel (an ACL that allows its keys but not its channel), the wait took the
    refusals for confirmations and waited deaf — a release on the masters went unheard, the
    waiter retried on its timers until its timeout. It now fails at once with the refusal."""
    user = "deaf-redlock"
    admins = clients(3)
    for admin in admins:
        await admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", user, "reset", "on", ">pw", "~*", "+@all", "resetchannels", "&{ok*"
        )
    try:
        urls = [f"redis://{user}:pw@{proc.host}:{proc.port}" for proc in masters[:3]]
        holder = RedLock(admins, "deaf", lease=10.0)
        assert await holder.acquire(blocking=False)
        waiter = RedLock(clients(urls=urls), "deaf", lease=10.0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(LockError, match="refused to subscribe"):
            await waiter.acquire(timeout=5.0)
        assert loop.time() - started < 2.0
        await holder.release()
    finally:
        for admin in admins:
            await admin.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]


def test_a_run_that_ends_during_a_release_leaves_no_task_behind(
    masters: list[ServerProcess], name: str
) -> None:
    """Bug (helper-65): a ``RedLock`` release returns once a quorum answered; when the
    ``asyncio.run`` ended right after it (its clients left open: a careless user, or clients
    that serve one run after another), the slow master's reply task was cancelled by the run's
    end, and the round's clean-up then started a task nothing would run: "Task was destroyed
    but it is pending!" once collected, its coroutine failing on the closed loop ("Exception
    ignored … Event loop is closed" — an unraisable exception, which fails a pytest run with
    ``filterwarnings = error``). No clean-up is started once the loop is seen ending."""
    clients = [aioredis.Redis.from_url(proc.url) for proc in masters[:3]]
    side = aioredis.Redis.from_url(masters[2].url)

    async def run() -> None:
        lock = RedLock(clients, name)
        assert await lock.acquire()
        sleeping = asyncio.create_task(
            side.execute_command("DEBUG", "SLEEP", "0.3")  # type: ignore[no-untyped-call]
        )
        await asyncio.sleep(0.05)
        await lock.release()  # (the quorum answered; the third master has not)
        assert not sleeping.done()

    async def close() -> None:
        for client in (*clients, side):
            await client.aclose()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(run())
        # The end of asyncio.run: every task left is cancelled, and awaited.
        ending = asyncio.all_tasks(loop)
        for task in ending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*ending, return_exceptions=True))
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        assert not left, left
    finally:
        loop.run_until_complete(close())  # (here only to leave nothing open)
        loop.close()


def test_a_quorum_error_says_how_many_answers_agreed() -> None:
    """Regression (helper-82): "no quorum to reenter: 2 of 3 masters answered in time" read as
    a quorum — one of the two had answered "not held". The message says how many agreed."""
    results: list[object] = [[1, 7, 7, 100], [-1, 0, 0, 0], redis.ConnectionError("reset")]
    error = _fanout._no_quorum(results, "reenter", lambda r: r[0] == 1)  # type: ignore[index]
    assert "2 of 3 masters answered in time, 1 of them agreeing; errors:" in str(error)
