"""The examples are programs: run them for real against the test server (SPEC §7).

Each web example runs in its own server process (uvicorn for FastAPI, ``web.run_app`` for
aiohttp) on a free loopback port with ``REDIS_URL`` pointing at the test server. The test fires
concurrent requests at one order's counter (read-modify-write under the order's lock), checks
that no update was lost and that the fencing tokens grew with every write, then stops the
server with a signal and checks that it shut down cleanly (lifespan / cleanup ran, which closes
the client and the library's tasks; no traceback). Every process is killed in ``finally``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from redis_locks_async import Lock
from tests.servers import LOOPBACK, free_port

# What this checks does not depend on the server: `make test` runs it in its first pass only.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
REQUESTS = 60  # concurrent increments of one counter
START_TIMEOUT = 20.0  # seconds for a server process to answer /health
STOP_TIMEOUT = 15.0  # seconds for a graceful shutdown after the signal


def _env(redis_url: str, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(REDIS_URL=redis_url, PORT=str(port), HOST=LOOPBACK, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_basic_example(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "basic.py")],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "6 writes" in result.stdout


# -- the web examples -----------------------------------------------------------------------


@dataclass(frozen=True)
class WebApp:
    """How to start one web example, and how it ends on each signal."""

    command: Callable[[int], list[str]]  # the argv, given the port
    exit_codes: dict[signal.Signals, int]  # the documented exit status per signal
    closed: str  # what it logs once its shutdown handler ran (the client is closed)


WEB_APPS = {
    # uvicorn shuts down gracefully (the lifespan's shutdown runs), then re-raises the signal
    # it caught so that process managers see it: SIGINT ends in status 0 (its CLI catches the
    # KeyboardInterrupt), SIGTERM ends the process by that signal (-SIGTERM).
    "fastapi": WebApp(
        command=lambda port: [
            sys.executable,
            "-m",
            "uvicorn",
            "fastapi_app:app",
            "--app-dir",
            str(EXAMPLES),
            "--host",
            LOOPBACK,
            "--port",
            str(port),
        ],
        exit_codes={signal.SIGINT: 0, signal.SIGTERM: -signal.SIGTERM},
        closed="Application shutdown complete.",
    ),
    "aiohttp": WebApp(
        command=lambda port: [sys.executable, str(EXAMPLES / "aiohttp_app.py")],
        exit_codes={signal.SIGINT: 0, signal.SIGTERM: 0},
        closed="closed the Redis client",
    ),
}


@dataclass
class Running:
    """A started web example."""

    proc: asyncio.subprocess.Process
    base: str
    stdout: Path
    stderr: Path

    def output(self) -> str:
        return (
            f"exit {self.proc.returncode}\n--- stdout\n{self.stdout.read_text()}\n"
            f"--- stderr\n{self.stderr.read_text()}"
        )


@asynccontextmanager
async def serving(app: WebApp, redis_url: str, logs: Path) -> AsyncIterator[Running]:
    """Start ``app`` in its own process and wait until it answers; kill it in any case."""
    port = free_port()
    stdout, stderr = logs / "stdout.txt", logs / "stderr.txt"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *app.command(port), cwd=ROOT, env=_env(redis_url, port), stdout=out, stderr=err
        )
    running = Running(proc, f"http://{LOOPBACK}:{port}", stdout, stderr)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        async with httpx.AsyncClient(base_url=running.base, timeout=2.0) as http:
            while True:
                assert proc.returncode is None, f"the server died at start\n{running.output()}"
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"no answer\n{running.output()}"
                await asyncio.sleep(0.1)
        yield running
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), STOP_TIMEOUT)


async def _stop(running: Running, sig: signal.Signals) -> int:
    running.proc.send_signal(sig)
    try:
        return await asyncio.wait_for(running.proc.wait(), STOP_TIMEOUT)
    except asyncio.TimeoutError:
        pytest.fail(f"no exit within {STOP_TIMEOUT} s after {sig.name}\n{running.output()}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("which", list(WEB_APPS))
async def test_web_example_loses_no_update(
    which: str, sig: signal.Signals, redis_url: str, client: aioredis.Redis, tmp_path: Path
) -> None:
    app = WEB_APPS[which]
    order = secrets.token_hex(4)
    async with serving(app, redis_url, tmp_path) as running:
        limits = httpx.Limits(max_connections=REQUESTS)
        async with httpx.AsyncClient(base_url=running.base, timeout=30.0, limits=limits) as http:
            replies = await asyncio.gather(
                *(http.post(f"/orders/{order}/increment") for _ in range(REQUESTS))
            )
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            final = (await http.get(f"/orders/{order}")).json()
        # No lost update: every request added one, and saw a different count.
        assert final == {"order_id": order, "count": REQUESTS}
        bodies = sorted((r.json() for r in replies), key=lambda body: body["count"])
        assert [body["count"] for body in bodies] == list(range(1, REQUESTS + 1))
        # Each write carried a newer fencing token than the one before it.
        tokens = [body["fencing_token"] for body in bodies]
        assert tokens == sorted(set(tokens)), tokens
        # The server agrees; and nothing holds the lock any more.
        assert await client.get(f"counter:{{{order}}}") == str(REQUESTS).encode()
        assert not await Lock(client, f"orders:{order}").locked()

        code = await _stop(running, sig)
        assert code == app.exit_codes[sig], running.output()
        errors = running.stderr.read_text()
        assert app.closed in errors, running.output()
        # No traceback, and no task of the library (or anything else) left behind.
        for bad in ("Traceback", "Task was destroyed", "Unclosed", "Task exception"):
            assert bad not in errors, running.output()


# -- anyio ----------------------------------------------------------------------------------


def test_anyio_example(redis_url: str) -> None:
    """Task groups and cancel scopes on the asyncio backend: exclusion, and no lock leaked by
    ``move_on_after`` around ``acquire()`` or ``async with`` at any stage; the trio backend
    (or, where trio is not installed, a thread without an asyncio loop) gets a clear error."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "anyio_tasks.py")],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report = f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, report
    assert "Traceback" not in result.stderr, report
    lines = result.stdout.splitlines()
    assert "1. task group: 20 holds by 4 workers, at most 1 inside at once" in lines, report
    assert (
        "2. move_on_after around acquire(): the waiter gave up; after the release the lock is "
        "free" in lines
    ), report
    assert (
        "3. move_on_after around async with: the scope cancelled the body; the lock is free"
        in lines
    ), report
    stages = re.search(
        r"^4\. 10 acquisitions cut short by move_on_after: (\d+) cancelled, (\d+) completed, "
        r"0 ghost holders$",
        result.stdout,
        re.MULTILINE,
    )
    assert stages is not None, report
    assert int(stages[1]) >= 1, report  # move_on_after(0) cancels before anything is sent
    message = (
        "no asyncio event loop is running. redis-locks-async runs on asyncio only, because "
        "redis.asyncio does"
    )
    if importlib.util.find_spec("trio") is None:
        assert "5. trio backend: not installed here" in result.stdout, report
        assert "   without an asyncio loop: RuntimeError: cannot acquire" in result.stdout
    else:
        assert "5. trio backend: RuntimeError: cannot acquire" in result.stdout, report
    assert message in result.stdout, report
