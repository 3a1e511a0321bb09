"""anyio: task groups and cancel scopes around locks, on the asyncio backend.

1. Workers in a task group share a lock; at most one is ever inside.
2. ``anyio.move_on_after`` around ``acquire()`` while someone else holds the lock: the waiter
   gives up when the scope fires, and leaves nothing behind — once the holder releases, another
   task gets the lock at once.
3. ``move_on_after`` around ``async with lock:`` whose body overruns: the scope cancels the
   body, the lock is released on the way out.
4. ``move_on_after`` with tiny deadlines around ``acquire()`` of a free lock, so the scope
   fires at every stage of the acquisition — including after the server granted it. Whatever
   the stage, no ghost holder remains: another task acquires the lock within two seconds,
   though a ghost would hold it for its whole 30 s lease.
5. The trio backend is not supported (redis.asyncio needs asyncio): under
   ``anyio.run(..., backend="trio")`` the lock raises a ``RuntimeError`` that says so. Where
   trio is not installed, the example shows the same message from a thread that has no asyncio
   loop (stepping the coroutine by hand, as a foreign event loop would).

Run: ``REDIS_URL=redis://localhost:6379 python examples/anyio_tasks.py``
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Awaitable, Callable

import anyio
import redis.asyncio as redis

from redis_locks_async import Lock

PROBE_TIMEOUT = 2.0  # seconds another task may wait for a lock nobody should hold (lease: 30)


async def probe(lock: Lock) -> bool:
    """Whether a fresh task gets ``lock`` within ``PROBE_TIMEOUT`` (then releases it)."""
    got: list[bool] = []

    async def attempt() -> None:
        got.append(await lock.acquire(timeout=PROBE_TIMEOUT))
        if got[0]:
            await lock.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(attempt)
    return got[0]


async def workers_in_a_task_group(client: redis.Redis, name: str) -> None:
    lock = Lock(client, name, timeout=10)
    inside, most, done = 0, 0, 0

    async def worker() -> None:
        nonlocal inside, most, done
        for _ in range(5):
            async with lock:
                inside += 1
                most = max(most, inside)
                await anyio.sleep(0.001)
                inside -= 1
                done += 1

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(worker)
    print(f"1. task group: {done} holds by 4 workers, at most {most} inside at once")


async def move_on_after_around_acquire(client: redis.Redis, name: str) -> None:
    lock = Lock(client, name)
    held, release = anyio.Event(), anyio.Event()

    async def holder() -> None:
        async with lock:
            held.set()
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await held.wait()
        with anyio.move_on_after(0.2) as scope:
            await lock.acquire()  # the lock is held: this waits until the scope fires
        release.set()
    gave_up = "gave up" if scope.cancelled_caught and not lock.owned() else "DID NOT give up"
    free = "the lock is free" if await probe(lock) else "GHOST: the lock is still held"
    print(f"2. move_on_after around acquire(): the waiter {gave_up}; after the release {free}")


async def move_on_after_around_async_with(client: redis.Redis, name: str) -> None:
    lock = Lock(client, name)
    with anyio.move_on_after(0.2) as scope:
        async with lock:
            await anyio.sleep(30)  # overruns: the scope cancels it
    cancelled = "cancelled the body" if scope.cancelled_caught else "DID NOT cancel the body"
    free = "the lock is free" if await probe(lock) else "GHOST: the lock is still held"
    print(f"3. move_on_after around async with: the scope {cancelled}; {free}")


async def scopes_firing_at_every_stage(client: redis.Redis, name: str) -> None:
    lock = Lock(client, name)
    delays = [0.0, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.05]
    acquired = cancelled = ghosts = 0
    for delay in delays:
        with anyio.move_on_after(delay):
            await lock.acquire()
        if lock.owned():
            acquired += 1
            await lock.release()
        else:
            cancelled += 1
        if not await probe(lock):
            ghosts += 1
    print(
        f"4. {len(delays)} acquisitions cut short by move_on_after: {cancelled} cancelled, "
        f"{acquired} completed, {ghosts} ghost holders"
    )


async def main() -> None:
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://localhost:6379"))
    prefix = f"examples:anyio:{secrets.token_hex(4)}"
    try:
        await workers_in_a_task_group(client, f"{prefix}:workers")
        await move_on_after_around_acquire(client, f"{prefix}:waiter")
        await move_on_after_around_async_with(client, f"{prefix}:body")
        await scopes_firing_at_every_stage(client, f"{prefix}:stages")
    finally:
        await client.aclose()  # also stops the library's tasks for this client


# -- 5. not on trio -----------------------------------------------------------------------------


async def lock_under_any_loop() -> None:
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://localhost:6379"))
    async with Lock(client, "examples:anyio:trio"):
        pass  # never reached: the lock refuses to run without asyncio, before any I/O


def error_of(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except BaseException as exc:
        return exc
    return None


def step_without_asyncio(make: Callable[[], Awaitable[None]]) -> None:
    """Step a coroutine in a thread with no asyncio loop, as another event loop would."""
    failure: list[BaseException] = []

    def run() -> None:
        coro = make().__await__()
        try:
            coro.send(None)
        except BaseException as exc:
            failure.append(exc)
        finally:
            coro.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def not_on_trio() -> None:
    error = error_of(lambda: anyio.run(lock_under_any_loop, backend="trio"))
    if isinstance(error, LookupError):  # anyio: trio is not installed
        print(f"5. trio backend: not installed here ({error})")
        error = error_of(lambda: step_without_asyncio(lock_under_any_loop))
        print(f"   without an asyncio loop: {type(error).__name__}: {error}")
    else:
        print(f"5. trio backend: {type(error).__name__}: {error}")


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
    not_on_trio()
