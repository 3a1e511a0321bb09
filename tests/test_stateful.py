"""S6 composition (SPEC §6): a hypothesis state machine drives the public API against a server.

Each example starts three long-lived asyncio tasks (*workers*, each serving a command queue, so
ownership is that task's, as the library defines it), three clients — ``Redis(host=, port=)``
(redis-py's default retry), the same through the fault proxy (tests/faultproxy.py), and
``Redis.from_url`` — and, per client, lock objects on two names (``x`` and ``{x}``, a pair that
once shared keys) with different leases, renewed or not. One test per primitive: ``Lock``,
``FairLock``, ``ReadWriteLock`` (``.read``/``.write``), ``Semaphore(permits=2)`` and ``RedLock``
over three independent masters (the session's server and two more): each client is then three
connections, one per master (the proxied one goes through the proxy to the first master only),
the rules are ``Lock``'s, and the server's view is a quorum's (an owner holds the lock when a
majority of masters has one of its round values; its hold count is 1 + the re-entries a majority
has — not the count a majority has at least: re-entries and inner releases confirmed by
different quorums leave the masters' counts apart, see ``introspect.quorum_hold_count``).
``release_beside_tagged_waiter`` is skipped for it: a RedLock's waiters never register.

Rules: acquire (blocking, small timeout), try (``blocking=False``), a blocking acquire left
running while other steps go on (hand-overs), re-enter (through another object of the same name),
release, extend (with and without a new lease), transfer to another worker, enter/leave
``guarded()`` blocks (nested: the worker serves commands inside the block), cancel a worker at a
random loop iteration of acquire/release/extend, close a client (and replace it), external
``DEL``, ``CLIENT KILL TYPE pubsub``, a lost reply under retry (proxy ``hold_replies`` then
``lose_held``), and sleeps that let unrenewed leases expire.

After every step, against the server (``tests/_introspect.py`` gives both views):

1. exclusion: never more valid holders than the primitive allows (locally and on the server);
2. a valid local lease (held, not expired by its own clock, its key not deleted since) is the
   server's owner — with the same hold count for ``Lock``/``FairLock``;
3. no ghost: a server holder no local task stands behind is gone within the longest lease + 1 s;
4. loss is signalled: a held lease the server no longer has turns lost within its lease + 1 s,
   ``on_lost`` was called for every lost lease, and a guarded block on a lost lease ends within
   1 s; a renewed lease on a healthy client (no delete, no fault, no loop stall) is never lost;
5. fencing tokens strictly increase per name, never repeat;
6. no keeper spin (renewal round trips stay within a rate), and at teardown (everything released,
   clients closed): no background task, no renewal, no key held beyond its lease.

Each API result is also checked against what it must mean: a successful acquire holds (one
more level on a re-entry), a release drops exactly one level, ``LockNotOwnedError`` only for a
task that holds nothing, ``LockLostError`` at release never for a lease that was valid.

Bounded in CI (``STATEFUL_EXAMPLES``/``STATEFUL_STEPS`` for more); ``make soak`` runs it long and
prints a summary.

What it found in the current library: a ``guarded()`` block nested in another on the same
hold turned the loss into ``LockLostError``; code handling that error inside the outer block ran
on unguarded (fixed; ``test_regressions.py::TestFoundByReview``). A soak on Valkey 8.1 (12 x 40)
failed check 2 for ``Lock``: a hold entered through the 0.5 s lock object, re-entered through
the 2 s one, vanished from the server after ``lost_reply`` steps of *other* tasks. The keeper's
renewal (0.5 s) had its held reply lost; redis-py's retry re-sent it after the re-entry (2 s),
so the server kept 0.5 s, but the keeper counted it as a renewal of the new 2 s lease (fixed;
``test_renewal_resent_after_a_longer_reentry_keeps_no_stale_lease``). Its sibling, found by
reading the same path: a cancelled re-entry through a shorter lease left that TTL on the server
unrenewed (fixed; ``test_cancelled_shorter_reentry_is_followed_by_renewal``).

``close_client`` never fired until its precondition went (see the rule): closing a client
found that only a task's newest ``Semaphore`` permit was marked lost (fixed;
``test_close_marks_every_permit_of_a_task_lost``). Soaks of 40 x 40 per primitive on Valkey 8.1
and Redis 7.0 with it enabled found one library bug — the lease keeper renewed a *releasing*
hold again and again once its renewal found the lock already released, until the release's
own reply (lost, re-sent after redis-py's retry back-off) came back: "renewal keeper spinning:
45 in 0.20 s" (``ReadWriteLock``, Redis 7.0; fixed,
``test_renewal_finding_a_release_done_stops_renewing``) — and four false positives of the
model, each fixed in the model with the reason beside it: an acquire that timed out while
another worker transferred its hold to the waiting task (``expect``); a ``Semaphore`` permit of
another holder beside the released one (``release_beside_tagged_waiter``); a task's earlier
``Semaphore`` permit, held under its newest, taken for a ghost (``live_owner_ids``); a
``RedLock``'s per-master counts apart after inner releases confirmed by different quorums
(``quorum_hold_count``) — and a hang of the harness itself: a "leave the guarded block" queued
just as a loss ended the block made the worker's own loop return (``Worker.serve``).

A soak of 120 ``Semaphore`` examples on a loaded 2-core machine failed check 4 once ("renewed
lease lost on a healthy client", a 0.5 s lease): a false positive of the model. Stalls were
noticed only between steps and in ``quiet``, not inside a step (a 0.4 s block of the loop
during ``sleep`` reproduces it), and a lease first seen by a check counted as born then, after
a stall noted earlier in the same step. Stalls are now probed all along (``_heartbeat``: the
loop's pace and a ``PING`` to each server), and such a lease's earliest birth is the check
before. Reading the renewal path for it found a library bug of the same symptom, for a lease
made *longer*: a renewal with the old length that the server ran after an ``extend`` and the
keeper judged before the extend's answer came back was counted as ordinary, so the holder
counted on the extend's lease while the server kept the renewal's (fixed;
``test_renewal_judged_while_a_longer_extend_is_in_flight_is_not_outlived``).

Scenario rules put in order the sequences of four or more steps that short random runs almost
never produce, each a rule of its own (so they are common), checked right away as well as by
the invariants:

* ``deep_lost_release``: enter three times through the retrying proxied client, lose an inner
  release's reply;
* ``shortened``: a fresh 2 s lease shortened to 0.5 s by ``extend`` or by re-entry through a
  0.5 s object, then quiet past 0.5 s: the lease is still the server's;
* ``nested_guard_loss``: nest two guarded blocks, leave the inner one, ``DEL``: the outer block
  ends within 1 s of the loss;
* ``extend_deleted``: ``extend`` after a ``DEL``, then quiet: no keeper spin;
* ``release_beside_tagged_waiter``: ``{x}`` held and waited for; releasing ``x`` (held once, no
  waiter of its own) hands it to nobody: it ends with no holder but those it had besides the
  releaser (a ``Semaphore``'s other permit).

Bugs of issue 5 re-introduced one at a time into the library (then reverted), ``Lock`` only,
20 examples x 30 steps (``STATEFUL_EXAMPLES=20 STATEFUL_STEPS=30``, Valkey 8.1). Before the
scenario rules none was found; now all are, each shrunk to one or two steps:

====================================================  =====  ====================================
bug re-introduced                                     found  failure (shrunk example)
====================================================  =====  ====================================
(2) inner release deletes *any* entry (``HDEL`` of    yes    check 2: "server hold count 1" for a
the first ``e:`` field: a re-sent release drops a            count-2 lease (``deep_lost_release``)
second level)
(4) no keeper reschedule after ``extend`` / re-entry  yes    "lease shortened by extend to 0.5 s
(both ``reschedule`` calls removed)                          not kept" (``shortened``)
(5) nested ``guarded()`` exit pops the task's guard   yes    "outer guarded block on lost <Lease>
entirely                                                     still runs after 1.0 s"
                                                             (``nested_guard_loss``)
(12) ``extend`` finding the lease gone leaves it in   yes    check 6: "renewal keeper spinning:
the keeper, and the keeper keeps non-live holds              533 in 0.25 s" (``extend_deleted``)
(1) ``{x}`` and ``x`` share their aux keys/channel    yes    "'x' released by its only holder,
(``slot_prefix`` of a tagged name is the tag only)           held by {<{x} waiter>: 399}"
                                                             (``release_beside_tagged_waiter``)
====================================================  =====  ====================================

Shrinking a found failure replays against a live server and can take minutes (or end in
hypothesis' ``FlakyStrategyDefinition`` with the original assertion attached).

The harness did find, in its first runs, the nested-guard bug above (a sibling of (5)), which no
single-mechanism test covered. Bugs that need a specific sequence not written as a scenario are
still rare in short random runs — run ``make soak`` for those.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from redis_locks_async import (
    FairLock,
    Lease,
    Lock,
    LockError,
    LockLostError,
    LockNotOwnedError,
    ReadWriteLock,
    RedLock,
    Semaphore,
)
from tests import _introspect as introspect
from tests.faultproxy import FaultProxy
from tests.servers import ServerProcess, running_servers

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="workers survive a cancellation with Task.uncancel()"
)

EXAMPLES: Final = int(os.environ.get("STATEFUL_EXAMPLES", "6"))
STEPS: Final = int(os.environ.get("STATEFUL_STEPS", "20"))
SOAK: Final = "STATEFUL_EXAMPLES" in os.environ  # random (not derandomized) on demand

TASKS: Final = 3
CLIENTS: Final = 3  # 0: Redis(host=, port=); 1: the same through the proxy; 2: Redis.from_url
PROXIED: Final = 1
SPECS: Final = ((0, 2.0, True), (0, 0.5, True), (1, 0.4, False))  # (name, lease, renewed)
EXTENDS: Final = (None, 0.5, 1.0, 3.0)
MAX_LEASE: Final = 3.0
WAIT: Final = 0.15  # every lock object's default timeout (async with, guarded)
MARGIN: Final = 0.15  # a lease with less left is not required to be the server's
SLACK: Final = 1.0
STALL: Final = 0.08  # a pause this long of the loop (or of a server's reply) excuses a lost renewal
HEARTBEAT: Final = 0.02  # seconds between two probes of the loop's and the servers' pace
STEP_BOUND: Final = 20.0
PERMITS: Final = 2
LAYOUT: Final = {"lock": "lock", "fair": "lock", "rw": "rw", "sem": "sem"}
MASTERS: Final = 3  # a RedLock's independent masters (the session's server and two more)
SHARE: Final = {"redlock": 2 / 3}  # of EXAMPLES in CI: the whole file stays near 50 s
NODE_TIMEOUT: Final = 0.04  # every RedLock's: one fan-out per client (shortest lease / 10)

STATS: dict[str, dict[str, collections.Counter[str]]] = collections.defaultdict(
    lambda: collections.defaultdict(collections.Counter)
)


@dataclass(frozen=True, eq=False)
class Handle:
    """One lock object of the machine."""

    slot: int  # the client it was built on
    name: str
    side: str  # "r"/"w" for a read/write lock, else ""
    lease: float
    lock: introspect.LockBase

    @property
    def key(self) -> tuple[int, str, str]:
        """Lock objects with one key share a task's hold (re-entry through another object)."""
        return (self.slot, self.name, self.side)


@dataclass(eq=False)
class Outcome:
    """What one command reported, and the task's lease on the lock before and after it."""

    value: object = None
    error: BaseException | None = None
    before: Lease | None = None
    count: int = 0  # hold count before
    after: Lease | None = None
    # Hold count of ``after`` when the command returned: the lease is a live view, and by the
    # time a command left running (``meanwhile``) is checked its count may have moved on — a
    # guarded block around it left when a fault cost the lease.
    count_after: int = 0


Job = Callable[["asyncio.Future[Outcome]"], Awaitable[Outcome]]


def build(
    kind: str, conns: list[aioredis.Redis], name: str, lease: float, auto: bool, on_lost: Any
) -> list[tuple[str, introspect.LockBase]]:
    """The lock objects of ``kind`` for one spec (both sides of a read/write lock) on a
    client's connections (one per master: several for a RedLock only)."""
    opts: dict[str, Any] = {"lease": lease, "auto_renew": auto, "timeout": WAIT, "on_lost": on_lost}
    if kind == "redlock":
        return [("", RedLock(conns, name, node_timeout=NODE_TIMEOUT, **opts))]
    client = conns[0]
    if kind == "rw":
        rw = ReadWriteLock(client, name, **opts)
        return [("r", rw.read), ("w", rw.write)]
    if kind == "sem":
        return [("", Semaphore(client, name, PERMITS, **opts))]
    return [("", (Lock if kind == "lock" else FairLock)(client, name, **opts))]


class Worker:
    """A long-lived task serving commands; inside a ``guarded()`` block it serves them too."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.queue: asyncio.Queue[tuple[Job | None, asyncio.Future[Outcome]]] = asyncio.Queue()
        self.guards: list[tuple[Handle, Lease]] = []
        self.busy: asyncio.Future[Outcome] | None = None
        self.cancel_ok = False  # the machine cancels the running command (not a guard's loss)
        self.task = asyncio.get_running_loop().create_task(self.serve(), name=f"w{index}")

    def submit(self, job: Job | None) -> asyncio.Future[Outcome]:
        """Queue ``job`` (``None``: leave the innermost guarded block); its outcome's future."""
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((job, fut))
        return fut

    def _take_cancel(self) -> bool:
        """Consume the machine's cancellation; ``False`` if another one is pending too."""
        if not self.cancel_ok:
            return False
        self.cancel_ok = False
        getattr(self.task, "uncancel")()  # noqa: B009 (Python 3.11+, see pytestmark)
        return bool(getattr(self.task, "cancelling")() == 0)  # noqa: B009

    async def serve(self, guarded: bool = False) -> asyncio.Future[Outcome] | None:
        """Run commands until a ``None`` job ends the ``guarded`` block this loop serves
        (returns its future); a guard's loss propagates.

        Outside any block a ``None`` job is answered at once: a lease's loss can end a block
        after the machine saw it open and queued the ``None`` (the worker's own loop used to
        return on it, ending the worker, and the machine waited for ever)."""
        while True:
            job, fut = await self.queue.get()
            if job is None:
                if guarded:
                    return fut
                if not fut.done():
                    fut.set_result(Outcome())
                continue
            self.busy = fut
            try:
                outcome = await job(fut)
            except asyncio.CancelledError as exc:
                outcome = Outcome(error=exc)
                if not self._take_cancel():
                    if not fut.done():
                        fut.set_result(outcome)
                    raise
            finally:
                self.busy = None
            self._take_cancel()  # a cancellation the command swallowed
            if not fut.done():
                fut.set_result(outcome)

    async def guard(self, h: Handle, entered: asyncio.Future[Outcome]) -> Outcome:
        """``async with h.lock.guarded()``, serving commands inside until told to leave."""
        left: asyncio.Future[Outcome] | None = None
        outcome = Outcome()
        try:
            async with h.lock.guarded() as lease:
                self.guards.append((h, lease))
                entered.set_result(Outcome(after=lease))
                try:
                    left = await self.serve(guarded=True)
                finally:
                    self.guards.pop()
        except LockError as exc:  # LockTimeout entering; LockLostError leaving
            outcome = Outcome(error=exc)
        except asyncio.CancelledError as exc:
            # An outer block's loss can cancel the worker while it leaves this one (its
            # release awaits the server): whoever asked to leave still gets an answer.
            outcome = Outcome(error=exc)
            raise
        finally:
            if left is not None and not left.done():
                left.set_result(outcome)
        return outcome


def op(h: Handle, action: Callable[[], Awaitable[object]]) -> Job:
    """A command running ``action`` in the worker, with the worker's lease before and after."""

    async def job(_: asyncio.Future[Outcome]) -> Outcome:
        before = h.lock.current_lease
        count = 0 if before is None else before.hold_count

        def outcome(value: object, error: BaseException | None) -> Outcome:
            after = h.lock.current_lease
            counted = 0 if after is None else after.hold_count
            return Outcome(value, error, before, count, after, counted)

        try:
            value = await action()
        except Exception as exc:
            return outcome(None, exc)
        return outcome(value, None)

    return job


def ok(out: Outcome) -> bool:
    """A command's error is one of the library's (or a guarded block's loss cancelled it)."""
    return out.error is None or isinstance(out.error, LockError | asyncio.CancelledError)


def step(
    fn: Callable[..., Coroutine[Any, Any, None]],
) -> Callable[..., None]:
    """Run a rule's coroutine on the machine's loop (bounded), counting it."""

    @functools.wraps(fn)
    def run(self: StatefulLocks, *args: Any, **kwargs: Any) -> None:
        self.stats["rules"][fn.__name__] += 1
        self.history.append(f"{self.loop.time():.3f} {fn.__name__}{args or ''}{kwargs}")
        self.run(fn(self, *args, **kwargs))

    return run


def scenario(
    fn: Callable[..., Coroutine[Any, Any, None]],
) -> Callable[..., None]:
    """A :func:`step` that first lets every blocking acquire left running finish."""

    @functools.wraps(fn)
    async def settled(self: StatefulLocks, *args: Any, **kwargs: Any) -> None:
        for t in list(self.pending):
            await self.settle(t)
        await fn(self, *args, **kwargs)

    return step(settled)


TASK = st.integers(0, TASKS - 1)
UNPROXIED = st.sampled_from((0, 2))
PICK = st.integers(0, 63)
ACTIONS = st.sampled_from(("acquire", "release", "extend"))


class StatefulLocks(RuleBasedStateMachine):
    """The machine; ``kind`` and ``server`` are set by :func:`machine_for`."""

    kind: str
    server: ServerProcess
    others: tuple[ServerProcess, ...] = ()  # a RedLock's other masters

    def __init__(self) -> None:
        super().__init__()
        self.stats = STATS[self.kind]
        self.stats["run"]["examples"] += 1
        self.loop = asyncio.new_event_loop()
        self.stopped_at = time.monotonic()
        self.runner: asyncio.Task[Any] | None = None
        self.stall = 0.0  # loop time of the last long pause of the loop or of a server
        self.snapshot_at = 0.0  # loop time of the last check's view of the local holds
        base = f"s6:{secrets.token_hex(3)}"
        self.names = (base, "{" + base + "}")
        self.lost_calls: list[Lease] = []
        self.history: collections.deque[str] = collections.deque(maxlen=12)
        self.retired: list[Any] = []  # local-state views of closed clients
        self.pending: dict[int, asyncio.Future[Outcome]] = {}
        self.handed: dict[int, list[Lease]] = {}  # transferred to a worker with a pending acquire
        self.born: dict[Lease, float] = {}  # first seen (loop time)
        self.earliest: dict[Lease, float] = {}  # taken at the earliest (the check before)
        self.top: dict[str, int] = {}  # highest fencing token per name
        self.tokens: dict[int, Lease] = {}
        self.deleted: dict[str, float] = {}  # name -> loop time of the last external DEL
        self.faulted = 0.0  # loop time of the last fault that may cost a renewal anywhere
        self.unclaimed: dict[str, float] = {}
        self.unsignalled: dict[Lease, float] = {}
        self.guard_lost: dict[Lease, float] = {}
        self.owner_task: dict[str, asyncio.Task[Any]] = {}
        self.sides: dict[str, str] = {}
        self.trips: list[tuple[int, float]] = []
        self.run(self._setup())

    # -- plumbing --------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, None], bound: float = STEP_BOUND) -> None:
        """Run ``coro`` on the machine's loop, noting how long the loop stood still before."""
        paused = time.monotonic() - self.stopped_at
        try:
            self.loop.run_until_complete(self._timed(coro, paused, bound))
        except AssertionError as exc:
            steps = "\n    ".join(self.history)
            raise AssertionError(
                f"{exc}\n  at {self.loop.time():.3f} after:\n    {steps}"
            ) from None
        finally:
            self.stopped_at = time.monotonic()

    async def _timed(self, coro: Coroutine[Any, Any, None], paused: float, bound: float) -> None:
        self.runner = asyncio.current_task()
        if paused > STALL:
            self.stats["faults"]["stall: between steps"] += 1
            self.stall = asyncio.get_running_loop().time()
        await asyncio.wait_for(coro, bound)

    async def _heartbeat(self) -> None:
        """Note the stalls a step cannot see: the loop late to wake (the process starved of
        CPU, a long GC) or a server slow to answer (starved itself), while any step runs.

        Only pauses *between* steps and inside :meth:`quiet` used to count, so check 4 took a
        lease lost to a stall *inside* a step for a library bug: a 0.5 s lease is lost once a
        renewal due every 0.17 s is 0.33 s late, and nothing measured the loop during, say,
        ``sleep`` (0.45 s). A soak of 120 ``Semaphore`` examples on a loaded 2-core machine
        failed so ("renewed lease lost on a healthy client", 0.5 s); a 0.4 s block of the
        loop in ``sleep`` makes the same failure at will ("renewal failed until the lease
        ended"), and unloaded soaks see in-step stalls past :data:`STALL` now and then. Each
        probe is a ``PING`` to every server on connections of its own (never the proxy's),
        then a short sleep; either one late by more than :data:`STALL` is a stall."""
        loop = asyncio.get_running_loop()
        while True:
            sent = loop.time()
            with contextlib.suppress(Exception):
                await asyncio.gather(*(probe.ping() for probe in self.probes))
            if (now := loop.time()) - sent > STALL:
                self.stats["faults"]["stall: server or loop (probe)"] += 1
                self.stall = now
            await asyncio.sleep(HEARTBEAT)
            if loop.time() - now > HEARTBEAT + STALL:
                self.stats["faults"]["stall: loop (probe)"] += 1
                self.stall = loop.time()

    def _connect(self, slot: int) -> list[aioredis.Redis]:
        """Client ``slot``'s connections, one per master (the first master is proxied)."""
        conns = []
        for i, server in enumerate((self.server, *self.others)):
            if slot == PROXIED and i == 0:
                conns.append(aioredis.Redis(host=self.proxy.host, port=self.proxy.port))
            elif slot == 2:
                conns.append(aioredis.Redis.from_url(server.url))
            else:
                conns.append(aioredis.Redis(host=server.host, port=server.port))
        return conns

    def _open(self, slot: int) -> list[Handle]:
        """(Re)open client ``slot``: its connections, lock objects and local-state view."""
        conns = self.clients[slot] = self._connect(slot)
        handles = [
            Handle(slot, self.names[n], side, lease, lock)
            for n, lease, auto in SPECS
            for side, lock in build(self.kind, conns, self.names[n], lease, auto, self._on_lost)
        ]
        redlock = self.kind == "redlock"
        self.views[slot] = introspect.redlock_client(handles[0].lock) if redlock else conns[0]
        return handles

    def _on_lost(self, lease: Lease) -> None:
        self.lost_calls.append(lease)

    async def _setup(self) -> None:
        self.inspectors = [
            aioredis.Redis(host=server.host, port=server.port)
            for server in (self.server, *self.others)
        ]
        self.probes = [
            aioredis.Redis(host=server.host, port=server.port)
            for server in (self.server, *self.others)
        ]
        self.heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(), name="beat")
        for inspector in self.inspectors:
            await inspector.flushall()
        self.proxy = await FaultProxy(self.server.host, self.server.port).start()
        self.clients: list[list[aioredis.Redis]] = [[] for _ in range(CLIENTS)]
        self.views: list[Any] = [None] * CLIENTS  # where each client's local state lives
        self.handles = [h for slot in range(CLIENTS) for h in self._open(slot)]
        self.workers = [Worker(i) for i in range(TASKS)]

    async def holders(self, name: str) -> dict[str, int]:
        """Who holds ``name`` on the server: owner id -> ms left (a RedLock's: on a quorum)."""
        if self.kind == "redlock":
            return await introspect.quorum_holders(self.inspectors, name)
        return await introspect.server_holders(self.inspectors[0], name, LAYOUT[self.kind])

    async def hold_count(self, name: str) -> int | None:
        """The server's hold count of ``name`` (a quorum's for a RedLock); ``None`` for the
        primitives without one."""
        if self.kind == "redlock":
            return await introspect.quorum_hold_count(self.inspectors, name)
        if LAYOUT[self.kind] == "lock":
            return await introspect.server_hold_count(self.inspectors[0], name)
        return None

    def why(self, message: str, lease: Lease | None = None) -> str:
        """An assertion message with the lease's story and the last steps."""
        if lease is not None:
            message += (
                f" (lease {lease.lease} s, born {self.born.get(lease, -1):.3f}, "
                f"lost: {lease.lost_reason or '-'}; stall {self.stall:.3f}, fault "
                f"{self.faulted:.3f}, deleted {self.deleted.get(lease.name, -1):.3f})"
            )
        return message

    def handle(self, pick: int) -> Handle:
        return self.handles[pick % len(self.handles)]

    def leases(self) -> list[tuple[int, asyncio.Task[Any], Lease]]:
        """Every local hold: (client slot, task, lease)."""
        return [
            (slot, task, lease)
            for slot, view in enumerate(self.views)
            for task, lease in introspect.task_leases(view)
        ]

    def held(self, t: int, pick: int, slots: tuple[int, ...] = tuple(range(CLIENTS))) -> Handle:
        """A lock object through which worker ``t`` holds something (any one if none)."""
        task = self.workers[t].task
        keys = {
            (slot, lease.name, introspect.lease_side(lease))
            for slot, owner, lease in self.leases()
            if owner is task and slot in slots and lease.state.value == "held"
        }
        choice = [h for h in self.handles if h.key in keys]
        if not choice:
            choice = [h for h in self.handles if h.slot in slots]
        return choice[pick % len(choice)]

    async def settle(self, t: int) -> None:
        """Wait for the command left running on worker ``t``."""
        fut = self.pending.pop(t, None)
        if fut is not None:
            self.expect("acquire", await fut, True, self.handed.pop(t, []))

    async def do(self, t: int, job: Job, what: str, *, spins: int | None = None) -> Outcome:
        """Run ``job`` on worker ``t``; with ``spins``, cancel it after that many iterations."""
        await self.settle(t)
        w = self.workers[t]
        fut = w.submit(job)
        if spins is not None:
            while w.busy is not fut and not fut.done():  # noqa: ASYNC110 (count loop turns)
                await asyncio.sleep(0)
            for _ in range(spins):
                if fut.done():
                    break
                await asyncio.sleep(0)
            if not fut.done():
                self.stats["faults"]["cancel " + what] += 1
                w.cancel_ok = True
                w.task.cancel()
        outcome = await fut
        if spins is not None:
            for view in self.views:
                await introspect.drain(view)
        return outcome

    def healthy(self, slot: int, lease: Lease) -> bool:
        """Renewed on a healthy client since it was born: no fault, no DEL, no stall since."""
        excuses = (self.stall, self.faulted, self.deleted.get(lease.name, -1.0))
        born = min(self.born.get(lease, -math.inf), self.earliest.get(lease, math.inf))
        return lease.auto_renew and slot != PROXIED and born > max(excuses)

    def round_trips(self) -> int:
        """Renewal round trips of every client's keeper so far."""
        return sum(introspect.renewal_round_trips(v) for v in self.views + self.retired)

    @staticmethod
    def no_spin(trips: int, seconds: float) -> None:
        """6. the keeper never spins: ``trips`` renewal round trips in ``seconds`` stay few."""
        assert trips <= 20 + 60 * seconds, f"renewal keeper spinning: {trips} in {seconds:.2f} s"

    async def quiet(self, seconds: float) -> None:
        """Let ``seconds`` pass with nothing else to do, noting a stall of the loop."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while (now := loop.time()) < end:
            nap = min(0.05, end - now)
            await asyncio.sleep(nap)
            if loop.time() - now > nap + STALL:
                self.stats["faults"]["stall: quiet"] += 1
                self.stall = loop.time()

    def find(self, slot: int, name: str, lease: float) -> Handle:
        """The lock object on client ``slot`` for ``name`` with ``lease`` (a write side)."""
        return next(
            h
            for h in self.handles
            if (h.slot, h.name, h.lease) == (slot, name, lease) and h.side != "r"
        )

    def valid(self, lease: Lease, margin: float = MARGIN) -> bool:
        """Held, not over by its own clock, and its key not deleted since it was acquired."""
        born = self.born.get(lease, float("inf"))
        return (
            lease.state.value == "held"
            and lease.remaining() > margin
            and self.deleted.get(lease.name, -1.0) < born
        )

    def expect(
        self, action: str, out: Outcome, valid_before: bool, handed: list[Lease] | None = None
    ) -> None:
        """What a command's result must mean (module docstring). ``handed``: leases another
        worker transferred to this one while the command ran (a pending acquire)."""
        err, before, n, after = out.error, out.before, out.count, out.after
        m = out.count_after
        if isinstance(err, asyncio.CancelledError):
            return
        if err is not None and not isinstance(err, LockError):
            raise AssertionError(f"{action} raised {err!r}")
        if isinstance(err, LockNotOwnedError) and not isinstance(err, LockLostError):
            assert before is None or before.state.value != "held", f"{action}: {err}"
        if isinstance(err, LockLostError) and action == "release":
            assert not valid_before, f"release of a valid lease reported a loss: {err}"
        if err is not None:
            return
        if action == "acquire":
            if out.value is True:
                assert after is not None, "acquire returned True, but nothing is held"
                if before is after:
                    assert m == n + 1, f"re-entry: count {n} -> {m}"
                else:
                    assert m == 1, f"fresh hold with count {m}"
            else:
                # A transfer to this worker while its acquire waited changes its hold, not the
                # acquire: the task then waits for a lock it holds itself (nobody releases it)
                # and times out, its handed hold intact (``transfer`` is local, no I/O).
                assert after is before or any(after is lease for lease in handed or ()), (
                    "acquire returned False, but the hold changed"
                )
        elif action == "release":
            if n > 1:
                assert after is before and after is not None, "inner release ended the hold"
                assert m == n - 1, f"release: count {n} -> {m}"
            else:
                assert after is not before, "final release left the hold in place"
        elif action == "extend":
            assert after is before and after is not None and m == n

    def job_for(self, h: Handle, action: str, arg: float | None = None) -> Job:
        if action == "acquire":
            return op(h, lambda: h.lock.acquire(arg))
        if action == "release":
            return op(h, h.lock.release)
        return op(h, lambda: h.lock.extend(arg))

    async def act(self, t: int, h: Handle, action: str, arg: float | None = None) -> Outcome:
        await self.settle(t)  # first: a lease valid now may expire while it settles
        lease = self._lease_of(t, h)
        valid = lease is not None and self.valid(lease, 0.3)
        out = await self.do(t, self.job_for(h, action, arg), action)
        self.expect(action, out, valid)
        return out

    async def hold(self, t: int, h: Handle) -> Lease | None:
        """Worker ``t``'s lease through ``h``, acquired (fresh: born now) if it held none."""
        if (lease := self._lease_of(t, h)) is None or lease.state.value != "held":
            started = asyncio.get_running_loop().time()
            if (lease := (await self.act(t, h, "acquire", WAIT)).after) is not None:
                self.born.setdefault(lease, started)
        return lease if lease is not None and lease.state.value == "held" else None

    def _lease_of(self, t: int, h: Handle) -> Lease | None:
        task = self.workers[t].task
        for slot, owner, lease in self.leases():
            if owner is task and (slot, lease.name, introspect.lease_side(lease)) == h.key:
                return lease
        return None

    # -- rules -------------------------------------------------------------------------------

    @rule(t=TASK, h=PICK, timeout=st.sampled_from((0.05, 0.25)))
    @step
    async def acquire(self, t: int, h: int, timeout: float) -> None:
        await self.act(t, self.handle(h), "acquire", timeout)

    @rule(t=TASK, h=PICK)
    @step
    async def try_acquire(self, t: int, h: int) -> None:
        hd = self.handle(h)
        self.expect(
            "acquire",
            await self.do(t, op(hd, lambda: hd.lock.acquire(blocking=False)), "try"),
            False,
        )

    @rule(t=TASK, h=PICK)
    @step
    async def acquire_meanwhile(self, t: int, h: int) -> None:
        await self.meanwhile(t, self.handle(h), 0.5)

    async def meanwhile(self, t: int, h: Handle, timeout: float) -> None:
        """Leave a blocking acquire running on worker ``t`` while other steps go on."""
        await self.settle(t)
        self.pending[t] = self.workers[t].submit(op(h, lambda: h.lock.acquire(timeout)))
        await asyncio.sleep(0.01)

    @rule(t=TASK, k=PICK)
    @step
    async def reenter(self, t: int, k: int) -> None:
        await self.act(t, self.held(t, k), "acquire", WAIT)

    @rule(t=TASK, k=PICK)
    @step
    async def release(self, t: int, k: int) -> None:
        await self.act(t, self.held(t, k), "release")

    @rule(t=TASK, h=PICK)
    @step
    async def release_any(self, t: int, h: int) -> None:
        await self.act(t, self.handle(h), "release")

    @rule(t=TASK, k=PICK, lease=st.sampled_from(EXTENDS))
    @step
    async def extend(self, t: int, k: int, lease: float | None) -> None:
        await self.act(t, self.held(t, k), "extend", lease)

    @rule(t=TASK, k=PICK, to=TASK)
    @step
    async def transfer(self, t: int, k: int, to: int) -> None:
        h, target = self.held(t, k), self.workers[to].task

        async def hand() -> Lease:
            return h.lock.transfer(target)

        out = await self.do(t, op(h, hand), "transfer")
        if out.error is None:
            assert isinstance(out.value, Lease)
            assert (target, out.value) in [(task, lease) for _, task, lease in self.leases()]
            if to in self.pending:
                self.handed.setdefault(to, []).append(out.value)
        else:
            assert ok(out), repr(out.error)

    @rule(t=TASK, h=PICK)
    @step
    async def enter_guarded(self, t: int, h: int) -> None:
        await self.enter(t, self.handle(h))

    async def enter(self, t: int, h: Handle) -> Lease | None:
        """Enter ``h.lock.guarded()`` on worker ``t``; the block's lease, ``None`` if refused."""
        out = await self.do(t, functools.partial(self.workers[t].guard, h), "guarded")
        assert ok(out), repr(out.error)
        return out.after

    @rule(t=TASK)  # no precondition on open blocks: a guard's loss ends them (timing)
    @step
    async def leave_guarded(self, t: int) -> None:
        await self.leave(t)

    async def leave(self, t: int) -> None:
        """Leave worker ``t``'s innermost guarded block, if it is in one."""
        await self.settle(t)
        w = self.workers[t]
        if w.guards:
            out = await w.submit(None)
            assert ok(out), repr(out.error)

    @rule(t=TASK, k=PICK, action=ACTIONS, spins=st.integers(0, 40))
    @step
    async def cancel(self, t: int, k: int, action: str, spins: int) -> None:
        h = self.handle(k) if action == "acquire" else self.held(t, k)
        self.faulted = asyncio.get_running_loop().time()
        self.expect(
            action, await self.do(t, self.job_for(h, action, 0.2), action, spins=spins), False
        )

    # No precondition: it used to be "something is held", but hypothesis evaluates
    # preconditions off the machine's loop, where the library's local state (kept per client
    # *and running loop*) reads as empty — the rule never fired. Nor can it be a snapshot from
    # the last check: what is held depends on timing (leases expire), and a precondition that
    # differs on replay makes hypothesis fail with FlakyStrategyDefinition instead of shrinking
    # (the same holds for any precondition on local state: only constant ones are used).
    # Closing a client that holds nothing is a valid step too (its waiters, its keeper).
    @rule(slot=st.integers(0, CLIENTS - 1))
    @step
    async def close_client(self, slot: int) -> None:
        for t in list(self.pending):
            await self.settle(t)
        self.stats["faults"]["close client"] += 1
        old = self.views[slot]
        held = [lease for _, lease in introspect.task_leases(old) if lease.state.value == "held"]
        for conn in self.clients[slot]:
            await conn.aclose()
        for lease in held:
            assert lease.lost, f"{lease!r} not lost after its client closed"
        self.retired.append(old)
        fresh = iter(self._open(slot))
        self.handles = [next(fresh) if h.slot == slot else h for h in self.handles]

    @rule(n=st.integers(0, 2))
    @step
    async def fault(self, n: int) -> None:
        """An external ``DEL`` of a lock's key (``n`` < 2), or ``CLIENT KILL TYPE pubsub``."""
        if n == 2:
            self.stats["faults"]["pubsub kill"] += 1
            for inspector in self.inspectors:
                await inspector.client_kill_filter(_type="pubsub")
            return
        await self._delete(self.names[n])

    async def _delete(self, name: str) -> None:
        """An external ``DEL`` of ``name``'s key: every lease on it is lost (no longer valid)."""
        self.stats["faults"]["DEL"] += 1
        loop = asyncio.get_running_loop()
        sent = loop.time()
        await asyncio.gather(*(inspector.delete(name) for inspector in self.inspectors))
        for _, _, lease in self.leases():  # held before the DEL, or taken while it ran
            self.born.setdefault(lease, sent)
        self.deleted[name] = loop.time()

    @rule(t=TASK, k=PICK, action=ACTIONS)
    @step
    async def lost_reply(self, t: int, k: int, action: str) -> None:
        await self.settle(t)
        await self._lost_reply(t, self.held(t, k, (PROXIED,)), action)

    async def _lost_reply(self, t: int, h: Handle, action: str) -> None:
        """Run ``action`` through the proxy, losing its reply (the client's retry re-sends it)."""
        valid = (lease := self._lease_of(t, h)) is not None and self.valid(lease, 0.3)
        self.proxy.hold_replies()
        fut = self.workers[t].submit(self.job_for(h, action, 0.5 if action == "extend" else WAIT))
        try:
            await self.proxy.wait_held(timeout=0.25)
            if self.proxy.lose_held():
                self.stats["faults"]["lost reply"] += 1
                self.faulted = asyncio.get_running_loop().time()
        except TimeoutError:
            pass
        finally:
            self.proxy.heal()
        self.expect(action, await fut, valid)

    @rule(seconds=st.sampled_from((0.02, 0.45)))
    @step
    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    # -- scenarios: sequences of four or more steps that random runs rarely put in order -----

    @rule(t=TASK)
    @scenario
    async def deep_lost_release(self, t: int) -> None:
        """Enter three times through the retrying proxied client, then lose an inner release's
        reply: the re-sent release must not drop a second level (check 2 compares counts)."""
        h = self.find(PROXIED, self.names[0], SPECS[0][1])
        if (lease := await self.hold(t, h)) is None:
            return
        for _ in range(3 - lease.hold_count):  # a semaphore takes another permit instead
            await self.act(t, h, "acquire", WAIT)
        await self._lost_reply(t, h, "release")

    @rule(t=TASK, slot=UNPROXIED, how=st.sampled_from(("extend", "re-entry")))
    @scenario
    async def shortened(self, t: int, slot: int, how: str) -> None:
        """Shorten a fresh long lease (extend, or re-entry through a short-lease object), stay
        quiet past the short lease: renewal must have followed the new length."""
        h, short = self.find(slot, self.names[0], SPECS[0][1]), SPECS[1][1]
        if (lease := await self.hold(t, h)) is None:
            return
        if how == "extend":
            await self.act(t, h, "extend", short)
        else:
            await self.act(t, self.find(slot, self.names[0], short), "acquire", WAIT)
        await self.quiet(short + 0.15)
        if self.healthy(slot, lease):
            holders = await self.holders(h.name)
            assert not lease.lost and introspect.lease_owner_id(lease) in holders, self.why(
                f"lease shortened by {how} to {short} s not kept: {lease!r}", lease
            )

    @rule(t=TASK, slot=UNPROXIED)
    @scenario
    async def nested_guard_loss(self, t: int, slot: int) -> None:
        """Nest two guarded blocks, leave the inner one, lose the lease (external DEL): the
        outer block must be cancelled once the loss is noticed."""
        h = self.find(slot, self.names[0], SPECS[1][1])
        if (lease := await self.enter(t, h)) is None:
            return
        if await self.enter(t, h) is not None:
            await self.leave(t)
        await self._delete(h.name)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lease.wait_lost(), lease.lease + SLACK)
        if lease.lost:
            w, loop = self.workers[t], asyncio.get_running_loop()
            until = loop.time() + SLACK
            while any(g is lease for _, g in w.guards) and loop.time() < until:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            assert all(g is not lease for _, g in w.guards), self.why(
                f"outer guarded block on lost {lease!r} still runs after {SLACK} s", lease
            )

    @rule(t=TASK, slot=UNPROXIED)
    @scenario
    async def extend_deleted(self, t: int, slot: int) -> None:
        """Extend a lease whose key was deleted: it is lost, and the keeper must not spin on
        it afterwards (check 6 over a quiet period)."""
        h = self.find(slot, self.names[0], SPECS[1][1])
        if await self.hold(t, h) is None:
            return
        await self._delete(h.name)
        await self.act(t, h, "extend")
        trips, loop = self.round_trips(), asyncio.get_running_loop()
        started = loop.time()
        await self.quiet(h.lease / 2)
        self.no_spin(self.round_trips() - trips, loop.time() - started)

    @precondition(lambda self: self.kind != "redlock")  # its waiters never register
    @rule(t=TASK, slot=UNPROXIED)
    @scenario
    async def release_beside_tagged_waiter(self, t: int, slot: int) -> None:
        """Worker t holds ``{x}``, another waits for it; a third takes ``x`` and releases it:
        with no waiter of its own, ``x`` gains no holder (nothing is handed to ``{x}``'s
        waiter) and loses the releaser's.

        ``x``'s holders after the release are compared with those before it, not required to be
        none: a ``Semaphore``'s other permit may be held all along — by another worker, or by
        any worker through another client or object (a task may hold several permits), e.g.
        the permit ``deep_lost_release`` leaves. For the exclusive primitives the releaser's
        fresh hold is the only one, so ``x`` must end free."""
        x, tagged = self.names
        h_tag = self.find(slot, tagged, SPECS[2][1])
        if await self.hold(t, h_tag) is None:
            return
        await self.meanwhile((t + 1) % TASKS, h_tag, 0.5)
        releaser, h_x = (t + 2) % TASKS, self.find(2 - slot, x, SPECS[0][1])
        if self._lease_of(releaser, h_x) is not None:
            return  # held already (maybe more than once: a release may not free it)
        if (lease := await self.hold(releaser, h_x)) is None:
            return  # held by another worker
        mine, others = introspect.lease_owner_id(lease), set(await self.holders(x))
        others.discard(mine)
        if (await self.act(releaser, h_x, "release")).error is None:
            holders = await self.holders(x)
            assert set(holders) <= others, self.why(
                f"{x!r} released by {mine} (other holders before: {sorted(others)}), held by "
                f"{holders}"
            )

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def checked(self) -> None:
        self.run(self.check())

    async def check(self) -> None:
        now = asyncio.get_running_loop().time()
        local = self.leases()  # snapshot first: the server is read after it
        claimed = set().union(*(introspect.live_owner_ids(v) for v in self.views))
        previous, self.snapshot_at = self.snapshot_at, now
        server = {name: await self.holders(name) for name in self.names}
        counts = {name: await self.hold_count(name) for name in self.names}
        # 5. fencing
        for _, _, lease in sorted(local, key=lambda item: item[2].fencing_token):
            self.born.setdefault(lease, now)
            # First seen now, it was taken after the last check's view at the earliest — by a
            # pending acquire, say, early in a step whose stall then cost it the lease: taken
            # for born "now", after that stall was noted, it would count as healthy.
            self.earliest.setdefault(lease, previous)
            if self.tokens.get(lease.fencing_token) is not lease:
                token = lease.fencing_token
                assert token not in self.tokens, f"token {token} repeated"
                assert token > self.top.get(lease.name, 0), f"token {token} not increasing"
                self.tokens[token] = lease
                self.top[lease.name] = token
        valid: dict[str, list[tuple[asyncio.Task[Any], Lease]]] = collections.defaultdict(list)
        for slot, task, lease in local:
            owner = introspect.lease_owner_id(lease)
            self.owner_task[owner] = task
            self.sides[owner] = introspect.lease_side(lease)
            state = lease.state.value
            if state == "lost":
                assert lease in self.lost_calls, f"{lease!r} lost without on_lost"
                assert not self.healthy(slot, lease), self.why(
                    f"renewed lease lost on a healthy client: {lease!r}", lease
                )
                continue
            if state != "held":
                continue
            if owner in server[lease.name]:
                self.unsignalled.pop(lease, None)
                if self.valid(lease):
                    valid[lease.name].append((task, lease))
                    if counts[lease.name] is not None:
                        assert counts[lease.name] == lease.hold_count, self.why(
                            f"{lease!r}: server hold count {counts[lease.name]}", lease
                        )
                continue
            # 2. a valid lease is the server's; 4. otherwise its loss is signalled in time
            assert not self.valid(lease), self.why(f"valid {lease!r} not held on the server", lease)
            since = self.unsignalled.setdefault(lease, now)
            assert now - since <= lease.lease + SLACK, self.why(
                f"loss of {lease!r} unsignalled", lease
            )
        # 1. exclusion
        for name, holders in valid.items():
            self.exclusive(
                name, {introspect.lease_owner_id(lease): task for task, lease in holders}
            )
        for name, owners in server.items():
            self.exclusive(name, {owner: self.owner_task.get(owner) for owner in owners})
        # 3. no ghost
        for owners in server.values():
            for owner in owners:
                if owner in claimed:
                    self.unclaimed.pop(owner, None)
                else:
                    since = self.unclaimed.setdefault(owner, now)
                    assert now - since <= MAX_LEASE + SLACK, self.why(f"ghost holder {owner}")
        # 4. guarded blocks end when their lease is lost
        for w in self.workers:
            if w.task.done():
                raise AssertionError(f"worker {w.index} ended: {w.task!r}")
            for _, lease in w.guards:
                if lease.lost:
                    since = self.guard_lost.setdefault(lease, now)
                    assert now - since <= SLACK, self.why(
                        f"guarded block on lost {lease!r} runs", lease
                    )
        # 6. the keeper never spins
        trips = self.round_trips()
        self.trips.append((trips, now))
        if len(self.trips) > 5:
            old_trips, then = self.trips.pop(0)
            self.no_spin(trips - old_trips, now - then)

    def exclusive(self, name: str, holders: dict[str, asyncio.Task[Any] | None]) -> None:
        """At most what the primitive allows (a downgrading writer's task may also read)."""
        if self.kind == "sem":
            assert len(holders) <= PERMITS, f"{len(holders)} permits held on {name}"
        elif self.kind == "rw":
            sides = {owner: self.sides.get(owner, "?") for owner in holders}
            writers = {holders[o] for o, side in sides.items() if side == "w"}
            assert len([s for s in sides.values() if s == "w"]) <= 1, f"two writers on {name}"
            if writers:
                assert {holders[o] for o in sides} == writers, f"readers beside a writer: {name}"
        else:
            assert len(holders) <= 1, f"two holders of {name}: {holders}"

    # -- teardown ----------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            self.run(self._teardown(), bound=60.0)
        finally:
            self.run(self._close(), bound=30.0)
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def _teardown(self) -> None:
        self.proxy.heal()
        for t in list(self.pending):
            await self.settle(t)
        for t, w in enumerate(self.workers):
            while w.guards and not w.task.done():
                await w.submit(None)
            for h in self.handles:
                await self.do(t, op(h, functools.partial(release_all, h)), "release all")
        await self.check()
        for w in self.workers:
            w.task.cancel()
        await asyncio.wait([w.task for w in self.workers])
        for view, conns in zip(self.views, self.clients, strict=True):
            await introspect.drain(view)
            for conn in conns:
                await conn.aclose()
        # 6. nothing left running; nothing held beyond its lease
        for view in self.views + self.retired:
            assert not introspect.background_tasks(view), "background task left"
            assert introspect.keeper_size(view) == 0, "renewal left running"
        for name in self.names:
            holders = await self.holders(name)
            for owner, ms in holders.items():
                assert ms <= MAX_LEASE * 1000, f"{owner} holds {name} for {ms} ms more"

    async def _close(self) -> None:
        if hasattr(self, "heartbeat"):
            self.heartbeat.cancel()
        for w in getattr(self, "workers", ()):
            w.task.cancel()
        clients = [*getattr(self, "clients", ()), getattr(self, "inspectors", ())]
        for conns in [*clients, getattr(self, "probes", ())]:
            for client in conns:
                await client.aclose()
        if hasattr(self, "proxy"):
            await self.proxy.close()
        mine = {asyncio.current_task(), self.runner}
        rest = [t for t in asyncio.all_tasks() if t not in mine]
        for task in rest:
            task.cancel()
        await asyncio.wait(rest, timeout=5.0) if rest else None


async def release_all(h: Handle) -> None:
    """Release every hold of the calling task on ``h`` (lost ones are acknowledged)."""
    for _ in range(20):
        if h.lock.current_lease is None:
            return
        with contextlib.suppress(LockError):
            await h.lock.release()


def machine_for(
    kind: str, server: ServerProcess, others: tuple[ServerProcess, ...] = ()
) -> type[StatefulLocks]:
    attrs = {"kind": kind, "server": server, "others": others}
    return type(f"Stateful_{kind}", (StatefulLocks,), attrs)


@pytest.fixture(scope="module")
def other_masters(server_binary: Path) -> Iterator[tuple[ServerProcess, ...]]:
    """The two masters a RedLock uses besides the session's server (started for it only)."""
    with running_servers(server_binary, MASTERS - 1) as procs:
        yield tuple(procs)


def test_a_command_left_running_is_judged_by_the_count_it_returned_with(
    server: ServerProcess,
) -> None:
    """Harness regression (a soak's false alarm, "re-entry: count 2 -> 2", seed
    239254442112398944473977582989997588): a re-entry left running (``acquire_meanwhile``,
    through another lock object, inside a guarded block) returned with the count 3, but was
    judged by its lease's count when checked — a live view: an external ``DEL`` had cost the
    lease meanwhile and the guarded block around it had left. It is judged by the count it
    returned with. The steps are the soak's, shrunk."""
    state = machine_for("fair", server)()
    try:
        state.shortened(how="extend", slot=2, t=1)
        state.transfer(k=8, t=1, to=2)
        state.enter_guarded(h=51, t=2)
        state.acquire_meanwhile(h=7, t=2)
        state.fault(n=0)
        state.lost_reply(action="release", k=34, t=1)
        state.checked()
    finally:
        state.teardown()


@pytest.mark.timeout(0 if SOAK else 120)
@pytest.mark.parametrize("kind", ["lock", "fair", "rw", "sem", "redlock"])
def test_composition(kind: str, server: ServerProcess, request: pytest.FixtureRequest) -> None:
    """S6: random compositions of the public API keep every invariant of the module docstring."""
    started = time.monotonic()
    others = request.getfixturevalue("other_masters") if kind == "redlock" else ()
    machine = machine_for(kind, server, others)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES if SOAK else round(EXAMPLES * SHARE.get(kind, 1.0)),
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=not SOAK,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    stats = STATS[kind]
    steps = sum(stats["rules"].values())
    print(
        f"\nS6 {kind}: {stats['run']['examples']} examples, {steps} steps in "
        f"{time.monotonic() - started:.1f} s; rules {dict(stats['rules'])}; "
        f"faults {dict(stats['faults'])}"
    )
