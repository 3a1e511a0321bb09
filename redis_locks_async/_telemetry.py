"""Where the core reports to optional telemetry (:mod:`redis_locks_async.otel`).

The core calls into :data:`SINK` at four moments — an ``acquire()`` call (wrapped whole), a hold
that ends (released or lost), a renewal confirmed — and only when a sink is installed: with
none (the default) each moment costs one global lookup. This module imports nothing optional;
:mod:`redis_locks_async.otel` installs the OpenTelemetry sink.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

__all__ = ("SINK", "Sink")


class Sink(Protocol):
    """What the core reports (see :class:`redis_locks_async.otel` for the instruments)."""

    async def acquire(self, lock: Any, call: Coroutine[Any, Any, bool]) -> bool:
        """Run ``call`` — the whole of ``lock.acquire()`` — and report it (time, outcome)."""
        ...

    def hold_ended(self, kind: str, seconds: float, *, lost: bool) -> None:
        """A hold of a ``kind`` lock ended after ``seconds``: released, or ``lost``."""
        ...

    def renewed(self) -> None:
        """A lease renewal was confirmed."""
        ...


SINK: Sink | None = None  # set by redis_locks_async.otel.instrument()
