"""The lease keeper: one asyncio task per runtime renews every auto-renewed lease, in batches.

A hold is due for renewal a third of the way into its lease (``Hold.renew_at``), so a lone hold
is renewed every lease/3. When one is due the keeper renews it together with every hold at least
halfway through its own renewal period, in pipelines of at most :data:`BATCH` calls: holds fall
into step (two groups a period apart merge at the next tick), and 10,000 held locks of one lease
cost ten round trips per tick, not 10,000 timers. A renewal succeeds only if the owner id still
holds the key (a token-checked script); "not held" means the lease is **lost**. A transient error
(connection refused, timeout, a demoted master) is retried with a growing back-off until the
lease's local expiry passes; then the lease is lost. Every round trip is bounded by the earliest
local expiry in its batch, so a silent network never keeps a lease "held" past its end.

The keeper also confirms hand-overs (a lock handed to a waiting task is granted a short claim
window; the confirmation is an ordinary renewal, due at once) and watches leases without
auto-renewal, only to mark them lost when they expire. A hold that is no longer live (released,
lost) is dropped the moment the keeper sees it: nothing spins on it.

The keeper's task exists while some hold is tracked (and lingers a few seconds after the last
one, so a client that keeps acquiring does not start a task per acquisition); it dies with the
runtime.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any, Final, final

from redis.exceptions import NoScriptError, RedisError

from ._lease import Hold, HoldState

__all__ = ("BATCH", "LeaseKeeper")

logger = logging.getLogger("redis_locks_async")

BATCH: Final = 1000  # renewals per pipeline (one round trip)
_BACKOFF: Final = (0.1, 0.2, 0.4, 0.8, 1.0)  # after a failed round trip
_IDLE_LINGER: Final = 10.0  # seconds the keeper task outlives its last hold
_MIN_BOUND: Final = 0.05  # the shortest time a renewal round trip is given


def _due_at(hold: Hold) -> float:
    """When the keeper must look at ``hold``: its renewal (or confirmation), or the expiry of
    a lease that is not renewed."""
    return hold.renew_at if hold.wants_renewal else hold.expires_at


def _expiry(hold: Hold) -> float:
    return hold.expires_at


def _ripe(hold: Hold, now: float) -> bool:
    """Whether ``hold`` may be renewed now with a batch due anyway: it is at least halfway
    through its renewal period (renewing it early keeps holds in step, so that they share
    round trips — two batches a period apart merge into one)."""
    return hold.wants_renewal and (hold.confirm or hold.renew_at - hold.lease / 6 <= now)


@final
class LeaseKeeper:
    """Renews (and watches) the holds of one runtime."""

    def __init__(
        self,
        topology: Any,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._topology = topology
        self._spawn = spawn
        self._holds: set[Hold] = set()
        self._task: asyncio.Task[None] | None = None
        self._kick: asyncio.Future[None] | None = None
        self._wake_at: float | None = None  # when the sleeping keeper wakes by itself
        self._failures = 0
        self._closed = False  # a cancellation swallowed by redis-py must not keep it running
        self.renewal_round_trips = 0
        self.renewals = 0

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The keeper's task, while there is one."""
        return self._task

    def add(self, hold: Hold) -> None:
        """Start keeping ``hold`` (renewing it, confirming it, or watching it expire)."""
        self._holds.add(hold)
        if self._task is None or self._task.done():
            self._task = self._spawn(self._run())
        else:
            self.reschedule(hold)

    def reschedule(self, hold: Hold) -> None:
        """``hold``'s schedule changed (a shorter lease, a confirmation): wake up in time."""
        if self._wake_at is not None and _due_at(hold) < self._wake_at:
            self._wake_at = None
            if self._kick is not None and not self._kick.done():
                self._kick.set_result(None)

    def discard(self, hold: Hold) -> None:
        """Stop keeping ``hold`` (released or lost)."""
        self._holds.discard(hold)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                # Checked here too, not only by cancellation: Python <= 3.11's wait_for swallows
                # a cancellation that lands as the renewal's reply arrives.
                return
            if not self._holds:
                # Linger before exiting: a client that acquires again soon (the common case)
                # does not pay for a new task on every acquisition.
                self._kick = loop.create_future()
                self._wake_at = math.inf  # any new hold wakes the keeper at once
                await asyncio.wait((self._kick,), timeout=_IDLE_LINGER)
                if not self._holds or self._closed:
                    self._task = None
                    self._wake_at = None
                    return
            now = loop.time()
            next_at = math.inf
            for hold in list(self._holds):
                if not hold.live:
                    self._holds.discard(hold)
                elif not hold.wants_renewal and hold.expires_at <= now:
                    self._holds.discard(hold)
                    hold.mark_lost(hold.expiry_reason)
                else:
                    next_at = min(next_at, _due_at(hold))
            if next_at <= now:
                # Soonest expiry first: a round trip is bounded by its batch's earliest expiry,
                # so holds close to the end of their lease never shorten the others' bound.
                due = sorted(
                    (hold for hold in self._holds if _ripe(hold, now)), key=_expiry
                )
                for start in range(0, len(due), BATCH):
                    await self._renew(due[start : start + BATCH])
                continue
            if next_at == math.inf:
                continue
            self._kick = loop.create_future()
            self._wake_at = next_at
            await asyncio.wait((self._kick,), timeout=max(0.0, next_at - now))
            self._wake_at = None

    async def _renew(self, due: list[Hold]) -> None:
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        topology = self._topology
        leases = [hold.lease for hold in due]
        calls = [hold.renew(hold.owner, lease) for hold, lease in zip(due, leases, strict=True)]
        self.renewal_round_trips += 1
        bound = max(_MIN_BOUND, min(hold.expires_at for hold in due) - sent_at)
        results = await topology.run_batch(calls, bound)
        now = loop.time()
        failed = False
        reload: dict[str, str] = {}
        for hold, lease, (script, _, _), result in zip(due, leases, calls, results, strict=True):
            if isinstance(result, NoScriptError):
                reload[script.sha] = script.source
            failed = self.judge(hold, result, sent_at, now, lease) or failed
        self._failures = self._failures + 1 if failed else 0
        for source in reload.values():
            try:
                await asyncio.wait_for(topology.client.script_load(source), bound)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                logger.debug("script reload failed: %s", exc)

    def judge(
        self, hold: Hold, result: object, sent_at: float, now: float, lease: float | None = None
    ) -> bool:
        """Act on ``hold``'s renewal ``result`` (sent at ``sent_at`` with ``lease``, default
        the hold's); ``True`` when it failed in a way worth retrying."""
        if not hold.live or hold not in self._holds:
            return False
        crossed = lease is not None and lease != hold.lease
        if lease is not None and crossed and not isinstance(result, NoScriptError):
            # A re-entry or an extend changed the hold's lease while this renewal was in
            # flight, and it may have run (a failure here may come after it ran). The server
            # ran the two in an unknown order — a retrying client re-sends a command whose
            # reply was lost, late — so it may keep this renewal's length.
            hold.crossed(sent_at, lease)
        if isinstance(result, NoScriptError):
            hold.renew_at = now  # again right after the reload
        elif isinstance(result, BaseException) and self._topology.transient(result):
            self._retry_or_lose(hold, result, now)
            return True
        elif isinstance(result, BaseException):
            self._lose(hold, f"renewal failed: {result}")
        elif int(result) == 1:  # type: ignore[call-overload]
            self.renewals += 1
            if not crossed:
                hold.renewed(sent_at)
        elif hold.state is HoldState.RELEASING:
            # The task's release ran first (a hand-over's confirmation or a renewal in flight
            # as it released): not a loss — the release's own answer settles the hold. Nothing
            # is left to renew: kept, the hold would stay due and be renewed again at once,
            # round trip after round trip, until that answer came (a retry's back-off away).
            self._holds.discard(hold)
        else:
            self._lose(hold, "renewal found the lock expired or held by another owner")
        return False

    def _lose(self, hold: Hold, reason: str) -> None:
        self._holds.discard(hold)
        hold.mark_lost(reason)

    def _retry_or_lose(self, hold: Hold, exc: BaseException, now: float) -> None:
        if now >= hold.expires_at:
            self._lose(hold, f"renewal failed until the lease ended: {exc!r}")
            return
        logger.info("renewing %r failed (%r); retrying", hold.name, exc)
        delay = _BACKOFF[min(self._failures, len(_BACKOFF) - 1)]
        retry_at = now + min(delay, (hold.expires_at - now) / 2)
        hold.renew_at = retry_at

    async def aclose(self) -> None:
        """Stop renewing (the leases then end on the server by themselves)."""
        self._closed = True
        self._holds.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
