"""What the benchmark scenarios and their worker processes share: reading a pipe from an event
loop or with a time limit, describing an error in one line, stopping a worker process, and
which of our lock classes a peer key names."""

from __future__ import annotations

import asyncio
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis_locks_async import FairLock, Lock


def describe(exc: BaseException) -> str:
    """``exc`` as its one-line ``Type: message``."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


async def recv(conn: Connection, timeout: float | None = None) -> object:
    """Receive from ``conn`` without blocking the event loop (and without polling it)."""
    if not conn.poll():
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(conn.fileno(), ready)
        try:
            await asyncio.wait_for(readable, timeout)
        finally:
            loop.remove_reader(conn.fileno())
    return conn.recv()


class WorkerError(RuntimeError):
    """A worker process reported an error, died, or did not answer in time."""


def receive(conn: Connection, timeout: float, who: str) -> object:
    """The next message from the worker ``who`` at the other end of ``conn``, within
    ``timeout`` seconds; :class:`WorkerError` if none comes or the worker is gone."""
    try:
        if not conn.poll(timeout):
            raise WorkerError(f"{who} did not answer within {timeout:.0f} s")
        message: object = conn.recv()
    except (OSError, EOFError) as exc:
        raise WorkerError(f"{who} died: {exc!r}") from exc
    return message


def stop_process(proc: BaseProcess, *, grace_s: float, force_s: float) -> bool:
    """Give ``proc`` ``grace_s`` to exit, then terminate it, then kill it (waiting ``force_s``
    after each). ``True`` when it had to be terminated."""
    proc.join(timeout=grace_s)
    if not proc.is_alive():
        return False
    proc.terminate()
    proc.join(timeout=force_s)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=force_s)
    return True


# Our lock kinds as the scenarios name them: a peer key of ``redis-locks-async`` is ``Lock``,
# ``redis-locks-async/fair`` is ``FairLock``, so the same worker code measures either.
OURS = "redis-locks-async"
OUR_KINDS = {OURS: "Lock", f"{OURS}/fair": "FairLock"}


def is_ours(peer: str) -> bool:
    """``True`` for a peer key naming one of our exclusive locks (``Lock``, ``FairLock``)."""
    return peer in OUR_KINDS


def our_lock_class(peer: str) -> type[Lock] | type[FairLock]:
    """The class of ours that ``peer`` names; both take the same arguments."""
    from redis_locks_async import FairLock, Lock

    if peer not in OUR_KINDS:
        raise ValueError(f"not one of our lock kinds: {peer!r}")
    return FairLock if OUR_KINDS[peer] == "FairLock" else Lock
