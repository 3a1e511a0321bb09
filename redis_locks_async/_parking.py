"""Local waiting: a parking lot per lock channel, and the codec of what releases announce.

A :class:`ParkingLot` keeps the tasks of this process that wait for one lock, in arrival order
(like trio's ``ParkingLot``). At most ``active`` of them — the first ones — talk to Redis; the
others sleep until one ahead leaves, so a release costs one Redis attempt per process, never a
herd, and 10,000 waiting tasks cost nothing while they wait. ``active=1`` is head-only
admission (``Lock``); a primitive that registers every waiter in Redis (``FairLock``) or admits
several at once (``Semaphore``) asks for more.

Arrival order is kept into Redis: a task whose uncontended attempt failed joins *ahead* of the
tasks that queued behind that attempt (:meth:`ParkingLot.join`, ``first``); and where the
server grants in the order it dated the registrations (``FairLock``:
``Policy.ordered_registration``), each waiter sends its first (registering) attempt only once
the waiter ahead of it has had the answer to its own (:meth:`ParkingLot.turn_to_register`) —
sent at once over a pool of connections, registrations would reach the server in any order.

What releases announce on the lock's channel is decoded by :func:`decode` into one of three
things, and anything it does not understand is a :class:`Recheck` — never dropped, since a
dropped announcement would leave waiters sleeping until their lease-bounded timers fire:

* :class:`Grant` — the lock was handed to these owners (with these fencing tokens) at server time
  ``at_us`` and holds for ``ttl_ms`` from then at most unless they confirm: a local waiter named
  there holds it now; any other active waiter knows the lock cannot be free before that claim
  window ends;
* :class:`Freed` — ``n`` units were freed (a lock: 1): that many active waiters re-check;
* :class:`Evicted` — the registrations of the process with this tag were dropped (it was taken
  for dead): if that is this process after all (it was paused), its active waiters re-check —
  and so register again (a ``FairLock``'s in their places of arrival, see
  ``Attempt.arrival_us``);
* :class:`Shortened` — a holder made its lease shorter: the waiters, who sleep at most until
  the end they were last told of, learn the new one — the one that watches the holds ahead for
  its lot (``Policy.one_watcher``), or else every active waiter;
* :class:`Recheck` — every active waiter re-checks.

Wire format: ``g:<ttl ms>:<at us>:<owner>:<token>[:<owner>:<token>...]``, ``f:<n>``,
``x:<process tag>``, ``r`` (shortened); anything else means "re-check".
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Final, NamedTuple, final

from ._owners import process_tag

__all__ = (
    "Evicted",
    "Freed",
    "Grant",
    "Granted",
    "News",
    "ParkingLot",
    "Recheck",
    "Shortened",
    "Waiter",
    "decode",
)


@final
@dataclass(slots=True)  # (not frozen: a frozen one is slower to make, on a hand-over's path)
class Grant:
    """The lock was handed over at server time ``at_us`` (microseconds) for a claim window of
    ``ttl_ms``: ``owners`` maps each new owner id to its fencing token."""

    ttl_ms: int
    at_us: int
    owners: Mapping[str, int]


@final
@dataclass(frozen=True, slots=True)
class Freed:
    """``n`` units of the lock were freed."""

    n: int


@final
@dataclass(frozen=True, slots=True)
class Evicted:
    """The registrations of the process tagged ``tag`` (``_runtime.process_tag``) were dropped."""

    tag: str


@final
@dataclass(frozen=True, slots=True)
class Shortened:
    """A hold's lease was made shorter: its end is sooner than the waiters were told."""


@final
@dataclass(frozen=True, slots=True)
class Recheck:
    """Something changed (or an announcement was not understood): re-check."""


RECHECK: Final = Recheck()
SHORTENED: Final = Shortened()
Announcement = Grant | Freed | Evicted | Shortened | Recheck


def decode(data: bytes | str) -> Announcement:
    """Decode one announcement; anything malformed or unknown is :data:`RECHECK`."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    parts = text.split(":")
    count = len(parts)
    try:
        if parts[0] == "g" and count >= 5 and count % 2 == 1:
            # (One grantee, the hand-over's case, without building a comprehension: this runs
            # between a release and its waiter's wake-up.)
            owners = (
                {parts[3]: int(parts[4])}
                if count == 5
                else dict(zip(parts[3::2], map(int, parts[4::2]), strict=True))
            )
            return Grant(int(parts[1]), int(parts[2]), owners)
        if parts[0] == "f" and len(parts) == 2:
            return Freed(max(1, int(parts[1])))
        if parts[0] == "x" and len(parts) == 2:
            return Evicted(parts[1])
        if parts[0] == "r" and len(parts) == 1:
            return SHORTENED
    except ValueError:
        pass
    return RECHECK


@final
class Granted(NamedTuple):
    """What a waiter keeps of the grant that named it."""

    token: int
    ttl: float  # the claim window, seconds
    at_us: int  # server time of the grant, microseconds
    received_at: float  # loop time the announcement was read


class News(enum.Enum):
    """Why a sleeping waiter woke."""

    GRANTED = "granted"  # the lock was handed to this waiter (see Waiter.grant)
    RECHECK = "recheck"  # it may be free: try again
    LATER = "later"  # handed to someone else: it cannot be free before Waiter.bound
    TIMER = "timer"  # the sleep's own bound passed


@final
class Waiter:
    """One task of this process waiting for one lock."""

    __slots__ = (
        "_loop",
        "_news",
        "_signal",
        "ahead",
        "answered",
        "arrival",
        "bound",
        "grant",
        "owner",
        "side",
        "since",
        "turn",
        "watch",
        "watches",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        owner: str,
        *,
        watches: bool = False,
        side: str = "",
        arrival: int = 0,
    ) -> None:
        self._loop = loop
        self.owner = owner
        # When its task called acquire(), as a number that grows with every call in this
        # process: orders the waiters of one lock across clients (``LockBase._kin_first``).
        self.arrival = arrival
        self.since = loop.time()  # when it queued
        self.side = side  # which side of its lock it waits for (``Policy.side``; "" for most)
        # One of the waiters of whom only the first watches the holds ahead for all (see
        # ParkingLot.watcher; ``Policy.one_watcher``); the others of the lot watch for themselves.
        self.watches = watches
        self.turn: asyncio.Future[None] = loop.create_future()
        # The waiter that joined just ahead of this one, until this one's first attempt is
        # answered; and the future the one behind awaits for that (created when asked for;
        # ParkingLot.turn_to_register).
        self.ahead: Waiter | None = None
        self.answered: asyncio.Future[None] | bool = False
        self.grant: Granted | None = None
        self.bound = 0.0  # with News.LATER: the lock cannot be free before this loop time
        self.watch: float | None = None  # when this waiter means to re-check the holds ahead
        self._news: News | None = None
        self._signal: asyncio.Future[None] | None = None

    def notify(self, news: News) -> None:
        """Wake the waiter with ``news`` (a grant or a recheck outranks a later bound)."""
        if self._news is None or self._news is News.LATER or news is News.GRANTED:
            self._news = news
        if self._signal is not None and not self._signal.done():
            self._signal.set_result(None)

    def granted(self, token: int, news: Grant) -> None:
        """The lock was handed to this waiter's owner id (``news``: the announcement). A
        waiter not yet among the active ones (one that followed its lock to another node's
        lot, at its end) takes its turn at once: the server holds the lock for it."""
        self.grant = Granted(token, news.ttl_ms / 1000, news.at_us, self._loop.time())
        self.notify(News.GRANTED)
        if not self.turn.done():
            self.turn.set_result(None)

    @property
    def known(self) -> bool:
        """Whether the server has answered this waiter's first attempt (so it knows of the
        waiter, if it registers waiters at all)."""
        answered = self.answered
        return answered is True or (isinstance(answered, asyncio.Future) and answered.done())

    def pass_on(self) -> None:
        """The waiter leaves before its first attempt was answered: the one behind it may
        register once the waiter ahead of this one has had its answer (or left in turn) —
        not at once, or it could be dated before that one."""
        ahead, self.ahead = self.ahead, None
        pending = ParkingLot.answer_of(ahead)
        if pending is None:
            self.mark_answered()
        else:
            pending.add_done_callback(lambda _: self.mark_answered())

    def mark_answered(self) -> None:
        """The first attempt was answered, or the waiter leaves: the next may register. (Not
        an attempt that failed: the server may not know of the waiter, and one behind it —
        or a try — would be first in line.)"""
        self.ahead = None
        if isinstance(self.answered, asyncio.Future):
            if not self.answered.done():
                self.answered.set_result(None)
        else:
            self.answered = True

    async def wait_turn(self, deadline: float | None) -> bool:
        """Wait until this waiter is among the active ones of its lot: ``True``, or ``False``
        once loop time ``deadline`` passed first.

        The turn can be taken back between being given and this task running (a waiter that
        joins at the front pushes the last active one out: a new :attr:`turn`), so the
        current future is looked at again after every wake-up: a waiter pushed back before
        it ran waits for its turn again, not giving up as if its time had run out."""
        while not self.turn.done():
            if deadline is None:
                await asyncio.wait((self.turn,))
                continue
            left = deadline - self._loop.time()
            if left <= 0:
                return False
            await asyncio.wait((self.turn,), timeout=left)
        return True

    def forget_news(self) -> None:
        """Drop earlier wake-ups: called just before an attempt, whose reply supersedes them
        (a grant is never dropped: it is kept in :attr:`grant`)."""
        self._news = None

    async def sleep(self, until: float | None) -> News:
        """Sleep until notified or until loop time ``until`` (``None``: until notified).

        The task awaits the signal future itself (a timer resolves it on time-out), so news
        wakes it in the very next loop iteration: this is the hand-over's hot path.
        """
        if self._news is None:
            if until is not None and until <= self._loop.time():
                return News.TIMER
            signal = self._signal = self._loop.create_future()
            timer = None if until is None else self._loop.call_at(until, _wake, signal)
            try:
                await signal
            finally:
                self._signal = None
                if timer is not None:
                    timer.cancel()
        news, self._news = self._news, None
        return News.TIMER if news is None else news


# Seconds after every active waiter of a lot re-checked (ParkingLot.sweep) during which a
# waiter's registration found gone does not make them all re-check again.
SWEEP_SPACING: Final = 1.0


# How many waiters one event-loop iteration wakes to re-check: a lot of 10,000 FairLock waiters
# woken at once (a reconnection, a sweep) ran 10,000 attempts in one iteration — a 1.3 s stall
# of everything else on the loop; in batches the loop keeps turning while they go out.
RECHECK_BATCH: Final = 256


def _wake(signal: asyncio.Future[None]) -> None:
    if not signal.done():
        signal.set_result(None)


@final
class ParkingLot:
    """The waiters of one lock in this process, in arrival order (module docstring)."""

    __slots__ = ("_active", "by_owner", "queue", "swept_at")

    def __init__(self, active: int = 1) -> None:
        self.queue: deque[Waiter] = deque()
        self.by_owner: dict[str, Waiter] = {}
        self._active = active
        self.swept_at = -SWEEP_SPACING  # loop time the active waiters last all re-checked

    def __len__(self) -> int:
        return len(self.queue)

    def join(self, waiter: Waiter, *, first: bool = False) -> None:
        """Queue ``waiter``; its ``turn`` resolves once it is among the active ones.
        ``first``: at the front — a task whose uncontended attempt was answered "held" arrived
        before every task that queued while that attempt was in flight (none of which has
        talked to Redis yet: they wait for the attempt to end), so it goes ahead of them, and
        one pushed out of the active ones waits for its turn again."""
        self.by_owner[waiter.owner] = waiter
        if not first:
            waiter.ahead = self.queue[-1] if self.queue else None
            self.queue.append(waiter)
            if len(self.queue) <= self._active:
                waiter.turn.set_result(None)
            return
        if self.queue:
            self.queue[0].ahead = waiter
        self.queue.appendleft(waiter)
        waiter.turn.set_result(None)
        if len(self.queue) > self._active:
            pushed = self.queue[self._active]
            if pushed.turn.done():
                pushed.turn = asyncio.get_running_loop().create_future()

    @staticmethod
    def turn_to_register(waiter: Waiter) -> asyncio.Future[None] | None:
        """What ``waiter`` awaits before its first attempt: the answer to the first attempt of
        the waiter that joined ahead of it (``None``: nothing to wait for)."""
        return ParkingLot.answer_of(waiter.ahead)

    @staticmethod
    def answer_of(ahead: Waiter | None) -> asyncio.Future[None] | None:
        """A future that resolves once ``ahead``'s first attempt is answered (or it leaves);
        ``None`` if that is so already."""
        if ahead is None or ahead.answered is True:
            return None
        if ahead.answered is False:
            ahead.answered = asyncio.get_running_loop().create_future()
        assert isinstance(ahead.answered, asyncio.Future)
        return None if ahead.answered.done() else ahead.answered

    def leave(self, waiter: Waiter, *, moving: bool = False) -> None:
        """Take ``waiter`` off the queue (synchronous: safe in ``finally``); the next in line
        becomes active. (``moving``: it joins another lot, and waits there; the one behind it
        here may register at once.)"""
        if moving:
            waiter.mark_answered()
        else:
            waiter.pass_on()
        if self.by_owner.get(waiter.owner) is waiter:
            del self.by_owner[waiter.owner]
        try:
            index = self.queue.index(waiter)
        except ValueError:
            return
        del self.queue[index]
        if index < self._active and len(self.queue) >= self._active:
            promoted = self.queue[self._active - 1]
            if not promoted.turn.done():
                promoted.turn.set_result(None)

    def watcher(self) -> Waiter | None:
        """The first of the waiters that share one watch (:attr:`Waiter.watches`): the one
        that re-checks when the holds ahead may end unannounced, for all of them. (Any other
        waiter in the lot — a ``Lock``'s, of the same name — is not counted on to.)"""
        return next((waiter for waiter in self.queue if waiter.watches), None)

    def pass_watch(self, waiter: Waiter, until: float | None) -> None:
        """``waiter``, the :meth:`watcher`, is leaving: the next waiter that shares the watch
        takes it over and re-checks at ``until`` (see ``Policy.one_watcher``). ``None``: the
        leaving waiter never heard back from the server (cancelled, or timed out, before its
        first reply), so it has nothing to pass on — the next one watches from what its own
        reply said (or, with no reply yet either, takes the watch up when that reply comes: it
        is the watcher by then)."""
        sharing = (other for other in self.queue if other.watches)
        if next(sharing, None) is not waiter:
            return
        successor = next(sharing, None)
        if successor is None:
            return
        if until is None:
            until = successor.watch
            if until is None:
                return
        successor.bound = until
        successor.notify(News.LATER)

    def _actives(self, count: int | None = None) -> Iterator[Waiter]:
        """The first ``count`` active waiters (all of them: ``None``). Iterated, never indexed:
        a deque is indexed from its nearer end, so taking the waiters of a lot of 10,000 one
        index at a time cost a millisecond per announcement, 20 ms at 50,000 (quadratic)."""
        return islice(self.queue, self._active if count is None else min(count, self._active))

    def deliver(self, news: Announcement) -> bool:
        """Act on an announcement; ``True`` when it handed the lock to a local waiter."""
        if isinstance(news, Grant):
            named = 0
            for owner, token in news.owners.items():
                waiter = self.by_owner.get(owner)
                if waiter is not None:
                    waiter.granted(token, news)
                    named += 1
            if len(self.queue) > named:
                # Someone else holds it now, for its claim window at least: if it never
                # confirms, one re-check by this process when the window ends moves it on.
                later = asyncio.get_running_loop().time() + news.ttl_ms / 1000
                for waiter in self._actives():
                    if waiter.owner not in news.owners:
                        waiter.bound = later
                        waiter.notify(News.LATER)
                        break
            return named > 0
        if isinstance(news, Evicted):
            if news.tag == process_tag():
                self.recheck_all()
            return False
        if isinstance(news, Shortened):
            watcher = self.watcher()
            if watcher is not None:  # it watches the holds ahead for the whole lot
                watcher.notify(News.RECHECK)
                return False
            news = RECHECK
        count = news.n if isinstance(news, Freed) else len(self.queue)
        if count <= RECHECK_BATCH:
            for waiter in self._actives(count):
                waiter.notify(News.RECHECK)
        else:
            self._recheck_from(list(self._actives(count)), 0)
        return False

    def _recheck_from(self, waiters: list[Waiter], start: int) -> None:
        """Wake ``waiters[start:]`` to re-check, :data:`RECHECK_BATCH` of them now and the rest
        in later iterations (in their order; one that left meanwhile ignores it). Each batch
        counts as a sweep (:meth:`sweep`): the attempts of the last batches go out later than
        ``SWEEP_SPACING`` after the first when there are many, and must not start another."""
        loop = asyncio.get_running_loop()
        self.swept_at = loop.time()
        end = start + RECHECK_BATCH
        for waiter in waiters[start:end]:
            waiter.notify(News.RECHECK)
        if end < len(waiters):
            loop.call_soon(self._recheck_from, waiters, end)

    def sweep(self, sent_at: float) -> None:
        """An attempt sent at loop time ``sent_at`` found its waiter's registration gone (and
        put it back in its place): the server may have dropped the others too — every active
        waiter re-checks (which puts each back in its place), unless they all did since
        ``sent_at`` or just before (within :data:`SWEEP_SPACING`: the re-checks of one sweep
        — or of a reconnection, which also finds registrations gone after a failover — must
        not start another)."""
        if sent_at > self.swept_at + SWEEP_SPACING:
            self.recheck_all()

    def recheck_all(self) -> None:
        """Every active waiter re-checks (announcements may have been lost, registrations
        dropped: a sweep, see :meth:`sweep`)."""
        self.swept_at = asyncio.get_running_loop().time()
        self.deliver(RECHECK)

    def wake_all(self) -> None:
        """Wake every waiter, active or not (the runtime is closing)."""
        for waiter in self.queue:
            waiter.notify(News.RECHECK)
            if not waiter.turn.done():
                waiter.turn.set_result(None)
