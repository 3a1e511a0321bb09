"""An asyncio TCP proxy that injects network faults between a client and a server (SPEC §8).

``tc netem`` and Toxiproxy are unavailable here, so lock tests put this proxy between the client
under test and a real server and steer faults from the test body:

- :meth:`FaultProxy.delay` adds latency to server→client bytes (order is kept);
- :meth:`FaultProxy.hold_replies` buffers server→client bytes until
  :meth:`FaultProxy.release_replies`, so a test can cancel a task exactly while the reply to its
  command is in flight (:meth:`FaultProxy.wait_held` says when a reply has reached the proxy);
- :meth:`FaultProxy.blackhole` silently drops everything both ways while keeping connections open
  (a partitioned or frozen peer);
- :meth:`FaultProxy.reset_all` aborts every current connection with a TCP RST;
- :meth:`FaultProxy.lose_held` drops the replies held right now and aborts their connections
  with a TCP RST: the command ran on the server but its reply is lost with a connection error
  (what makes a retrying client such as ``Redis(host=…)`` send the command again);
- :meth:`FaultProxy.blackhole_where` / :meth:`FaultProxy.reset_where` act only on the connections
  whose client sent some bytes (e.g. ``b"SUBSCRIBE"``: the pub/sub connection), for a silently dead
  (half-open) connection or a targeted reset; :meth:`FaultProxy.blackhole_sending` does it to
  every connection that sends them, also one opened later (a path that hangs for one kind of
  command while the others pass);
- :meth:`FaultProxy.heal` lifts delay, hold and blackhole (proxy-wide and per connection).

One proxy serves any number of connections; each gets its own upstream connection. Faults are
proxy-wide and apply to connections present and future. Counters (:attr:`FaultProxy.stats`) let
tests assert how much traffic went where.

Example::

    async with FaultProxy(server.host, server.port) as proxy:
        client = redis.asyncio.Redis.from_url(proxy.url)
        proxy.hold_replies()
        task = asyncio.create_task(acquire_then_work(lock))
        await proxy.wait_held()          # the reply is at the proxy, not at the client
        task.cancel()
        proxy.release_replies()
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass
from types import TracebackType
from typing import Final, final

__all__ = ("FaultProxy", "ProxyStats")

_CHUNK: Final = 65536
_EOF: Final = None
_SENT_LOG: Final = 65536


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """A snapshot of the proxy's counters."""

    connections_total: int
    connections_open: int
    bytes_up: int  # client → server, forwarded
    bytes_down: int  # server → client, delivered
    bytes_dropped_up: int  # client → server, eaten by the blackhole
    bytes_dropped_down: int  # server → client, eaten by the blackhole
    bytes_pending_down: int  # server → client, read from the server but not yet delivered
    resets: int  # connections aborted by reset_all()


def _set_rst_on_close(writer: asyncio.StreamWriter) -> None:
    """SO_LINGER {on, 0}: closing then sends RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@final
class _Connection:
    """One client connection and its upstream twin, with the two pump tasks."""

    __slots__ = (
        "aborted",
        "blackholed",
        "client",
        "down_queue",
        "pending_down",
        "sent",
        "tasks",
        "upstream",
    )

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.down_queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self.pending_down = 0  # bytes read from the server, not yet delivered or dropped
        self.tasks: list[asyncio.Task[None]] = []
        self.aborted = False
        self.blackholed = False  # this connection only (see FaultProxy.blackhole_where)
        self.sent = bytearray()  # the first _SENT_LOG bytes sent, lower-cased, for *_where()

    def abort(self, *, rst: bool) -> None:
        self.aborted = True
        for writer in (self.client, self.upstream):
            if rst:
                _set_rst_on_close(writer)
            writer.transport.abort()


@final
class FaultProxy:
    """A loopback TCP proxy in front of ``upstream_host:upstream_port`` with switchable faults.

    Use as ``async with FaultProxy(host, port) as proxy:`` or call :meth:`start` and :meth:`close`.
    Point clients at :attr:`url` (or :attr:`host`/:attr:`port`). Fault switches are plain methods,
    callable from any coroutine on the proxy's event loop::

        async with FaultProxy(server.host, server.port) as proxy:
            client = redis.asyncio.Redis.from_url(proxy.url)
            proxy.delay(0.2)
            await client.ping()          # ≈ 200 ms
            proxy.heal()
    """

    __slots__ = (
        "_blackhole_on",
        "_blackholed",
        "_bytes_down",
        "_bytes_dropped_down",
        "_bytes_dropped_up",
        "_bytes_up",
        "_changed",
        "_connections",
        "_connections_total",
        "_delay",
        "_host",
        "_listen_port",
        "_released",
        "_resets",
        "_server",
        "upstream_host",
        "upstream_port",
    )

    def __init__(
        self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self._host = host
        self._listen_port = port
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._delay = 0.0
        self._blackholed = False
        self._blackhole_on: tuple[bytes, ...] = ()  # blackhole_sending's needles
        self._released: asyncio.Event | None = None
        self._changed: asyncio.Condition | None = None
        self._connections_total = 0
        self._bytes_up = 0
        self._bytes_down = 0
        self._bytes_dropped_up = 0
        self._bytes_dropped_down = 0
        self._resets = 0

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> FaultProxy:
        """Start listening (on a free port unless one was given). Returns ``self``."""
        if self._server is not None:
            raise RuntimeError("FaultProxy already started")
        self._released = asyncio.Event()
        self._released.set()
        self._changed = asyncio.Condition()
        self._server = await asyncio.start_server(self._accept, self._host, self._listen_port)
        self._listen_port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening and abort every connection. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        tasks = [t for conn in self._connections for t in conn.tasks]
        for conn in list(self._connections):
            conn.abort(rst=False)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._connections.clear()
        await server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ---- where to connect ------------------------------------------------------------------

    @property
    def host(self) -> str:
        """Listening address."""
        return self._host

    @property
    def port(self) -> int:
        """Listening port (valid after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("FaultProxy not started")
        return self._listen_port

    @property
    def url(self) -> str:
        """``redis://host:port`` of the proxy."""
        return f"redis://{self._host}:{self.port}"

    # ---- faults ----------------------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        """Delay server→client bytes read from now on by ``seconds`` (0 turns it off)."""
        if not seconds >= 0:  # also rejects NaN
            raise ValueError(f"delay must be >= 0 seconds, got {seconds!r}")
        self._delay = float(seconds)

    def hold_replies(self) -> None:
        """Buffer all server→client bytes until :meth:`release_replies` (or :meth:`heal`)."""
        self._require_started().clear()

    def release_replies(self) -> None:
        """Deliver everything held back by :meth:`hold_replies`, in order, and stop holding."""
        self._require_started().set()

    def blackhole(self) -> None:
        """Drop every byte both ways (connections stay open) until :meth:`heal`."""
        self._blackholed = True

    def reset_all(self) -> int:
        """Abort every current connection with a TCP RST on both sides; returns how many.

        The proxy keeps listening: new connections work (subject to the faults in force).
        """
        conns = list(self._connections)
        for conn in conns:
            conn.abort(rst=True)
        self._resets += len(conns)
        return len(conns)

    def lose_held(self) -> int:
        """Drop every reply held right now and abort its connection with a TCP RST.

        Use it after :meth:`hold_replies` and :meth:`wait_held`: the command ran on the server,
        and the client sees a connection error instead of its reply (a retrying client then
        sends the command again on a new connection). Returns how many connections were lost.
        Replies stay held for the other connections.
        """
        lost = [conn for conn in self._connections if conn.pending_down > 0]
        for conn in lost:
            self._bytes_dropped_down += conn.pending_down
            conn.pending_down = 0
            conn.abort(rst=True)
        self._resets += len(lost)
        return len(lost)

    def blackhole_held(self) -> int:
        """Silently drop both ways, until :meth:`heal`, on the connections whose replies are
        held right now: their commands ran, and their replies never come (a half-open
        connection; the client waits out its own timeout). Returns how many."""
        hit = [conn for conn in self._connections if conn.pending_down > 0]
        for conn in hit:
            conn.blackholed = True
        return len(hit)

    def connections_where(self, needle: bytes) -> int:
        """How many open connections have sent ``needle`` (case-insensitive, within their first
        64 KiB)."""
        return len(self._where(needle))

    def blackhole_where(self, needle: bytes) -> int:
        """Silently drop both ways on the open connections that sent ``needle`` (a half-open
        connection: no RST, no FIN) until :meth:`heal`. Returns how many."""
        hit = self._where(needle)
        for conn in hit:
            conn.blackholed = True
        return len(hit)

    def blackhole_sending(self, needle: bytes) -> None:
        """From now until :meth:`heal`, every connection — open or opened later — goes silent
        both ways (as :meth:`blackhole_where`) once it sends ``needle``, from that write on
        (a path that hangs for one kind of command while the others pass)."""
        self._blackhole_on = (*self._blackhole_on, needle.lower())

    def reset_where(self, needle: bytes) -> int:
        """Abort with a TCP RST the open connections that sent ``needle``; returns how many."""
        hit = self._where(needle)
        for conn in hit:
            conn.abort(rst=True)
        self._resets += len(hit)
        return len(hit)

    def _where(self, needle: bytes) -> list[_Connection]:
        needle = needle.lower()
        return [conn for conn in self._connections if needle in conn.sent]

    def heal(self) -> None:
        """Lift delay, hold and blackhole; held replies are delivered."""
        self._delay = 0.0
        self._blackholed = False
        self._blackhole_on = ()
        for conn in self._connections:
            conn.blackholed = False
        if self._released is not None:
            self._released.set()

    @property
    def holding(self) -> bool:
        """True between :meth:`hold_replies` and :meth:`release_replies`."""
        return self._released is not None and not self._released.is_set()

    @property
    def blackholed(self) -> bool:
        """True between :meth:`blackhole` and :meth:`heal`."""
        return self._blackholed

    async def wait_held(self, nbytes: int = 1, timeout: float = 5.0) -> int:
        """Wait until replies are being held and at least ``nbytes`` reached the proxy.

        Returns the number of bytes pending. Raises ``asyncio.TimeoutError`` after ``timeout``
        seconds.
        """
        if not self.holding:
            raise RuntimeError("wait_held() needs hold_replies() first")
        return await self.wait_pending_down(nbytes, timeout)

    async def wait_pending_down(self, nbytes: int = 1, timeout: float = 5.0) -> int:
        """Wait until at least ``nbytes`` server→client bytes are read but undelivered.

        Raises ``asyncio.TimeoutError`` after ``timeout`` seconds.
        """
        cond = self._condition()

        async def pending_enough() -> None:
            async with cond:
                await cond.wait_for(lambda: self._pending_down >= nbytes)

        await asyncio.wait_for(pending_enough(), timeout)
        return self._pending_down

    @property
    def _pending_down(self) -> int:
        return sum(conn.pending_down for conn in self._connections)

    # ---- counters --------------------------------------------------------------------------

    @property
    def stats(self) -> ProxyStats:
        """Current counters."""
        return ProxyStats(
            connections_total=self._connections_total,
            connections_open=len(self._connections),
            bytes_up=self._bytes_up,
            bytes_down=self._bytes_down,
            bytes_dropped_up=self._bytes_dropped_up,
            bytes_dropped_down=self._bytes_dropped_down,
            bytes_pending_down=self._pending_down,
            resets=self._resets,
        )

    def __repr__(self) -> str:
        where = f"{self._host}:{self._listen_port}" if self._server else "not started"
        faults = [
            name
            for name, on in (
                (f"delay={self._delay}s", self._delay > 0),
                ("holding", self.holding),
                ("blackholed", self._blackholed),
            )
            if on
        ]
        return (
            f"<FaultProxy {where} -> {self.upstream_host}:{self.upstream_port} "
            f"conns={len(self._connections)} faults=[{', '.join(faults)}]>"
        )

    # ---- plumbing --------------------------------------------------------------------------

    def _require_started(self) -> asyncio.Event:
        if self._released is None:
            raise RuntimeError("FaultProxy not started")
        return self._released

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            raise RuntimeError("FaultProxy not started")
        return self._changed

    async def _notify(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections_total += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.upstream_host, self.upstream_port
            )
        except OSError:
            # Upstream down: the client sees its connection reset, like a refused connect.
            _set_rst_on_close(writer)
            writer.transport.abort()
            return
        conn = _Connection(writer, up_writer)
        self._connections.add(conn)
        loop = asyncio.get_running_loop()
        readers = [
            loop.create_task(self._pump_up(conn, reader)),
            loop.create_task(self._read_down(conn, up_reader)),
        ]
        deliver = loop.create_task(self._deliver_down(conn))
        conn.tasks = [*readers, deliver]
        try:
            await asyncio.wait(readers)
            if conn.aborted:
                # Nothing left to deliver to; don't let a held or delayed reply keep it alive.
                deliver.cancel()
            await asyncio.wait([deliver])
        finally:
            for task in conn.tasks:
                task.cancel()
            self._connections.discard(conn)
            for w in (conn.client, conn.upstream):
                w.transport.abort()
            await self._notify()

    async def _pump_up(self, conn: _Connection, reader: asyncio.StreamReader) -> None:
        """Client → server, dropping bytes while blackholed."""
        try:
            while data := await reader.read(_CHUNK):
                if len(conn.sent) < _SENT_LOG:
                    conn.sent += data[: _SENT_LOG - len(conn.sent)].lower()
                if any(needle in conn.sent for needle in self._blackhole_on):
                    conn.blackholed = True
                if self._blackholed or conn.blackholed:
                    self._bytes_dropped_up += len(data)
                    continue
                conn.upstream.write(data)
                self._bytes_up += len(data)
                await conn.upstream.drain()
        except (ConnectionError, OSError):
            conn.abort(rst=True)
            return
        # Client closed its side: close the upstream side too; the server's EOF then ends the rest.
        with contextlib.suppress(Exception):
            conn.upstream.write_eof()

    async def _read_down(self, conn: _Connection, reader: asyncio.StreamReader) -> None:
        """Server → proxy: stamp each chunk with its delivery time and queue it."""
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(_CHUNK):
                if self._blackholed or conn.blackholed:
                    self._bytes_dropped_down += len(data)
                    continue
                conn.pending_down += len(data)
                conn.down_queue.put_nowait((loop.time() + self._delay, data))
                await self._notify()
        except (ConnectionError, OSError):
            conn.abort(rst=True)
        finally:
            conn.down_queue.put_nowait(_EOF)

    async def _deliver_down(self, conn: _Connection) -> None:
        """Proxy → client: honour delay, hold and blackhole, in order."""
        loop = asyncio.get_running_loop()
        released = self._require_started()
        while (item := await conn.down_queue.get()) is not _EOF:
            deliver_at, data = item
            if (wait := deliver_at - loop.time()) > 0:
                await asyncio.sleep(wait)
            await released.wait()
            if conn.aborted:
                return
            conn.pending_down -= len(data)
            if self._blackholed or conn.blackholed:
                self._bytes_dropped_down += len(data)
            else:
                try:
                    conn.client.write(data)
                    await conn.client.drain()
                except (ConnectionError, OSError):
                    conn.abort(rst=True)
                    return
                self._bytes_down += len(data)
            await self._notify()
        # Server closed: pass the close on once everything before it was delivered.
        with contextlib.suppress(Exception):
            conn.client.write_eof()
        conn.client.close()
        conn.upstream.close()
