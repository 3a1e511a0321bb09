"""The Lua scripts in ``lua/`` and one typed wrapper each.

Scripts are data: each file opens with its ``KEYS``/``ARGV``/returns contract, is read once with
:mod:`importlib.resources` (the wheel carries them as ``redis_locks_async/lua``; a source checkout
reads the top-level ``lua/``), and is run with ``EVALSHA``. The SHA is computed locally, so it is
the same for every client; a server that does not know it (first use, ``SCRIPT FLUSH``, a
restart, a failover) answers ``NOSCRIPT`` and the call falls back to ``EVAL``, which loads it.

Errors from Redis are translated here, in one place: a key of the wrong type becomes a
:class:`LockError` that names the key, anything else a :class:`LockError` chained to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final, NoReturn, Protocol, final

from redis.exceptions import NoScriptError, RedisError, ResponseError

from ._errors import LockError
from ._keys import LockKeys

EncodableArg = str | int | float | bytes


class ScriptClient(Protocol):
    """The part of a redis.asyncio client (or pipeline) the scripts need."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: EncodableArg) -> object: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: EncodableArg) -> object: ...


def _read_source(filename: str) -> str:
    packaged = resources.files("redis_locks_async").joinpath("lua").joinpath(filename)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    checkout = Path(__file__).resolve().parent.parent / "lua" / filename
    return checkout.read_text(encoding="utf-8")


@final
class Script:
    """One Lua script: its source, its SHA1, and how to run it on a client."""

    __slots__ = ("filename", "sha", "source")

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.source = _read_source(filename)
        self.sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()

    async def run(
        self, client: ScriptClient, keys: Sequence[str], args: Sequence[EncodableArg]
    ) -> object:
        """Run with ``EVALSHA``; load with ``EVAL`` when the server does not know the script."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<Script {self.filename} {self.sha[:8]}>"


LOCK_ACQUIRE: Final = Script("lock_acquire.lua")
LOCK_RELEASE: Final = Script("lock_release.lua")
LOCK_EXTEND: Final = Script("lock_extend.lua")
LOCK_SETTLE: Final = Script("lock_settle.lua")


class TypeProbe(Protocol):
    """A client that can tell a key's type (used only to explain a WRONGTYPE error)."""

    def type(self, name: str) -> object: ...


async def raise_translated(
    client: object, keys: Sequence[str], lock_name: str, action: str, exc: BaseException
) -> NoReturn:
    """Re-raise a redis-py error as a :class:`LockError` that says which key and why."""
    if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
        culprit = await _wrong_type_key(client, keys)
        raise LockError(
            f"cannot {action} {lock_name!r}: key {culprit!r} holds a value of the wrong type "
            "(it is not a lock of this kind); nothing was changed",
            name=lock_name,
        ) from exc
    if isinstance(exc, ResponseError) and "not an integer" in str(exc):
        raise LockError(
            f"cannot {action} {lock_name!r}: a key under {lock_name!r} ({', '.join(keys)}) "
            "holds a value this library did not write; nothing was changed",
            name=lock_name,
        ) from exc
    raise LockError(f"cannot {action} {lock_name!r}: {exc}", name=lock_name) from exc


async def _wrong_type_key(client: object, keys: Sequence[str]) -> str:
    expected = {0: "hash", 1: "string", 2: "zset", 3: "hash"}
    probe: TypeProbe = client  # type: ignore[assignment]
    for index, key in enumerate(keys):
        try:
            kind = await probe.type(key)  # type: ignore[misc]
        except RedisError:
            break
        text = kind.decode() if isinstance(kind, bytes) else str(kind)
        if text not in ("none", expected.get(index, text)):
            return key
    return keys[0]


@final
@dataclass(frozen=True, slots=True)
class AcquireReply:
    """What ``lock_acquire.lua`` answered."""

    status: int
    token: int
    count: int
    ttl_ms: int

    @property
    def acquired(self) -> bool:
        """``True`` when the caller holds the lock."""
        return self.status == 1


def _int(reply: object) -> int:
    if not isinstance(reply, (int, bytes, str)):
        raise LockError(f"unexpected script reply {reply!r}")
    return int(reply)


def _ints(reply: object, length: int) -> list[int]:
    if not isinstance(reply, list) or len(reply) != length:
        raise LockError(f"unexpected script reply {reply!r}")
    return [int(item) for item in reply]


async def lock_acquire(
    client: ScriptClient, keys: LockKeys, owner: str, lease_ms: int, mode: str, grace_ms: int
) -> AcquireReply:
    """Run ``lock_acquire.lua`` (see its contract)."""
    reply = await LOCK_ACQUIRE.run(client, keys.script_keys, (owner, lease_ms, mode, grace_ms))
    status, token, count, ttl = _ints(reply, 4)
    return AcquireReply(status, token, count, ttl)


async def lock_release(
    client: ScriptClient, keys: LockKeys, owner: str, mode: str, sharded: bool
) -> tuple[int, int]:
    """Run ``lock_release.lua``: ``(1, count)`` still held, ``(0, 0)`` released, ``(-1, 0)`` not
    the owner."""
    reply = await LOCK_RELEASE.run(
        client, keys.script_keys, (owner, keys.channel, mode, "1" if sharded else "0")
    )
    status, count = _ints(reply, 2)
    return status, count


async def lock_extend(client: ScriptClient, keys: LockKeys, owner: str, lease_ms: int) -> bool:
    """Run ``lock_extend.lua``: ``True`` when ``owner`` still held the lock and it was renewed."""
    reply = await LOCK_EXTEND.run(client, (keys.name,), (owner, lease_ms))
    return _int(reply) == 1


async def lock_settle(client: ScriptClient, keys: LockKeys, owner: str, expected: int) -> int:
    """Run ``lock_settle.lua``: the hold count after undoing an unseen re-entry (-1: not held)."""
    reply = await LOCK_SETTLE.run(client, (keys.name,), (owner, expected))
    return _int(reply)
