"""The acquire / wait / renew / release machinery every lock primitive shares.

A primitive supplies its scripts (:meth:`LockBase._attempt`, :meth:`LockBase._release_script`,
...); this module owns the algorithm around them:

1. **Ownership.** The owner is the asyncio task. Each fresh acquisition gets a new random owner
   id (128 bits from :mod:`secrets`) that is never reused; the process maps ``(name, task)`` to
   the :class:`Lease` it holds, so a task re-entering a lock is recognised locally and the hold
   count is kept in Redis (it dies with the lease if the process dies).
2. **Acquire.** One attempt; if the lock is held and the caller may wait, it queues locally
   (see ``_notify``), subscribes, and the head of the local queue registers in Redis as a waiter
   so that the release hands the lock over directly and announces it — the waiter holds the lock
   the moment the announcement arrives, with no further round trip. Each sleep is bounded by the
   holder's remaining lease, because expiry announces nothing.
3. **Cancellation.** Every command that may change the lock runs in its own task, shielded from
   the caller's cancellation. If the caller is cancelled (or times out) while such a command may
   have reached Redis, a tracked cleanup waits for the command's reply and then removes whatever
   it reached (a registration, a handed-over hold, an extra re-entry) with the never-reused owner
   id, so a cancelled acquisition never leaves a ghost holder. Release is shielded the same way:
   cancelling a release does not stop it.
4. **Renewal** is handed to the client's :class:`LeaseKeeper` (batched; see ``_renewal``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import secrets
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._client import ClientState, state_for
from ._errors import LockError, LockLostError, LockNotOwnedError, LockTimeout
from ._keys import LockKeys
from ._lease import HoldState, Lease, LostCallback
from ._notify import Waiter
from ._scripts import AcquireReply, raise_translated
from ._validation import check_lease, check_name, check_timeout, to_ms

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ._scripts import EncodableArg, Script

logger = logging.getLogger("redis_locks_async")

_T = TypeVar("_T")
_REGISTRATION_GRACE_MS: Final = 2000
_ERROR_BACKOFF: Final = (0.05, 0.1, 0.2, 0.5, 1.0)
_POOL_BACKOFF: Final = (0.002, 0.005, 0.01, 0.02, 0.05)  # a pool frees up within a round trip


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


def new_owner_id() -> str:
    """A fresh, unguessable owner id (128 random bits, hex)."""
    return secrets.token_hex(16)


def _current_task(action: str, name: str) -> asyncio.Task[Any]:
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError(f"cannot {action} {name!r} outside an asyncio task")
    return task


def _transient(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, LockError) else exc
    return isinstance(cause, (RedisConnectionError, RedisTimeoutError, OSError))


class LockBase(ABC):
    """Shared machinery of the exclusive lock primitives (see the module docstring)."""

    __slots__ = (
        "_auto_renew",
        "_entered",
        "_keys",
        "_lease",
        "_name",
        "_on_lost",
        "_redis",
        "_timeout",
    )

    def __init__(
        self,
        redis: Redis,
        name: str,
        *,
        lease: float = 30.0,
        auto_renew: bool = True,
        timeout: float | None = None,
        on_lost: LostCallback | None = None,
    ) -> None:
        self._name = check_name(name)
        self._lease = check_lease(lease)
        self._timeout = check_timeout(timeout)
        if not isinstance(auto_renew, bool):
            raise TypeError(f"auto_renew must be a bool, not {type(auto_renew).__name__}")
        if on_lost is not None and not callable(on_lost):
            raise TypeError("on_lost must be callable")
        if not hasattr(redis, "evalsha"):
            raise TypeError(f"redis must be a redis.asyncio client, not {type(redis).__name__}")
        self._redis = redis
        self._auto_renew = auto_renew
        self._on_lost = on_lost
        self._keys = LockKeys.for_name(self._name)
        self._entered: dict[asyncio.Task[Any], list[Lease]] = {}

    # -- what a primitive supplies ---------------------------------------------------------

    @abstractmethod
    async def _attempt(self, owner: str, lease_ms: int, mode: str, grace_ms: int) -> AcquireReply:
        """One acquisition attempt (``mode``: "try", "wait" or "reenter")."""

    @abstractmethod
    async def _release_script(self, owner: str, mode: str) -> tuple[int, int]:
        """Release one hold ("one") or everything ``owner`` reached ("all")."""

    @abstractmethod
    async def _settle_script(self, owner: str, expected: int) -> int:
        """Undo an unseen re-entry: put the hold count back to ``expected``."""

    @abstractmethod
    def _renew_call(
        self, owner: str, lease_ms: int
    ) -> tuple[Script, tuple[str, ...], tuple[EncodableArg, ...]]:
        """The script call that renews ``owner``'s lease (pipelined by the keeper)."""

    # -- public surface ----------------------------------------------------------------------

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
    def state(self) -> LockState:
        """This lock's state for the calling task (a local view; no I/O)."""
        task = asyncio.current_task()
        lease = self._local_hold(task) if task is not None else None
        if lease is None:
            return LockState.IDLE
        return {
            HoldState.HELD: LockState.HELD,
            HoldState.RELEASING: LockState.RELEASING,
            HoldState.LOST: LockState.LOST,
            HoldState.RELEASED: LockState.IDLE,
        }[lease.state]

    def owned(self) -> bool:
        """Whether the calling task holds this lock (a local view; no I/O)."""
        task = asyncio.current_task()
        lease = self._local_hold(task) if task is not None else None
        return lease is not None and lease.state is HoldState.HELD

    @property
    def current_lease(self) -> Lease | None:
        """The calling task's :class:`Lease` on this lock, if it holds it."""
        task = asyncio.current_task()
        return self._local_hold(task) if task is not None else None

    async def locked(self) -> bool:
        """Whether anyone holds the lock, as the server sees it now."""
        try:
            return bool(await self._redis.exists(self._name))
        except RedisError as exc:
            await raise_translated(self._redis, (self._name,), self._name, "inspect", exc)

    async def acquire(
        self, timeout: float | _Unset | None = UNSET, *, blocking: bool = True
    ) -> bool:
        """Acquire the lock for the calling task; ``True`` once held, ``False`` on timeout.

        ``timeout`` is in seconds; ``None`` waits forever; left out, the lock's own ``timeout``
        applies. ``blocking=False`` makes a single attempt. A task that already holds the lock
        re-enters it (the hold count goes up; release once per acquire).
        """
        wait = self._timeout if timeout is UNSET else check_timeout(timeout)
        if not isinstance(blocking, bool):
            raise TypeError("blocking must be a bool")
        task = _current_task("acquire", self._name)
        state = state_for(self._redis)
        held = state.holds.get((self._name, task))
        if held is not None:
            return await self._reenter(state, held)
        return await self._acquire_fresh(state, task, wait if blocking else 0.0)

    async def release(self) -> None:
        """Release one hold of the calling task (the last one frees or hands over the lock).

        Raises :class:`LockNotOwnedError` if the task does not hold the lock and
        :class:`LockLostError` if its lease ended meanwhile. Cancelling the caller does not
        stop the release.
        """
        task = _current_task("release", self._name)
        state = state_for(self._redis)
        lease = state.holds.get((self._name, task))
        if lease is None:
            raise LockNotOwnedError(
                f"cannot release {self._name!r}: not held by this task", name=self._name
            )
        if lease.state is HoldState.RELEASING:
            raise LockNotOwnedError(
                f"cannot release {self._name!r}: a release of this hold is still in progress",
                name=self._name,
            )
        if lease.state is HoldState.LOST:
            self._forget(state, task, lease)
            raise LockLostError(
                f"cannot release {self._name!r}: the lease was lost ({lease.lost_reason})",
                name=self._name,
            )
        job = state.spawn(self._release_core(state, task, lease), report=False)
        await asyncio.shield(job)

    async def extend(self, lease: float | None = None) -> None:
        """Renew the calling task's lease now, to ``lease`` seconds (default: the lock's)."""
        length = self._lease if lease is None else check_lease(lease)
        task = _current_task("extend", self._name)
        state = state_for(self._redis)
        held = state.holds.get((self._name, task))
        if held is None or held.state is not HoldState.HELD:
            error = LockNotOwnedError if held is None else LockLostError
            raise error(f"cannot extend {self._name!r}: not held by this task", name=self._name)
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        script, keys, args = self._renew_call(held._owner, to_ms(length))
        reply = await self._shielded(script.run(self._redis, keys, args), "extend")
        if int(reply) != 1:  # type: ignore[call-overload]
            held._mark_lost("extend found the lock expired or held by another owner")
            raise LockLostError(
                f"cannot extend {self._name!r}: the lease was lost", name=self._name
            )
        held.lease = length
        held._renew_call = self._renew_call(held._owner, to_ms(length))
        held._renewed(sent_at)

    def transfer(self, task: asyncio.Task[Any]) -> Lease:
        """Hand the calling task's hold to ``task`` (no I/O): ``task`` must release it.

        Use it to let a background task finish work under the lock::

            await lock.acquire()
            worker = asyncio.create_task(finish(lock))   # finish() calls lock.release()
            lock.transfer(worker)

        Leaving an ``async with lock:`` block whose hold was transferred releases nothing.
        """
        current = _current_task("transfer", self._name)
        state = state_for(self._redis)
        lease = state.holds.get((self._name, current))
        if lease is None:
            raise LockNotOwnedError(
                f"cannot transfer {self._name!r}: not held by this task", name=self._name
            )
        if task is current:
            return lease
        if (self._name, task) in state.holds:
            raise LockError(
                f"cannot transfer {self._name!r}: the target task already holds it",
                name=self._name,
            )
        del state.holds[(self._name, current)]
        state.holds[(self._name, task)] = lease
        self._watch_task(state, task, lease)
        return lease

    def guarded(self) -> _Guarded:
        """``async with lock.guarded() as lease:`` — the block is cancelled if the lease is lost.

        The cancellation surfaces as :class:`LockLostError` out of the block, so work stops
        when the lock is gone instead of running on unprotected.
        """
        return _Guarded(self)

    async def __aenter__(self) -> Lease:
        if not await self.acquire():
            raise LockTimeout(
                f"timed out after {self._timeout} s waiting for {self._name!r}", name=self._name
            )
        task = _current_task("enter", self._name)
        lease = self._local_hold(task)
        assert lease is not None
        self._entered.setdefault(task, []).append(lease)
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = _current_task("exit", self._name)
        stack = self._entered.get(task)
        lease = stack.pop() if stack else None
        if stack is not None and not stack:
            del self._entered[task]
        if lease is not None and lease._task is not task:
            return  # transferred to another task, which releases it
        try:
            await self.release()
        except LockLostError:
            if exc is None:
                raise
            logger.warning("lease on %r was lost inside a block that failed", self._name)

    def __repr__(self) -> str:
        try:
            state = self.state.value
        except RuntimeError:
            state = "?"
        return (
            f"<{type(self).__name__} {self._name!r} lease={self._lease}s state={state} "
            f"waiters={self._local_waiters()}>"
        )

    # -- machinery ------------------------------------------------------------------------------

    def _local_hold(self, task: asyncio.Task[Any]) -> Lease | None:
        state: ClientState | None = self._redis.__dict__.get("_redis_locks_async_state")
        if state is None:
            return None
        return state.holds.get((self._name, task))

    def _local_waiters(self) -> int:
        state: ClientState | None = self._redis.__dict__.get("_redis_locks_async_state")
        return state.notifier.queued(self._keys.channel) if state is not None else 0

    async def _shielded(self, coro: Awaitable[object], action: str) -> object:
        try:
            return await asyncio.shield(coro)
        except RedisError as exc:
            await raise_translated(self._redis, self._keys.script_keys, self._name, action, exc)

    async def _run_attempt(
        self,
        state: ClientState,
        owner: str,
        mode: str,
        cleanup: Callable[[], Awaitable[object]],
        *,
        cleanup_on_error: bool = True,
    ) -> AcquireReply:
        """One attempt in its own task; if the caller is cancelled (or the attempt fails and
        ``cleanup_on_error``), ``cleanup`` runs once the attempt's fate is known.

        The task is not only about ordering (the cleanup cannot overtake the attempt): awaiting
        redis-py directly, a cancellation that lands as a reply arrives can be swallowed by its
        internal ``wait_for`` on Python < 3.12, and the caller would never see it.
        """
        job = asyncio.ensure_future(
            self._attempt(owner, to_ms(self._lease), mode, _REGISTRATION_GRACE_MS)
        )
        try:
            reply = await asyncio.shield(job)
        except asyncio.CancelledError:
            state.spawn(self._cleanup_after(job, cleanup))
            raise
        except RedisError as exc:
            # A script error leaves no partial writes (each script fails before it writes);
            # a lost connection may have delivered the command, so clean up after it.
            if cleanup_on_error and _transient(exc) and not isinstance(exc, MaxConnectionsError):
                state.spawn(self._cleanup_after(job, cleanup))
            await raise_translated(self._redis, self._keys.script_keys, self._name, "acquire", exc)
        if reply.status == -2:
            raise LockError(
                f"cannot acquire {self._name!r}: key {self._name!r} exists and is not a lock "
                "of this kind; nothing was changed",
                name=self._name,
            )
        return reply

    async def _cleanup_after(
        self, job: asyncio.Future[AcquireReply], cleanup: Callable[[], Awaitable[object]]
    ) -> None:
        if not job.done():
            await asyncio.wait((job,), timeout=self._lease)
            job.cancel()
        if not job.cancelled():
            job.exception()  # retrieved
        for delay in _ERROR_BACKOFF:
            try:
                await cleanup()
                return
            except (RedisError, OSError) as exc:
                if not _transient(exc):
                    logger.warning("cleanup of %r failed: %s", self._name, exc)
                    return
                logger.info("cleanup of %r failed (%s); retrying", self._name, exc)
                await asyncio.sleep(delay)
        logger.warning("cleanup of %r gave up; its lease ends by itself", self._name)

    def _abandon(self, owner: str) -> Callable[[], Awaitable[object]]:
        return lambda: self._release_script(owner, "all")

    def _spawn_abandon(self, state: ClientState, owner: str) -> asyncio.Task[None]:
        """Drop everything ``owner`` reached (a registration, a hold handed over meanwhile, which
        passes on to the next waiter) in a tracked task, retrying transient errors."""
        return state.spawn(self._cleanup_after(_done_future(state.loop), self._abandon(owner)))

    async def _acquire_fresh(
        self, state: ClientState, task: asyncio.Task[Any], timeout: float | None
    ) -> bool:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        owner = new_owner_id()
        channel = self._keys.channel
        if timeout == 0:
            started = loop.time()
            reply = await self._run_attempt(state, owner, "try", self._abandon(owner))
            if reply.acquired:
                self._hold(state, task, owner, reply.token, reply.count, started + self._lease)
            return reply.acquired
        waiter = Waiter(loop)
        registered = False
        state.notifier.enqueue(channel, waiter)
        try:
            if not waiter.turn.done():
                await asyncio.wait((waiter.turn,), timeout=_left(deadline, loop))
                if not waiter.turn.done():
                    return False
            self._check_open(state)
            if not state.notifier.subscribed(channel):
                # nobody here waits for this lock: one plain attempt first (the fast path)
                started = loop.time()
                reply = await self._pool_patient(
                    lambda: self._run_attempt(state, owner, "try", self._abandon(owner)), deadline
                )
                if reply.acquired:
                    self._hold(state, task, owner, reply.token, reply.count, started + self._lease)
                    return True
            await self._pool_patient(lambda: state.notifier.subscribe(channel), deadline)
            state.notifier.expect(channel, waiter, owner)
            failures = 0
            while True:
                self._check_open(state)
                waiter.reset_signal()
                started = loop.time()
                registered = False  # a cancelled attempt cleans up after itself
                try:
                    reply = await self._run_attempt(
                        state, owner, "wait", self._abandon(owner), cleanup_on_error=False
                    )
                except LockError as exc:
                    registered = True
                    if not _transient(exc) or _left(deadline, loop) == 0:
                        raise
                    await waiter.sleep(_bounded(_ERROR_BACKOFF[min(failures, 4)], deadline, loop))
                    failures += 1
                    continue
                registered = True
                failures = 0
                if reply.acquired:
                    self._hold(state, task, owner, reply.token, reply.count, started + self._lease)
                    return True
                if waiter.grant is None:
                    left = _left(deadline, loop)
                    if left == 0:
                        registered = False
                        await asyncio.shield(self._spawn_abandon(state, owner))
                        return False
                    bound = reply.ttl_ms / 1000 if reply.ttl_ms > 0 else self._lease
                    await waiter.sleep(bound if left is None else min(bound, left))
                    self._check_open(state)
                grant = waiter.grant
                if grant is not None:
                    expires = grant.received_at + grant.lease_ms / 1000
                    self._hold(state, task, owner, grant.token, 1, expires)
                    return True
        except BaseException:
            if registered:
                job = self._spawn_abandon(state, owner)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(job)
            raise
        finally:
            state.notifier.leave(channel, waiter)

    async def _pool_patient(self, call: Callable[[], Awaitable[_T]], deadline: float | None) -> _T:
        """Run ``call``; an exhausted connection pool (a burst of acquisitions on a pool capped
        at ``max_connections``) is back-pressure, not a failure: a caller willing to wait backs
        off and tries again (the command was never sent)."""
        loop = asyncio.get_running_loop()
        for delay in itertools.chain(_POOL_BACKOFF, itertools.repeat(_POOL_BACKOFF[-1])):
            try:
                return await call()
            except LockError as exc:
                if not isinstance(exc.__cause__, MaxConnectionsError):
                    raise
                if _left(deadline, loop) == 0:
                    raise
                logger.info("connection pool exhausted acquiring %r; retrying", self._name)
                await asyncio.sleep(_bounded(delay, deadline, loop))
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_open(self, state: ClientState) -> None:
        if state.closed:
            raise LockError(
                f"cannot acquire {self._name!r}: the redis client was closed", name=self._name
            )

    async def _reenter(self, state: ClientState, lease: Lease) -> bool:
        if lease.state is not HoldState.HELD:
            raise LockLostError(
                f"cannot re-enter {self._name!r}: the lease was lost ({lease.lost_reason})",
                name=self._name,
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        expected = lease._count
        reply = await self._run_attempt(
            state, lease._owner, "reenter", lambda: self._settle_script(lease._owner, expected)
        )
        if reply.status == -1:
            lease._mark_lost("re-entry found the lock expired or held by another owner")
            state.keeper.discard(lease)
            raise LockLostError(
                f"cannot re-enter {self._name!r}: the lease was lost", name=self._name
            )
        lease._count = reply.count
        lease._renewed(started)
        return True

    def _hold(
        self,
        state: ClientState,
        task: asyncio.Task[Any],
        owner: str,
        token: int,
        count: int,
        expires_at: float,
    ) -> Lease:
        lease = Lease(
            name=self._name,
            fencing_token=token,
            lease=self._lease,
            auto_renew=self._auto_renew,
            owner=owner,
            count=count,
            expires_at=expires_at,
            task=task,
            renew_call=self._renew_call(owner, to_ms(self._lease)),
            on_lost=self._on_lost,
        )
        state.holds[(self._name, task)] = lease
        state.keeper.add(lease)
        self._watch_task(state, task, lease)
        return lease

    def _watch_task(self, state: ClientState, task: asyncio.Task[Any], lease: Lease) -> None:
        """Release the hold if its task ends without releasing (and say so)."""
        old_task, old_callback = lease._task, lease._done_callback
        if old_callback is not None:
            old_task.remove_done_callback(old_callback)
        lease._task = task

        def task_ended(_: asyncio.Task[Any]) -> None:
            if state.holds.get((self._name, task)) is not lease or state.closed:
                return
            if lease.state is HoldState.RELEASING:
                return  # a release (cancelled in its caller) is finishing the job
            logger.warning(
                "task %s ended while holding %r; releasing it", task.get_name(), self._name
            )
            self._forget(state, task, lease)
            self._spawn_abandon(state, lease._owner)

        lease._done_callback = task_ended
        task.add_done_callback(task_ended)

    def _forget(self, state: ClientState, task: asyncio.Task[Any], lease: Lease) -> None:
        if state.holds.get((self._name, task)) is lease:
            del state.holds[(self._name, task)]
        state.keeper.discard(lease)
        if lease._done_callback is not None:
            lease._task.remove_done_callback(lease._done_callback)
            lease._done_callback = None

    async def _release_with_backoff(self, lease: Lease) -> tuple[int, int]:
        """Run the release script, waiting out an exhausted connection pool while the lease
        lasts (the command was never sent, so retrying is safe)."""
        for delay in itertools.chain(_POOL_BACKOFF, itertools.repeat(_POOL_BACKOFF[-1])):
            try:
                return await self._release_script(lease._owner, "one")
            except MaxConnectionsError:
                if lease._expires_at <= lease._loop.time():
                    raise
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _release_core(
        self, state: ClientState, task: asyncio.Task[Any], lease: Lease
    ) -> None:
        lease._state = HoldState.RELEASING
        try:
            status, count = await self._release_with_backoff(lease)
        except (RedisError, OSError) as exc:
            # The outcome is unknown: stop renewing, and drop the hold once Redis answers again
            # (or let the lease end by itself).
            lease._state = HoldState.RELEASED
            self._forget(state, task, lease)
            self._spawn_abandon(state, lease._owner)
            await raise_translated(self._redis, self._keys.script_keys, self._name, "release", exc)
        if status == 1:
            lease._count = count
            lease._state = HoldState.HELD
            return
        self._forget(state, task, lease)
        if status == -1:
            lease._state = HoldState.HELD
            lease._mark_lost("release found the lock expired or held by another owner")
            raise LockLostError(
                f"cannot release {self._name!r}: the lease had already ended (expired or taken "
                "over) — work done under it may have overlapped another holder",
                name=self._name,
            )
        lease._state = HoldState.RELEASED


@final
class _Guarded:
    """The context manager returned by :meth:`LockBase.guarded`."""

    __slots__ = ("_lease", "_lock", "_task")

    def __init__(self, lock: LockBase) -> None:
        self._lock = lock
        self._lease: Lease | None = None
        self._task: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> Lease:
        lease = await self._lock.__aenter__()
        self._task = _current_task("guard", self._lock.name)
        self._lease = lease
        lease._guarded.add(self._task)
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease, task = self._lease, self._task
        assert lease is not None and task is not None
        lease._guarded.discard(task)
        cancelled_by_loss = lease.lost and isinstance(exc, asyncio.CancelledError)
        if cancelled_by_loss:
            uncancel = getattr(task, "uncancel", None)
            if uncancel is not None:
                uncancel()
        try:
            await self._lock.__aexit__(exc_type, exc, tb)
        except LockLostError as lost:
            if cancelled_by_loss:
                raise lost from exc
            raise
        if cancelled_by_loss:
            raise LockLostError(
                f"lease on {lease.name!r} lost: {lease.lost_reason}", name=lease.name
            ) from exc


def _left(deadline: float | None, loop: asyncio.AbstractEventLoop) -> float | None:
    return None if deadline is None else max(0.0, deadline - loop.time())


def _bounded(delay: float, deadline: float | None, loop: asyncio.AbstractEventLoop) -> float:
    left = _left(deadline, loop)
    return delay if left is None else min(delay, left)


def _done_future(loop: asyncio.AbstractEventLoop) -> asyncio.Future[AcquireReply]:
    future: asyncio.Future[AcquireReply] = loop.create_future()
    future.set_result(AcquireReply(0, 0, 0, 0))
    return future
