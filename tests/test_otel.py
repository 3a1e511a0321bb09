"""OpenTelemetry metrics and spans (SPEC §7 Observability; ``redis_locks_async.otel``).

The SDK's in-memory reader and exporter stand in for a collector; the locks run against the
real server. Each test installs its own providers and uninstruments at the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from redis_locks_async import (
    FairLock,
    Lock,
    LockError,
    LockLostError,
    ReadWriteLock,
    Semaphore,
    _telemetry,
    otel,
)

sdk_metrics = pytest.importorskip("opentelemetry.sdk.metrics")
sdk_metrics_export = pytest.importorskip("opentelemetry.sdk.metrics.export")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
sdk_trace_export = pytest.importorskip("opentelemetry.sdk.trace.export")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")


class Telemetry:
    """An instrumented process: what was recorded, read back."""

    def __init__(self) -> None:
        self.reader = sdk_metrics_export.InMemoryMetricReader()
        self.spans = in_memory.InMemorySpanExporter()
        tracer_provider = sdk_trace.TracerProvider()
        tracer_provider.add_span_processor(sdk_trace_export.SimpleSpanProcessor(self.spans))
        meter_provider = sdk_metrics.MeterProvider(metric_readers=[self.reader])
        otel.instrument(meter_provider=meter_provider, tracer_provider=tracer_provider)

    def points(self, metric: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data is not None else []:
            for scope in resource.scope_metrics:
                for item in scope.metrics:
                    if item.name == metric:
                        found.extend(item.data.data_points)
        return found

    def count(self, metric: str, **attributes: str) -> float:
        """A histogram's count (or a counter's sum) over points with ``attributes``."""
        total = 0.0
        for point in self.points(metric):
            if all(point.attributes.get(k.replace("_", ".")) == v for k, v in attributes.items()):
                value: Any = getattr(point, "count", None) or getattr(point, "value", 0)
                total += float(value)
        return total


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    recorder = Telemetry()
    try:
        yield recorder
    finally:
        otel.uninstrument()
    assert _telemetry.SINK is None


@pytest.mark.parametrize(
    "make",
    [
        lambda c, n: Lock(c, n),
        lambda c, n: FairLock(c, n),
        lambda c, n: ReadWriteLock(c, n).write,
        lambda c, n: ReadWriteLock(c, n).read,
        lambda c, n: Semaphore(c, n, 2),
    ],
    ids=["Lock", "FairLock", "WriteLock", "ReadLock", "Semaphore"],
)
async def test_acquire_hold_and_span_are_recorded(
    telemetry: Telemetry, client: aioredis.Redis, name: str, make: Any
) -> None:
    lock = make(client, name)
    kind = type(lock).__name__
    async with lock as lease:
        await asyncio.sleep(0.05)
    assert telemetry.count("redis_locks.acquire.duration", lock_kind=kind, outcome="acquired") == 1
    held = telemetry.points("redis_locks.hold.duration")
    assert len(held) == 1 and held[0].attributes == {"lock.kind": kind, "outcome": "released"}
    assert held[0].count == 1 and 0.05 <= held[0].sum < 5.0
    (span,) = telemetry.spans.get_finished_spans()
    assert span.name == "redis_locks.acquire"
    assert span.attributes["lock.name"] == name and span.attributes["lock.kind"] == kind
    assert span.attributes["lock.acquired"] is True
    assert span.attributes["lock.fencing_token"] == lease.fencing_token
    for point in telemetry.points("redis_locks.acquire.duration"):
        assert "lock.name" not in point.attributes  # unbounded cardinality stays on spans


async def test_timeouts_errors_and_cancellations_are_outcomes(
    telemetry: Telemetry, client: aioredis.Redis, name: str
) -> None:
    holder, other = Lock(client, name), Lock(client, name)
    async with holder:

        async def times_out() -> None:
            assert await other.acquire(timeout=0.05) is False

        await asyncio.create_task(times_out())

        async def cancelled() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(other.acquire(), 0.05)

        await asyncio.create_task(cancelled())
    await client.set(name, "not a lock")
    try:
        with pytest.raises(LockError):
            await other.acquire(blocking=False)
    finally:
        await client.delete(name)
    assert telemetry.count("redis_locks.acquire.duration", outcome="timeout") == 1
    assert telemetry.count("redis_locks.acquire.duration", outcome="cancelled") == 1
    assert telemetry.count("redis_locks.acquire.duration", outcome="error") == 1
    failed = [s for s in telemetry.spans.get_finished_spans() if not s.status.is_ok]
    assert len(failed) == 1 and "LockError" in (failed[0].status.description or "")


async def test_renewals_and_losses_are_counted(
    telemetry: Telemetry, client: aioredis.Redis, name: str
) -> None:
    lock = Lock(client, name, lease=0.3)
    with pytest.raises(LockLostError):
        async with lock.guarded():
            await asyncio.sleep(0.35)  # at least one renewal (every lease/3)
            await client.delete(name)  # taken away behind its back
            await asyncio.sleep(5)  # cancelled at the next renewal
    assert telemetry.count("redis_locks.renewals") >= 1
    assert telemetry.count("redis_locks.lost", lock_kind="Lock") == 1
    assert telemetry.count("redis_locks.hold.duration", outcome="lost") == 1
    assert telemetry.count("redis_locks.hold.duration", outcome="released") == 0


async def test_nothing_is_recorded_without_instrument(client: aioredis.Redis, name: str) -> None:
    """The default: no sink, holds carry no telemetry."""
    assert _telemetry.SINK is None
    lock = Lock(client, name)
    async with lock as lease:
        assert lease.name == name
    recorder = Telemetry()
    try:
        otel.uninstrument()
        async with lock:
            pass
        assert not recorder.points("redis_locks.acquire.duration")
        assert not recorder.spans.get_finished_spans()
    finally:
        otel.uninstrument()


class _Raising:
    """An instrument, span or processor method that raises (a broken exporter or provider)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("telemetry is broken")


async def test_broken_telemetry_never_fails_a_lock_operation(
    client: aioredis.Redis, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (an attack pass: a span processor whose ``on_end`` raised made
    ``async with lock:`` raise with the lock held — the body never ran, nothing released it;
    an instrument whose ``add`` raised killed the lease keeper at its first renewal, so every
    lease of the client was lost, and ``on_lost`` was never called). Telemetry errors are
    logged once and the lock goes on."""
    processor = sdk_trace.SpanProcessor()
    processor.on_end = _Raising()
    tracer_provider = sdk_trace.TracerProvider()
    tracer_provider.add_span_processor(processor)
    meter_provider = sdk_metrics.MeterProvider()
    otel.instrument(meter_provider=meter_provider, tracer_provider=tracer_provider)
    sink: Any = _telemetry.SINK
    for instrument in (sink._acquire, sink._hold, sink._renewals, sink._lost):
        instrument.add = instrument.record = _Raising()
    try:
        lost: list[object] = []
        lock = Lock(client, name, lease=0.3, on_lost=lost.append)
        ran = False
        async with lock:
            ran = True
            await asyncio.sleep(0.35)  # renewed at least once: the keeper survives
            assert lock.owned()
        assert ran and not await lock.locked()
        with pytest.raises(LockLostError):
            async with lock.guarded():
                await client.delete(name)
                await asyncio.sleep(5)
        assert lost  # the loss was told, telemetry or not
        errors = [r for r in caplog.records if "OpenTelemetry" in r.getMessage()]
        assert errors and len(errors) <= 5  # once per kind of report, not per call
    finally:
        otel.uninstrument()
