"""Key layout: every auxiliary key and the channel share the slot of the lock's name."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redis_locks_async import Lock, LockTimeout
from redis_locks_async._keys import LockKeys, crc16, hash_tag, key_slot

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
    for aux in (keys.fence, keys.waiters, keys.waiter_info, keys.channel):
        assert key_slot(aux.encode()) == slot, aux
    assert len({keys.fence, keys.waiters, keys.waiter_info, keys.channel, name}) == 5


def test_layout_is_readable() -> None:
    assert LockKeys.for_name("orders:42").fence == "{orders:42}:fence"
    assert LockKeys.for_name("orders:{42}").fence == "orders:{42}:fence"
    odd = LockKeys.for_name("a}b").fence
    assert odd.endswith(":a}b:fence") and odd.startswith("{")


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(name=names.filter(_utf8))
async def test_any_name_locks_and_frees_cleanly(client: aioredis.Redis, name: str) -> None:
    """S5: unicode, braces and huge names work, and nothing is left behind but the fence."""
    name = "hyp:" + name
    lock = Lock(client, name, lease=5)
    async with lock as lease:
        assert lease.name == name
        assert await client.exists(name) == 1
        with pytest.raises(LockTimeout):
            await asyncio.create_task(_enter(Lock(client, name, timeout=0)))
    keys = LockKeys.for_name(name)
    assert await client.exists(name, keys.waiters, keys.waiter_info) == 0
    await client.delete(keys.fence)


async def _enter(lock: Lock) -> None:
    async with lock:
        pass  # pragma: no cover
