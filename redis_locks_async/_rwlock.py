"""``ReadWriteLock``: many readers or one writer, in one hash per name (so it works on a cluster).

Layout in Redis (``lua/rw_*.lua``, ``prelude.lua``'s ``rw_state``): the lock is a hash under its
own name. The writer is fields ``w`` (owner id), ``wt`` (fencing token), ``wx`` (expiry, server
milliseconds) and ``we`` (its re-entries); each reader is a field ``r:<owner id>`` holding its
own expiry, token and re-entries. Every hold has its own lease, renewed on its own, so a reader
whose process died ends with its lease without touching the others; the key's TTL is kept at
least as long as the longest hold, and expired holds are dropped by the next script that looks.
The waiting line (``rw.queue``) and the registrations (``rw.meta``) are those of every lock in
this library, each registration marked with its side.

The two sides are two lock objects of ``Lock``'s shape, ``rw.read`` and ``rw.write``, over one
core (two policies that differ only in their side). Rules:

* readers share the lock; a writer excludes everyone; each side is reentrant per task;
* **downgrade**: a task holding the write side may take the read side (at once, whatever
  waits); when it then releases the write side, the readers at the front of the line get in
  together, announced in one message;
* **upgrade** — taking the write side while holding the read side — is refused at once with a
  :class:`LockError` naming the lock: two readers upgrading would wait for each other forever;
* **writer preference** (default): while a writer waits, new readers wait too, so a stream of
  readers cannot starve it; ``prefer_writers=False`` lets readers in whenever no writer holds
  the lock (a writer then waits for a moment without readers).

Fencing tokens increase with every acquisition of either side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, final

from ._core import Attempt, LockBase, Policy
from ._lease import unclaimed
from ._scripts import Call, Script, ints, wrong_type_error
from ._validation import to_ms

if TYPE_CHECKING:
    from ._lease import Hold, LostCallback
    from ._parking import Waiter

__all__ = ("ReadWriteLock",)

RW_ACQUIRE: Final = Script("rw_acquire.lua")
RW_REENTER: Final = Script("rw_reenter.lua")
RW_RELEASE: Final = Script("rw_release.lua")
RW_RENEW: Final = Script("rw_renew.lua")
RW_LOCKED: Final = Script("rw_locked.lua")
SCRIPTS: Final = (RW_ACQUIRE, RW_REENTER, RW_RELEASE, RW_RENEW, RW_LOCKED)


class _SidePolicy(Policy):
    """One side of a read/write lock (``side``: "r" or "w")."""

    kind = "rw"
    layout = "rw"
    active_waiters = 1 << 30  # every waiter registers: readers are let in together
    side: ClassVar[str]
    __slots__ = ("_prefer",)

    def __init__(self, name: str, prefer_writers: bool) -> None:
        super().__init__(name)
        self._prefer = "1" if prefer_writers else "0"

    @property
    def hold_key(self) -> Hashable:
        """The read and write sides of one name are different holds."""
        return ("rw", self.keys.name, self.side)

    @property
    def hold_keys(self) -> tuple[Hashable, ...]:
        """Both sides of the name."""
        return (("rw", self.keys.name, "r"), ("rw", self.keys.name, "w"))

    def attempt(self, a: Attempt) -> Call:
        """``rw_acquire.lua``."""
        keys = self.keys
        mode = "wait" if a.wait else "try"
        side, prefer = self.side, self._prefer
        args = (a.owner, side, a.lease_ms, mode, a.grace_ms, a.claim_ms, keys.wire_channel)
        return Call(RW_ACQUIRE, keys.script_keys, (*args, int(a.sharded), prefer, a.peer))

    def reenter(self, owner: str, entry: str, lease_ms: int, sharded: bool = False) -> Call:
        """``rw_reenter.lua``."""
        args = (owner, self.side, entry, lease_ms, self.keys.wire_channel, "1" if sharded else "0")
        return Call(RW_REENTER, (self.keys.key,), args)

    def release(self, owner: str, mode: str, entry: str, sharded: bool) -> Call:
        """``rw_release.lua``."""
        keys = self.keys
        args = (owner, self.side, mode, entry, keys.wire_channel, "1" if sharded else "0")
        return Call(RW_RELEASE, keys.script_keys, args)

    def renew(self, owner: str, lease: float, sharded: bool | None) -> Call:
        """``rw_renew.lua``."""
        if sharded is None:
            return Call(RW_RENEW, (self.keys.key,), (owner, self.side, to_ms(lease)))
        args = (owner, self.side, to_ms(lease), self.keys.wire_channel, "1" if sharded else "0")
        return Call(RW_RENEW, (self.keys.key,), args)

    def transfer_conflict(
        self, holds: Mapping[tuple[Hashable, asyncio.Task[Any]], Hold], task: asyncio.Task[Any]
    ) -> str | None:
        """A task holding both sides (a downgrade) hands over neither: the writer and a reader
        would be two tasks."""
        other = "r" if self.side == "w" else "w"
        hold = unclaimed(holds.get((("rw", self.keys.name, other), task)))
        if hold is not None and hold.live:
            return (
                f"this task holds its {'read' if other == 'r' else 'write'} side too (a "
                "downgrade): handed over alone, a writer and a reader would hold it at once in "
                "two tasks — release one side first"
            )
        return None

    async def locked(self, client: Any) -> bool:
        """``rw_locked.lua``: the write side is locked while anyone holds the lock, the read
        side while a writer holds it. A hash that is not a read/write lock is refused, as an
        acquisition refuses it."""
        reply = await RW_LOCKED.run(client, (self.keys.key,), (self.side,))
        status = ints([reply], 1)[0]
        if status == -2:
            raise wrong_type_error(self.keys.name, "inspect", self.keys.key)
        return status == 1


@final
class _ReadPolicy(_SidePolicy):
    side = "r"
    __slots__ = ()

    def try_yields(self, waiters: Iterable[Waiter], attempting: bool) -> bool:
        """With writers preferred, a read try yields to a local writer waiting whose
        registration the server has not answered yet (registered writers the script sees)."""
        return self._prefer == "1" and any(
            waiter.side == "w" and not waiter.known for waiter in waiters
        )

    @property
    def peer_key(self) -> Hashable:
        """The write side: a task that holds it downgrades."""
        return ("rw", self.keys.name, "w")


@final
class _WritePolicy(_SidePolicy):
    side = "w"
    __slots__ = ()

    def conflict(
        self, holds: Mapping[tuple[Hashable, asyncio.Task[Any]], Hold], task: asyncio.Task[Any]
    ) -> str | None:
        """An upgrade (write while holding read) is refused: it would deadlock."""
        read = unclaimed(holds.get((("rw", self.keys.name, "r"), task)))
        if read is not None and read.live:
            return (
                "this task holds it for reading; taking it for writing as well would wait for "
                "its own read hold (and two readers upgrading would wait for each other forever)"
                " — release the read side first, or take the write side first and downgrade"
            )
        return None


class _Side(LockBase):
    """One side of a :class:`ReadWriteLock` (the shape of :class:`Lock`)."""

    _side_policy: ClassVar[type[_SidePolicy]]
    __slots__ = ("_prefer",)

    def __init__(self, redis: Any, name: str, *, prefer_writers: bool, **options: Any) -> None:
        self._prefer = prefer_writers
        super().__init__(redis, name, **options)

    def _make_policy(self) -> Policy:
        return self._side_policy(self._name, self._prefer)


@final
class ReadLock(_Side):
    """The read side of a :class:`ReadWriteLock`: shared with other readers."""

    _side_policy = _ReadPolicy
    __slots__ = ()


@final
class WriteLock(_Side):
    """The write side of a :class:`ReadWriteLock`: excludes readers and other writers."""

    _side_policy = _WritePolicy
    __slots__ = ()


@final
class ReadWriteLock:
    """Many readers or one writer, across processes, in one Redis hash per name.

    ::

        rw = ReadWriteLock(client, "catalog")
        async with rw.read as lease:       # with other readers
            await show(catalog, fence=lease.fencing_token)
        async with rw.write:               # alone
            await update(catalog)

    ``rw.read`` and ``rw.write`` have the shape of :class:`Lock` (``acquire``, ``release``,
    ``extend``, ``transfer``, ``guarded``, ``async with``, leases, renewal, fencing tokens).
    Each side is reentrant per task; a task holding the write side may take the read side (a
    downgrade: when it releases the write side, waiting readers get in together); taking the
    write side while holding the read side raises :class:`LockError` at once (it would
    deadlock). With ``prefer_writers`` (default) new readers wait while a writer waits.
    """

    __slots__ = ("_name", "_read", "_write")

    def __init__(
        self,
        redis: Any,
        name: str,
        *,
        lease: float = 30.0,
        auto_renew: bool = True,
        timeout: float | None = None,
        on_lost: LostCallback | None = None,
        claim_timeout: float = 2.0,
        prefer_writers: bool = True,
        replicas: int = 0,
        replica_timeout: float = 1.0,
        replica_fsync: bool = False,
        max_hold: float | None = None,
    ) -> None:
        if not isinstance(prefer_writers, bool):
            raise TypeError(f"prefer_writers must be a bool, not {type(prefer_writers).__name__}")
        options: dict[str, Any] = {
            "prefer_writers": prefer_writers,
            "lease": lease,
            "auto_renew": auto_renew,
            "timeout": timeout,
            "on_lost": on_lost,
            "claim_timeout": claim_timeout,
            "replicas": replicas,
            "replica_timeout": replica_timeout,
            "replica_fsync": replica_fsync,
            "max_hold": max_hold,
        }
        self._read = ReadLock(redis, name, **options)
        self._write = WriteLock(redis, name, **options)
        self._name = name

    @property
    def read(self) -> ReadLock:
        """The read side: a lock object of :class:`Lock`'s shape, held by many tasks at once
        (each with its own lease) while no writer holds the lock."""
        return self._read

    @property
    def write(self) -> WriteLock:
        """The write side: a lock object of :class:`Lock`'s shape, held by one task while no
        reader holds the lock (a holder may also take the read side: a downgrade)."""
        return self._write

    @property
    def name(self) -> str:
        """The lock's name (also its Redis key)."""
        return self._name

    def __repr__(self) -> str:
        return f"<ReadWriteLock {self._name!r} read={self.read!r} write={self.write!r}>"
