"""``inspect`` and ``list``: what the server says about the locks of this library.

Everything is read, nothing written. A lock is recognised by its main key — named like the
lock — and that key's type and fields (the layout of ``_keys.py`` and ``lua/``):

* ``Lock`` / ``FairLock`` (kind ``lock``; the two share one layout and cannot be told apart): a
  hash with ``owner``, ``token`` and one ``e:<id>`` field per re-entry; its TTL is the lease;
* ``ReadWriteLock`` (kind ``rw``): a hash of ``w``, ``wt``, ``wx``, ``we`` (the writer) and one
  ``r:<owner>`` field per reader, each hold with its own expiry (server milliseconds);
* ``Semaphore`` (kind ``sem``): a sorted set of holders scored by expiry, next to a
  ``sem.meta`` hash that records the permit count and each holder's token.

One lock is read in one ``MULTI`` (:func:`read_view`): the main key as a hash and as a sorted
set (one of them fails with ``WRONGTYPE``, which tells the type), the server's clock, and the
meta hash and waiting line of every kind — so the view is one consistent snapshot, and the kind
of a free lock can still be told from its auxiliary keys. Holds whose expiry has passed are not
shown (the next script that looks drops them). Waiters are those *registered in Redis*: one per
waiting process for ``Lock`` (its other tasks queue locally), every waiter for the others.

``list`` walks the keyspace with ``SCAN … MATCH`` (never ``KEYS``), skips auxiliary keys (they
contain the byte 0xFF, which no lock name can), pre-filters the candidates with a few cheap
commands per key in one pipeline, and reads each candidate with :func:`read_view`.

On a Redis Cluster (:class:`Servers` finds out with ``INFO cluster``) each lock is read and
written on the primary that serves its slot — every key of a lock is in that one slot — through
a plain connection to that node, so the snapshot is still one ``MULTI``; ``list`` scans every
primary in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, TextIO, TypeVar, final
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from .._keys import AUX_SEPARATOR, LockKeys
from .._scripts import key_text

__all__ = (
    "KINDS",
    "Holder",
    "LockView",
    "Servers",
    "Waiter",
    "connect",
    "detect",
    "read_view",
    "redacted",
    "run_inspect",
    "run_list",
    "scrubbed",
)

KINDS: Final = ("lock", "rw", "sem")
KIND_TITLES: Final = {"lock": "Lock or FairLock", "rw": "ReadWriteLock", "sem": "Semaphore"}
_RW_WRITER_FIELDS: Final = frozenset((b"w", b"wt", b"wx", b"we"))
_LOCK_FIELDS: Final = frozenset((b"owner", b"token"))

EXIT_OK: Final = 0
EXIT_NOTHING: Final = 1
EXIT_USAGE: Final = 2

_T = TypeVar("_T")


class CliError(Exception):
    """A failure the command reports in one line on stderr, with exit code 2."""


@final
@dataclass(frozen=True, slots=True)
class Holder:
    """One live hold: ``side`` is "" (a lock), "write"/"read" (a read/write lock) or "permit"."""

    owner: str
    side: str
    token: int | None
    holds: int  # 1 + re-entries
    lease_ms: int | None  # lease left; None: no expiry


@final
@dataclass(frozen=True, slots=True)
class Waiter:
    """One waiter registered in Redis (``role``: "", or "read"/"write" for a read/write lock)."""

    owner: str
    role: str
    age_ms: int  # since its registration (server time)
    live: bool  # its registration has not expired


@final
@dataclass(frozen=True, slots=True)
class LockView:
    """One lock as the server has it at one instant (``kind`` None: no trace of any kind)."""

    name: str
    kind: str | None
    holders: tuple[Holder, ...]
    waiters: tuple[Waiter, ...]
    fence: int | None  # the highest token recorded in meta (fence floor of the next one)
    permits: int | None  # a semaphore's permit count

    @property
    def held(self) -> bool:
        """Whether anybody holds the lock."""
        return bool(self.holders)

    @property
    def live_waiters(self) -> int:
        """How many registered waiters are live."""
        return sum(1 for waiter in self.waiters if waiter.live)

    @property
    def lease_ms(self) -> int | None:
        """The longest lease left among the holders (when it is free at the latest)."""
        leases = [h.lease_ms for h in self.holders]
        if not leases:
            return None
        if None in leases:
            return None
        return max(lease for lease in leases if lease is not None)

    def to_json(self) -> dict[str, Any]:
        """The view as plain JSON data (the ``--json`` output of ``inspect``)."""
        data = asdict(self)
        data["held"] = self.held
        data["waiting"] = self.live_waiters
        return data


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _secrets(url: str) -> list[str]:
    """The passwords ``url`` carries: in its user info (``user:pass@``) and as the
    ``password`` query parameter redis-py also reads — raw and decoded."""
    try:
        parts = urlsplit(url)
        found = [parts.password] if parts.password else []
    except ValueError:
        return []
    for name, raw in (pair.partition("=")[::2] for pair in parts.query.split("&")):
        if unquote(name) == "password" and raw:
            found += [raw, unquote(raw)]
    # Longest first: a decoded password that contains the raw one is blanked whole.
    return sorted({secret for secret in found if secret}, key=len, reverse=True)


def redacted(url: str) -> str:
    """``url`` as it may be printed: a password in it (``user:pass@``, ``?password=``)
    replaced by ``***``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<the URL given>"
    if password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{user}:***@{host}")
    if parts.query:
        pairs = [pair.partition("=") for pair in parts.query.split("&")]
        parts = parts._replace(
            query="&".join(
                f"{name}{sep}***" if unquote(name) == "password" and sep else f"{name}{sep}{value}"
                for name, sep, value in pairs
            )
        )
    return urlunsplit(parts)


def scrubbed(text: str, url: str) -> str:
    """``text`` (an error message) with ``url``'s passwords, should it quote them, blanked."""
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


def connect(url: str) -> aioredis.Redis:
    """A client on ``url`` with bounded timeouts (a bad URL is a :class:`CliError`)."""
    try:
        return aioredis.Redis.from_url(url, **_TIMEOUTS)
    except ValueError as exc:
        raise CliError(f"bad --url {redacted(url)!r}: {scrubbed(str(exc), url)}") from None


_TIMEOUTS: Final[dict[str, Any]] = {"socket_connect_timeout": 5.0, "socket_timeout": 10.0}


def _at(url: str, host: str, port: int) -> str:
    """``url`` (its scheme, credentials, database and options) pointed at ``host:port``."""
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=f"{user}@{where}" if user else where))


class Servers:
    """Where a command reads and writes: the one server ``url`` names, or — when that is a
    node of a Redis Cluster — the primary serving a lock's slot (:meth:`for_name`) and every
    primary in turn (:meth:`primaries`), each through a plain client of its own."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._seed = connect(url)
        self._cluster: RedisCluster | None = None
        self._nodes: dict[tuple[str, int], aioredis.Redis] = {}

    @property
    def clustered(self) -> bool:
        """Whether ``url`` named a node of a Redis Cluster (known after :meth:`open`)."""
        return self._cluster is not None

    async def open(self) -> None:
        """Find out whether the server is a cluster node (and then the cluster's layout)."""
        try:
            info = await self._seed.info("cluster")
        except ResponseError:
            return  # INFO refused (an ACL user without it): a single server, as far as we know
        if not int(info.get("cluster_enabled", 0)):
            return
        try:
            cluster = RedisCluster.from_url(self._url, **_TIMEOUTS)
        except ValueError as exc:
            raise CliError(
                f"bad --url {redacted(self._url)!r}: {scrubbed(str(exc), self._url)}"
            ) from None
        self._cluster = cluster
        await cluster.initialize()

    async def for_name(self, name: str) -> aioredis.Redis:
        """The client of the server that keeps the lock ``name``."""
        if self._cluster is None:
            return self._seed
        node = self._cluster.get_node_from_key(name)
        if node is None:
            raise CliError(f"no cluster node serves the slot of {name!r}")
        return self._node(node.host, int(node.port))

    async def primaries(self) -> list[aioredis.Redis]:
        """The client of every server that keeps locks (one; or each cluster primary)."""
        if self._cluster is None:
            return [self._seed]
        nodes = sorted(self._cluster.get_primaries(), key=lambda node: (node.host, node.port))
        return [self._node(node.host, int(node.port)) for node in nodes]

    def _node(self, host: str, port: int) -> aioredis.Redis:
        client = self._nodes.get((host, port))
        if client is None:
            client = self._nodes[(host, port)] = connect(_at(self._url, host, port))
        return client

    async def aclose(self) -> None:
        """Close every client this opened."""
        for client in (self._seed, *self._nodes.values()):
            await client.aclose()
        if self._cluster is not None:
            await self._cluster.aclose()


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _int(value: object) -> int | None:
    try:
        return int(_text(value))
    except ValueError:
        return None


def _entries(text: bytes | str) -> int:
    """How many re-entries a ",e1,e2," list records."""
    return sum(1 for part in _text(text).split(",") if part)


def classify_hash(fields: Mapping[bytes, bytes]) -> str | None:
    """The kind of lock a hash with these fields is, if it is one."""
    names = set(fields)
    if names >= _LOCK_FIELDS and all(f in _LOCK_FIELDS or f.startswith(b"e:") for f in names):
        return "lock"
    if names and all(f in _RW_WRITER_FIELDS or f.startswith(b"r:") for f in names):
        return "rw"
    return None


@final
@dataclass(frozen=True, slots=True)
class _Snapshot:
    key_type: str
    fields: dict[bytes, bytes]
    members: list[tuple[bytes, float]]
    pttl: int
    now_us: int
    metas: dict[str, dict[bytes, bytes]]
    queues: dict[str, list[tuple[bytes, float]]]
    # per kind, its auxiliary keys that hold a value of another type (read as empty above)
    wrong: dict[str, tuple[str | bytes, ...]]


async def _snapshot(client: aioredis.Redis, name: str) -> _Snapshot:
    pipe = client.pipeline(transaction=True)
    pipe.type(name)
    pipe.pttl(name)
    pipe.time()
    pipe.hgetall(name)
    pipe.zrange(name, 0, -1, withscores=True)
    for kind in KINDS:
        keys = LockKeys.for_name(name, kind)
        pipe.hgetall(keys.meta)
        pipe.zrange(keys.queue, 0, -1, withscores=True)
    replies = await pipe.execute(raise_on_error=False)
    for reply in replies[:3]:
        if isinstance(reply, Exception):
            raise reply
    seconds, micros = replies[2]

    def ok(reply: _T | Exception, empty: _T) -> _T:
        # The reply of a key of another type is WRONGTYPE: for this view, an empty value.
        return empty if isinstance(reply, Exception) else reply

    metas, queues = {}, {}
    wrong: dict[str, tuple[str | bytes, ...]] = {}
    for index, kind in enumerate(KINDS):
        keys = LockKeys.for_name(name, kind)
        meta, queue = replies[5 + 2 * index], replies[6 + 2 * index]
        metas[kind] = ok(meta, {})
        queues[kind] = ok(queue, [])
        wrong[kind] = tuple(
            key
            for key, reply in ((keys.meta, meta), (keys.queue, queue))
            if isinstance(reply, Exception)
        )
    return _Snapshot(
        key_type=_text(replies[0]),
        fields=ok(replies[3], {}),
        members=ok(replies[4], []),
        pttl=int(replies[1]),
        now_us=int(seconds) * 1_000_000 + int(micros),
        metas=metas,
        queues=queues,
        wrong=wrong,
    )


def detect(snap: _Snapshot) -> str | None:
    """The kind the main key is, or — when it does not exist — the kind whose auxiliary keys
    exist ("" when the key exists but is no lock of this library; None: no trace at all)."""
    if snap.key_type == "hash":
        return classify_hash(snap.fields) or ""
    if snap.key_type == "zset":
        return "sem" if b"permits" in snap.metas["sem"] else ""
    if snap.key_type != "none":
        return ""
    for kind in KINDS:
        if snap.queues[kind]:
            return kind
    for kind in KINDS:
        if snap.metas[kind]:
            return kind
    return None


def _holders(kind: str, snap: _Snapshot) -> list[Holder]:
    now_ms = snap.now_us // 1000
    fields = snap.fields
    if kind == "lock":
        if snap.key_type != "hash" or b"owner" not in fields:
            return []
        return [
            Holder(
                owner=_text(fields[b"owner"]),
                side="",
                token=_int(fields.get(b"token", b"")),
                holds=len(fields) - 1,
                lease_ms=snap.pttl if snap.pttl >= 0 else None,
            )
        ]
    if kind == "rw":
        if snap.key_type != "hash":
            return []
        found = []
        writer_expiry = _int(fields.get(b"wx", b""))
        if b"w" in fields and writer_expiry is not None and writer_expiry >= now_ms:
            found.append(
                Holder(
                    owner=_text(fields[b"w"]),
                    side="write",
                    token=_int(fields.get(b"wt", b"")),
                    holds=1 + _entries(fields.get(b"we", b"")),
                    lease_ms=writer_expiry - now_ms,
                )
            )
        for field, value in sorted(fields.items()):
            if not field.startswith(b"r:"):
                continue
            expiry, _, rest = _text(value).partition(":")
            token, _, entries = rest.partition(":")
            reader_expiry = _int(expiry)
            if reader_expiry is None or reader_expiry < now_ms:
                continue
            found.append(
                Holder(
                    owner=_text(field[2:]),
                    side="read",
                    token=_int(token),
                    holds=1 + _entries(entries),
                    lease_ms=reader_expiry - now_ms,
                )
            )
        return found
    if snap.key_type != "zset":
        return []
    meta = snap.metas["sem"]
    return [
        Holder(
            owner=_text(member),
            side="permit",
            token=_int(meta.get(b"t:" + member, b"")),
            holds=1,
            lease_ms=int(score) - now_ms,
        )
        for member, score in sorted(snap.members, key=lambda item: item[1])
        if int(score) >= now_ms
    ]


_ROLES: Final = {"": "", "r": "read", "R": "read", "w": "write"}


def _waiters(kind: str, snap: _Snapshot) -> list[Waiter]:
    meta = snap.metas[kind]
    now_ms = snap.now_us // 1000
    found = []
    for member, arrival in snap.queues[kind]:
        # "w:<owner>" -> "<deadline ms>:<lease ms>:<claim ms>:<role>" (lua/prelude.lua)
        parts = _text(meta.get(b"w:" + member, b"")).split(":")
        deadline = _int(parts[0]) if parts[0] else None
        role = parts[3] if len(parts) > 3 else ""
        found.append(
            Waiter(
                owner=_text(member),
                role=_ROLES.get(role, role),
                age_ms=max(0, (snap.now_us - int(arrival)) // 1000),
                live=deadline is not None and deadline >= now_ms,
            )
        )
    return found


async def read_view(
    client: aioredis.Redis, name: str, kind: str | None = None, *, strict: bool = True
) -> LockView:
    """The lock ``name`` as the server has it now, read as ``kind`` (default: detected).

    Raises :class:`CliError` when the key exists but is not a lock of this library (of
    ``kind``, when given), and — ``strict`` — when one of its auxiliary keys holds a value
    of another type (naming that key; not ``strict``: read as empty, as ``list`` shows it).
    """
    snap = await _snapshot(client, name)
    found = detect(snap)
    if found == "" and snap.key_type == "zset" and snap.wrong["sem"] and kind in (None, "sem"):
        found = "sem"  # (a semaphore's holders, whose meta cannot tell it: named below)
    if kind is None:
        if found == "":
            raise CliError(f"{name!r} is a {snap.key_type} that is not a lock of redis-locks-async")
        kind = found
    elif snap.key_type != "none" and found != kind:
        what = f"a {KIND_TITLES[found]}" if found else f"a {snap.key_type} that is no lock"
        raise CliError(f"{name!r} is not a {KIND_TITLES[kind]} (--kind {kind}): it is {what}")
    if kind is None:
        aux = next((keys for keys in snap.wrong.values() if keys), ())
        if aux and strict:
            raise _wrong_type(name, aux[0])
        return LockView(name, None, (), (), None, None)
    if snap.wrong[kind] and strict:
        raise _wrong_type(name, snap.wrong[kind][0])
    meta = snap.metas[kind]
    return LockView(
        name=name,
        kind=kind,
        holders=tuple(_holders(kind, snap)),
        waiters=tuple(_waiters(kind, snap)),
        fence=_int(meta[b"fence"]) if b"fence" in meta else None,
        permits=_int(meta[b"permits"]) if kind == "sem" and b"permits" in meta else None,
    )


def _wrong_type(name: str, key: str | bytes) -> CliError:
    return CliError(
        f"{name!r} cannot be read: its key '{key_text(key)}' holds a value of the wrong type "
        "(foreign data, not written by redis-locks-async)"
    )


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def shown(text: str) -> str:
    """``text`` (a lock name, an owner read from the server) as a line of output may show it:
    as it is when every character is printable, else as a Python string literal — a name
    with a newline, a carriage return or an escape sequence (names are often built from user
    input) would otherwise forge rows of ``list`` or lines of ``inspect``, or drive the
    operator's terminal."""
    return text if text.isprintable() else repr(text)


def seconds(ms: int | None) -> str:
    """A lease or an age for people: "29.512 s", "no expiry"."""
    return "no expiry" if ms is None else f"{ms / 1000:.3f} s"


def _holder_line(holder: Holder) -> str:
    reentries = holder.holds - 1
    side = f"{holder.side} " if holder.side else ""
    holds = ""
    if holder.side != "permit":  # a permit is never re-entered
        plural = "y" if reentries == 1 else "ies"
        holds = f"  holds {holder.holds} ({reentries} re-entr{plural})"
    left = seconds(holder.lease_ms)
    return f"{side}{shown(holder.owner)}  token {holder.token}{holds}  lease left {left}"


def render_view(view: LockView, verbose: bool, out: TextIO) -> None:
    """``inspect``'s human-readable report."""
    rows: list[tuple[str, str]] = [("name", shown(view.name))]
    if view.kind is None:
        rows.append(("state", "free (no key of any kind of lock in Redis)"))
    else:
        rows.append(("kind", f"{view.kind} ({KIND_TITLES[view.kind]})"))
        if view.kind == "sem":
            permits = "unknown" if view.permits is None else str(view.permits)
            free = "" if view.permits is None else f", {view.permits - len(view.holders)} free"
            rows.append(("permits", f"{permits} ({len(view.holders)} held{free})"))
        rows.append(("state", f"held by {len(view.holders)}" if view.held else "free"))
        rows.extend(("holder", _holder_line(holder)) for holder in view.holders)
        dead = len(view.waiters) - view.live_waiters
        note = f" (+{dead} expired registration{'s' if dead != 1 else ''})" if dead else ""
        rows.append(("waiters", f"{view.live_waiters} registered in Redis{note}"))
        if verbose:
            for waiter in view.waiters:
                role = f"{waiter.role} " if waiter.role else ""
                status = "" if waiter.live else "  (expired)"
                age = seconds(waiter.age_ms)
                rows.append(
                    ("waiter", f"{role}{shown(waiter.owner)}  registered {age} ago{status}")
                )
        rows.append(("fence", "none recorded" if view.fence is None else str(view.fence)))
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        out.write(f"{label:<{width}}  {value}\n")


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def run_command(url: str, body: Callable[[Servers], Coroutine[Any, Any, int]]) -> int:
    """Run ``body`` with the servers of ``url``; report a :class:`CliError` or a Redis failure
    on stderr with exit code 2."""

    async def main() -> int:
        servers = Servers(url)
        try:
            await servers.open()
            return await body(servers)
        finally:
            await servers.aclose()

    try:
        return asyncio.run(main())
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
    except RedisError as exc:
        print(f"error: {redacted(url)}: {scrubbed(str(exc), url)}", file=sys.stderr)
    return EXIT_USAGE


def run_inspect(args: argparse.Namespace) -> int:
    """``inspect NAME``: exit 0 when held, 1 when not held, 2 on errors."""

    async def body(servers: Servers) -> int:
        view = await read_view(await servers.for_name(args.name), args.name, args.kind)
        if args.json:
            json.dump(view.to_json(), sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            render_view(view, args.verbose, sys.stdout)
        return EXIT_OK if view.held else EXIT_NOTHING

    return run_command(args.url, body)


def _may_be_lock(key_type: bytes, hmget: object, field: object, permits: object) -> bool:
    """The cheap pre-filter of ``list`` (read_view decides)."""
    if key_type == b"zset":
        return permits is not None and not isinstance(permits, Exception)
    if key_type != b"hash" or isinstance(hmget, Exception) or not isinstance(hmget, list):
        return False
    owner, token, writer, writer_token = hmget
    if owner is not None and token is not None:
        return True
    if writer is not None or writer_token is not None:
        return True
    return isinstance(field, list) and bool(field) and bytes(field[0]).startswith(b"r:")


async def find_locks(
    client: aioredis.Redis, pattern: str, count: int, limit: int
) -> tuple[list[LockView], bool]:
    """The locks whose names match ``pattern`` (SCAN), at most ``limit``; and whether the
    scan stopped at the limit."""
    found: list[LockView] = []
    cursor = 0
    while True:
        cursor, keys = await client.scan(cursor, match=pattern, count=count)
        names = []
        for key in keys:
            raw = key if isinstance(key, bytes) else str(key).encode("utf-8")
            if AUX_SEPARATOR in raw:
                continue
            try:
                names.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                continue  # lock names are text
        if names:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.type(name)
                pipe.hmget(name, ["owner", "token", "w", "wt"])
                pipe.hrandfield(name, 1)
                pipe.hget(LockKeys.for_name(name, "sem").meta, "permits")
            replies = await pipe.execute(raise_on_error=False)
            for index, name in enumerate(names):
                key_type, hmget, field, permits = replies[4 * index : 4 * index + 4]
                if isinstance(key_type, Exception) or not _may_be_lock(
                    key_type, hmget, field, permits
                ):
                    continue
                try:
                    view = await read_view(client, name, strict=False)
                except CliError:
                    continue  # not a lock after all, or changed meanwhile
                if view.kind is None or not view.held:
                    continue
                found.append(view)
                if len(found) >= limit:
                    return found, cursor != 0 or index + 1 < len(names)
        if cursor == 0:
            return found, False


def render_list(views: Sequence[LockView], out: TextIO) -> None:
    """``list``'s table: kind, holders, lease left, name."""
    rows = [("KIND", "HOLDERS", "LEASE LEFT", "NAME")]
    for view in views:
        holders = str(len(view.holders))
        if view.kind == "sem" and view.permits is not None:
            holders += f"/{view.permits}"
        rows.append((view.kind or "", holders, seconds(view.lease_ms), shown(view.name)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        out.write(
            f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}\n"
        )


def run_list(args: argparse.Namespace) -> int:
    """``list [PATTERN]``: exit 0 when locks were found, 1 when none, 2 on errors."""

    async def body(servers: Servers) -> int:
        views: list[LockView] = []
        truncated = False
        primaries = await servers.primaries()
        for index, client in enumerate(primaries):
            found, truncated = await find_locks(
                client, args.pattern, args.count, args.limit - len(views)
            )
            views.extend(found)
            if len(views) >= args.limit:
                # Stopped at the limit: more may match here or on the primaries not scanned.
                truncated = truncated or index + 1 < len(primaries)
                break
        if args.json:
            data = {
                "locks": [
                    {
                        "name": view.name,
                        "kind": view.kind,
                        "holders": len(view.holders),
                        "lease_ms": view.lease_ms,
                        "waiting": view.live_waiters,
                        "permits": view.permits,
                    }
                    for view in views
                ],
                "truncated": truncated,
            }
            json.dump(data, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            render_list(views, sys.stdout)
            if not views:
                print(f"no held lock matches {args.pattern!r}", file=sys.stderr)
            if truncated:
                print(f"(stopped at --limit {args.limit}; there may be more)", file=sys.stderr)
        return EXIT_OK if views else EXIT_NOTHING

    return run_command(args.url, body)
