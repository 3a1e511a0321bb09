"""The lease keeper: one asyncio task per client renews every auto-renewed lease, in batches.

Each lease is due for renewal a third of the way into its lease. When the keeper wakes it
renews, in one pipelined round trip, every lease due now or within the next sixth of its lease,
so leases of the same length fall into step and 10,000 held locks cost one round trip per tick,
not 10,000 timers. A renewal succeeds only if the owner id still holds the key (token-checked
script); the reply "not held" means the lease is lost. A transient error (connection refused,
timeout) is retried with a short back-off until the lease's local expiry passes; then the lease
is lost. Leases without auto-renewal are tracked too, only to be marked lost when they expire.

The keeper's task exists only while some lease is tracked, and dies with the client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, final

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from ._lease import HoldState, Lease

logger = logging.getLogger("redis_locks_async")

_RETRY_DELAY = 0.1


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
        elif self._kick is not None and not self._kick.done():
            self._kick.set_result(None)

    def discard(self, lease: Lease) -> None:
        """Stop keeping ``lease`` (released or given up)."""
        self._leases.discard(lease)
        if not self._leases and self._kick is not None and not self._kick.done():
            self._kick.set_result(None)  # nothing left to keep: let the task end now

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._leases:
            now = loop.time()
            due: list[Lease] = []
            expired: list[Lease] = []
            next_at = None
            for lease in self._leases:
                if not lease.auto_renew:
                    if lease._expires_at <= now:
                        expired.append(lease)
                    else:
                        next_at = (
                            lease._expires_at
                            if next_at is None
                            else min(next_at, lease._expires_at)
                        )
                elif lease._renew_at <= now + lease.lease / 6:
                    due.append(lease)
                else:
                    next_at = lease._renew_at if next_at is None else min(next_at, lease._renew_at)
            for lease in expired:
                self._leases.discard(lease)
                lease._mark_lost("the lease expired (auto_renew=False)")
            if due:
                await self._renew(due)
                continue
            if next_at is None:
                continue
            self._kick = loop.create_future()
            await asyncio.wait((self._kick,), timeout=max(0.0, next_at - now))

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
        lease._renew_at = now + min(_RETRY_DELAY, (lease._expires_at - now) / 4) - lease.lease / 6

    async def aclose(self) -> None:
        """Stop renewing (the leases then end on the server by themselves)."""
        self._leases.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
