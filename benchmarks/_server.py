"""Which server the benchmarks run against (the process itself is the package's own helper).

Starting and stopping the throwaway server is :func:`redis_locks_async.cli._server.embedded_server`
(free loopback port, no persistence, dies with its parent); this module only resolves
``--server-bin`` and reads a binary's version for the report.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from redis_locks_async.cli._server import ServerUnavailableError as ServerError
from redis_locks_async.cli._server import embedded_server, find_server_binary

__all__ = ("ServerError", "binary_version", "default_binary", "embedded_server", "resolve_binary")


def default_binary() -> Path:
    """``$REDIS_SERVER_BIN``, else ``redis-server`` on ``PATH``, else the bundled Valkey."""
    return find_server_binary()


def resolve_binary(value: str) -> Path:
    """An executable named or pointed to by ``value`` (``--server-bin``)."""
    found = shutil.which(value)
    if found is None:
        raise ServerError(f"--server-bin {value!r} is not an executable file")
    return Path(found)


def binary_version(binary: Path) -> str:
    """The first line of ``binary --version`` (e.g. ``Redis server v=7.0.15 ...``)."""
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if lines else "?"
