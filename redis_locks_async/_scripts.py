"""The Lua scripts in ``lua/``: loading, running, and translating their errors.

Scripts are data: each file opens with its ``KEYS``/``ARGV``/returns contract and is read once
with :mod:`importlib.resources` (the wheel carries them as ``redis_locks_async/lua``; a source
checkout reads the top-level ``lua/``). ``lua/prelude.lua`` — the functions every script shares
(server time, fencing, registration, hand-over, announcements) — is prepended to each script
before its SHA1 is taken, so that code exists once: only the definitions the script uses
(:func:`with_prelude`), since a script defines them anew on every call. A script runs with
``EVALSHA`` (on a plain client by the short way of :mod:`._wire`); a server that does not know
it (first use, ``SCRIPT FLUSH``, a restart, a failover) answers ``NOSCRIPT`` and the call falls
back to ``EVAL``, which loads it. The typed wrapper of each script lives
next to the primitive that uses it.

Errors from Redis are translated here, in one place (:func:`translate`): a key of the wrong
type becomes a :class:`LockError` that names the key, anything else a :class:`LockError` chained
to the original.
"""

from __future__ import annotations

import functools
import hashlib
import re
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol, final

from redis.exceptions import ClusterError, NoScriptError, RedisError, ResponseError, TryAgainError

from ._errors import LockError
from ._wire import TORN_DOWN, FastPool, connection_failed, fast_pool, loop_error, run_script

__all__ = (
    "Call",
    "EncodableArg",
    "Script",
    "ScriptClient",
    "explain",
    "ints",
    "key_text",
    "translate",
    "wrong_type_error",
)

EncodableArg = str | int | float | bytes


class ScriptClient(Protocol):
    """The part of a redis.asyncio client (or pipeline) the scripts need."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: EncodableArg) -> object: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: EncodableArg) -> object: ...


# A client whose scripts take another way than its own (a ``RedisCluster``: straight to the
# node that owns the keys, see ``_cluster.Cluster.run_script``) -> that way. Registered by the
# client's topology; empty unless such a client is in use.
ROUTES: Final[
    weakref.WeakKeyDictionary[
        Any, Callable[[Script, Sequence[str | bytes], Sequence[EncodableArg]], Awaitable[object]]
    ]
] = weakref.WeakKeyDictionary()


def _read_source(filename: str) -> str:
    packaged = resources.files("redis_locks_async").joinpath("lua").joinpath(filename)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    checkout = Path(__file__).resolve().parent.parent / "lua" / filename
    return checkout.read_text(encoding="utf-8")


PRELUDE: Final = _read_source("prelude.lua")

_DEFINITION: Final = re.compile(r"^local (?:function )?([A-Za-z_]\w*)", re.MULTILINE)
_COMMENT: Final = re.compile(r"--[^\n]*")  # (no string literal of the scripts holds "--")


@functools.cache
def _prelude_parts(prelude: str) -> tuple[str, dict[str, str], re.Pattern[str] | None]:
    """The prelude's header (its comments), its top-level definitions (name -> text, in their
    order; each runs to the next one), and a pattern that finds their names — parsed once."""
    starts = list(_DEFINITION.finditer(prelude))
    header = prelude[: starts[0].start()] if starts else prelude
    parts = {}
    for here, after in zip(starts, [*starts[1:], None], strict=True):
        parts[here.group(1)] = prelude[here.start() : None if after is None else after.start()]
    names = re.compile(r"\b(" + "|".join(map(re.escape, parts)) + r")\b") if parts else None
    return header, parts, names


def with_prelude(body: str, prelude: str = PRELUDE) -> str:
    """``body`` preceded by the prelude's definitions it uses, directly or through another
    one, in the prelude's order: a script does not pay, on every call, for defining the
    functions it never calls (about 3 µs per call for the whole prelude, Redis 7.0)."""
    header, parts, names = _prelude_parts(prelude)
    needed: set[str] = set()
    todo = [body]
    while todo and names is not None:
        for name in names.findall(_COMMENT.sub("", todo.pop())):
            if name not in needed:
                needed.add(name)
                todo.append(parts[name])
    kept = "".join(text for name, text in parts.items() if name in needed)
    return header + kept + "\n" + body


@final
class Script:
    """One Lua script (prelude included): its source, its SHA1, and how to run it.

    The body is read from ``lua/<filename>`` unless ``source`` is given.
    """

    __slots__ = ("code", "filename", "sha", "source")

    def __init__(self, filename: str, source: str | None = None) -> None:
        self.filename = filename
        body = _read_source(filename) if source is None else source
        self.source = with_prelude(body)
        # Sent as UTF-8 bytes whatever the client's encoding (the comments are not ASCII).
        self.code = self.source.encode("utf-8")
        self.sha = hashlib.sha1(self.code).hexdigest()

    async def run(
        self, client: ScriptClient, keys: Sequence[str | bytes], args: Sequence[EncodableArg]
    ) -> object:
        """Run with ``EVALSHA``; load with ``EVAL`` when the server does not know the script.

        On a plain ``redis.asyncio.Redis`` client the ``EVALSHA`` takes the short way
        (:mod:`._wire`); a client with a route of its own (:data:`ROUTES`) takes that."""
        fast = fast_pool(client)
        try:
            if fast is not None:
                return await self.run_fast(fast, keys, args)
            if ROUTES:
                try:
                    route = ROUTES.get(client)
                except TypeError:  # (not weakly referable: no route of its own)
                    route = None
                if route is not None:
                    return await route(self, keys, args)
            return await self.run_plain(client, keys, args)
        except TORN_DOWN as exc:
            # redis-py's own path lets these through too (a connection torn down under a call
            # by pool.disconnect() meanwhile): a connection error for the callers.
            raise connection_failed(exc) from exc
        except RuntimeError as exc:
            # A connection of an earlier event loop on redis-py's path (a Sentinel's look-up,
            # a pool the runtime's clean-up missed): the command may have been written — a
            # connection error, whose callers send the token-checked undo.
            if loop_error(exc):
                raise connection_failed(exc) from exc
            raise

    async def run_fast(
        self, fast: FastPool, keys: Sequence[str | bytes], args: Sequence[EncodableArg]
    ) -> object:
        """Run it by the short way on ``fast``'s pool (:func:`._wire.run_script`)."""
        try:
            return await run_script(fast, self.sha, tuple(keys), args)
        except NoScriptError:
            return await run_script(fast, self.sha, tuple(keys), args, self.code)

    async def run_plain(
        self, client: ScriptClient, keys: Sequence[str | bytes], args: Sequence[EncodableArg]
    ) -> object:
        """Run it through ``client``'s own ``evalsha`` (and ``eval``)."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            return await client.eval(self.code, len(keys), *keys, *args)  # type: ignore[misc,arg-type]

    def __repr__(self) -> str:
        return f"<Script {self.filename} {self.sha[:8]}>"


class Call(NamedTuple):
    """One script invocation — what a primitive's policy hands the core to run.

    ``narrow``: the keys to name instead when a cluster's slot migration has split the call's
    keys between two nodes (``TRYAGAIN``; redis-py's "TTL exhausted" once it has retried
    that): the keys the hold itself keeps, a prefix of ``keys``. A renewal that also keeps an
    auxiliary key alive goes on through the window without it (helper-80: a ``Semaphore``
    permit, renewed with its meta hash, was lost in a window longer than its lease)."""

    script: Script
    keys: tuple[str | bytes, ...]
    args: tuple[EncodableArg, ...]
    narrow: tuple[str | bytes, ...] | None = None

    def run(self, client: ScriptClient) -> Coroutine[Any, Any, object]:
        """Run it on ``client`` (``EVALSHA``, falling back to ``EVAL``)."""
        if self.narrow is None:
            return self.script.run(client, self.keys, self.args)
        return self._run_narrowing(client)

    def narrowed(self) -> Call:
        """The call naming only :attr:`narrow` (itself when it has none)."""
        if self.narrow is None:
            return self
        return Call(self.script, self.narrow, self.args)

    async def _run_narrowing(self, client: ScriptClient) -> object:
        try:
            return await self.script.run(client, self.keys, self.args)
        except (TryAgainError, ClusterError):
            return await self.narrowed().run(client)


def ints(raw: object, length: int) -> tuple[int, ...]:
    """A script's reply of ``length`` integers (anything else is a :class:`LockError`)."""
    if not isinstance(raw, list) or len(raw) != length:
        raise LockError(f"unexpected script reply {raw!r}")
    return tuple(map(int, raw))


def key_text(key: str | bytes) -> str:
    """A key as an operator reads it (``redis-cli`` style escapes for non-UTF-8 bytes)."""
    if isinstance(key, str):
        return key
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return key.decode("utf-8", "backslashreplace")


def wrong_type_error(lock_name: str, action: str, key: str | bytes) -> LockError:
    """The error for a key of ``lock_name`` that holds a value of another type."""
    return LockError(
        f"cannot {action} {lock_name!r}: key '{key_text(key)}' is not a lock of this kind (it "
        "holds a value of the wrong type, or foreign data); nothing was changed",
        name=lock_name,
    )


async def explain(
    client: object,
    lock_name: str,
    action: str,
    exc: BaseException,
    key_types: Sequence[tuple[str | bytes, str]],
) -> LockError:
    """:func:`translate`, naming the key when the error is ``WRONGTYPE``: each of
    ``key_types`` (key, expected type) is probed with ``TYPE`` (only on this error path)."""
    if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
        for key, expected in key_types:
            try:
                kind = await client.type(key)  # type: ignore[attr-defined]
            except RedisError:
                break
            text = kind.decode() if isinstance(kind, bytes) else str(kind)
            if text not in ("none", expected):
                return wrong_type_error(lock_name, action, key)
    return translate(lock_name, action, exc)


def translate(lock_name: str, action: str, exc: BaseException) -> LockError:
    """A redis-py error as a :class:`LockError` that says which lock and why (chain it)."""
    if isinstance(exc, LockError):
        return exc
    if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
        return LockError(
            f"cannot {action} {lock_name!r}: a key of the lock holds a value of the wrong type",
            name=lock_name,
        )
    return LockError(f"cannot {action} {lock_name!r}: {exc}", name=lock_name)
