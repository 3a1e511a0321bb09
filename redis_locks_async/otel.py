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
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Final, final

from . import _telemetry

__all__ = ("instrument", "uninstrument")

_SCOPE: Final = "redis_locks_async"
_SPAN: Final = "redis_locks.acquire"
logger = logging.getLogger("redis_locks_async")


def instrument(*, meter_provider: Any = None, tracer_provider: Any = None) -> None:
    """Report every lock of this process to OpenTelemetry from now on (replacing an earlier
    :func:`instrument`). ``meter_provider`` / ``tracer_provider``: default the global ones.

    Raises :class:`ImportError` naming the extra when ``opentelemetry-api`` is not installed.
    A provider, instrument or span processor that raises never fails a lock operation: the
    error is logged (once per kind of report) and the operation goes on.
    """
    try:
        from opentelemetry import context, metrics, trace
    except ImportError as exc:  # pragma: no cover - the extra is installed in the test venv
        raise ImportError(
            "redis_locks_async.otel needs opentelemetry-api: pip install 'redis-locks-async[otel]'"
        ) from exc
    meter = (meter_provider or metrics.get_meter_provider()).get_meter(_SCOPE)
    tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(_SCOPE)
    _telemetry.SINK = _OpenTelemetrySink(meter, tracer, trace, context)


def uninstrument() -> None:
    """Stop reporting (instruments already handed out stay with their provider)."""
    _telemetry.SINK = None


@final
class _OpenTelemetrySink:
    """The sink :func:`instrument` installs (see the module docstring)."""

    def __init__(self, meter: Any, tracer: Any, trace: Any, context: Any) -> None:
        self._tracer, self._trace, self._context = tracer, trace, context
        self._failed: set[str] = set()  # what already logged an error
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

    def _safely(self, what: str, report: Callable[..., object], *args: Any) -> Any:
        """``report(*args)``; an exception is logged (once per ``what``), never raised."""
        try:
            return report(*args)
        except Exception:
            if what not in self._failed:
                self._failed.add(what)
                logger.exception("OpenTelemetry: %s failed (lock operations go on)", what)
            return None

    async def acquire(self, lock: Any, call: Coroutine[Any, Any, bool]) -> bool:
        kind = type(lock).__name__
        loop = asyncio.get_running_loop()
        attributes = {"lock.name": lock.name, "lock.kind": kind}
        span = self._safely(
            "starting a span", lambda: self._tracer.start_span(_SPAN, attributes=attributes)
        )
        token = None
        if span is not None:
            token = self._safely(
                "entering a span", self._context.attach, self._trace.set_span_in_context(span)
            )
        started = loop.time()
        outcome, error = "error", None
        try:
            got = await call
            outcome = "acquired" if got else "timeout"
            return got
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._safely(
                "recording an acquire",
                self._acquire.record,
                loop.time() - started,
                {"lock.kind": kind, "outcome": outcome},
            )
            if span is not None:
                self._safely("ending a span", self._end, span, token, lock, outcome, error)

    def _end(
        self, span: Any, token: object, lock: Any, outcome: str, error: BaseException | None
    ) -> None:
        try:
            span.set_attribute("lock.acquired", outcome == "acquired")
            lease = lock.current_lease if outcome == "acquired" else None
            if lease is not None:
                span.set_attribute("lock.fencing_token", lease.fencing_token)
            if error is not None:
                span.record_exception(error)
                status = self._trace.Status(
                    self._trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"
                )
                span.set_status(status)
        finally:
            try:
                if token is not None:
                    self._context.detach(token)
            finally:
                span.end()

    def hold_ended(self, kind: str, seconds: float, *, lost: bool) -> None:
        outcome = {"lock.kind": kind, "outcome": "lost" if lost else "released"}
        self._safely("recording a hold", self._hold.record, seconds, outcome)
        if lost:
            self._safely("counting a loss", self._lost.add, 1, {"lock.kind": kind})

    def renewed(self) -> None:
        self._safely("counting a renewal", self._renewals.add, 1)
