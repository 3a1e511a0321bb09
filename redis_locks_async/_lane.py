"""The pipelined lane: one pooled connection that carries the script calls of every task at once.

On a busy client (many tasks taking and releasing locks) each script call through
:func:`._wire.run_script` used to take a pooled connection of its own: one ``send`` and one
``recv`` per command, and once the pool ran short, a queue on the pool's condition. A lane
instead *pipelines*: every call writes its packed command on the same connection, in the order
the calls were made, and the replies, which Redis sends in that same order, are matched to
the calls first in, first out. Commands written while earlier ones are unanswered are gathered
and written together once per event-loop iteration, so a burst of tasks costs a few system
calls, not two per command; a lone call is written at once.

How the connection is used: a connection of the client's own pool is taken (connected,
authenticated, database selected: redis-py's handshake), and its transport is given a protocol
of this module's that feeds the bytes received to a ``hiredis`` reader and hands each reply to
its caller's future from within the event loop's callback — no reader task, no per-read
timeout scope. The connection stays in the pool's "in use" set while the lane has it; the lane
gives it back (the stream protocol restored, fit for redis-py's own use) after :data:`IDLE`
seconds without a call, or as soon as nothing is owed on it when the pool has no other
connection to give. A lane whose oldest call waits longer than :data:`STALL` takes no new calls
(they open another lane) and goes once nothing it owes is awaited.

What is kept of redis-py's contract (see :mod:`._wire`): errors arrive as redis-py's exceptions
(``NOSCRIPT`` as ``NoScriptError``, ``WRONGTYPE`` as ``ResponseError``); the client's
``socket_timeout`` bounds the wait for the oldest unanswered reply (a lane that stops answering
fails every call on it with ``TimeoutError``, and is closed); a connection that breaks fails
every call on it with ``ConnectionError`` — the callers' ``Retry`` retries them on a new lane,
which is safe because every script is idempotent. A call that is cancelled gives up its future
only; its reply, when it comes, is read and dropped, so the connection stays usable and in step
— nobody ever reads another call's reply.

A lane is used only where :func:`._wire.fast_pool` already takes the short way, with RESP2 (or
RESP3 with a hiredis that tells push messages from replies) and without a health-check
interval; otherwise the calls keep the short way's per-call connections.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Final, final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._errors import describe

try:
    import hiredis
except ImportError:  # pragma: no cover - redis[hiredis] is a dependency
    _Push: Any = None
    _READER: Any = None
else:
    # A RESP3 push message (hiredis >= 3.2 tells it from a reply); without that type, RESP3
    # connections get no lane.
    _Push = getattr(hiredis, "PushNotification", None)
    _READER = hiredis.Reader

__all__ = ("IDLE", "Lane", "lane_capable", "lane_possible", "reply_reader")

IDLE: Final = 0.25
"""Seconds without a call after which a lane gives its connection back to the pool (at once,
when the pool has no connection left to give: see :func:`._wire.crowded`)."""

STALL: Final = 0.1
"""Seconds the oldest unanswered call of a lane may wait before new calls stop joining it (a
lane whose connection went silent — a half-open TCP connection, a hung proxy — must not hold
up every later call of the process): the next call opens a new lane, and the stalled one
serves the calls already on it until they are answered or nobody waits for them any more."""

_TICK: Final = 0.1  # the soonest a lane's timer re-arms (never a busy loop)


def lane_possible(protocol: object) -> bool:
    """Lanes can be had for connections speaking RESP ``protocol`` (``hiredis`` reads the
    replies; RESP3 push messages need a hiredis that tells them from replies)."""
    if protocol in (None, 2, "2"):
        return _READER is not None
    return protocol in (3, "3") and _Push is not None


def reply_reader(conn: Any, *, decoded: bool = True) -> Any:
    """A ``hiredis`` reader that parses what ``conn`` (connected) receives as redis-py's own
    parser would: its error classes (``NOSCRIPT`` as ``NoScriptError``, ``MOVED`` as
    ``MovedError``), and its decoding unless ``decoded`` is false (bytes, whatever the
    client's ``decode_responses``)."""
    encoder = conn.encoder
    options: dict[str, Any] = {
        "protocolError": InvalidResponse,
        "replyError": conn._parser.parse_error,
        "errors": encoder.encoding_errors,
    }
    if decoded and encoder.decode_responses:
        options["encoding"] = encoder.encoding
    return _READER(**options)


def lane_capable(conn: Any) -> bool:
    """``conn`` (connected) can carry a lane: a protocol hiredis reads here, no health checks,
    a transport whose protocol can be swapped."""
    writer = getattr(conn, "_writer", None)
    transport = getattr(writer, "transport", None)
    return (
        lane_possible(getattr(conn, "protocol", 2))
        and not getattr(conn, "health_check_interval", 0)
        and transport is not None
        and hasattr(transport, "set_protocol")
        and not transport.is_closing()
    )


@final
class Lane(asyncio.Protocol):
    """One pipelined connection: calls in, replies out in the same order."""

    def __init__(
        self, conn: Any, loop: asyncio.AbstractEventLoop, crowded: Callable[[], bool]
    ) -> None:
        self.conn = conn
        self._crowded = crowded  # the pool needs the connection back as soon as it is free
        self.loop = loop
        self.closed: BaseException | None = None
        self.retired = False  # closed with nothing owed: the connection is fit for reuse
        self.demoted = False  # stalled: takes no new calls, closes once nothing is owed
        self._transport: Any = conn._writer.transport
        self._inner: asyncio.BaseProtocol = self._transport.get_protocol()
        self._reader = reply_reader(conn)
        self._pending: deque[asyncio.Future[object]] = deque()
        self._gathered: list[bytes] = []
        self._timeout: float | None = conn.socket_timeout
        self._touched = self._progress = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._on_close: list[Any] = []
        self._transport.set_protocol(self)
        self._arm(self._touched)

    # -- calls -------------------------------------------------------------------------------

    def call(self, packed: bytes) -> asyncio.Future[object]:
        """Send ``packed`` (one RESP command); the future gets its reply (or error)."""
        if self.closed is not None:
            raise _closed_error(self.closed)
        future: asyncio.Future[object] = self.loop.create_future()
        now = self.loop.time()
        if self._pending:
            if not self._gathered:
                self.loop.call_soon(self._flush)
            self._gathered.append(packed)
        else:
            self._progress = now
            self._transport.write(packed)
            timer, timeout = self._timer, self._timeout
            if timeout is not None and timer is not None and timer.when() > now + timeout:
                timer.cancel()
                self._timer = self.loop.call_at(now + timeout, self._check)
        self._touched = now
        self._pending.append(future)
        return future

    def stalled(self, now: float) -> bool:
        """The oldest unanswered call has waited longer than :data:`STALL`."""
        return bool(self._pending) and now - self._progress > STALL

    def demote(self) -> None:
        """Take no new calls: serve the ones already sent, then go (see :data:`STALL`)."""
        self.demoted = True
        if self._timer is not None:
            self._timer.cancel()
        self._arm(self.loop.time())

    def _flush(self) -> None:
        gathered, self._gathered = self._gathered, []
        if gathered and self.closed is None:
            self._transport.write(b"".join(gathered))

    # -- protocol ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        pending = self._pending
        try:
            reader.feed(data)
            reply = reader.gets()
            while reply is not False:
                if _Push is not None and isinstance(reply, _Push):
                    # Not a reply (a server's maintenance notice, say): nothing waits for it.
                    reply = reader.gets()
                    continue
                if not pending:
                    raise InvalidResponse(f"a reply nobody asked for: {reply!r}")
                future = pending.popleft()
                if not future.done():
                    # An error reply is an exception object (redis-py's parse_error): a
                    # ResponseError, or a ConnectionError kind (LOADING: BusyLoadingError,
                    # which the client's Retry retries) — never a value.
                    if isinstance(reply, Exception):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
                reply = reader.gets()
        except Exception as exc:  # a protocol error: nothing on this connection can be trusted
            self._fail(RedisConnectionError(f"unreadable reply on the lane: {describe(exc)}"))
            return
        self._progress = self.loop.time()
        if not pending and (self.demoted or self._crowded()):
            self.retire()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"the lane's connection was lost: {describe(exc)}"))
        # redis-py's stream protocol waits for this to finish a disconnect() of the connection.
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- ends --------------------------------------------------------------------------------

    def on_close(self, callback: Any) -> None:
        """``callback(lane)`` once the lane is closed (for whatever reason)."""
        self._on_close.append(callback)

    def _fail(self, error: BaseException) -> None:
        if self.closed is not None:
            return
        self.closed = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, deque()
        self._gathered = []
        for future in pending:
            if not future.done():
                future.set_exception(_closed_error(error))
        if not self._transport.is_closing():
            self._transport.abort()
        for callback in self._on_close:
            callback(self)

    def retire(self) -> bool:
        """Give the connection back unbroken, if nothing is owed on it: the stream protocol is
        put back, so redis-py can use the connection as before. ``False``: calls are in flight."""
        if self.closed is not None:
            return True
        if self._pending or self._reader.has_data():
            return False
        self.closed = RedisConnectionError("the lane was retired")
        self.retired = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.set_protocol(self._inner)
        for callback in self._on_close:
            callback(self)
        return True

    def _arm(self, now: float) -> None:
        if self._pending:
            limit = IDLE if self._timeout is None else self._timeout
            if self.demoted:
                limit = min(limit, STALL)
            at = self._progress + limit
        else:
            at = self._touched + IDLE
        self._timer = self.loop.call_at(max(at, now + _TICK), self._check)

    def _check(self) -> None:
        self._timer = None
        if self.closed is not None:
            return
        now = self.loop.time()
        pending = self._pending
        if pending:
            overdue = now - self._progress
            if self._timeout is not None and overdue >= self._timeout:
                self._fail(RedisTimeoutError(f"Timeout reading from {self.conn._host_error()}"))
                return
            if self.demoted and overdue >= STALL and all(f.done() for f in pending):
                # Stalled, and nobody waits for what is owed: the connection goes.
                self._fail(RedisConnectionError("the lane stalled"))
                return
        elif (self.demoted or now - self._touched >= IDLE) and self.retire():
            return
        self._arm(now)


def _closed_error(error: BaseException) -> BaseException:
    """A fresh exception of ``error``'s kind for one caller (an exception object is not
    shared between futures: each raise would grow its traceback)."""
    if isinstance(error, RedisTimeoutError):
        return RedisTimeoutError(*error.args)
    return RedisConnectionError(*error.args)
