"""What a holder holds: :class:`Lease`, and the states a hold goes through.

A :class:`Lease` is created when an acquisition succeeds and lives until the hold ends. Its
expiry is a *local estimate* on the event loop's monotonic clock, taken from the moment the
acquiring command was sent (so it never runs later than the server's), or, for a lock handed
over while waiting, from the moment the announcement arrived (one network hop late: the
fencing token is what protects resources against that, and against every pause).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, final

if TYPE_CHECKING:
    from ._scripts import EncodableArg, Script

logger = logging.getLogger("redis_locks_async")


class HoldState(enum.Enum):
    """Where a hold is in its life."""

    HELD = "held"
    RELEASING = "releasing"
    RELEASED = "released"
    LOST = "lost"


LostCallback = Callable[["Lease"], object]


@final
class Lease:
    """A held lock: its name, its fencing token, and how long it is known to last.

    ``fencing_token`` increases strictly with every fresh acquisition of a name (re-entering
    keeps it), also across expiries, so a resource that remembers the highest token it has seen
    can reject writes from a holder whose lease ended while it was paused::

        async with Lock(client, "orders:42") as lease:
            await store.write(order, fence=lease.fencing_token)

    ``lost`` turns true (and :meth:`wait_lost` returns, and the lock's ``on_lost`` callback runs)
    when renewal finds the lease gone or cannot renew it before it ends.
    """

    __slots__ = (
        "_count",
        "_done_callback",
        "_expires_at",
        "_guarded",
        "_loop",
        "_lost_event",
        "_lost_reason",
        "_on_lost",
        "_owner",
        "_renew_at",
        "_renew_call",
        "_state",
        "_task",
        "auto_renew",
        "fencing_token",
        "lease",
        "name",
    )

    def __init__(
        self,
        *,
        name: str,
        fencing_token: int,
        lease: float,
        auto_renew: bool,
        owner: str,
        count: int,
        expires_at: float,
        task: asyncio.Task[object],
        renew_call: tuple[Script, tuple[str, ...], tuple[EncodableArg, ...]],
        on_lost: LostCallback | None,
    ) -> None:
        self.name = name
        self.fencing_token = fencing_token
        self.lease = lease
        self.auto_renew = auto_renew
        self._owner = owner
        self._count = count
        self._loop = asyncio.get_running_loop()
        self._expires_at = expires_at
        self._renew_at = expires_at - lease * 2 / 3 if auto_renew else expires_at
        self._state = HoldState.HELD
        self._task = task
        self._renew_call = renew_call
        self._on_lost = on_lost
        self._lost_event = asyncio.Event()
        self._lost_reason = ""
        self._guarded: set[asyncio.Task[object]] = set()
        self._done_callback: Callable[[asyncio.Task[object]], object] | None = None

    @property
    def state(self) -> HoldState:
        """The hold's state: held, releasing, released, or lost."""
        return self._state

    @property
    def hold_count(self) -> int:
        """How many times the holding task has entered the lock (as of the last reply)."""
        return self._count

    @property
    def lost(self) -> bool:
        """``True`` once the lease is known to have ended while held."""
        return self._state is HoldState.LOST

    @property
    def lost_reason(self) -> str:
        """Why the lease was lost (empty while it is not)."""
        return self._lost_reason

    def remaining(self) -> float:
        """Seconds the lease is known to last from now (a local estimate; 0 when over)."""
        if self._state is not HoldState.HELD:
            return 0.0
        return max(0.0, self._expires_at - self._loop.time())

    async def wait_lost(self) -> None:
        """Return when the lease is lost (never, if it is released first)."""
        await self._lost_event.wait()

    def _renewed(self, sent_at: float) -> None:
        self._expires_at = sent_at + self.lease
        self._renew_at = sent_at + self.lease / 3

    def _mark_lost(self, reason: str) -> None:
        if self._state is not HoldState.HELD:
            return
        self._state = HoldState.LOST
        self._lost_reason = reason
        self._lost_event.set()
        logger.warning("lease on %r lost: %s", self.name, reason)
        for task in self._guarded:
            task.cancel(f"lease on {self.name!r} lost: {reason}")
        if self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                logger.exception("on_lost callback for %r failed", self.name)

    def __repr__(self) -> str:
        return (
            f"<Lease {self.name!r} token={self.fencing_token} {self._state.value} "
            f"count={self._count} remaining={self.remaining():.3f}s>"
        )
