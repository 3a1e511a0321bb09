"""The core: one acquire / wait / cancel / renew / release algorithm every primitive plugs into.

A primitive is a thin **policy** over this core (:class:`Policy`): it supplies its key space, its
scripts (``attempt``, ``reenter``, ``release``, the renewal call), ``locked()``, how many local
waiters may talk to Redis at once (``active_waiters``: 1 is head-only admission) and its hold
key (which tells the read side of a lock from its write side, or one permit from another). The
core owns everything else, once:

1. **Ownership.** The owner is the asyncio task. Each fresh acquisition gets a new owner id
   (``_owners.new_owner_id``: 128 unguessable bits, never reused); the runtime maps
   ``(hold key, task)`` to the :class:`~._lease.Hold`, so a task that acquires again re-enters.
   Re-entries are *entries* (``e:<id>`` fields in Redis), so a re-entry or a release re-sent by
   a retrying client counts once, and undoing one cancelled re-entry never touches another.
   ``acquire()`` run as the whole body of a helper task — what ``asyncio.wait_for`` does on
   Python 3.10/3.11 — is owned by the task awaiting that ``wait_for``; any other such task
   (``create_task(lock.acquire())``) is refused at the call with the fix in the message,
   because the task ends the moment it would hold the lock.
2. **Acquire.** When no local task waits for the lock, one attempt (the uncontended fast path).
   A try (``timeout=0``) makes its one attempt also beside local waiters, unless the policy
   orders arrivals and an earlier one may be unknown to the server (``Policy.try_yields``).
   Otherwise the caller joins the lock's parking lot (``_parking``); an active waiter subscribes
   the lock's channel and waits for the confirmation (``_notify``) *before* its registering
   attempt, so a release cannot slip in between; it then sleeps until a grant names it (it holds
   the lock: no round trip), a release frees the lock (re-check), or its timer fires — at the
   holder's remaining lease (expiry announces nothing), or at the end of a claim window when the
   lock was handed to someone else (a waiter that died while registered delays the next one by
   at most that window). Every wait — for a turn, a confirmation, a reply, a wake-up — is bounded
   by the caller's deadline, so ``acquire(timeout=t)`` returns within about ``t`` whatever the
   network does.
3. **Cancellation: one guard.** A command that may change the lock runs in a job task whose
   reply the caller awaits (the caller's cancellation never interrupts it half-way, and redis-py
   can never swallow the caller's cancellation). If the caller gives up — cancelled, deadline
   passed, or an error after which the command may still have run — the command's *undo*
   (abandon the owner id, or drop the re-entry) is sent at once in a tracked, retried
   background task. The undo of an acquisition also records the owner id as finished in Redis,
   so an attempt that reaches the server *after* its undo (another connection, a slow network)
   is refused there: a cancelled acquisition never leaves a ghost holder. Releases run in their
   own task too: cancelling a release does not stop it, and a task that ends while its release
   is in flight leaves nothing behind.
4. **Renewal** is the runtime's lease keeper (``_renewal``); whatever changes a hold's lease
   (``extend``, re-entry, a hand-over to confirm) reschedules it there.

Where it is not safe: like every lease-based lock, for a holder paused longer than its lease
(GC, VM freeze, SIGSTOP) — pass the fencing token to the protected resource.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import itertools
import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterable, Mapping
from dataclasses import dataclass
from types import CodeType, FrameType, TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Final,
    NamedTuple,
    NoReturn,
    TypeVar,
    cast,
    final,
)

from redis.exceptions import (
    MaxConnectionsError,
    NoScriptError,
    RedisClusterException,
    RedisError,
)

from . import _telemetry as telemetry
from ._errors import LockError, LockLostError, LockNotOwnedError, LockTimeout, describe
from ._keys import LockKeys
from ._lease import Hold, HoldState, Lease, LostCallback, Snapshot, unclaimed
from ._owners import new_owner_id
from ._parking import Granted, News, ParkingLot, Waiter
from ._runtime import Runtime, existing_runtime, observed_runtime, runtime_for
from ._scripts import Call, explain, ints, wrong_type_error
from ._validation import check_lease, check_name, check_replicas, check_timeout, to_ms
from ._wire import never_sent, recent_failure

if TYPE_CHECKING:
    from ._notify import Hub
    from ._runtime import Topology

__all__ = ("UNSET", "Attempt", "LockBase", "LockState", "LockStatistics", "Policy", "Reply")

logger = logging.getLogger("redis_locks_async")

_T = TypeVar("_T")

REGISTRATION_GRACE: Final = 2.0  # seconds a registration outlives the holder's lease (+ claim)
TRY_BOUND: Final = 1.0  # seconds a single attempt (blocking=False) waits for its reply
# seconds between a waiter's re-checks while its lock's channel is subscribed nowhere (its slot
# is moving between cluster nodes: no announcement can reach it)
ORPHAN_RECHECK: Final = 1.0
_TIMER_SLACK: Final = 0.001  # seconds a loop timer may fire before its time (clock resolution)
REPLICA_WAIT_FLOOR: Final = 0.05  # seconds a replica sync may wait past the caller's deadline
# Seconds a WAIT's reply may come after its timeout: the server ends a blocked WAIT on its
# timer (every 100 ms at the default hz 10), and the reply has a round trip to make.
REPLICA_REPLY_SLACK: Final = 0.15
# Seconds a waiter that gives up waits for its clean-up: a round trip on a healthy server;
# when the server stopped answering mid-wait, this is how late a timeout returns (was 0.5 s).
CLEANUP_GRACE: Final = 0.1
RELEASE_PATIENCE: Final = 1.0  # seconds a release waits for an answer, at least
# Seconds a waiter's attempt waits for its reply before it gives its connection up and the
# waiter waits on under a new owner id (LockBase._wait; a connection gone silent — half-open: a
# NAT or a proxy dropped it — under a client without a socket_timeout would hold the waiter for
# ever, the lock free meanwhile). Also the first attempt's bound on such a client.
ATTEMPT_PATIENCE: Final = 5.0
# Seconds a waiter's first attempt waits for its channel's subscription to be confirmed before
# it attempts without it, its timers the fallback (a pub/sub path that hangs while commands
# pass). Over the hub's own bound on an unconfirmed subscription (PING_TIMEOUT, 2 s: it
# reconnects then), so that one reconnection may still bring it in time.
SUBSCRIBE_PATIENCE: Final = 3.0
# What "no reply within TRY_BOUND" may mean (a refused connection is retried by redis-py's Retry
# for longer than the bound, so its error never reaches the caller).
_NO_REPLY: Final = " (unreachable, paused, or its connection failing under the client's Retry)"
_ERROR_BACKOFF: Final = (0.05, 0.1, 0.2, 0.5, 1.0)
_POOL_BACKOFF: Final = (0.002, 0.005, 0.01, 0.02, 0.05)  # a pool frees up within a round trip
# A clean-up's pauses while the pool is exhausted (LockBase._retrying): it has time.
_POOL_WAITS: Final = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0)
_ARRIVALS: Final = itertools.count(1)  # numbers acquire() calls in this process (Waiter.arrival)
# Seconds after it queued (or attempted) that an earlier arrival of another client of the same
# server is waited for, at most, to register first (LockBase._kin_first): the order is kept
# across clients when they are healthy; one stuck on its own pool or connection holds the
# others back no longer.
KIN_PATIENCE: Final = 0.25
_EAGER: Final = sys.version_info >= (3, 12)
# Awaiting redis-py in the caller's task is safe only where a swallowed cancellation can be
# seen (Task.cancelling(), Python 3.11+); Python 3.10 runs every command in a job task.
_DIRECT: Final = sys.version_info >= (3, 11)


class _Unset(enum.Enum):
    UNSET = enum.auto()


UNSET: Final = _Unset.UNSET
"""Marker for "use the lock's own timeout" in :meth:`LockBase.acquire`."""


class LockState(enum.Enum):
    """What one lock object is doing for the calling task."""

    IDLE = "idle"
    ACQUIRING = "acquiring"
    HELD = "held"
    RELEASING = "releasing"
    LOST = "lost"


@final
@dataclass(frozen=True, slots=True)
class LockStatistics:
    """What one lock object saw in this process (a local, synchronous snapshot; no I/O).

    Counters cover every task that used this lock object. ``waiting`` and ``held`` are the
    tasks of this process waiting for / holding the lock right now (through any lock object of
    the same client).
    """

    name: str
    acquisitions: int  # fresh acquisitions (re-entries not included)
    handovers: int  # of which the lock was handed over by a release while waiting
    reentries: int
    releases: int  # holds ended by release (inner ones included)
    timeouts: int  # acquire calls that gave up (False or LockTimeout)
    lost: int  # leases lost while held
    wait_time: float  # seconds waited in total (also by waits that timed out or were cancelled)
    waiting: int
    held: int


@final
class _Counters:
    __slots__ = ("acquisitions", "handovers", "lost", "reentries", "releases", "timeouts", "waited")

    def __init__(self) -> None:
        self.acquisitions = self.handovers = self.reentries = 0
        self.releases = self.timeouts = self.lost = 0
        self.waited = 0.0


class Attempt(NamedTuple):
    """What the core asks of an acquisition attempt (see :meth:`Policy.attempt`)."""

    owner: str  # the acquisition's owner id
    lease_ms: int
    wait: bool  # register to be handed the lock when it cannot be taken now
    grace_ms: int  # how long a registration outlives max(holder's remaining lease, lease_ms)
    claim_ms: int  # how long a waiter handed the lock has to confirm it
    sharded: bool  # announce with SPUBLISH, should the attempt hand the lock over
    peer: str  # owner id of the caller's hold on Policy.peer_key, or ""
    # The server's clock (µs) in its answer to this owner's first registration (0: none yet).
    # A policy that orders registrations (``Policy.ordered_registration``) puts a registration
    # the server dropped back at this arrival, answering -3 (see :class:`Reply`).
    arrival_us: int = 0


class Reply(NamedTuple):
    """What an ``attempt`` or ``reenter`` script answered (see the Lua contracts).

    ``status``: 1 held by the caller, 0 held by another owner, -1 refused (not the owner, or a
    late duplicate of an abandoned acquisition), -2 ``token`` is the 1-based index of a key of
    the wrong type, -3 as 0, and the caller's registration was gone: it was put back at
    ``Attempt.arrival_us`` (the process's other registrations may be gone too).
    ``ttl_ms``: the lock's remaining TTL (-1: none). With status 0 (or -3) in "wait" mode
    ``token`` is the server's clock (µs) when the caller was registered: a grant's own server
    time is measured from it (see :func:`_claim_end`).
    """

    status: int
    token: int
    holds: int
    ttl_ms: int


class Policy(ABC):
    """What a primitive supplies to the core (module docstring). One instance per lock object.

    The script methods return the :class:`~._scripts.Call` to run; the core runs it on the
    topology's client, with the reply shapes of this contract: ``attempt`` and ``reenter``
    answer four integers (:class:`Reply`), ``release`` two — ``(1, count)`` still held,
    ``(0, 0)`` released (or already released), ``(-1, 0)`` not held (lost) — and ``renew``
    1 (renewed) or 0 (lost). Release modes: ``"entry"`` drops one re-entry (``entry``),
    ``"final"`` ends the owner's last hold, ``"abandon"`` gives up everything an owner id
    reached (a registration, a hand-over, a hold) and fences it against its own late attempts.
    """

    kind: ClassVar[str] = "lock"
    # The key layout and hold key: primitives of the same layout on one name are one lock.
    layout: ClassVar[str] = "lock"
    active_waiters: ClassVar[int] = 1
    # True when an attempt that finds the lock free hands it to the first live registration
    # (FairLock): then one waiter per process re-checking when the holds ahead may end
    # unannounced is enough — the first such waiter in the parking lot; the others only keep
    # their registrations alive (and the next one takes over the watch when the first leaves).
    one_watcher: ClassVar[bool] = False
    # True when the server's order of registrations is the order of grants (FairLock): the
    # waiters of a process then register one after the other, in the order they arrived
    # (ParkingLot.turn_to_register) — sent at once, they would reach the server in any order;
    # also after those of other clients of the same server, for KIN_PATIENCE at most
    # (LockBase._kin_first). It costs a round trip per waiter of a burst, so only a policy
    # that promises FIFO asks. Its attempts carry the arrival the server gave a waiter's first
    # registration (Attempt.arrival_us): a registration the server dropped meanwhile is put
    # back in its place (the attempt answers -3, and the process's other waiters re-check).
    ordered_registration: ClassVar[bool] = False
    reentrant: ClassVar[bool] = True  # False: each acquire by a task is a new hold (a permit)
    side: ClassVar[str] = ""  # which side of its lock (a read/write lock's "r" or "w")

    __slots__ = ("keys",)

    def __init__(self, name: str) -> None:
        self.keys = LockKeys.for_name(name, self.layout)

    @property
    def key_types(self) -> tuple[tuple[str | bytes, str], ...]:
        """Each key of the lock with the Redis type it must have (to name a wrong-type key)."""
        keys = self.keys
        return ((keys.key, "hash"), (keys.meta, "hash"), (keys.queue, "zset"), (keys.done, "zset"))

    @property
    def hold_key(self) -> Hashable:
        """What a task holds (with the task): re-acquiring the same hold key re-enters."""
        return (self.layout, self.keys.name)

    @property
    def hold_keys(self) -> tuple[Hashable, ...]:
        """Every hold key of this lock (both sides of a read/write lock): a task waiting to
        acquire any of them cannot be handed a hold of the lock (:meth:`LockBase.transfer`)."""
        return (self.hold_key,)

    def key_of(self, index: int) -> str | bytes:
        """The key a ``-2`` reply names (1-based, in script order)."""
        keys = self.keys.script_keys
        return keys[index - 1] if 1 <= index <= len(keys) else keys[0]

    @property
    def peer_key(self) -> Hashable | None:
        """Another hold key of the same lock whose holder the scripts must know (the write side
        for the read side of a read/write lock: a downgrade); ``None`` for most primitives."""
        return None

    def conflict(
        self, holds: Mapping[tuple[Hashable, asyncio.Task[Any]], Hold], task: asyncio.Task[Any]
    ) -> str | None:
        """Why ``task`` may not acquire this lock given what it ``holds`` (``None``: it may).
        A read side refuses the write side of the same lock here, for instance."""
        return None

    def transfer_conflict(
        self, holds: Mapping[tuple[Hashable, asyncio.Task[Any]], Hold], task: asyncio.Task[Any]
    ) -> str | None:
        """Why ``task`` may not hand its hold of this lock to another task given what else it
        ``holds`` (``None``: it may). One side of a read/write lock whose other side the task
        also holds (a downgrade) refuses here: handed over alone, a writer and a reader would
        hold it at once in two tasks."""
        return None

    def try_yields(self, waiters: Iterable[Waiter], attempting: bool) -> bool:
        """Whether a try (``timeout=0``) answers False without asking the server, given this
        process's tasks waiting for the lock (``waiters``, in arrival order; the core reads
        :attr:`Waiter.side` and :attr:`Waiter.known`) and whether an attempt on it is in flight
        here (``attempting``). Only a policy that orders arrivals yields: a local waiter or
        attempt that came first may not be known to the server yet, and a try sent beside it
        would overtake it. ``False`` for most: the server alone knows whether a permit, a read
        share or the lock is free, and a try is a newcomer like any other process's."""
        return False

    def margin(self, lease: float) -> float:
        """Seconds by which the local estimate of a lease's end is kept short of the server's,
        for a lease of ``lease`` seconds: ``lease·0.01 + 2 ms`` (RedLock's clock-drift
        allowance). On one server it is the slack for the event loop's lag at that moment: the
        loss must be signalled before another client can take the lock, and a timer due at the
        server's very end fired a few milliseconds after a rival's acquire under ordinary lag
        (helper-72)."""
        return lease * 0.01 + 0.002

    @abstractmethod
    def attempt(self, a: Attempt) -> Call:
        """Take the lock for ``a.owner`` if it may be taken now; with ``a.wait``, register to be
        handed it otherwise (see :class:`Attempt`)."""

    @abstractmethod
    def reenter(self, owner: str, entry: str, lease_ms: int, sharded: bool = False) -> Call:
        """Add re-entry ``entry`` to ``owner``'s hold and renew its lease; a lease made
        shorter than it was is announced ("r": re-check) on the lock's channel (``sharded``:
        with ``SPUBLISH``), so waiters do not sleep until the longer one would have ended."""

    @abstractmethod
    def release(self, owner: str, mode: str, entry: str, sharded: bool) -> Call:
        """Release in ``mode`` (class docstring)."""

    @abstractmethod
    def renew(self, owner: str, lease: float, sharded: bool | None) -> Call:
        """Renew ``owner``'s lease to ``lease`` seconds (pipelined by the lease keeper; also
        ``extend()``). With ``sharded`` given, a lease made shorter than it was is announced
        as :meth:`reenter` does: ``extend()`` always gives it; the keeper only while the hold
        was made shorter without an announcement known to have run (``Hold.shortened``: a
        shorter setting given up on, perhaps before it was sent) — the keeper's other
        renewals never shorten a lease, and 10,000 of them per tick stay lean."""

    @abstractmethod
    async def locked(self, client: Any) -> bool:
        """Whether anyone holds the lock, as the server sees it now."""


class _Expired(Exception):
    """The caller's deadline passed while a command was in flight."""


class _Unanswered(Exception):
    """A waiter's attempt had no reply within ATTEMPT_PATIENCE, or one that came after the
    lease it gave had ended (given up, see ``_adopt``): wait on as a new owner (``arrival_us``:
    the server's time of the registration given up, 0 if none)."""

    def __init__(self, arrival_us: int) -> None:
        super().__init__(arrival_us)
        self.arrival_us = arrival_us


class _JobCancelled(Exception):
    """A command's job task was cancelled under a caller that was not (the client closed)."""


def _is_async_client(redis: object) -> bool:
    return inspect.iscoroutinefunction(getattr(redis, "execute_command", None))


# -- who owns an acquisition -------------------------------------------------------------------

_WAIT_FOR_CODE: Final = asyncio.wait_for.__code__


_HELPER_TASKS: Final = sys.version_info < (3, 12)  # wait_for runs a coroutine in a task
_RELEASE_WAITER: Final = getattr(asyncio.tasks, "_release_waiter", None)


def _wait_for_caller(task: asyncio.Task[Any]) -> asyncio.Task[Any] | None:
    """The task awaiting ``asyncio.wait_for`` on ``task`` (Python 3.10/3.11), found cheaply:
    ``wait_for`` puts a ``_release_waiter(waiter)`` callback on the task it awaits, and the
    caller awaits ``waiter``. ``None`` when ``task`` is no such helper (or asyncio's inner
    workings differ)."""
    helper = False
    for entry in getattr(task, "_callbacks", None) or ():
        callback = entry[0] if isinstance(entry, tuple) else entry
        if getattr(callback, "func", None) is not _RELEASE_WAITER or _RELEASE_WAITER is None:
            continue
        helper = True
        waiter = callback.args[0] if getattr(callback, "args", None) else None
        for inner in getattr(waiter, "_callbacks", None) or ():
            wakeup = inner[0] if isinstance(inner, tuple) else inner
            caller = getattr(wakeup, "__self__", None)
            # Duck-typed: asyncio's pure-Python Task is no subclass of the C one, and the
            # Task of backports.asyncio.runner (pytest-asyncio on 3.10) is not even a Future.
            if callable(getattr(caller, "get_coro", None)) and caller is not task:
                return cast("asyncio.Task[Any]", caller)
    # A helper whose waiter lists nobody: wait_for's deadline released the waiter in the very
    # step the helper got the lock, and the caller's wake-up is scheduled already — it is
    # found suspended in wait_for (helper-53: a Lease handed back released, ~3 in 80).
    return _awaiting_wait_for(task) if helper else None


def _awaiting_wait_for(helper: asyncio.Task[Any]) -> asyncio.Task[Any] | None:
    """The task suspended in ``asyncio.wait_for`` on ``helper``, if any."""
    for task in asyncio.all_tasks():
        if task is helper:
            continue
        coro: Any = task.get_coro()
        for _ in range(64):
            if coro is None:
                break
            frame = getattr(coro, "cr_frame", None)
            if (
                getattr(coro, "cr_code", None) is _WAIT_FOR_CODE
                and frame is not None
                and frame.f_locals.get("fut") is helper
            ):
                return task
            coro = getattr(coro, "cr_await", None)
    return None


def asyncio_task(action: str, name: str) -> asyncio.Task[Any] | None:
    """The calling asyncio task (``None`` outside one); a clear error when no asyncio loop
    runs at all (trio, anyio's trio backend, another event loop, a plain thread)."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running asyncio loop in this thread
        raise RuntimeError(
            f"cannot {action} {name!r}: no asyncio event loop is running. redis-locks-async "
            "runs on asyncio only, because redis.asyncio does: run it with asyncio.run(), or "
            "under anyio with the asyncio backend (anyio.run(..., backend='asyncio')); the trio "
            "backend and other event loops are not supported"
        ) from None


def _running_task(action: str, name: str) -> asyncio.Task[Any]:
    """The calling asyncio task; a clear error when there is none, or no asyncio loop at all
    (trio, anyio's trio backend, another event loop, a plain thread)."""
    task = asyncio_task(action, name)
    if task is None:
        raise RuntimeError(f"cannot {action} {name!r} outside an asyncio task")
    return task


def _pass_through_codes() -> frozenset[object]:
    """The code of the coroutines that only await the one they were given and return its
    result, so that a task whose body one of them is ends with that coroutine as surely as if
    it were its own body: anyio's task wrapper (``TaskHandle._run_coro``, anyio ≥ 4.11), the
    one ``anyio.from_thread.run()`` runs a function's coroutine in, and — on Python 3.12+,
    where it runs the coroutine in the caller's task — ``asyncio.wait_for``. anyio's are looked
    for only once its asyncio backend is in use (imported: no task of anyio's can run before);
    importing it here cost the first ``acquire()`` 20 to 30 ms inside the event loop
    (helper-65)."""
    global _PASS_THROUGH
    if _PASS_THROUGH is not None:
        return _PASS_THROUGH
    backend = sys.modules.get("anyio._backends._asyncio")
    if backend is None:
        return _BASE_PASS_THROUGH
    codes = set(_BASE_PASS_THROUGH)
    with contextlib.suppress(AttributeError, KeyError):  # (anyio < 4.11: no TaskHandle)
        codes.add(sys.modules["anyio._core._tasks"].TaskHandle._run_coro.__code__)
    with contextlib.suppress(AttributeError):
        codes.update(
            const
            for const in backend.AsyncIOBackend.run_async_from_thread.__code__.co_consts
            if isinstance(const, CodeType) and const.co_name == "task_wrapper"
        )
    _PASS_THROUGH = frozenset(codes)
    return _PASS_THROUGH


_BASE_PASS_THROUGH: Final[frozenset[object]] = frozenset(
    () if _HELPER_TASKS else (_WAIT_FOR_CODE,)
)
_PASS_THROUGH: frozenset[object] | None = None


def _whole_body(task: asyncio.Task[Any], frame: FrameType | None) -> bool:
    """Whether the coroutine running in ``frame`` is all that ``task`` runs: the task's own
    coroutine, or the one a pass-through wrapper awaits (:func:`_pass_through_codes`)."""
    body: FrameType | None = getattr(task.get_coro(), "cr_frame", None)
    if body is frame:
        return True
    if frame is None or body is None:
        return False
    codes = _pass_through_codes()
    above = frame.f_back  # (wrappers nest: wait_for(wait_for(lock.acquire(), t), u))
    while above is not None and above.f_code in codes:
        if above is body:
            return True
        above = above.f_back
    return False


def _owner_task(name: str, frame: FrameType | None) -> asyncio.Task[Any]:
    """The task that owns what the running ``acquire`` (whose frame is ``frame``) takes."""
    task = _running_task("acquire", name)
    if not _whole_body(task, frame):
        return task
    waiting = _awaiting_wait_for(task)
    while waiting is not None:
        if getattr(waiting.get_coro(), "cr_code", None) is not _WAIT_FOR_CODE:
            return waiting
        # A task whose whole body is a wait_for (a helper of an outer wait_for, nested:
        # wait_for(wait_for(lock.acquire(), t), u)): the task awaiting it, if any — else it
        # ends with acquire() too (create_task(wait_for(lock.acquire(), t))).
        task = waiting
        waiting = _awaiting_wait_for(task)
    raise LockError(
        f"cannot acquire {name!r}: acquire() is the whole body of task {task.get_name()!r}, "
        "which ends as soon as acquire() returns, so nothing could hold the lock (the lock is "
        "owned by the task that acquires it; asyncio.shield(), gather(), create_task() and "
        "anyio.from_thread.run() run a coroutine in a task of its own). Await lock.acquire() "
        "— or use `async with "
        "lock:` — in the task that works under the lock and releases it; for a time limit use "
        "lock.acquire(timeout=...) or asyncio.timeout(); to let another task finish the work, "
        "acquire here and call lock.transfer(task)",
        name=name,
    )


def _current(action: str, name: str, frame: FrameType | None = None) -> asyncio.Task[Any]:
    """The calling task — or, when the running method (whose frame is ``frame``) is the whole
    body of a helper task of ``asyncio.wait_for`` (Python 3.10/3.11), the task awaiting it."""
    task = _running_task(action, name)
    if frame is not None and getattr(task.get_coro(), "cr_frame", None) is frame:
        return _awaiting_wait_for(task) or task
    return task


# -- jobs: a command the caller awaits without being able to interrupt it --------------------


async def _job(coro: Awaitable[_T], reply: asyncio.Future[_T]) -> None:
    try:
        result = await coro
    except asyncio.CancelledError:
        # The job itself was cancelled (the runtime is closing): the caller was not.
        if not reply.done():
            reply.set_exception(_JobCancelled())
        raise
    except BaseException as exc:
        if not reply.done():
            reply.set_exception(exc)
        return
    if not reply.done():
        reply.set_result(result)


@final
class _Deadline:
    """Fails a command's reply future with :class:`_Expired` at a deadline: a loop time, or a
    function of now re-read when it comes — a bound that moved later meanwhile (a lease the
    keeper renewed) re-arms the timer instead."""

    __slots__ = ("_handle", "_loop", "_reply", "_until")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        reply: asyncio.Future[Any],
        until: float | Callable[[], float],
    ) -> None:
        self._loop, self._reply, self._until = loop, reply, until
        self._handle = loop.call_at(self._at(), self._fire)

    def _at(self) -> float:
        return self._until() if callable(self._until) else self._until

    def _fire(self) -> None:
        if self._reply.done():
            return
        at = self._at()
        if self._loop.time() < at - _TIMER_SLACK:
            self._handle = self._loop.call_at(at, self._fire)
            return
        self._reply.set_exception(_Expired())

    def cancel(self) -> None:
        self._handle.cancel()


def _cancelling(task: asyncio.Task[Any] | None) -> int:
    """Pending cancellation requests of ``task`` (always 0 before Python 3.11)."""
    return task.cancelling() if _DIRECT and task is not None else 0  # type: ignore[attr-defined]


async def _bounded(command: Awaitable[_T], deadline: float) -> _T:
    """``command``, abandoned with ``TimeoutError`` at loop time ``deadline``."""
    if _DIRECT:
        async with asyncio.timeout_at(deadline):  # type: ignore[attr-defined]
            return await command
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(command, max(0.0, deadline - loop.time()))
    except asyncio.TimeoutError:
        raise TimeoutError from None


def _maybe_shortened(runtime: Runtime, hold: Hold, sent_at: float, length: float) -> None:
    """A command sent at ``sent_at`` that sets ``hold``'s server lease to ``length`` may run
    (it is in flight) or may have run (it failed, or was given up): if that lease could end
    sooner than the hold's, count on the sooner end (and have the keeper renew at once; see
    :meth:`Hold.may_have_set`)."""
    if hold.live and hold.may_have_set(sent_at, length):
        runtime.keeper.reschedule(hold)


def _given_up(runtime: Runtime, hold: Hold, sent_at: float, length: float) -> None:
    """A command sent at ``sent_at`` setting ``hold``'s lease to ``length`` was given up on (no
    answer in time, an error after which it may have run, a cancellation): it may have run, and
    may still land (see :meth:`Hold.gave_up_on`)."""
    hold.gave_up_on(length)
    _maybe_shortened(runtime, hold, sent_at, length)


def _renewed_by(
    runtime: Runtime, hold: Hold, sent_at: float, length: float, judged: object
) -> None:
    """A command sent at ``sent_at`` set ``hold``'s server lease to ``length`` (an extend, a
    re-entry). ``judged``: the keeper's last renewal that may have run, as it was when the
    command was sent. A renewal the keeper judged since, with another length, was in flight
    with the command: the server ran the two in an unknown order — it may have run the
    renewal last, and kept its length — and the keeper, judging it before this command's
    answer, took it for an ordinary renewal. Count on the earlier of the two ends, and have
    the keeper renew with the new length at once."""
    hold.renewed(sent_at, length)
    if hold.shortened == sent_at:
        hold.shortened = 0.0  # the command announced it
    if hold.judged is not judged and hold.judged is not None and hold.judged[1] != length:
        hold.crossed(*hold.judged)
    runtime.keeper.reschedule(hold)


def _release_deadline(hold: Hold) -> float:
    """How long a release may wait for its answer: until the lease would end (then there is
    nothing left to release), and at least a moment."""
    return max(hold.expires_at, hold.loop.time() + RELEASE_PATIENCE)


def _left(deadline: float | None, loop: asyncio.AbstractEventLoop) -> float | None:
    return None if deadline is None else max(0.0, deadline - loop.time())


def _claim_end(grant: Granted, since: tuple[float, int] | None) -> float | None:
    """The loop time by which the claim window of ``grant`` has surely ended on the server, or
    ``None`` when the grant cannot be vouched for.

    The window runs from the grant (server time), not from when the announcement was read:
    read late (a loaded machine, a paused process), the server may already have moved the
    lock on. ``since`` — the last attempt that found this owner waiting, as (loop time sent,
    server time µs) — dates the grant on the loop's clock from below. A grant older than that
    attempt is stale (the attempt would have found the lock this owner's); without ``since``
    nothing dates it. Either way the caller asks the server instead.
    """
    if since is None:
        return None
    sent_at, at_us = since
    if grant.at_us < at_us:
        return None
    return min(grant.received_at, sent_at + (grant.at_us - at_us) / 1e6) + grant.ttl


def _earlier(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


class LockBase:
    """The public surface every lock primitive shares (see the module docstring).

    A subclass only says which :class:`Policy` it uses (``_policy_class``).
    """

    _policy_class: ClassVar[type[Policy]]

    __slots__ = (
        "_auto_renew",
        "_cached",
        "_claim",
        "_claim_ms",
        "_counters",
        "_entered",
        "_grace_ms",
        "_lease",
        "_lease_ms",
        "_max_hold",
        "_name",
        "_on_lost",
        "_policy",
        "_redis",
        "_replica_fsync",
        "_replica_timeout",
        "_replicas",
        "_timeout",
        "_topology",
    )

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
        replicas: int = 0,
        replica_timeout: float = 1.0,
        replica_fsync: bool = False,
        max_hold: float | None = None,
    ) -> None:
        self._name = check_name(name)
        self._max_hold = None if max_hold is None else check_lease(max_hold, "max_hold")
        self._replicas = check_replicas(replicas)
        self._replica_timeout = check_lease(replica_timeout, "replica_timeout")
        if not isinstance(replica_fsync, bool):
            raise TypeError(f"replica_fsync must be a bool, not {type(replica_fsync).__name__}")
        self._replica_fsync = replica_fsync
        self._lease = check_lease(lease)
        if self._max_hold is not None and self._max_hold < self._lease:
            raise ValueError(
                f"max_hold must be at least the lease ({self._lease:g} s), got {max_hold!r}: "
                "an acquisition holds the lock for a whole lease"
            )
        self._timeout = check_timeout(timeout)
        self._claim = check_lease(claim_timeout, "claim_timeout")
        self._lease_ms = to_ms(self._lease)
        self._claim_ms = to_ms(self._claim)
        self._grace_ms = to_ms(REGISTRATION_GRACE + self._claim)
        if not isinstance(auto_renew, bool):
            raise TypeError(f"auto_renew must be a bool, not {type(auto_renew).__name__}")
        if on_lost is not None and not callable(on_lost):
            raise TypeError("on_lost must be callable (a function or an async function)")
        if not _is_async_client(redis):
            raise TypeError(
                f"redis must be a redis.asyncio client (redis.asyncio.Redis, RedisCluster or a "
                f"Sentinel master), not {type(redis).__module__}.{type(redis).__name__}"
            )
        self._redis = redis
        self._topology: Callable[[Any], Topology] | None = None
        self._cached: Runtime | None = None
        self._auto_renew = auto_renew
        self._on_lost = on_lost
        self._policy = self._make_policy()
        # Per task, its open ``async with`` blocks: (hold, level entered, the statement's frame).
        self._entered: dict[asyncio.Task[Any], list[tuple[Hold, str | None, FrameType | None]]] = {}
        self._counters = _Counters()

    def _make_policy(self) -> Policy:
        """The policy of this lock object (a primitive with options of its own overrides it)."""
        return self._policy_class(self._name)

    # -- properties ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The lock's name (also its main Redis key)."""
        return self._name

    @property
    def lease(self) -> float:
        """Lease length in seconds for each acquisition."""
        return self._lease

    @property
    def timeout(self) -> float | None:
        """Default wait for ``async with`` and :meth:`acquire` (``None``: wait forever)."""
        return self._timeout

    @property
    def claim_timeout(self) -> float:
        """Seconds a waiter that was handed the lock has to confirm it (dead-waiter bound)."""
        return self._claim

    @property
    def state(self) -> LockState:
        """This lock's state for the calling task (a local view; no I/O)."""
        hold = self._local_hold()
        if hold is None:
            return LockState.IDLE
        return {
            HoldState.HELD: LockState.HELD,
            HoldState.RELEASING: LockState.RELEASING,
            HoldState.LOST: LockState.LOST,
            HoldState.RELEASED: LockState.IDLE,
        }[hold.state]

    def statistics(self) -> LockStatistics:
        """A snapshot of what this lock object saw in this process (no I/O)."""
        counters = self._counters
        runtime = observed_runtime(self._redis)
        held = 0
        if runtime is not None:
            key = self._policy.hold_key
            # (list(): one step under the GIL, also when called from another thread)
            holds = list(runtime.holds.items())
            # (HELD only: a hold whose last release is on its way is no longer the task's —
            # counted, a semaphore's statistics showed more holders than permits; helper-76)
            held = sum(1 for (k, _), hold in holds if k == key and hold.state is HoldState.HELD)
        return LockStatistics(
            name=self._name,
            acquisitions=counters.acquisitions,
            handovers=counters.handovers,
            reentries=counters.reentries,
            releases=counters.releases,
            timeouts=counters.timeouts,
            lost=counters.lost,
            wait_time=counters.waited,
            waiting=self._local_waiters(runtime),
            held=held,
        )

    def owned(self) -> bool:
        """Whether the calling task holds this lock (a local view; no I/O). False once the
        task has given its hold up — also while that release is still being confirmed in the
        background (a cancelled ``release()``, a cancel scope that ended an ``async with``)."""
        hold = self._local_hold()
        return hold is not None and hold.state is HoldState.HELD

    @property
    def current_lease(self) -> Lease | None:
        """The calling task's :class:`Lease` on this lock, if it holds it (or lost it)."""
        hold = self._local_hold()
        return hold.view if hold is not None else None

    def _runtime(self) -> Runtime:
        """The runtime of this lock's client on the running loop (created on first use)."""
        runtime = self._cached
        if runtime is None or runtime.closed or runtime.loop is not asyncio.get_running_loop():
            if self._topology is None:
                runtime = runtime_for(self._redis)
            else:
                runtime = runtime_for(self._redis, self._topology)
            self._cached = runtime
        return runtime

    def _existing(self) -> Runtime | None:
        """The runtime of this lock's client on the running loop, if there is one."""
        runtime = self._cached
        if runtime is not None and runtime.loop is asyncio.get_running_loop():
            return runtime
        runtime = existing_runtime(self._redis)
        if runtime is not None:
            self._cached = runtime
        return runtime

    def _local_hold(self) -> Hold | None:
        task = asyncio_task("inspect", self._name)
        runtime = self._existing() if task is not None else None
        if task is None or runtime is None:
            return None
        if runtime.heirs:
            _inherit(runtime, task)
        return unclaimed(runtime.holds.get((self._policy.hold_key, task)))

    def _local_waiters(self, runtime: Runtime | None) -> int:
        if runtime is None:
            return 0
        channel = self._policy.keys.channel
        return sum(hub.waiters(channel) for hub in runtime.hubs())

    # -- public operations ------------------------------------------------------------------

    async def locked(self) -> bool:
        """Whether anyone holds the lock, as the server sees it now. Bounded like a single
        attempt: no answer within a second (a paused server, a partition) is a
        :class:`LockError`. On a client closed on this loop, :class:`LockError` too (it would
        open a connection the closed client no longer tracks; helper-65)."""
        return await self._ask(self._policy.locked(self._redis), "inspect")

    async def _ask(self, call: Coroutine[Any, Any, _T], action: str, unsure: str = "") -> _T:
        """Await ``call``, one exchange with the server on behalf of the calling task
        (``locked()``, a semaphore's ``free_permits()``/``set_permits()``), bounded like a
        single attempt: no answer within TRY_BOUND is a :class:`LockError` (``unsure`` says
        what may have happened all the same), a Redis error is translated; refused on a
        client closed on this loop (it would open a connection the closed client no longer
        tracks; helper-65)."""
        try:
            asyncio_task(action, self._name)
            runtime = self._existing()
            if runtime is not None:
                self._check_open(runtime, action)
        except BaseException:
            call.close()
            raise
        try:
            return await asyncio.wait_for(call, TRY_BOUND)
        except asyncio.TimeoutError as exc:
            raise LockError(
                f"cannot {action} {self._name!r}: no reply from the server within "
                f"{TRY_BOUND:g} s{_NO_REPLY}{recent_failure(self._redis, TRY_BOUND)}{unsure}",
                name=self._name,
            ) from exc
        except (RedisError, OSError, RedisClusterException) as exc:
            # (RedisClusterException: no node of a cluster answers — helper-83: it reached
            # the caller of locked() raw)
            raise await self._explain(exc, action) from exc

    async def acquire(
        self, timeout: float | _Unset | None = UNSET, *, blocking: bool = True
    ) -> bool:
        """Acquire the lock for the calling task; ``True`` once held, ``False`` on timeout.

        ``timeout`` is in seconds; ``None`` waits forever; left out, the lock's own ``timeout``
        applies. ``blocking=False`` makes a single attempt (waiting at most about a second
        for the server's answer). A task that already holds the lock re-enters it (the hold
        count goes up; release once per acquire).

        The calling task owns the lock — also under ``asyncio.wait_for(lock.acquire(), t)``
        (the task awaiting ``wait_for``). Running ``acquire()`` as the whole body of a task
        (``asyncio.create_task(lock.acquire())``) raises :class:`LockError`: that task ends at
        once, so nothing could hold the lock.
        """
        wait = self._timeout if timeout is UNSET else check_timeout(timeout)
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be a bool, not {type(blocking).__name__}")
        task = _owner_task(self._name, sys._getframe(0))
        sink = telemetry.SINK
        if sink is not None:
            return await sink.acquire(self, self._acquire_for(task, wait, blocking))
        return await self._acquire_for(task, wait, blocking)

    async def _acquire_for(
        self, task: asyncio.Task[Any], wait: float | None, blocking: bool
    ) -> bool:
        """:meth:`acquire` for ``task``, its arguments checked."""
        runtime = self._runtime()
        policy = self._policy
        if runtime.heirs:
            _inherit(runtime, task)
        hold = unclaimed(runtime.holds.get((policy.hold_key, task)))
        limit = wait if blocking else 0.0
        # The replica sync (and a re-entry) ends with the caller's deadline (a try's: TRY_BOUND).
        deadline = None if limit is None else runtime.loop.time() + (limit or TRY_BOUND)
        if hold is not None and policy.reentrant and hold.state is not HoldState.LOST:
            # (A hold whose loss was signalled is not re-entered: this is a fresh acquisition,
            # and the lost hold waits underneath it for its own release.)
            held = await self._reenter(runtime, hold, deadline)
            if held is False:
                self._counters.timeouts += 1
            if held is not None:
                return held
        refused = policy.conflict(runtime.holds, task)
        if refused is not None:
            raise LockError(f"cannot acquire {self._name!r}: {refused}", name=self._name)
        key = (policy.hold_key, task)
        acquiring = runtime.acquiring
        acquiring[key] = acquiring.get(key, 0) + 1
        try:
            got = await self._acquire(runtime, task, limit)
        except LockError:
            if runtime.closed:
                # The client was closed under the acquisition: what it reached (a command
                # that completed during the close, or was re-sent after it by a retrying
                # client) is being undone — let the caller see the error once it is.
                await runtime.cleanups_settled(RELEASE_PATIENCE)
            raise
        finally:
            if acquiring[key] == 1:
                del acquiring[key]
            else:
                acquiring[key] -= 1
        if got:
            if self._replicas:
                await self._sync_replicas(runtime, task, deadline)
            return True
        self._counters.timeouts += 1
        return False

    async def _sync_replicas(
        self, runtime: Runtime, task: asyncio.Task[Any], deadline: float | None
    ) -> None:
        """Replica sync (``replicas=``): renew the fresh hold and ``WAIT`` (``WAITAOF``) for the
        replicas in one pipeline on one connection — the renewal follows the acquisition in the
        replication stream, so its acknowledgement covers the lock. Too few acknowledgements,
        an error or a cancellation give the lock up (fenced, in the background) and fail. The
        wait ends at the caller's ``deadline`` too, but is given at least REPLICA_WAIT_FLOOR
        (a healthy replica acknowledges within a round trip)."""
        hold = runtime.holds[(self._policy.hold_key, task)]
        wanted, timeout = self._replicas, self._replica_timeout
        loop = runtime.loop
        if deadline is not None:
            timeout = min(timeout, max(REPLICA_WAIT_FLOOR, deadline - loop.time()))
        ends = loop.time() + timeout
        # Under a caller's deadline the reply is awaited only REPLICA_REPLY_SLACK past the
        # WAIT's end, and a give-up after it at most CLEANUP_GRACE more (a server that goes
        # silent during the WAIT, a partition: the caller's bound holds; helper-59). Without
        # one, each RELEASE_PATIENCE.
        slack = RELEASE_PATIENCE if deadline is None else REPLICA_REPLY_SLACK

        def settle_patience() -> float | None:
            if deadline is None:
                return None
            return max(CLEANUP_GRACE, ends + slack - loop.time())

        call = self._policy.renew(hold.owner, hold.lease, runtime.topology.sharded)
        waits = ("WAITAOF", 0, wanted) if self._replica_fsync else ("WAIT", wanted)
        problem = ""
        current = asyncio.current_task()
        before = _cancelling(current)
        try:
            for _ in range(2):  # a second time if the server did not know the renewal script
                # The second time waits only what is left: the first WAIT ran all the same.
                left = max(0.001, ends - loop.time())
                pipe = runtime.topology.pipeline_for(call.keys[0])
                pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
                pipe.execute_command(*waits, to_ms(left))
                renewed, acked = await asyncio.wait_for(
                    pipe.execute(raise_on_error=False), left + slack
                )
                if not isinstance(renewed, NoScriptError):
                    break
                await asyncio.wait_for(
                    runtime.topology.client.script_load(call.script.code),
                    max(0.001, ends - loop.time()) + slack,
                )
            if _cancelling(current) > before:
                raise asyncio.CancelledError()  # swallowed by redis-py on its way out
            if isinstance(renewed, BaseException) or isinstance(acked, BaseException):
                error = renewed if isinstance(renewed, BaseException) else acked
                problem = f"the replica sync failed: {error}"
            elif int(renewed) != 1:
                problem = "the lock expired before its replicas could be asked"
            elif hold.state is not HoldState.HELD or hold.expires_at <= loop.time():
                # (The WAIT outlasted the lease: a rival may hold the lock already — the
                # acknowledgement vouches for nothing; helper-59.)
                problem = "its lease ended while the replicas were awaited"
            else:
                hold.replicas = int(acked[1] if isinstance(acked, list) else acked)
                if hold.replicas < wanted:
                    problem = (
                        f"only {hold.replicas} of {wanted} replicas acknowledged it within "
                        f"{timeout:.3g} s"
                    )
        except BaseException as exc:
            undo = self._give_up(runtime, hold)
            if isinstance(exc, (RedisError, OSError, asyncio.TimeoutError)):
                await _settle_undo(undo, settle_patience())
                cause = (
                    f"no reply within {timeout + slack:.3g} s{_NO_REPLY}"
                    if isinstance(exc, asyncio.TimeoutError)
                    else describe(exc)
                )
                raise LockError(
                    f"cannot acquire {self._name!r}: the replica sync failed ({cause}); "
                    "the lock was given up",
                    name=self._name,
                ) from exc
            raise
        if problem:
            undo = self._give_up(runtime, hold)
            await _settle_undo(undo, settle_patience())
            raise LockError(
                f"cannot acquire {self._name!r}: {problem}; the lock was given up",
                name=self._name,
            )

    def _give_up(self, runtime: Runtime, hold: Hold) -> asyncio.Task[None] | None:
        """Drop a hold the caller will not get, and abandon it on the server (fenced): the
        abandon's background task, if one was started. A hold lost meanwhile is forgotten too
        (its lease stays marked lost): the caller, who was not given it, will not release it."""
        if hold.state is HoldState.LOST:
            self._forget(runtime, hold)
            if runtime.closed:
                return None
            return self._undo(runtime, self._abandon(hold.owner), self._kept_until(runtime, hold))
        if hold.state is not HoldState.HELD:
            return None
        return self._drop(runtime, hold, counted=False)

    def _drop(
        self, runtime: Runtime, hold: Hold, *, counted: bool = True, eager: bool = False
    ) -> asyncio.Task[None]:
        """End ``hold`` here (released, forgotten) and abandon it on the server in the
        background (fenced): the abandon's task. ``counted``: a release (a task that ended
        holding it, a release that failed), not an acquisition given up. ``eager``: see
        :meth:`_undo`."""
        self._forget(runtime, hold)
        hold.state = HoldState.RELEASED
        if counted:
            self._released(runtime, hold)
        until = self._kept_until(runtime, hold)
        return self._undo(runtime, self._abandon(hold.owner), until, eager=eager)

    def _kept_until(self, runtime: Runtime, hold: Hold) -> float:
        """Until when (loop time) the server may keep ``hold`` — its clean-up is retried that
        long: the end of its lease there (its local end and the margin kept short of it), or
        the lock's lease from now if that is later (a renewal in flight may still land).
        (helper-79: an extended hold's clean-up gave up at the lock's shorter lease.)"""
        end = hold.expires_at + self._policy.margin(hold.lease)
        return max(end, runtime.loop.time() + self._lease)

    def _released(self, runtime: Runtime, hold: Hold) -> None:
        """Count the end of ``hold`` by a release (statistics, telemetry)."""
        self._counters.releases += 1
        sink = telemetry.SINK
        if sink is not None and hold.kind:
            sink.hold_ended(hold.kind, runtime.loop.time() - hold.acquired_at, lost=False)

    async def release(self) -> None:
        """Release one hold of the calling task (the last one frees or hands over the lock).

        Raises :class:`LockNotOwnedError` if the task does not hold the lock and
        :class:`LockLostError` if its lease ended meanwhile. Cancelling the caller does not
        stop the release. The level released is chosen at the call: the innermost one whose
        release is not already on its way (a cancelled release going on in the background).
        """
        task = _current("release", self._name, frame := sys._getframe(0))
        runtime, hold = self._held_by(task, "release", frame)
        await self._release(runtime, hold, _innermost_unclaimed(hold))

    async def extend(self, lease: float | None = None) -> None:
        """Renew the calling task's lease now, to ``lease`` seconds (default: the lock's).

        The new length is kept by later renewals (a shorter lease is renewed sooner; it counts
        from the moment the extend is sent). The answer is awaited until the lease it sets would
        end: without one, :class:`LockError` if the lease goes on (renewed meanwhile), else
        :class:`LockLostError`.
        """
        length = self._lease if lease is None else check_lease(lease)
        task = _current("extend", self._name, frame := sys._getframe(0))
        runtime, hold = self._held_by(task, "extend", frame)
        # (Releases of the hold in flight are of inner levels — a hold whose last release is
        # on its way is not the task's any more: independent of the lease, not waited for.)
        self._check_live(runtime, hold, "extend")
        loop = runtime.loop
        sent_at = loop.time()
        judged = hold.judged
        if hold.renew_until is not None and sent_at + length > hold.renew_until:
            raise LockError(
                f"cannot extend {self._name!r} by {length} s: it would be held past its "
                f"max_hold (which ends in {max(0.0, hold.renew_until - sent_at):.3g} s)",
                name=self._name,
            )
        before = hold.snapshot()
        bound = self._setting(runtime, hold, sent_at, length)
        try:
            renewed = await self._call(
                runtime,
                self._policy.renew(hold.owner, length, runtime.topology.sharded).run(self._redis),
                None,
                lambda: min(bound, hold.expires_at),
            )
        except _Expired:
            self._not_set_in_time(runtime, hold, sent_at, length, "extend")
        except BaseException as exc:
            # The renewal may have run all the same (its reply late or lost, the caller
            # cancelled): the server's lease may now be the shorter one.
            await self._setting_failed(runtime, hold, sent_at, length, exc, "extend", before)
            raise
        if int(renewed) != 1:  # type: ignore[call-overload]
            self._lose(runtime, hold, "extend found the lock expired or held by another owner")
            raise LockLostError(
                f"cannot extend {self._name!r}: the lease was lost ({hold.lost_reason})",
                name=self._name,
            )
        self._check_in_time(runtime, hold, sent_at, length, "extend")
        if not hold.live:
            # Signalled lost while the extend was in flight (its lease ended first): the
            # extend does not bring it back; the release gives up what it set on the server.
            raise LockLostError(
                f"cannot extend {self._name!r}: the lease was lost ({hold.lost_reason})",
                name=self._name,
            )
        _renewed_by(runtime, hold, sent_at, length, judged)

    def transfer(self, task: asyncio.Task[Any]) -> Lease:
        """Hand the calling task's hold to ``task`` (no I/O): ``task`` must release it.

        Use it to let a background task finish work under the lock::

            await lock.acquire()
            worker = asyncio.create_task(finish(lock))   # finish() calls lock.release()
            lock.transfer(worker)

        Leaving an ``async with lock:`` block whose hold was transferred releases nothing.
        A task that is itself waiting in ``acquire()`` for this lock (for either side of a
        read/write lock) cannot be handed it (:class:`LockError`: it would wait for its own
        hold).
        """
        if not callable(getattr(task, "get_coro", None)):
            # (duck-typed: a task of another asyncio-compatible Task class, such as the one the
            # backports.asyncio.runner used by pytest-asyncio on Python 3.10 runs a test in)
            raise TypeError(
                f"transfer() needs the asyncio.Task to hand {self._name!r} to, "
                f"not {type(task).__name__}"
            )
        current = _current("transfer", self._name)
        runtime, hold = self._held_by(current, "transfer")
        if task is current:
            return hold.view
        if task.done():
            raise LockError(
                f"cannot transfer {self._name!r}: the target task has already ended",
                name=self._name,
            )
        target_loop = getattr(task, "get_loop", None)
        if target_loop is not None and target_loop() is not runtime.loop:
            # (Its end would be seen on the other loop's thread, and its release() would not
            # find the hold: locks of a client are used on the loop it serves; helper-63.)
            raise LockError(
                f"cannot transfer {self._name!r}: the target task runs on another event loop; "
                "hand the hold to a task of this loop (asyncio.create_task), or let that loop "
                "acquire the lock through a client of its own",
                name=self._name,
            )
        theirs = unclaimed(runtime.holds.get((hold.key, task)))
        if self._policy.reentrant and theirs is not None and theirs.state is not HoldState.LOST:
            raise LockError(
                f"cannot transfer {self._name!r}: the target task already holds it",
                name=self._name,
            )
        split = self._policy.transfer_conflict(runtime.holds, current)
        if split is not None:
            raise LockError(f"cannot transfer {self._name!r}: {split}", name=self._name)
        if any((key, task) in runtime.acquiring for key in self._policy.hold_keys):
            # (Also for the other side of a read/write lock: holding the read side while it
            # waits for the write side, the task would wait for its own read hold; handed the
            # write side while it waits for the read side, its wait never turns into a
            # downgrade — either way it waits for ever. And for a semaphore's permit: a task
            # waiting for a permit of a semaphore whose last permit it was handed waits for
            # itself.)
            raise LockError(
                f"cannot transfer {self._name!r}: the target task is waiting in acquire() for "
                "it and would go on waiting for the hold it was handed; let its acquire() end "
                "first",
                name=self._name,
            )
        self._move(runtime, hold, current, task)
        return hold.view

    def guarded(self) -> _Guarded:
        """``async with lock.guarded() as lease:`` — the block is cancelled if the lease is lost.

        The cancellation surfaces as :class:`LockLostError` out of the block, so work stops
        when the lock is gone instead of running on unprotected. Nested guarded blocks all
        stay guarded.
        """
        return _Guarded(self)

    async def __aenter__(self) -> Lease:
        return await self._enter(sys._getframe(1))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exit(sys._getframe(1), exc)

    async def _enter(self, frame: FrameType | None) -> Lease:
        """``async with``'s entry, made by the statement running in ``frame``."""
        if not await self.acquire():
            raise LockTimeout(
                f"timed out after {self._timeout} s waiting for {self._name!r}", name=self._name
            )
        task = _current("enter", self._name)
        runtime = self._runtime()
        hold = runtime.holds[(self._policy.hold_key, task)]
        level = hold.entries[-1] if hold.entries else None
        self._entered.setdefault(task, []).append((hold, level, frame))
        hold.blocks.append(level)
        return hold.view

    def _enter_elsewhere(
        self, frame: FrameType | None
    ) -> tuple[asyncio.Task[Any], tuple[Hold, str | None, FrameType | None]] | None:
        """The task whose open ``async with`` block the statement running in ``frame`` entered,
        and that entry, removed from its stack (the innermost such entry)."""
        if frame is None:
            return None
        for task, stack in list(self._entered.items()):
            for index in range(len(stack) - 1, -1, -1):
                if stack[index][2] is frame:
                    found = stack.pop(index)
                    if not stack:
                        del self._entered[task]
                    return task, found
        return None

    async def _exit(self, frame: FrameType | None, exc: BaseException | None) -> None:
        """``async with``'s exit, made by the statement running in ``frame``."""
        task = _current("exit", self._name)
        runtime = self._existing()
        if runtime is not None and runtime.heirs:
            _inherit(runtime, task)  # (the stack of enters comes with the hold)
        stack = self._entered.get(task)
        found = None
        if stack and stack[-1][2] is frame:
            found = task, stack.pop()
            if not stack:
                del self._entered[task]
        else:
            # The block was entered by the same statement (frame) — in this task, or in another
            # one: an async generator's block, entered while the task iterating it ran it, ends
            # in the task that closes the generator (asyncio's finalizer, or whoever calls
            # aclose()). The level it entered is released all the same, on behalf of its task.
            found = self._enter_elsewhere(frame)
            if found is None and stack:
                # Entered and exited from different frames in this task (AsyncExitStack):
                # the task's innermost block is the one that ends.
                found = task, stack.pop()
                if not stack:
                    del self._entered[task]
            if found is None and _HELPER_TASKS:
                # Python 3.10/3.11: ``wait_for(stack.aclose(), t)`` runs the exit in a helper
                # task; the block is the innermost of the task awaiting wait_for.
                waiting = _awaiting_wait_for(task)
                theirs = None if waiting is None else self._entered.get(waiting)
                if waiting is not None and theirs:
                    found = waiting, theirs.pop()
                    if not theirs:
                        del self._entered[waiting]
        if found is None:
            raise LockError(f"exit of {self._name!r} without a matching enter", name=self._name)
        entered_by, (hold, entry, _) = found
        elsewhere, task = entered_by is not task, entered_by
        # The hold's innermost open block ends in its own task (the usual case) — through
        # whichever lock object.
        in_order = not elsewhere and bool(hold.blocks) and hold.blocks[-1] == entry
        if entry in hold.blocks:
            del hold.blocks[len(hold.blocks) - 1 - hold.blocks[::-1].index(entry)]
        if hold.task is not task:
            return  # transferred to another task, which releases it
        if entry is not None and entry not in hold.entries:
            return  # this level was released explicitly inside the block
        if hold.claimed is not None and entry in hold.claimed:
            return  # its release, cancelled inside the block, goes on in the background
        runtime = self._existing()
        if (
            not in_order
            and entry is None
            and (hold.entries or hold.reentering)
            and hold.state is HoldState.HELD
            and runtime is not None
            and _in_stack(runtime, hold)
        ):
            # The block of the hold's own level ends before blocks and acquisitions of the
            # task entered since (an async generator's, closed out of order): the hold is
            # released once those levels are (see _settle_owed_base), not now from under them.
            hold.base_owed = True
            return
        try:
            if runtime is None or not _in_stack(runtime, hold):
                if hold.state is HoldState.LOST:
                    raise LockLostError(
                        f"lease on {self._name!r} was lost ({hold.lost_reason})",
                        name=self._name,
                    )
                return  # released explicitly inside the block
            # (Released from another task than the holder's: claimed at once, so the holder's
            # own calls meanwhile see it as they see a release in flight.)
            await self._release(runtime, hold, entry, owed=elsewhere)
        except LockError as error:
            if exc is None:
                raise
            logger.warning("leaving %r while %s: %s", self._name, type(exc).__name__, error)

    def __repr__(self) -> str:
        if not hasattr(self, "_counters"):  # a constructor that refused its arguments
            return f"<{type(self).__name__} (not constructed)>"
        try:
            state = self.state.value
        except RuntimeError:
            state = "?"
        return (
            f"<{type(self).__name__} {self._name!r} lease={self._lease}s state={state} "
            f"waiters={self._local_waiters(observed_runtime(self._redis))}>"
        )

    # -- commands ----------------------------------------------------------------------------

    async def _call(
        self,
        runtime: Runtime,
        command: Coroutine[Any, Any, _T],
        undo: Callable[[], Awaitable[object]] | None,
        deadline: float | Callable[[], float] | None,
        *,
        drained: bool = True,
        first: bool = True,
    ) -> _T:
        """Run ``command`` in a job task and return its reply (module docstring, point 3).

        If the caller is cancelled, ``deadline`` (loop time, or a function of it re-read when
        it comes: see :class:`_Deadline`) passes — :class:`_Expired` —, or the command fails in
        a way after which it may still have run, ``undo`` is sent in the background. Errors
        are redis-py's (the caller translates them). Without ``drained``, a close does not
        wait for the job (:meth:`Runtime.track`). Not ``first`` (a retry after an exhausted
        pool, :meth:`_pool_patient`): an earlier try may have been written, so a failure that
        says it sent nothing (:func:`never_sent`) is undone all the same.
        """
        loop = runtime.loop
        reply: asyncio.Future[_T] = loop.create_future()
        if _EAGER:
            job = asyncio.Task(_job(command, reply), loop=loop, eager_start=True)  # type: ignore[call-arg]
        else:
            job = loop.create_task(_job(command, reply))
        if not job.done():
            runtime.track(job, drained=drained)
        timer = None if deadline is None else _Deadline(loop, reply, deadline)
        try:
            return await reply
        except _JobCancelled:
            if undo is not None:
                self._undo(runtime, undo)
            raise LockError(
                f"cannot use {self._name!r}: the redis client was closed", name=self._name
            ) from None
        except BaseException as exc:
            if undo is not None and (
                isinstance(exc, (asyncio.CancelledError, _Expired))
                or (
                    runtime.topology.transient(exc)
                    and not isinstance(exc, MaxConnectionsError)
                    and not (first and never_sent(exc))  # (nothing was sent: no connection)
                )
            ):
                self._undo(runtime, undo)
            if isinstance(exc, (asyncio.CancelledError, _Expired)) and not job.done():
                job.cancel()  # the undo is fenced: whatever the command reaches is undone
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def _direct(
        self,
        runtime: Runtime,
        call: Call,
        undo: Callable[[], Awaitable[object]] | None,
        bound: float | None = None,
        patience: float | None = None,
    ) -> object:
        """Run ``call`` in the caller's task (the hot path: no job task) and return its raw
        reply; ``undo`` is sent in the background if the caller is cancelled, loop time
        ``bound`` passes first (:class:`_Expired`; the command is dropped with its
        connection), or the command fails in a way after which it may still have run. An
        undo is fenced on the server, so it is safe whenever it lands. An exhausted
        connection pool is waited out until loop time ``patience``.

        On Python 3.11, redis-py's use of ``asyncio.wait_for`` can swallow a cancellation that
        lands as the reply arrives; ``Task.cancelling()`` shows it, and it is raised here.
        """
        if not _DIRECT:
            tries = itertools.count()
            return await self._pool_patient(
                # (Not waited for by a close, as on 3.11+ the direct command is not: Runtime.track.)
                lambda: self._call(
                    runtime, call.run(self._redis), undo, bound, drained=False,
                    first=next(tries) == 0,
                ),
                patience,
            )
        task = asyncio.current_task()
        before = _cancelling(task)
        first = True
        try:
            try:
                reply = await self._sent(runtime, call, bound)
            except MaxConnectionsError:
                first = False
                reply = await self._pool_patient(lambda: self._sent(runtime, call, bound), patience)
        except (asyncio.CancelledError, _Expired):
            if undo is not None:
                self._undo(runtime, undo)
            raise
        except BaseException as exc:
            swallowed = _cancelling(task) > before
            if undo is not None and (
                swallowed
                or (
                    runtime.topology.transient(exc)
                    and not isinstance(exc, MaxConnectionsError)
                    # (nothing was sent: no connection could be had — unless an earlier try,
                    # cut short by an exhausted pool, may have been written; helper-78)
                    and not (first and never_sent(exc))
                )
            ):
                self._undo(runtime, undo)
            if swallowed:
                # The caller was cancelled and redis-py swallowed it (its wait_for around the
                # write, Python 3.11); the command then failed (its socket timeout, say): the
                # caller sees its cancellation, not the error that followed it.
                raise asyncio.CancelledError() from exc
            raise
        if _cancelling(task) > before:
            if undo is not None:
                self._undo(runtime, undo)
            raise asyncio.CancelledError()
        return reply

    async def _sent(self, runtime: Runtime, call: Call, bound: float | None) -> object:
        """``call``'s reply; :class:`_Expired` once loop time ``bound`` passes, or the client is
        closed (the close expires the scope: a client that retries would otherwise go on
        re-sending to a server that does not answer) (Python ≥ 3.11)."""
        if runtime.closed:
            raise _Expired()
        scope = asyncio.timeout_at(bound)  # type: ignore[attr-defined]
        in_flight = runtime.in_flight
        in_flight.add(scope)
        try:
            async with scope:
                return await call.run(self._redis)
        except TimeoutError:
            if scope.expired():
                raise _Expired() from None
            raise
        finally:
            in_flight.discard(scope)

    async def _explain(self, exc: BaseException, action: str) -> LockError:
        """``exc`` (from redis-py) as a :class:`LockError` that names the lock, and the key
        when one has the wrong type."""
        return await explain(self._redis, self._name, action, exc, self._policy.key_types)

    def _undo(
        self,
        runtime: Runtime,
        undo: Callable[[], Awaitable[object]],
        until: float | None = None,
        *,
        eager: bool = False,
    ) -> asyncio.Task[None]:
        """Send ``undo`` in the background (:meth:`_retrying`): its task.

        ``eager`` (the release of a task that ended holding): on Python 3.12+ the task starts
        at once, so the command is written before the loop goes on — a task that ended as
        its ``asyncio.run`` did (its main task, say) has its release cancelled by the run's
        end, and a task cancelled before its first step sent nothing (helper-63/65: the lock
        stayed held for its whole lease). Where it still cannot go out, that is said."""
        if not eager:
            return runtime.spawn(self._retrying(undo, "cleanup", until), cleanup=True)
        started = False

        async def run() -> None:
            nonlocal started
            started = True
            await self._retrying(undo, "release", until)

        def ended(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                logger.warning(
                    "the release of %r was %s: its event loop was ending (a task that ends "
                    "holding a lock as asyncio.run ends); the lock frees itself when its "
                    "lease ends",
                    self._name,
                    "cut short, and may not have been sent" if started else "not sent",
                )

        task = runtime.spawn(run(), cleanup=True, eager=True)
        task.add_done_callback(ended)
        return task

    async def _retrying(
        self, call: Callable[[], Awaitable[object]], what: str, until: float | None = None
    ) -> None:
        """Run ``call``, retrying its errors a few times quickly (:data:`_ERROR_BACKOFF`) — and
        on, until loop time ``until``, the end of the lease it frees (a slot migration's
        window, a failover, an outage may outlast the first few); then the lease ends by
        itself. By default ``until`` is the lock's lease from now, the longest an acquisition
        it undoes can have been granted (helper-78: an undo gave up after ~2 s of a 3 s
        outage, and its ghost hold kept the lock for the rest of the lease).

        Past the quick tries — or once the connection pool was found exhausted — the
        clean-ups of a node take turns while its latest try failed (:class:`UndoTurn`: one try
        a second in all, however many wait; once one succeeds, the rest go at once). Waiting
        for the pool does not spend the quick tries (it says nothing about the server:
        helper-78 saw them used up by a pool an outage had filled). Every error is retried: a
        refusal that looks final may clear by itself (``NOREPLICAS`` while a replica is away,
        helper-81; ``MISCONF``, ``OOM``); only the node's trouble (a transient error: a
        connection, a timeout, a busy or loading server) makes its clean-ups take turns."""
        loop = asyncio.get_running_loop()
        if until is None:
            until = loop.time() + self._lease
        # A client without a socket_timeout: a call on a connection gone silent (half-open)
        # would hold the clean-up — and the pooled connection it took — for ever (helper-43:
        # three cancelled waits used up a pool of three). Each call gets ATTEMPT_PATIENCE; the
        # read it abandons drops its connection, and the next try takes another.
        runtime = self._existing()
        patience = ATTEMPT_PATIENCE if runtime is not None and runtime.reads_unbounded else None
        failures = waits = 0
        while True:
            turn = None if runtime is None else runtime.undo_turn(self._name)
            gate = None
            if turn is not None and (failures >= len(_ERROR_BACKOFF) or waits):
                gate = turn.gate if await turn.take() else None
                if failures >= len(_ERROR_BACKOFF) and loop.time() >= until:
                    if gate is not None:  # (its turn came after the lease it frees ended)
                        gate.release()
                    break
            try:
                try:
                    if patience is None:
                        await call()
                    else:
                        await _bounded(call(), loop.time() + patience)
                    if turn is not None:
                        turn.failing = False
                    return
                except MaxConnectionsError:
                    if loop.time() >= until:
                        break
                    delay = _POOL_WAITS[min(waits, len(_POOL_WAITS) - 1)]
                    waits += 1
                except (RedisError, OSError, LockError, RedisClusterException) as exc:
                    if turn is not None and runtime is not None and runtime.topology.transient(exc):
                        turn.failing = True
                    elif gate is not None:
                        # Not the node's trouble (a key of the wrong type): the next one's turn
                        # at once — paced behind it, every other clean-up of the node waited a
                        # second per such clean-up in line (helper-83).
                        gate.release()
                        gate = None
                    failures += 1
                    if failures > len(_ERROR_BACKOFF) and loop.time() >= until:
                        break
                    delay = _ERROR_BACKOFF[min(failures, len(_ERROR_BACKOFF)) - 1]
                    logger.info("%s of %r failed (%s); retrying", what, self._name, describe(exc))
                if loop.time() + delay >= until and failures >= len(_ERROR_BACKOFF):
                    break
                await asyncio.sleep(delay)  # (holding the gate, if it is held: one try a second)
            finally:
                if gate is not None:
                    gate.release()
        logger.warning("%s of %r gave up; its lease ends by itself", what, self._name)

    def _entry_undo(self, owner: str, entry: str, sharded: bool) -> Callable[[], Awaitable[object]]:
        """The undo of a re-entry: drop its entry (the hold stays)."""
        return lambda: self._policy.release(owner, "entry", entry, sharded).run(self._redis)

    def _abandon(self, owner: str) -> Callable[[], Awaitable[object]]:
        """The undo of a fresh acquisition: drop whatever ``owner`` reached, fence it."""
        sharded = self._sharded()
        return lambda: self._policy.release(owner, "abandon", "", sharded).run(self._redis)

    def _sharded(self) -> bool:
        runtime = self._existing()
        return runtime is not None and runtime.topology.sharded

    async def _pool_patient(self, call: Callable[[], Awaitable[_T]], deadline: float | None) -> _T:
        """Run ``call``; an exhausted connection pool (a burst of acquisitions on a pool capped
        at ``max_connections``) is back-pressure, not a failure: wait and try again (the
        command was never sent) while the deadline allows."""
        loop = asyncio.get_running_loop()
        for delay in itertools.chain(_POOL_BACKOFF, itertools.repeat(_POOL_BACKOFF[-1])):
            try:
                return await call()
            except MaxConnectionsError:
                left = _left(deadline, loop)
                if left == 0:
                    raise
                # Back-pressure, not a failure: DEBUG (a burst logs it a few times per call).
                logger.debug("connection pool exhausted acquiring %r; retrying", self._name)
                await asyncio.sleep(delay if left is None else min(delay, left))
        raise AssertionError("unreachable")  # pragma: no cover

    # -- acquire ---------------------------------------------------------------------------

    def _check_open(self, runtime: Runtime, action: str = "acquire") -> None:
        if runtime.closed:
            raise LockError(
                f"cannot {action} {self._name!r}: the redis client was closed", name=self._name
            )

    def _check_other_clients(self, runtime: Runtime, task: asyncio.Task[Any]) -> None:
        """Warn when ``task`` is about to wait without end for a lock it holds through another
        client of the same server: re-entry (and the read/write rules) work per client, so the
        wait is for the task itself. (Not refused: one task holding through one client while it
        waits, bounded by an outer timeout, through another is what tests of contention do.)"""
        policy = self._policy
        if not policy.reentrant:
            return  # (permits: another one may come free)
        for other in runtime.siblings():
            held = False
            for key in (policy.hold_key, policy.peer_key):
                hold = None if key is None else unclaimed(other.holds.get((key, task)))
                held = held or (hold is not None and hold.live)
            if held or policy.conflict(other.holds, task):
                logger.warning(
                    "task %s waits without a timeout for %r, which it holds through another "
                    "redis client of the same server: it waits for itself (a task re-enters a "
                    "lock through the client it holds it with)",
                    task.get_name(),
                    self._name,
                )
                return

    def _check_reply(self, reply: Reply, action: str) -> None:
        if reply.status == -2:
            raise wrong_type_error(self._name, action, self._policy.key_of(reply.token))

    def _attempt_call(
        self,
        runtime: Runtime,
        owner: str,
        wait: bool,
        task: asyncio.Task[Any],
        arrival_us: int = 0,
    ) -> Call:
        return self._policy.attempt(
            Attempt(
                owner,
                self._lease_ms,
                wait,
                self._grace_ms,
                self._claim_ms,
                runtime.topology.sharded,
                self._peer(runtime, task),
                arrival_us,
            )
        )

    def _peer(self, runtime: Runtime, task: asyncio.Task[Any]) -> str:
        """The owner id of ``task``'s live hold of the policy's peer key ("": none)."""
        peer_key = self._policy.peer_key
        if peer_key is None:
            return ""
        held = runtime.holds.get((peer_key, task))
        return held.owner if held is not None and held.live else ""

    async def _acquire(
        self, runtime: Runtime, task: asyncio.Task[Any], timeout: float | None
    ) -> bool:
        loop = runtime.loop
        deadline = None if timeout is None else loop.time() + timeout
        owner = new_owner_id()
        arrival = next(_ARRIVALS)
        channel = self._policy.keys.channel
        contended = runtime.contended(channel)
        if (
            contended
            and timeout == 0
            and self._policy.try_yields(runtime.local_waiters(channel), channel in runtime.trying)
            and not self._peer(runtime, task)  # (a downgrade goes ahead of every waiter)
        ):
            return False  # an earlier local arrival the server may not know of yet goes first
        if not contended and timeout != 0 and self._policy.ordered_registration:
            # Where the server grants in the order of registration (FairLock), a task that
            # arrives while tasks of other clients of the same server wait (or attempt) waits
            # in line behind them (_kin_first), rather than attempting on its own first.
            contended = any(other.contended(channel) for other in runtime.kin())
        if not contended or timeout == 0:
            # Nobody here waits for this lock: one plain attempt first (the fast path), and
            # only one at a time per lock (others queue behind it, in the parking lot). A try
            # (timeout 0) makes its one attempt also beside local waiters and attempts in
            # flight, unless the policy orders arrivals (Policy.try_yields): the server alone
            # knows whether a permit, a read share, or the lock itself is free for it (a try
            # answered False from the local queue refused a free permit to concurrent tries of
            # a Semaphore).
            bound: float | None
            if timeout == 0:
                bound = loop.time() + TRY_BOUND
            elif runtime.reads_unbounded:
                # (A silent connection would hold it until the deadline, or for ever.)
                bound = _earlier(loop.time() + ATTEMPT_PATIENCE, deadline)
            else:
                bound = deadline
            sent_at = loop.time()
            if not contended:
                runtime.begin_try(channel, sent_at)
            try:
                call = self._attempt_call(runtime, owner, False, task)
                undo = self._abandon(owner)
                raw = await self._direct(runtime, call, undo, bound, deadline)
                reply = Reply(*ints(raw, 4))
            except _Expired:
                self._check_open(runtime)  # (expired by the close)
                if timeout == 0:
                    raise LockError(
                        f"cannot acquire {self._name!r}: no reply from the server within "
                        f"{TRY_BOUND:g} s{_NO_REPLY}{recent_failure(self._redis, TRY_BOUND)}",
                        name=self._name,
                    ) from None
                if bound == deadline:
                    return False
                # Unanswered for ATTEMPT_PATIENCE (its undo is sent): go on as a waiter, whose
                # attempts are bounded the same way, each on a connection of its own.
                logger.warning(
                    "acquiring %r: no reply to an attempt within %g s; waiting",
                    self._name,
                    ATTEMPT_PATIENCE,
                )
                reply = None
            except MaxConnectionsError as exc:
                if timeout == 0:
                    raise await self._explain(exc, "acquire") from exc
                return False  # no connection freed up within the timeout: a timeout
            except (RedisError, OSError) as exc:
                if timeout == 0 or not runtime.topology.passing(exc):
                    raise await self._explain(exc, "acquire") from exc
                # A slot migration or a failover under way: wait it out like a waiter, whose
                # attempts retry such errors until the deadline (a new owner: the undo of
                # this attempt fences the old one off).
                logger.info("acquiring %r: %s; retrying", self._name, describe(exc))
                reply = None
            finally:
                if not contended:
                    runtime.end_try(channel)
            if reply is None:
                return await self._wait(
                    runtime, task, new_owner_id(), deadline, arrival, first=True
                )
            self._check_reply(reply, "acquire")
            if reply.status == 1:
                if self._adopt(runtime, task, owner, reply, sent_at):
                    return True
                owner = new_owner_id()  # (given up: fenced off)
            if timeout == 0:
                return False
            # It arrived before any task that queued while this attempt was in flight.
            return await self._wait(runtime, task, owner, deadline, arrival, first=True)
        return await self._wait(runtime, task, owner, deadline, arrival)

    def _over(self, expires_at: float, now: float, length: float) -> bool:
        """Whether a hold whose server lease of ``length`` seconds ends at ``expires_at`` (loop
        time) can no longer be vouched for at ``now``: the policy's margin for that length is
        kept, as the hold's own local end keeps it (:meth:`_hold`). (The length granted, not
        the lock's lease: a hand-over's claim window is far shorter, and a margin of the
        lease's swallowed it — every grant "too late", passed on round the line; helper-75.)"""
        return expires_at - self._policy.margin(length) <= now

    def _adopt(
        self, runtime: Runtime, task: asyncio.Task[Any], owner: str, reply: Reply, sent_at: float
    ) -> bool:
        """An attempt answered "held by you": make it this task's hold — unless the answer
        came after the lease it reports may have ended (counted from the attempt's sending:
        a reply delayed that long, a rival may hold the lock already): then it is undone
        (fenced), and False."""
        if runtime.closed:
            self._undo(runtime, self._abandon(owner))
            self._check_open(runtime)
        lease_ms = self._lease_ms
        ttl = reply.ttl_ms if 0 <= reply.ttl_ms <= lease_ms else lease_ms
        expires_at = sent_at + ttl / 1000
        if self._over(expires_at, runtime.loop.time(), ttl / 1000):
            logger.warning(
                "acquiring %r: the server's answer came after the lease it gave had ended "
                "(%.3g s after the attempt was sent); given up",
                self._name,
                runtime.loop.time() - sent_at,
            )
            self._undo(runtime, self._abandon(owner))
            return False
        # A TTL below the lease: the lock was handed over to this owner while it waited (the
        # announcement was missed) — confirm the hand-over at once.
        self._hold(runtime, task, owner, reply.token, expires_at, ttl < lease_ms, ttl / 1000)
        return True

    async def _wait(
        self,
        runtime: Runtime,
        task: asyncio.Task[Any],
        owner: str,
        deadline: float | None,
        arrival: int,
        *,
        first: bool = False,
    ) -> bool:
        """Wait in line for the lock as ``owner`` (:meth:`_wait_as`); an attempt left without
        a reply for ``ATTEMPT_PATIENCE`` ends that owner's wait — its clean-up fences off
        whatever copy of it still lands — and the task waits on, first in its local line,
        under a new owner id (keeping a ``FairLock`` registration's arrival)."""
        arrival_us = 0
        while True:
            try:
                return await self._wait_as(
                    runtime, task, owner, deadline, arrival, first=first, arrival_us=arrival_us
                )
            except _Unanswered as unanswered:
                owner, first, arrival_us = new_owner_id(), True, unanswered.arrival_us

    async def _wait_as(
        self,
        runtime: Runtime,
        task: asyncio.Task[Any],
        owner: str,
        deadline: float | None,
        arrival: int,
        *,
        first: bool,
        arrival_us: int,
    ) -> bool:
        loop = runtime.loop
        channel = self._policy.keys.channel
        self._check_open(runtime)  # (closed while the first attempt was out: name the lock)
        refusal = runtime.topology.wait_refusal()
        if refusal is not None:
            raise LockError(f"cannot wait for {self._name!r}: {refusal}", name=self._name)
        if deadline is None:
            self._check_other_clients(runtime, task)
        hub = runtime.hub(channel)
        lot = hub.lot(channel, self._policy.active_waiters)
        one_watcher = self._policy.one_watcher
        ordered = self._policy.ordered_registration
        waiter = Waiter(
            loop, owner, watches=one_watcher, side=self._policy.side, arrival=arrival
        )
        lot.join(waiter, first=first)
        # (ordered: the latest arrival already waiting through another client, see _kin_first)
        kin_before = self._kin_latest(runtime.kin(), waiter, -1) if ordered else None
        registered = False  # an attempt that may have registered this owner was sent
        acquired = False
        # (loop time sent, server time µs) of the last attempt that registered this owner: any
        # grant naming it came later, so its loop time is at least sent + (grant - server time)
        since: tuple[float, int] | None = None
        started = loop.time()
        try:
            if not await waiter.wait_turn(deadline):
                return False
            ended = runtime.try_ended(channel)
            if ended is not None:
                # Only one command per lock at a time from this process: let the uncontended
                # attempt in flight finish first (it may take the lock, or queue behind us).
                await asyncio.wait((ended,), timeout=_left(deadline, loop))
                if not ended.done():
                    return False
            kin_waited = not ordered  # (_kin_first: once, before the first attempt)
            failures = 0
            homed: Hub | None = None  # the hub whose subscription the attempts followed
            # (ordered: the server's time of this waiter's first registration — of an earlier
            # owner id of this wait, if it was given up: its first attempt is put back, -3)
            resumed = arrival_us != 0
            call = self._attempt_call(runtime, owner, True, task, arrival_us)

            bound: float | None = None

            def attempt() -> Awaitable[object]:
                nonlocal bound
                bound = _earlier(loop.time() + ATTEMPT_PATIENCE, deadline)
                return self._call(runtime, call.run(self._redis), None, bound)

            while True:
                self._check_open(runtime)
                hub, lot = self._follow(runtime, hub, lot, waiter, create=False)
                if not waiter.turn.done():
                    # Moved to the end of another lot (_follow), or pushed back by a waiter
                    # that joined at the front: wait for the turn (a grant naming this waiter
                    # gives it at once), then look again.
                    if not await waiter.wait_turn(deadline):
                        return False
                    continue
                if (homed is not hub or hub.refused(channel)) and hub.existing_lot(channel) is lot:
                    # The first attempt (and the first in a new home) follows the subscription:
                    # a release after it is heard. (Later ones do not wait for a re-subscription
                    # after a reconnection: their timers are the fallback meanwhile — unless
                    # the server refused it: a waiter does not wait deaf, it fails with why.)
                    patience = _earlier(loop.time() + SUBSCRIBE_PATIENCE, deadline)
                    if not await hub.subscribed(channel, patience):
                        if patience == deadline:
                            return False
                        # Unconfirmed for that long (a pub/sub path that hangs while commands
                        # pass: the hub reconnects meanwhile): attempt all the same, deaf — the
                        # re-check at the holder's lease end is the fallback (helper-57: a free
                        # lock left untaken until the timeout, or for ever without one).
                        logger.warning(
                            "waiting for %r: its channel's subscription is unconfirmed after "
                            "%g s; attempting without it (re-checks at the holder's lease end)",
                            self._name,
                            SUBSCRIBE_PATIENCE,
                        )
                    homed = hub
                    self._check_open(runtime)
                ahead = lot.turn_to_register(waiter) if ordered else None
                if ahead is not None:
                    # Registrations reach the server (which dates them) in arrival order.
                    await asyncio.wait((ahead,), timeout=_left(deadline, loop))
                    if not ahead.done():
                        return False
                    continue  # (look again: the lot, the turn)
                if not kin_waited:
                    kin_waited = True
                    kin = runtime.kin()
                    if kin:
                        await self._kin_first(kin, waiter, kin_before, deadline)
                        if deadline is not None and loop.time() >= deadline:
                            return False
                        continue  # (look again: the client may have been closed meanwhile)
                waiter.forget_news()
                sent_at = loop.time()
                registered = True
                try:
                    reply = Reply(*ints(await self._pool_patient(attempt, deadline), 4))
                except _Expired:
                    if bound == deadline:
                        return False
                    # Unanswered for ATTEMPT_PATIENCE: its connection went with it (silent, or
                    # the server stopped). Not sent again as this owner: a copy of it landing
                    # after this task took the lock and released it would take it again.
                    logger.warning(
                        "waiting for %r: no reply to an attempt within %g s; waiting on as a "
                        "new owner",
                        self._name,
                        ATTEMPT_PATIENCE,
                    )
                    raise _Unanswered(arrival_us) from None
                except (RedisError, OSError) as exc:
                    # (Not answered: while this waiter backs off, those behind it keep waiting
                    # for its registration — FIFO — and leave() lets them go if it gives up.)
                    if isinstance(exc, MaxConnectionsError):
                        return False  # no connection freed up within the timeout: a timeout
                    if not runtime.topology.transient(exc) or _left(deadline, loop) == 0:
                        raise await self._explain(exc, "acquire") from exc
                    delay = _ERROR_BACKOFF[min(failures, len(_ERROR_BACKOFF) - 1)]
                    failures += 1
                    logger.info(
                        "waiting for %r: %s; retrying in %.2fs", self._name, describe(exc), delay
                    )
                    await waiter.sleep(_earlier(loop.time() + delay, deadline))
                    continue
                waiter.mark_answered()
                failures = 0
                expected, resumed = resumed, False
                if ordered and reply.token > 0 and reply.status in (0, -3):
                    if reply.status == -3:
                        # Its registration was gone (put back in its place): the server may
                        # have dropped this process's others too — they re-check now. (Not
                        # when it is this wait's new owner's first: expected.)
                        if not expected:
                            lot.sweep(sent_at)
                        reply = reply._replace(status=0)
                    elif not arrival_us:
                        # From now on a registration the server drops is put back here.
                        arrival_us = reply.token
                        call = self._attempt_call(runtime, owner, True, task, arrival_us)
                self._check_reply(reply, "acquire")
                if reply.status == 1:
                    if not self._adopt(runtime, task, owner, reply, sent_at):
                        raise _Unanswered(arrival_us)  # (wait on as a new owner)
                    acquired = True
                    return True
                if reply.status != 0:
                    raise LockError(
                        f"cannot acquire {self._name!r}: the server refused the attempt",
                        name=self._name,
                    )
                if reply.token > 0:
                    since = (sent_at, reply.token)
                if hub.existing_lot(channel) is not lot:
                    # The channel's slot moved to another node (the hub gave it up); this
                    # attempt followed it: subscribe there, then attempt again.
                    moved = self._follow(runtime, hub, lot, waiter, create=True)
                    if moved != (hub, lot):
                        hub, lot = moved
                        continue
                ttl = reply.ttl_ms / 1000 if reply.ttl_ms >= 0 else self._lease
                # The registration lives for max(ttl, lease) + grace on the server: re-check
                # (which refreshes it) before then, however often hand-overs to others move
                # the re-check later — or the queue would skip this waiter for ever.
                refresh_at = sent_at + max(ttl, self._lease) + REGISTRATION_GRACE
                # Re-check when the holds ahead may end unannounced (a dead holder, a grantee
                # that never confirms) — unless another local waiter watches for that.
                recheck_at = waiter.watch = sent_at + ttl
                if one_watcher and lot.watcher() is not waiter:
                    recheck_at = refresh_at
                if hub.existing_lot(channel) is not lot:
                    # Subscribed nowhere (the slot is between nodes): no announcement can
                    # reach this waiter, so it re-checks every ORPHAN_RECHECK seconds.
                    recheck_at = min(recheck_at, sent_at + ORPHAN_RECHECK)
                while True:
                    news = (
                        None
                        if waiter.grant is not None
                        else await waiter.sleep(_earlier(recheck_at, deadline))
                    )
                    if waiter.grant is not None:
                        self._check_open(runtime)
                        grant, waiter.grant = waiter.grant, None
                        expires_at = _claim_end(grant, since)
                        if expires_at is None or self._over(expires_at, loop.time(), grant.ttl):
                            break  # heard too late to vouch for: ask the server (re-attempt)
                        self._hold(runtime, task, owner, grant.token, expires_at, True, grant.ttl)
                        acquired = True
                        return True
                    if deadline is not None and loop.time() >= deadline:
                        return False
                    if news is News.LATER:
                        recheck_at = waiter.watch = min(waiter.bound, refresh_at)
                        continue
                    if news is News.TIMER and loop.time() < recheck_at:
                        continue  # woken for the deadline's sake, which has not passed
                    break
        finally:
            self._counters.waited += loop.time() - started  # also a wait that timed out
            if one_watcher:
                # The next waiter watches from now on: until the holds ahead may end — or, if
                # this waiter now holds the lock, until its lease may end unannounced.
                hold = runtime.holds.get((self._policy.hold_key, task)) if acquired else None
                lot.pass_watch(waiter, waiter.watch if hold is None else hold.expires_at)
            lot.leave(waiter)
            # (The channel's linger starts at the next iteration: not between a hand-over and
            # the caller's return.)
            loop.call_soon(self._home(runtime, hub, lot).done_with, channel)
            if registered and not acquired:
                # Give the clean-up a moment, so that the registration (or a lock handed over
                # meanwhile, which it passes on) is gone when the caller sees the outcome; it
                # goes on in the background if the server is slow to answer.
                cleanup = self._undo(runtime, self._abandon(owner))
                await asyncio.wait((cleanup,), timeout=CLEANUP_GRACE)

    async def _kin_first(
        self, kin: list[Runtime], waiter: Waiter, before: Waiter | None, deadline: float | None
    ) -> None:
        """Where registrations are ordered (FairLock), before ``waiter``'s first attempt: let
        the tasks of this process that called ``acquire()`` before it through *other* clients
        of the same server (``kin``: ``Runtime.kin``) register first — wait for the answer to
        the latest such waiter's first attempt. ``before`` is the latest of them when
        ``waiter`` queued (the last in each of their lots then); uncontended attempts in
        flight there are let end first — a task whose attempt came back "held" queues at the
        front of its lot, ahead of any that came later. (A waiter that left unanswered is
        answered once the one ahead of it is: ``Waiter.pass_on``.)

        Nothing is waited for longer than :data:`KIN_PATIENCE` after it began (the attempt
        was sent, the waiter queued), nor for more than half of the time the caller has left:
        the order is kept between healthy clients, and one stuck on its own pool or connection
        does not hold the others back — not at all once it has been stuck that long."""
        loop = asyncio.get_running_loop()
        channel = self._policy.keys.channel
        cap = None if deadline is None else loop.time() + max(0.0, deadline - loop.time()) / 2
        for other in kin:
            ended = other.try_ended(channel)
            sent_at = other.tried_at.get(channel)
            if ended is not None and sent_at is not None:
                until = _earlier(sent_at + KIN_PATIENCE, cap)
                await asyncio.wait((ended,), timeout=_left(until, loop))
        front = self._kin_latest(kin, waiter, 0)
        if before is None or (front is not None and front.arrival > before.arrival):
            before = front
        answered = ParkingLot.answer_of(before)
        if answered is not None and before is not None:
            until = _earlier(before.since + KIN_PATIENCE, cap)
            await asyncio.wait((answered,), timeout=_left(until, loop))

    def _kin_latest(self, kin: list[Runtime], waiter: Waiter, end: int) -> Waiter | None:
        """Of the waiters at the ``end`` (0: front, -1: back) of the lots of ``waiter``'s lock
        in the runtimes ``kin``, the latest that arrived before it. (A lot is in arrival
        order, so these are found without walking the lots.)"""
        channel = self._policy.keys.channel
        latest: Waiter | None = None
        for lot in itertools.chain.from_iterable(other.lots(channel) for other in kin):
            candidate = lot.queue[end] if lot.queue else None
            if (
                candidate is not None
                and candidate.arrival < waiter.arrival
                and (latest is None or candidate.arrival > latest.arrival)
            ):
                latest = candidate
        return latest

    def _home(self, runtime: Runtime, hub: Hub, lot: ParkingLot) -> Hub:
        """The hub that has ``lot`` now: ``hub``, unless another waiter of the lot moved it
        (:meth:`_follow`)."""
        channel = self._policy.keys.channel
        if hub.existing_lot(channel) is lot:
            return hub
        try:
            home = runtime.hub(channel)
        except LockError:  # closed meanwhile
            return hub
        return home if home.existing_lot(channel) is lot else hub

    def _follow(
        self, runtime: Runtime, hub: Hub, lot: ParkingLot, waiter: Waiter, *, create: bool
    ) -> tuple[Hub, ParkingLot]:
        """The hub and lot ``waiter`` waits in from now on. Unchanged unless ``hub`` gave the
        lock's channel up (a cluster slot migration, or a failover: another node serves the
        channel now).
        Then the lot moves to the hub of the channel's node — as found by another waiter of
        the lot, or (``create``: only just after an attempt, which made the client learn where
        the slot lives) by subscribing the channel there; if that node already has a lot for
        it (a newcomer's), ``waiter`` joins that one, at its end."""
        channel = self._policy.keys.channel
        if hub.existing_lot(channel) is lot:
            return hub, lot
        try:
            home = runtime.hub(channel)
        except LockError:  # no node serves the slot right now: look again later
            return hub, lot
        found = home.existing_lot(channel)
        if found is None and (not create or home is hub):
            return hub, lot  # not known elsewhere yet (or the node still claims the slot)
        if found is None:
            found = home.lot(channel, self._policy.active_waiters, shared=lot)
        elif found is not lot:
            lot.pass_watch(waiter, waiter.watch)
            lot.leave(waiter, moving=True)
            waiter.turn = runtime.loop.create_future()
            home.lot(channel, self._policy.active_waiters)  # (cancels a linger)
            found.join(waiter)
        hub.done_with(channel)
        return home, found

    # -- holds -----------------------------------------------------------------------------

    def _hold(
        self,
        runtime: Runtime,
        task: asyncio.Task[Any],
        owner: str,
        token: int,
        expires_at: float,
        confirm: bool,
        length: float,
    ) -> Hold:
        """Make ``owner``'s hold of the lock this task's: its server lease of ``length``
        seconds (the lease, or a hand-over's claim window) ends at ``expires_at``; the local
        end is kept the policy's margin for that length short of it."""
        policy = self._policy
        margin = policy.margin(length)
        hold = Hold(
            key=policy.hold_key,
            name=self._name,
            owner=owner,
            fencing_token=token,
            lease=self._lease,
            auto_renew=self._auto_renew,
            expires_at=expires_at - margin,
            task=task,
            renew=self._policy.renew,
            on_lost=self._on_lost,
            spawn=runtime.spawn,
            confirm=confirm,
            counters=self._counters,
            margin=policy.margin if margin else None,
            renew_until=None if self._max_hold is None else runtime.loop.time() + self._max_hold,
        )
        self._counters.acquisitions += 1
        if confirm:
            self._counters.handovers += 1
        if telemetry.SINK is not None:
            hold.kind, hold.acquired_at = type(self).__name__, runtime.loop.time()
        # Where each acquisition is a hold of its own (a permit), the task's earlier one waits
        # underneath, to be its hold again when this one ends.
        hold.outer = runtime.holds.get((hold.key, task))
        runtime.holds[(hold.key, task)] = hold
        if _HELPER_TASKS:
            hold.heir = heir = _wait_for_caller(task)
            if heir is not None:
                runtime.heirs.setdefault(heir, []).append(hold)
        runtime.keeper.add_soon(hold)  # (after the acquisition returns: off the hand-over's path)
        self._watch(runtime, hold, task)
        return hold

    def _watch(self, runtime: Runtime, hold: Hold, task: asyncio.Task[Any]) -> None:
        """Release the hold if its task ends without releasing it (and say so)."""
        if hold.task_callback is not None:
            hold.task.remove_done_callback(hold.task_callback)
        hold.task = task

        def task_ended(_: asyncio.Task[Any]) -> None:
            if hold.heir is not None:
                _unlist_heir(runtime, hold)
            if runtime.holds.get((hold.key, task)) is not hold or runtime.closed:
                return
            if hold.pending is not None:
                return  # the release in flight finishes the job (see _release_job)
            if hold.live and self._hand_up(runtime, hold, task):
                return
            if hold.live:
                logger.warning(
                    "task %s ended while holding %r; releasing it", task.get_name(), self._name
                )
            if hold.live:
                self._drop(runtime, hold, eager=True)
            else:
                self._forget_lost(runtime, hold)
            _end_the_rest(runtime, hold.key, task)

        hold.task_callback = task_ended
        task.add_done_callback(task_ended)

    def _move(
        self, runtime: Runtime, hold: Hold, source: asyncio.Task[Any], target: asyncio.Task[Any]
    ) -> None:
        """Make ``hold`` ``target``'s (on top of what it holds of the lock), no longer
        ``source``'s (whose earlier hold, if any, is its own again)."""
        _unstack(runtime, hold, source)
        hold.outer = runtime.holds.get((hold.key, target))
        runtime.holds[(hold.key, target)] = hold
        self._watch(runtime, hold, target)

    def _hand_up(self, runtime: Runtime, hold: Hold, helper: asyncio.Task[Any]) -> bool:
        """``helper`` returned holding ``hold``: if it ran a coroutine for a task awaiting it in
        ``asyncio.wait_for`` (a helper task on Python 3.10/3.11; :attr:`Hold.heir`) and returned
        the lock — ``True`` or this hold's :class:`Lease`: ``wait_for(lock.__aenter__())``,
        ``wait_for(stack.enter_async_context(lock))``, ``wait_for(get())`` around ``return await
        lock.acquire()`` — that task receives the hold with the result. (Without this, the
        caller had ``True`` for a lock released as the helper ended.) The heir was noted when
        the hold was taken: ``wait_for`` may have returned already (its caller cancelled as the
        helper finished returns the result all the same). A helper that was cancelled, raised,
        or returned something else (a task of the application's that forgot to release) is a
        task that ended holding the lock: its hold is released."""
        waiting = hold.heir
        if waiting is None or waiting.done():
            return False
        if helper.cancelled() or helper.exception() is not None:
            return False
        result = helper.result()
        if result is not True and not (isinstance(result, Lease) and result._hold is hold):
            return False
        theirs = unclaimed(runtime.holds.get((hold.key, waiting)))
        if self._policy.reentrant and theirs is not None and theirs.state is not HoldState.LOST:
            return False  # it holds the lock already: the helper's hold cannot join it
        hold.heir = None
        self._move(runtime, hold, helper, waiting)
        entered = self._entered.pop(helper, None)
        if entered:
            self._entered.setdefault(waiting, []).extend(entered)
        guards = hold.guards.pop(helper, 0)
        if guards:  # guarded() entered in the helper: the heir's block is the guarded one now
            hold.guards[waiting] = hold.guards.get(waiting, 0) + guards
        logger.debug(
            "%r: the hold of wait_for's helper task %s goes to %s, which awaited it",
            self._name,
            helper.get_name(),
            waiting.get_name(),
        )
        _end_the_rest(runtime, hold.key, helper)
        return True

    def _forget(self, runtime: Runtime, hold: Hold) -> None:
        _unstack(runtime, hold, hold.task)
        runtime.keeper.discard(hold)
        if hold.task_callback is not None:
            hold.task.remove_done_callback(hold.task_callback)
            hold.task_callback = None

    def _lose(self, runtime: Runtime, hold: Hold, reason: str) -> None:
        runtime.keeper.discard(hold)
        hold.mark_lost(reason)

    def _held_by(
        self, task: asyncio.Task[Any], action: str, frame: FrameType | None = None
    ) -> tuple[Runtime, Hold]:
        """The runtime and ``task``'s hold of the lock, for ``action``; else
        :class:`LockNotOwnedError` — which says why when the method running in ``frame`` is the
        whole body of ``task`` (``asyncio.shield(lock.release())``: a task of its own)."""
        runtime = self._existing()
        if runtime is not None and runtime.heirs:
            _inherit(runtime, task)
        hold = (
            None if runtime is None else unclaimed(runtime.holds.get((self._policy.hold_key, task)))
        )
        if runtime is None or hold is None:
            why = ""
            if frame is not None and _whole_body(task, frame):
                why = (
                    f" ({action}() is the whole body of task {task.get_name()!r}: "
                    "asyncio.shield(), gather(), create_task() and anyio.from_thread.run() run "
                    "a coroutine in a task of its own, and the lock is held by the task that "
                    f"acquired it). Await lock.{action}() in that task — a release goes on "
                    "when its caller is cancelled, it needs no shield — or hand the hold over "
                    "first with lock.transfer(task)"
                )
            raise LockNotOwnedError(
                f"cannot {action} {self._name!r}: not held by this task{why}", name=self._name
            )
        return runtime, hold

    async def _settled(self, hold: Hold, deadline: float | None = None) -> bool:
        """Wait for the releases of ``hold`` in flight (cancelling the caller does not stop
        them; their outcome is their callers'): False if ``deadline`` (loop time) came first."""
        loop = hold.loop
        while (pending := hold.pending) is not None:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            done, _ = await asyncio.wait((pending,), timeout=left)
            if not done:
                return False
        return True

    def _check_live(
        self, runtime: Runtime, hold: Hold, action: str, entry: str | None = None
    ) -> None:
        """Raise unless ``hold`` is this task's and live. A lost hold stays the task's until
        it is released once per acquire, each release raising :class:`LockLostError` (an
        ``extend()`` or a re-entry that reports the loss does not end it: the release in the
        caller's ``finally`` must say "lost" too, not "not held")."""
        held = _in_stack(runtime, hold)
        if not held and hold.state is not HoldState.LOST:
            raise LockNotOwnedError(
                f"cannot {action} {self._name!r}: not held by this task (released)",
                name=self._name,
            )
        if hold.state is HoldState.LOST:
            if held and action == "release":
                if entry is not None and entry in hold.entries:
                    hold.entries.remove(entry)  # an inner hold of it: the outer one remains
                else:
                    self._forget_lost(runtime, hold)
            raise LockLostError(
                f"cannot {action} {self._name!r}: the lease was lost ({hold.lost_reason})",
                name=self._name,
            )

    def _check_in_time(
        self, runtime: Runtime, hold: Hold, sent_at: float, length: float, action: str
    ) -> None:
        """An extend or a re-entry sets the server's lease to ``length`` from when it ran: if
        its confirmation came only after that lease could have ended (a slow network, a
        paused process), the key may be gone and another owner may hold the lock — the hold
        is lost, not extended (what may be left of it on the server is given up)."""
        if sent_at + length - self._policy.margin(length) > runtime.loop.time():
            return
        self._lose(runtime, hold, f"the {action} was confirmed only after the lease it set ended")
        self._abandon_lost(runtime, hold)  # the hold stays the task's, lost
        raise LockLostError(
            f"cannot {action} {self._name!r}: the lease was lost ({hold.lost_reason})",
            name=self._name,
        )

    def _setting(self, runtime: Runtime, hold: Hold, sent_at: float, length: float) -> float:
        """An extend or a re-entry setting the lease to ``length`` is sent at ``sent_at``:
        from now on the hold counts on the end it may leave (a shorter lease is the hold's
        lease from now on, renewed at its pace — the keeper's renewals in flight with the old
        one are judged as crossed); the loop time by which its answer must come: the end of
        the lease it sets (a later answer could not be told from a lease that ended)."""
        if length < hold.lease:
            hold.lease = length
            hold.shortened = sent_at  # until a command that announces it is known to have run
        _maybe_shortened(runtime, hold, sent_at, length)
        return sent_at + length - self._policy.margin(length)

    def _not_set_in_time(
        self, runtime: Runtime, hold: Hold, sent_at: float, length: float, action: str
    ) -> NoReturn:
        """No answer to an extend or a re-entry came within the lease it sets (or the hold's
        lease ended first): it may have run. Lost if the lease may have ended (the keeper's
        watchdog may have said so already); else a :class:`LockError` — the lease goes on,
        kept by the renewals confirmed meanwhile."""
        _given_up(runtime, hold, sent_at, length)
        loop = runtime.loop
        if hold.state is HoldState.HELD and loop.time() < hold.expires_at - _TIMER_SLACK:
            raise LockError(
                f"cannot {action} {self._name!r}: no answer from the server within the "
                f"{length:g} s lease it sets; the lease goes on (renewed)",
                name=self._name,
            )
        if hold.state is HoldState.HELD:
            self._lose(runtime, hold, f"the lease ended before the {action} was confirmed")
        raise LockLostError(
            f"cannot {action} {self._name!r}: the lease was lost ({hold.lost_reason})",
            name=self._name,
        )

    async def _setting_failed(
        self,
        runtime: Runtime,
        hold: Hold,
        sent_at: float,
        length: float,
        exc: BaseException,
        action: str,
        before: Snapshot,
    ) -> None:
        """An extend or a re-entry sent at ``sent_at``, setting a lease of ``length``, failed
        with ``exc`` in a way after which it may have run: count on the shorter lease if it
        was shorter, and raise what the caller must see for a server's error — the loss, if
        the lease it may have set has already ended (:class:`LockLostError`: ``remaining()``
        says 0, and another owner may hold the lock now), else a :class:`LockError`. Returns
        for any other exception (a cancellation: the caller re-raises it).

        No free connection (``MaxConnectionsError``) means it was never sent: the hold is put
        back as it was ``before`` (:meth:`Hold.unsent`) — else a shorter lease nobody sent
        was counted on, and lost while the server's lease went on."""
        if isinstance(exc, MaxConnectionsError):
            hold.unsent(before)
            runtime.keeper.reschedule(hold)
            raise await self._explain(exc, action) from exc
        _given_up(runtime, hold, sent_at, length)
        if not isinstance(exc, (RedisError, OSError)):
            return
        if hold.state is HoldState.HELD and hold.expires_at <= runtime.loop.time():
            self._lose(runtime, hold, f"the {action} failed and the lease it may have set ended")
            self._abandon_lost(runtime, hold)  # the hold stays the task's, lost
        if hold.state is HoldState.LOST:
            raise LockLostError(
                f"cannot {action} {self._name!r}: the lease was lost ({hold.lost_reason})",
                name=self._name,
            ) from exc
        raise await self._explain(exc, action) from exc

    def _forget_lost(self, runtime: Runtime, hold: Hold) -> None:
        """Forget a lost hold, and release what may still be ours on the server (a lease lost
        because its renewals went unanswered may still be alive there): fenced, harmless if
        another owner holds the lock now."""
        self._forget(runtime, hold)
        self._abandon_lost(runtime, hold)

    def _abandon_lost(self, runtime: Runtime, hold: Hold) -> None:
        """Give up on the server what may be left of the lost ``hold`` (fenced), unless the
        runtime is closed."""
        if not runtime.closed:
            self._undo(runtime, self._abandon(hold.owner))

    def _length_ending_in(self, remaining: float) -> float:
        """The lease to set now for a hold whose local end — the lease less the policy's
        margin for it — is to stay ``remaining`` seconds away. (``remaining`` itself, as a
        lease, took another margin off the end at every re-entry: 20 re-entries of an
        hour's hold cut it by 11 minutes, a thousand of a 10 s hold ended it in 5 s;
        helper-77.)"""
        length = remaining
        for _ in range(3):  # (x = remaining + margin(x): each step shrinks the error 100-fold)
            length = remaining + self._policy.margin(length)
        return length

    async def _reenter(self, runtime: Runtime, hold: Hold, deadline: float | None) -> bool | None:
        """Re-enter ``hold``; ``None`` when a release in flight ended it (acquire afresh),
        ``False`` when no answer came by ``deadline`` (loop time; the re-entry is undone). The
        wait for the answer ends with the lease too: the hold is lost then."""
        if hold.pending is not None:
            if not await self._settled(hold, deadline):
                return False
            if unclaimed(runtime.holds.get((hold.key, hold.task))) is not hold:
                return None
        self._check_live(runtime, hold, "re-enter")
        loop = runtime.loop
        entry = hold.new_entry()
        sent_at = loop.time()
        judged = hold.judged
        owner = hold.owner
        length = self._lease
        if not hold.auto_renew and self._auto_renew:
            # Nothing renews this hold: a re-entry through an auto-renewing lock object of a
            # shorter lease (it asks for the lock for as long as its block runs, not for a
            # shorter lease) never ends it sooner than it was to end. One that is not
            # auto-renewing sets the length it was given.
            length = max(length, self._length_ending_in(hold.remaining()))
        if hold.renew_until is not None:  # max_hold: a re-entry never carries the hold past it
            length = min(length, max(0.001, hold.renew_until - sent_at))
        call = self._policy.reenter(owner, entry, to_ms(length), runtime.topology.sharded)
        undo = self._entry_undo(owner, entry, runtime.topology.sharded)
        before = hold.snapshot()
        limit = self._setting(runtime, hold, sent_at, length)
        if deadline is not None:
            limit = min(limit, deadline)

        def bound() -> float:
            return min(limit, hold.expires_at)

        hold.reentering += 1
        try:
            # In a job task, not directly: the wait is bounded, and a cancellation that
            # redis-py swallows on Python 3.11 (its wait_for) must not wait for the bound.
            tries = itertools.count()
            raw = await self._pool_patient(
                lambda: self._call(
                    runtime, call.run(self._redis), undo, bound, first=next(tries) == 0
                ),
                bound(),
            )
            reply = Reply(*ints(raw, 4))
        except _Expired:
            # Undone (its undo drops the entry); the TTL it set may remain.
            if deadline is not None and loop.time() >= deadline - _TIMER_SLACK:
                _given_up(runtime, hold, sent_at, length)
                if hold.state is HoldState.HELD and loop.time() < hold.expires_at:
                    return False  # the caller's deadline, the hold intact
            self._not_set_in_time(runtime, hold, sent_at, length, "re-enter")
        except BaseException as exc:
            # The re-entry may have run all the same (its reply late or lost, the caller
            # cancelled): its undo drops the entry, not the TTL it set, so the server's lease
            # may now be the shorter one (as in extend).
            await self._setting_failed(runtime, hold, sent_at, length, exc, "re-enter", before)
            raise
        finally:
            hold.reentering -= 1
            if hold.base_owed:
                # (Once this step is over: a re-entry that succeeded has added its level.)
                loop.call_soon(self._settle_owed_base, runtime, hold)
        self._check_reply(reply, "re-enter")
        if reply.status != 1:
            self._lose(runtime, hold, "re-entry found the lock expired or held by another owner")
            raise LockLostError(
                f"cannot re-enter {self._name!r}: the lease was lost", name=self._name
            )
        if not hold.live:
            raise LockLostError(
                f"cannot re-enter {self._name!r}: the lease was lost ({hold.lost_reason})",
                name=self._name,
            )
        self._check_in_time(runtime, hold, sent_at, length, "re-enter")
        hold.entries.append(entry)
        self._counters.reentries += 1
        _renewed_by(runtime, hold, sent_at, length, judged)
        return True

    # -- release -----------------------------------------------------------------------------

    async def _release(
        self, runtime: Runtime, hold: Hold, entry: str | None, *, owed: bool = False
    ) -> None:
        """Release ``entry`` of ``hold`` (``None``: the hold itself). The level was chosen when
        the caller asked: releases of ``hold`` still in flight (cancelled, going on in the
        background) have claimed theirs (:attr:`Hold.claimed`), and this one runs after them.
        ``owed``: in the background chain whatever the caller's state (another task's block)."""
        settled = not hold.base_owed
        await self._release_level(runtime, hold, entry, owed)
        if not settled and not hold.base_owed and hold.pending is not None:
            # This release was the last level the hold's own was owed after: the hold's
            # release is under way (_settle_owed_base) — leaving the block waits for it.
            await asyncio.shield(hold.pending)  # (cancelled, it goes on in the background)

    def _settle_owed_base(self, runtime: Runtime, hold: Hold) -> asyncio.Future[None] | None:
        """Release the hold whose own level's block ended out of order (``Hold.base_owed``)
        once no level entered since is left, or being entered: the release, or ``None``."""
        if hold.base_owed and not hold.entries and not hold.reentering and hold.live:
            hold.base_owed = False
            if _in_stack(runtime, hold):
                return self._owe_release(runtime, hold, None, resent=False)
        return None

    async def _release_level(
        self, runtime: Runtime, hold: Hold, entry: str | None, owed: bool
    ) -> None:
        if owed or hold.pending is not None or not _DIRECT:
            job = self._owe_release(runtime, hold, entry, resent=False)
            task = asyncio.current_task()
            before = _cancelling(task)
            try:
                await asyncio.shield(job)
            except asyncio.CancelledError:
                if not (job.cancelled() and runtime.closed and _cancelling(task) == before):
                    raise
                # Not the caller's cancellation: the client's close ended the release.
                self._check_live(runtime, hold, "release", entry)
                raise LockError(
                    f"cannot release {self._name!r}: the redis client was closed",
                    name=self._name,
                ) from None
            return
        self._check_live(runtime, hold, "release", entry)
        if entry is not None and entry not in hold.entries:
            return  # that level was already released
        task = asyncio.current_task()
        before = _cancelling(task)
        try:
            if entry is None:
                await self._release_final(runtime, hold)
            else:
                await self._release_entry(runtime, hold, entry)
        except asyncio.CancelledError:
            # Cancelling a release does not stop it: it is sent again (every release is
            # idempotent) in the background, which also finishes the bookkeeping.
            if hold.live and hold.pending is None:
                self._owe_release(runtime, hold, entry, resent=True)
            raise
        if _cancelling(task) > before:
            raise asyncio.CancelledError()  # swallowed by redis-py; the release is done

    def _owe_release(
        self, runtime: Runtime, hold: Hold, entry: str | None, *, resent: bool
    ) -> asyncio.Future[None]:
        """Release ``entry`` of ``hold`` in the background, after the releases of ``hold``
        already in flight; the level is claimed until then. ``resent``: the caller was
        cancelled while this very release was in flight (see :meth:`_release_final`)."""
        if hold.claimed is None:
            hold.claimed = []
        hold.claimed.append(entry)
        job: asyncio.Future[None] = runtime.spawn(
            self._release_job(runtime, hold, entry, hold.pending, resent=resent), report=False
        )
        hold.pending = job
        # A callback, not a finally: a job the closed runtime cancelled before it started
        # still gives its claim back.
        job.add_done_callback(lambda _: self._release_done(runtime, hold, entry, job))
        return job

    async def _release_job(
        self,
        runtime: Runtime,
        hold: Hold,
        entry: str | None,
        previous: asyncio.Future[None] | None,
        *,
        resent: bool,
    ) -> None:
        if previous is not None:
            await asyncio.wait((previous,))  # (its outcome was its own caller's)
        if not resent:
            self._check_live(runtime, hold, "release", entry)
            if entry is not None and entry not in hold.entries:
                return  # that level was already released
        if entry is None:
            await self._release_final(runtime, hold, resent=resent)
        else:
            await self._release_entry(runtime, hold, entry)

    def _release_done(
        self, runtime: Runtime, hold: Hold, entry: str | None, job: asyncio.Future[None]
    ) -> None:
        """A release of ``hold`` run in the background (``job``) is over."""
        if hold.claimed is not None:
            hold.claimed.remove(entry)
            if not hold.claimed:
                hold.claimed = None
        if hold.pending is job:
            hold.pending = None
        if hold.pending is not None:
            return  # a later release of it is still to run: it finishes the job
        if (
            hold.live
            and hold.task.done()
            and runtime.holds.get((hold.key, hold.task)) is hold
            and not runtime.closed
        ):
            # The task ended while this release was in flight: nobody releases the rest.
            logger.warning("task ended while releasing %r; releasing it", self._name)
            self._drop(runtime, hold)
        if hold.task.done():
            _end_the_rest(runtime, hold.key, hold.task)

    async def _release_entry(self, runtime: Runtime, hold: Hold, entry: str) -> None:
        """Drop one re-entry, retrying transient errors while the lease lasts: the outer hold
        stays intact, or its loss is signalled — never silently dropped."""
        sharded = runtime.topology.sharded
        failures = 0
        status = 0
        while True:
            try:
                call = self._policy.release(hold.owner, "entry", entry, sharded)
                status, _ = ints(await _bounded(call.run(self._redis), _release_deadline(hold)), 2)
                break
            except MaxConnectionsError:
                await asyncio.sleep(_POOL_BACKOFF[-1])
            except (RedisError, OSError, TimeoutError) as exc:
                if not runtime.topology.transient(exc):
                    raise await self._explain(exc, "release") from exc
                if not hold.live:
                    break
                delay = _ERROR_BACKOFF[min(failures, len(_ERROR_BACKOFF) - 1)]
                failures += 1
                logger.info("releasing %r failed (%s); retrying", self._name, describe(exc))
                await asyncio.sleep(min(delay, max(0.01, hold.remaining())))
            if not hold.live or hold.remaining() == 0:
                status = -1
                break
        if status == -1 or not hold.live:
            self._lose(runtime, hold, "release found the lock expired or held by another owner")
            # This inner hold ends here; the lost outer one stays the task's, so each release
            # still to come reports the loss too (see _check_live), not "not held".
            if entry in hold.entries:
                hold.entries.remove(entry)
            raise LockLostError(
                f"cannot release {self._name!r}: the lease had already ended ({hold.lost_reason})"
                " — work done under it may have overlapped another holder",
                name=self._name,
            )
        hold.entries.remove(entry)
        self._counters.releases += 1
        if hold.base_owed:
            self._settle_owed_base(runtime, hold)

    async def _release_final(self, runtime: Runtime, hold: Hold, *, resent: bool = False) -> None:
        """The last release of ``hold``. ``resent``: the caller was cancelled while this
        release was in flight, so the first send may have freed the lock already — and another
        owner may have taken and released it since, erasing the trace a re-sent release looks
        for. "Not held" is then no evidence of a loss (the task gave the lock up either way),
        so it ends the hold quietly instead of reporting a loss nobody could act on."""
        if hold.entries:
            logger.warning(
                "releasing %r with %d inner holds still open: all are released",
                self._name,
                len(hold.entries),
            )
        hold.state = HoldState.RELEASING
        sharded = runtime.topology.sharded
        try:
            call = self._policy.release(hold.owner, "final", "", sharded)
            command = self._pool_patient(lambda: call.run(self._redis), hold.expires_at)
            status, _ = ints(await _bounded(command, _release_deadline(hold)), 2)
        except (RedisError, OSError, TimeoutError, RedisClusterException) as exc:
            lost = hold.state is HoldState.LOST  # (by its renewal, while this was in flight)
            if not lost:
                hold.state = HoldState.RELEASED
            self._forget(runtime, hold)
            if runtime.topology.transient(exc):
                self._undo(runtime, self._abandon(hold.owner), self._kept_until(runtime, hold))
                if lost:
                    raise _lost_in_flight(self._name, hold) from exc
                raise LockError(
                    f"cannot confirm the release of {self._name!r} ({describe(exc)}): it is "
                    "retried in the background, and the lock frees itself when its lease ends at "
                    "the latest",
                    name=self._name,
                ) from exc
            error = await self._explain(exc, "release")
            raise LockError(
                f"{error}; it is no longer renewed and frees itself when its lease ends",
                name=self._name,
            ) from exc
        except Exception:
            # Not a server's error (a client library's bug, a wrapper's exception; the caller
            # sees it): the hold ends here all the same — left RELEASING, it stayed owned
            # until its lease ended — and the lock is freed in the background.
            self._drop(runtime, hold)
            raise
        if status == -1 and resent:
            logger.debug("re-sent release of %r found it already free", self._name)
            status = 0
        if status != -1 and hold.state is HoldState.LOST:
            # Its renewal gave the lease up for lost while this release was in flight (the
            # server answered neither in time): the loss was signalled, and stands (helper-62:
            # the release took it back — lease.lost false again, on_lost had run).
            self._forget(runtime, hold)
            raise _lost_in_flight(self._name, hold)
        if status == -1:
            self._lose(runtime, hold, "release found the lock expired or held by another owner")
            self._forget(runtime, hold)
            raise LockLostError(
                f"cannot release {self._name!r}: the lease had already ended (expired or taken "
                "over) — work done under it may have overlapped another holder",
                name=self._name,
            )
        hold.state = HoldState.RELEASED
        self._forget(runtime, hold)
        self._released(runtime, hold)


@final
class _Guarded:
    """The context manager returned by :meth:`LockBase.guarded`."""

    __slots__ = ("_hold", "_lock", "_task")

    def __init__(self, lock: LockBase) -> None:
        self._lock = lock
        self._hold: Hold | None = None
        self._task: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> Lease:
        lease = await self._lock._enter(sys._getframe(1))
        task = _current("guard", self._lock.name)
        hold = lease._hold
        self._hold, self._task = hold, task
        hold.guards[task] = hold.guards.get(task, 0) + 1
        if hold.state is HoldState.LOST:
            hold.cancel_guarded(task)
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        hold, task = self._hold, self._task
        assert hold is not None and task is not None
        if task.done() and hold.task is not task and task not in hold.guards:
            task = hold.task  # entered in wait_for's helper, which handed the hold up (_hand_up)
        count = hold.guards.get(task, 0) - 1
        if count > 0:
            hold.guards[task] = count
        else:
            hold.guards.pop(task, None)
        by_loss = False
        if hold.take_back_cancel(task):
            # The loss cancelled the task: take that cancellation back (as a cancel scope
            # does), whatever the block made of it — swallowed or turned into an error of its
            # own, it must not make the task's next guarded block take its loss for a
            # cancellation from outside. (One not delivered yet was withdrawn.)
            uncancel = getattr(task, "uncancel", None)
            outside = uncancel is not None and uncancel() > 0
            # (cancelled from outside as well: that cancellation wins)
            by_loss = isinstance(exc, asyncio.CancelledError) and not outside
        try:
            await self._lock._exit(sys._getframe(1), exc)
        except LockLostError as lost:
            if count > 0:
                asyncio.get_running_loop().call_soon(_rearm, hold, task)  # (see below)
            if by_loss:
                raise lost from exc
            raise
        if by_loss:
            if count > 0:
                # Outer guarded blocks of this task on the same hold are still open: if the
                # caller handles this error inside them, they are cancelled at the next await.
                asyncio.get_running_loop().call_soon(_rearm, hold, task)
            raise LockLostError(
                f"lease on {hold.name!r} lost: {hold.lost_reason}", name=hold.name
            ) from exc


def _inherit(runtime: Runtime, task: asyncio.Task[Any]) -> None:
    """Python 3.10/3.11: hand ``task`` now the holds that ``asyncio.wait_for``'s helper task
    took for it and returned with. The helper's own end does it (its done-callback), but
    ``wait_for`` may give ``task`` the helper's result before that callback has run — when
    ``task`` was cancelled in the same loop step as the helper returned."""
    holds = runtime.heirs.get(task)
    if not holds:
        return
    for hold in list(holds):
        callback = hold.task_callback
        if hold.task.done() and hold.heir is task and callback is not None:
            callback(hold.task)  # (task_ended: hands the hold up, and unlists it)


def _unlist_heir(runtime: Runtime, hold: Hold) -> None:
    """``hold``'s helper task ended: it is no longer owed to its heir's next look."""
    holds = runtime.heirs.get(hold.heir) if hold.heir is not None else None
    if holds is not None:
        if hold in holds:
            holds.remove(hold)
        if not holds:
            del runtime.heirs[hold.heir]  # type: ignore[arg-type]


def _innermost_unclaimed(hold: Hold) -> str | None:
    """The level of ``hold`` a ``release()`` called now releases: its innermost re-entry whose
    release is not already on its way, else the hold itself (``None``)."""
    claimed = hold.claimed
    for entry in reversed(hold.entries):
        if claimed is None or entry not in claimed:
            return entry
    return None


def _in_stack(runtime: Runtime, hold: Hold) -> bool:
    """Whether ``hold`` is one of its task's holds (on top, or under a later one)."""
    top = runtime.holds.get((hold.key, hold.task))
    while top is not None and top is not hold:
        top = top.outer
    return top is not None


def _unstack(runtime: Runtime, hold: Hold, task: asyncio.Task[Any]) -> None:
    """Take ``hold`` out of ``task``'s holds of its key, whether on top or not (a permit
    released while the task took another: the one above would bring it back when it ends)."""
    top = runtime.holds.get((hold.key, task))
    if top is hold:
        if hold.outer is not None:
            runtime.holds[(hold.key, task)] = hold.outer
        else:
            del runtime.holds[(hold.key, task)]
        return
    while top is not None and top.outer is not hold:
        top = top.outer
    if top is not None:
        top.outer = hold.outer


def _end_the_rest(runtime: Runtime, key: Hashable, task: asyncio.Task[Any]) -> None:
    """The ended ``task``'s hold now on top for ``key`` (a Semaphore's earlier permit, a lost
    hold under a fresh one) is ended by its own callback: that callback ran when the task
    ended and left it, as it was not on top then."""
    top = runtime.holds.get((key, task))
    if top is not None and top.task_callback is not None:
        top.task_callback(task)


def _lost_in_flight(name: str, hold: Hold) -> LockLostError:
    """The error of a final release during which the hold's loss was signalled."""
    return LockLostError(
        f"cannot release {name!r}: its lease was lost while the release was in flight "
        f"({hold.lost_reason}) — work done under it may have overlapped another holder",
        name=name,
    )


async def _settle_undo(undo: asyncio.Task[None] | None, patience: float | None = None) -> None:
    """Wait (``patience`` seconds at most, default RELEASE_PATIENCE) for a give-up sent in the
    background: an acquisition that fails "after releasing" (SPEC §4) must not leave the lock
    visibly held as it reports the failure. It goes on retrying past this wait if the server
    is slow to answer."""
    if undo is not None and not undo.done():
        await asyncio.wait((undo,), timeout=RELEASE_PATIENCE if patience is None else patience)


def _rearm(hold: Hold, task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` again for the guarded blocks it still has open on the lost ``hold``."""
    if hold.guards.get(task, 0) > 0 and hold.state is HoldState.LOST:
        hold.cancel_guarded(task)
