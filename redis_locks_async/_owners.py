"""Owner ids: who holds or waits, one fresh id per acquisition.

**Owner ids** are 128-bit keyed hashes (BLAKE2b) of a per-process counter under a per-process
secret from :mod:`secrets`, re-drawn after ``fork``: as unguessable as ``secrets.token_hex(16)``
for anyone without the secret, never repeated, and without a system call per acquisition. Each is
prefixed with the process's random tag (:func:`process_tag`, 8 hex characters), so that the
registrations of one process can be found together when that process is taken for dead.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
from typing import Final

__all__ = ("PROCESS_TAG_LEN", "new_owner_id", "process_tag")

PROCESS_TAG_LEN: Final = 8  # hex characters that begin every owner id of one process

_secret = secrets.token_bytes(32)
_counter = itertools.count(1)
_tag = secrets.token_hex(PROCESS_TAG_LEN // 2)


def _reseed() -> None:
    global _secret, _counter, _tag
    _secret = secrets.token_bytes(32)
    _counter = itertools.count(1)
    _tag = secrets.token_hex(PROCESS_TAG_LEN // 2)


if hasattr(os, "register_at_fork"):  # pragma: no branch - POSIX
    os.register_at_fork(after_in_child=_reseed)


def new_owner_id() -> str:
    """A fresh, unguessable owner id: this process's tag, then 128 bits (hex; module
    docstring)."""
    return (
        _tag
        + hashlib.blake2b(
            next(_counter).to_bytes(8, "little"), key=_secret, digest_size=16
        ).hexdigest()
    )


def process_tag() -> str:
    """What every owner id of this process begins with (random per process, re-drawn after
    ``fork``): a script that finds a process's grantee vanished drops that process's other
    registrations by it (``prelude.lua``, ``evict_vanished``)."""
    return _tag
