"""What a holder holds: the public :class:`Lease` view over the internal :class:`Hold` record.

A :class:`Hold` is created when an acquisition succeeds and lives until the hold ends. The core
(``_core``) and the lease keeper (``_renewal``) change it only through its named transitions
(:meth:`Hold.renewed`, :meth:`Hold.set_lease`, :meth:`Hold.mark_lost`, ...). Its expiry is a
*local estimate* on the event loop's monotonic clock, taken from the moment the command that
set the server's TTL was sent, so it never runs later than the server's — except for a lock
handed over while waiting, whose clock starts when the announcement arrives (one network hop
late; the hand-over grants only a short claim window, confirmed at once by a renewal whose
send time then restarts the clock exactly). The fencing token is what protects resources
against that hop and against every pause.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, final

from . import _telemetry as telemetry

if TYPE_CHECKING:
    from ._scripts import Call

__all__ = ("Hold", "HoldState", "Lease", "LostCallback", "Snapshot", "unclaimed")

logger = logging.getLogger("redis_locks_async")


class HoldState(enum.Enum):
    """Where a hold is in its life."""

    HELD = "held"
    RELEASING = "releasing"
    RELEASED = "released"
    LOST = "lost"


LostCallback = Callable[["Lease"], object] | Callable[["Lease"], Awaitable[object]]


class _LossCounter(Protocol):
    lost: int


class Snapshot(NamedTuple):
    """A hold's lease, end, next renewal and last judged renewal (``Hold.snapshot``)."""

    lease: float
    expires_at: float
    renew_at: float
    judged: tuple[float, float] | None


@final
class Hold:
    """The internal record of one held lock (see the module docstring).

    ``entries`` are the ids of the re-entries on top of the first acquisition, innermost last:
    the hold count is ``1 + len(entries)``.
    """

    __slots__ = (
        "__weakref__",
        "_deferred_cancels",
        "_loss_cancelled",
        "_lost_event",
        "acquired_at",
        "auto_renew",
        "base_owed",
        "blocks",
        "claimed",
        "confirm",
        "confirmed",
        "counters",
        "entries",
        "expires_at",
        "fencing_token",
        "floor",
        "guards",
        "heir",
        "judged",
        "key",
        "kind",
        "lease",
        "loop",
        "lost_reason",
        "margin",
        "name",
        "next_entry",
        "on_lost",
        "outer",
        "owner",
        "pending",
        "reentering",
        "renew",
        "renew_at",
        "renew_until",
        "replicas",
        "shortened",
        "spawn",
        "state",
        "task",
        "task_callback",
        "view",
    )

    def __init__(
        self,
        *,
        key: Hashable,
        name: str,
        owner: str,
        fencing_token: int,
        lease: float,
        auto_renew: bool,
        expires_at: float,
        task: asyncio.Task[Any],
        renew: Callable[[str, float, bool | None], Call],
        on_lost: LostCallback | None,
        spawn: Callable[[Coroutine[Any, Any, Any]], object],
        confirm: bool = False,
        counters: _LossCounter | None = None,
        margin: Callable[[float], float] | None = None,
        renew_until: float | None = None,
    ) -> None:
        self.key = key
        self.name = name
        self.owner = owner
        self.fencing_token = fencing_token
        self.lease = lease
        self.auto_renew = auto_renew
        self.loop = asyncio.get_running_loop()
        # Seconds the local estimate of the lease's end is kept short of the server's, for a
        # lease of the given length (RedLock: the allowance for clock drift between masters).
        self.margin = margin
        self.expires_at = expires_at
        # A hand-over grants a claim window only: the first renewal (the confirmation) is due now.
        self.confirm = confirm
        self.renew_at = self.loop.time() if confirm else expires_at - lease * 2 / 3
        self.renew = renew  # (owner, lease, sharded) -> the script call that renews the lease
        # max_hold: no renewal may carry the lease past this loop time
        self.renew_until = renew_until
        # (sent at, lease) of the last keeper renewal that may have run on the server: a
        # command changing the lease compares it before and after its round trip.
        self.judged: tuple[float, float] | None = None
        # Loop time of a shorter lease set without an announcement known to have run (an
        # extend or a re-entry in flight or given up on): the keeper's renewals announce a
        # shortening until one of them is confirmed (0.0: none).
        self.shortened = 0.0
        # (sent at, lease) of the latest command whose setting of the lease was confirmed.
        self.confirmed: tuple[float, float] | None = None
        # The shortest lease a command given up on (unanswered, failed, cancelled) may still
        # set when it lands, late: the hold counts on it and is renewed at its pace for good.
        self.floor = math.inf
        self.state = HoldState.HELD
        self.task = task
        self.task_callback: Callable[[asyncio.Task[Any]], object] | None = None
        self.entries: list[str] = []
        self.next_entry = 0
        self.on_lost = on_lost
        self.spawn = spawn
        self.pending: asyncio.Future[None] | None = None  # the last release in flight
        # The levels (re-entry ids; None: the hold itself) whose releases are in flight in the
        # background (cancelled callers'): a release() called meanwhile releases another one.
        self.claimed: list[str | None] | None = None
        # The block of the hold's own level ended before the levels entered since (an async
        # generator's block, closed out of order): the hold is released once they are.
        self.base_owed = False
        # The levels (None: the hold's own) of the ``async with`` blocks open on it, in the
        # order they were entered, through any lock object.
        self.blocks: list[str | None] = []
        self.reentering = 0  # re-entries of the hold in flight
        self.outer: Hold | None = None  # the task's previous hold of the same key (permits)
        self.lost_reason = ""
        self.replicas: int | None = None  # replicas that acknowledged it (replica sync)
        self.guards: dict[asyncio.Task[Any], int] = {}
        # The task awaiting ``asyncio.wait_for`` on ``task`` when it took the hold (Python
        # 3.10/3.11 run the awaited coroutine in a helper task): it receives the hold if the
        # helper returns holding it (LockBase._hand_up).
        self.heir: asyncio.Task[Any] | None = None
        self.view = Lease(self)
        # Telemetry (set when a sink is installed): the lock's class name, when it was taken.
        self.kind = ""
        self.acquired_at = 0.0
        self._lost_event: asyncio.Event | None = None
        self.counters = counters
        self._loss_cancelled: set[asyncio.Task[Any]] = set()
        # Guarded tasks that found the loss themselves: their cancellation waits for them to
        # suspend (see cancel_guarded).
        self._deferred_cancels: dict[asyncio.Task[Any], asyncio.Handle] | None = None

    # -- views ---------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        """How many times the holding task has entered the lock."""
        return 1 + len(self.entries)

    @property
    def live(self) -> bool:
        """Held or being released: the lease must be kept alive (and may be renewed)."""
        return self.state is HoldState.HELD or self.state is HoldState.RELEASING

    def remaining(self) -> float:
        """Seconds the lease is known to last from now (0 when over or not held)."""
        if not self.live:
            return 0.0
        return max(0.0, self.expires_at - self.loop.time())

    @property
    def wants_renewal(self) -> bool:
        """Whether the keeper renews this hold (auto-renewed and not at its ``max_hold``, or a
        hand-over to confirm, or a lease to set again: :meth:`crossed`)."""
        return self.confirm or (self.auto_renew and not self.capped)

    @property
    def capped(self) -> bool:
        """Whether the next renewal would carry the lease past ``max_hold``."""
        return self.renew_until is not None and self.renew_at + self.lease > self.renew_until

    @property
    def expiry_reason(self) -> str:
        """Why a hold that is not renewed any more ends."""
        if self.auto_renew and self.capped:
            return "the lease expired: the lock was held for its max_hold"
        return "the lease expired (auto_renew=False)"

    # -- transitions ---------------------------------------------------------------------------

    def new_entry(self) -> str:
        """A fresh entry id for a re-entry (never reused within this hold)."""
        self.next_entry += 1
        return str(self.next_entry)

    def renewed(self, sent_at: float, lease: float | None = None) -> None:
        """The server set the lease to ``lease`` (default: the hold's) by a command sent at
        ``sent_at``."""
        if lease is not None:
            self.lease = lease
        if self.confirmed is None or sent_at > self.confirmed[0]:
            self.confirmed = (sent_at, self.lease)
        self.confirm = False
        pace = self.pace
        self.expires_at = sent_at + pace
        if self.margin is not None:
            self.expires_at -= self.margin(pace)
        self.renew_at = sent_at + pace / 3 if self.auto_renew else self.expires_at

    @property
    def pace(self) -> float:
        """The lease the hold counts on and is renewed at: its own, or the :attr:`floor` of
        a shorter setting that may still land (a command is not withdrawn by giving up on it:
        its bytes may be on the wire)."""
        return min(self.lease, self.floor)

    def gave_up_on(self, lease: float) -> None:
        """A command setting the server's lease to ``lease`` was given up on (no answer, an
        error after which it may have run, a cancellation): if it lands later — after a
        longer lease was confirmed — it shortens the server's lease without a word. Count on
        it, and renew at its pace, for the rest of the hold."""
        self.floor = min(self.floor, lease)

    def crossed(self, sent_at: float, lease: float) -> None:
        """A renewal to ``lease`` sent at ``sent_at``, which may have run, crossed a command
        that changed the hold's lease: the server may have run it last and kept ``lease``.
        Count on the earlier of the two ends, and renew with the hold's own lease at once —
        also a hold that is not renewed otherwise (``auto_renew=False``: helper-84, an
        ``extend()`` right after a hand-over was undone by the hand-over's confirmation, and
        the hold ended at the lock's shorter lease)."""
        end = sent_at + lease
        if self.margin is not None:
            end -= self.margin(lease)
        self.expires_at = min(self.expires_at, end)
        self.renew_at = self.loop.time()
        if not self.auto_renew:
            self.confirm = True  # (one renewal owed: wants_renewal)

    def snapshot(self) -> Snapshot:
        """What an extend or a re-entry may change before it is sent (see :meth:`unsent`)."""
        return Snapshot(self.lease, self.expires_at, self.renew_at, self.judged)

    def unsent(self, before: Snapshot) -> None:
        """The extend or re-entry that changed the hold since ``before`` was never sent (no
        free connection): its lease is not the hold's. Its earlier end is forgotten too,
        unless the keeper judged a renewal since (it may have sent the shorter lease)."""
        self.lease = before.lease
        if self.judged is before.judged:
            self.expires_at = max(self.expires_at, before.expires_at)
            self.renew_at = max(self.renew_at, before.renew_at)

    def may_have_set(self, sent_at: float, lease: float) -> bool:
        """A command sent at ``sent_at`` that sets the server's lease to ``lease`` may have run
        (its answer late, lost, or not awaited): count on the end it may have left, if earlier
        — from its send or, when a setting sent after it was confirmed, from that one's send
        with the shorter of the two leases (whichever of the two ran last, the lease lasts at
        least that long). ``True`` when that moved the end earlier (renewal then comes now)."""
        start, length = sent_at, lease
        later = self.confirmed
        if later is not None and later[0] > sent_at:
            start, length = later[0], min(lease, later[1])
        end = start + length - (self.margin(length) if self.margin is not None else 0.0)
        if end >= self.expires_at:
            return False
        self.expires_at = end
        self.renew_at = min(self.renew_at, self.loop.time())
        return True

    def mark_lost(self, reason: str) -> bool:
        """The lease ended while held: signal it once (event, guarded blocks, ``on_lost``).

        Returns ``False`` when the hold was not live (nothing signalled).
        """
        if not self.live:
            return False
        self.state = HoldState.LOST
        self.lost_reason = reason
        if self.counters is not None:
            self.counters.lost += 1
        if self._lost_event is not None:
            self._lost_event.set()
        logger.warning("lease on %r lost: %s", self.name, reason)
        for task in list(self.guards):
            self.cancel_guarded(task)
        if self.on_lost is not None:
            try:
                result = self.on_lost(self.view)
            except Exception:
                logger.exception("on_lost callback for %r failed", self.name)
            else:
                if inspect.isawaitable(result):
                    self.spawn(_report_failure(result, self.name))
        sink = telemetry.SINK
        if sink is not None and self.kind:
            sink.hold_ended(self.kind, self.loop.time() - self.acquired_at, lost=True)
        return True

    def cancel_guarded(self, task: asyncio.Task[Any]) -> None:
        """Cancel ``task``, which has a guarded block open on this lost hold. The task that is
        running — it found the loss itself (an ``extend()``, a re-entry, a release, entering
        the block) — is cancelled once it suspends: cancelled now, the cancellation would wait
        for its next ``await`` even if that came after the block, which raises
        :class:`LockLostError` anyway (see :meth:`take_back_cancel`)."""
        deferred = self._deferred_cancels
        if task.done() or task in self._loss_cancelled or (deferred and task in deferred):
            return
        if task is asyncio.current_task(self.loop):
            if deferred is None:
                deferred = self._deferred_cancels = {}
            deferred[task] = self.loop.call_soon(self._cancel_deferred, task)
            return
        self._loss_cancelled.add(task)
        task.cancel(f"lease on {self.name!r} lost: {self.lost_reason}")

    def _cancel_deferred(self, task: asyncio.Task[Any]) -> None:
        deferred = self._deferred_cancels
        if deferred and deferred.pop(task, None) is not None and self.guards.get(task):
            self.cancel_guarded(task)

    def take_back_cancel(self, task: asyncio.Task[Any]) -> bool:
        """A guarded block of ``task`` ends: withdraw a cancellation the loss has not yet
        delivered (``False``), or say the loss cancelled ``task`` (``True``: the caller takes
        it back with ``uncancel()``)."""
        deferred = self._deferred_cancels
        handle = deferred.pop(task, None) if deferred else None
        if handle is not None:
            handle.cancel()
            return False
        if task in self._loss_cancelled:
            self._loss_cancelled.discard(task)
            return True
        return False

    def cancelled_by_loss(self, task: asyncio.Task[Any]) -> bool:
        """Whether :meth:`mark_lost` cancelled ``task`` (a guarded block), or will once it
        suspends."""
        deferred = self._deferred_cancels
        return task in self._loss_cancelled or bool(deferred and task in deferred)

    async def wait_lost(self) -> None:
        """Return when the lease is lost."""
        if self.state is HoldState.LOST:
            return
        if self._lost_event is None:
            self._lost_event = asyncio.Event()
        await self._lost_event.wait()


async def _report_failure(awaitable: Awaitable[object], name: str) -> None:
    try:
        await awaitable
    except Exception:
        logger.exception("on_lost callback for %r failed", name)


@final
class Lease:
    """A held lock: its name, its fencing token, and how long it is known to last.

    ``fencing_token`` increases strictly with every fresh acquisition of a name (re-entering
    keeps it) — also after the lock expired, after a server restart without persistence, and
    after a failover, within the servers' clock skew — so a resource that remembers the highest
    token it has seen can reject writes from a holder whose lease ended while it was paused::

        async with Lock(client, "orders:42") as lease:
            await store.write(order, fence=lease.fencing_token)

    ``lost`` turns true (and :meth:`wait_lost` returns, and the lock's ``on_lost`` callback runs)
    when renewal finds the lease gone or cannot renew it before it ends. A ``Lease`` is a
    read-only view; it stays valid (and keeps its last values) after the hold ends.
    """

    __slots__ = ("_hold",)

    def __init__(self, hold: Hold) -> None:
        self._hold = hold

    @property
    def name(self) -> str:
        """The lock's name."""
        return self._hold.name

    @property
    def fencing_token(self) -> int:
        """The fencing token of this acquisition."""
        return self._hold.fencing_token

    @property
    def lease(self) -> float:
        """The lease length in seconds the server keeps (re)setting for this hold."""
        return self._hold.lease

    @property
    def auto_renew(self) -> bool:
        """Whether the lease is renewed while held."""
        return self._hold.auto_renew

    @property
    def state(self) -> HoldState:
        """The hold's state: held, releasing, released, or lost."""
        return self._hold.state

    @property
    def hold_count(self) -> int:
        """How many times the holding task has entered the lock."""
        return self._hold.count

    @property
    def replicas(self) -> int | None:
        """How many replicas acknowledged this acquisition (``WAIT``/``WAITAOF``) when the lock
        asks for replica sync (``replicas=``); ``None`` without it."""
        return self._hold.replicas

    @property
    def lost(self) -> bool:
        """``True`` once the lease is known to have ended while held."""
        return self._hold.state is HoldState.LOST

    @property
    def lost_reason(self) -> str:
        """Why the lease was lost (empty while it is not)."""
        return self._hold.lost_reason

    def remaining(self) -> float:
        """Seconds the lease is known to last from now (a local estimate; 0 when over)."""
        return self._hold.remaining()

    async def wait_lost(self) -> None:
        """Return when the lease is lost (never, if it is released first)."""
        await self._hold.wait_lost()

    def __repr__(self) -> str:
        hold = self._hold
        return (
            f"<Lease {hold.name!r} token={hold.fencing_token} {hold.state.value} "
            f"count={hold.count} remaining={hold.remaining():.3f}s>"
        )


def unclaimed(hold: Hold | None) -> Hold | None:
    """The innermost of a task's holds (``hold``, then those under it) whose last release is
    not already on its way (a cancelled ``release()`` going on in the background): the one the
    task holds as far as its next ``release()``, ``extend()``, re-entry, ``transfer()`` — or
    another primitive's rule (a read/write lock's upgrade) — is concerned."""
    while hold is not None and hold.claimed is not None and None in hold.claimed:
        hold = hold.outer
    return hold
