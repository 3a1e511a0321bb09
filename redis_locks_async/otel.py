"""OpenTelemetry metrics and spans for every lock of the process (the ``otel`` extra).

``pip install 'redis-locks-async[otel]'`` (``opentelemetry-api``; bring your own SDK and
exporters), then once at start-up::

    from redis_locks_async import otel
    otel.instrument()            # the global meter and tracer providers, or pass your own

Instruments (meter and tracer ``redis_locks_async``):

==============================  =========  ========================================================
``redis_locks.acquire.duration``  histogram  seconds an ``acquire()`` call took (waiting included);
                                             attributes ``lock.kind`` (``Lock``, ``FairLock``,
                                             ``ReadLock``, ``WriteLock``, ``Semaphore``,
                                             ``RedLock``) and ``outcome`` (``acquired``,
                                             ``timeout``, ``error``, ``cancelled``)
``redis_locks.hold.duration``     histogram  seconds from acquisition to release, or to the loss;
                                             ``lock.kind``, ``outcome`` (``released``, ``lost``)
``redis_locks.renewals``          counter    lease renewals confirmed by the server
``redis_locks.lost``              counter    leases lost while held; ``lock.kind``
==============================  =========  ========================================================

Each ``acquire()`` call is also a span, ``redis_locks.acquire``, with ``lock.name``,
``lock.kind``, ``lock.acquired`` and, once held, ``lock.fencing_token``; an error sets the
span's status. Lock names are on spans only — never metric attributes, whose cardinality they
would make unbounded. Re-entries are acquisitions of their own here (a short span and
duration); only fresh acquisitions start a hold's duration.

Without :func:`instrument` nothing is measured and the ``opentelemetry`` package is not imported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, final

from . import _telemetry

__all__ = ("instrument", "uninstrument")

_SCOPE = "redis_locks_async"


def instrument(*, meter_provider: Any = None, tracer_provider: Any = None) -> None:
    """Report every lock of this process to OpenTelemetry from now on (replacing an earlier
    :func:`instrument`). ``meter_provider`` / ``tracer_provider``: default the global ones.

    Raises :class:`ImportError` naming the extra when ``opentelemetry-api`` is not installed.
    """
    try:
        from opentelemetry import metrics, trace
    except ImportError as exc:  # pragma: no cover - the extra is installed in the test venv
        raise ImportError(
            "redis_locks_async.otel needs opentelemetry-api: pip install 'redis-locks-async[otel]'"
        ) from exc
    meter = (meter_provider or metrics.get_meter_provider()).get_meter(_SCOPE)
    tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(_SCOPE)
    _telemetry.SINK = _OpenTelemetrySink(meter, tracer, trace.Status, trace.StatusCode)


def uninstrument() -> None:
    """Stop reporting (instruments already handed out stay with their provider)."""
    _telemetry.SINK = None


@final
class _OpenTelemetrySink:
    """The sink :func:`instrument` installs (see the module docstring)."""

    def __init__(self, meter: Any, tracer: Any, status: Any, status_code: Any) -> None:
        self._tracer = tracer
        self._status, self._error = status, status_code.ERROR
        self._acquire = meter.create_histogram(
            "redis_locks.acquire.duration", unit="s", description="time an acquire() call took"
        )
        self._hold = meter.create_histogram(
            "redis_locks.hold.duration", unit="s", description="time a lock was held"
        )
        self._renewals = meter.create_counter(
            "redis_locks.renewals", description="lease renewals confirmed by the server"
        )
        self._lost = meter.create_counter("redis_locks.lost", description="leases lost while held")

    async def acquire(self, lock: Any, call: Coroutine[Any, Any, bool]) -> bool:
        kind = type(lock).__name__
        loop = asyncio.get_running_loop()
        attributes = {"lock.name": lock.name, "lock.kind": kind}
        with self._tracer.start_as_current_span(
            "redis_locks.acquire", attributes=attributes, record_exception=True
        ) as span:
            started = loop.time()
            outcome = "error"
            try:
                got = await call
                outcome = "acquired" if got else "timeout"
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            except BaseException as exc:
                span.set_status(self._status(self._error, f"{type(exc).__name__}: {exc}"))
                raise
            finally:
                self._acquire.record(loop.time() - started, {"lock.kind": kind, "outcome": outcome})
                span.set_attribute("lock.acquired", outcome == "acquired")
            if got:
                lease = lock.current_lease
                if lease is not None:
                    span.set_attribute("lock.fencing_token", lease.fencing_token)
            return got

    def hold_ended(self, kind: str, seconds: float, *, lost: bool) -> None:
        self._hold.record(seconds, {"lock.kind": kind, "outcome": "lost" if lost else "released"})
        if lost:
            self._lost.add(1, {"lock.kind": kind})

    def renewed(self) -> None:
        self._renewals.add(1)
