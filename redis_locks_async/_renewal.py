"""The lease keeper: one asyncio task per runtime renews every auto-renewed lease, in batches.

A hold is renewed a third of the way into its lease at the latest (``Hold.renew_at``). To share
round trips, the keeper moves each renewal *earlier*, never later, onto a **beat**: loop times
``phase + k * period`` (period = lease/3, ``phase`` drawn once per keeper, so processes do not
all renew at the same instant). Every hold of one lease length therefore falls due at the same
moment, and the keeper renews all of them together — those due, soonest expiry first, in as few
pipelines per node as :data:`BATCH` allows, of equal size: 10,000 held locks of one lease cost
ten round trips per lease/3, not 10,000 timers, and holds of one lease never tick apart. Holds
acquired between two beats join the next one; a hold renewed off the beat (a retry, a
confirmation, a changed lease) rejoins it at its next renewal. Leases whose periods are whole
multiples of each other share beats. Joining the beat costs one renewal up to a period earlier
than lease/3 would have asked for, once per hold (and again after each renewal off the beat).

An earlier rule renewed, with any batch that came due, every hold at least halfway through its
period. Holds acquired over a few seconds then settled into two groups about half a period
apart, and the holds at the edge of each group were renewed by both (B5: 10,000 locks cost 10.1
round trips per tick, twelve per period on a loaded machine). On a beat, renewing a hold early
gains nothing (its next renewal falls on the same beat), so nothing is renewed before it is due.

A renewal succeeds only if the owner id still holds the key (a token-checked script); "not
held" means the lease is **lost**. A transient error (connection refused, timeout, a demoted
master) is retried with a growing back-off until the lease's local expiry passes; then the lease
is lost. Every round trip is bounded by the earliest local expiry in its batch, so a silent
network never keeps a lease "held" past its end. On a cluster the nodes' batches go side by
side, each node's in a task of its own judged as its answers come in, while the keeper goes on
with the others: a stopped node costs the holds it serves, not the others (their renewals,
answered, were once left unjudged until its round trip timed out, and every lease of the client
ended locally while the healthy nodes had renewed it). A client whose
connection pool is exhausted (``max_connections`` reached in a burst of acquisitions) sent
nothing: that is no failure, and the keeper tries again every 10 ms, as the acquisitions
competing with it do.

A lease whose end passes while its renewal is still unanswered is lost **at its end**, not when
the round trip returns or times out: a watchdog timer, armed at the earliest local expiry of the
holds kept, marks every hold still held past its expiry lost (its guarded blocks cancelled, its
``on_lost`` called) on time. Another owner may take the lock from that moment (a ``RedLock``'s
validity keeps only ``lease·1 % + 2 ms`` of margin), so the signal must not wait for a round
that answers late: the round's answer, when it comes, is ignored for a hold that is no longer
held. The hold's release later gives up whatever the late renewal may have kept on the server.

The keeper also confirms hand-overs (a lock handed to a waiting task is granted a short claim
window; the confirmation is an ordinary renewal, due at once) and watches leases without
auto-renewal, only to mark them lost when they expire. A hold that is no longer live (released,
lost) is dropped the moment the keeper sees it, and checked again just before each pipeline is
sent: nothing spins on it, nothing renews it.

The keeper's task exists while some hold is tracked (and lingers :data:`_IDLE_LINGER` seconds
after the last one, so a client that keeps acquiring does not start a task per acquisition —
also when the last hold's next renewal was further away); it dies with the runtime.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Final, final

from redis.exceptions import MaxConnectionsError, NoScriptError, RedisError

from . import _telemetry as telemetry
from ._errors import LockError, describe
from ._lease import Hold, HoldState
from ._wire import PIPELINE_STEP

__all__ = ("BATCH", "LeaseKeeper")

logger = logging.getLogger("redis_locks_async")

BATCH: Final = 1000  # renewals per pipeline (one round trip)
_BACKOFF: Final = (0.1, 0.2, 0.4, 0.8, 1.0)  # after a failed round trip
# After "no free connection" (the client's pool at ``max_connections``, a burst of acquisitions):
# nothing was sent and nothing failed, so the keeper tries again soon — as the acquisitions
# competing with it do — instead of backing off as after an error.
_POOL_WAIT: Final = 0.01
_IDLE_LINGER: Final = 10.0  # seconds the keeper task outlives its last hold
_MIN_BOUND: Final = 0.05  # the shortest time a renewal round trip is given
# Renewals due within this much of the batch's moment go with it: beats of different periods
# that meet (lease 3 s and 30 s) are equal only up to floating-point rounding.
_SLACK: Final = 0.001
# The watchdog may fire a timer's clock resolution early: a hold this close to its end is taken
# as ended (lost a little early, never late), rather than re-arming the timer for it at once.
_EARLY: Final = 0.0005
_PHASE_RANGE: Final = 3600.0  # seconds; beats of whole-multiple periods still coincide


def _due_at(hold: Hold) -> float:
    """When the keeper must look at ``hold``: its renewal (or confirmation); never for a lease
    that is not renewed (the watchdog marks it lost at its end)."""
    return hold.renew_at if hold.wants_renewal else math.inf


def _expiry(hold: Hold) -> float:
    return hold.expires_at


def _even_chunks(holds: list[Hold]) -> list[list[Hold]]:
    """``holds`` cut, in order, into the fewest pieces of at most :data:`BATCH`, of sizes that
    differ by one at most (1,500 due: two of 750, not 1,000 and 500)."""
    if not holds:
        return []
    count = -(-len(holds) // BATCH)
    size, larger = divmod(len(holds), count)
    chunks: list[list[Hold]] = []
    start = 0
    for index in range(count):
        end = start + size + (1 if index >= count - larger else 0)
        chunks.append(holds[start:end])
        start = end
    return chunks


@final
class LeaseKeeper:
    """Renews (and watches) the holds of one runtime."""

    def __init__(
        self,
        topology: Any,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._topology = topology
        self._spawn = spawn
        self._holds: set[Hold] = set()
        # Holds to start keeping at the loop's next iteration (add_soon), with their callbacks.
        self._soon: dict[Hold, asyncio.Handle] = {}
        self._task: asyncio.Task[None] | None = None
        self._kick: asyncio.Future[None] | None = None
        self._wake_at: float | None = None  # when the sleeping keeper wakes by itself
        self._watch: asyncio.TimerHandle | None = None  # the expiry watchdog (module docstring)
        self._watch_at = math.inf
        self._failures: dict[Hashable, int] = {}  # failed round trips in a row, per node
        # Seconds the last two answered rounds took, per node (newest last).
        self._took: dict[Hashable, tuple[float, ...]] = {}
        self._rounds: dict[Hashable, asyncio.Task[None]] = {}  # cluster nodes' renewals out
        self._closed = False  # a cancellation swallowed by redis-py must not keep it running
        # Where this keeper's beats fall (module docstring). Not a secret: it only spreads the
        # renewals of different processes over time.
        self._phase = random.uniform(0.0, _PHASE_RANGE)
        self.renewal_round_trips = 0
        self.renewals = 0

    def __len__(self) -> int:
        return len(self._holds) + len(self._soon)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The keeper's task, while there is one."""
        return self._task

    @property
    def watchdog(self) -> asyncio.TimerHandle | None:
        """The expiry watchdog's timer, while one is armed."""
        return self._watch

    def add(self, hold: Hold) -> None:
        """Start keeping ``hold`` (renewing it, confirming it, or watching it expire)."""
        self._holds.add(hold)
        self._arm(hold.expires_at)
        if self._task is None or self._task.done():
            self._on_beat(hold, hold.renew_at)
            self._task = self._spawn(self._run())
        else:
            self.reschedule(hold)

    def add_soon(self, hold: Hold) -> None:
        """:meth:`add` ``hold`` at the event loop's next iteration, unless it is discarded (or
        no longer live) first. An acquisition returns to its caller without arming the
        watchdog or waking the keeper on its way (their cost came between a hand-over and its
        waiter's wake-up): the hold's first renewal is a third of a lease away, a hand-over's
        confirmation a claim window (seconds), and nothing can renew or lose it before the
        loop turns (every release awaits the server first)."""
        self._soon[hold] = asyncio.get_running_loop().call_soon(self._add_soon, hold)

    def _add_soon(self, hold: Hold) -> None:
        if self._soon.pop(hold, None) is not None and hold.live and not self._closed:
            self.add(hold)

    def reschedule(self, hold: Hold) -> None:
        """``hold``'s schedule changed (a new lease, a confirmation): wake up in time."""
        self._on_beat(hold, hold.renew_at)
        self._arm(hold.expires_at)
        if self._wake_at is not None and _due_at(hold) < self._wake_at:
            self._wake_at = None
            if self._kick is not None and not self._kick.done():
                self._kick.set_result(None)

    def discard(self, hold: Hold) -> None:
        """Stop keeping ``hold`` (released or lost). After the last one, nothing waits longer
        than :data:`_IDLE_LINGER`: the watchdog's timer goes, and a keeper asleep until a
        later renewal wakes to linger, then end."""
        soon = self._soon.pop(hold, None)
        if soon is not None:
            soon.cancel()
        self._holds.discard(hold)
        if self._holds:
            return
        if self._watch is not None:
            self._watch.cancel()
            self._watch, self._watch_at = None, math.inf
        kick, wake_at = self._kick, self._wake_at
        if (
            kick is not None
            and wake_at is not None
            and wake_at != math.inf  # lingering already
            and not kick.done()
            and wake_at - kick.get_loop().time() > _IDLE_LINGER
        ):
            self._wake_at = None
            kick.set_result(None)

    def _arm(self, at: float) -> None:
        """Have the watchdog look at the holds by ``at`` (a hold's expiry) at the latest."""
        if at >= self._watch_at or self._closed:
            return
        if self._watch is not None:
            self._watch.cancel()
        self._watch_at = at
        self._watch = asyncio.get_running_loop().call_at(at, self._expire)

    def _expire(self) -> None:
        """The watchdog: every hold still held past its local expiry is lost now — also one
        whose renewal is in flight (its answer would come too late to count). Re-armed at the
        earliest expiry left."""
        self._watch = None
        self._watch_at = math.inf
        now = asyncio.get_running_loop().time()
        earliest = math.inf
        for hold in list(self._holds):
            if hold.state is not HoldState.HELD:
                continue
            if hold.expires_at <= now + _EARLY:
                if hold.wants_renewal:
                    self._lose(hold, "the lease ended before a renewal of it was confirmed")
                else:
                    self._lose(hold, hold.expiry_reason)
            else:
                earliest = min(earliest, hold.expires_at)
        if earliest < math.inf:
            self._arm(earliest)

    def _on_beat(self, hold: Hold, latest: float) -> None:
        """Schedule ``hold``'s next renewal on the last beat of its period at or before
        ``latest`` (and never after ``hold.renew_at``). A hold to confirm, or not renewed,
        keeps its time."""
        if hold.confirm or not hold.auto_renew:
            return
        period = hold.pace / 3
        beat = self._phase + math.floor((latest - self._phase) / period) * period
        hold.renew_at = min(hold.renew_at, beat)

    def _node(self, hold: Hold) -> Hashable:
        """The node that serves ``hold`` (a lock's keys all hash to its name's slot)."""
        try:
            return self._topology.node_of(hold.name)  # type: ignore[no-any-return]
        except LockError:
            return None

    def _batches(self, due: list[Hold]) -> dict[Hashable, list[list[Hold]]]:
        """``due`` per node, in batches for one round trip each: soonest expiry first (a round
        trip is bounded by its batch's earliest expiry, so holds close to the end of their lease
        never shorten the others' bound), in the fewest pieces of equal size."""
        by_node: dict[Hashable, list[Hold]] = {}
        for hold in due:
            by_node.setdefault(self._node(hold), []).append(hold)
        return {node: _even_chunks(sorted(holds, key=_expiry)) for node, holds in by_node.items()}

    async def _renew_in_turn(self, node: Hashable, batches: list[list[Hold]]) -> None:
        """Renew one node's ``batches``, one round trip after the other, each judged as soon as
        its answers are in."""
        for batch in batches:
            # A step of the loop per pipeline built, and per answer judged: 10,000 renewals
            # never hold the event loop for more than one pipeline's work.
            await asyncio.sleep(0)
            await self._renew(batch, node)

    def _round_ended(self, node: Hashable, task: asyncio.Task[None]) -> None:
        """A cluster node's round (module docstring) is over — judged, failed, or cancelled,
        also before it started: the keeper wakes for that node's holds due meanwhile."""
        if self._rounds.get(node) is task:
            del self._rounds[node]
        kick = self._kick
        if kick is not None and not kick.done():
            self._wake_at = None
            kick.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                # Checked here too, not only by cancellation: Python <= 3.11's wait_for swallows
                # a cancellation that lands as the renewal's reply arrives.
                return
            now = loop.time()
            next_at = math.inf
            due: list[Hold] = []
            for hold in list(self._holds):
                if not hold.live:
                    self._holds.discard(hold)
                elif hold.wants_renewal:
                    if hold.renew_at <= now + _SLACK:
                        due.append(hold)
                    else:
                        next_at = min(next_at, hold.renew_at)
                elif hold.expires_at <= now:
                    self._holds.discard(hold)
                    hold.mark_lost(hold.expiry_reason)
                # A lease that is not renewed is the watchdog's alone (its timer marks it lost
                # at its end): the keeper does not wake for it, so acquiring and releasing one
                # costs the keeper nothing.
            if due and self._rounds:
                # A node whose round is out: its holds due wait for it (it wakes the keeper).
                due = [hold for hold in due if self._node(hold) not in self._rounds]
            if due:
                nodes = self._batches(due)
                if len(nodes) == 1 and None in nodes:
                    # One server (standalone, Sentinel; a RedLock's masters answer as one):
                    # its batches in turn, here.
                    await self._renew_in_turn(None, nodes[None])
                else:
                    # Cluster nodes side by side, each in a task judged as its own answers
                    # come: a stopped node must not hold up the others' renewals (their
                    # answers were once left unjudged until its round trip timed out, and
                    # their leases ended locally while their servers had renewed them).
                    for node, batches in nodes.items():
                        task = self._rounds[node] = self._spawn(
                            self._renew_in_turn(node, batches)
                        )
                        task.add_done_callback(functools.partial(self._round_ended, node))
                continue
            if next_at == math.inf:
                # Nothing to renew: linger before exiting, so a client that acquires again
                # soon (the common case) does not pay for a new task on every acquisition.
                # Holds only watched (not renewed) keep the keeper lingering.
                self._kick = loop.create_future()
                self._wake_at = math.inf  # a hold to renew wakes the keeper at once
                await asyncio.wait((self._kick,), timeout=_IDLE_LINGER)
                self._wake_at = None
                if not self._holds or self._closed:
                    self._task = None
                    return
                continue
            self._kick = loop.create_future()
            self._wake_at = next_at
            await asyncio.wait((self._kick,), timeout=max(0.0, next_at - now))
            self._wake_at = None

    async def _renew(self, due: list[Hold], node: Hashable) -> None:
        # Earlier round trips of the batch took time: a hold released or lost meanwhile is
        # not renewed.
        due = [hold for hold in due if hold.live and hold.wants_renewal and hold in self._holds]
        if not due:
            return
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        failures = self._failures.get(node, 0)
        topology = self._topology
        leases = [hold.lease for hold in due]
        # A hold made shorter without a word (Hold.shortened) has its renewal announce it.
        sharded = topology.sharded
        marks = [hold.shortened for hold in due]
        calls = [
            hold.renew(hold.owner, lease, sharded if mark else None)
            for hold, lease, mark in zip(due, leases, marks, strict=True)
        ]
        self.renewal_round_trips += 1
        # Half the time left until the first of these leases ends: a round on a connection gone
        # silent (half-open: a NAT or a proxy dropped it) given all of it lost the leases at
        # their end though a new connection would have worked — with no socket_timeout, or
        # one longer than what was left (helper-54: 5 s against a 6 s lease). Cut short, it
        # drops its connection, and a round on another follows within the lease. But at least
        # twice what the faster of the last two answered rounds to the node took, up to the
        # time left: a steady latency (a round trip of a sixth of the lease) is no silent
        # connection, and a round cut short on a working one cost the lease (helper-62). (Two
        # rounds, not one: after a single slow round — a latency spike, a first round that
        # opened its connection — a round on a connection gone silent was given so much that
        # no other could follow within the lease; helper-66.)
        left = min(hold.expires_at for hold in due) - sent_at
        bound = max(_MIN_BOUND, left / 2)
        took = self._took.get(node, ())
        if len(took) == 2:
            bound = max(bound, min(left, 2 * min(took)))
        try:
            results = await topology.run_batch(calls, bound)
        except Exception as exc:
            # Not a server's error (a client library's bug, a wrapper's exception): it would
            # end this task, and the holds it keeps would be neither renewed nor ever marked
            # lost. Their renewals failed for good: they are lost, and told so.
            logger.error("renewing %d leases failed", len(calls), exc_info=exc)
            results = [exc] * len(calls)
        now = answered_at = loop.time()
        failed = False
        reload: dict[str, bytes] = {}
        for index, (hold, lease, mark, (script, *_), result) in enumerate(
            zip(due, leases, marks, calls, results, strict=True)
        ):
            if index and not index % PIPELINE_STEP:
                # A step of the loop per hundred answers judged (B5's loop lag); a hold
                # released, extended or lost meanwhile is judged as it is now.
                await asyncio.sleep(0)
                now = loop.time()
            if isinstance(result, NoScriptError):
                reload[script.sha] = script.code
            failed = self.judge(hold, result, sent_at, now, lease, failures) or failed
            if mark and hold.shortened == mark and not isinstance(result, BaseException):
                hold.shortened = 0.0  # its renewal (which announces a shortening) has run
        self._failures[node] = failures + 1 if failed else 0
        if any(not isinstance(result, BaseException) for result in results):
            self._took[node] = (*self._took.get(node, ())[-1:], answered_at - sent_at)
        for hold in due:
            if hold.live:
                self._arm(hold.expires_at)  # a crossed renewal may have shortened it
        for source in reload.values():
            try:
                await asyncio.wait_for(topology.client.script_load(source), bound)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                logger.debug("script reload failed: %s", exc)

    def judge(
        self,
        hold: Hold,
        result: object,
        sent_at: float,
        now: float,
        lease: float | None = None,
        failures: int = 0,
    ) -> bool:
        """Act on ``hold``'s renewal ``result`` (sent at ``sent_at`` with ``lease``, default
        the hold's; ``failures``: the round trips to its node that failed in a row before, for
        the back-off); ``True`` when it failed in a way worth retrying."""
        if not hold.live or hold not in self._holds:
            return False
        if not isinstance(result, (NoScriptError, MaxConnectionsError)) and (
            not isinstance(result, BaseException) or self._topology.transient(result)
        ):
            # It may have run: an extend or a re-entry in flight meanwhile must not count on
            # its own lease alone (the server may have run this renewal after it). Not after
            # "no free connection": nothing was sent.
            hold.judged = (sent_at, hold.lease if lease is None else lease)
            if isinstance(result, BaseException):
                hold.gave_up_on(hold.lease if lease is None else lease)  # it may land late
        crossed = lease is not None and lease != hold.lease
        if (
            lease is not None
            and crossed
            and not isinstance(result, (NoScriptError, MaxConnectionsError))
        ):
            # A re-entry or an extend changed the hold's lease while this renewal was in
            # flight, and it may have run (a failure here may come after it ran). The server
            # ran the two in an unknown order — a retrying client re-sends a command whose
            # reply was lost, late — so it may keep this renewal's length. Not after "no free
            # connection": nothing was sent (else an extend that was not sent either, and put
            # back as it was, left the hold counting on the shorter lease nobody set).
            hold.crossed(sent_at, lease)
        if isinstance(result, NoScriptError):
            hold.renew_at = now  # again right after the reload
        elif isinstance(result, MaxConnectionsError) or getattr(result, "pool_exhausted", False):
            # No free connection (on one server, or on some of a RedLock's masters): retried
            # within milliseconds, not backed off from as from a failing server.
            self._wait_for_pool(hold, result, now)
        elif isinstance(result, BaseException) and self._topology.transient(result):
            self._retry_or_lose(hold, result, now, failures)
            return True
        elif isinstance(result, BaseException):
            self._lose(hold, f"renewal failed: {result}")
        elif int(result) == 1:  # type: ignore[call-overload]
            self.renewals += 1
            if telemetry.SINK is not None:
                telemetry.SINK.renewed()
            if not crossed:
                hold.renewed(sent_at)
                # Onto the beat: a renewal sent up to _SLACK before its beat still counts as
                # that beat's (else the next one would be due on the same beat again).
                self._on_beat(hold, sent_at + hold.pace / 3 + _SLACK)
        elif hold.state is HoldState.RELEASING:
            # The task's release ran first (a hand-over's confirmation or a renewal in flight
            # as it released): not a loss — the release's own answer settles the hold. Nothing
            # is left to renew: kept, the hold would stay due and be renewed again at once,
            # round trip after round trip, until that answer came (a retry's back-off away).
            self._holds.discard(hold)
        else:
            self._lose(hold, "renewal found the lock expired or held by another owner")
        return False

    def _lose(self, hold: Hold, reason: str) -> None:
        # Through discard(): the watchdog may lose the last hold while the keeper sleeps until
        # a renewal of a hold released since (it outlived its holds by up to a third of that
        # lease).
        self.discard(hold)
        hold.mark_lost(reason)

    def _wait_for_pool(self, hold: Hold, exc: object, now: float) -> None:
        if now >= hold.expires_at:
            self._lose(
                hold, f"no free connection to renew it until the lease ended: {describe(exc)}"
            )
            return
        hold.renew_at = min(now + _POOL_WAIT, hold.expires_at)

    def _retry_or_lose(self, hold: Hold, exc: BaseException, now: float, failures: int) -> None:
        if now >= hold.expires_at:
            self._lose(hold, f"renewal failed until the lease ended: {describe(exc)}")
            return
        logger.info("renewing %r failed (%s); retrying", hold.name, describe(exc))
        delay = _BACKOFF[min(failures, len(_BACKOFF) - 1)]
        retry_at = now + min(delay, (hold.expires_at - now) / 2)
        hold.renew_at = retry_at

    async def aclose(self) -> None:
        """Stop renewing (the leases then end on the server by themselves)."""
        self._closed = True
        self._holds.clear()
        for soon in self._soon.values():
            soon.cancel()
        self._soon.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        task, self._task = self._task, None
        tasks = [*self._rounds.values(), *([] if task is None else [task])]
        self._rounds.clear()
        for each in tasks:
            each.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
