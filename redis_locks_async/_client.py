"""Per-client shared machinery: one notifier, one lease keeper, one table of holds.

Everything a process shares between the locks of one ``redis.asyncio`` client lives in a
:class:`ClientState`, attached to the client object itself. It is created on first use on the
running event loop. ``client.aclose()`` is wrapped (on that instance only) so that closing the
client also stops renewal, closes the pub/sub connection and cancels every background task of
this library: no orphan task survives a closed client. Leases held at that moment are marked
lost (they can no longer be renewed or released) and end on the server when they expire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Final, final

from redis.asyncio import Redis

from ._errors import LockError
from ._lease import Lease
from ._notify import Notifier
from ._renewal import LeaseKeeper

logger = logging.getLogger("redis_locks_async")

_ATTRIBUTE: Final = "_redis_locks_async_state"
_CLOSE_GRACE: Final = 2.0  # seconds waiters and cleanups get to tidy up on close


@final
class ClientState:
    """What the locks of one client share in one process."""

    def __init__(self, client: Redis) -> None:
        self.client = client
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.holds: dict[tuple[str, asyncio.Task[Any]], Lease] = {}
        self.notifier = Notifier(client.pubsub, self.spawn)
        self.keeper = LeaseKeeper(client, self.spawn)

    def spawn(self, coro: Coroutine[Any, Any, None], *, report: bool = True) -> asyncio.Task[None]:
        """Run ``coro`` in a background task that this state tracks and cancels on close.

        With ``report``, a failure is logged; without, it is left to whoever awaits the task.
        """
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done if report else self._task_done_quietly)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    def _task_done_quietly(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # the awaiting caller re-raises it, if it is still there

    @property
    def background_tasks(self) -> int:
        """How many background tasks are running (listener, keeper, cleanups)."""
        return len(self._tasks)

    def _cleanups(self) -> list[asyncio.Task[None]]:
        long_lived = (self.keeper.task, self.notifier.listener, asyncio.current_task())
        return [task for task in self._tasks if task not in long_lived]

    @property
    def pending_cleanups(self) -> int:
        """How many cleanups, releases and unsubscriptions are still running."""
        return len(self._cleanups())

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait for pending cleanups and releases (not the keeper or the listener)."""
        pending = self._cleanups()
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    async def aclose(self) -> None:
        """Stop everything this library runs for the client.

        Waiting tasks fail with :class:`LockError` after removing their registrations; held
        leases are marked lost (they end on the server by themselves); then the pub/sub
        connection is closed and every remaining background task is cancelled.
        """
        if self.closed:
            return
        self.closed = True
        for lease in list(self.holds.values()):
            lease._mark_lost("the client was closed")
        self.holds.clear()
        await self.keeper.aclose()
        self.notifier.wake_all()
        await self.notifier.wait_empty(timeout=_CLOSE_GRACE)
        await self.drain(timeout=_CLOSE_GRACE)
        await self.notifier.aclose()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def state_for(client: Redis) -> ClientState:
    """The :class:`ClientState` of ``client`` on the running loop (created on first use)."""
    state: ClientState | None = client.__dict__.get(_ATTRIBUTE)
    loop = asyncio.get_running_loop()
    if state is not None and state.loop is loop:
        if state.closed:
            raise LockError("the redis client was closed; create a new client to use locks")
        return state
    state = ClientState(client)
    if _ATTRIBUTE not in client.__dict__:
        _wrap_aclose(client)
    client.__dict__[_ATTRIBUTE] = state
    return state


def _wrap_aclose(client: Redis) -> None:
    original = client.aclose

    async def aclose(*args: Any, **kwargs: Any) -> None:
        state: ClientState | None = client.__dict__.get(_ATTRIBUTE)
        if state is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:  # pragma: no cover - aclose is always awaited in a loop
                running = None
            if state.loop is running:
                await state.aclose()
        await original(*args, **kwargs)

    client.aclose = aclose  # type: ignore[method-assign]
