"""Counting what a client sends, in the client: commands, round trips, and (optionally) when.

``INFO commandstats`` counts every command the server runs, including the ones a Lua script
runs inside the server (``HGET``, ``PEXPIRE`` ... of our scripts), which are not round trips;
Valkey's per-connection ``tot-cmds`` (``CLIENT LIST``) counts those too, and Redis 7.0 has no
such field. So the scenarios that report *client* commands count them where they are sent: a
subclass of redis-py's ``Connection`` (given to the pool as ``connection_class``) counts

- a **command** for every command in a request it writes (single commands, every command of a
  pipeline, ``SUBSCRIBE``/``PING`` of a pub/sub connection, the ``HELLO``/``CLIENT SETINFO`` of
  a new connection, health-check pings), by name;
- a **round trip** for every request written (``send_packed_command``: one per single command,
  one per pipeline however many commands it carries).

Both are counted once the write is done, so a reading never shows a command packed but not yet
sent. They are what the client *sent*: a request that never got its reply still counts.

The same class can also record *when*: with :attr:`Meter.trace` set, every write (when it began,
with its first command's name) and every reply or pushed message read (when redis-py returned
it; for our subscription hub, which reads its connection itself, when the hub acts on it:
:func:`hub_reads_traced`) is appended with ``monotonic_ns()`` —
B2 uses that to split a handoff into its hops. A sync variant counts redis-py's blocking client
(python-redis-lock) the same way, under a lock (its waiters are threads).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT


@dataclass(frozen=True, slots=True)
class Reading:
    """A meter's counts at one moment (picklable, so workers can send it)."""

    commands: dict[str, int]
    round_trips: int

    @property
    def total(self) -> int:
        """Commands of every kind."""
        return sum(self.commands.values())

    def __sub__(self, earlier: Reading) -> Reading:
        names = set(self.commands) | set(earlier.commands)
        delta = {n: self.commands.get(n, 0) - earlier.commands.get(n, 0) for n in names}
        kept = {n: c for n, c in sorted(delta.items()) if c}
        return Reading(kept, self.round_trips - earlier.round_trips)

    def __add__(self, other: Reading) -> Reading:
        merged = Counter(self.commands)
        merged.update(other.commands)
        return Reading(dict(sorted(merged.items())), self.round_trips + other.round_trips)


ZERO = Reading({}, 0)


@dataclass(slots=True)
class Meter:
    """Counters shared by every connection of one pool (``trace``: also record when)."""

    commands: Counter[str] = field(default_factory=Counter)
    round_trips: int = 0
    trace: list[tuple[int, str]] | None = None
    trace_reads: bool = True
    sizes: list[int] | None = None  # commands per request written, while set
    guard: threading.Lock = field(default_factory=threading.Lock)

    def reading(self) -> Reading:
        """The counts now."""
        with self.guard:
            return Reading(dict(sorted(self.commands.items())), self.round_trips)

    def sent(self, names: list[str], began: int) -> None:
        """A request carrying the commands ``names``, whose write began at ``began``
        (``monotonic_ns``), was written: one round trip."""
        with self.guard:
            self.round_trips += 1
            self.commands.update(names)
        if self.sizes is not None:
            self.sizes.append(len(names))
        if self.trace is not None:
            self.trace.append((began, "send:" + (names[0] if names else "?")))

    def read(self, response: object) -> None:
        """A reply or a pushed message was read."""
        if self.trace is not None and self.trace_reads:
            self.trace.append((time.monotonic_ns(), "read:" + _kind(response)))


def command_name(args: Iterable[EncodableT]) -> str:
    """``EVALSHA`` for ``("EVALSHA", sha, ...)``; ``CLIENT`` for ``("CLIENT SETINFO", ...)``."""
    first = next(iter(args), "?")
    if isinstance(first, (bytes, bytearray, memoryview)):
        first = bytes(first).decode("utf-8", "replace")
    return str(first).split(" ", 1)[0].upper()


def _kind(response: object) -> str:
    """``message`` for a pub/sub message, else ``reply``."""
    if isinstance(response, (list, tuple)) and response:
        head = response[0]
        if isinstance(head, bytes) and head in (b"message", b"smessage", b"pmessage"):
            return "message"
    return "reply"


def metered_connection(meter: Meter) -> type[aioredis.Connection]:
    """A ``redis.asyncio`` connection class that reports to ``meter``. Commands are counted
    when the request carrying them has been written (with the round trip), so a reading never
    shows a command packed but not yet sent."""

    class MeteredConnection(aioredis.Connection):
        _packed: list[str] | None = None

        def pack_command(self, *args: EncodableT) -> list[bytes]:
            if self._packed is None:
                self._packed = []
            self._packed.append(command_name(args))
            return super().pack_command(*args)

        async def send_packed_command(
            self, command: bytes | str | Iterable[bytes], check_health: bool = True
        ) -> None:
            names, self._packed = self._packed or [], None
            began = time.monotonic_ns()
            await super().send_packed_command(command, check_health)
            meter.sent(names, began)

        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            response = await super().read_response(*args, **kwargs)
            meter.read(response)
            return response

    return MeteredConnection


@contextlib.contextmanager
def hub_reads_traced(meter: Meter) -> Iterator[None]:
    """While inside, ``meter`` also records when our subscription hub acts on each message or
    confirmation it reads. The hub reads its pub/sub connection in a protocol callback of its
    own (``redis_locks_async._notify._Tap``), not through the connection's ``read_response``,
    so the metered connection class does not see those reads; the hub's dispatch is where
    the read message is at hand (microseconds after the bytes arrived)."""
    from redis_locks_async import _notify

    original = _notify.SubscriptionHub._dispatch

    def dispatch(hub: _notify.SubscriptionHub, kind: str, channel: str, data: object) -> bool:
        if hub._tap is not None:  # (read by get_message otherwise: the class saw it)
            meter.read([kind.encode()])
        return original(hub, kind, channel, data)

    _notify.SubscriptionHub._dispatch = dispatch  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _notify.SubscriptionHub._dispatch = original  # type: ignore[method-assign]


def metered_sync_connection(meter: Meter) -> type[redis.Connection]:
    """The same for the blocking ``redis`` client (which packs in ``send_command`` and
    ``pack_commands`` without going through ``pack_command``)."""

    class MeteredSyncConnection(redis.Connection):
        _packed: list[str] | None = None

        def _note(self, args: Iterable[EncodableT]) -> None:
            if self._packed is None:
                self._packed = []
            self._packed.append(command_name(args))

        def send_command(self, *args: Any, **kwargs: Any) -> None:
            self._note(args)
            super().send_command(*args, **kwargs)  # type: ignore[no-untyped-call]

        def pack_commands(self, commands: Iterable[Iterable[EncodableT]]) -> list[bytes]:
            listed = [tuple(command) for command in commands]
            for command in listed:
                self._note(command)
            packed: list[bytes] = super().pack_commands(listed)  # type: ignore[no-untyped-call]
            return packed

        def send_packed_command(
            self, command: bytes | str | Iterable[bytes], check_health: bool = True
        ) -> None:
            names, self._packed = self._packed or [], None
            began = time.monotonic_ns()
            super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]
            meter.sent(names, began)

    return MeteredSyncConnection


def metered_client(
    url: str, meter: Meter, *, max_connections: int = 64, client_name: str | None = None
) -> aioredis.Redis:
    """A ``redis.asyncio`` client on a ``BlockingConnectionPool`` of metered connections."""
    kwargs: dict[str, Any] = {"client_name": client_name} if client_name else {}
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=120,
        connection_class=metered_connection(meter),
        **kwargs,
    )
    return aioredis.Redis.from_pool(pool)
