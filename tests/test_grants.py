"""Pure units: how a waiter reads an announcement and dates the claim window a grant gives it;
owner ids and their process tag.

The behaviour against a real server (a grant read after its claim window ended is no hold) is
``test_family.py::TestEveryPrimitive::test_a_grant_heard_after_its_claim_window_is_no_hold``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest

from redis_locks_async._core import _claim_end
from redis_locks_async._owners import PROCESS_TAG_LEN, new_owner_id, process_tag
from redis_locks_async._parking import (
    RECHECK,
    RECHECK_BATCH,
    SWEEP_SPACING,
    Evicted,
    Freed,
    Grant,
    Granted,
    News,
    ParkingLot,
    Waiter,
    decode,
)


class TestDecode:
    def test_a_grant_names_its_time_and_every_grantee(self) -> None:
        assert decode(b"g:300:1700000000123456:a:11:b:12") == Grant(
            300, 1700000000123456, {"a": 11, "b": 12}
        )

    @pytest.mark.parametrize(
        "raw",
        [
            b"g:300:a:11",  # the format before grants carried their time
            b"g:300:1700000000123456",  # nobody named
            b"g:300:1700000000123456:a",  # an owner without a token
            b"g:x:1:a:1",
            b"",
            b"zzz",
        ],
    )
    def test_anything_malformed_is_a_recheck(self, raw: bytes) -> None:
        assert decode(raw) is RECHECK

    def test_freed(self) -> None:
        assert decode("f:3") == Freed(3)

    def test_evicted(self) -> None:
        assert decode(b"x:0a1b2c3d") == Evicted("0a1b2c3d")
        assert decode(b"x:0a1b2c3d:junk") is RECHECK


def test_owner_ids_begin_with_the_process_tag() -> None:
    """What ``evict_vanished`` (prelude.lua) finds a process's registrations by."""
    ids = {new_owner_id() for _ in range(100)}
    assert len(ids) == 100
    assert {owner[:PROCESS_TAG_LEN] for owner in ids} == {process_tag()}
    assert all(len(owner) == PROCESS_TAG_LEN + 32 for owner in ids)


class TestClaimEnd:
    """``since`` = (loop time the registering attempt was sent, server µs it ran at)."""

    def test_read_at_once_counts_from_the_read(self) -> None:
        # granted 2 s (server time) after the registration, read 1 ms after the attempt was
        # sent + those 2 s: the earlier of the two dates wins
        grant = Granted(token=7, ttl=0.3, at_us=5_000_000 + 2_000_000, received_at=102.001)
        assert _claim_end(grant, (100.0, 5_000_000)) == pytest.approx(102.0 + 0.3)

    def test_read_late_counts_from_the_grant(self) -> None:
        """Regression (S1 chaos run): the window was counted from the read."""
        grant = Granted(token=7, ttl=0.3, at_us=5_000_000 + 2_000_000, received_at=103.5)
        end = _claim_end(grant, (100.0, 5_000_000))
        assert end == pytest.approx(102.3)
        assert end is not None and end < grant.received_at  # over before it was heard of

    def test_a_grant_older_than_the_last_registration_is_stale(self) -> None:
        """A later attempt found the owner still waiting: the grant had run out by then."""
        grant = Granted(token=7, ttl=0.3, at_us=4_999_000, received_at=100.5)
        assert _claim_end(grant, (100.0, 5_000_000)) is None

    def test_no_reference_no_vouching(self) -> None:
        grant = Granted(token=7, ttl=0.3, at_us=5_000_000, received_at=100.5)
        assert _claim_end(grant, None) is None


class _Unindexable(deque[Waiter]):
    """A parking lot's queue that fails any lookup by index."""

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("the parking lot's queue was indexed")


class TestDeliver:
    """How a parking lot of ``FairLock`` waiters (all active) acts on an announcement."""

    async def test_an_announcement_costs_the_same_however_many_wait(self) -> None:
        """Regression (a millisecond of event loop per announcement with 10,000 fair waiters in
        one process, 20 ms with 50,000): the active waiters were taken from the deque one index
        at a time, each lookup walking from the nearer end — quadratic. They are iterated; and
        an announcement for one waiter (a grant to someone else, "f:1") touches the first."""
        loop = asyncio.get_running_loop()
        lot = ParkingLot(1 << 30)
        waiters = [Waiter(loop, f"w{i}") for i in range(3)]
        for waiter in waiters:
            lot.join(waiter)
        lot.queue = _Unindexable(lot.queue)
        lot.deliver(Grant(2000, 1, {"w0": 7, "elsewhere": 8}))
        assert waiters[0].grant is not None and waiters[0].grant.token == 7
        assert await waiters[0].sleep(None) is News.GRANTED
        # the first waiter not named is told when the grantees' window ends; nobody else
        assert waiters[1].bound > 0 and waiters[2].bound == 0
        lot.leave(waiters[0])  # it holds the lock now
        lot.deliver(Freed(1))
        assert await waiters[1].sleep(None) is News.RECHECK  # it supersedes the LATER
        assert await waiters[2].sleep(loop.time()) is News.TIMER  # not woken
        lot.deliver(Evicted(process_tag()))  # this process was taken for dead: all re-check
        assert [await waiter.sleep(None) for waiter in waiters[1:]] == [News.RECHECK] * 2

    async def test_registrations_found_gone_make_the_lot_re_check_once(self) -> None:
        """A ``FairLock`` attempt that found its registration gone (-3: put back in its place)
        makes every waiter of its lot re-check — the server may have dropped theirs too — but
        the re-checks of that sweep, or of a reconnection's, find theirs gone as well and must
        not each start another (with 10,000 waiters: 10,000 sweeps of 10,000)."""
        loop = asyncio.get_running_loop()
        lot = ParkingLot(1 << 30)
        waiters = [Waiter(loop, f"w{i}") for i in range(3)]
        for waiter in waiters:
            lot.join(waiter)
        sent_at = loop.time()
        lot.recheck_all()  # a reconnection (or an "x:" for this process)
        assert [await waiter.sleep(None) for waiter in waiters] == [News.RECHECK] * 3
        lot.sweep(sent_at)  # an attempt of those re-checks, or one sent just before
        assert [await waiter.sleep(loop.time()) for waiter in waiters] == [News.TIMER] * 3
        lot.sweep(loop.time() + SWEEP_SPACING + 0.01)  # sent well after: another drop
        assert [await waiter.sleep(None) for waiter in waiters] == [News.RECHECK] * 3

    async def test_a_large_lot_re_checks_in_batches(self) -> None:
        """Regression (an attack pass: event-loop stalls of 1.3 to 1.5 s): a lot of 10,000
        ``FairLock`` waiters woken to re-check at once — a reconnection, a sweep — ran their
        10,000 attempts in one event-loop iteration. They are woken ``RECHECK_BATCH`` per
        iteration, in their order, every one of them."""
        loop = asyncio.get_running_loop()
        lot = ParkingLot(1 << 30)
        waiters = [Waiter(loop, f"w{i}") for i in range(2 * RECHECK_BATCH + 1)]
        for waiter in waiters:
            lot.join(waiter)

        async def woken() -> list[int]:
            news = [await waiter.sleep(loop.time()) for waiter in waiters]
            return [i for i, seen in enumerate(news) if seen is News.RECHECK]

        lot.recheck_all()
        assert await woken() == list(range(RECHECK_BATCH))
        await asyncio.sleep(0)
        assert await woken() == list(range(RECHECK_BATCH, 2 * RECHECK_BATCH))
        await asyncio.sleep(0)
        assert await woken() == [2 * RECHECK_BATCH]


class TestTurn:
    """How a waiter waits for its turn among the active ones of a ``Lock``'s lot (one active)."""

    async def test_a_turn_taken_back_before_the_waiter_ran_is_waited_for_again(self) -> None:
        """Regression (``test_lock_faults.py::TestPubSubKilled::
        test_waiters_re_check_past_a_silent_command_connection`` failed ~1 run in 10): the
        head's attempt went unanswered, so it left and joined again at the front under a new
        owner id. Leaving gave the next waiter its turn; joining at the front took it back
        (a new ``turn`` future) before that waiter's task ran. The task woke, found its turn
        not done, and ``acquire(timeout=10)`` returned ``False`` at once, as though it had
        timed out. The waiter now waits for its turn again, until its deadline."""
        loop = asyncio.get_running_loop()
        lot = ParkingLot(1)
        head, second = Waiter(loop, "head"), Waiter(loop, "second")
        lot.join(head)
        lot.join(second)
        waiting = asyncio.create_task(second.wait_turn(loop.time() + 10))
        await asyncio.sleep(0)  # awaiting its turn
        lot.leave(head)  # gives the second waiter its turn...
        again = Waiter(loop, "head again")
        lot.join(again, first=True)  # ...and takes it back before that waiter's task ran
        await asyncio.sleep(0.01)
        assert not waiting.done()  # still waiting, not "timed out"
        lot.leave(again)
        assert await asyncio.wait_for(waiting, 1.0) is True

    async def test_a_turn_not_given_by_the_deadline_is_false(self) -> None:
        loop = asyncio.get_running_loop()
        lot = ParkingLot(1)
        head, second = Waiter(loop, "head"), Waiter(loop, "second")
        lot.join(head)
        lot.join(second)
        assert await second.wait_turn(loop.time() + 0.05) is False
        assert await head.wait_turn(loop.time()) is True  # given: at once, whatever the deadline
