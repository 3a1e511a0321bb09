"""The script calls' short way to the server: one pooled connection, no per-command layers.

Every script call of the library is an ``EVALSHA`` whose reply is a short array of integers.
Through ``Redis.execute_command`` each one also pays for redis-py's general machinery: packing
through the encoder, the pool's lock and its stale-connection probe, observability records,
and — on Python ≤ 3.11 with a ``socket_timeout`` — a task per write (``asyncio.wait_for``).
On the uncontended acquire + release that is about a fifth of the cycle (``benchmarks/``, B1).

:func:`run_script` sends the packed command itself on a connection it takes from the pool of a
*plain* client, and keeps what matters of redis-py's contract:

- the client's own ``Retry`` (its errors and backoff; the connection is dropped before each
  retry) — every script is idempotent, which is what makes that retry safe at all;
- the client's ``socket_timeout`` on the reply (the read), a dropped connection on any error or
  cancellation while a reply is owed (a reused connection never reads someone else's reply);
- the pool's bookkeeping (the connection is marked in use and returned, or dropped when the
  server asked for a reconnection);
- replies and errors parsed by the connection's own parser (``NOSCRIPT``, ``WRONGTYPE`` arrive
  as the same exceptions).

What it leaves out, and why that is safe here: the write is not awaited (the command is a few
hundred bytes; the read that follows is bounded by ``socket_timeout``, so a server that stops
reading fails it like one that stops answering), and a connection is not probed for unread data
before use (redis-py drops a connection whenever a reply may be left unread). A connection class
of the application's that overrides how commands are packed, sent or read (a meter, a tracer) is
used through those methods, so it sees every command.

Anything else takes redis-py's way, unchanged: a client whose ``execute_command`` or
``evalsha`` is wrapped or overridden (tracing instrumentation, a subclass, a patch), redis-py's
own metrics turned on, a cluster or Sentinel client, a pipeline, a single-connection client, a
pool of another class than ``ConnectionPool`` and ``BlockingConnectionPool``, a credential
provider, or a redis-py whose internals do not look as expected.
:func:`fast_pool` decides on every call (what depends only on the pool, once per pool).

A call that finds no idle connection in the pool (a fresh client, or every connection busy:
many tasks at once), or tasks queued for one, joins the pool's pipelined *lane* (:mod:`._lane`):
one connection that carries every such call at once, replies matched first in, first out — a
busy process then costs a few system calls per event-loop iteration instead of a connection, a
``send`` and a ``recv`` per call. A lone call on a quiet pool keeps an idle connection of its
own. Where no lane can be had (a connection class that observes commands, a health-check
interval, no connection to open one on), the connection comes from the pool's own
``get_connection()`` (redis-py opens one, waits for one — a ``BlockingConnectionPool``'s queue
keeps its order — or raises ``MaxConnectionsError``) and goes back through its ``release()``.

The lease keeper's batches take a short way too: :func:`run_pipeline` writes one request, reads
its replies here and gives the event loop a step every :data:`PIPELINE_STEP` commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import types
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, cast, final

import redis
from redis.asyncio.client import Pipeline, Redis
from redis.asyncio.connection import (
    BlockingConnectionPool,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._errors import describe
from ._lane import Lane, lane_capable, lane_possible

try:
    from redis.asyncio.observability import recorder as _recorder
except ImportError:  # pragma: no cover - redis-py without its own metrics
    _recorder = None  # type: ignore[assignment]

__all__ = (
    "TORN_DOWN",
    "FastPool",
    "connection_failed",
    "drop_connection",
    "drop_stale_client",
    "drop_stale_connections",
    "fast_batches",
    "fast_pool",
    "forget_foreign",
    "loop_error",
    "never_sent",
    "run_pipeline",
    "run_script",
)

TORN_DOWN: Final = (AttributeError, TypeError)
"""What asyncio raises for a transport torn down under a read or write (``pool.disconnect()``
meanwhile; ``TypeError`` on Python 3.13), and redis-py lets through: a connection failure."""

_PLAIN_CONNECTIONS: Final = (Connection, SSLConnection, UnixDomainSocketConnection)

Keys = tuple[str | bytes, ...]
Args = Sequence[str | int | float | bytes]
LANE_OPEN_PATIENCE: Final = 2.0
"""Seconds a lane's connection may take to connect and answer its handshake when the client
sets no socket timeouts (else their sum, if longer): a server that accepts the connection but
never answers (a silent network, a paused server) would keep the opener — and every call
awaiting it — for ever, past the client's close. Past it the calls go on without a lane, each
on a connection of its own under its caller's deadline."""

PIPELINE_STEP: Final = 100
"""Commands packed, and replies read, per event-loop step in :func:`run_pipeline`."""
_HEADS_MAX: Final = 4096  # cached command heads per pool (one per script and lock, typically)
_REDIS_PACKAGE: Final = os.path.dirname(redis.__file__) + os.sep
_OWN: dict[Any, bool] = {}  # a command method -> it is redis-py's own (not a wrapper)


def _redis_own(method: object) -> bool:
    """``method`` is a function of redis-py itself, not a wrapper put in its place (a
    tracer's instrumentation, a subclass's override, a test's patch)."""
    known = _OWN.get(method)
    if known is None:
        code = getattr(method, "__code__", None)
        known = (
            type(method) is types.FunctionType
            and code is not None
            and code.co_filename.startswith(_REDIS_PACKAGE)
        )
        if len(_OWN) < 64:
            _OWN[method] = known
    return known


@final
class FastPool:
    """A pool :func:`run_script` may use, with its clients' string encoding and the packed
    heads (``EVALSHA sha numkeys keys…``) of the script calls sent through it."""

    __slots__ = (
        "condition",
        "encoding",
        "errors",
        "failure",
        "heads",
        "lane",
        "laned",
        "opening",
        "pool",
        "raw",
        "retry",
    )

    def __init__(self, pool: ConnectionPool) -> None:
        kwargs = pool.connection_kwargs
        self.pool = pool
        # A BlockingConnectionPool's tasks waiting for a connection, told when one comes back.
        self.condition: asyncio.Condition | None = getattr(pool, "_condition", None)
        # A connection class that overrides how commands are packed, sent or read (a meter, a
        # tracer at connection level) is used through those methods; only redis-py's own is
        # written to directly.
        self.raw = all(
            _redis_own(getattr(pool.connection_class, method, None))
            for method in ("pack_command", "send_packed_command", "read_response")
        )
        self.encoding: str = kwargs.get("encoding", "utf-8")
        self.errors: str = kwargs.get("encoding_errors", "strict")
        self.heads: dict[tuple[str, tuple[str | bytes, ...]], bytes] = {}
        # The pipelined lane (see ._lane): where the pool's connections allow one.
        self.laned = (
            self.raw
            and lane_possible(kwargs.get("protocol"))
            and not kwargs.get("health_check_interval")
        )
        self.lane: Lane | None = None
        self.opening: asyncio.Future[Lane | None] | None = None
        self.retry: Any = None
        # The last connection error a call through this pool met (under its Retry, which
        # hides it while it retries) and the loop time it came: what "no reply within …"
        # messages name (recent_failure).
        self.failure: tuple[BaseException, float] | None = None

    async def failed(self, error: BaseException) -> None:
        """The Retry's hook between tries of a lane call: the error is recorded; nothing is
        undone (a failed lane has closed itself, and a lane that failed to open has given its
        connection back)."""
        self.failure = (error, asyncio.get_running_loop().time())

    def pack(
        self, sha: str, keys: Keys, args: Args, code: bytes | None = None, *, cache: bool = True
    ) -> bytes:
        """``EVALSHA sha len(keys) *keys *args`` as one RESP command, strings encoded as the
        pool's clients encode them (``EVAL code …`` when ``code`` is given). The head is kept
        for the next call unless ``cache`` is false (a batch of thousands of locks' renewals
        would only push out the heads of the locks acquired and released again and again)."""
        if code is not None:
            loading = self._bulk((b"EVAL", code, len(keys), *keys))
            return b"*%d\r\n%b%b" % (3 + len(keys) + len(args), loading, self._bulk(args))
        head = self.heads.get((sha, keys))
        if head is None:
            head = self._bulk((b"EVALSHA", sha.encode("ascii"), len(keys), *keys))  # as redis-py
            if cache:
                if len(self.heads) >= _HEADS_MAX:
                    self.heads.clear()
                self.heads[(sha, keys)] = head
        return b"*%d\r\n%b%b" % (3 + len(keys) + len(args), head, self._bulk(args))

    def _bulk(self, parts: Args) -> bytes:
        out = []
        encoding, errors = self.encoding, self.errors
        for part in parts:
            # The exact types first (what the scripts' arguments are), then their subclasses.
            if type(part) is str:
                data = part.encode(encoding, errors)
            elif type(part) is int:
                data = b"%d" % part
            elif isinstance(part, bytes):
                data = part
            elif isinstance(part, str):
                data = part.encode(encoding, errors)
            elif isinstance(part, bool):  # redis-py refuses it too
                raise TypeError(f"cannot send a bool to Redis: {part!r}")
            else:
                data = repr(part).encode()
            out.append(b"$%d\r\n%b\r\n" % (len(data), data))
        return b"".join(out)


# Where a pool keeps what fast_pool() found out about it: on the pool itself, so that the two
# go together (a weak mapping from the pool to a FastPool, which refers to the pool, kept every
# pool ever used alive, with its connections).
_FAST: Final = "_redis_locks_async_fast"
_UNKNOWN: Final = object()


def _qualifies(pool: ConnectionPool) -> bool:
    kwargs = getattr(pool, "connection_kwargs", None)
    blocking = type(pool) is BlockingConnectionPool
    return (
        (type(pool) is ConnectionPool or blocking)
        and (not blocking or isinstance(getattr(pool, "_condition", None), asyncio.Condition))
        and issubclass(pool.connection_class, _PLAIN_CONNECTIONS)
        and isinstance(getattr(pool, "_available_connections", None), list)
        and isinstance(getattr(pool, "_in_use_connections", None), set)
        and hasattr(pool, "_lock")
        and isinstance(kwargs, dict)
        and kwargs.get("credential_provider") is None
        and kwargs.get("redis_connect_func") is None
    )


def _metrics_on() -> bool:
    """redis-py's own OpenTelemetry metrics are on (they record only on redis-py's way)."""
    return getattr(_recorder, "_async_metrics_collector", None) is not None


# Client classes and whether they are a redis.asyncio ``Redis`` that is no ``Pipeline``: a class's
# answer never changes, and ``isinstance(client, Pipeline)`` alone cost ~1.4 µs per script call
# (redis-py's ``Redis`` has a ``Protocol`` metaclass, whose negative answers are slow). Bounded:
# an application making client classes on the fly only stops being cached.
_PLAIN_CLASSES: dict[type, bool] = {}
_PLAIN_CLASSES_MAX: Final = 64


def _plain_class(cls: type, client: object) -> bool:
    plain = _PLAIN_CLASSES.get(cls)
    if plain is None:
        plain = isinstance(client, Redis) and not isinstance(client, Pipeline)
        if len(_PLAIN_CLASSES) < _PLAIN_CLASSES_MAX:
            _PLAIN_CLASSES[cls] = plain
    return plain


def fast_pool(client: object) -> FastPool | None:
    """How :func:`run_script` may reach ``client``'s server, or ``None`` (redis-py's way).

    Checked on every call, as cheaply as possible: a client whose ``execute_command`` or
    ``evalsha`` is wrapped or overridden (tracing, instrumentation, a subclass, a test) keeps
    redis-py's way, so whatever observes its commands still sees the library's."""
    if not _plain_class(type(client), client):
        return None
    client = cast("Redis", client)  # (what _plain_class found)
    if client.connection is not None:  # single_connection_client
        return None
    if not unobserved(client):
        return None
    pool = client.connection_pool
    fast = getattr(pool, _FAST, _UNKNOWN)
    if fast is _UNKNOWN:
        fast = FastPool(pool) if _qualifies(pool) else None
        setattr(pool, _FAST, fast)
    return fast  # type: ignore[return-value]


def recent_failure(client: object, within: float) -> str:
    """The last connection error a script call to ``client``'s server met in the last
    ``within`` seconds, for a message ("…; the last connection error, 0.4 s ago:
    ConnectionError('max number of clients reached')"), or ``""``: the client's ``Retry``
    retries such errors out of sight until a bound ends the call, and the bound alone does not
    say why. Known only where the library's own way reaches the server (:func:`fast_pool`)."""
    fast = getattr(getattr(client, "connection_pool", None), _FAST, None)
    failure = fast.failure if isinstance(fast, FastPool) else None
    if failure is None:
        return ""
    error, at = failure
    ago = asyncio.get_running_loop().time() - at
    if ago > within:
        return ""
    return f"; the last connection error, {ago:.1f} s ago: {describe(error)}"


def unobserved(client: object) -> bool:
    """Whether nothing observes ``client``'s commands (any client class — a ``RedisCluster``
    too): its ``execute_command`` and ``evalsha`` are redis-py's own, on its class and not
    replaced on it, and redis-py's metrics are off — so its scripts may go another way than
    through them (see :func:`fast_pool`)."""
    cls = type(client)
    own = client.__dict__
    return (
        _redis_own(getattr(cls, "execute_command", None))
        and _redis_own(getattr(cls, "evalsha", None))
        and "execute_command" not in own
        and "evalsha" not in own
        and not _metrics_on()
    )


async def let_go(client: object) -> None:
    """After a clean-up that ran past the user's close of ``client``: its lane gives its
    connection back, and a pool the client does not own (``Redis(connection_pool=...)``, which
    redis-py's close leaves open) has its idle connections closed. The clean-up connected them
    anew — maybe after the application had closed that pool itself — and nothing else would
    close them; a pool still in use elsewhere reconnects them on their next use.

    Each is taken out of the pool while it closes, as if in use: redis-py's
    ``disconnect(inuse_connections=False)`` closes them in tasks that start later, and another
    client of a shared pool could take one meanwhile and have it closed under its command."""
    if not isinstance(client, Redis):
        return
    pool: Any = client.connection_pool
    lane = getattr(getattr(pool, _FAST, None), "lane", None)
    if isinstance(lane, Lane):
        lane.retire()
    available = getattr(pool, "_available_connections", None)
    in_use = getattr(pool, "_in_use_connections", None)
    if client.auto_close_connection_pool or not (
        isinstance(available, list) and isinstance(in_use, set)
    ):
        return
    idle = [conn for conn in available if conn.is_connected]
    for conn in idle:
        available.remove(conn)
        in_use.add(conn)
    for conn in idle:
        try:
            await conn.disconnect()
        finally:
            await pool.release(conn)


def fast_batches(client: object) -> FastPool | None:
    """How :func:`run_pipeline` may reach ``client``'s server, or ``None`` (redis-py's
    pipeline): as :func:`fast_pool`, and only while the client's ``pipeline`` and the
    pipeline's ``execute`` are redis-py's own — what wraps them (a tracer, a test) still sees
    every batch."""
    fast = fast_pool(client)
    if fast is None or "pipeline" in client.__dict__:
        return None
    cls: Any = type(client)
    if not (_redis_own(cls.pipeline) and _redis_own(Pipeline.execute)):
        return None
    return fast


async def _ready(conn: Any) -> None:
    """``conn`` connected (and health-checked, if its pool asks) on the running loop."""
    # Opened under an earlier event loop (a client used under one asyncio.run after another):
    # its first read would fail, after the command was sent. A new one instead.
    forget_foreign(conn, asyncio.get_running_loop())
    try:
        if not conn.is_connected:
            # One connection attempt per attempt of the command: the command's Retry is the
            # one that retries (connect() would nest the connection's own Retry inside it:
            # 11 x 10 attempts against a server that is down, where redis-py makes 10).
            await conn.connect_check_health(check_health=True, retry_socket_connect=False)
        elif conn.health_check_interval:
            await conn.check_health()
    except (redis.RedisError, OSError) as exc:
        _unsent(exc)
        raise


async def _exchange(
    conn: Any, fast: FastPool, sha: str, keys: Keys, args: Args, code: bytes | None
) -> object:
    await _ready(conn)
    packed = fast.pack(sha, keys, args, code) if fast.raw else None
    try:
        if packed is not None:
            conn._writer.write(packed)
        else:
            if code is None:
                command = conn.pack_command("EVALSHA", sha, len(keys), *keys, *args)
            else:
                command = conn.pack_command("EVAL", code, len(keys), *keys, *args)
            await conn.send_packed_command(command, check_health=False)
        return await conn.read_response()
    except (OSError, RuntimeError, *TORN_DOWN) as exc:
        # A transport torn down under the call: a connection error, retried like one.
        await drop_connection(conn, nowait=True)
        raise connection_failed(exc) from exc


async def drop_connection(conn: Any, *, nowait: bool = False) -> None:
    """Disconnect ``conn``, whatever state it is in. A connection opened on an event loop that
    has since been closed cannot be closed the ordinary way (asyncio raises "Event loop is
    closed"); redis-py forgets it all the same (its next use opens a new one), and that is
    all that is needed here."""
    try:
        await conn.disconnect(nowait=nowait)
    except (OSError, RuntimeError, *TORN_DOWN):
        pass


def drop_stale_connections(pool: Any) -> None:
    """Forget the idle connections of ``pool`` opened under another event loop (a client used
    under one ``asyncio.run`` after another; :func:`forget_foreign`): redis-py's own paths — a
    pipeline — would send on one and fail with "attached to a different loop" or "Event loop
    is closed", and release it to the pool to fail again. Each opens anew on its next use.

    A lane left open by a loop that has closed since (the run ended within the lane's idle
    time) gives its connection back too: it stayed in use, a connection short for the
    application while the library's calls found idle ones (helper-52: ``MaxConnectionsError``
    on a pool of three, and ``aclose()`` raising "Event loop is closed")."""
    loop = asyncio.get_running_loop()
    fast = getattr(pool, _FAST, None)
    lane = fast.lane if isinstance(fast, FastPool) else None
    if fast is not None and lane is not None and lane.loop is not loop and lane.loop.is_closed():
        fast.lane = None
        forget_foreign(lane.conn, loop)
        pool._in_use_connections.discard(lane.conn)
        pool._available_connections.append(lane.conn)
    for conn in list(getattr(pool, "_available_connections", ())):
        forget_foreign(conn, loop)


def drop_stale_client(client: Any) -> None:
    """:func:`drop_stale_connections` for ``client``'s pool, and for the pools of the Sentinel
    clients a Sentinel-managed pool asks for its master (their stale connections fail the
    look-up a new connection makes); for each master of a ``RedLock``'s fan-out. Done when a
    client's locks are first used on an event loop: a client used under one ``asyncio.run``
    after another."""
    for master in getattr(client, "masters", ()):  # (RedLock's fan-out over its masters)
        drop_stale_client(master)
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return
    drop_stale_connections(pool)
    manager = getattr(pool, "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        inner = getattr(sentinel, "connection_pool", None)
        if inner is not None:
            drop_stale_connections(inner)


def loop_error(exc: BaseException) -> bool:
    """Whether ``exc`` is what asyncio raises for a connection of a closed or another event
    loop ("Event loop is closed", "… attached to a different loop"): redis-py's own command
    path lets it through, possibly after the command was written — a connection failure."""
    return isinstance(exc, RuntimeError) and "loop" in str(exc)


def forget_foreign(conn: Any, loop: asyncio.AbstractEventLoop) -> None:
    """If ``conn``'s socket was opened under another event loop than ``loop``, make redis-py
    forget it without closing it (the connection opens anew on its next use). Closing it is
    not this loop's to do: in a child forked from a running application that loop is the
    parent's, copied, and closing the transport takes the parent's socket out of the epoll
    both processes share — every command of the parent on it would hang; and a loop closed
    since cannot close it anyway (asyncio raises "Event loop is closed")."""
    opened_on = _loop_of(conn)
    if opened_on is None or opened_on is loop:
        return
    parser = getattr(conn, "_parser", None)
    if parser is not None:
        with contextlib.suppress(Exception):  # a parser of a torn-down stream
            parser.on_disconnect()
    if not opened_on.is_closed():
        # A stream writer closes its transport when it is collected (Python >= 3.11): kept
        # for good (a forked child's few copies of the parent's connections).
        _FOREIGN_WRITERS.append(conn._writer)
    conn._reader = None
    conn._writer = None


_FOREIGN_WRITERS: Final[list[Any]] = []


def _loop_of(conn: Any) -> asyncio.AbstractEventLoop | None:
    """The event loop ``conn``'s open socket belongs to (``None``: not connected)."""
    reader = getattr(conn, "_reader", None)
    return getattr(reader, "_loop", None) if reader is not None else None


_UNSENT: Final = "_redis_locks_async_never_sent"


def never_sent(exc: BaseException) -> bool:
    """Whether ``exc`` ended a script call (:func:`run_script`) none of whose attempts wrote a
    byte of it — each failed to get a connection ready (refused, unreachable, its handshake or
    ``AUTH`` failed): nothing of the call can have reached the server, so there is nothing to
    undo (helper-76: a server that is down made every failed acquire start seconds of
    clean-up retries and a "gave up" warning, and slowed the client's close)."""
    return getattr(exc, _UNSENT, False) is True


def _unsent(exc: BaseException) -> None:
    """Mark ``exc``: it was raised before this attempt wrote anything."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _UNSENT, True)


def connection_failed(exc: BaseException) -> RedisConnectionError:
    """The connection error that stands for ``exc`` (raise it ``from exc``)."""
    return RedisConnectionError(f"the connection failed under the call: {describe(exc)}")


async def run_script(
    fast: FastPool, sha: str, keys: Keys, args: Args, code: bytes | None = None
) -> object:
    """``EVALSHA sha len(keys) *keys *args`` on a connection of ``fast``'s pool (``EVAL code
    …`` when ``code`` is given: the server did not know the script): the parsed reply, errors
    as redis-py raises them (``MaxConnectionsError`` included: nothing was sent).

    An idle connection is taken straight from the pool while nothing else is going on there;
    otherwise (none idle, tasks queued for one, the pool busy with its own bookkeeping) the
    call joins the pool's lane, and where none can be had, the pool's own ``get_connection()``
    and ``release()`` take their course."""
    wrote = [False]  # whether an attempt may have written the call (see never_sent)
    try:
        return await _run_script(fast, sha, keys, args, code, wrote)
    except BaseException as exc:
        if wrote[0] and never_sent(exc):
            delattr(exc, _UNSENT)  # (an earlier attempt may have reached the server)
        raise


async def _run_script(
    fast: FastPool, sha: str, keys: Keys, args: Args, code: bytes | None, wrote: list[bool]
) -> object:
    async def failed_attempt(error: BaseException) -> None:
        if not never_sent(error):
            wrote[0] = True
        await fast.failed(error)

    conn = _idle(fast)
    if conn is None and fast.laned:
        packed = fast.pack(sha, keys, args, code)
        failed: BaseException | None = None
        lane = fast.lane
        if lane is not None and lane.closed is None:
            loop = asyncio.get_running_loop()
            if lane.loop is loop and not lane.stalled(loop.time()):
                # The common case, without the layers below: the open lane takes the call.
                try:
                    return await lane.call(packed)
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    failed = exc  # the Retry's first failure (below)

        def attempt() -> Awaitable[object]:
            nonlocal failed
            if failed is not None:
                error, failed = failed, None
                raise error
            return _on_lane(fast, packed)

        retry = fast.retry
        if retry is None:
            pool: Any = fast.pool
            # The Retry every connection of the pool gets (a connection object is only built).
            retry = fast.retry = pool.connection_class(**pool.connection_kwargs).retry
        try:
            return await retry.call_with_retry(attempt, failed_attempt)
        except _NoLane:
            pass
    if conn is None:
        pool = fast.pool
        try:
            conn = await pool.get_connection()
        except (redis.RedisError, OSError) as exc:
            _unsent(exc)  # (redis-py's own connect, retried under its own Retry)
            raise
        try:
            return await _sent(conn, sha, keys, args, code, fast, failed_attempt)
        finally:
            await pool.release(conn)
    try:
        return await _sent(conn, sha, keys, args, code, fast, failed_attempt)
    finally:
        await _put_back(fast, conn)


def _sent(
    conn: Any,
    sha: str,
    keys: Keys,
    args: Args,
    code: bytes | None,
    fast: FastPool,
    failed_attempt: Callable[[BaseException], Awaitable[None]],
) -> Awaitable[object]:
    async def failed(error: BaseException) -> None:
        await failed_attempt(error)
        await drop_connection(conn)

    return conn.retry.call_with_retry(  # type: ignore[no-any-return]
        lambda: _exchange(conn, fast, sha, keys, args, code), failed
    )


async def run_pipeline(
    fast: FastPool, calls: Sequence[tuple[str, Keys, Args]], bound: float | None = None
) -> list[object]:
    """``EVALSHA sha len(keys) *keys *args`` for each of ``calls`` (``(sha, keys, args)``), all
    written at once on one connection of ``fast``'s pool — one round trip, as a redis-py
    pipeline — and their replies in order, a server's error reply in place of its call's.

    Unlike a redis-py pipeline it gives the event loop a step every :data:`PIPELINE_STEP`
    commands packed and replies read: a batch of 1,000 renewals holds the loop for a tenth of
    the time (B5's loop lag), and costs no more. Under the pool's ``Retry`` as a single script
    call is (every script is idempotent); a connection left with replies owed (an error, a
    timeout, a cancellation) is dropped, never reused. ``bound``: seconds the exchange may
    take once the connection is ready (a connection opened for it has its handshake first:
    the caller bounds the whole)."""
    pool: Any = fast.pool
    conn = await pool.get_connection()
    try:
        return await conn.retry.call_with_retry(  # type: ignore[no-any-return]
            lambda: _pipelined(conn, fast, calls, bound), lambda _error: drop_connection(conn)
        )
    finally:
        await pool.release(conn)


async def _pipelined(
    conn: Any, fast: FastPool, calls: Sequence[tuple[str, Keys, Args]], bound: float | None
) -> list[object]:
    await _ready(conn)
    exchange = _pipelined_exchange(conn, fast, calls)
    if bound is None:
        return await exchange
    return await asyncio.wait_for(exchange, bound)


async def _pipelined_exchange(
    conn: Any, fast: FastPool, calls: Sequence[tuple[str, Keys, Args]]
) -> list[object]:
    packed: list[bytes] = []
    for start in range(0, len(calls), PIPELINE_STEP):
        if start:
            await asyncio.sleep(0)
        chunk = calls[start : start + PIPELINE_STEP]
        if fast.raw:
            pack = fast.pack
            packed.append(b"".join(pack(sha, keys, args, cache=False) for sha, keys, args in chunk))
        else:  # the connection class's own packing (a meter, a tracer sees every command)
            packed.extend(
                conn.pack_commands(
                    [("EVALSHA", sha, len(keys), *keys, *args) for sha, keys, args in chunk]
                )
            )
    replies: list[object] = []
    owed = True
    try:
        await conn.send_packed_command(packed, check_health=False)
        for index in range(len(calls)):
            if index and not index % PIPELINE_STEP:
                await asyncio.sleep(0)
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        owed = False
    except (OSError, RuntimeError, *TORN_DOWN) as exc:
        raise connection_failed(exc) from exc
    finally:
        if owed:
            await drop_connection(conn, nowait=True)
    return replies


def _idle(fast: FastPool) -> Any:
    """An idle connection of the pool, marked in use; ``None`` unless the pool is quiet."""
    pool: Any = fast.pool
    condition: Any = fast.condition
    if pool._lock.locked() or getattr(pool, "_in_maintenance", False):
        return None
    if condition is not None and (condition.locked() or condition._waiters):
        return None  # tasks queue for a connection: take a turn behind them
    available: list[Any] = pool._available_connections
    if not available:
        return None
    conn = available.pop()
    pool._in_use_connections.add(conn)
    return conn


async def _put_back(fast: FastPool, conn: Any) -> None:
    pool: Any = fast.pool
    in_use: set[Any] = pool._in_use_connections
    if conn not in in_use:  # the pool was reset meanwhile: the connection is no longer its own
        await drop_connection(conn)
        return
    in_use.discard(conn)
    try:
        if conn.should_reconnect():
            await drop_connection(conn)
    finally:
        pool._available_connections.append(conn)
        notify = _notify_queued(fast)
        if notify is not None:
            await asyncio.shield(notify)


def _notify_queued(fast: FastPool) -> asyncio.Future[None] | None:
    """Wake a task queued for a connection of ``fast``'s pool, if any (a connection was just
    given back). The notification is owed whatever happens to the caller: cancelled while it
    waited for the condition's lock, it would leave a queued task asleep beside an idle
    connection until the pool's timeout. So it runs in a task of its own."""
    condition = fast.condition
    if condition is None or not condition._waiters:
        return None
    notify = asyncio.ensure_future(_notify(condition))
    _NOTIFYING.add(notify)
    notify.add_done_callback(_NOTIFYING.discard)
    return notify


_NOTIFYING: set[asyncio.Future[None]] = set()  # notifications under way (kept referenced)


async def _lane(fast: FastPool) -> Lane | None:
    """The pool's lane on this event loop, opened if need be; ``None``: none can be had now
    (the call takes a connection of its own)."""
    loop = asyncio.get_running_loop()
    lane = fast.lane
    if lane is not None:
        if lane.loop is loop and lane.closed is None:
            if not lane.stalled(loop.time()):
                return lane
            fast.lane = None  # it serves what it has; new calls take a new lane
            lane.demote()
        elif lane.loop is not loop:
            if not lane.loop.is_closed():
                return None  # the client is in use on another running loop: no lane here
            fast.lane = None  # opened under an earlier, closed loop: its connection goes back
            forget_foreign(lane.conn, loop)
            await _put_back(fast, lane.conn)
    opening = fast.opening
    if opening is None or opening.get_loop() is not loop:
        if _crowded(fast):
            # Tasks queue for the pool's connections (or it has none to give): the call takes
            # its turn like them. One opener for every call would lose each race for a freed
            # connection to whoever asks right then (redis-py's blocking pool is not FIFO),
            # and fail them all at once at the pool's timeout.
            return None
        opening = fast.opening = asyncio.ensure_future(_open_lane(fast, loop))
        opening.add_done_callback(lambda done: _opened(fast, done))
    elif _crowded(fast):
        return None  # the opening queues for a connection: not every call behind it
    return await asyncio.shield(opening)


def _opened(fast: FastPool, done: asyncio.Future[Lane | None]) -> None:
    if fast.opening is done:
        fast.opening = None
    if not done.cancelled():
        done.exception()  # retrieved: each waiter got it


async def _open_lane(fast: FastPool, loop: asyncio.AbstractEventLoop) -> Lane | None:
    pool: Any = fast.pool
    conn = _idle(fast)
    if conn is None:
        if _crowded(fast):
            return None
        conn = _new_connection(fast)
        if conn is None:
            return None  # (the pool busy with its own bookkeeping: the call takes its turn)
    try:
        forget_foreign(conn, loop)
        if not conn.is_connected:
            try:
                await asyncio.wait_for(
                    conn.connect_check_health(check_health=True, retry_socket_connect=False),
                    _open_patience(pool),
                )
            except asyncio.TimeoutError:
                # No lane now: the call takes a connection of its own (the pool's
                # get_connection(), which waits a stalled server out like redis-py does,
                # bounded by the caller's own deadline) — failing it would cut a caller's
                # timeout short at this bound (helper-52: a 3 s DEBUG SLEEP failed a fresh
                # acquire(timeout=10)). The opener itself ends here, its half-open
                # connection dropped.
                await drop_connection(conn, nowait=True)
                raise _NoLane from None
            except (redis.RedisError, OSError) as exc:  # (after TimeoutError, an OSError)
                _unsent(exc)  # (the calls waiting for this lane sent nothing)
                raise
        if not lane_capable(conn):
            raise _NoLane  # (this connection: the call takes it as a connection of its own)
        try:
            lane = Lane(conn, loop, lambda: _crowded(fast))
        except Exception as exc:  # redis-py's internals not as expected: no lanes on this pool
            fast.laned = False
            raise _NoLane from exc
    except BaseException as exc:
        if not isinstance(exc, _NoLane):
            await drop_connection(conn, nowait=True)
        await _put_back(fast, conn)
        if isinstance(exc, _NoLane):
            return None
        raise
    lane.on_close(lambda closed: _lane_closed(fast, closed))
    fast.lane = lane
    return lane


def _new_connection(fast: FastPool) -> Any:
    """A connection of the pool to open — not connected yet, marked in use — or ``None`` when
    the pool is busy with its own bookkeeping or has none to give. Not the pool's own
    ``get_connection()``: that one also connects, without a bound, and a connect cut short
    there (a cancellation) puts the connection back half-open, its handshake's reply owed."""
    pool: Any = fast.pool
    if pool._lock.locked() or getattr(pool, "_in_maintenance", False):
        return None
    try:
        return pool.get_available_connection()
    except MaxConnectionsError:
        return None


def _open_patience(pool: Any) -> float:
    """How long a lane's connection may take to open (:data:`LANE_OPEN_PATIENCE`)."""
    kwargs = pool.connection_kwargs
    timeouts = [kwargs.get("socket_connect_timeout"), kwargs.get("socket_timeout")]
    return max(LANE_OPEN_PATIENCE, sum(t for t in timeouts if isinstance(t, int | float)))


def _crowded(fast: FastPool) -> bool:
    """The pool has no connection left to give: it is at ``max_connections`` with none idle,
    or tasks queue for one — an idle lane gives its connection back at once."""
    pool: Any = fast.pool
    condition: Any = fast.condition
    if condition is not None and condition._waiters:
        return True
    available: list[Any] = pool._available_connections
    in_use: set[Any] = pool._in_use_connections
    return not available and len(in_use) >= pool.max_connections


class _NoLane(Exception):
    pass


def _lane_closed(fast: FastPool, lane: Lane) -> None:
    """A lane closed: its connection goes back to the pool — at once, ready for use, if the
    lane was retired with nothing owed (the next command may be the application's own, on a
    pool with no other connection); else disconnected, by a task."""
    if fast.lane is lane:
        fast.lane = None
    if lane.retired and _returned(fast, lane.conn):
        return
    task = asyncio.ensure_future(_give_back(fast, lane))
    _NOTIFYING.add(task)
    task.add_done_callback(_NOTIFYING.discard)


def _returned(fast: FastPool, conn: Any) -> bool:
    """:func:`_put_back` without waiting, for a connection fit for reuse (``False``: it needs
    the waiting kind)."""
    pool: Any = fast.pool
    in_use: set[Any] = pool._in_use_connections
    if conn not in in_use or conn.should_reconnect():
        return False
    in_use.discard(conn)
    pool._available_connections.append(conn)
    _notify_queued(fast)
    return True


async def _give_back(fast: FastPool, lane: Lane) -> None:
    if not lane.retired:
        await drop_connection(lane.conn, nowait=True)
    await _put_back(fast, lane.conn)


async def _on_lane(fast: FastPool, packed: bytes) -> object:
    try:
        lane = await _lane(fast)
    except TORN_DOWN as exc:  # the pool disconnected under the opening (redis-py's connect())
        raise connection_failed(exc) from exc
    if lane is None:
        raise _NoLane
    return await lane.call(packed)


async def _notify(condition: asyncio.Condition) -> None:
    async with condition:
        condition.notify()
