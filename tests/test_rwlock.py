"""``ReadWriteLock``: shared readers, exclusive writers, downgrade, refused upgrade, writer
preference, independent reader leases — against a real server."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from redis_locks_async import LockError, ReadWriteLock
from tests import _introspect as introspect
from tests._workers import readline, reap, worker_process
from tests.test_lock_faults import HoldingTask, park_unregistered, try_once, until
from tests.test_regressions import key_label

if TYPE_CHECKING:
    from tests.conftest import Connect
    from tests.faultproxy import FaultProxy
    from tests.servers import ServerProcess


class TestReadWriteLock:
    async def test_readers_share_and_a_writer_waits_for_them(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        rw = ReadWriteLock(client, name)
        other = ReadWriteLock(connect(), name)
        async with rw.read as first, other.read as second:
            assert first.fencing_token != second.fencing_token
            assert await rw.write.locked() and not await rw.read.locked()
            assert not await ReadWriteLock(connect(), name).write.acquire(blocking=False)
        writer = ReadWriteLock(connect(), name).write
        assert await writer.acquire(blocking=False)
        assert await rw.read.locked()
        assert not await other.read.acquire(blocking=False)
        await writer.release()
        assert not await client.exists(name)

    async def test_a_writer_release_lets_the_waiting_readers_in_together(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        writer = ReadWriteLock(client, name).write
        await writer.acquire()
        inside = 0
        peak = 0
        release = asyncio.Event()

        async def reader() -> None:
            nonlocal inside, peak
            async with ReadWriteLock(connect(), name).read:
                inside += 1
                peak = max(peak, inside)
                await release.wait()
                inside -= 1

        tasks = [asyncio.create_task(reader()) for _ in range(3)]
        await introspect.until_registered(client, name, 3, "rw")
        await writer.release()

        async def all_in() -> None:
            while inside < 3:  # noqa: ASYNC110 (a local count)
                await asyncio.sleep(0.005)

        await asyncio.wait_for(all_in(), 2)
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert peak == 3

    async def test_downgrade_and_refused_upgrade(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        rw = ReadWriteLock(client, name)
        async with rw.read:
            with pytest.raises(LockError, match=name):
                await rw.write.acquire()
        await rw.write.acquire()
        waiting = asyncio.create_task(self._read_once(ReadWriteLock(connect(), name)))
        await introspect.until_registered(client, name, 1, "rw")
        await rw.read.acquire()  # a downgrade: allowed at once
        await rw.write.release()  # the waiting reader gets in now, beside us
        await asyncio.wait_for(waiting, 2)
        await rw.read.release()
        assert not await client.exists(name)

    @staticmethod
    async def _read_once(rw: ReadWriteLock) -> None:
        async with rw.read:
            pass

    async def test_writers_are_not_starved_by_readers(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        reader = ReadWriteLock(client, name).read
        await reader.acquire()
        writer_in = asyncio.Event()

        async def write() -> None:
            async with ReadWriteLock(connect(), name).write:
                writer_in.set()

        writer = asyncio.create_task(write())
        await introspect.until_registered(client, name, 1, "rw")
        # a new reader waits behind the waiting writer (writer preference)
        assert not await ReadWriteLock(connect(), name).read.acquire(blocking=False)
        # without it, a new reader gets in
        unfair = ReadWriteLock(connect(), name, prefer_writers=False).read
        assert await unfair.acquire(blocking=False)
        await unfair.release()
        await reader.release()
        await asyncio.wait_for(writer_in.wait(), 2)
        await asyncio.wait_for(writer, 2)

    async def test_a_readers_lease_ends_on_its_own(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """A reader that stops renewing (its process died) ends with its lease; the other
        reader keeps its hold, renewed."""
        gone = ReadWriteLock(connect(), name, lease=0.3, auto_renew=False).read
        kept = ReadWriteLock(connect(), name, lease=0.3).read
        await gone.acquire()
        await kept.acquire()
        writer = ReadWriteLock(connect(), name).write
        assert not await writer.acquire(timeout=0.8)  # the renewed reader is still there
        lease = kept.current_lease
        assert lease is not None and not lease.lost
        await kept.release()
        assert await writer.acquire(timeout=1)
        await writer.release()

    async def test_a_waiting_writer_wakes_when_the_first_reader_lease_ends(
        self, connect: Connect, name: str
    ) -> None:
        """Regression (a waiting writer slept until the *longest* reader lease could end — the
        key's TTL — not the first: a dead reader's 0.5 s lease, after a 30 s reader had come
        and gone, kept the writer out for 30 s; expiry announces nothing). Found by a
        contract probe of SPEC §4: a waiter sleeps at most the holder's remaining lease."""
        dead = ReadWriteLock(connect(), name, lease=0.5, auto_renew=False).read
        await dead.acquire()  # never renewed: stands for a killed reader
        passer = ReadWriteLock(connect(), name, lease=30.0).read
        async with passer:
            pass  # the key's TTL is now 30 s
        writer = ReadWriteLock(connect(), name).write
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await writer.acquire(timeout=5.0)  # 30 s before the fix
        assert loop.time() - started < 4.0
        await writer.release()

    async def test_concurrent_read_tries_each_ask_the_server(
        self, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (contract probe): with the lock free, three tasks trying ``rw.read``
        at once got ``[True, False, False]``, and with ``prefer_writers=False`` a read try
        beside a holding reader and a waiting writer of the same process got ``False``: a try
        made while another attempt or waiter on the name was in the process answered from the
        local queue, without asking the server. Each try now makes its one attempt."""
        rw = ReadWriteLock(client, name, prefer_writers=False)
        tried: list[bool] = []
        done = asyncio.Event()

        async def reader() -> None:
            held = await rw.read.acquire(blocking=False)
            tried.append(held)
            await done.wait()
            if held:
                await rw.read.release()

        readers = [asyncio.create_task(reader()) for _ in range(3)]
        await until(lambda: len(tried) == 3, what="every read try answered", within=10)
        assert tried == [True, True, True]
        writer = HoldingTask(rw.write)
        await until(lambda: introspect.local_waiters(client) > 0, what="the writer waits")
        late = asyncio.create_task(reader())
        await until(lambda: len(tried) == 4, what="the late read try answered", within=10)
        assert tried[3] is True  # prefer_writers=False: readers in while no writer holds
        done.set()
        await asyncio.wait_for(asyncio.gather(*readers, late), 10)
        assert await writer.wait_acquired(10) is not None
        await writer.end()

    async def test_a_read_try_never_overtakes_an_earlier_local_writer(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        connect: Connect,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (attack pass, stop 22): with writers preferred, a read try made beside
        a writer of the same process waiting for the readers, whose registration had not
        reached the server yet, joined the readers ahead of it. It answers False now (and,
        writers not preferred, it still gets its share)."""
        reader = ReadWriteLock(connect(), name).read
        assert await reader.acquire()
        writer = await park_unregistered(
            fault_proxy, client, proxied, ReadWriteLock(proxied, name).write, "rw"
        )
        trier = asyncio.create_task(try_once(ReadWriteLock(proxied, name).read))
        unpreferred = ReadWriteLock(proxied, name, prefer_writers=False).read
        other = asyncio.create_task(try_once(unpreferred))
        await asyncio.sleep(0.05)
        fault_proxy.release_replies()
        assert await asyncio.wait_for(trier, 5) is False
        assert await asyncio.wait_for(other, 5) is True
        await reader.release()
        assert await writer.wait_acquired() is not None
        await writer.end()

    async def test_a_downgrade_try_is_not_refused_beside_a_local_writer(
        self,
        proxied: aioredis.Redis,
        fault_proxy: FaultProxy,
        client: aioredis.Redis,
        name: str,
    ) -> None:
        """Regression (attack pass, stop 23): the writer's downgrade try (``rw.read`` with
        ``blocking=False`` while holding ``rw.write``) answered False without asking the
        server while another writer of the process waited unregistered — the rule that keeps
        read tries behind a preferred writer applied to the holder's own downgrade, which goes
        ahead of every waiter."""
        rw = ReadWriteLock(proxied, name)
        assert await rw.write.acquire()
        writer = await park_unregistered(
            fault_proxy, client, proxied, ReadWriteLock(proxied, name).write, "rw"
        )

        async def let_go() -> None:
            await asyncio.sleep(0.05)
            fault_proxy.release_replies()

        letting = asyncio.create_task(let_go())
        assert await rw.read.acquire(blocking=False)  # the downgrade
        await letting
        await rw.read.release()
        await rw.write.release()
        assert await writer.wait_acquired() is not None
        await writer.end()

    async def test_reentrant_sides(self, client: aioredis.Redis, name: str) -> None:
        rw = ReadWriteLock(client, name)
        async with rw.write, rw.write:
            assert rw.write.current_lease is not None
            assert rw.write.current_lease.hold_count == 2
        async with rw.read, rw.read:
            assert await rw.write.locked()
        assert not await client.exists(name)


class TestDeadWriterRegistration:
    async def test_a_reader_behind_a_dead_writer_gets_in_when_nothing_is_held(
        self, server: ServerProcess, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (a reader stranded for ~two leases while nothing was held): a process
        holding the read side (1 s lease) and one waiting for the write side are SIGKILLed.
        The live reader waiting behind the dead writer (writer preference) re-checked when the
        read lease ended, found nothing held but the writer registered — and slept for its own
        whole lease (the lock's TTL was gone: -2), again and again until the dead writer's
        registration ran out (its own lease + claim_timeout + 2 s: ~62 s with default leases,
        longer with a longer writer lease). Now an attempt that finds nothing held but a
        writer registered ahead hands the lock to the front of the line, as a release would
        have: the dead writer costs one claim window."""
        workers = []
        try:
            for lease, kind, mode in (("1", "rw-read", "hold"), ("30", "rw-write", "wait")):
                args = ("--lease", lease, "--kind", kind, mode)
                proc = await worker_process(server.url, name, *args)
                workers.append(proc)
                assert (await readline(proc)).split()[0] in ("held", "waiting")
            await introspect.until_registered(client, name, 1, "rw")  # the writer
            reader = HoldingTask(ReadWriteLock(client, name).read, timeout=30)
            await introspect.until_registered(client, name, 2, "rw")
            for proc in workers:
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
            # the dead reader's lease ends within 1 s; the dead writer is handed the lock
            # for its claim window (2 s), then the live reader gets in
            assert await reader.wait_acquired(within=10) is not None
            await reader.end()
        finally:
            await reap(workers)


    async def test_a_reader_behind_a_writer_that_died_waiting_gets_in_while_readers_hold(
        self, server: ServerProcess, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (F4 of stop 25's attack pass, fixed in stop 26): readers hold (renewed);
        a writer registers behind them, and a reader behind the writer (writer preference).
        The writer's process is SIGKILLed. No release comes and nothing announces the death,
        so the reader slept until the readers' holds would end — a whole lease (30 s here),
        again after every renewal of theirs. A reader kept out only by a registered writer
        now re-checks within its claim window, and finds the writer gone."""
        holder = HoldingTask(ReadWriteLock(client, name, lease=30.0).read)
        assert await holder.wait_acquired() is not None
        proc = await worker_process(server.url, name, "--lease", "30", "--kind", "rw-write", "wait")
        reader: HoldingTask | None = None
        try:
            assert (await readline(proc)).split()[0] == "waiting"
            await introspect.until_registered(client, name, 1, "rw")  # the writer
            lock = ReadWriteLock(client, name, lease=30.0, claim_timeout=1.0).read
            reader = HoldingTask(lock, timeout=30)
            await introspect.until_registered(client, name, 2, "rw")
            await asyncio.sleep(0.3)
            assert not reader.acquired.done()  # writer preference: it waits
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            loop = asyncio.get_running_loop()
            died = loop.time()
            assert await reader.wait_acquired(within=10) is not None
            assert loop.time() - died < 1.0 + 1.0, "the reader waited past its claim window"
        finally:
            await reap([proc])
            if reader is not None:
                await reader.end()
            await holder.end()


class TestProbeFindings:
    """Contract probe of SPEC §4/§6 S5 for ``ReadWriteLock`` (session 15)."""

    async def test_readers_not_preferring_writers_pass_a_waiting_writer(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (``prefer_writers=False``: a reader registered behind a waiting writer
        stayed out for a whole claim window after the writer holding the lock released —
        the hand-over stopped at the waiting writer). README: readers get in "whenever no
        writer holds the lock"."""
        claim = 3.0
        side = {
            key: getattr(
                ReadWriteLock(connect(), name, prefer_writers=False, claim_timeout=claim), key
            )
            for key in ("write", "read")
        }
        holder = side["write"]
        assert await holder.acquire()
        loop = asyncio.get_running_loop()
        entered: dict[str, float] = {}
        leave = asyncio.Event()

        async def enter(label: str, kind: str) -> None:
            lock = getattr(
                ReadWriteLock(connect(), name, prefer_writers=False, claim_timeout=claim), kind
            )
            async with lock:
                entered[label] = loop.time()
                await leave.wait()

        tasks = []
        for count, (label, kind) in enumerate((("R1", "read"), ("W2", "write"), ("R3", "read"))):
            tasks.append(asyncio.create_task(enter(label, kind)))
            await introspect.until_registered(client, name, count + 1, "rw")
        released = loop.time()
        await holder.release()
        await until(lambda: len(entered) >= 2, what="both readers in", within=2.0)
        assert set(entered) == {"R1", "R3"}
        assert max(entered.values()) - released < 1.0  # a claim window (3 s) before the fix
        leave.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

    async def test_a_wrong_type_auxiliary_key_changes_nothing(
        self, connect: Connect, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (SPEC §6 S5, "a failed script changes nothing": a read/write script that
        failed on an auxiliary key of the wrong type had already dropped the expired holds
        from the lock's hash)."""
        failures = []
        for index, key in enumerate(introspect.aux_keys(name, "rw")):
            for action in ("read.acquire", "write.acquire", "read.release"):
                lock_name = f"{name}:{index}:{action}"
                aux = introspect.aux_keys(lock_name, "rw")
                bad = aux[index]
                kept = ReadWriteLock(connect(), lock_name, lease=30.0).read
                await kept.acquire()
                gone = ReadWriteLock(connect(), lock_name, lease=0.2, auto_renew=False).read
                await gone.acquire()
                await asyncio.sleep(0.3)  # its field stays in the hash, expired
                await client.delete(bad)
                await client.set(bad, "not a lock")
                before = await client.hgetall(lock_name)
                kind, verb = action.split(".")
                target = (
                    kept
                    if action == "read.release"
                    else getattr(ReadWriteLock(connect(), lock_name), kind)
                )
                call = target.release() if verb == "release" else target.acquire(blocking=False)
                try:
                    await call
                except LockError as exc:
                    if key_label(bad, aux) not in str(exc):
                        failures.append(f"{key!r} {action}: the error does not name it: {exc}")
                else:
                    failures.append(f"{key!r} {action}: no error")
                if await client.hgetall(lock_name) != before:
                    failures.append(f"{key!r} {action}: the lock's hash changed")
                await client.delete(lock_name, *aux)
        assert not failures, "\n".join(failures)

    @pytest.mark.parametrize(
        "data",
        [
            {"foo": "bar", "n": "1"},
            {"r:someone": "hello"},  # looks like a reader, is not one
            {"w": "someone"},  # a writer's field without the rest of a writer
            {"w": "a", "wt": "1", "wx": "abc"},  # a writer's fields, not as a writer writes them
            {"owner": "f" * 40, "token": "7"},  # a Lock's
        ],
        ids=["plain", "reader-like", "writer-like", "writer-malformed", "lock"],
    )
    async def test_a_users_hash_under_the_name_is_refused_and_left_alone(
        self, client: aioredis.Redis, name: str, data: dict[str, str]
    ) -> None:
        """Bug (contract probe, SPEC §3): a user's own hash under a read/write lock's name was
        taken for an empty lock — both sides acquired it, wrote their fields into it, set a
        TTL on it, and the release deleted the whole key. Only a ``Lock``'s ``owner`` field
        counted as foreign; now any field no read/write lock writes does. Bug (attack pass,
        stop 30): ``locked()`` answered "free" for such a hash (a ``Lock``'s held one among
        them), or failed with a raw Lua error on a malformed writer; it refuses it too now."""
        await client.hset(name, mapping=data)  # type: ignore[arg-type]
        rw = ReadWriteLock(client, name, lease=5)
        for side in (rw.read, rw.write):
            with pytest.raises(LockError, match="is not a lock of this kind") as info:
                await side.acquire(blocking=False)
            assert repr(name) in str(info.value)
            with pytest.raises(LockError, match=r"cannot inspect .*is not a lock of this kind"):
                await side.locked()
        assert await client.hgetall(name) == {k.encode(): v.encode() for k, v in data.items()}
        assert await client.pttl(name) == -1


class TestAttackFindings:
    @pytest.mark.parametrize("held", ["read", "write"])
    async def test_a_side_is_not_handed_to_a_task_waiting_for_the_other_side(
        self, client: aioredis.Redis, name: str, held: str
    ) -> None:
        """Regression (attack pass, stop 25: a hang): ``transfer()`` refused a task waiting in
        ``acquire()`` for the *same* side only. Handed the read side while it waited for the
        write side, the task waited for its own read hold; handed the write side while it
        waited for the read side, its wait never turned into a downgrade — either way for
        ever, the hold renewed all the while (everyone else locked out). Now refused at once,
        as for the same side; the holder keeps its hold."""
        rw = ReadWriteLock(client, name)
        mine, theirs = (rw.read, rw.write) if held == "read" else (rw.write, rw.read)

        async def wait_then_release() -> bool:
            got = await theirs.acquire(timeout=5)
            if got:
                await theirs.release()
            return got

        assert await mine.acquire(blocking=False)
        target = asyncio.create_task(wait_then_release())
        await introspect.until_registered(client, name, 1, "rw")
        with pytest.raises(LockError, match="waiting in acquire"):
            mine.transfer(target)
        assert mine.owned()
        await mine.release()
        assert await asyncio.wait_for(target, 5)  # the lock is free now: the target's turn
        assert not await client.exists(name)
