"""The library runs on asyncio only (SPEC §1: redis.asyncio needs asyncio) and says so clearly.

A foreign event loop — trio, anyio's trio backend, or any other runner — drives a coroutine by
calling ``send()`` on it with no asyncio loop running in the thread. That is what
:func:`_first_step_without_asyncio` does (trio is not a dependency, so no test imports it): the
library must then fail at its entry point with a message naming asyncio and the fix, before any
I/O (the client points at a port nobody listens on), not with a bare "no running event loop"
from deep inside.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis.asyncio as aioredis

from redis_locks_async import FairLock, Lock, ReadWriteLock, Semaphore
from redis_locks_async._core import LockBase

NOBODY = "redis://127.0.0.1:1"  # nothing listens there: the error must come before any I/O

PRIMITIVES: dict[str, Callable[[aioredis.Redis], LockBase]] = {
    "Lock": lambda r: Lock(r, "asyncio-only"),
    "FairLock": lambda r: FairLock(r, "asyncio-only"),
    "ReadWriteLock.read": lambda r: ReadWriteLock(r, "asyncio-only").read,
    "ReadWriteLock.write": lambda r: ReadWriteLock(r, "asyncio-only").write,
    "Semaphore": lambda r: Semaphore(r, "asyncio-only", 2),
}


def _first_step_without_asyncio(make: Callable[[], Coroutine[Any, Any, Any]]) -> BaseException:
    """Run the first step of ``make()`` in a fresh thread with no asyncio loop; what it raised."""
    raised: list[BaseException] = []

    def step() -> None:
        coro = make()
        try:
            coro.send(None)
        except BaseException as exc:
            raised.append(exc)
        finally:
            coro.close()

    thread = threading.Thread(target=step)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert raised, "the coroutine suspended instead of failing"
    return raised[0]


@pytest.mark.parametrize("primitive", list(PRIMITIVES))
@pytest.mark.parametrize("operation", ["acquire", "try", "enter", "release", "extend", "locked"])
def test_without_asyncio_loop_the_error_names_asyncio(primitive: str, operation: str) -> None:
    """Regression: under a non-asyncio event loop (anyio's trio backend) or in a thread with no
    running loop, acquire/release/``async with`` failed with a bare ``RuntimeError: no running
    event loop`` raised by ``asyncio.current_task()``, which does not say that the library
    needs asyncio."""
    client = aioredis.Redis.from_url(NOBODY)
    lock = PRIMITIVES[primitive](client)
    calls: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
        "acquire": lambda: lock.acquire(timeout=1),
        "try": lambda: lock.acquire(blocking=False),
        "enter": lock.__aenter__,
        "release": lock.release,
        "extend": lambda: lock.extend(),
        "locked": lock.locked,
    }
    error = _first_step_without_asyncio(calls[operation])
    _assert_names_asyncio(error)


def _assert_names_asyncio(error: BaseException) -> None:
    assert isinstance(error, RuntimeError)
    message = str(error)
    assert "'asyncio-only'" in message
    assert "no asyncio event loop is running" in message
    assert "redis.asyncio" in message
    assert "backend='asyncio'" in message
    assert "trio" in message
    assert error.__cause__ is None and error.__suppress_context__


@pytest.mark.parametrize("primitive", list(PRIMITIVES))
def test_local_views_without_asyncio_loop_name_asyncio(primitive: str) -> None:
    """Regression (``owned()``, ``state`` and ``current_lease`` off asyncio raised a bare
    "no running event loop"; so did ``locked()`` — and ``Semaphore.set_permits()`` /
    ``free_permits()``, tested below)."""
    client = aioredis.Redis.from_url(NOBODY)
    lock = PRIMITIVES[primitive](client)
    views: list[Callable[[], object]] = [
        lock.owned,
        lambda: lock.state,
        lambda: lock.current_lease,
    ]
    for view in views:
        raised: list[BaseException] = []

        def call(view: Callable[[], object] = view, raised: list[BaseException] = raised) -> None:
            try:
                view()
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        thread.join(10)
        assert raised, "no error off asyncio"
        _assert_names_asyncio(raised[0])


@pytest.mark.parametrize("operation", ["set_permits", "free_permits"])
def test_semaphore_admin_without_asyncio_loop_names_asyncio(operation: str) -> None:
    sem = Semaphore(aioredis.Redis.from_url(NOBODY), "asyncio-only", 2)
    make = (lambda: sem.set_permits(3)) if operation == "set_permits" else sem.free_permits
    _assert_names_asyncio(_first_step_without_asyncio(make))
