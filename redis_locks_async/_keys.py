"""Key and channel names for a lock, laid out so every script touches one cluster slot.

The main key of a lock is its name itself, so an operator finds it in ``redis-cli`` under the
name they chose. Auxiliary keys (fencing counter, waiter queue) and the pub/sub channel must
hash to the same slot as the name, or a script touching them all is refused by Redis Cluster:

* a name that already carries a hash tag (``"orders:{42}"``) keeps it: ``orders:{42}:fence``;
* a name without braces is wrapped: ``{orders:42}:fence`` hashes exactly like ``orders:42``;
* the rare name with a ``}`` but no valid tag (``"a}b"``, ``"{}x"``) cannot be wrapped, so a short
  tag that hashes to the name's slot is found by search and used instead: ``{8713}:a}b:fence``.

All three are plain data: names never reach Lua source, only ``KEYS``/``ARGV``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import count
from typing import Final, final

CLUSTER_SLOTS: Final = 16384


def _crc16_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return tuple(table)


_TABLE: Final = _crc16_table()


def crc16(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), the checksum Redis Cluster uses for key slots."""
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _TABLE[((crc >> 8) ^ byte) & 0xFF]
    return crc


def hash_tag(key: bytes) -> bytes | None:
    """The part of ``key`` Redis Cluster hashes, if the key has a valid ``{tag}``."""
    start = key.find(b"{")
    if start < 0:
        return None
    end = key.find(b"}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


def key_slot(key: bytes) -> int:
    """The cluster slot of ``key``."""
    tag = hash_tag(key)
    return crc16(key if tag is None else tag) % CLUSTER_SLOTS


@lru_cache(maxsize=1024)
def _tag_for_slot(slot: int) -> str:
    for candidate in count():
        text = str(candidate)
        if crc16(text.encode()) % CLUSTER_SLOTS == slot:
            return text
    raise AssertionError("unreachable")  # pragma: no cover


def aux_prefix(name: str) -> str:
    """A prefix that hashes to the slot of ``name`` and shows the name to an operator."""
    raw = name.encode("utf-8", "surrogatepass")
    if hash_tag(raw) is not None:
        return name
    if "}" not in name:
        return "{" + name + "}"
    return "{" + _tag_for_slot(key_slot(raw)) + "}:" + name


@final
@dataclass(frozen=True, slots=True)
class LockKeys:
    """Every Redis name one lock uses."""

    name: str
    fence: str
    waiters: str
    waiter_info: str
    channel: str

    @classmethod
    def for_name(cls, name: str) -> LockKeys:
        """Lay out the keys of the lock called ``name``."""
        prefix = aux_prefix(name)
        return cls(
            name=name,
            fence=prefix + ":fence",
            waiters=prefix + ":waiters",
            waiter_info=prefix + ":waiter-info",
            channel=prefix + ":released",
        )

    @property
    def script_keys(self) -> tuple[str, str, str, str]:
        """The ``KEYS`` of the lock scripts, in their contract order."""
        return (self.name, self.fence, self.waiters, self.waiter_info)
