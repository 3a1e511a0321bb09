"""Topologies and runtimes: how the core reaches the server(s), and what it shares per client.

**Topology** — how to reach the server(s) behind one client: which client runs a lock's scripts,
how to open a pub/sub connection for a lock's channel, whether announcements are sharded
(``SPUBLISH``/``SSUBSCRIBE`` on Redis Cluster), and what counts as a transient error. The core
talks to servers only through a topology: a standalone ``redis.asyncio.Redis`` (also a Sentinel
master from ``Sentinel.master_for``) is :class:`Standalone`; a cluster or N independent masters
(``RedLock``) are further implementations of the same protocol.

**Runtime** — everything the locks of one client share on one event loop: the table of holds
(``(hold key, task) -> Hold``), the lease keeper, a subscription hub per node, and every
background task of the library. It is found through a weak mapping keyed by the client (no
attribute is stored on the client) and created on first use on the running loop; a client used
from a new event loop gets a new runtime (the old loop's tasks are that loop's business).

The one hook: ``client.aclose`` is wrapped on that client instance, so that closing the client
also closes its runtime — stops renewal, closes the pub/sub connections and cancels every
background task: no orphan task survives a closed client. Leases held at that moment are
marked lost (they can no longer be renewed or released) and end on the server when they
expire; acquisitions in flight fail with :class:`LockError`. After the close, locks on that
client refuse to work on that loop (create a new client).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterator, Sequence
from types import FrameType
from typing import Any, ClassVar, Final, Protocol, final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._errors import LockError, describe
from ._lease import Hold
from ._notify import Hub, SubscriptionHub, Subscriptions, subscription_refusal
from ._parking import ParkingLot, Waiter
from ._renewal import LeaseKeeper
from ._scripts import Call
from ._wire import drop_stale_client, drop_stale_connections, fast_batches, let_go, run_pipeline

__all__ = (
    "ClientRef",
    "Runtime",
    "Standalone",
    "Topology",
    "UndoTurn",
    "close_with",
    "existing_runtime",
    "observed_runtime",
    "pipelined",
    "runtime_for",
    "topology_for",
    "transient_error",
)

logger = logging.getLogger("redis_locks_async")

_CLOSE_GRACE: Final = 2.0  # seconds waiters and cleanups get to tidy up on close
_HOOKED: Final = "_redis_locks_async_close_hook"


class Topology(Protocol):
    """How the core reaches the server(s) behind one client (module docstring)."""

    @property
    def client(self) -> Any:
        """The client that runs scripts (standalone: the user's client)."""

    @property
    def sharded(self) -> bool:
        """Whether announcements use sharded pub/sub (``SPUBLISH``/``SSUBSCRIBE``)."""

    def node_of(self, channel: str) -> Hashable:
        """Which node serves ``channel`` (one subscription hub per node)."""

    def pubsub(self, node: Hashable) -> Any:
        """A new pub/sub object for ``node``."""

    def wait_refusal(self) -> str | None:
        """Why no task may wait for a lock through this topology (``None``: it may)."""

    def transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is worth retrying (the command may not have run)."""

    def passing(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the servers pass through a state that ends by itself (a slot
        migration, a failover under way): a fresh acquisition waits it out within its
        timeout instead of failing at once, as it would on a server that is down."""

    async def run_batch(self, calls: Sequence[Call], bound: float) -> list[object]:
        """Run ``calls`` (renewals) in as few round trips as the topology allows, each round
        trip bounded by ``bound`` seconds; an error takes the place of its call's reply."""

    async def aclose(self) -> None:
        """Close whatever connections the topology opened itself (not the user's client)."""

    def pipeline_for(self, key: str | bytes) -> Any:
        """A non-transactional pipeline on one connection to the node that owns ``key``."""


_TRANSIENT: Final = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
)


_BUSY: Final = ("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN")


class ClientRef:
    """What every topology starts from: a *weak* reference to the client it serves (the
    runtime lives in a weak mapping keyed by that client, which must not be kept alive by its
    own value)."""

    __slots__ = ("_client",)
    _gone: ClassVar[str] = "the redis client was garbage-collected"

    def __init__(self, client: Any) -> None:
        self._client = weakref.ref(client)

    @property
    def client(self) -> Any:
        """The client (:class:`LockError` once it was garbage-collected)."""
        client = self._client()
        if client is None:
            raise LockError(self._gone)
        return client


@final
class Standalone(ClientRef):
    """One server (or a Sentinel-managed master) behind a ``redis.asyncio.Redis`` client."""

    __slots__ = ("_sentinel", "_subscriptions")

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self._subscriptions = Subscriptions(lambda: self.client)
        pool = getattr(client, "connection_pool", None)
        self._sentinel = getattr(pool, "sentinel_manager", None) is not None

    @property
    def sharded(self) -> bool:
        """Standalone servers use plain pub/sub."""
        return False

    def node_of(self, channel: str) -> Hashable:
        """Every channel lives on the one server."""
        return None

    def pubsub(self, node: Hashable) -> Any:
        """A pub/sub object on a pool of its own, made like the client's
        (:class:`Subscriptions`)."""
        return self._subscriptions.pubsub()

    def wait_refusal(self) -> str | None:
        """See :func:`subscription_refusal`."""
        return subscription_refusal(self.client)

    def transient(self, exc: BaseException) -> bool:
        """See :func:`transient_error`."""
        return transient_error(exc)

    def passing(self, exc: BaseException) -> bool:
        """A Sentinel-managed master: what a failover under way looks like (no master known
        yet, the old one unreachable or demoted: :func:`transient_error`) — Sentinel ends it
        by itself. One server alone: nothing (one that does not answer fails a fresh
        acquisition at once)."""
        return self._sentinel and transient_error(exc)

    async def run_batch(self, calls: Sequence[Call], bound: float) -> list[object]:
        """One pipeline (one round trip): :func:`pipelined`."""
        try:
            return await pipelined(self.client, calls, bound)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            return [exc] * len(calls)

    async def aclose(self) -> None:
        """Close the subscriptions' own pool."""
        await self._subscriptions.aclose()

    def pipeline_for(self, key: str | bytes) -> Any:
        """A pipeline on the user's client."""
        return self.client.pipeline(transaction=False)


async def pipelined(
    client: Any, calls: Sequence[Call], bound: float | None = None
) -> list[object]:
    """``calls`` in one pipeline on one connection of ``client`` (one round trip), within
    ``bound`` seconds if given, never on a connection of an earlier event loop: their replies, a
    server's error reply in place of its call's. A plain client takes
    :func:`._wire.run_pipeline`, which lets the event loop run between steps of a long batch;
    any other (:func:`._wire.fast_batches`), redis-py's pipeline.

    A server that does not know a script (restarted, flushed, a cluster node just added) is
    given it — on ``client``, the one server it reaches (through a cluster client a ``SCRIPT
    LOAD`` goes to every primary, and waited for a stopped one) — and those calls are sent
    again; a failure there is those calls' reply. Each of those round trips is bounded by
    ``bound`` too (the server answered the first: not a silent connection; one bound for all
    three lost the lease under a steady latency of a sixth of it — helper-62)."""
    replies = await _pipelined_once(client, calls, bound)
    redo = [k for k, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if redo:
        try:
            for script in {calls[k].script for k in redo}:
                await asyncio.wait_for(client.script_load(script.code), bound)
            resent = await _pipelined_once(client, [calls[k] for k in redo], bound)
        except Exception as exc:
            resent = [exc] * len(redo)
        for k, reply in zip(redo, resent, strict=True):
            replies[k] = reply
    return replies


async def _pipelined_once(
    client: Any, calls: Sequence[Call], bound: float | None
) -> list[object]:
    drop_stale_connections(client.connection_pool)
    fast = fast_batches(client)
    if fast is not None:
        # (A connection opened for the batch has as long again for its handshake: the bound
        # is there for a pooled connection gone silent, and a new one is not one — helper-62:
        # a handshake of three round trips under a steady latency lost the lease.)
        batch = [(script.sha, keys, args) for script, keys, args, _ in calls]
        return await asyncio.wait_for(
            run_pipeline(fast, batch, bound), None if bound is None else 2 * bound
        )
    pipe = client.pipeline(transaction=False)
    for script, keys, args, _ in calls:
        pipe.evalsha(script.sha, len(keys), *keys, *args)
    return list(await asyncio.wait_for(pipe.execute(raise_on_error=False), bound))


def transient_error(exc: BaseException) -> bool:
    """Whether a server's error is worth retrying: connection trouble, timeouts, a demoted
    master (``READONLY``), and a server that is busy for now (a long script, loading its data
    set)."""
    return isinstance(exc, _TRANSIENT) or (
        isinstance(exc, ResponseError) and str(exc).startswith(_BUSY)
    )


# -- runtimes ----------------------------------------------------------------------------------


@final
class UndoTurn:
    """How the clean-ups of one node that failed their first few tries retry (an outage):
    while the node's latest try :attr:`failing`, one at a time (:attr:`gate`), each pausing
    after a failure before the next one's turn — one try a second in all, however many wait
    (helper-79: 2,000 clean-ups each retrying on its own kept a core busy, and the loop's lag
    lost healthy leases of the process); once a try succeeds, the rest go at once, side by
    side (helper-81: one at a time they kept their ghost holds ~N round trips longer)."""

    __slots__ = ("failing", "gate")

    def __init__(self) -> None:
        self.failing = False
        self.gate = asyncio.Lock()

    async def take(self) -> bool:
        """Wait for a turn while the node fails: ``True`` holding :attr:`gate` (the node still
        fails — try, pause, then release it), ``False`` to go at once."""
        if not self.failing:
            return False
        await self.gate.acquire()
        if self._still_failing():
            return True
        self.gate.release()  # (the try before this turn succeeded)
        return False

    def _still_failing(self) -> bool:
        # (Read anew after the wait: another clean-up's try may have cleared it.)
        return self.failing


@final
class Runtime:
    """What the locks of one client share on one event loop (module docstring)."""

    __slots__ = (
        "__weakref__",
        "_closers",
        "_closing",
        "_commands",
        "_finished",
        "_hubs",
        "_server",
        "_tasks",
        "_unbounded",
        "_undo_turns",
        "_undoing",
        "acquiring",
        "closed",
        "heirs",
        "holds",
        "in_flight",
        "keeper",
        "loop",
        "topology",
        "tried_at",
        "trying",
    )

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._finished = False  # the close is complete: nothing may start any more
        self._closing: asyncio.Task[None] | None = None  # the close, once begun (aclose)
        self._closers: set[asyncio.Task[Any]] = set()  # tasks awaiting it (not cancelled)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._undoing: set[asyncio.Task[Any]] = set()  # undo tasks under way (spawn)
        # Per node: how the clean-ups past their first few tries take turns (undo_turn).
        self._undo_turns: dict[Hashable, UndoTurn] = {}
        # The timeout scopes of acquisitions whose command is in flight in the caller's own
        # task (Python >= 3.11): the close expires them (the others run in tracked job tasks).
        self.in_flight: set[Any] = set()
        # Their Python 3.10 counterparts: the job tasks of those commands (tracked; the close
        # cancels them once it is done, as it expires the scopes, and does not drain them).
        self._commands: set[asyncio.Task[Any]] = set()
        self.holds: dict[tuple[Hashable, asyncio.Task[Any]], Hold] = {}
        # (hold key, task) -> how many acquire() calls of that task for that key are running
        # (a task that waits for a lock cannot be handed it: it would wait for itself).
        self.acquiring: dict[tuple[Hashable, asyncio.Task[Any]], int] = {}
        # Python 3.10/3.11: task awaiting asyncio.wait_for -> the holds its helper task took,
        # to be handed up to it (LockBase._hand_up) — at the latest when it next looks.
        self.heirs: dict[asyncio.Task[Any], list[Hold]] = {}
        # Channels with an uncontended attempt in flight -> a future for those who wait for it
        # to end (created only when someone does).
        self.trying: dict[str, asyncio.Future[None] | None] = {}
        self.tried_at: dict[str, float] = {}  # ... and the loop time each was sent at
        self.keeper = LeaseKeeper(topology, self.spawn)
        self._hubs: dict[Hashable, Hub] = {}
        self._server: Hashable = _UNKNOWN_SERVER
        self._unbounded: bool | None = None

    @property
    def server(self) -> Hashable | None:
        """Where this runtime's client connects, as far as its pool's settings tell (host, port
        and database; a socket path); ``None`` when they do not (a cluster, a Sentinel service,
        several masters, a pool of another kind)."""
        if self._server is _UNKNOWN_SERVER:
            self._server = _server_of(self.topology)
        return self._server

    @property
    def reads_unbounded(self) -> bool:
        """Whether the client waits for a reply without end (a plain client's pool, or a
        ``RedisCluster``, built with ``socket_timeout=None``): its acquisitions then bound
        their first attempt, and its clean-ups each call, themselves
        (``_core.ATTEMPT_PATIENCE``). Read once."""
        if self._unbounded is None:
            self._unbounded = _reads_unbounded(self.topology)
        return self._unbounded

    def kin(self) -> list[Runtime]:
        """The other open runtimes of this event loop whose clients reach the same server
        (:attr:`server`; none where it is not known)."""
        server = self.server
        if server is None:
            return []
        return [
            other
            for other in list(_RUNTIMES.values())
            if other is not self
            and other.loop is self.loop
            and not other.closed
            and other.server == server
        ]

    def siblings(self) -> list[Runtime]:
        """The runtimes of :meth:`kin` that hold something."""
        return [other for other in self.kin() if other.holds]

    # -- background tasks --------------------------------------------------------------------

    def spawn(
        self,
        coro: Coroutine[Any, Any, Any],
        *,
        report: bool = True,
        cleanup: bool = False,
        eager: bool = False,
    ) -> asyncio.Task[Any]:
        """Run ``coro`` in a background task this runtime tracks (and cancels on close).

        With ``report`` a failure is logged; without, it is left to whoever awaits the task.
        Once the runtime has shut down, the task is cancelled before it starts — unless it is
        a ``cleanup`` (a fenced undo): the undo of a command that reached Redis after the
        close (a retrying client re-sent it on a new connection) must still go out, or it
        leaves a ghost hold for a whole lease. It gets ``_CLOSE_GRACE`` seconds, as the
        close's own clean-ups do: no task outlives a closed client for long (a server that
        does not answer meanwhile keeps what it holds until the lease ends).

        ``eager``: on Python 3.12+ the task runs its first step at once, up to its first wait.
        """
        if cleanup and self._finished:
            client = self.topology.client
            coro = _within(coro, _CLOSE_GRACE, getattr(client, "masters", (client,)))
        if eager and _EAGER_START:
            task: asyncio.Task[Any] = asyncio.Task(  # type: ignore[call-arg,unused-ignore]
                coro, loop=self.loop, eager_start=True
            )
        else:
            task = self.loop.create_task(coro)
        if cleanup:
            self._undoing.add(task)
            task.add_done_callback(self._undoing.discard)
            if self._finished:  # (kept referenced by _undoing: the loop's references are weak)
                task.add_done_callback(self._task_done)
                return task
        if self._finished:
            task.cancel()
            return task
        self._tasks.add(task)
        task.add_done_callback(self._task_done if report else self._task_done_quietly)
        return task

    def undo_turn(self, name: str) -> UndoTurn:
        """The turn of the clean-ups of the node that serves lock ``name``
        (:meth:`LockBase._retrying`): per node, so a node that does not answer holds up no
        clean-up of another."""
        try:
            node = self.topology.node_of(name)
        except (LockError, RedisClusterException):  # (a slot the client cannot place yet)
            node = None
        turn = self._undo_turns.get(node)
        if turn is None:
            turn = self._undo_turns[node] = UndoTurn()
        return turn

    async def cleanups_settled(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for the undo tasks under way: an acquisition that
        fails because the client was closed under it returns once what it reached is undone."""
        if self._undoing:
            await asyncio.wait(set(self._undoing), timeout=timeout)

    def track(self, task: asyncio.Task[Any], *, drained: bool = True) -> None:
        """Track a task created elsewhere (a command in flight): cancelled on close. Without
        ``drained``, the close does not wait for it first: an acquisition's command (Python
        3.10; on 3.11+ it runs in the caller's task, in :attr:`in_flight`) — its undo must
        start once the close is done, as a clean-up after the close, not during the close's
        drain (where the close would cut it short, and it would retry on after the close)."""
        if self._finished:
            task.cancel()
            return
        self._tasks.add(task)
        if not drained:
            self._commands.add(task)
        task.add_done_callback(self._task_done_quietly)

    def _task_done_quietly(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._commands.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the awaiting caller re-raises it, if still there

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    @property
    def background_tasks(self) -> set[asyncio.Task[Any]]:
        """The library's tasks for this runtime that are still running."""
        return {task for task in self._tasks if not task.done()}

    def _cleanups(self) -> list[asyncio.Task[Any]]:
        # (Nor the tasks awaiting this runtime's close, which waits for these: helper-66 — an
        # on_lost callback that closed the client made the close wait its whole grace.)
        long_lived = {self.keeper.task, asyncio.current_task(), *self._closers}
        for hub in self._hubs.values():
            long_lived |= hub.long_lived
        return [
            task
            for task in self._tasks
            if task not in long_lived and task not in self._commands and not task.done()
        ]

    @property
    def pending_cleanups(self) -> int:
        """How many cleanups, releases and (un)subscriptions are still running."""
        return len(self._cleanups())

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait (at most ``timeout`` s) for pending cleanups and releases (not the keeper or
        the listeners), also those that finishing ones start (a ``RedLock`` release's
        stragglers start its clean-ups)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (pending := self._cleanups()) and (left := deadline - loop.time()) > 0:
            await asyncio.wait(pending, timeout=left)

    # -- pub/sub -----------------------------------------------------------------------------

    def hub(self, channel: str) -> Hub:
        """The subscription hub of the node that serves ``channel`` (a topology may build its
        own with ``make_hub(node, spawn)``: N masters listen on every master)."""
        node = self.topology.node_of(channel)
        hub = self._hubs.get(node)
        if hub is None:
            if self.closed:
                raise LockError("the redis client was closed; create a new client to use locks")
            topology = self.topology
            make_hub = getattr(topology, "make_hub", None)
            if make_hub is not None:
                hub = self._hubs[node] = make_hub(node, self.spawn)
            else:
                hub = self._hubs[node] = SubscriptionHub(
                    lambda: topology.pubsub(node),
                    self.spawn,
                    sharded=topology.sharded,
                    serves=(lambda other: _serves(topology, other, node))
                    if topology.sharded
                    else None,
                    refresh=getattr(topology, "refresh", None),
                    owns=_owner_probe(topology, node),
                )
        return hub

    def begin_try(self, channel: str, sent_at: float) -> None:
        """An uncontended attempt on ``channel`` is sent (at loop time ``sent_at``): waiters
        of this process wait for it to end (:meth:`try_ended`)."""
        self.trying[channel] = None
        self.tried_at[channel] = sent_at

    def end_try(self, channel: str) -> None:
        """The uncontended attempt on ``channel`` is over: let the waiters behind it go."""
        ended = self.trying.pop(channel, None)
        self.tried_at.pop(channel, None)
        if ended is not None and not ended.done():
            ended.set_result(None)

    def try_ended(self, channel: str) -> asyncio.Future[None] | None:
        """A future that resolves when the uncontended attempt on ``channel`` ends (``None``:
        there is none in flight)."""
        if channel not in self.trying:
            return None
        ended = self.trying[channel]
        if ended is None:
            ended = self.trying[channel] = self.loop.create_future()
        return ended

    def contended(self, channel: str) -> bool:
        """Whether a local task waits for (or is attempting) the lock of ``channel``."""
        if channel in self.trying:
            return True
        # Every hub, not just the channel's node: asking a cluster client which node serves
        # the channel needs its slot map, which the first attempt on the lock loads.
        return any(hub.waiters(channel) > 0 for hub in self._hubs.values())

    def lots(self, channel: str) -> Iterator[ParkingLot]:
        """The parking lots of the lock of ``channel``, one per hub that has one."""
        for hub in self._hubs.values():
            lot = hub.existing_lot(channel)
            if lot is not None:
                yield lot

    def local_waiters(self, channel: str) -> Iterator[Waiter]:
        """This process's tasks waiting for the lock of ``channel``, each lot in arrival order."""
        for lot in self.lots(channel):
            yield from lot.queue

    def hubs(self) -> list[Hub]:
        """Every subscription hub of this runtime."""
        return list(self._hubs.values())

    # -- closing -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop everything this library runs for the client (module docstring).

        The close runs once, in a task of its own: a caller cancelled meanwhile (a
        ``wait_for`` around ``aclose()``, a shutdown) does not cut it short — it left waiters
        waiting until their holder's lease ended, a listener and a connection behind — and a
        later or concurrent call waits for the same close (helper-63: it returned at once,
        before the first had drained)."""
        current = asyncio.current_task()
        if current is not None:
            self._closers.add(current)  # (an on_lost callback closing the client, say)
        if self._closing is None:
            self.closed = True
            self._closing = self.loop.create_task(self._close())
            self._closing.add_done_callback(_retrieved)
        try:
            await asyncio.shield(self._closing)
        finally:
            if current is not None:
                self._closers.discard(current)

    async def _close(self) -> None:
        for top in list(self.holds.values()):
            hold: Hold | None = top
            while hold is not None:  # a task's earlier permits wait underneath (outer)
                hold.mark_lost("the redis client was closed")
                hold = hold.outer
        # The lost holds stay their tasks' until released: each release() says "lost"
        # (LockLostError), as after any other loss, not "not held".
        await self.keeper.aclose()
        for hub in self._hubs.values():
            hub.wake_all()
        loop = self.loop
        deadline = loop.time() + _CLOSE_GRACE
        for hub in self._hubs.values():
            await hub.wait_empty(max(0.0, deadline - loop.time()))
        await self.drain(timeout=max(0.0, deadline - loop.time()))
        for hub in self._hubs.values():
            await hub.aclose()
        await self.topology.aclose()
        self._finished = True
        for scope in list(self.in_flight):
            # An acquisition still waiting for its reply now (a server that does not answer,
            # a client that keeps re-sending): it ends in LockError, its command undone.
            with contextlib.suppress(RuntimeError):  # (one expiring already: left alone)
                scope.reschedule(loop.time())
        undoing = {task for task in self._undoing if not task.done()}
        if undoing:
            # An undo still waiting for its server (a command of an acquisition cut short by
            # the close may have reached it) gets the grace once more, as one started now would.
            self.spawn(_settled(undoing), cleanup=True)
        tasks = [task for task in self._tasks if task not in undoing and task not in self._closers]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A done callback that marks ``task``'s exception retrieved (its awaiters, if any, were
    cancelled meanwhile: it is theirs to see, not the loop's to log)."""
    if not task.cancelled():
        task.exception()


_EAGER_START: Final = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)

_RUNTIMES: weakref.WeakKeyDictionary[Any, Runtime] = weakref.WeakKeyDictionary()
_UNKNOWN_SERVER: Final = object()


def _reads_unbounded(topology: Topology) -> bool:
    """See :attr:`Runtime.reads_unbounded` (``False`` where the pool does not tell)."""
    if not isinstance(topology, Standalone):
        # A RedisCluster gives every node's connections its own settings (helper-45: a
        # cancelled wait's clean-up hung for ever on a silent node connection).
        kwargs = getattr(topology.client, "connection_kwargs", None)
        return isinstance(kwargs, dict) and kwargs.get("socket_timeout", 0) is None
    try:
        pool: Any = getattr(topology.client, "connection_pool", None)
        kwargs = getattr(pool, "connection_kwargs", None)
        if pool is None or not isinstance(kwargs, dict):
            return False
        if "socket_timeout" in kwargs:
            return kwargs["socket_timeout"] is None
        # The connection class's own default (redis-py 8: 5 s; earlier: none). Building a
        # connection object does no I/O.
        return getattr(pool.connection_class(**kwargs), "socket_timeout", 0) is None
    except Exception:  # a pool of another kind: do not guess
        return False


def _server_of(topology: Topology) -> Hashable | None:
    """See :attr:`Runtime.server`."""
    if not isinstance(topology, Standalone):
        return None
    try:
        client = topology.client
    except LockError:
        return None
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return None
    db = kwargs.get("db", 0)
    if getattr(pool, "service_name", None) is not None:
        return None  # (a Sentinel service's name does not tell one deployment from another)
    if isinstance(kwargs.get("path"), str):
        return ("unix", kwargs["path"], db)
    host, port = kwargs.get("host"), kwargs.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    host = host.lower().rstrip(".")
    if host in _LOOPBACK:
        host = "localhost"  # one machine's own server, however the client names it
    return (host, port, db)


_LOOPBACK: Final = frozenset({"localhost", "127.0.0.1", "::1", "[::1]", "ip6-localhost"})


# The clients the user closed -> their own close (what the hook wrapped, unbound).
_CLOSED: weakref.WeakKeyDictionary[Any, Callable[[Any], Awaitable[None]]] = (
    weakref.WeakKeyDictionary()
)


async def _within(coro: Coroutine[Any, Any, Any], seconds: float, clients: Sequence[Any]) -> None:
    """Run ``coro`` — a clean-up after the close — for at most ``seconds``; then close again
    those of ``clients`` the user closed: the clean-up connected them anew (redis-py lets a
    closed client reconnect), and nothing else would close those connections — also those of a
    pool the application passed in and closed itself meanwhile (:func:`._wire.let_go`)."""
    try:
        await asyncio.wait_for(coro, seconds)
    except asyncio.TimeoutError:
        logger.info(
            "a clean-up after the client was closed got no answer within %s s; what it would "
            "undo ends with its lease",
            seconds,
        )
    finally:
        for client in clients:
            close = _CLOSED.get(client)
            if close is not None:
                try:
                    await close(client)
                    await let_go(client)
                except Exception as exc:  # closing what is broken: nothing more to do
                    logger.debug("closing %r again failed: %s", client, describe(exc))


async def _settled(tasks: set[asyncio.Task[Any]]) -> None:
    """Wait for ``tasks``; cancel those still running if this wait is cut short."""
    try:
        await asyncio.wait(tasks)
    finally:
        for task in tasks:
            task.cancel()


def topology_for(client: Any) -> Topology:
    """The topology of a user's client: a ``RedisCluster`` is a :class:`~._cluster.Cluster`,
    anything else (a ``Redis``, a Sentinel master) is :class:`Standalone`."""
    from redis.asyncio.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        from ._cluster import Cluster

        return Cluster(client)
    return Standalone(client)


def runtime_for(client: Any, topology: Callable[[Any], Topology] = topology_for) -> Runtime:
    """The runtime of ``client`` on the running loop (created on first use).

    Raises :class:`LockError` if the client was closed on this loop.
    """
    runtime = _RUNTIMES.get(client)
    loop = asyncio.get_running_loop()
    if runtime is not None and runtime.loop is loop:
        if runtime.closed:
            raise LockError("the redis client was closed; create a new client to use locks")
        return runtime
    # Connections opened under an earlier loop (this client used under one asyncio.run after
    # another) would be sent on by redis-py's own path, and fail after writing: forgotten.
    drop_stale_client(client)
    runtime = _RUNTIMES[client] = Runtime(topology(client))
    _hook_close(client)
    return runtime


def existing_runtime(client: Any) -> Runtime | None:
    """The runtime of ``client`` on the running loop, if there is one (no creation)."""
    runtime = _RUNTIMES.get(client)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return runtime if runtime is not None and runtime.loop is loop else None


def observed_runtime(client: Any) -> Runtime | None:
    """The runtime a local snapshot (``statistics()``) reports on: ``client``'s on the running
    loop; called from a thread with no running loop (a metrics collector's), ``client``'s on
    the loop it serves, while that loop is open. (Only read, never changed, from there.)"""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        runtime = _RUNTIMES.get(client)
        if runtime is None or runtime.closed or runtime.loop.is_closed():
            return None
        return runtime
    return existing_runtime(client)


_ALSO_CLOSE: weakref.WeakKeyDictionary[Any, list[Callable[[], Coroutine[Any, Any, None]]]] = (
    weakref.WeakKeyDictionary()
)


def close_with(client: Any, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``closer`` when ``client`` is closed (before the client's own close), as its own
    runtime is: a runtime built over several clients (``RedLock``'s masters) closes with any
    of them."""
    _ALSO_CLOSE.setdefault(client, []).append(closer)
    _hook_close(client)


def _internal_reset(caller: FrameType | None) -> bool:
    """Whether ``aclose()`` was called by redis-py's own cluster code (a reset of its slot map,
    after which the client reconnects by itself): its command path, and its pipelines — which
    also serve multi-key commands (``exists``, ``delete``, ``mget`` of keys in several slots) —
    but not the user's ``close()`` or ``async with`` exit."""
    code = None if caller is None else caller.f_code
    return (
        code is not None
        and code.co_name not in _USER_CLOSES
        and code.co_filename.replace("\\", "/").endswith("redis/asyncio/cluster.py")
    )


# redis-py cluster functions that close the client on the user's behalf
_USER_CLOSES: Final = frozenset({"close", "__aexit__", "__del__"})


def _hook_close(client: Any) -> None:
    if getattr(client, _HOOKED, False):
        return
    original = client.aclose
    ref = weakref.ref(client)

    async def aclose(*args: Any, **kwargs: Any) -> None:
        if _internal_reset(sys._getframe(1)):
            # redis-py's RedisCluster "closes" itself to refresh its slot map (CLUSTERDOWN, a
            # slot not covered, every few MOVED) and goes on serving: not the user's close.
            await original(*args, **kwargs)
            return
        target = ref()
        unbound = getattr(original, "__func__", None)  # (a bound method would keep the client)
        if target is not None and unbound is not None:
            _CLOSED[target] = unbound
        runtime = existing_runtime(target) if target is not None else None
        try:
            if runtime is not None:
                await runtime.aclose()
            for closer in list(_ALSO_CLOSE.get(target, ())) if target is not None else []:
                await closer()
        finally:
            # Also when the caller was cancelled meanwhile — by the loss the close itself
            # signals, an aclose() inside a guarded() block (helper-66): redis-py's own close
            # of the client runs, or a pooled connection stayed open.
            await original(*args, **kwargs)

    client.aclose = aclose
    setattr(client, _HOOKED, True)


def _owner_probe(
    topology: Topology, node: Hashable
) -> Callable[[str], Awaitable[bool | None]] | None:
    """How a hub asks its own node whether it serves a channel's slot (a topology that can:
    ``node_serves(node, channel)``), else ``None``."""
    node_serves = getattr(topology, "node_serves", None)
    if node_serves is None:
        return None
    return functools.partial(node_serves, node)


def _serves(topology: Topology, channel: str, node: Hashable) -> bool:
    """Whether ``node`` serves ``channel`` as ``topology`` knows it now (unknown: yes)."""
    try:
        return bool(topology.node_of(channel) == node)
    except Exception:  # a slot map being rebuilt (redis-py raises several kinds): keep it
        return True
