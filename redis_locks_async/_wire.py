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
before use (redis-py drops a connection whenever a reply may be left unread).

Anything else takes redis-py's way, unchanged: a cluster or Sentinel client, a pipeline, a
single-connection client, a custom pool or connection class, credentials providers, a pool with
no idle connection (redis-py opens one, or raises ``MaxConnectionsError``), or a redis-py whose
internals do not look as expected. :func:`fast_pool` makes that decision once per pool.
"""

from __future__ import annotations

import os
import types
import weakref
from collections.abc import Sequence
from typing import Any, Final, final

import redis
from redis.asyncio.client import Pipeline, Redis
from redis.asyncio.connection import (
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import ConnectionError as RedisConnectionError

try:
    from redis.asyncio.observability import recorder as _recorder
except ImportError:  # pragma: no cover - redis-py without its own metrics
    _recorder = None  # type: ignore[assignment]

__all__ = ("MISS", "FastPool", "fast_pool", "run_script")

MISS: Final = object()
"""What :func:`run_script` returns when it did not send the command (use redis-py's way)."""

_PLAIN_CONNECTIONS: Final = (Connection, SSLConnection, UnixDomainSocketConnection)
_HEADS_MAX: Final = 4096  # cached command heads per pool (one per script and lock, typically)


@final
class FastPool:
    """A pool :func:`run_script` may use, with its clients' string encoding and the packed
    heads (``EVALSHA sha numkeys keys…``) of the script calls sent through it."""

    __slots__ = ("encoding", "errors", "heads", "pool")

    def __init__(self, pool: ConnectionPool) -> None:
        kwargs = pool.connection_kwargs
        self.pool = pool
        self.encoding: str = kwargs.get("encoding", "utf-8")
        self.errors: str = kwargs.get("encoding_errors", "strict")
        self.heads: dict[tuple[str, tuple[str | bytes, ...]], bytes] = {}

    def pack(
        self, sha: str, keys: tuple[str | bytes, ...], args: Sequence[str | int | float | bytes]
    ) -> bytes:
        """``EVALSHA sha len(keys) *keys *args`` as one RESP command, strings encoded as the
        pool's clients encode them."""
        head = self.heads.get((sha, keys))
        if head is None:
            if len(self.heads) >= _HEADS_MAX:
                self.heads.clear()
            head = self.heads[(sha, keys)] = self._bulk(("EVALSHA", sha, len(keys), *keys))
        return b"*%d\r\n%b%b" % (3 + len(keys) + len(args), head, self._bulk(args))

    def _bulk(self, parts: Sequence[str | int | float | bytes]) -> bytes:
        out = []
        for part in parts:
            if isinstance(part, bytes):
                data = part
            elif isinstance(part, str):
                data = part.encode(self.encoding, self.errors)
            elif isinstance(part, bool):  # redis-py refuses it too
                raise TypeError(f"cannot send a bool to Redis: {part!r}")
            else:
                data = repr(part).encode()
            out.append(b"$%d\r\n%b\r\n" % (len(data), data))
        return b"".join(out)


_POOLS: weakref.WeakKeyDictionary[ConnectionPool, FastPool | None] = weakref.WeakKeyDictionary()


def _qualifies(pool: ConnectionPool) -> bool:
    kwargs = getattr(pool, "connection_kwargs", None)
    return (
        type(pool) is ConnectionPool
        and pool.connection_class in _PLAIN_CONNECTIONS
        and isinstance(getattr(pool, "_available_connections", None), list)
        and isinstance(getattr(pool, "_in_use_connections", None), set)
        and hasattr(pool, "_lock")
        and isinstance(kwargs, dict)
        and kwargs.get("credential_provider") is None
        and kwargs.get("redis_connect_func") is None
    )


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


def _metrics_on() -> bool:
    """redis-py's own OpenTelemetry metrics are on (they record only on redis-py's way)."""
    return getattr(_recorder, "_async_metrics_collector", None) is not None


def fast_pool(client: object) -> FastPool | None:
    """How :func:`run_script` may reach ``client``'s server, or ``None`` (redis-py's way).

    Checked on every call, as cheaply as possible: a client whose ``execute_command`` or
    ``evalsha`` is wrapped or overridden (tracing, instrumentation, a subclass, a test) keeps
    redis-py's way, so whatever observes its commands still sees the library's."""
    if not isinstance(client, Redis) or isinstance(client, Pipeline):
        return None
    if client.connection is not None:  # single_connection_client
        return None
    cls = type(client)
    if not (_redis_own(cls.execute_command) and _redis_own(cls.evalsha)):
        return None
    own = client.__dict__
    if "execute_command" in own or "evalsha" in own or _metrics_on():
        return None
    pool = client.connection_pool
    try:
        return _POOLS[pool]
    except KeyError:
        fast = _POOLS[pool] = FastPool(pool) if _qualifies(pool) else None
        return fast


async def _exchange(conn: Any, packed: bytes) -> object:
    if not conn.is_connected:
        await conn.connect()
    elif conn.health_check_interval:
        await conn.check_health()
    writer = conn._writer
    try:
        writer.write(packed)
    except (OSError, RuntimeError) as exc:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while writing to socket: {exc!r}") from exc
    return await conn.read_response()


async def run_script(fast: FastPool, packed: bytes) -> object:
    """Send ``packed`` on an idle connection of ``pool`` and return the parsed reply (errors as
    redis-py raises them), or :data:`MISS` without sending anything when no connection is
    idle or the pool is busy with its own bookkeeping."""
    pool = fast.pool
    if pool._lock.locked():
        return MISS
    available: list[Any] = pool._available_connections
    if not available:
        return MISS
    conn = available.pop()
    in_use: set[Any] = pool._in_use_connections
    in_use.add(conn)
    try:
        return await conn.retry.call_with_retry(
            lambda: _exchange(conn, packed), lambda _error: conn.disconnect()
        )
    finally:
        if conn in in_use:
            in_use.discard(conn)
            if conn.should_reconnect():
                await conn.disconnect()
            pool._available_connections.append(conn)
        else:  # the pool was reset meanwhile: the connection is no longer its own
            await conn.disconnect()
