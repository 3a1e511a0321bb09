"""``FairLock``: a reentrant lock granted strictly in order of arrival, with direct hand-over.

The same hash in Redis as ``Lock`` (see ``_lock``), the same release, re-entry and renewal
scripts; what differs is admission. Every waiting task registers in Redis when it starts to
wait (not only the head of its process's queue), stamped with the server's time; a release hands
the lock to the oldest live registration inside the release script and announces it once, naming
that waiter; and an attempt that finds the lock free while a live waiter is registered ahead
(its grantee never confirmed, or the holder's lease ran out) hands the lock to that waiter
instead of taking it (``lua/fair_acquire.lua``): a newcomer never barges in.

Dead waiters never stall the line: a waiter handed the lock has ``claim_timeout`` to confirm it
(as with ``Lock``); when it does not, one waiting process re-checks when the window ends, and that
attempt hands the lock on to the next live waiter. Registrations whose deadline passed (a waiter
that stopped refreshing: its process died) are dropped when they reach the front of the line.

A ``Lock`` and a ``FairLock`` of the same name are the same lock in Redis: fair waiters keep
their order among themselves, but a ``Lock`` acquirer may take a free lock ahead of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, final

from ._core import Attempt, LockBase
from ._lock import HashLockPolicy
from ._scripts import Call, Script

if TYPE_CHECKING:
    from ._parking import Waiter

__all__ = ("FairLock", "FairLockPolicy")

FAIR_ACQUIRE: Final = Script("fair_acquire.lua")


@final
class FairLockPolicy(HashLockPolicy):
    """The ``FairLock`` policy: every waiter registered, no barging."""

    kind = "fair"
    active_waiters = 1 << 30  # every local waiter registers in Redis
    one_watcher = True  # fair_acquire.lua hands a free lock to the first in line
    ordered_registration = True  # granted in the order the server dated the registrations
    __slots__ = ()

    def try_yields(self, waiters: Iterable[Waiter], attempting: bool) -> bool:
        """First come, first served within the process too: a try yields to a local attempt in
        flight and to a local waiter whose registration the server has not answered yet."""
        return attempting or any(not waiter.known for waiter in waiters)

    def attempt(self, a: Attempt) -> Call:
        """``fair_acquire.lua`` in mode "wait" or "try"; the last argument is the arrival a
        registration the server dropped is put back at (``Attempt.arrival_us``)."""
        keys = self.keys
        mode = "wait" if a.wait else "try"
        args = (
            a.owner,
            a.lease_ms,
            mode,
            a.grace_ms,
            a.claim_ms,
            keys.wire_channel,
            int(a.sharded),
            a.arrival_us,
        )
        return Call(FAIR_ACQUIRE, keys.script_keys, args)


@final
class FairLock(LockBase):
    """A reentrant lock granted strictly first come, first served across tasks and processes.

    ::

        lock = FairLock(client, "jobs:queue-head", timeout=30)
        async with lock as lease:          # granted in order of arrival (server time)
            await work(fence=lease.fencing_token)

    Same API, leases, renewal, cancellation safety and fencing tokens as :class:`Lock`; a
    release hands the lock straight to the longest-waiting live task, whichever process it
    is in, and a task that arrives while others wait queues behind them even if the lock is
    momentarily free. A waiting process that dies delays the line by at most
    ``claim_timeout``. Waiting costs one registration per waiting task (refreshed once per
    holder's lease), where ``Lock`` registers one task per process.
    """

    _policy_class = FairLockPolicy
    __slots__ = ()
