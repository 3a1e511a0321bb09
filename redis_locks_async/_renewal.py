"""The lease keeper: one asyncio task per client renews every auto-renewed lease, in batches.

Each lease is due for renewal a third of the way into its lease. When the keeper wakes it
renews, in one pipelined round trip, every lease due now or within the next sixth of its lease,
so leases of the same length fall into step and 10,000 held locks cost one round trip per tick,
not 10,000 timers. A renewal succeeds only if the owner id still holds the key (token-checked
script); the reply "not held" means the lease is lost. A transient error (connection refused,
timeout) is retried with a short back-off until the lease's local expiry passes; then the lease
is lost. Leases without auto-renewal are tracked too, only to be marked lost when they expire.

The keeper's task exists while some lease is tracked (and lingers a few seconds after the
last one, so a client that keeps acquiring does not start a task per acquisition); it dies
with the client.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any, final

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from ._lease import HoldState, Lease

logger = logging.getLogger("redis_locks_async")

_RETRY_DELAY = 0.1
_IDLE_LINGER = 10.0  # seconds the keeper task outlives its last lease


def _due_at(lease: Lease) -> float:
    """When the keeper must look at ``lease`` (renewal, or expiry without auto-renewal)."""
    return lease._renew_at - lease.lease / 6 if lease.auto_renew else lease._expires_at


@final
class LeaseKeeper:
    """Renews the leases of one client."""

    def __init__(
        self,
        client: Redis,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._client = client
        self._spawn = spawn
        self._leases: set[Lease] = set()
        self._task: asyncio.Task[None] | None = None
        self._kick: asyncio.Future[None] | None = None
        self._wake_at: float | None = None  # when the sleeping keeper wakes by itself
        self.renewal_round_trips = 0
        self.renewals = 0

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The keeper's task, while there is one."""
        return self._task

    def add(self, lease: Lease) -> None:
        """Start keeping ``lease`` (renewing it, or watching it expire)."""
        self._leases.add(lease)
        if self._task is None or self._task.done():
            self._task = self._spawn(self._run())
        elif self._wake_at is not None and _due_at(lease) < self._wake_at:
            self._wake()

    def discard(self, lease: Lease) -> None:
        """Stop keeping ``lease`` (released or given up)."""
        self._leases.discard(lease)

    def _wake(self) -> None:
        if self._kick is not None and not self._kick.done():
            self._kick.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._leases:
                # Linger a while before exiting: a client that acquires again soon (the common
                # case) does not pay for a new task on every acquisition.
                self._kick = loop.create_future()
                self._wake_at = math.inf  # any new lease wakes the keeper at once
                await asyncio.wait((self._kick,), timeout=_IDLE_LINGER)
                if not self._leases:
                    self._task = None
                    self._wake_at = None
                    return
            now = loop.time()
            due: list[Lease] = []
            expired: list[Lease] = []
            next_at = None
            for lease in self._leases:
                due_at = _due_at(lease)
                if due_at > now:
                    next_at = due_at if next_at is None else min(next_at, due_at)
                elif lease.auto_renew:
                    due.append(lease)
                else:
                    expired.append(lease)
            for lease in expired:
                self._leases.discard(lease)
                lease._mark_lost("the lease expired (auto_renew=False)")
            if due:
                await self._renew(due)
                continue
            if next_at is None:
                continue
            self._kick = loop.create_future()
            self._wake_at = next_at
            await asyncio.wait((self._kick,), timeout=max(0.0, next_at - now))
            self._wake_at = None

    async def _renew(self, due: list[Lease]) -> None:
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        pipe = self._client.pipeline(transaction=False)
        for lease in due:
            script, keys, args = lease._renew_call
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        self.renewal_round_trips += 1
        # A silent network must not keep a lease "held" past its end: bound the round trip
        # by the earliest local expiry and treat running out as a transient failure.
        bound = max(0.01, min(lease._expires_at for lease in due) - sent_at)
        try:
            results: list[object] = await asyncio.wait_for(
                pipe.execute(raise_on_error=False), bound
            )
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            results = [exc] * len(due)
        reload: set[str] = set()
        for lease, result in zip(due, results, strict=True):
            if lease._state is not HoldState.HELD or lease not in self._leases:
                continue
            if isinstance(result, NoScriptError):
                reload.add(lease._renew_call[0].source)
                lease._renew_at = sent_at
            elif isinstance(result, BaseException):
                self._retry_or_lose(lease, result, loop.time())
            elif int(result) == 1:  # type: ignore[call-overload]
                self.renewals += 1
                lease._renewed(sent_at)
            else:
                self._leases.discard(lease)
                lease._mark_lost("renewal found the lock expired or held by another owner")
        for source in reload:
            try:
                await self._client.script_load(source)
            except (RedisError, OSError) as exc:
                logger.debug("script reload failed: %s", exc)

    def _retry_or_lose(self, lease: Lease, exc: BaseException, now: float) -> None:
        if now >= lease._expires_at:
            self._leases.discard(lease)
            lease._mark_lost(f"renewal failed until the lease ended: {exc}")
            return
        logger.info("renewing %r failed (%s); retrying", lease.name, exc)
        # due again (see _due_at) after a short back-off, well before the lease ends
        lease._renew_at = now + min(_RETRY_DELAY, (lease._expires_at - now) / 4) + lease.lease / 6

    async def aclose(self) -> None:
        """Stop renewing (the leases then end on the server by themselves)."""
        self._leases.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
