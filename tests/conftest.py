"""Shared fixtures: real servers (tests/servers.py), clients, unique names, fault proxies.

Fixtures
--------
``server_binary`` (session)   the binary every server of this run uses (``server_binaries()[0]``)
``server`` (session)          a started :class:`~tests.servers.ServerProcess`; a test may kill,
                              pause or restart it — it is resumed/restarted after that test
``server_factory`` (function) ``server_factory(*, binary=None, port=None, extra_args=())`` starts a
                              private server; all are killed at teardown
``redis_url`` (session)       URL of the standalone server (a Docker container when the opt-in
                              testcontainers provider is active)
``connect`` (function, async) ``connect(url=redis_url, **kwargs)`` opens more
                              ``redis.asyncio.Redis`` clients; all closed at teardown
``client`` (function, async)  ``redis.asyncio.Redis`` on ``redis_url``; closed at teardown
``name`` (function)           a lock name unique to the test
``fault_proxy`` (function, async) a started :class:`~tests.faultproxy.FaultProxy` in front of
                              ``server``; closed at teardown
``proxy_factory`` (function, async) ``await proxy_factory(host, port)`` for more proxies
``proxied`` (function, async) a client (no retry) whose connections all run through
                              ``fault_proxy``, scripts loaded; faults healed at teardown
"""

from __future__ import annotations

import gc
import os
import secrets
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings

from tests import _introspect as introspect
from tests.faultproxy import FaultProxy
from tests.servers import ServerFactory, ServerProcess, binary_info, server_binaries

# Property tests talk to real servers on a noisy 2-core machine: no per-example deadline (a
# slow example is not a failing one), and no "too slow" health check.
settings.register_profile(
    "real-servers", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("real-servers")

TESTCONTAINERS_ENV = "REDIS_LOCKS_TESTCONTAINERS"


# --------------------------------------------------------------------------------------------
# Header
# --------------------------------------------------------------------------------------------


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Name the server binary and version at the top of every run."""
    try:
        info = binary_info(server_binaries()[0])
    except Exception as exc:  # the header must never break collection
        return [f"redis server: unavailable ({exc})"]
    lines = [f"redis server: {info.describe()}"]
    if _testcontainers_requested():
        lines.append(f"{TESTCONTAINERS_ENV}=1: standalone tests use Docker if reachable")
    return lines


# --------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _quiet_cluster_garbage() -> None:
    """Once a Redis Cluster test ran, collect garbage before each test with
    ``ResourceWarning`` silenced: redis-py's cluster client drops the ``ClusterNode`` objects
    of an old slot map (a redirection, a migration) without closing their connections, and the
    cycle collector finds them at random later — in another module's test, which
    ``filterwarnings = error`` then failed (twice in fresh runs). A test's own leaks still
    surface: only what earlier tests left is collected here."""
    if introspect.CLUSTER_GARBAGE[0]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


@pytest.fixture(scope="session")
def server_binary() -> Path:
    """The server binary of this run (``$REDIS_SERVER_BIN``, else redis-server, else Valkey)."""
    return server_binaries()[0]


@pytest.fixture(scope="session")
def server(server_binary: Path) -> Iterator[ServerProcess]:
    """The session's standalone server (a started :class:`ServerProcess`).

    A test may kill, pause or restart it: ``_heal_server`` gets it running again before the
    next test (its data may then be gone).
    """
    proc = ServerProcess(server_binary)
    try:
        proc.start()
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(autouse=True)
def _heal_server(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used ``server``, resume or restart it if the test left it down."""
    yield
    if "server" in request.fixturenames:
        proc: ServerProcess = request.getfixturevalue("server")
        proc.ensure_running()


@pytest.fixture
def server_factory(server_binary: Path) -> Iterator[ServerFactory]:
    """Start private servers (same binary as ``server`` unless given); all stopped at teardown."""
    started: list[ServerProcess] = []

    def start(
        *,
        binary: Path | str | None = None,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> ServerProcess:
        proc = ServerProcess(binary or server_binary, port=port, extra_args=extra_args)
        started.append(proc)
        return proc.start()

    try:
        yield start
    finally:
        for proc in reversed(started):
            proc.cleanup()


# --------------------------------------------------------------------------------------------
# Optional testcontainers provider (opt-in; never used on machines without a Docker engine)
# --------------------------------------------------------------------------------------------


def _testcontainers_requested() -> bool:
    return os.environ.get(TESTCONTAINERS_ENV, "") == "1"


def _docker_reachable() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def docker_redis_url() -> Iterator[str]:
    """URL of a Redis container started with testcontainers; skips unless opted in and reachable."""
    if not _testcontainers_requested():
        pytest.skip(f"testcontainers provider is opt-in: set {TESTCONTAINERS_ENV}=1")
    if not _docker_reachable():
        pytest.skip("no Docker engine answers")
    from testcontainers.redis import RedisContainer

    image = os.environ.get("REDIS_LOCKS_DOCKER_IMAGE", "redis:7")
    with RedisContainer(image) as container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
        yield f"redis://{host}:{port}"


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest, server: ServerProcess) -> str:
    """URL of the standalone server the ``client`` fixture talks to."""
    if _testcontainers_requested() and _docker_reachable():
        url: str = request.getfixturevalue("docker_redis_url")
        return url
    return server.url


# --------------------------------------------------------------------------------------------
# Clients and names
# --------------------------------------------------------------------------------------------


class Connect(Protocol):
    """The ``connect`` fixture: a new client on ``url`` (default: ``redis_url``)."""

    def __call__(self, url: str | None = None, **kwargs: Any) -> aioredis.Redis: ...


@pytest.fixture
async def connect(redis_url: str) -> AsyncIterator[Connect]:
    """``connect(url=redis_url, **kwargs)``: a new ``redis.asyncio.Redis``; all closed (last
    first) after the test."""
    opened: list[aioredis.Redis] = []

    def open_client(url: str | None = None, **kwargs: Any) -> aioredis.Redis:
        conn = aioredis.Redis.from_url(url or redis_url, **kwargs)
        opened.append(conn)
        return conn

    try:
        yield open_client
    finally:
        for conn in reversed(opened):
            await conn.aclose()


@pytest.fixture
async def client(connect: Connect) -> aioredis.Redis:
    """A ``redis.asyncio.Redis`` on the standalone server, closed after the test."""
    return connect()


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A lock name unique to this test (and to this run)."""
    return f"test:{request.node.name}:{secrets.token_hex(4)}"


# --------------------------------------------------------------------------------------------
# Fault proxies
# --------------------------------------------------------------------------------------------

ProxyFactory = Callable[[str, int], Awaitable[FaultProxy]]


@pytest.fixture
async def proxy_factory() -> AsyncIterator[ProxyFactory]:
    """``await proxy_factory(host, port)``: a started :class:`FaultProxy`, closed at teardown."""
    proxies: list[FaultProxy] = []

    async def start(host: str, port: int) -> FaultProxy:
        proxy = FaultProxy(host, port)
        proxies.append(proxy)
        return await proxy.start()

    try:
        yield start
    finally:
        for proxy in reversed(proxies):
            await proxy.close()


@pytest.fixture
async def fault_proxy(server: ServerProcess, proxy_factory: ProxyFactory) -> FaultProxy:
    """A started :class:`FaultProxy` in front of ``server``; connect clients to ``.url``."""
    return await proxy_factory(server.host, server.port)


@pytest.fixture
async def proxied(fault_proxy: FaultProxy, client: aioredis.Redis) -> AsyncIterator[aioredis.Redis]:
    """A client (``from_url``: no retry) whose every connection runs through ``fault_proxy``:
    connected, scripts loaded (so the first reply of an acquire is the script's, not a
    NOSCRIPT or a handshake). Faults are healed before it is closed. (Three idle connections
    here made another test flaky; a test that needs more warms the pool itself.)"""
    for source in introspect.script_sources():
        await client.script_load(source)
    conn = aioredis.Redis.from_url(fault_proxy.url)
    await conn.ping()
    try:
        yield conn
    finally:
        fault_proxy.heal()
        await conn.aclose()
