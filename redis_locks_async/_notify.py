"""The subscription hub: one pub/sub connection per node serves every waiting lock of a runtime.

Each lock channel with local waiters has one :class:`~._parking.ParkingLot`; the hub keeps the
channel subscribed while its lot exists (reference-counted by the lot's waiters, lingering a
couple of seconds after the last one leaves, so a lock contended again soon costs no
SUBSCRIBE/UNSUBSCRIBE per wait) and routes every announcement to the lot.

The order that makes waiting safe: a waiter subscribes the channel and waits for the server's
*confirmation* before its registering attempt, so no release can slip between a failed attempt
and the subscription. Callers never send pub/sub commands themselves: subscriptions are sent
by the hub's tasks, and a caller only waits — bounded by its own deadline — for its channel's
confirmation, so a hung connection can never hang an ``acquire(timeout=…)``.

**Reading.** Where the connection allows it (RESP2, or RESP3 with a ``hiredis`` that tells push
messages apart; no ``health_check_interval``, which makes redis-py read replies itself) the hub
does not read through redis-py's ``get_message``: the connection's transport is given a
protocol of this module's (:class:`_Tap`) that parses what arrives (``hiredis``) and acts on
each message in the event loop's callback that read it — a grant resolves its waiter's future
there, so the waiter runs in the very next loop iteration, with no reader task in between (B2's
wake hop; redis-py's reader also cost a timeout scope and its parser's layers per message, and
more in the tail). redis-py still connects, authenticates and closes the connection; the hub
writes its ``SUBSCRIBE``/``PING`` commands on it directly (through the ``PubSub`` object,
redis-py would keep a record of every channel that only its own reader prunes). Otherwise the
listener task reads with ``get_message``.

The listener task owns the connection's life:

* **Reconnect.** Any error on the connection closes it; the listener opens a new one, subscribes
  every channel again, and, as each confirmation arrives, every active waiter of that channel
  re-checks (announcements may have been lost while it was down). Re-subscriptions redis-py
  makes by itself are confirmed the same way and trigger the same re-check.
* **Health check.** A connection can die *silently* (half-open TCP: a NAT or a proxy dropped it,
  a peer vanished): nothing arrives, and nothing fails. When the connection has been quiet for
  :data:`PING_AFTER` seconds the listener sends a ``PING``; if nothing at all arrives within
  :data:`PING_TIMEOUT` seconds after it, the connection is declared dead and handled like any
  other error. Idle cost: one ``PING`` per :data:`PING_AFTER` seconds per connection, and only
  while some task waits.

**Presence.** Beside each lock channel the hub subscribes ``<channel>:<process tag>``
(:func:`presence_channel`), in the same command and first, so a waiter's registration is
always made while its process is visibly present on the server; the scripts skip the
registrations of a process that is not (killed: the server dropped its connection). A child
forked while the hub was connected would keep that connection open — and its parent present
after the parent died — so the child lets go of its copies of the hubs' sockets at once
(:func:`_after_fork_in_child`).

**Refusals.** Each lock's channels go in a command of their own, and the hub keeps, per
connection, what its (un)subscriptions are still owed: an error reply is the oldest
unanswered one's (the server refuses a command whole, with one error, and the stream stays in
step). A lock whose channel the server refuses (``NOPERM``: the user's ACL allows the lock's
keys but not its channel) fails only its own waiters, with a ``LockError`` naming the channel;
the connection and the other locks' subscriptions go on, and the lock's next waiter asks again.
An error that cannot be told whose it is (a refused ``PING``, a user who may not subscribe at
all, frames nobody here asked for) fails every unconfirmed subscription and re-makes the
connection, backing off.

``sharded=True`` (Redis Cluster) uses ``SSUBSCRIBE``/``SUNSUBSCRIBE``; a server-sent
``sunsubscribe`` for a channel still wanted (its slot moved) subscribes it again.

**Its own connection.** The hub's connection is not one of the client's pool: it lives for as
long as anyone waits, and taken from a small pool it would starve the client's commands for
good. :class:`Subscriptions` makes it in a pool of its own, made like the client's. Once no
channel is left (the last one's linger over), the listener closes it (:meth:`_retire`).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import sys
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, Protocol, final

from redis.asyncio.client import PubSub
from redis.asyncio.connection import BlockingConnectionPool, ConnectionPool
from redis.exceptions import AskError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from ._errors import LockError, describe
from ._keys import key_slot
from ._lane import lane_capable, reply_reader
from ._owners import process_tag
from ._parking import ParkingLot, decode

__all__ = (
    "PING_AFTER",
    "PING_TIMEOUT",
    "Hub",
    "SubscriptionHub",
    "Subscriptions",
    "presence_channel",
    "subscription_refusal",
)

logger = logging.getLogger("redis_locks_async")

PING_AFTER: Final = 3.0  # seconds of silence before the listener pings
PING_TIMEOUT: Final = 2.0  # seconds a ping may go unanswered before the connection is dead
_READ_SLICE: Final = 1.0  # the listener wakes at least this often to check the connection
_SEND_TIMEOUT: Final = 3.0  # seconds a (re)subscription may take to be sent
_TIMEOUT_CM: Final = sys.version_info >= (3, 11)  # asyncio.timeout() exists
# What a pub/sub connection's failure looks like: anything a redis-py call on it raises. Besides
# its own errors, redis-py lets asyncio's raw ones through when the connection is torn down
# under a read or write (``pool.disconnect()``, a cluster client's slot-map reset):
# AttributeError ("'NoneType' object has no attribute 'writelines'") on Python <= 3.12,
# TypeError ("'NoneType' object is not callable") on 3.13. The listener must survive them all:
# once it ends, nothing restarts it while the channels' waiters stay.
_CONNECTION_TROUBLE: Final = (Exception,)
_LINGER: Final = 2.0  # seconds a channel stays subscribed after its last local waiter left
_RECONNECT_BACKOFF: Final = (0.05, 0.1, 0.2, 0.5, 1.0)
_PING_TEXT: Final = "redis-locks-async"


def presence_channel(channel: str) -> str:
    """The channel this process keeps subscribed beside a lock's ``channel`` while it has
    waiters for the lock: ``<channel>:<process tag>``. A script that is about to hand the lock
    to a registration asks the server whether the registering process still has it
    (``PUBSUB NUMSUB``, ``prelude.lua``, ``registrant_alive``): a killed process's
    registrations are skipped at once instead of costing a claim window each. Nothing is ever
    published on it. Same hash tag as ``channel``: one slot, one node."""
    return channel + ":" + process_tag()


def _with_presence(channel: str) -> tuple[str, str]:
    """``channel``'s presence channel, then ``channel``, to (un)subscribe in one command: the
    confirmation of ``channel`` then also confirms its presence."""
    return presence_channel(channel), channel


def _of_another_loop(exc: BaseException) -> bool:
    """``exc`` is asyncio's for a connection opened under another (closed) event loop."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "attached to a different loop" in text or "Event loop is closed" in text
    )


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _failed(future: asyncio.Future[Any]) -> bool:
    """``future`` ended with an exception (not a result, not cancelled)."""
    return future.done() and not future.cancelled() and future.exception() is not None


def _wire(arg: str) -> bytes:
    """A channel (or PING text) as the hub sends it: UTF-8, whatever the client's encoding —
    as the scripts publish it (``_keys.LockKeys.wire_channel``) and as the hub reads it back."""
    return arg.encode("utf-8")


def _channel_text(value: object, pubsub: Any) -> str:
    """A channel name redis-py read for the listener: decoded with the client's encoding when
    it decodes responses — undone here, as the name went out in UTF-8 (:func:`_wire`)."""
    if isinstance(value, str):
        encoder = getattr(pubsub, "encoder", None)
        encoding = getattr(encoder, "encoding", "utf-8")
        if codecs.lookup(encoding).name != "utf-8":
            value = value.encode(encoding, "replace")
    return _text(value)


class Hub(Protocol):
    """What the core and the runtime use of a hub: :class:`SubscriptionHub`, or a topology's
    own (several servers' hubs delivering to one lot per channel, for ``RedLock``)."""

    @property
    def waiting(self) -> int:
        """How many local waiters are queued, over all channels."""

    @property
    def long_lived(self) -> set[asyncio.Task[None]]:
        """The hub's own long-running tasks (not clean-ups)."""

    def waiters(self, channel: str) -> int:
        """How many local waiters are queued on ``channel``."""

    def lots(self) -> list[ParkingLot]:
        """Every parking lot."""

    def lot(self, channel: str, active: int = 1, *, shared: ParkingLot | None = None) -> ParkingLot:
        """The parking lot of ``channel`` (subscribing it; ``shared``: the lot to use if the
        channel is new here); release with :meth:`done_with`."""

    def existing_lot(self, channel: str) -> ParkingLot | None:
        """The parking lot of ``channel`` if it is subscribed here (``None``: it is not, or
        no longer — its cluster slot moved to another node)."""

    def done_with(self, channel: str) -> None:
        """A waiter left ``channel``'s lot."""

    async def subscribed(self, channel: str, deadline: float | None) -> bool:
        """Wait until ``channel`` is subscribed; ``False`` when ``deadline`` passed first."""

    def refused(self, channel: str) -> bool:
        """Whether the server refused ``channel``'s latest subscription (then
        :meth:`subscribed` raises the reason, and the channel's waiters were told to re-check)."""

    def wake_all(self) -> None:
        """Wake every local waiter (closing)."""

    async def wait_empty(self, timeout: float) -> None:
        """Return once no waiter is queued, or after ``timeout`` seconds."""

    async def aclose(self) -> None:
        """Stop listening and close the connection(s)."""


@final
class _Channel:
    __slots__ = ("asked_at", "confirmed", "linger", "lot", "refused")

    def __init__(self, lot: ParkingLot, loop: asyncio.AbstractEventLoop) -> None:
        self.lot = lot
        self.confirmed: asyncio.Future[None] = loop.create_future()
        self.asked_at: float | None = None  # when the pending subscription was sent
        self.linger: asyncio.TimerHandle | None = None  # set while nobody waits
        self.refused = False  # the server refused its last subscription (confirmed failed)


@final
class _Owed:
    """What one (un)subscription sent on the hub's connection is still owed: a confirmation
    frame per channel it names — or, instead of them all, one error reply (the server refuses a
    command whole)."""

    __slots__ = ("channel", "frames", "subscribe")

    def __init__(self, subscribe: bool, channel: str, frames: tuple[str, ...]) -> None:
        self.subscribe = subscribe
        self.channel = channel  # the lock channel it is for
        self.frames = set(frames)


async def _read(pubsub: Any) -> dict[str, Any] | None:
    """The next message on ``pubsub`` (``None`` after :data:`_READ_SLICE` of silence). Bounded
    as a safety net beyond redis-py's own read timeout — by ``asyncio.timeout`` where there is
    one: ``wait_for`` runs the read in a task of its own on Python <= 3.11, one more task and
    one more loop iteration between a grant's arrival and the waiter it wakes (B2's wake hop)."""
    if _TIMEOUT_CM:
        async with asyncio.timeout(_READ_SLICE + _SEND_TIMEOUT):  # type: ignore[attr-defined]
            return await pubsub.get_message(timeout=_READ_SLICE)  # type: ignore[no-any-return]
    return await asyncio.wait_for(
        pubsub.get_message(timeout=_READ_SLICE), _READ_SLICE + _SEND_TIMEOUT
    )


_MESSAGES: Final = frozenset(("message", "smessage"))
_SUBSCRIBES: Final = frozenset(("subscribe", "ssubscribe"))
_CONFIRMATIONS: Final = _SUBSCRIBES | {"unsubscribe", "sunsubscribe"}


@final
class _Tap(asyncio.Protocol):
    """Reads a hub's pub/sub connection in the event loop's own callback: what arrives is
    parsed (``hiredis``) and handed to the hub at once — a grant reaches its waiter's future
    in the callback that read it, with no reader task between (redis-py's ``get_message``
    cost B2 a task step, a timeout scope and its parser's layers per wake-up, and more in the
    tail). The connection is redis-py's (connected, authenticated, database selected by it);
    only its transport's protocol is this one while the hub uses it, and redis-py still
    writes on it (``SUBSCRIBE``, ``PING``). Where the connection cannot be read this way (see
    :func:`._lane.lane_capable`: RESP3 without a hiredis that tells push messages apart, a
    ``health_check_interval``, which makes redis-py read replies itself) the listener reads
    with ``get_message`` as before."""

    def __init__(self, hub: SubscriptionHub, conn: Any) -> None:
        self._hub = hub
        self._loop = hub._loop
        self.conn = conn
        self._transport: Any = conn._writer.transport
        self._inner: asyncio.BaseProtocol = self._transport.get_protocol()
        # Bytes, whatever the client decodes: a message that is not UTF-8 (anyone who may
        # publish on a lock's channel can send one) would fail a decoding reader, and cost a
        # reconnection each; the hub reads every frame with errors replaced (_text, decode).
        self._reader = reply_reader(conn, decoded=False)
        self.live = True  # the hub's current connection: what it reads is acted on
        self.received = 0  # reads so far
        self.heard = False  # a frame other than an error reply came (a confirmation, say)
        self.last_rx = self._loop.time()  # when the last one came
        self.failure: asyncio.Future[BaseException] = self._loop.create_future()
        self._nudged: asyncio.Future[None] | None = None
        self._transport.set_protocol(self)

    @classmethod
    def attach(cls, hub: SubscriptionHub, pubsub: Any) -> _Tap | None:
        """A tap on ``pubsub``'s connection (connected, nothing sent on it yet), or ``None``
        when it cannot be read this way."""
        conn = getattr(pubsub, "connection", None)
        if conn is None or not lane_capable(conn):
            return None
        if getattr(getattr(conn, "_reader", None), "_loop", None) is not hub._loop:
            return None  # opened under another event loop: redis-py's way fails, and says so
        return cls(hub, conn)

    async def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds, or until :meth:`nudge`; raise what broke the
        connection meanwhile (or an error reply that is no single subscription's)."""
        if not self.failure.done():
            nudged = self._nudged = self._loop.create_future()
            try:
                await asyncio.wait(
                    (self.failure, nudged), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                self._nudged = None
        if self.failure.done():
            raise self.failure.result()

    def nudge(self) -> None:
        """End the listener's :meth:`wait` now (the hub's last channel went: it closes the
        connection at once, as when it read the unsubscription's confirmation itself)."""
        if self._nudged is not None and not self._nudged.done():
            self._nudged.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if not self.failure.done():
            self.failure.set_result(error)

    def data_received(self, data: bytes) -> None:
        reader, hub = self._reader, self._hub
        self.last_rx = self._loop.time()
        self.received += 1
        try:
            reader.feed(data)
            frame = reader.gets()
            while frame is not False:
                if not self.live:
                    return
                if isinstance(frame, Exception):
                    if not hub._error_reply(frame):  # (one subscription refused: the rest go on)
                        self._fail(frame)
                elif isinstance(frame, list) and len(frame) >= 2:  # (a Push is a list too)
                    self.heard = True
                    kind = _text(frame[0])
                    data_ = frame[2] if kind in _MESSAGES and len(frame) > 2 else None
                    hub._dispatch(kind, _text(frame[1]), data_)
                frame = reader.gets()
        except Exception as exc:  # unreadable: nothing on this connection can be trusted
            self._fail(RedisConnectionError(f"unreadable pub/sub frame: {describe(exc)}"))

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"the pub/sub connection was lost: {describe(exc)}"))
        self._inner.connection_lost(exc)  # redis-py's stream protocol: its close completes

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


@final
class SubscriptionHub:
    """Multiplexes every waiting lock of one runtime over one pub/sub connection."""

    def __init__(
        self,
        make_pubsub: Callable[[], Any],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        *,
        sharded: bool = False,
        serves: Callable[[str], bool] | None = None,
        refresh: Callable[[str], Awaitable[object]] | None = None,
        owns: Callable[[str], Awaitable[bool | None]] | None = None,
    ) -> None:
        self._make_pubsub = make_pubsub
        self._spawn = spawn
        self._sharded = sharded
        # Whether this hub's node still serves a channel, as the client knows it now (a
        # cluster: the slot's primary); None: always.
        self._serves = serves
        # Makes the client look up where a channel's slot lives now (a command through the
        # cluster client): a client that only waits sends nothing that would tell it.
        self._refresh = refresh
        # Asks the node itself whether it serves a channel's slot (None: it cannot tell).
        self._owns = owns
        self._loop = asyncio.get_running_loop()
        self._channels: dict[str, _Channel] = {}
        self._pubsub: Any = None
        self._tap: _Tap | None = None  # reads self._pubsub's connection, where it can
        self._listener: asyncio.Task[None] | None = None
        self._send_lock = asyncio.Lock()
        self._closing = False
        self._generation = 0  # bumped on every reset: a stale send does not reset a new one
        self._emptied: asyncio.Future[None] | None = None
        # What the (un)subscriptions sent on the current connection are still owed, oldest
        # first (None: out of step — frames came that nobody here asked for — until the next
        # connection): an error reply is the oldest one's.
        self._owed: deque[_Owed] | None = deque()
        self.reconnects = 0
        _hubs.add(self)

    # -- the lots ------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """How many local waiters are queued, over all channels."""
        return sum(len(entry.lot) for entry in self._channels.values())

    def waiters(self, channel: str) -> int:
        """How many local waiters are queued on ``channel``."""
        entry = self._channels.get(channel)
        return len(entry.lot) if entry is not None else 0

    def lots(self) -> list[ParkingLot]:
        """Every parking lot (one per subscribed channel)."""
        return [entry.lot for entry in self._channels.values()]

    def lot(self, channel: str, active: int = 1, *, shared: ParkingLot | None = None) -> ParkingLot:
        """The parking lot of ``channel``, created (and its subscription started) if needed.

        ``shared``: the lot to use if the channel is new here (hubs of several servers that
        announce the same lock deliver to one lot). The caller must :meth:`done_with` it when
        its waiter left.
        """
        entry = self._channels.get(channel)
        if entry is None:
            if self._closing:
                raise LockError("the redis client was closed; create a new client to use locks")
            lot = shared if shared is not None else ParkingLot(active)
            entry = self._channels[channel] = _Channel(lot, self._loop)
            self._request(self._subscribe_one(channel))
        else:
            if entry.linger is not None:
                entry.linger.cancel()
                entry.linger = None
            if entry.refused:  # ask again: the server's ACL may allow it now
                entry.refused = False
                entry.confirmed = self._loop.create_future()
                self._request(self._subscribe_one(channel))
        return entry.lot

    def existing_lot(self, channel: str) -> ParkingLot | None:
        """The parking lot of ``channel`` if the channel is subscribed here (no creation)."""
        entry = self._channels.get(channel)
        return entry.lot if entry is not None else None

    def confirmation(self, channel: str) -> asyncio.Future[None]:
        """The future that resolves when ``channel``'s subscription is confirmed (the
        channel's lot must exist; a reset replaces the future once it has resolved)."""
        return self._channels[channel].confirmed

    @property
    def long_lived(self) -> set[asyncio.Task[None]]:
        """The hub's own long-running tasks (the listener), not clean-ups."""
        return set() if self._listener is None else {self._listener}

    def done_with(self, channel: str) -> None:
        """A waiter left ``channel``'s lot: unsubscribe (after a linger) once the lot is empty."""
        entry = self._channels.get(channel)
        if self._emptied is not None and not self._emptied.done() and not self.waiting:
            self._emptied.set_result(None)
        if entry is None or len(entry.lot) or entry.linger is not None:
            return
        if self._closing:
            self._drop(channel)
        else:
            entry.linger = self._loop.call_later(_LINGER, self._expire, channel, entry)

    def _expire(self, channel: str, entry: _Channel) -> None:
        if self._channels.get(channel) is entry and not len(entry.lot):
            self._drop(channel)

    def _drop(self, channel: str) -> None:
        entry = self._channels.pop(channel)
        if entry.linger is not None:
            entry.linger.cancel()
            entry.linger = None
        if not entry.confirmed.done():
            entry.confirmed.cancel()
        if not self._closing:
            self._request(self._unsubscribe_one(channel))
        if not self._channels and self._tap is not None:
            self._tap.nudge()  # the listener closes the connection now

    async def subscribed(self, channel: str, deadline: float | None) -> bool:
        """Wait until ``channel`` is subscribed (the server confirmed it): ``True``, or
        ``False`` when loop time ``deadline`` passed first. The channel's lot must exist."""
        confirmed = self._channels[channel].confirmed
        if not confirmed.done():
            timeout = None if deadline is None else max(0.0, deadline - self._loop.time())
            await asyncio.wait((confirmed,), timeout=timeout)
            if self._closing:
                raise LockError("the redis client was closed; create a new client to use locks")
        # (Also when it was refused before this waiter asked: a waiter queued behind the one
        # that failed with the refusal must not take it for "subscribed" and wait deaf.)
        if confirmed.done() and not confirmed.cancelled() and confirmed.exception() is not None:
            raise LockError(f"cannot wait for a lock: {confirmed.exception()}")
        return confirmed.done()

    def is_subscribed(self, channel: str) -> bool:
        """Whether ``channel``'s subscription is confirmed right now."""
        entry = self._channels.get(channel)
        return entry is not None and entry.confirmed.done()

    def refused(self, channel: str) -> bool:
        """Whether the server refused ``channel``'s latest subscription."""
        entry = self._channels.get(channel)
        return entry is not None and _failed(entry.confirmed)

    # -- sending -------------------------------------------------------------------------------

    def _request(self, coro: Coroutine[Any, Any, None]) -> None:
        self._spawn(coro)
        if self._listener is None or self._listener.done():
            self._listener = self._spawn(self._listen())

    async def _send(self, command: str, *channels: str) -> None:
        """Send a (un)subscription on the current connection; on failure, reset it."""
        async with self._send_lock:
            pubsub, generation = self._pubsub, self._generation
            if pubsub is None or not channels:
                return  # the listener subscribes everything when it connects
            self._asked(channels)
            self._owe(command, channels)
            try:
                await asyncio.wait_for(self._command(pubsub, command, *channels), _SEND_TIMEOUT)
            except _CONNECTION_TROUBLE as exc:
                logger.info("pub/sub %s failed: %s", command, describe(exc))
                if generation == self._generation:
                    await self._reset(f"{command} failed: {describe(exc)}")

    def _owe(self, command: str, channels: tuple[str, ...]) -> None:
        """``command`` (an (un)subscription of one lock: its presence channel, then its channel)
        goes out on the current connection now."""
        if self._owed is not None:
            self._owed.append(_Owed(command in _SUBSCRIBES, channels[-1], channels))

    def _asked(self, channels: tuple[str, ...] | list[str]) -> None:
        now = self._loop.time()
        for channel in channels:
            entry = self._channels.get(channel)
            if entry is not None and not entry.confirmed.done():
                entry.asked_at = now

    def _overdue(self, now: float) -> bool:
        """A subscription sent more than PING_TIMEOUT ago is still unconfirmed."""
        return any(
            entry.asked_at is not None
            and not entry.confirmed.done()
            and now - entry.asked_at > PING_TIMEOUT
            for entry in self._channels.values()
        )

    async def _subscribe_one(self, channel: str) -> None:
        if channel in self._channels:
            await self._send(
                "ssubscribe" if self._sharded else "subscribe", *_with_presence(channel)
            )

    async def _resubscribe(self, channel: str) -> None:
        """The server dropped ``channel``'s shard subscription (an unasked ``SUNSUBSCRIBE``):
        its slot moved to another node (a migration), or this node no longer serves it — a
        primary demoted to a replica by a failover (``CLUSTER FAILOVER``), which stays up and
        accepts the channel again. Subscribed there, the waiters heard releases, but the new
        primary's scripts could not see their process (its presence channel is counted where
        the script runs): their registrations were taken for away, and waiters went unserved
        until their timers (helper-46). So the node itself is asked first (a redirection: it
        no longer serves the slot — the client's map may say otherwise for a while, rebuilt
        from a node that has not heard of the failover yet: helper-47); where it does not, the
        channel is given up and its waiters follow it to the node that does (:meth:`_give_up`;
        their attempts, redirected, teach the client where); else it is subscribed again
        here. When the node cannot tell, the client's map decides, looked up anew."""
        owns = None
        if self._owns is not None:
            try:
                owns = await asyncio.wait_for(self._owns(channel), _SEND_TIMEOUT)
            except Exception as exc:  # (unreachable: a reconnection follows anyway)
                logger.debug("pub/sub: asking the node about %r failed: %s", channel, describe(exc))
        if owns is None and self._refresh is not None:
            try:
                await asyncio.wait_for(self._refresh(channel), _SEND_TIMEOUT)
            except Exception as exc:  # a hint only: the subscription decides (MOVED: _moved)
                logger.debug("pub/sub: slot look-up failed: %s", describe(exc))
        if channel not in self._channels:
            return
        if owns is None:
            owns = self._serves is None or self._serves(channel)
        if not owns:
            self._give_up([channel], "its slot is served by another node now")
            return
        await self._subscribe_one(channel)

    async def _unsubscribe_one(self, channel: str) -> None:
        if channel not in self._channels:
            await self._send(
                "sunsubscribe" if self._sharded else "unsubscribe", *_with_presence(channel)
            )

    async def _reset(self, reason: str, *, stale: bool = False) -> None:
        """Drop the connection: every channel waits for a new confirmation; the listener
        reconnects. ``stale``: the connection was opened under an earlier event loop (the
        client is used under a new one): expected, and said only at debug level."""
        if self._pubsub is None:
            return
        self._generation += 1
        self.reconnects += 1
        pubsub, self._pubsub = self._pubsub, None
        self._untap()
        if stale:
            logger.debug("pub/sub connection of an earlier event loop dropped; reconnecting")
        else:
            logger.warning("pub/sub connection dropped (%s); reconnecting", reason)
        for entry in self._channels.values():
            entry.asked_at = None
            entry.refused = False  # (asked again on the new connection)
            if entry.confirmed.done():
                entry.confirmed = self._loop.create_future()
        self._spawn(_close_quietly(pubsub))

    # -- listening -----------------------------------------------------------------------------

    async def _connect(self) -> None:
        """Open a connection and subscribe every channel on it, one lock per command (the
        server refuses a command whole: an ACL that refuses one lock's channel must not keep
        the others from being subscribed; and one ``SSUBSCRIBE`` may only name channels of
        one slot). Channels added meanwhile are sent by their own requests, which wait for the
        send lock."""
        async with self._send_lock:
            pubsub = self._make_pubsub()
            pairs = [_with_presence(channel) for channel in self._channels]
            command = "ssubscribe" if self._sharded else "subscribe"
            try:
                # Connected first, and tapped before anything is sent: no confirmation may
                # reach redis-py's buffer, where nobody would read it.
                await asyncio.wait_for(pubsub.connect(), _SEND_TIMEOUT)
                self._owed = deque()
                self._tap = _Tap.attach(self, pubsub)
                self._asked(list(self._channels))
                await asyncio.wait_for(self._subscribe_all(pubsub, command, pairs), _SEND_TIMEOUT)
            except BaseException:
                self._untap()
                self._spawn(_close_quietly(pubsub))
                raise
            self._pubsub = pubsub

    async def _subscribe_all(self, pubsub: Any, command: str, pairs: list[tuple[str, str]]) -> None:
        for pair in pairs:
            self._owe(command, pair)
            await self._command(pubsub, command, *pair)

    def _command(self, pubsub: Any, command: str, *args: str) -> Awaitable[object]:
        """Send ``command`` (``subscribe``, ``sunsubscribe``, ``ping``...) on ``pubsub``'s
        connection. A tapped one gets it as is: through the ``PubSub`` object, redis-py would
        keep a record of every channel that only its own reader prunes (a leak, with the tap
        reading), and on a reconnection of its own subscribe them all again on a connection
        nobody reads — the hub reconnects by itself."""
        tap = self._tap
        wire = map(_wire, args)
        if tap is not None and tap.conn is pubsub.connection:
            return tap.conn.send_command(command.upper(), *wire, check_health=False)  # type: ignore[no-any-return]
        return getattr(pubsub, command)(*wire)  # type: ignore[no-any-return]

    def _untap(self) -> None:
        """What the current tap reads from now on is not acted on (its connection goes)."""
        tap, self._tap = self._tap, None
        if tap is not None:
            tap.live = False

    def _error_reply(self, exc: BaseException) -> bool:
        """An error reply read on the connection: ``True`` when it was one (un)subscription's
        and was dealt with here — the stream stays in step (a command is refused whole, with
        one error reply), so the connection and its other channels go on. A channel's refusal
        (``NOPERM``: the user's ACL does not allow it) fails only that lock's waiters; a shard
        channel's ``MOVED``/``ASK`` gives up the channels of its slot (:meth:`_moved`)."""
        owed = self._owed
        head = owed[0] if owed else None
        if isinstance(exc, AskError) and self._sharded:
            if head is not None and head.subscribe and key_slot(head.channel) == exc.slot_id:
                owed.popleft()  # type: ignore[union-attr]
            else:
                self._owed = None
            self._moved(exc.slot_id)
            return True
        if (
            head is None
            or not head.subscribe
            or not isinstance(exc, ResponseError)
            or "channel" not in str(exc).lower()
        ):
            return False  # (no subscription's: a refused PING, a user who may not subscribe)
        owed.popleft()  # type: ignore[union-attr]
        self._refuse(head.channel, exc)
        return True

    def _settle(self, kind: str, channel: str) -> None:
        """A confirmation frame (``subscribe``, ``unsubscribe``... of ``channel``) came."""
        owed = self._owed
        head = owed[0] if owed else None
        if head is not None and (kind in _SUBSCRIBES) == head.subscribe and channel in head.frames:
            head.frames.discard(channel)
            if not head.frames:
                owed.popleft()  # type: ignore[union-attr]
        elif kind != "sunsubscribe":  # (the server's own, unasked: its slot moved)
            # Nobody here asked for it (redis-py re-subscribed by itself): an error reply can
            # no longer be told whose it is, until the next connection.
            self._owed = None

    def _refuse(self, channel: str, exc: ResponseError) -> None:
        """The server refused ``channel``'s subscription: the waiters that wait for its
        confirmation fail with the reason; the next waiter of the lock asks again."""
        entry = self._channels.get(channel)
        if entry is None:
            return
        logger.warning("pub/sub: the server refused to subscribe %r: %s", channel, exc)
        entry.asked_at = None
        entry.refused = True
        if entry.confirmed.done():
            entry.confirmed = self._loop.create_future()
        entry.confirmed.set_exception(
            LockError(f"the server refused to subscribe {channel!r}: {exc}")
        )
        entry.confirmed.exception()  # retrieved here: no waiter may be left to read it
        # Waiters asleep on an earlier confirmation (a re-subscription after a reconnection
        # refused: the user lost the channel meanwhile) would wait deaf: they re-check, and
        # fail with the reason (LockBase._wait_as asks the hub when it was refused).
        entry.lot.recheck_all()

    def _refused(self, exc: ResponseError) -> None:
        """The server refused a subscription, and it cannot be told which (a user who may not
        subscribe at all, or frames out of step): the waiters of every unconfirmed channel fail
        with the reason instead of waiting blind."""
        for channel, entry in self._channels.items():
            if not entry.confirmed.done():
                entry.confirmed.set_exception(
                    LockError(f"the server refused to subscribe {channel!r}: {exc}")
                )
                entry.confirmed.exception()  # retrieved here: no waiter may be left to read it
                entry.lot.recheck_all()  # (see _refuse)

    def _moved(self, slot: int) -> None:
        """The node refused a shard channel's subscription with ``MOVED``/``ASK``: ``slot``
        now lives on another node (a slot migration). Not a refusal: the channels of that slot
        are given up here (:meth:`_give_up`) — subscribing them again on this node would be
        refused for ever. The connection and its other channels go on (an error reply leaves
        the stream in step)."""
        self._give_up([c for c in self._channels if key_slot(c) == slot], f"slot {slot} moved")

    async def _relocate(self) -> None:
        """The node cannot be reached: give up the channels the client knows to be served by
        another node now (its replica was promoted) — their waiters follow them there. The
        client is first made to look the slot up (one command through it), as a client that
        only waits would otherwise go on naming the dead node."""
        serves = self._serves
        if serves is None or not self._channels:
            return
        if self._refresh is not None:
            try:
                await asyncio.wait_for(self._refresh(next(iter(self._channels))), _SEND_TIMEOUT)
            except Exception as exc:  # the node is down: errors are expected, and only a hint
                logger.debug("pub/sub: slot look-up failed: %s", describe(exc))
        self._give_up([c for c in self._channels if not serves(c)], "node replaced")

    def _give_up(self, channels: list[str], why: str) -> None:
        """Stop serving ``channels`` here: their waiters re-check at once (their attempt goes
        where the channel's slot lives now), then move their lot to that node's hub
        (``LockBase._follow``) — or, if the client does not know the new node yet, re-check
        every ``ORPHAN_RECHECK`` seconds until it does."""
        for channel in channels:
            entry = self._channels.pop(channel)
            if entry.linger is not None:
                entry.linger.cancel()
            if not entry.confirmed.done():
                entry.confirmed.set_result(None)  # a waiter of it goes on to its attempt
            logger.info("pub/sub: %r given up on this node (%s)", channel, why)
            entry.lot.recheck_all()

    async def _listen(self) -> None:
        loop = self._loop
        failures = 0
        heard = False  # anything received on the current connection
        last_rx = loop.time()
        ping_sent: float | None = None
        seen = 0  # reads of the tap on the current connection already taken into account
        while self._channels and not self._closing:
            pubsub = self._pubsub
            if pubsub is None:
                try:
                    await self._connect()
                except _CONNECTION_TROUBLE as exc:
                    await self._relocate()
                    delay = _RECONNECT_BACKOFF[min(failures, len(_RECONNECT_BACKOFF) - 1)]
                    failures += 1
                    logger.info(
                        "pub/sub connect failed (%s); retrying in %.2fs", describe(exc), delay
                    )
                    await asyncio.sleep(delay)
                    continue
                last_rx, ping_sent, heard, seen = loop.time(), None, False, 0
                continue
            tap = self._tap
            try:
                if tap is not None:
                    # (Messages were acted on as they came, in the tap's callback.)
                    await tap.wait(_READ_SLICE)
                    message = None
                    arrived, seen = tap.received != seen, tap.received
                else:
                    message = await _read(pubsub)
                    arrived = message is not None
            except _CONNECTION_TROUBLE as exc:
                # (An error reply alone is not "heard": a refused subscription backs off.)
                heard = heard or (tap is not None and tap.heard)
                if tap is None and self._error_reply(exc):
                    # A refusal of one subscription (an ACL, or its slot moved away), read on
                    # a healthy connection: the other channels go on. (The tap deals with
                    # error replies as they come.)
                    continue
                if isinstance(exc, ResponseError):
                    self._refused(exc)
                await self._reset(f"{describe(exc)}", stale=not heard and _of_another_loop(exc))
                if not heard:
                    # Failed before a single confirmation: back off, or a refused
                    # subscription would reconnect in a hot loop.
                    delay = _RECONNECT_BACKOFF[min(failures, len(_RECONNECT_BACKOFF) - 1)]
                    failures += 1
                    await asyncio.sleep(delay)
                continue
            now = loop.time()
            if self._overdue(now):
                await self._reset(f"a subscription went unconfirmed for {PING_TIMEOUT} s")
                continue
            if arrived:
                failures = 0
                last_rx, ping_sent, heard = now if tap is None else tap.last_rx, None, True
                if message is not None and self._dispatch(
                    _text(message.get("type")),
                    _channel_text(message.get("channel"), pubsub),
                    message.get("data"),
                ):
                    # Let the waiter that was just handed the lock run before this task goes
                    # back into redis-py: the hand-over's latency is the waiter's, not ours.
                    await asyncio.sleep(0)
                continue
            if ping_sent is not None:
                if now - ping_sent > PING_TIMEOUT:
                    await self._reset(f"no answer to PING within {PING_TIMEOUT} s")
                continue
            if now - last_rx >= PING_AFTER:
                ping_sent = now
                try:
                    await asyncio.wait_for(self._command(pubsub, "ping", _PING_TEXT), _SEND_TIMEOUT)
                except _CONNECTION_TROUBLE as exc:
                    await self._reset(f"PING failed: {describe(exc)}")
        self._listener = None
        if not self._closing:
            self._retire()

    def _retire(self) -> None:
        """No channel is left (the last one's linger ended): close the connection; the next
        wait opens one. An idle hub keeps no connection open — nor does a client the
        application dropped without closing it, or whose pool it disconnected."""
        pubsub, self._pubsub = self._pubsub, None
        self._untap()
        if pubsub is not None:
            self._generation += 1  # a send still under way on it does not reset the next one
            self._spawn(_close_quietly(pubsub))

    def _dispatch(self, kind: str, channel: str, data: object) -> bool:
        """Act on one pub/sub message (``kind``: ``message``, ``subscribe``...; ``data``: a
        message's payload); ``True`` when it handed a lock to a local waiter."""
        entry = self._channels.get(channel)
        if kind in _MESSAGES:
            return entry is not None and entry.lot.deliver(
                decode(data if isinstance(data, (bytes, str)) else b"")
            )
        if kind in _CONFIRMATIONS and self._owed is not None:
            self._settle(kind, channel)
        if entry is None:
            return False
        if kind in ("subscribe", "ssubscribe"):
            if entry.confirmed.done():
                entry.lot.recheck_all()  # re-subscribed by redis-py: messages may be lost
            else:
                entry.confirmed.set_result(None)
                entry.asked_at = None
                entry.lot.recheck_all()
        elif kind == "sunsubscribe" and self._sharded:
            # the server dropped it: the slot moved, or this node was demoted (see _resubscribe)
            entry.confirmed = self._loop.create_future()
            self._request(self._resubscribe(channel))
        return False

    # -- closing -------------------------------------------------------------------------------

    async def wait_empty(self, timeout: float) -> None:
        """Return once no waiter is queued, or after ``timeout`` seconds."""
        if self.waiting:
            self._emptied = self._loop.create_future()
            await asyncio.wait((self._emptied,), timeout=timeout)

    def wake_all(self) -> None:
        """Wake every local waiter (the runtime is closing)."""
        for entry in self._channels.values():
            entry.lot.wake_all()

    async def aclose(self) -> None:
        """Stop listening and close the pub/sub connection."""
        self._closing = True
        for entry in self._channels.values():
            if entry.linger is not None:
                entry.linger.cancel()
                entry.linger = None
            if not entry.confirmed.done():
                entry.confirmed.cancel()
        self.wake_all()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        pubsub, self._pubsub = self._pubsub, None
        self._untap()
        if pubsub is not None:
            await _close_quietly(pubsub)


_hubs: weakref.WeakSet[SubscriptionHub] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a child forked from this process: point this copy of every hub's pub/sub socket at
    ``/dev/null`` (nothing is sent; the parent's connection is untouched). Otherwise the
    child's copy keeps the connection — and the parent's presence — alive after the parent
    died, and each of its waiters would cost a claim window. The file descriptor stays valid
    (``dup2``), so whatever later closes it in the child closes ``/dev/null``, not a file the
    child opened meanwhile. (An event loop does not survive a fork: the child never uses
    these connections.)"""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    try:
        for hub in list(_hubs):
            fd = _socket_fd(hub._pubsub)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.dup2(null, fd)
    finally:
        os.close(null)


def _socket_fd(pubsub: Any) -> int | None:
    """The file descriptor of ``pubsub``'s connection, if it has an open one."""
    try:
        transport = pubsub.connection._writer.transport
        sock = transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
    except (AttributeError, OSError):
        return None
    return fd if fd >= 0 else None


if hasattr(os, "register_at_fork"):  # pragma: no branch - POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Pools that a pool of the subscriptions' own is made like (from their connection class and
# settings): redis-py's plain kinds. A subclass's or a Sentinel's may add what a copy would lose.
_PLAIN_POOLS: Final = (ConnectionPool, BlockingConnectionPool)


@final
class Subscriptions:
    """Where the subscriptions of one server's hub get their pub/sub connection: a pool of
    their own, made like the client's (same connection class and settings), so that the one
    long-lived subscription never takes a connection of the client's pool from the client's
    commands — on a pool of ``max_connections=1``, or one the application keeps busy, it took
    the last one for good and every command of the client was stuck behind it. A client whose
    pool is not of redis-py's plain kinds (a Sentinel's, a subclass) subscribes through its
    own pool (:func:`subscription_refusal` says when that cannot work)."""

    __slots__ = ("_client_of", "_pool")

    def __init__(self, client_of: Callable[[], Any]) -> None:
        self._client_of = client_of
        self._pool: ConnectionPool | None = None

    def pubsub(self) -> Any:
        """A new pub/sub object (its connection is made when it first subscribes)."""
        client = self._client_of()
        if self._pool is None:
            pool = getattr(client, "connection_pool", None)
            if pool is None or type(pool) not in _PLAIN_POOLS:
                return client.pubsub()
            # Frames as bytes, whatever the client decodes: a channel name is UTF-8 (``_keys``),
            # which the client's encoding may not decode (``ascii``, ``cp1252``: redis-py's
            # subscribe() and its parser fail on it, and every reconnection failed with them).
            kwargs = {**pool.connection_kwargs, "decode_responses": False}
            self._pool = ConnectionPool(connection_class=pool.connection_class, **kwargs)
        return PubSub(self._pool)

    async def aclose(self) -> None:
        """Close the pool of the subscriptions' own (the hub closed its pub/sub first)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):  # a connection of a closed event loop
                await pool.disconnect()


def subscription_refusal(client: Any) -> str | None:
    """Why no task may wait through ``client`` (``None``: it may): its subscriptions go
    through its own pool (:class:`Subscriptions`), and that pool allows a single connection —
    the subscription would take it for good, and every command of the client would be stuck
    behind it."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or type(pool) in _PLAIN_POOLS:
        return None
    limit = getattr(pool, "max_connections", None)
    if isinstance(limit, int) and limit < 2:
        return (
            f"the client's connection pool allows {limit} connection, and waiting needs one "
            "for the pub/sub subscription that announces releases besides those for commands: "
            "give the pool max_connections >= 2 (a try, blocking=False, needs no subscription)"
        )
    return None


async def _close_quietly(pubsub: Any) -> None:
    try:
        await asyncio.wait_for(pubsub.aclose(), _SEND_TIMEOUT)
    except Exception as exc:  # a broken connection, or one of a closed event loop: let it go
        logger.debug("closing a pub/sub connection failed: %s", describe(exc))
