"""The shared pub/sub listener and the local wait queues: how waiting avoids polling.

One :class:`Notifier` per client and event loop owns one pub/sub connection. Every lock name
with local waiters has one subscribed channel and one FIFO queue of :class:`Waiter` objects
(like trio's ParkingLot): only the head of a queue talks to Redis, the others sleep until they
reach the head, so a release costs one Redis attempt per process, never a herd.

The order that makes it safe: the head of a queue subscribes the channel (and waits for the
subscription to be *confirmed*) before its registering attempt, so no release can slip between
a failed attempt and the subscription. Waiters behind the head do nothing until they reach it,
so 10,000 waiting tasks cost one connection and no commands. The head then sleeps until one of:

* a handover announcement naming its owner id: it already holds the lock (no round trip);
* a plain release announcement, or the channel was re-subscribed after the connection dropped
  (messages may have been lost): it re-checks;
* its sleep bound — the holder's remaining lease — ran out (expiry publishes nothing): it
  re-checks.

Channels are reference-counted by their queues: the last waiter to leave unsubscribes, after
a short linger (so a lock contended again soon costs no SUBSCRIBE/UNSUBSCRIBE per wait). The
listener task exists only while some channel is subscribed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, final

from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from ._errors import LockError

logger = logging.getLogger("redis_locks_async")

_RECONNECT_BACKOFF = (0.05, 0.1, 0.2, 0.4)
_LINGER = 2.0  # seconds a channel stays subscribed after its last local waiter left


@final
@dataclass(frozen=True, slots=True)
class Grant:
    """A handover announced to a waiter: it now holds the lock."""

    token: int
    lease_ms: int
    received_at: float


@final
class Waiter:
    """One task waiting for one lock in this process."""

    __slots__ = ("_loop", "_signal", "grant", "owner", "turn")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.owner = ""
        self.turn: asyncio.Future[None] = loop.create_future()
        self.grant: Grant | None = None
        self._signal: asyncio.Future[None] = loop.create_future()

    def signal(self) -> None:
        """Wake the waiter (news for the head: a handover or a reason to re-check)."""
        if not self._signal.done():
            self._signal.set_result(None)

    def reset_signal(self) -> None:
        """Forget earlier wake-ups; called just before each attempt, so none is missed."""
        if self._signal.done():  # also when a cancelled sleep cancelled it
            self._signal = self._loop.create_future()

    async def sleep(self, timeout: float | None) -> None:
        """Sleep until signalled or ``timeout`` seconds passed (``None``: until signalled).

        The task awaits the signal future itself (a timer signals it on time-out), so a
        handover wakes it in the very next loop iteration: this is the handoff's hot path.
        """
        if timeout is not None and timeout <= 0:
            return
        timer = None if timeout is None else self._loop.call_later(timeout, self.signal)
        try:
            await self._signal
        finally:
            if timer is not None:
                timer.cancel()


@final
class _Channel:
    __slots__ = ("by_owner", "confirmed", "linger", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: deque[Waiter] = deque()
        self.by_owner: dict[str, Waiter] = {}
        self.confirmed: asyncio.Future[None] | None = None  # set once subscription is asked
        self.linger: asyncio.TimerHandle | None = None  # unsubscribes when nobody came back

    def recheck(self) -> None:
        if self.queue:
            self.queue[0].signal()


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@final
class Notifier:
    """Multiplexes every waiting lock of one client over one pub/sub connection."""

    def __init__(
        self,
        make_pubsub: Callable[[], PubSub],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._make_pubsub = make_pubsub
        self._spawn = spawn
        self._pubsub: PubSub | None = None
        self._channels: dict[str, _Channel] = {}
        self._listener: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self._emptied: asyncio.Future[None] | None = None
        self._closing = False
        self.reconnects = 0

    @property
    def waiting(self) -> int:
        """How many local waiters are queued, over all channels."""
        return sum(len(entry.queue) for entry in self._channels.values())

    def queued(self, channel: str) -> int:
        """How many local waiters are queued on ``channel``."""
        entry = self._channels.get(channel)
        return len(entry.queue) if entry else 0

    def enqueue(self, channel: str, waiter: Waiter) -> None:
        """Queue ``waiter`` on ``channel`` (its ``turn`` resolves when it is at the head).

        The caller must call :meth:`leave` afterwards, whatever happens (also on error).
        """
        entry = self._channels.get(channel)
        if entry is None:
            entry = self._channels[channel] = _Channel(waiter._loop)
        elif entry.linger is not None:
            entry.linger.cancel()
            entry.linger = None
        entry.queue.append(waiter)
        if len(entry.queue) == 1:
            waiter.turn.set_result(None)

    def subscribed(self, channel: str) -> bool:
        """Whether ``channel``'s subscription has been requested (and has not failed)."""
        entry = self._channels.get(channel)
        return entry is not None and entry.confirmed is not None

    async def subscribe(self, channel: str) -> None:
        """Make sure ``channel`` is subscribed; return once the server confirmed it.

        Only a queued waiter may call this; the subscription lasts while the queue is not empty.
        """
        entry = self._channels[channel]
        if entry.confirmed is None:
            entry.confirmed = entry.queue[0]._loop.create_future()
            try:
                await self._subscribe(channel)
            except BaseException as exc:
                confirmed, entry.confirmed = entry.confirmed, None
                if not confirmed.done():
                    confirmed.set_exception(LockError(f"cannot subscribe to {channel!r}: {exc}"))
                    confirmed.exception()  # retrieved: no "never retrieved" warning
                raise
        await asyncio.shield(entry.confirmed)

    def expect(self, channel: str, waiter: Waiter, owner: str) -> None:
        """Route handover announcements for ``owner`` on ``channel`` to ``waiter``."""
        entry = self._channels.get(channel)
        if entry is not None:
            waiter.owner = owner
            entry.by_owner[owner] = waiter

    def leave(self, channel: str, waiter: Waiter) -> None:
        """Take ``waiter`` off its queue (synchronous: safe in ``finally`` and on cancel)."""
        entry = self._channels.get(channel)
        if entry is None:
            return
        if entry.by_owner.get(waiter.owner) is waiter:
            del entry.by_owner[waiter.owner]
        was_head = bool(entry.queue) and entry.queue[0] is waiter
        try:
            entry.queue.remove(waiter)
        except ValueError:
            return
        if entry.queue:
            if was_head:
                entry.queue[0].turn.set_result(None)
            return
        if entry.confirmed is not None and not self._closing:
            # Keep the subscription a moment: a lock that is contended again soon (the common
            # case) then costs no SUBSCRIBE/UNSUBSCRIBE round trips per wait.
            entry.linger = waiter._loop.call_later(_LINGER, self._expire, channel, entry)
        else:
            self._drop(channel, entry)
        if self._emptied is not None and not self._emptied.done() and not self.waiting:
            self._emptied.set_result(None)

    def _expire(self, channel: str, entry: _Channel) -> None:
        if self._channels.get(channel) is entry and not entry.queue:
            self._drop(channel, entry)

    def _drop(self, channel: str, entry: _Channel) -> None:
        del self._channels[channel]
        if entry.linger is not None:
            entry.linger.cancel()
            entry.linger = None
        if entry.confirmed is not None:
            self._spawn(self._unsubscribe(channel))

    async def _subscribe(self, channel: str) -> None:
        async with self._send_lock:
            if self._pubsub is None:
                self._pubsub = self._make_pubsub()
            try:
                await self._pubsub.subscribe(channel)
            except RedisError as exc:
                raise LockError(f"cannot subscribe to {channel!r}: {exc}") from exc
        if self._listener is None or self._listener.done():
            self._listener = self._spawn(self._listen())

    async def _unsubscribe(self, channel: str) -> None:
        async with self._send_lock:
            if channel in self._channels or self._pubsub is None:
                return  # wanted again meanwhile
            try:
                await self._pubsub.unsubscribe(channel)
            except RedisError as exc:
                logger.debug("unsubscribe %r failed: %s", channel, exc)

    async def _listen(self) -> None:
        pubsub = self._pubsub
        assert pubsub is not None
        failures = 0
        while self._channels:
            try:
                message = await pubsub.get_message(timeout=None)
            except (RedisError, OSError) as exc:
                # redis-py re-subscribes when it reconnects; confirmations trigger re-checks
                delay = _RECONNECT_BACKOFF[min(failures, len(_RECONNECT_BACKOFF) - 1)]
                failures += 1
                self.reconnects += 1
                logger.warning("pub/sub connection failed (%s); retrying in %.2fs", exc, delay)
                for entry in self._channels.values():
                    entry.recheck()
                await asyncio.sleep(delay)
                continue
            failures = 0
            if message is None:
                continue
            try:
                woke = self._dispatch(message)
            except ValueError:  # not one of our announcements: never let it stop the wait
                logger.warning("ignoring a malformed message: %r", message)
                continue
            if woke:
                # Let the woken waiter run before this task goes back into redis-py to read
                # the next message: the handover's latency is the waiter's, not ours.
                await asyncio.sleep(0)

    def _dispatch(self, message: dict[str, Any]) -> bool:
        """Act on one pub/sub message; ``True`` when it handed a lock to a local waiter."""
        kind = _text(message.get("type"))
        entry = self._channels.get(_text(message.get("channel")))
        if entry is None:
            return False
        if kind in ("subscribe", "ssubscribe"):
            if entry.confirmed is None:
                return False
            if entry.confirmed.done():
                entry.recheck()  # re-subscribed after a reconnect: announcements may be lost
            else:
                entry.confirmed.set_result(None)
        elif kind in ("message", "smessage"):
            data = _text(message.get("data"))
            if data.startswith("g:"):
                _, owner, token, lease_ms = data.split(":")
                waiter = entry.by_owner.get(owner)
                if waiter is not None:
                    loop = asyncio.get_running_loop()
                    waiter.grant = Grant(int(token), int(lease_ms), loop.time())
                    waiter.signal()
                    return True
            else:
                entry.recheck()
        return False

    def wake_all(self) -> None:
        """Wake every local waiter, heads and queued alike (the client is closing)."""
        for entry in self._channels.values():
            for waiter in entry.queue:
                waiter.signal()
                if not waiter.turn.done():
                    waiter.turn.set_result(None)

    async def wait_empty(self, timeout: float) -> None:
        """Return once no waiter is queued, or after ``timeout`` seconds."""
        if self.waiting:
            self._emptied = asyncio.get_running_loop().create_future()
            await asyncio.wait((self._emptied,), timeout=timeout)

    @property
    def listener(self) -> asyncio.Task[None] | None:
        """The listener task, while there is one."""
        return self._listener

    async def aclose(self) -> None:
        """Stop listening and close the pub/sub connection."""
        self._closing = True
        for entry in self._channels.values():
            if entry.linger is not None:
                entry.linger.cancel()
        listener, self._listener = self._listener, None
        self.wake_all()
        if listener is not None:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        if self._pubsub is not None:
            pubsub, self._pubsub = self._pubsub, None
            await pubsub.aclose()  # type: ignore[no-untyped-call]
