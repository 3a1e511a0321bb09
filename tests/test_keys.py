"""Key layout: every auxiliary key and the channel share the slot of the lock's name."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redis_locks_async import Lock, LockTimeout
from redis_locks_async._keys import LockKeys, crc16, hash_tag, key_slot
from tests.conftest import Connect

# Names as users write them: any text, braces in odd places, and some very long ones.
names = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(alphabet="{}ab:", min_size=1, max_size=12),
    st.text(min_size=1, max_size=5).map(lambda s: s * 2000),
)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def test_crc16_reference_value() -> None:
    # The reference value given by the Redis Cluster specification.
    assert crc16(b"123456789") == 0x31C3


@pytest.mark.parametrize(
    ("key", "tag"),
    [
        (b"plain", None),
        (b"{user1000}.following", b"user1000"),
        (b"foo{}{bar}", None),
        (b"foo{{bar}}zap", b"{bar"),
        (b"foo{bar}{zap}", b"bar"),
        (b"{}", None),
        (b"a}b{", None),
    ],
)
def test_hash_tag_rules(key: bytes, tag: bytes | None) -> None:
    assert hash_tag(key) == tag


@given(names.filter(_utf8))
def test_every_key_shares_the_name_slot(name: str) -> None:
    keys = LockKeys.for_name(name)
    slot = key_slot(name.encode())
    assert keys.name == name
    for aux in (*keys.aux_keys, keys.channel):
        assert key_slot(aux) == slot, aux
    assert len({*keys.aux_keys, name.encode()}) == 4


@given(names.filter(_utf8), names.filter(_utf8))
def test_no_two_names_share_a_key_or_a_channel(a: str, b: str) -> None:
    """Regression (issue 5 #1): ``x`` and ``{x}``, ``a}b`` and ``{tag}:a}b``, or a name that
    looks like another lock's auxiliary key shared queue, fence and channel."""
    if a == b:
        return
    ka, kb = LockKeys.for_name(a), LockKeys.for_name(b)
    keys_a = {a.encode(), *ka.aux_keys}
    keys_b = {b.encode(), *kb.aux_keys}
    assert not keys_a & keys_b
    assert ka.channel != kb.channel


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("x", "{x}"),
        ("a}b", "{8713}:a}b"),
        ("a}b", "{8713}a}b"),
        ("x", "{x}:fence"),
        ("x", "{x}\xffmeta"),
        ("{x}", "{x}{x}"),
    ],
)
def test_tricky_pairs_are_disjoint(a: str, b: str) -> None:
    test_no_two_names_share_a_key_or_a_channel.hypothesis.inner_test(a, b)  # type: ignore[attr-defined]


def test_auxiliary_keys_can_never_be_lock_names() -> None:
    """An auxiliary key holds the byte 0xFF, which UTF-8 text (every lock name) never does."""
    for name in ("orders:42", "orders:{42}", "a}b", "\xff", "\u00ff"):
        for aux in LockKeys.for_name(name).aux_keys:
            assert b"\xff" in aux
            with pytest.raises(UnicodeDecodeError):
                aux.decode("utf-8")


def test_layout_is_readable() -> None:
    keys = LockKeys.for_name("orders:42")
    assert keys.meta == b"{orders:42}\xffmeta"
    assert keys.channel == "{orders:42}:lock"
    assert LockKeys.for_name("orders:{42}").meta == b"{42}orders:{42}\xffmeta"
    odd = LockKeys.for_name("a}b").meta
    assert odd.endswith(b"}a}b\xffmeta") and odd.startswith(b"{")
    assert LockKeys.for_name("x", "fair").channel == "{x}:fair"


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(name=names.filter(_utf8))
async def test_any_name_locks_and_frees_cleanly(client: aioredis.Redis, name: str) -> None:
    """S5: unicode, braces and huge names work; what is left behind expires by itself."""
    name = "hyp:" + name
    lock = Lock(client, name, lease=5)
    async with lock as lease:
        assert lease.name == name
        assert await client.exists(name) == 1
        with pytest.raises(LockTimeout):
            await asyncio.create_task(_enter(Lock(client, name, timeout=0)))
    keys = LockKeys.for_name(name)
    assert await client.exists(name) == 0
    for aux in keys.aux_keys:
        assert await client.pttl(aux) in (-2, *range(1, 120_001))  # absent, or expiring
    await client.delete(*keys.aux_keys)


async def _enter(lock: Lock) -> None:
    async with lock:
        pass  # pragma: no cover


# -- clients with another string encoding ---------------------------------------------------


async def test_a_client_encoding_cannot_make_a_name_another_locks_auxiliary_key(
    connect: Connect, name: str
) -> None:
    """Bug (helper-44): on a client built with ``encoding="latin-1"`` the name
    ``"{x}\\xffqueue"`` went out as the bytes of lock ``x``'s queue key (names were encoded
    with the client's encoding, auxiliary keys in UTF-8): holding it made lock ``x`` fail with
    a wrong-type ``LockError``. Every key now goes out in UTF-8."""
    utf8, latin = connect(), connect(encoding="latin-1")
    base = "{" + name + "}"
    lock = Lock(utf8, name, lease=5)
    assert await lock.acquire(timeout=2)
    await lock.release()
    lookalikes = [Lock(latin, base + "\xff" + kind, lease=5) for kind in ("meta", "queue", "done")]
    for other in lookalikes:
        assert await other.acquire(blocking=False)
    assert await lock.acquire(timeout=2)
    await lock.release()
    for other in lookalikes:
        await other.release()
    keys = LockKeys.for_name(name)
    await utf8.delete(*keys.aux_keys, *(LockKeys.for_name(o.name).meta for o in lookalikes))


@pytest.mark.parametrize("decode_responses", [False, True])
async def test_a_client_with_another_encoding_wakes_its_waiters(
    connect: Connect, name: str, decode_responses: bool
) -> None:
    """Bug (helper-44): with ``encoding="latin-1"`` and a non-ASCII name the hub subscribed
    the channel in latin-1 but read channel names as UTF-8: it never recognised the
    confirmation, re-subscribed every 2 s for ever, and a waiter stayed blocked after the
    release. Channels now go out and come back in UTF-8."""
    clients = [connect(encoding="latin-1", decode_responses=decode_responses) for _ in range(2)]
    holder, waiter = (Lock(c, name + ":é", lease=10) for c in clients)
    await woken_by_release([holder], [waiter])


@pytest.mark.parametrize("encoding", ["cp1252", "ascii"])
async def test_a_decoding_client_whose_encoding_cannot_read_the_channel_wakes_its_waiters(
    connect: Connect, name: str, encoding: str
) -> None:
    """Bug (helper-45, after the UTF-8 channels fix): a client that decodes responses in an
    encoding that cannot decode a lock's UTF-8 channel (``cp1252``: ``锁`` is ``e9 94 81``;
    ``ascii``), read through redis-py's ``get_message`` (a ``health_check_interval``):
    redis-py's ``subscribe()`` failed decoding the name, every reconnection failed with it,
    and the client's waiters — of every lock, an ASCII one too — never heard a release. The
    library's pub/sub connections read bytes, whatever the client decodes."""
    options: dict[str, Any] = {
        "encoding": encoding,
        "decode_responses": True,
        "health_check_interval": 10,
    }
    holders = connect()
    waiters = connect(**options)
    names = [name + (":锁" if encoding == "cp1252" else ":é"), name + ":plain"]
    await woken_by_release(
        [Lock(holders, lock_name, lease=10) for lock_name in names],
        [Lock(waiters, lock_name, lease=10) for lock_name in names],
        waiting_for=0.5,
    )


async def test_clients_of_different_encodings_share_a_lock(connect: Connect, name: str) -> None:
    """A non-ASCII name is one lock for clients of any encoding: they exclude each other and
    hear each other's releases (before, each encoding had keys of its own)."""
    utf8, latin = connect(), connect(encoding="latin-1")
    name += ":é"
    first, other = Lock(utf8, name, lease=10), Lock(latin, name, lease=10)

    async def excluded_then_held() -> None:
        if not other.owned():  # (before the release: excluded)
            assert not await other.acquire(blocking=False)
        else:  # (the waiter holds it: the one key, in UTF-8)
            assert await utf8.exists(name.encode()) == 1

    await woken_by_release([first], [other], check=excluded_then_held)


async def woken_by_release(
    held: list[Lock],
    waiters: list[Lock],
    *,
    waiting_for: float = 0.3,
    within: float = 1.0,
    check: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """``held`` are taken; a task per lock of ``waiters`` waits for it (8 s at most) and
    releases it at once; ``waiting_for`` seconds later ``held`` are released, and every
    waiter must have taken its lock ``within`` seconds of that. ``check`` runs after ``held`` are
    taken, and in each waiter's task while it holds its lock."""
    loop = asyncio.get_running_loop()
    for lock in held:
        assert await lock.acquire()
    if check is not None:
        await check()

    async def wait(lock: Lock) -> float:
        assert await lock.acquire(timeout=8)
        woke = loop.time()
        if check is not None:
            await check()
        await lock.release()
        return woke

    tasks = [asyncio.create_task(wait(lock)) for lock in waiters]
    await asyncio.sleep(waiting_for)
    released = loop.time()
    for lock in held:
        await lock.release()
    for task in tasks:
        assert await asyncio.wait_for(task, 10) - released < within
