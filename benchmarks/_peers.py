"""Which peer libraries are importable here, and their versions.

Peers are optional (the ``bench`` extra installs pottery and python-redis-lock; aioredlock is
installed by hand where it still works): a missing peer is reported, never a failure.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from functools import cache
from typing import Final

# peer key -> (module to import, distribution name)
_PEERS: Final = {
    "redis-locks-async": ("redis_locks_async", "redis-locks-async"),
    "redis-py": ("redis.asyncio.lock", "redis"),
    "pottery": ("pottery", "pottery"),
    "aioredlock": ("aioredlock", "aioredlock"),
    "python-redis-lock": ("redis_lock", "python-redis-lock"),
}


@dataclass(frozen=True, slots=True)
class PeerStatus:
    """Whether one peer library can be used in this environment."""

    key: str
    available: bool
    version: str
    reason: str


@cache
def status(key: str) -> PeerStatus:
    """Import the peer's module once and report whether it works."""
    module, dist = _PEERS[key]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return PeerStatus(key, False, "", "not installed")
    try:
        importlib.import_module(module)
    except Exception as exc:  # any import-time failure means "does not work here"
        return PeerStatus(key, False, version, f"installed but does not import: {exc!r}")
    return PeerStatus(key, True, version, "")


def available(key: str) -> bool:
    """``True`` when the peer imports."""
    return status(key).available


def all_statuses() -> dict[str, PeerStatus]:
    """Every known peer's status, keyed by peer."""
    return {key: status(key) for key in _PEERS}
