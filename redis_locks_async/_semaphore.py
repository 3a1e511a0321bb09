"""``Semaphore``: N permits across processes, each owned by a task with its own lease.

Layout in Redis (``lua/sem_*.lua``, ``prelude.lua``'s ``sem_admit``): the holders are a sorted
set under the semaphore's name, owner id -> lease expiry (server milliseconds), so a holder whose
process died gives its permit back when its lease ends, without anyone's help; ``sem.meta``
records the permit count, the fencing counter and each holder's token; the waiting line and its
registrations are those of every lock in this library.

Each acquisition is a hold of its own (a task may hold several permits; ``release()`` gives
back the most recent), renewed, lost and cancelled like a ``Lock``'s. Every waiting task
registers in Redis; a release hands its permit straight to the first live waiter in line, and a
larger permit count (``set_permits``) hands every newly free permit at once — one announcement
naming them all, so k free permits wake k waiters. A free permit is taken at once by whoever
asks (like ``Lock``, not ``FairLock``).

The permit count lives in Redis while the semaphore is in use: the first user records its
``permits``, ``set_permits`` changes it for everyone, and it is forgotten a minute after the
semaphore was last used (then the next user's ``permits`` applies again).
"""

from __future__ import annotations

from typing import Any, Final, final

from ._core import Attempt, LockBase, Policy, asyncio_task
from ._lease import LostCallback
from ._scripts import Call, Script, ints, wrong_type_error
from ._validation import to_ms

__all__ = ("Semaphore",)

SEM_ACQUIRE: Final = Script("sem_acquire.lua")
SEM_RELEASE: Final = Script("sem_release.lua")
SEM_RENEW: Final = Script("sem_renew.lua")
SEM_ADMIN: Final = Script("sem_admin.lua")
SCRIPTS: Final = (SEM_ACQUIRE, SEM_RELEASE, SEM_RENEW, SEM_ADMIN)
# The most permits accepted: the scripts count them with Lua numbers (exact integers below
# 2**53) and Redis integers; 2**63 and up came back as a negative count.
MAX_PERMITS: Final = 2**31 - 1


def _check_permits(permits: object) -> int:
    if isinstance(permits, bool) or not isinstance(permits, int):
        raise TypeError(f"permits must be an int, not {type(permits).__name__}")
    if permits < 1:
        raise ValueError(f"permits must be at least 1, got {permits}")
    if permits > MAX_PERMITS:
        raise ValueError(f"permits must be at most {MAX_PERMITS}, got {permits}")
    return permits


@final
class SemaphorePolicy(Policy):
    """The ``Semaphore`` policy: one hold per acquisition, every waiter registered."""

    kind = "sem"
    layout = "sem"
    active_waiters = 1 << 30
    reentrant = False
    __slots__ = ("permits",)

    def __init__(self, name: str, permits: int) -> None:
        super().__init__(name)
        self.permits = permits

    @property
    def key_types(self) -> tuple[tuple[str | bytes, str], ...]:
        """The holders are a sorted set."""
        keys = self.keys
        return ((keys.key, "zset"), (keys.meta, "hash"), (keys.queue, "zset"), (keys.done, "zset"))

    def attempt(self, a: Attempt) -> Call:
        """``sem_acquire.lua``."""
        mode = "wait" if a.wait else "try"
        keys = self.keys
        args = (a.owner, a.lease_ms, mode, a.grace_ms, a.claim_ms, self.permits, keys.wire_channel)
        return Call(SEM_ACQUIRE, keys.script_keys, (*args, int(a.sharded)))

    def reenter(  # pragma: no cover
        self, owner: str, entry: str, lease_ms: int, sharded: bool = False
    ) -> Call:
        """Never called: every acquisition is a permit of its own."""
        raise NotImplementedError("a semaphore's permits are not re-entered")

    def release(self, owner: str, mode: str, entry: str, sharded: bool) -> Call:
        """``sem_release.lua``."""
        keys = self.keys
        args = (owner, mode, entry, keys.wire_channel, "1" if sharded else "0", self.permits)
        return Call(SEM_RELEASE, keys.script_keys, args)

    def renew(self, owner: str, lease: float, sharded: bool | None) -> Call:
        """``sem_renew.lua``; in a cluster's split migration window without meta, whose life
        it prolongs (:attr:`Call.narrow`)."""
        keys = (self.keys.key, self.keys.meta)
        if sharded is None:
            return Call(SEM_RENEW, keys, (owner, to_ms(lease)), keys[:1])
        args = (owner, to_ms(lease), self.keys.wire_channel, int(sharded))
        return Call(SEM_RENEW, keys, args, keys[:1])

    async def locked(self, client: Any) -> bool:
        """No permit is free right now."""
        return await self.free(client) <= 0

    async def free(self, client: Any) -> int:
        """How many permits are free right now."""
        keys = self.keys
        reply = await SEM_ADMIN.run(client, keys.script_keys, ("free", self.permits, "", "0"))
        status, free = ints(reply, 2)
        if status == -2:
            raise wrong_type_error(keys.name, "inspect", keys.key)
        return free


@final
class Semaphore(LockBase):
    """N permits shared across processes through Redis; each holder's permit has its own lease.

    ::

        sem = Semaphore(client, "api-quota", 5, timeout=10)
        async with sem as lease:          # one of 5 permits; waits without polling
            await call_api(fence=lease.fencing_token)

    ``acquire(timeout=…)``, ``release()``, ``extend()``, ``transfer()``, ``guarded()`` and
    ``async with`` work as for :class:`Lock`, except that a task acquiring again takes another
    permit (``release()`` gives back its most recent one). A permit whose holder's process died
    comes back when its lease ends; a released permit goes straight to the first waiter in line.
    ``await sem.set_permits(n)`` changes the count for every user (more permits wake waiters at
    once); ``locked()`` tells whether no permit is free.
    """

    _policy_class = SemaphorePolicy
    __slots__ = ("_permits",)

    def __init__(
        self,
        redis: Any,
        name: str,
        permits: int,
        *,
        lease: float = 30.0,
        auto_renew: bool = True,
        timeout: float | None = None,
        on_lost: LostCallback | None = None,
        claim_timeout: float = 2.0,
        replicas: int = 0,
        replica_timeout: float = 1.0,
        replica_fsync: bool = False,
        max_hold: float | None = None,
    ) -> None:
        self._permits = _check_permits(permits)
        super().__init__(
            redis,
            name,
            lease=lease,
            auto_renew=auto_renew,
            timeout=timeout,
            on_lost=on_lost,
            claim_timeout=claim_timeout,
            replicas=replicas,
            replica_timeout=replica_timeout,
            replica_fsync=replica_fsync,
            max_hold=max_hold,
        )

    def _make_policy(self) -> Policy:
        return SemaphorePolicy(self._name, self._permits)

    @property
    def permits(self) -> int:
        """The permit count this object was built with, or last set (Redis's may differ)."""
        return self._permits

    async def free_permits(self) -> int:
        """How many permits are free right now, as the server sees it (may be negative after
        a decrease, until enough holders leave). Bounded like :meth:`locked`: no answer
        within about a second is a :class:`LockError`."""
        policy = self._policy
        assert isinstance(policy, SemaphorePolicy)
        return await self._ask(policy.free(self._redis), "inspect")

    async def set_permits(self, permits: int) -> None:
        """Change the permit count for every user of this semaphore (``permits`` >= 1).

        More permits are handed to waiting tasks at once; fewer take effect as holders leave.
        Bounded like :meth:`locked`: no answer within about a second is a :class:`LockError`
        (the new count may have been recorded all the same; setting it again is harmless).
        """
        count = _check_permits(permits)
        asyncio_task("set the permits of", self._name)
        policy = self._policy
        assert isinstance(policy, SemaphorePolicy)
        runtime = self._runtime()
        keys = policy.keys
        sharded = "1" if runtime.topology.sharded else "0"
        args = ("set", count, keys.wire_channel, sharded)
        reply = await self._ask(
            SEM_ADMIN.run(self._redis, keys.script_keys, args),
            "set permits of",
            "; the new count may have been recorded all the same",
        )
        if ints(reply, 2)[0] == -2:
            raise wrong_type_error(self._name, "set permits of", keys.key)
        self._permits = policy.permits = count
