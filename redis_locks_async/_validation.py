"""Argument checks done at the call, before any I/O.

Durations are checked explicitly (a number, finite, in range), never by truthiness, so ``0``,
``-1``, ``nan``, ``inf`` and ``True`` each get a message that says what was wrong.
"""

from __future__ import annotations

import math
from typing import Final

MIN_LEASE: Final = 0.01
"""The shortest lease accepted, in seconds (leases travel to Redis as whole milliseconds)."""

MAX_LEASE: Final = 10 * 365 * 86400.0
"""The longest lease (and claim window, replica timeout, max_hold) accepted, in seconds: ten
years. Longer ones lose their integer form in the scripts' arithmetic (Lua numbers print as
``1e+17``), which the server refuses after part of a script has run."""


def check_name(name: object) -> str:
    """A lock name: a non-empty ``str`` that encodes as UTF-8."""
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("lock name must not be empty")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"lock name {name!r} is not valid UTF-8 text: {exc.reason}") from None
    return name


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    try:
        result = float(value)
    except OverflowError:  # an int beyond any float (10**400): past every finite float
        result = math.inf if value > 0 else -math.inf
    if math.isnan(result):
        raise ValueError(f"{what} must not be NaN")
    return result


def check_lease(value: object, what: str = "lease") -> float:
    """A lease: finite seconds, from :data:`MIN_LEASE` to :data:`MAX_LEASE`."""
    lease = _number(value, what)
    if math.isinf(lease):
        raise ValueError(f"{what} must be finite (an infinite lease could never be recovered)")
    if lease < MIN_LEASE:
        raise ValueError(f"{what} must be at least {MIN_LEASE} s, got {lease!r}")
    if lease > MAX_LEASE:
        raise ValueError(f"{what} must be at most {MAX_LEASE:.0f} s (ten years), got {lease!r}")
    return lease


def check_timeout(value: object, what: str = "timeout") -> float | None:
    """A timeout: ``None`` (wait forever) or seconds >= 0; ``inf`` also means forever."""
    if value is None:
        return None
    timeout = _number(value, what)
    if timeout < 0:
        raise ValueError(f"{what} must be >= 0 or None, got {timeout!r}")
    return None if math.isinf(timeout) else timeout


def to_ms(seconds: float) -> int:
    """Whole milliseconds for the Lua boundary (at least 1)."""
    return max(1, round(seconds * 1000))


MAX_REPLICAS: Final = 2**31 - 1
"""The most replicas an acquisition may wait for (``WAIT`` refuses counts beyond a 64-bit
integer after the lock was taken; no deployment has more than a handful)."""


def check_replicas(replicas: object) -> int:
    """How many replicas must acknowledge an acquisition: an ``int`` from 0 (no replica sync)
    to :data:`MAX_REPLICAS`."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise TypeError(f"replicas must be an int, not {type(replicas).__name__}")
    if replicas < 0:
        raise ValueError(f"replicas must be 0 or more, got {replicas}")
    if replicas > MAX_REPLICAS:
        raise ValueError(f"replicas must be at most {MAX_REPLICAS}, got {replicas}")
    return replicas
