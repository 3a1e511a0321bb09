"""``Lock``: a reentrant distributed lock with direct handover and pub/sub wake-up.

Layout in Redis (see ``_keys``): the lock is a hash under its own name with fields ``owner``
(the owner id of the current acquisition), ``count`` (re-entries) and ``token`` (the fencing
token), expiring with the lease. ``{name}:fence`` counts fencing tokens and never expires, so
tokens keep increasing after the lock key itself expired. ``{name}:waiters`` and
``{name}:waiter-info`` list the registered waiters (one per process per name: the head of
that process's local queue) with their registration deadlines.

Why it is safe: acquisition, re-entry, release and renewal are single scripts that check the
owner id, so a holder whose lease ended can never release or renew someone else's hold; the
release hands the lock to the oldest waiter whose registration is still live (server time)
inside the same script, so a handover cannot race with a newcomer. Where it is not: like every
lease-based lock it is an *efficiency* lock for a holder paused longer than its lease (GC, VM
freeze, SIGSTOP): the lease ends and another task acquires it while the paused holder still
believes it holds it. Pass ``lease.fencing_token`` to the protected resource and have it reject
lower tokens when correctness matters.

Handover is first come, first served across processes (in order of registration), but a task
arriving while the lock is free takes it at once, ahead of waiters that have not yet noticed an
expiry: use ``FairLock`` for strict FIFO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, final

from ._base import LockBase
from ._scripts import LOCK_EXTEND, AcquireReply, lock_acquire, lock_release, lock_settle

if TYPE_CHECKING:
    from ._scripts import EncodableArg, Script

__all__ = ("Lock",)


@final
class Lock(LockBase):
    """A reentrant lock shared across processes through Redis, owned by an asyncio task.

    ::

        lock = Lock(client, "orders:42", lease=30.0, timeout=10)
        async with lock as lease:          # waits without polling; LockTimeout after 10 s
            await write(order, fence=lease.fencing_token)

    One ``Lock`` object may be shared by many tasks: they exclude each other, and a task that
    holds the lock re-enters it (release once per acquire). The lease (default 30 s) is renewed
    every third of its length by a background task while the lock is held (``auto_renew``);
    if it cannot be renewed before it ends it is *lost*: ``release()`` raises
    :class:`LockLostError`, ``on_lost(lease)`` is called, ``lease.lost`` turns true, and a
    block entered with :meth:`guarded` is cancelled. A waiting task sleeps until the holder
    releases (the release hands it the lock directly) or, at the latest, until the holder's
    lease would end. Cancelling a task anywhere in ``acquire`` or ``release`` never leaves a
    ghost holder behind.
    """

    __slots__ = ()

    async def _attempt(self, owner: str, lease_ms: int, mode: str, grace_ms: int) -> AcquireReply:
        return await lock_acquire(self._redis, self._keys, owner, lease_ms, mode, grace_ms)

    async def _release_script(self, owner: str, mode: str) -> tuple[int, int]:
        return await lock_release(self._redis, self._keys, owner, mode, sharded=False)

    async def _settle_script(self, owner: str, expected: int) -> int:
        return await lock_settle(self._redis, self._keys, owner, expected)

    def _renew_call(
        self, owner: str, lease_ms: int
    ) -> tuple[Script, tuple[str, ...], tuple[EncodableArg, ...]]:
        return LOCK_EXTEND, (self._keys.name,), (owner, lease_ms)
