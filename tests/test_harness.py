"""Tests of the test harness itself: real server processes and the fault proxy."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.faultproxy import FaultProxy
from tests.servers import (
    ServerFactory,
    ServerProcess,
    ServerStartError,
    bundled_valkey_binary,
    free_port,
    main,
    server_binaries,
)


def _ping(url: str, timeout: float = 0.5) -> bool:
    """Synchronous liveness probe that does not depend on the event loop."""
    host_port = url.removeprefix("redis://")
    host, port = host_port.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class TestBinaries:
    def test_bundled_valkey_is_found(self) -> None:
        binary = bundled_valkey_binary()
        assert binary is not None
        assert binary.name == "valkey-server"
        assert binary.is_file()

    def test_env_override_wins(self, monkeypatch: pytest.MonkeyPatch) -> None:
        bundled = bundled_valkey_binary()
        assert bundled is not None
        monkeypatch.setenv("REDIS_SERVER_BIN", str(bundled))
        assert server_binaries() == [bundled]

    def test_env_override_must_exist(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("REDIS_SERVER_BIN", "/nonexistent/redis-server")
        with pytest.raises(ServerStartError, match="REDIS_SERVER_BIN"):
            server_binaries()

    def test_list_prints_bundled_first(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.delenv("REDIS_SERVER_BIN", raising=False)
        assert main(["--list"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == str(bundled_valkey_binary())
        assert all(Path(line).is_file() for line in lines)


class TestServerProcess:
    async def test_session_server_answers(
        self, server: ServerProcess, client: aioredis.Redis
    ) -> None:
        assert await client.ping() is True
        info = await client.info("server")
        assert server.version >= (7, 0, 0)
        assert server.is_valkey == ("valkey_version" in info)
        assert server.url == f"redis://127.0.0.1:{server.port}"

    async def test_debug_command_enabled(self, client: aioredis.Redis) -> None:
        reply = await client.execute_command("DEBUG", "SLEEP", "0")  # type: ignore[no-untyped-call]
        assert reply in (True, b"OK")

    def test_kill_then_restart_same_port(self, server_factory: ServerFactory) -> None:
        srv = server_factory()
        port = srv.port
        srv.kill()
        assert not srv.is_running
        assert not _ping(srv.url)
        srv.restart()
        assert srv.port == port
        assert _ping(srv.url)

    def test_pause_and_resume(self, server_factory: ServerFactory) -> None:
        srv = server_factory()
        srv.pause()
        assert srv.is_paused
        assert not _ping(srv.url, timeout=0.2)
        srv.resume()
        assert _ping(srv.url)

    def test_stop_while_paused_does_not_hang(self, server_factory: ServerFactory) -> None:
        srv = server_factory()
        srv.pause()
        srv.stop(timeout=2)
        assert srv.pid is None

    def test_context_manager_cleans_up(self, server_binary: Path) -> None:
        with ServerProcess(server_binary) as srv:
            pid = srv.pid
            assert pid is not None
            assert _ping(srv.url)
            directory = srv.directory
        assert srv.pid is None
        assert not directory.exists()

    def test_start_failure_reports_log_tail(self, server_binary: Path) -> None:
        srv = ServerProcess(server_binary, extra_args=["--no-such-option", "1"])
        try:
            with pytest.raises(ServerStartError, match="no-such-option") as excinfo:
                srv.start()
            assert "log tail" in str(excinfo.value)
        finally:
            srv.cleanup()

    def test_heal_after_test_killed_shared_server(self, server: ServerProcess) -> None:
        """The session server is restarted for the next test by the _heal_server fixture."""
        server.kill()

    def test_shared_server_is_back(self, server: ServerProcess) -> None:
        assert _ping(server.url)

    def test_free_port_is_bindable(self) -> None:
        port = free_port()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


class TestFaultProxy:
    async def test_passes_traffic_and_counts(self, fault_proxy: FaultProxy) -> None:
        client = aioredis.Redis.from_url(fault_proxy.url)
        try:
            assert await client.set("harness:k", "v")
            assert await client.get("harness:k") == b"v"
        finally:
            await client.aclose()
        stats = fault_proxy.stats
        assert stats.connections_total == 1
        assert stats.bytes_up > 0
        assert stats.bytes_down > 0

    async def test_hold_replies_blocks_until_release(self, fault_proxy: FaultProxy) -> None:
        client = aioredis.Redis.from_url(fault_proxy.url)
        try:
            await client.ping()  # connection set up outside the hold
            fault_proxy.hold_replies()

            async def incr() -> int:
                return await client.incr("harness:counter")

            task = asyncio.create_task(incr())
            held = await fault_proxy.wait_held()
            assert held > 0
            assert not task.done()
            # The command reached the server even though its reply is held back.
            assert await _direct_get(fault_proxy, "harness:counter") is not None
            fault_proxy.release_replies()
            assert await asyncio.wait_for(task, 2) >= 1
        finally:
            fault_proxy.heal()
            await client.aclose()

    async def test_delay_adds_latency(self, fault_proxy: FaultProxy) -> None:
        client = aioredis.Redis.from_url(fault_proxy.url)
        try:
            await client.ping()
            fault_proxy.delay(0.2)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await client.ping()
            assert loop.time() - started >= 0.19
        finally:
            await client.aclose()

    async def test_blackhole_times_out_then_heals(self, fault_proxy: FaultProxy) -> None:
        client = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=0.2)
        try:
            await client.ping()
            fault_proxy.blackhole()
            with pytest.raises(RedisTimeoutError):
                await client.ping()
            assert fault_proxy.stats.bytes_dropped_up > 0
            fault_proxy.heal()
            # The timed-out connection was discarded; a fresh one goes through.
            assert await client.ping() is True
        finally:
            await client.aclose()

    async def test_reset_all_breaks_connection_and_new_one_works(
        self, fault_proxy: FaultProxy
    ) -> None:
        reader, writer = await asyncio.open_connection(fault_proxy.host, fault_proxy.port)
        try:
            writer.write(b"PING\r\n")
            assert await reader.readline() == b"+PONG\r\n"
            assert fault_proxy.reset_all() == 1
            with pytest.raises(ConnectionResetError):
                await reader.read(1)
        finally:
            writer.close()
        assert fault_proxy.stats.resets == 1
        client = aioredis.Redis.from_url(fault_proxy.url)
        try:
            assert await client.ping() is True
        finally:
            await client.aclose()
        assert fault_proxy.stats.connections_total == 2

    async def test_lost_reply_makes_a_retrying_client_run_the_command_twice(
        self, fault_proxy: FaultProxy
    ) -> None:
        """``lose_held``: the command ran, its reply is lost with a RST, redis-py retries it."""
        client = aioredis.Redis(host=fault_proxy.host, port=fault_proxy.port)  # retries by default
        try:
            await client.delete("harness:twice")
            fault_proxy.hold_replies()

            async def incr() -> int:
                return await client.incr("harness:twice")

            task = asyncio.create_task(incr())
            await fault_proxy.wait_held()
            assert fault_proxy.lose_held() == 1
            fault_proxy.release_replies()
            assert await asyncio.wait_for(task, 5) == 2  # ran twice: the retry saw 1
        finally:
            fault_proxy.heal()
            await client.aclose()

    async def test_blackhole_where_silences_only_matching_connections(
        self, fault_proxy: FaultProxy
    ) -> None:
        client = aioredis.Redis.from_url(fault_proxy.url, socket_timeout=0.3)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe("harness:channel")
            confirmation = await pubsub.get_message(timeout=1)
            assert confirmation is not None and confirmation["type"] == "subscribe"
            assert fault_proxy.connections_where(b"SUBSCRIBE") == 1
            assert fault_proxy.blackhole_where(b"SUBSCRIBE") == 1
            await client.publish("harness:channel", "lost")  # other connections still work
            await pubsub.ping()
            assert await pubsub.get_message(timeout=0.3) is None  # nothing comes back
            assert fault_proxy.stats.bytes_dropped_up > 0
            assert fault_proxy.reset_where(b"SUBSCRIBE") == 1
        finally:
            fault_proxy.heal()
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await client.aclose()

    async def test_upstream_down_resets_client(self, server_factory: ServerFactory) -> None:
        srv = server_factory()
        async with FaultProxy(srv.host, srv.port) as proxy:
            srv.kill()
            client = aioredis.Redis.from_url(proxy.url)
            try:
                with pytest.raises(RedisConnectionError):
                    await client.ping()
            finally:
                await client.aclose()


async def _direct_get(proxy: FaultProxy, key: str) -> bytes | str | None:
    """GET straight from the proxy's upstream, bypassing the proxy."""
    direct = aioredis.Redis(host=proxy.upstream_host, port=proxy.upstream_port)
    try:
        return await direct.get(key)
    finally:
        await direct.aclose()
