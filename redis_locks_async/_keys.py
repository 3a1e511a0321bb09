"""Key and channel names of a lock: one slot per lock, and no two names ever share anything.

The main key of a lock is its name itself, so an operator finds it in ``redis-cli`` under the
name they chose. Everything else a lock needs — its auxiliary keys and its pub/sub channel —
is derived from a **slot prefix** ``P(name)`` that starts with a hash tag hashing to the slot of
the bare name, so a script touching all of a lock's keys touches one cluster slot:

* a name without ``}`` is wrapped: ``P("orders:42") = "{orders:42}"``;
* a name with a valid hash tag keeps it, followed by the whole name:
  ``P("orders:{42}") = "{42}orders:{42}"``;
* a name with a ``}`` but no valid tag (``"a}b"``, ``"{}x"``) gets a short tag found by search that
  hashes to the name's slot, followed by the whole name: ``P("a}b") = "{8713}a}b"``.

``P`` is injective: the prefix always opens with ``{``; its first ``}`` closes the tag; in the
first form nothing follows it, in the other two the full name does. So ``x`` and ``{x}``
(``"{x}"`` vs ``"{x}{x}"``), or ``a}b`` and ``{8713}:a}b``, never share a key or a channel.

Auxiliary keys are ``P(name) + b"\\xff" + kind``. The byte ``0xFF`` never occurs in UTF-8 text,
and lock names are text, so **no lock name can ever equal another lock's auxiliary key** (a lock
named ``"{x}\\xffmeta"`` in Python is the UTF-8 key ``{x}\\xc3\\xbfmeta``). Auxiliary keys are
therefore bytes, and so is the main key (:attr:`LockKeys.key`, the name in UTF-8) and the
channel as the scripts publish and the hub subscribes it (:attr:`LockKeys.wire_channel`):
**every name goes out in UTF-8 whatever the client's ``encoding``**. A client built with
``encoding="latin-1"`` would otherwise send the name ``"{x}\\xffqueue"`` as the bytes of lock
``x``'s queue key; and its hub, which reads channel names as UTF-8, never recognised the
confirmation of a non-ASCII channel (it re-subscribed every 2 s, and its waiters never woke).
Clients of different encodings agree on a lock's keys. In the library channels are text,
``P(name) + ":" + kind`` (:attr:`LockKeys.channel`; channels live in their own namespace, so
only injectivity among channels matters).

The **guard** key (``P(name) + b"\\xffguard"``) is never written: the scripts that may delete or
empty a key declare it (their last ``KEYS``) so that a cluster node whose slot is being migrated
refuses them before they run (``TRYAGAIN``: one of a multi-key command's keys is missing there),
which the client retries like any migration window. Without it such a script ran on the
migrating node when all its keys were still there, and the first command on a key it had itself
deleted or emptied earlier in the run (``DEL`` then ``HSET`` of the lock in a hand-over, the
last waiter's ``ZREM`` then ``ZRANGE`` of the queue) failed the script half-way — a missing key
in a migrating slot — with its earlier writes kept: a release that freed the lock without
handing it over, a ``FairLock`` line that lost its head. It is not an auxiliary key
(:attr:`LockKeys.aux_keys`): nothing ever stores it.

Names never reach Lua source, only ``KEYS``/``ARGV``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import count
from typing import Final, final

__all__ = ("CLUSTER_SLOTS", "LockKeys", "crc16", "hash_tag", "key_slot", "slot_prefix")

CLUSTER_SLOTS: Final = 16384
AUX_SEPARATOR: Final = b"\xff"


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


def key_slot(key: bytes | str) -> int:
    """The cluster slot of ``key``."""
    raw = key.encode("utf-8") if isinstance(key, str) else key
    tag = hash_tag(raw)
    return crc16(raw if tag is None else tag) % CLUSTER_SLOTS


@lru_cache(maxsize=1024)
def _tag_for_slot(slot: int) -> str:
    for candidate in count():
        text = str(candidate)
        if crc16(text.encode()) % CLUSTER_SLOTS == slot:
            return text
    raise AssertionError("unreachable")  # pragma: no cover


def slot_prefix(name: str) -> str:
    """``P(name)``: an injective prefix that hashes to the slot of ``name`` (module docstring)."""
    raw = name.encode("utf-8")
    tag = hash_tag(raw)
    if tag is not None:
        return "{" + tag.decode("utf-8") + "}" + name
    if "}" not in name:
        return "{" + name + "}"
    return "{" + _tag_for_slot(key_slot(raw)) + "}" + name


@final
@dataclass(frozen=True, slots=True)
class LockKeys:
    """Every Redis name one lock uses (see the module docstring for why they never collide)."""

    name: str
    key: bytes
    meta: bytes
    queue: bytes
    done: bytes
    channel: str
    wire_channel: bytes
    guard: bytes

    @classmethod
    def for_name(cls, name: str, kind: str = "lock") -> LockKeys:
        """Lay out the keys of the lock called ``name``.

        ``kind`` is the key layout: "lock" (``Lock``, ``FairLock``: one lock), or another
        primitive's, whose auxiliary keys carry the kind (``{x}\\xffrw.meta``) so that
        primitives of different kinds on one name never read each other's data.
        """
        prefix = slot_prefix(name)
        aux = prefix.encode("utf-8") + AUX_SEPARATOR
        if kind != "lock":
            aux += kind.encode("ascii") + b"."
        channel = prefix + ":" + kind
        return cls(
            name=name,
            key=name.encode("utf-8"),
            meta=aux + b"meta",
            queue=aux + b"queue",
            done=aux + b"done",
            channel=channel,
            wire_channel=channel.encode("utf-8"),
            guard=aux + b"guard",
        )

    @property
    def script_keys(self) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        """The ``KEYS`` of the lock scripts, in their contract order (the guard last)."""
        return (self.key, self.meta, self.queue, self.done, self.guard)

    @property
    def aux_keys(self) -> tuple[bytes, bytes, bytes]:
        """Every key of the lock except the main one."""
        return (self.meta, self.queue, self.done)
