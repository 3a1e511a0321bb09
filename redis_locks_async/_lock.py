"""``Lock``: a reentrant distributed lock with direct hand-over and pub/sub wake-up.

Layout in Redis (see ``_keys`` and the contracts in ``lua/lock_*.lua``): the lock is a hash under
its own name with fields ``owner`` (the owner id of the current acquisition), ``token`` (its
fencing token) and one ``e:<id>`` field per re-entry, expiring with the lease. Three auxiliary
keys carry the rest and expire by themselves: ``meta`` (the fencing counter and the waiters'
registrations), ``queue`` (registered waiters by arrival) and ``done`` (owners whose hold ended,
so that re-sent commands are recognised).

Why it is safe: acquisition, re-entry, release and renewal are single scripts that check the
owner id, so a holder whose lease ended can never release or renew someone else's hold; the
release hands the lock to the oldest waiter whose registration is still live (server time)
inside the same script, so a hand-over cannot race with a newcomer; every script is idempotent,
so redis-py's retry after a lost reply never counts twice. Where it is not: like every
lease-based lock it is an *efficiency* lock for a holder paused longer than its lease (GC, VM
freeze, SIGSTOP): pass ``lease.fencing_token`` to the protected resource and have it reject
lower tokens when correctness matters.

Hand-over is first come, first served across processes (in order of registration, one
registered waiter per process), but a task arriving while the lock is free takes it at once,
ahead of waiters that have not yet noticed an expiry: use ``FairLock`` for strict FIFO.
"""

from __future__ import annotations

from typing import Any, Final, final

from redis.exceptions import ResponseError

from ._core import Attempt, LockBase, Policy
from ._scripts import Call, Script, wrong_type_error
from ._validation import to_ms

__all__ = ("HashLockPolicy", "Lock", "LockPolicy")

LOCK_ACQUIRE: Final = Script("lock_acquire.lua")
LOCK_REENTER: Final = Script("lock_reenter.lua")
LOCK_RELEASE: Final = Script("lock_release.lua")
LOCK_RENEW: Final = Script("lock_renew.lua")
SCRIPTS: Final = (LOCK_ACQUIRE, LOCK_REENTER, LOCK_RELEASE, LOCK_RENEW)


class HashLockPolicy(Policy):
    """What ``Lock`` and ``FairLock`` share: the hash layout and its re-entry, release and
    renewal scripts (they differ only in how an attempt treats the waiters in line)."""

    __slots__ = ()

    def reenter(self, owner: str, entry: str, lease_ms: int, sharded: bool = False) -> Call:
        """``lock_reenter.lua``."""
        args = (owner, entry, lease_ms, self.keys.wire_channel, "1" if sharded else "0")
        return Call(LOCK_REENTER, (self.keys.key,), args)

    def release(self, owner: str, mode: str, entry: str, sharded: bool) -> Call:
        """``lock_release.lua``."""
        return Call(
            LOCK_RELEASE,
            self.keys.script_keys,
            (owner, mode, entry, self.keys.wire_channel, "1" if sharded else "0"),
        )

    def renew(self, owner: str, lease: float, sharded: bool | None) -> Call:
        """``lock_renew.lua``."""
        if sharded is None:
            return Call(LOCK_RENEW, (self.keys.key,), (owner, to_ms(lease)))
        args = (owner, to_ms(lease), self.keys.wire_channel, "1" if sharded else "0")
        return Call(LOCK_RENEW, (self.keys.key,), args)

    async def locked(self, client: Any) -> bool:
        """The lock hash exists, in one round trip (``TYPE`` and ``HGET … owner``,
        pipelined). A key of another type under the name is an error (the caller names it),
        and so is a hash that is not a lock (a user's, a read/write lock's): an acquisition
        refuses it too."""
        name, key = self.keys.name, self.keys.key
        pipe = client.pipeline(transaction=False)
        pipe.type(key)
        pipe.hget(key, "owner")
        kind, owner = await pipe.execute(raise_on_error=False)
        for reply in (kind, owner):
            if isinstance(reply, BaseException):
                # The server's refusal (CLUSTERDOWN, LOADING, NOPERM…), as it is: not taken for
                # a key of another type (helper-55: "wrong type" while a cluster was down).
                raise reply
        text = kind.decode() if isinstance(kind, bytes) else str(kind)
        if text not in ("none", "hash"):
            raise ResponseError("WRONGTYPE the lock's key holds a value of another type")
        if text == "hash" and owner is None:
            raise wrong_type_error(name, "inspect", key)
        return text == "hash"


@final
class LockPolicy(HashLockPolicy):
    """The ``Lock`` policy: head-only admission, counted re-entry, a free lock is taken at
    once (see the module docstring)."""

    kind = "lock"
    __slots__ = ()

    def attempt(self, a: Attempt) -> Call:
        """``lock_acquire.lua`` in mode "wait" or "try"."""
        mode = "wait" if a.wait else "try"
        args = (a.owner, a.lease_ms, mode, a.grace_ms, a.claim_ms)
        return Call(LOCK_ACQUIRE, self.keys.script_keys, args)


@final
class Lock(LockBase):
    """A reentrant lock shared across processes through Redis, owned by an asyncio task.

    ::

        lock = Lock(client, "orders:42", lease=30.0, timeout=10)
        async with lock as lease:          # waits without polling; LockTimeout after 10 s
            await write(order, fence=lease.fencing_token)

    One ``Lock`` object may be shared by many tasks: they exclude each other, and a task that
    holds the lock re-enters it (release once per acquire), also through another ``Lock``
    object of the same client. The lease (default 30 s) is renewed every third of its length
    while the lock is held (``auto_renew``); if it cannot be renewed before it ends it is
    *lost*: ``release()`` raises :class:`LockLostError`, ``on_lost(lease)`` is called (or
    awaited), ``lease.lost`` turns true, and a block entered with :meth:`guarded` is cancelled.
    A waiting task sleeps until the holder releases (the release hands it the lock directly)
    or, at the latest, until the holder's lease would end. A waiter that was handed the lock
    confirms it within ``claim_timeout`` (default 2 s) — a waiting process that died therefore
    delays the next waiter by at most that. Cancelling a task anywhere in ``acquire`` or
    ``release`` never leaves a ghost holder behind.
    """

    _policy_class = LockPolicy
    __slots__ = ()
