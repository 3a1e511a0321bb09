"""The operator's command line (SPEC §7): ``inspect``, ``list``, ``force-unlock``, ``bench``.

The commands run for real — ``python -m redis_locks_async …`` in a subprocess, against the test
server — while the test holds and waits for locks of every kind through the library, so what
the CLI reports is checked against what the holders know (owner ids, fencing tokens, hold
counts, registered waiters). Argument errors are checked in-process through ``main``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import pytest
import redis.asyncio as aioredis

from redis_locks_async import (
    FairLock,
    Lease,
    Lock,
    LockError,
    LockLostError,
    ReadWriteLock,
    Semaphore,
)
from redis_locks_async._keys import LockKeys
from redis_locks_async._scripts import key_text
from redis_locks_async.cli import main
from tests import _introspect as introspect
from tests.servers import free_port

if TYPE_CHECKING:
    from tests.conftest import Connect

ROOT = Path(__file__).resolve().parent.parent
CLI_TIMEOUT = 20.0
HOLD_LEASE = 60.0  # far longer than any wait below: only the announcement can wake a waiter


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    def __str__(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.out}\n--- stderr\n{self.err}"

    def json(self) -> Any:
        return json.loads(self.out)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


async def cli(url: str, *args: str, stdin: str = "") -> Result:
    """Run ``python -m redis_locks_async ARGS --url URL`` (the event loop keeps running, so
    the test's locks are renewed and its waiters keep listening meanwhile)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "redis_locks_async",
        *args,
        "--url",
        url,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), CLI_TIMEOUT)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


class Lockable(Protocol):
    """What the tests need of a lock object of any kind."""

    async def acquire(self, timeout: float | None = ...) -> bool: ...

    async def release(self) -> None: ...

    @property
    def current_lease(self) -> Lease | None: ...

    async def __aenter__(self) -> Lease: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@dataclass(frozen=True)
class Kind:
    """One primitive: the CLI's name for its layout, a holder and a waiter of it."""

    id: str
    layout: str
    holder: Callable[[aioredis.Redis, str], Lockable]
    waiter: Callable[[aioredis.Redis, str], Lockable]


KINDS = [
    Kind("lock", "lock", lambda c, n: Lock(c, n, lease=HOLD_LEASE), lambda c, n: Lock(c, n)),
    Kind(
        "fair", "lock", lambda c, n: FairLock(c, n, lease=HOLD_LEASE), lambda c, n: FairLock(c, n)
    ),
    Kind(
        "rw",
        "rw",
        lambda c, n: ReadWriteLock(c, n, lease=HOLD_LEASE).write,
        lambda c, n: ReadWriteLock(c, n).read,
    ),
    Kind(
        "sem",
        "sem",
        lambda c, n: Semaphore(c, n, 1, lease=HOLD_LEASE),
        lambda c, n: Semaphore(c, n, 1),
    ),
]


async def _hold(lock: Lockable) -> Lease:
    assert await lock.acquire(timeout=5)
    lease = lock.current_lease
    assert lease is not None
    return lease


class _Waiting:
    """A task of another client waiting for a lock, holding it once granted until stopped."""

    def __init__(self, lock: Lockable) -> None:
        loop = asyncio.get_running_loop()
        self.got: asyncio.Future[Lease] = loop.create_future()
        self._stop = asyncio.Event()
        self.task = asyncio.create_task(self._run(lock))

    async def _run(self, lock: Lockable) -> None:
        assert await lock.acquire(timeout=2 * CLI_TIMEOUT)
        try:
            lease = lock.current_lease
            assert lease is not None
            self.got.set_result(lease)
            await self._stop.wait()
        finally:
            await lock.release()

    async def close(self) -> None:
        self._stop.set()
        if not self.got.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class TestInspect:
    async def test_lock_holder_reentries_token_and_waiters(
        self, connect: Connect, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        lock = Lock(client, name, lease=HOLD_LEASE)
        lease = await _hold(lock)
        assert await lock.acquire()  # a re-entry: 2 holds
        waiting = _Waiting(Lock(connect(), name))
        try:
            await introspect.until_registered(client, name, 1)
            (waiter_id,) = await introspect.registered_waiters(client, name)
            result = await cli(redis_url, "inspect", name, "--json")
            assert result.code == 0, result
            view = result.json()
            assert view["kind"] == "lock"
            assert view["held"] is True
            (holder,) = view["holders"]
            assert holder["owner"] == introspect.lease_owner_id(lease)
            assert holder["token"] == lease.fencing_token
            assert holder["holds"] == 2
            assert 0 < holder["lease_ms"] <= HOLD_LEASE * 1000
            assert view["waiting"] == 1
            assert [(w["owner"], w["live"]) for w in view["waiters"]] == [(waiter_id, True)]
            assert view["waiters"][0]["age_ms"] >= 0

            text = await cli(redis_url, "inspect", name, "-v")
            assert text.code == 0, text
            assert re.search(r"^kind\s+lock \(Lock or FairLock\)$", text.out, re.M), text
            line = rf"^holder\s+{introspect.lease_owner_id(lease)}\s+token {lease.fencing_token}"
            assert re.search(
                line + r"\s+holds 2 \(1 re-entry\)\s+lease left \d+\.\d{3} s$", text.out, re.M
            ), text
            assert re.search(r"^waiters\s+1 registered in Redis$", text.out, re.M), text
            age = rf"^waiter\s+{waiter_id}\s+registered \d+\.\d{{3}} s ago$"
            assert re.search(age, text.out, re.M), text
        finally:
            await lock.release()
            await lock.release()
            await waiting.close()

    async def test_fair_lock_lists_every_waiter_in_order(
        self, connect: Connect, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        lock = FairLock(client, name, lease=HOLD_LEASE)
        lease = await _hold(lock)
        waiters = []
        try:
            for count in (1, 2):
                waiters.append(_Waiting(FairLock(connect(), name)))
                await introspect.until_registered(client, name, count)
            result = await cli(redis_url, "inspect", name, "--json")
            assert result.code == 0, result
            view = result.json()
            assert view["kind"] == "lock"
            assert [h["token"] for h in view["holders"]] == [lease.fencing_token]
            assert view["waiting"] == 2
            ages = [w["age_ms"] for w in view["waiters"]]
            assert ages == sorted(ages, reverse=True)  # oldest registration first
        finally:
            await lock.release()
            for waiting in waiters:
                await waiting.close()

    async def test_read_write_lock_writer_and_readers(
        self, connect: Connect, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        rw = ReadWriteLock(client, name, lease=HOLD_LEASE)
        lease = await _hold(rw.write)
        assert await rw.write.acquire()  # a re-entry of the writer
        waiting = _Waiting(ReadWriteLock(connect(), name).read)
        try:
            await introspect.until_registered(client, name, 1, layout="rw")
            (waiter_id,) = await introspect.registered_waiters(client, name, layout="rw")
            view = (await cli(redis_url, "inspect", name, "--json")).json()
            assert view["kind"] == "rw"
            (writer,) = view["holders"]
            assert writer["side"] == "write"
            assert writer["owner"] == introspect.lease_owner_id(lease)
            assert (writer["token"], writer["holds"]) == (lease.fencing_token, 2)
            assert [(w["owner"], w["role"]) for w in view["waiters"]] == [(waiter_id, "read")]
        finally:
            await rw.write.release()
            await rw.write.release()
        # the waiting reader got in; a second reader of this client joins it
        reader_lease = await asyncio.wait_for(waiting.got, 10)
        second = ReadWriteLock(client, name, lease=HOLD_LEASE).read
        second_lease = await _hold(second)
        try:
            result = await cli(redis_url, "inspect", name, "--kind", "rw", "--json")
            assert result.code == 0, result
            readers = {h["owner"]: h for h in result.json()["holders"]}
            assert set(readers) == {
                introspect.lease_owner_id(reader_lease),
                introspect.lease_owner_id(second_lease),
            }
            assert {h["side"] for h in readers.values()} == {"read"}
            mine = readers[introspect.lease_owner_id(second_lease)]
            assert (mine["token"], mine["holds"]) == (second_lease.fencing_token, 1)
        finally:
            await second.release()
            await waiting.close()

    async def test_semaphore_permits_holders_and_waiters(
        self, connect: Connect, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        sem = Semaphore(client, name, 2, lease=HOLD_LEASE)
        other = Semaphore(connect(), name, 2, lease=HOLD_LEASE)
        leases = [await _hold(sem), await _hold(other)]
        waiting = _Waiting(Semaphore(connect(), name, 2))
        try:
            await introspect.until_registered(client, name, 1, layout="sem")
            result = await cli(redis_url, "inspect", name, "--json")
            assert result.code == 0, result
            view = result.json()
            assert (view["kind"], view["permits"], view["waiting"]) == ("sem", 2, 1)
            assert {(h["owner"], h["token"]) for h in view["holders"]} == {
                (introspect.lease_owner_id(lease), lease.fencing_token) for lease in leases
            }
            text = await cli(redis_url, "inspect", name)
            assert re.search(r"^permits\s+2 \(2 held, 0 free\)$", text.out, re.M), text
        finally:
            await sem.release()
            await other.release()
            await waiting.close()

    async def test_free_foreign_and_mismatched_names(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        free = await cli(redis_url, "inspect", name)
        assert free.code == 1, free
        assert re.search(r"^state\s+free", free.out, re.M), free
        assert (await cli(redis_url, "inspect", name, "--json")).json()["held"] is False

        await client.set(name, "not a lock")
        foreign = await cli(redis_url, "inspect", name)
        assert foreign.code == 2, foreign
        assert "not a lock" in foreign.err, foreign
        await client.delete(name)

        lock = Lock(client, name)
        await _hold(lock)
        try:
            wrong = await cli(redis_url, "inspect", name, "--kind", "sem")
            assert wrong.code == 2, wrong
            assert "not a Semaphore" in wrong.err, wrong
        finally:
            await lock.release()


    async def test_an_auxiliary_key_of_the_wrong_type_is_named(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        """Bug (helper-71): a user's string at a held semaphore's meta key made ``inspect``
        say the semaphore's valid holders set was "a zset that is not a lock", and
        ``--kind sem`` / ``force-unlock`` blame it too; a wrong-type queue of a ``Lock`` was
        shown as "0 waiters". The error names the auxiliary key now; ``list`` still shows such
        a lock (read as it can be)."""
        sem = Semaphore(client, name, 2, lease=HOLD_LEASE)
        await _hold(sem)
        meta = LockKeys.for_name(name, "sem").meta
        try:
            await client.delete(meta)
            await client.set(meta, "user data")
            for args in (("inspect", name), ("inspect", name, "--kind", "sem")):
                result = await cli(redis_url, *args)
                assert result.code == 2, result
                assert f"key '{key_text(meta)}' holds" in result.err, result  # (as redis-cli)
                assert "wrong type" in result.err, result
                assert "not a lock" not in result.err, result
            forced = await cli(redis_url, "force-unlock", name, "--kind", "sem", "--yes")
            assert forced.code == 2 and "sem.meta" in forced.err, forced
            assert await client.zcard(name) == 1  # (nothing was forced)
        finally:
            await client.delete(meta)
            await sem.release()
        lock = Lock(client, name)
        await _hold(lock)
        queue = LockKeys.for_name(name, "lock").queue
        try:
            await client.set(queue, "user data")
            result = await cli(redis_url, "inspect", name)
            assert result.code == 2 and "queue" in result.err, result
            listed = await cli(redis_url, "list", name)
            assert listed.code == 0 and name in listed.out, listed
        finally:
            await client.delete(queue)
            await lock.release()


class TestList:
    async def test_finds_locks_of_every_kind_by_scan_and_skips_the_rest(
        self, connect: Connect, client: aioredis.Redis, redis_url: str
    ) -> None:
        prefix = f"cli-list:{secrets.token_hex(4)}"
        locks: list[Lockable] = [
            Lock(client, f"{prefix}:lock"),
            FairLock(client, f"{prefix}:fair"),
            ReadWriteLock(client, f"{prefix}:rw").write,
            ReadWriteLock(client, f"{prefix}:rwr").read,  # readers only: no writer fields
            Semaphore(client, f"{prefix}:sem", 3),
        ]
        for lock in locks:
            await _hold(lock)
        gone = Lock(client, f"{prefix}:gone")  # free now, its auxiliary keys left behind
        await _hold(gone)
        await gone.release()
        await client.set(f"{prefix}:string", "x")
        await client.hset(f"{prefix}:hash", mapping={"a": "1"})
        await client.hset(f"{prefix}:fake", mapping={"owner": "x"})
        await client.zadd(f"{prefix}:zset", {"m": 1})
        # every auxiliary key matches the pattern too (they contain the name)
        assert any(b"\xff" in key for key in await client.keys(f"*{prefix}*"))
        try:
            keys_before = await _calls(client, "keys")
            result = await cli(redis_url, "list", f"*{prefix}*", "--count", "1", "--json")
            assert result.code == 0, result
            assert await _calls(client, "keys") == keys_before  # SCAN, never KEYS
            found = {entry["name"]: entry for entry in result.json()["locks"]}
            assert {n.removeprefix(f"{prefix}:"): e["kind"] for n, e in found.items()} == {
                "lock": "lock",
                "fair": "lock",
                "rw": "rw",
                "rwr": "rw",
                "sem": "sem",
            }
            assert all(e["holders"] == 1 and e["lease_ms"] > 0 for e in found.values())
            assert result.json()["truncated"] is False

            table = await cli(redis_url, "list", f"*{prefix}*")
            assert table.code == 0, table
            assert table.out.splitlines()[0].split() == ["KIND", "HOLDERS", "LEASE", "LEFT", "NAME"]
            assert re.search(rf"^sem\s+1/3\s+\d+\.\d{{3}} s\s+{prefix}:sem$", table.out, re.M)
            assert len(table.out.splitlines()) == 6, table

            limited = await cli(redis_url, "list", f"*{prefix}*", "--limit", "2", "--json")
            assert limited.code == 0, limited
            assert len(limited.json()["locks"]) == 2
            assert limited.json()["truncated"] is True

            none = await cli(redis_url, "list", f"{prefix}:string*")
            assert none.code == 1, none
        finally:
            for lock in locks:
                await lock.release()


async def _calls(client: aioredis.Redis, command: str) -> int:
    stats = await client.info("commandstats")
    entry = stats.get(f"cmdstat_{command}")
    return int(entry["calls"]) if entry else 0


class TestForceUnlock:
    @pytest.mark.parametrize("kind", KINDS, ids=[k.id for k in KINDS])
    async def test_frees_the_lock_wakes_a_waiter_and_the_holder_loses_its_lease(
        self, connect: Connect, client: aioredis.Redis, redis_url: str, name: str, kind: Kind
    ) -> None:
        holder = kind.holder(connect(), name)
        lease = await _hold(holder)
        waiting = _Waiting(kind.waiter(connect(), name))
        try:
            await introspect.until_registered(client, name, 1, layout=kind.layout)
            result = await cli(redis_url, "force-unlock", name, "--yes")
            assert result.code == 0, result
            owner = introspect.lease_owner_id(lease)
            assert f"removed hold of {owner} (token {lease.fencing_token})" in result.out
            # the waiter's timer would fire at the end of the holder's 60 s lease: only the
            # announcement can wake it this soon
            granted = await asyncio.wait_for(waiting.got, 10)
            assert granted.fencing_token > lease.fencing_token
            with pytest.raises(LockLostError):
                await holder.release()
        finally:
            await waiting.close()

    async def test_asks_for_the_name_and_does_nothing_unless_it_is_typed(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        lock = Lock(client, name, lease=HOLD_LEASE)
        lease = await _hold(lock)
        owner = introspect.lease_owner_id(lease)
        try:
            for answer in ("", "wrong\n", f"{name}x\n"):
                result = await cli(redis_url, "force-unlock", name, stdin=answer)
                assert result.code == 2, result
                assert "Type the lock's name" in result.out, result
                assert "not confirmed: nothing changed" in result.err, result
                assert await introspect.owner_in_redis(client, name) == owner
        finally:
            await lock.release()  # still ours: no LockLostError

        lease = await _hold(lock)
        result = await cli(redis_url, "force-unlock", name, stdin=f"{name}\n")
        assert result.code == 0, result
        assert f"removed hold of {introspect.lease_owner_id(lease)}" in result.out
        assert not await client.exists(name)
        with pytest.raises(LockLostError):
            await lock.release()

    async def test_nothing_held_exits_1_and_touches_nothing(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        result = await cli(redis_url, "force-unlock", name, "--yes")
        assert result.code == 1, result
        assert "not held" in result.err
        await client.set(name, "data")
        foreign = await cli(redis_url, "force-unlock", name, "--yes")
        assert foreign.code == 2, foreign
        assert await client.get(name) == b"data"


class TestNamesThatAreNotPrintable:
    async def test_a_newline_in_a_name_forges_no_row_and_the_name_can_be_confirmed(
        self, client: aioredis.Redis, redis_url: str, name: str
    ) -> None:
        """Bug (helper-64): names were printed as they are, so a held lock named
        ``"x\\nlock  1  29.999 s  orders:42"`` (names are often built from user input) showed
        ``list`` a row for ``orders:42``, which nobody held, and ``inspect`` a second holder
        line; and a name with a newline could not be confirmed at ``force-unlock``'s prompt
        (``readline`` stops at the newline). Such names are shown — and typed — as string
        literals now."""
        forged = f"{name}\nlock        1    29.999 s  {name}:forged\x1b[2K\r"
        lock = Lock(client, forged, lease=HOLD_LEASE)
        lease = await _hold(lock)
        try:
            listed = await cli(redis_url, "list", f"{name}*")
            assert listed.code == 0, listed
            rows = listed.out.splitlines()
            assert len(rows) == 2, listed  # the header and one row
            assert rows[1].endswith(repr(forged)), listed
            assert "\x1b" not in listed.out and "\r" not in listed.out, listed

            inspected = await cli(redis_url, "inspect", forged)
            assert inspected.code == 0, inspected
            assert re.search(r"^name\s+" + re.escape(repr(forged)) + "$", inspected.out, re.M)
            assert [row.split()[0] for row in inspected.out.splitlines()] == [
                "name",
                "kind",
                "state",
                "holder",
                "waiters",
                "fence",
            ], inspected

            typed_raw = await cli(redis_url, "force-unlock", forged, stdin=f"{forged}\n")
            assert typed_raw.code == 2, typed_raw  # (a line of it is not the name)
            assert await introspect.owner_in_redis(client, forged) == introspect.lease_owner_id(
                lease
            )
            typed = await cli(redis_url, "force-unlock", forged, stdin=f"{forged!r}\n")
            assert typed.code == 0, typed
            assert "quotes and escapes included" in typed.out, typed
            assert not await client.exists(forged)
            with pytest.raises(LockLostError):
                await lock.release()
        finally:
            with contextlib.suppress(LockError):
                await lock.release()


class TestArguments:
    @pytest.mark.parametrize(
        "argv",
        [
            [],
            ["nonsense"],
            ["inspect"],
            ["inspect", "x", "--kind", "bogus"],
            ["list", "--count", "0"],
            ["list", "--limit", "many"],
            ["force-unlock"],
            ["force-unlock", "x", "--yes", "extra"],
            # Regression (contract probe): an empty name was "not held" (exit 1), though the
            # library refuses it (ValueError): a bad argument.
            ["inspect", ""],
            ["force-unlock", "", "--yes"],
        ],
        ids=lambda argv: " ".join(a or repr(a) for a in argv) or "nothing",
    )
    def test_usage_errors_exit_2(self, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "usage:" in capsys.readouterr().err

    @pytest.mark.parametrize("command", ["inspect", "force-unlock"])
    def test_bad_url_or_no_server_exits_2(
        self, command: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert (
            main(
                [
                    command,
                    "x",
                    "--yes" if command == "force-unlock" else "-v",
                    "--url",
                    "nosuch://where",
                ]
            )
            == 2
        )
        assert "error:" in capsys.readouterr().err
        closed = f"redis://127.0.0.1:{free_port()}"
        assert main(["list", "--url", closed]) == 2
        assert "error:" in capsys.readouterr().err

    def test_errors_never_show_the_password(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Regression (the error of a refused connection or a bad URL printed the whole URL,
        password included, to the terminal and CI logs)."""
        port = free_port()
        for url in (
            f"redis://admin:s3cret-pw@127.0.0.1:{port}",
            "redis://admin:s3cret-pw@127.0.0.1:notaport",
        ):
            assert main(["inspect", "x", "--url", url]) == 2
            err = capsys.readouterr().err
            assert "error:" in err and "s3cret-pw" not in err and "admin:***@" in err, err
        monkeypatch.setenv("REDIS_URL", f"redis://:s3cret-pw@127.0.0.1:{port}/0")
        assert main(["list"]) == 2
        err = capsys.readouterr().err
        assert "s3cret-pw" not in err and ":***@" in err, err

    @pytest.mark.parametrize("command", ["inspect", "list", "force-unlock"])
    def test_errors_never_show_a_password_given_as_a_query_parameter(
        self, command: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Regression (contract probe, stop 19): redis-py also reads the password from the
        URL's query (``?password=…``), and the error messages printed that one in full."""
        port = free_port()
        argv = {
            "inspect": ["inspect", "x"],
            "list": ["list"],
            "force-unlock": ["force-unlock", "x", "--yes"],
        }[command]
        for url in (
            f"redis://127.0.0.1:{port}/0?password=s3cret-pw",
            f"redis://127.0.0.1:{port}/0?username=u&password=s3cret%2Dpw",
            "unix:///nonexistent/redis.sock?password=s3cret-pw",
        ):
            assert main([*argv, "--url", url]) == 2
            err = capsys.readouterr().err
            assert "error:" in err and "s3cret" not in err and "password=***" in err, err

    @pytest.mark.parametrize("command", [["inspect"], ["force-unlock", "--yes"], ["list"]])
    def test_an_argument_that_is_not_utf8_exits_2(self, command: list[str], tmp_path: Path) -> None:
        """Regression (contract probe, stop 19): a NAME or PATTERN that is not valid UTF-8
        crashed the command with a UnicodeEncodeError traceback and exit code 1, which means
        "not held" / "none found"."""
        result = subprocess.run(
            [sys.executable, "-m", "redis_locks_async", command[0], b"bad\xffname", *command[1:]],
            capture_output=True,
            cwd=ROOT,
            env={**_env(), "REDIS_URL": f"redis://127.0.0.1:{free_port()}"},
            timeout=CLI_TIMEOUT,
        )
        assert result.returncode == 2, result
        assert b"not valid UTF-8" in result.stderr and b"Traceback" not in result.stderr

    async def test_output_a_terminal_cannot_encode_or_a_closed_pipe(
        self, redis_url: str, client: aioredis.Redis, name: str
    ) -> None:
        """Regression (contract probe, stop 19): under a C locale (ASCII output) a held lock
        with a non-ASCII name crashed ``inspect`` with exit code 1 ("not held"), ``list`` and
        ``force-unlock`` likewise; output into a closed pipe did the same. The name is printed
        escaped now, and a closed pipe is an error (2)."""
        unicode_name = name + ":名前"
        lock = Lock(client, unicode_name)
        async with lock:
            c_locale = {**_env(), "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "redis_locks_async",
                "inspect",
                unicode_name,
                "--url",
                redis_url,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=ROOT,
                env=c_locale,
            )
            out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT)
            assert proc.returncode == 0, (out, err)
            assert b"\\u540d\\u524d" in out and b"Traceback" not in err

            read, write = os.pipe()
            os.close(read)  # the reader is gone before anything is written
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "redis_locks_async",
                    "inspect",
                    "-v",
                    "--json",
                    unicode_name,
                    "--url",
                    redis_url,
                    stdout=write,
                    stderr=subprocess.PIPE,
                    cwd=ROOT,
                    env=_env(),
                )
            finally:
                os.close(write)
            _, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT)
            assert proc.returncode == 2, err
            assert b"Traceback" not in err

    def test_help_explains_force_unlock_and_url_default(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as exit_info:
            main(["force-unlock", "--help"])
        assert exit_info.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "lease lost at its next renewal" in text
        assert "$REDIS_URL, else redis://localhost:6379" in text


class TestBench:
    def test_without_the_checkout_says_so_and_exits_2(self, tmp_path: Path) -> None:
        """An installed package (no source checkout around it, no ``benchmarks`` importable)."""
        site = tmp_path / "site"
        shutil.copytree(ROOT / "redis_locks_async", site / "redis_locks_async")
        shutil.copytree(ROOT / "lua", site / "redis_locks_async" / "lua")
        script = (
            "import sys\n"
            f"sys.path[:] = [{str(site)!r}] + [p for p in sys.path if p and "
            f"p != {str(ROOT)!r}]\n"
            "from redis_locks_async.cli import main\n"
            "sys.exit(main(['bench']))\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
            check=False,
        )
        assert result.returncode == 2, result
        assert "benchmark suite is not installed" in result.stderr
        assert "source checkout" in result.stderr

    def test_from_the_checkout_it_finds_the_suite(self) -> None:
        from redis_locks_async.cli._bench import locate_benchmarks

        assert locate_benchmarks(ROOT / "redis_locks_async") == ROOT
