"""N independent masters behind one client-like object: how ``RedLock`` reuses the core.

The core runs a lock's scripts on "the client" of its topology (``Call.run(client)``,
``client.pipeline()`` for the lease keeper). For ``RedLock`` that client is a :class:`FanOut`:
every script call is sent to all N masters at once, each bounded by ``node_timeout``, and the
N replies are folded into the one reply the script's contract promises — so the core's acquire,
wait, cancel, renew and release logic runs unchanged, once, over the quorum.

**A round** starts a task per master and decides as soon as the outcome is known: a quorum
(``N // 2 + 1``) answered yes, or so many answered no (or failed, or timed out) that a quorum
has become impossible. Stragglers are not waited for; they finish (or time out after
``node_timeout``) in tracked background tasks — each holding one of that master's pooled
connections meanwhile, so a silent master has up to (requests per second times ``node_timeout``)
of them in flight; past the pool's ``max_connections`` its requests fail at once, which a
round counts as a failed master.

``node_timeout`` belongs to the ``RedLock`` object (its policy appends it to each attempt's
arguments, and the fan-out takes it off); the rounds of one acquisition — its renewals,
re-entries and release too — use the timeout of the object that acquired. One fan-out serves
every ``RedLock`` over the same set of clients, in any order and with any timeout, so a task
re-enters its hold through any of them.

**Acquire** is the Redis documentation's algorithm. Every round writes a value of its own on
the masters (``<owner id>:<round>``, unguessable because the owner id is), so the clean-up of a
failed round can never delete what a later round of the same acquisition takes on a master
whose replies arrive out of order. A round holds the lock if a quorum took it and time is left:
validity = lease - elapsed - (lease·0.01 + 2 ms) on the monotonic clock. The core counts the
lease from the moment it sent the attempt and keeps the drift allowance short of it (the
policy's ``margin``), so the hold's local expiry *is* that validity: a slow master shortens it.
A failed round is abandoned on **every** master — also those that answered no, failed or did
not answer in time. Each master has one janitor (:class:`_Janitor`): a background task, alive
while the master is owed something, that sends every abandon owed to it in one pipeline per
pass and retries what the master did not confirm (for at most two leases — the longest the
acquisition set, by an extend or a re-entry too — and a few seconds: after that the master's
copy has expired by itself). So a silent master costs one task and one connection however
many rounds and releases it missed. An abandon also fences the round's value on that master
(``done``), so a straggling attempt that arrives after it is refused.
The folded reply of a failed round tells the core when to try again: when enough of the other
holder's keys expire to leave a quorum free, or — after a split vote or with masters
unreachable — after a random delay (jittered retry).

**Renew, re-enter, release** fold the same way: they count when a quorum confirmed (an extend
or a re-entry only within the validity of the lease it sets, else the hold is lost); "lost"
when more than N - quorum masters say the owner no longer holds the key; anything in between
(masters unreachable) is a transient :class:`QuorumError`, which the core retries while the
lease lasts, exactly as it retries a single server's connection errors. A release returns once
a quorum released; when its last master is in (or timed out), every master that did not answer
"released" is swept — one that was merely slower than the quorum costs nothing more — and so is
one that answered while the hold's own attempt there was still in flight (a retrying client
may re-send it). A drop of a re-entry (an inner release, or the undo of a cancelled re-entry)
is sent once more, when every master answered both, to each master that answered the drop before
the re-entry or did not confirm it (:class:`_Entry`).
The keeper's pipeline becomes one pipeline per master per tick, folded as soon as a quorum
decided each renewal in it (a stopped master is not waited for).

**Waiting**: the hub of a ``FanOut`` runtime (:class:`MultiHub`) keeps one
:class:`~._notify.SubscriptionHub` per master delivering into one parking lot per lock, so a
release announced by any master wakes the waiters, and each master's connection has its own
health check and reconnects on its own (a stopped master does not stall the others).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import random
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any, Final, cast, final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError, ResponseError

from ._errors import LockError, describe
from ._keys import LockKeys
from ._lock import LOCK_ACQUIRE, LOCK_REENTER, LOCK_RELEASE, LOCK_RENEW
from ._notify import SubscriptionHub, Subscriptions, subscription_refusal
from ._parking import ParkingLot
from ._runtime import (
    ClientRef,
    Runtime,
    close_with,
    existing_runtime,
    pipelined,
    transient_error,
)
from ._scripts import Call, EncodableArg, Script
from ._wire import TORN_DOWN, connection_failed

__all__ = (
    "INSPECT_TIMEOUT",
    "LAYOUT",
    "FanOut",
    "Masters",
    "MultiHub",
    "QuorumError",
    "drift",
    "fan_out",
)

LAYOUT: Final = "redlock"  # the key layout of a RedLock (its auxiliary keys and channel)
RETRY_DELAY: Final = 0.1  # seconds, ±50 % at random: the pause after a split vote
_SWEEP_BACKOFF: Final = (0.05, 0.1, 0.2, 0.5, 1.0)
_SWEEP_PATIENCE: Final = 5.0  # seconds past two leases a clean-up keeps trying a master
_SWEEP_MIN_PATIENCE: Final = 0.25  # seconds a clean-up pass waits for a master at least
_SWEEP_BATCH: Final = 500  # abandons per clean-up pipeline
# Clean-ups kept for a master silent past their give-up time (see _Janitor): past this many the
# oldest are dropped (a master down for hours under a steady stream of acquisitions).
_SILENT_DEBTS_MAX: Final = 10_000
# The pauses between the few tries of a clean-up after the close (FanOut._sweep_once).
_LATE_SWEEP_BACKOFF: Final = (0.05, 0.1, 0.2, 0.5)
INSPECT_TIMEOUT: Final = 0.5  # seconds a master's reply is waited for outside a lock's rounds
_PENDING: Final = object()

logger = logging.getLogger("redis_locks_async")

_ROLES: Final[dict[str, tuple[Script, str]]] = {
    LOCK_ACQUIRE.sha: (LOCK_ACQUIRE, "attempt"),
    LOCK_REENTER.sha: (LOCK_REENTER, "reenter"),
    LOCK_RELEASE.sha: (LOCK_RELEASE, "release"),
    LOCK_RENEW.sha: (LOCK_RENEW, "renew"),
}


class QuorumError(RedisConnectionError):
    """Too few masters answered to decide either way (transient: retried like a connection
    error of one server)."""

    #: Some master had no free connection (its pool at ``max_connections``: nothing was sent
    #: there). The lease keeper then tries again within milliseconds, as on one server,
    #: instead of backing off as after a failed master.
    pool_exhausted: bool = False


def drift(lease: float) -> float:
    """The clock-drift allowance of a lease of ``lease`` seconds (the Redis documentation's
    ``lease·0.01 + 2 ms``)."""
    return lease * 0.01 + 0.002


def _status(reply: object) -> int | None:
    if isinstance(reply, list) and reply:
        try:
            return int(reply[0])
        except (TypeError, ValueError):
            return None
    if isinstance(reply, int) and not isinstance(reply, bool):
        return reply
    return None


def _type_name(reply: object) -> str | None:
    """A ``TYPE`` reply as text (``None``: an error or no reply)."""
    if isinstance(reply, bytes):
        return reply.decode()
    return reply if isinstance(reply, str) else None


def _took(reply: object) -> bool:
    return _status(reply) == 1


def _refusal(reply: object) -> bool:
    """A master's script refused the call and changed nothing there: a key of another type
    (an error that is not transient) or of another kind (``-2``)."""
    return (isinstance(reply, ResponseError) and not transient_error(reply)) or _status(reply) == -2


@final
class _Entry:
    """One re-entry of a hold on the masters, while its round or a drop of it is under way:
    a drop that reached a master before the re-entry's own reply came from there may have run
    first there, and left the entry behind — it is sent there once more when both are in."""

    __slots__ = ("answered", "dropping", "resend", "rounds", "unsure")

    def __init__(self, masters: int, rounds: int) -> None:
        # The masters whose re-entry reply (or error, or time-out) is in (all of them, for an
        # entry whose re-entry rounds are over).
        self.answered: set[int] = set() if rounds else set(range(masters))
        self.rounds = rounds  # the re-entry rounds of this entry still waiting for a master
        self.dropping = 0  # the drops of this entry still waiting for a master
        self.unsure: set[int] = set()  # the masters a drop may have left the entry on
        self.resend: Callable[[Any], Awaitable[object]] | None = None  # the drop, once more


@final
class _Owner:
    """What one acquisition (an owner id of the core) reached on the masters."""

    __slots__ = ("channel", "entries", "flying", "keys", "lease", "node_timeout", "open", "value")

    def __init__(self, keys: tuple[str | bytes, ...], node_timeout: float) -> None:
        self.keys = keys  # the lock's script keys (the clean-ups address them too)
        name = keys[0].decode("utf-8") if isinstance(keys[0], bytes) else keys[0]
        self.channel = LockKeys.for_name(name, LAYOUT).wire_channel  # (an argument of scripts)
        self.value: str | None = None  # the round's value that holds the quorum
        self.open: set[str] = set()  # values that may be on some master (not swept yet)
        # The masters whose attempt of ``value``'s round may still be in flight (no reply, no
        # time-out yet): a client that retries after a lost reply may re-send it there.
        self.flying: set[int] = set()
        # The longest lease (s) any command of this acquisition set on a master — its attempt,
        # and every renewal, extend or re-entry since (through any RedLock object): a master's
        # copy of a value has surely expired two of these after the value was given up.
        self.lease = 0.0
        # Each master's reply is waited for this long, in every round of this acquisition
        # (the node_timeout of the RedLock object that started it).
        self.node_timeout = node_timeout
        # Re-entries whose round, or a drop of which, is still under way (see _Entry).
        self.entries: dict[str, _Entry] = {}

    def lengthen(self, lease_ms: object) -> None:
        """A command of this acquisition sets a lease of ``lease_ms`` on the masters."""
        self.lease = max(self.lease, int(str(lease_ms)) / 1000)


@final
class FanOut:
    """N masters behind the interface the core uses of one client (module docstring)."""

    def __init__(self, masters: Sequence[Any]) -> None:
        self.masters = tuple(masters)
        self.quorum = len(self.masters) // 2 + 1
        self._owners: dict[str, _Owner] = {}
        self._rounds = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()  # only when no runtime tracks them
        self._janitors: dict[int, _Janitor] = {}
        # The event loop seen ending under a round: a master's reply task cancelled neither by
        # the round's timer nor by a close — asyncio.run cancelling every task at its end.
        # Clean-ups are not started there: nothing would run them (helper-65: a task created
        # after that sweep was destroyed pending, its coroutine failing on the closed loop).
        self._ending: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"<FanOut {len(self.masters)} masters quorum={self.quorum}>"

    async def aclose(self) -> None:
        """Close this fan-out's runtime (renewal, listeners, background tasks); the masters'
        clients stay open (they are the caller's). What it knew of its acquisitions goes
        with it: their holds are lost (the masters' keys expire by themselves), their rounds
        cut short, their janitors stopped; a round that still completes fails and is swept
        (:meth:`_sweep_once`)."""
        runtime = existing_runtime(self)
        if runtime is not None:
            await runtime.aclose()
        self._owners.clear()

    # -- tasks and rounds ----------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        runtime = existing_runtime(self)
        if runtime is not None:
            return runtime.spawn(coro, report=False)
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _one(
        self, master: Any, command: Callable[[Any], Awaitable[object]], timeout: float
    ) -> object:
        """One master's reply, or the error (a timeout included) in its place."""
        try:
            return await asyncio.wait_for(self._reply(master, command), timeout)
        except asyncio.TimeoutError as exc:
            return exc

    async def _reply(self, master: Any, command: Callable[[Any], Awaitable[object]]) -> object:
        """One master's reply, or the error in its place (the round bounds its time)."""
        try:
            return await command(master)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            return exc
        except TORN_DOWN as exc:  # a transport torn down under the call (the master restarted)
            return connection_failed(exc)

    async def _round(
        self,
        command: Callable[[Any], Awaitable[object]],
        yes: Callable[[object], bool],
        timeout: float,
        settled: Callable[[list[object]], None] | None = None,
        answered: Callable[[int], None] | None = None,
    ) -> tuple[bool, list[object]]:
        """Send ``command`` to every master, each reply waited for at most ``timeout`` s;
        return as soon as a quorum answered ``yes`` or a quorum has become impossible, with
        the replies so far (``_PENDING`` for the rest). ``settled`` is called with every
        master's reply (or error) once the last one is in, the round's stragglers included;
        ``answered`` with each master's index as its reply (or error) is in.

        The hot path of every ``RedLock`` call, so it is lean: one task per master, whose
        completion callback counts its reply, and one timer for the whole round that cancels
        the masters still silent at ``timeout`` (their reply: a ``TimeoutError``). A
        ``wait_for`` per master cost a second task each on Python <= 3.11, and an
        ``asyncio.wait`` loop re-registered on every pending task per reply."""
        loop = asyncio.get_running_loop()
        count, quorum = len(self.masters), self.quorum
        results: list[object] = [_PENDING] * count
        decided: asyncio.Future[bool] = loop.create_future()
        tally = [0, 0, 0]  # yes, no, answered
        expired = False

        def settle(index: int, task: asyncio.Task[object]) -> None:
            if task.cancelled():
                result: object = (
                    asyncio.TimeoutError(f"no reply within {timeout} s")
                    if expired
                    else LockError("the redis client was closed")
                )
                if not expired and self._closed() is None:
                    self._ending = loop
            else:
                try:
                    result = task.result()
                except Exception as exc:  # not a server's error: the caller must see it
                    if not decided.done():
                        decided.set_exception(exc)
                    result = exc
            results[index] = result
            if answered is not None:
                answered(index)
            tally[0 if yes(result) else 1] += 1
            tally[2] += 1
            if tally[2] == count:
                timer.cancel()
                if settled is not None:
                    settled(results)
            if not decided.done() and (tally[0] >= quorum or tally[1] > count - quorum):
                decided.set_result(tally[0] >= quorum)

        tasks = [self._spawn(self._reply(master, command)) for master in self.masters]

        def expire() -> None:
            nonlocal expired
            expired = True
            for task in tasks:
                task.cancel()

        timer = loop.call_later(timeout, expire)
        for index, task in enumerate(tasks):
            task.add_done_callback(functools.partial(settle, index))
        held = await decided
        return held, list(results)

    def _owner(self, owner: str, keys: tuple[str | bytes, ...], node_timeout: float) -> _Owner:
        state = self._owners.get(owner)
        if state is None:
            state = self._owners[owner] = _Owner(keys, node_timeout)
        return state

    def _tidy(self, owner: str) -> None:
        state = self._owners.get(owner)
        if state is not None and state.value is None and not state.open:
            del self._owners[owner]

    # -- the client interface ------------------------------------------------------------------

    async def execute_command(self, *args: EncodableArg) -> list[object]:
        """Run one command on every master; each master's reply (or error), in order."""
        return list(
            await asyncio.gather(
                *(
                    self._one(m, lambda c: c.execute_command(*args), INSPECT_TIMEOUT)
                    for m in self.masters
                )
            )
        )

    async def type(self, key: str | bytes) -> str:
        """The type of ``key`` on the first master where it exists (to name a wrong-type
        key in an error)."""
        for reply in await self.execute_command("TYPE", key):
            if isinstance(reply, BaseException):
                continue
            text = reply.decode() if isinstance(reply, bytes) else str(reply)
            if text != "none":
                return text
        return "none"

    async def holds_key(self, key: str | bytes, node_timeout: float) -> bool:
        """Whether the lock hash ``key`` is on a quorum of masters (``QuorumError`` if too few
        answer within ``node_timeout``; ``WRONGTYPE`` if so many hold another type under it
        that no quorum could ever hold the lock)."""
        held, results = await self._round(
            lambda c: c.type(key), lambda r: _type_name(r) == "hash", node_timeout
        )
        if held:
            return True
        kinds = [_type_name(r) for r in results]
        foreign = sum(1 for k in kinds if k not in (None, "none", "hash"))
        if foreign > len(self.masters) - self.quorum:
            raise ResponseError("WRONGTYPE the lock's key holds a value of another type")
        if foreign + kinds.count("none") > len(self.masters) - self.quorum:
            return False
        raise _no_quorum(results, "inspect")

    async def eval(self, script: str, numkeys: int, *keys_and_args: EncodableArg) -> object:
        """Not used: each master loads the scripts itself (``EVALSHA`` falls back there)."""
        raise LockError("RedLock runs only its own scripts (EVALSHA)")

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: EncodableArg) -> object:
        """Run one of the lock scripts on the masters and fold the replies into the reply the
        script's contract promises (module docstring)."""
        entry = _ROLES.get(sha)
        if entry is None:
            raise LockError(f"RedLock cannot run script {sha}")
        script, role = entry
        keys = tuple(k for k in keys_and_args[:numkeys] if isinstance(k, (str, bytes)))
        args = tuple(keys_and_args[numkeys:])
        owner = str(args[0])
        if role == "attempt":
            # The RedLock's policy appends its node_timeout (ms) to the script's arguments.
            return await self._attempt(script, keys, owner, args[:-1], int(args[-1]) / 1000)
        if role == "release":
            return await self._release(script, keys, owner, args)
        state = self._owners.get(owner)
        value = state.value if state is not None else None
        if state is None or value is None:
            return [-1, 0, 0, 0] if role == "reenter" else 0
        # renew: (owner, lease ms[, channel, sharded]); reenter: (owner, entry, lease ms, ...)
        lease_ms = args[1] if role == "renew" else args[2]
        state.lengthen(lease_ms)
        lease = int(lease_ms) / 1000
        loop = asyncio.get_running_loop()
        started = loop.time()
        answered: Callable[[int], None] | None = None
        settled: Callable[[list[object]], None] | None = None
        if role == "reenter":
            answered, settled = self._reentering(state, str(args[1]))
        held, results = await self._round(
            lambda c: script.run(c, keys, (value, *args[1:])),
            _took,
            state.node_timeout,
            settled,
            answered,
        )
        # An extension counts only if the quorum made it within its validity: the round waits
        # the acquiring object's node_timeout, which a re-entry through an object of a shorter
        # lease (or an extend to one) may exceed — the keys could be gone by now.
        late = held and lease - (loop.time() - started) - drift(lease) <= 0
        if held and not late:
            if role == "renew":
                return 1
            replies = [r for r in results if _took(r)]
            return [
                1,
                max(int(r[1]) for r in replies),  # type: ignore[index]
                max(int(r[2]) for r in replies),  # type: ignore[index]
                min(int(r[3]) for r in replies),  # type: ignore[index]
            ]
        gone = -1 if role == "reenter" else 0
        if late or sum(1 for r in results if _status(r) == gone) > len(self.masters) - self.quorum:
            # Lost: give up what the masters still have (nobody would renew or release it).
            if state.value == value:
                state.value = None
                self._sweep(state, owner, value)
            return [-1, 0, 0, 0] if role == "reenter" else 0
        refused = [r for r in results if isinstance(r, ResponseError) and not transient_error(r)]
        if len(refused) > len(self.masters) - self.quorum:
            raise refused[0]  # a wrong-type key on so many masters: the caller's error, named
        raise _no_quorum(results, role, _took)

    def pipeline(self, transaction: bool = False) -> FanPipeline:
        """A pipeline of renewals (what the lease keeper batches): one pipeline per master."""
        return FanPipeline(self)

    # -- acquire -------------------------------------------------------------------------------

    async def _attempt(
        self,
        script: Script,
        keys: tuple[str | bytes, ...],
        owner: str,
        args: tuple[Any, ...],
        node_timeout: float,
    ) -> list[int]:
        state = self._owner(owner, keys, node_timeout)
        value = f"{owner}:{next(self._rounds)}"
        state.open.add(value)
        lease = int(args[1]) / 1000
        state.lengthen(args[1])
        loop = asyncio.get_running_loop()
        started = loop.time()
        flying = set(range(len(self.masters)))
        try:
            held, results = await self._round(
                lambda c: script.run(c, keys, (value, *args[1:])),
                _took,
                state.node_timeout,
                answered=flying.discard,
            )
        except BaseException:
            # Not a server's error (the caller sees it), or the round cut short (the caller
            # cancelled, the client closed): what the masters took is nobody's hold. Abandoned
            # everywhere, as after a failed round — else the key stayed on them until its
            # lease ended, and this state for good.
            self._sweep(state, owner, value)
            raise
        validity = lease - (loop.time() - started) - drift(lease)
        closed = self._closed() is not None
        if held and validity > 0 and not closed:
            state.value = value
            state.flying = flying  # emptied as the round's stragglers come in
            replies = [r for r in results if _took(r)]
            return [
                1,
                max(int(r[1]) for r in replies),  # type: ignore[index]
                1,
                min(int(r[3]) for r in replies),  # type: ignore[index]
            ]
        # A failed round: abandon it on every master, whatever each answered — also one that
        # came back after the client was closed (nobody may hold the lock then), whose clean-up
        # the caller waits for a moment: two tries' worth (it goes on in the background) —
        # except where the script refused (a key of another type or kind: it changed nothing
        # there, and an abandon would write its bookkeeping beside the user's key).
        refusing = [i for i, r in enumerate(results) if _refusal(r)]
        swept = self._sweep(
            state,
            owner,
            value,
            [i for i in range(len(results)) if i not in refusing] if refusing else None,
        )
        if closed:
            await asyncio.wait((swept,), timeout=2 * max(_SWEEP_MIN_PATIENCE, state.node_timeout))
        refused = [results[i] for i in refusing]
        if len(refused) > len(self.masters) - self.quorum:
            # A wrong-type key, a refused script on so many masters that no quorum is possible:
            # the caller must see it. Fewer are failed masters, which a quorum tolerates.
            for result in refused:
                if isinstance(result, ResponseError):
                    raise result
            return [-2, 1, 0, 0]
        return [0, 0, 0, self._retry_ms(results, lease)]

    def _retry_ms(self, results: list[object], lease: float) -> int:
        """When a failed round is worth repeating (module docstring), in milliseconds."""
        held = sorted(
            (int(r[3]) if int(r[3]) >= 0 else round(lease * 1000))  # type: ignore[index]
            for r in results
            if _status(r) == 0
        )
        excess = len(held) - (len(self.masters) - self.quorum)
        if excess > 0:  # another owner holds a quorum: until enough of its keys expire
            return held[excess - 1] + round(random.uniform(0, RETRY_DELAY) * 1000)
        return round(random.uniform(0.5, 1.5) * RETRY_DELAY * 1000)

    # -- release -------------------------------------------------------------------------------

    async def _release(
        self, script: Script, keys: tuple[str | bytes, ...], owner: str, args: tuple[Any, ...]
    ) -> list[int]:
        mode = str(args[1])
        state = self._owners.get(owner)
        if mode == "abandon":
            if state is None:
                return [0, 0]
            state.value = None
            sweeps = [self._sweep(state, owner, value) for value in list(state.open)]
            if sweeps:
                await asyncio.wait(sweeps, timeout=state.node_timeout)
            return [0, 0]
        value = state.value if state is not None else None
        if state is None or value is None:
            return [-1, 0]
        wanted = 1 if mode == "entry" else 0
        final = mode == "final"
        flying = state.flying

        def command(client: Any) -> Awaitable[object]:
            return script.run(client, keys, (value, *args[1:]))

        # The masters that answered this release while the hold's attempt there was still in
        # flight: a re-sent attempt may take the key again after the release (swept).
        overtaken: set[int] = set()

        def answered(index: int) -> None:
            if index in flying:
                overtaken.add(index)

        def released(results: list[object]) -> None:
            # Once every master answered or timed out: what did not answer is swept (the key
            # ends by itself at the latest), and so is what answered "not held": an attempt
            # of this hold still in flight there (a straggler of its acquire round) would
            # take the key after this release; the sweep's abandon fences it off, or removes
            # what it took. Not before the round's stragglers are in: a master that was
            # merely slower than the quorum (the common case) needs no clean-up.
            # A master that answered while the attempt of this hold was still in flight there is
            # swept even if it answered "released": a client that retries after a lost reply
            # (redis-py's retry) re-sends the attempt, which would take the key again.
            unsure = [i for i, r in enumerate(results) if _status(r) != 0 or i in overtaken]
            if unsure:
                self._sweep(state, owner, value, unsure)
            else:
                state.open.discard(value)
                self._tidy(owner)

        on_answered: Callable[[int], None] = answered
        on_settled: Callable[[list[object]], None] = released
        if not final:
            on_answered, on_settled = self._dropping(state, str(args[2]), command)
        try:
            done, results = await self._round(
                command,
                lambda r: _status(r) == wanted,
                state.node_timeout,
                on_settled,
                on_answered,
            )
        except Exception:
            # Not a server's error (the caller sees it): the hold ends here all the same, and
            # ``released`` sweeps whatever is not released once the last master is in — the
            # state is dropped then, not kept for good with its value.
            if final:
                state.value = None
                self._tidy(owner)
            raise
        if final:
            state.value = None
            self._tidy(owner)  # every master may have answered already (``released`` ran)
        if done:
            if mode == "entry":
                return [1, max(int(r[1]) for r in results if _status(r) == 1)]  # type: ignore[index]
            return [0, 0]
        if sum(1 for r in results if _status(r) == -1) > len(self.masters) - self.quorum:
            return [-1, 0]
        refused = [r for r in results if isinstance(r, ResponseError) and not transient_error(r)]
        if len(refused) > len(self.masters) - self.quorum:
            # A wrong-type key on so many masters that no quorum can answer: the caller's error
            # (it names the key), not a network's to retry.
            raise refused[0]
        raise _no_quorum(results, "release", lambda r: _status(r) == wanted)

    # -- re-entries and their drops ------------------------------------------------------------

    def _reentering(
        self, state: _Owner, entry: str
    ) -> tuple[Callable[[int], None], Callable[[list[object]], None]]:
        """A re-entry round of ``entry`` starts: the callbacks that note its masters' replies
        (``answered``) and its end (``settled``)."""
        track = state.entries.get(entry)
        if track is None:
            track = state.entries[entry] = _Entry(len(self.masters), 1)
        else:
            track.rounds += 1  # re-sent with the same entry id
        final = track

        def settled(_: list[object]) -> None:
            final.rounds -= 1
            self._entry_settled(state, entry, final)

        return final.answered.add, settled

    def _dropping(
        self, state: _Owner, entry: str, command: Callable[[Any], Awaitable[object]]
    ) -> tuple[Callable[[int], None], Callable[[list[object]], None]]:
        """A drop of ``entry`` (an inner release, or the undo of a cancelled re-entry) starts:
        the callbacks that note the masters it may have left the entry on — those that
        answered it before their re-entry reply came, and those that did not confirm it."""
        track = state.entries.get(entry)
        if track is None:
            track = state.entries[entry] = _Entry(len(self.masters), 0)
        track.dropping += 1
        track.resend = command
        final = track

        def answered(index: int) -> None:
            if index not in final.answered:
                final.unsure.add(index)

        def settled(results: list[object]) -> None:
            final.unsure.update(i for i, r in enumerate(results) if _status(r) != 1)
            final.dropping -= 1
            self._entry_settled(state, entry, final)

        return answered, settled

    def _entry_settled(self, state: _Owner, entry: str, track: _Entry) -> None:
        """Once every master answered the re-entry and its drop: the drop is sent once more
        to the masters it may have missed (best effort — a master that missed that too keeps
        the entry until the hold ends; ``"entry"`` on a key the owner no longer holds does
        nothing)."""
        if track.rounds or track.dropping:
            return
        if state.entries.get(entry) is track:
            del state.entries[entry]
        if track.resend is None or not track.unsure:
            return
        for index in sorted(track.unsure):
            self._spawn(self._one(self.masters[index], track.resend, state.node_timeout))

    def _sweep(
        self, state: _Owner, owner: str, value: str, only: Sequence[int] | None = None
    ) -> asyncio.Future[Any]:
        """Abandon ``value`` on the masters (all, or ``only`` those) in the background: each
        master's :class:`_Janitor` owes it. The future is done once every one of them has
        confirmed the abandon or given up on it."""
        loop = asyncio.get_running_loop()
        until = loop.time() + 2 * state.lease + _SWEEP_PATIENCE
        indexes = range(len(self.masters)) if only is None else only

        def swept(_: object = None) -> None:
            state.open.discard(value)
            if self._owners.get(owner) is state:
                self._tidy(owner)

        if not indexes or self._ending is loop:
            # Nothing to abandon anywhere (settled now, not a loop step later), or the loop is
            # ending: the keys end with their leases.
            swept()
            done: asyncio.Future[Any] = loop.create_future()
            done.set_result(None)
            return done
        closed = self._closed()
        if closed is not None:
            settled: asyncio.Future[Any] = self._sweep_once(closed, state, value, indexes)
        else:
            settled = asyncio.gather(*(self._janitor(i).owe(state, value, until) for i in indexes))
        settled.add_done_callback(swept)
        return settled

    def _closed(self) -> Runtime | None:
        """This fan-out's runtime if it was closed (``None``: open, or none yet)."""
        runtime = existing_runtime(self)
        return runtime if runtime is not None and runtime.closed else None

    def _sweep_once(
        self, runtime: Runtime, state: _Owner, value: str, indexes: Sequence[int]
    ) -> asyncio.Task[None]:
        """Abandon ``value`` on each of the masters ``indexes`` (a few tries, each bounded by
        the node timeout) in a task of its own: the sweep after the close, when the janitors
        have stopped — a round still in flight during the close (or re-sent by a retrying
        client on a new connection) took keys that must not stay held for a whole lease."""
        call = (*state.keys, value, "abandon", "", state.channel, "0", "1")
        abandon = functools.partial(
            _pipelined, script=LOCK_RELEASE, calls=[call], numkeys=len(state.keys)
        )
        patience = max(_SWEEP_MIN_PATIENCE, state.node_timeout)

        async def sweep_one(master: Any) -> None:
            for delay in _LATE_SWEEP_BACKOFF:  # a few times: the close broke its connections
                if isinstance(await self._one(master, abandon, patience), list):
                    return
                await asyncio.sleep(delay)

        async def sweep() -> None:
            await asyncio.gather(*(sweep_one(self.masters[i]) for i in indexes))

        return runtime.spawn(sweep(), cleanup=True)

    def _janitor(self, index: int) -> _Janitor:
        janitor = self._janitors.get(index)
        if janitor is None or janitor.loop is not asyncio.get_running_loop():
            janitor = self._janitors[index] = _Janitor(self, self.masters[index])
        return janitor

    # -- renewal (the keeper's pipelines) ------------------------------------------------------

    async def renew_batch(self, calls: list[tuple[str, tuple[Any, ...]]]) -> list[object]:
        """Fold a batch of renewals (``(sha, keys and args)``) over one pipeline per master:
        1 where a quorum renewed, 0 where the lease is known lost, else a ``QuorumError``."""
        live: list[int] = []
        renewals: list[tuple[EncodableArg, ...]] = []  # (name, the round's value, lease ms, …)
        bound = 0.0  # each master's pipeline waits as long as its most patient hold allows
        for i, (sha, keys_and_args) in enumerate(calls):
            # renew: (name, owner, lease ms[, channel, sharded])
            state = self._owners.get(str(keys_and_args[1]))
            if sha == LOCK_RENEW.sha and state is not None and state.value is not None:
                live.append(i)
                renewals.append((keys_and_args[0], state.value, *keys_and_args[2:]))
                state.lengthen(keys_and_args[2])
                bound = max(bound, state.node_timeout)
        per_master: list[object] = []
        if live:
            renew = functools.partial(_pipelined, script=LOCK_RENEW, calls=renewals, numkeys=1)
            per_master = await self._until_decided(renew, len(live), bound)
        folded: list[object] = [0] * len(calls)
        for slot, i in enumerate(live):
            verdict = self._verdict(per_master, slot, len(live))
            if verdict is None:
                folded[i] = _no_quorum(_slot(per_master, slot, len(live)), "renew")
            else:
                folded[i] = verdict
        return folded

    async def _until_decided(
        self, command: Callable[[Any], Awaitable[object]], slots: int, timeout: float
    ) -> list[object]:
        """Each master's replies to a pipeline of ``slots`` renewals (``_PENDING`` where none
        came yet), returned once every renewal is decided — renewed, or lost, on a quorum —
        not when the slowest master answers. One batch holds the renewals of RedLock objects
        with different ``node_timeout`` s: waiting the most patient one's for a stopped master
        would outlast the bound of the batch's shortest lease, and lose that lease while a
        quorum renews it. The masters not waited for finish in tracked background tasks."""
        tasks = [self._spawn(self._one(master, command, timeout)) for master in self.masters]
        index = {task: i for i, task in enumerate(tasks)}
        replies: list[object] = [_PENDING] * len(tasks)
        pending: set[asyncio.Task[Any]] = set(tasks)
        while pending and any(self._verdict(replies, s, slots) is None for s in range(slots)):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                replies[index[task]] = _outcome(task, self.masters[index[task]])
        return replies

    def _verdict(self, per_master: list[object], slot: int, slots: int) -> int | None:
        """1: a quorum renewed renewal ``slot`` of a batch; 0: it is lost; ``None``: open."""
        replies = _slot(per_master, slot, slots)
        if sum(1 for r in replies if _status(r) == 1) >= self.quorum:
            return 1
        if sum(1 for r in replies if _status(r) == 0) > len(self.masters) - self.quorum:
            return 0
        return None


def _outcome(task: asyncio.Task[object], master: Any) -> object:
    """A renewal pipeline's reply from ``master``, or the error in its place. An exception
    that is not a server's (a client library's bug, a wrapper's) fails that master alone: the
    others' quorum still renews — it is logged, not raised, as one master's failure."""
    if task.cancelled():
        return LockError("the redis client was closed")
    exc = task.exception()
    if exc is None:
        return task.result()
    if not isinstance(exc, Exception):
        raise exc
    if isinstance(exc, TORN_DOWN):
        # redis-py on a transport torn down under the call (the master restarted): a broken
        # connection, retried as one — not a bug to report.
        logger.info(
            "renewing on %r: the connection broke under the call (%s)", master, describe(exc)
        )
        return connection_failed(exc)
    logger.error("renewing on %r failed", master, exc_info=exc)
    return exc


def _slot(per_master: list[object], slot: int, slots: int) -> list[object]:
    """Each master's reply to entry ``slot`` of a pipeline of ``slots`` (or its error)."""
    return [r[slot] if isinstance(r, list) and len(r) == slots else r for r in per_master]


_Keys = tuple[str | bytes, ...]


async def _pipelined(
    master: Any, script: Script, calls: Sequence[tuple[EncodableArg, ...]], numkeys: int
) -> list[object]:
    """Run ``script`` once per ``calls`` entry (its keys, then its arguments) in one pipeline
    on ``master``; each reply or error in order (a master that lost its scripts is given them:
    :func:`._runtime.pipelined`)."""
    return await pipelined(
        master, [Call(script, cast(_Keys, c[:numkeys]), c[numkeys:]) for c in calls]
    )


@final
class _Debt:
    """One abandon a master is owed (see :class:`_Janitor`)."""

    __slots__ = ("channel", "keys", "owed_at", "patience", "settled", "until")

    def __init__(
        self, state: _Owner, until: float, settled: asyncio.Future[None], owed_at: float
    ) -> None:
        self.keys = state.keys
        self.channel = state.channel
        self.patience = state.node_timeout
        # Past this the value's key has expired by itself on the master — if the master ran
        # the commands sent to it by then (it answered something since ``owed_at``).
        self.until = until
        self.owed_at = owed_at
        self.settled = settled


@final
class _Janitor:
    """The clean-ups one master is owed: abandons of round values that may be on it (a failed
    round, a release the master did not confirm, a lost hold's minority copy).

    At most one task per master sends them, all that are owed in one pipeline per pass, and
    retries what was not confirmed with a growing back-off until the master confirms it or the
    value's key has surely expired. So a silent master costs one connection and one task
    however many holds were released meanwhile, instead of a task and a connection per release
    (which filled the master's connection pool). An abandon also fences its value on the
    master, so an attempt of that round arriving after it is refused.

    "Surely expired" needs the master to have run what was sent to it: a stopped master
    (SIGSTOP, a long GC-like pause of its host) runs a round's attempt still queued on its
    socket when it resumes, and the key it then takes lives a whole lease from that moment.
    So a debt is given up by time only once the master has answered something since it was
    owed (it keeps refusing with a transient error: BUSY, LOADING, READONLY); a master silent
    all along is retried, at most once a second, until it answers."""

    __slots__ = ("_debts", "_fan", "_heard", "_master", "_runtime", "_task", "loop")

    def __init__(self, fan: FanOut, master: Any) -> None:
        self._fan = fan
        self._master = master
        self.loop = asyncio.get_running_loop()
        self._runtime = existing_runtime(fan)
        self._debts: dict[str, _Debt] = {}
        self._task: asyncio.Task[None] | None = None
        self._heard = -math.inf  # loop time of the master's last answer to a clean-up

    def owe(self, state: _Owner, value: str, until: float) -> asyncio.Future[None]:
        """Owe the abandon of ``value`` (a round of ``state``); done once settled."""
        debt = self._debts.get(value)
        if debt is None:
            now = self.loop.time()
            debt = self._debts[value] = _Debt(state, until, self.loop.create_future(), now)
        else:
            debt.until = max(debt.until, until)
        if self._task is None or self._task.done():
            task = self._task = self._fan._spawn(self._work())
            task.add_done_callback(self._ended)
        return debt.settled

    def _ended(self, task: asyncio.Task[None]) -> None:
        # A task cancelled before it started (spawned once its runtime had shut down) never
        # ran its ``finally``: nobody will send what is still owed, so nobody waits for it.
        if task is self._task:
            for value in list(self._debts):
                self._settle(value)

    def _settle(self, value: str) -> None:
        debt = self._debts.pop(value, None)
        if debt is not None and not debt.settled.done() and not self.loop.is_closed():
            debt.settled.set_result(None)

    async def _work(self) -> None:
        failures = 0
        try:
            # The runtime's close cancels this task; the check also stops it where Python
            # 3.10/3.11's wait_for swallowed that cancellation (a reply arriving with it).
            while self._debts and not (self._runtime is not None and self._runtime.closed):
                batch = list(itertools.islice(self._debts.items(), _SWEEP_BATCH))
                calls = [
                    (*debt.keys, value, "abandon", "", debt.channel, "0", "1")
                    for value, debt in batch
                ]
                patience = max(_SWEEP_MIN_PATIENCE, *(debt.patience for _, debt in batch))
                numkeys = len(batch[0][1].keys)
                abandon = functools.partial(
                    _pipelined, script=LOCK_RELEASE, calls=calls, numkeys=numkeys
                )
                replies = await self._fan._one(self._master, abandon, patience)
                if isinstance(replies, list):
                    self._heard = self.loop.time()
                if isinstance(replies, list) and len(replies) == len(batch):
                    for (value, _), reply in zip(batch, replies, strict=True):
                        if not (isinstance(reply, BaseException) and transient_error(reply)):
                            self._settle(value)  # done, or refused for good (not our key)
                    if not any(value in self._debts for value, _ in batch):
                        failures = 0
                        continue
                # Not confirmed: the master is silent, or it answers with an error worth
                # retrying (BUSY, LOADING, READONLY) — which comes back at once, so it is
                # retried with the same back-off and given up on at the same time.
                failures += 1
                delay = _SWEEP_BACKOFF[min(failures, len(_SWEEP_BACKOFF)) - 1]
                now = self.loop.time()
                overdue = []
                for value, debt in list(self._debts.items()):
                    if now + delay >= debt.until:
                        if self._heard >= debt.owed_at:
                            self._settle(value)
                        else:
                            overdue.append(value)  # silent all along: it may run it yet
                if len(overdue) > _SILENT_DEBTS_MAX:
                    logger.warning(
                        "%r has been silent for long: %d clean-ups of it given up (their keys "
                        "may be taken when it answers again, each for at most a lease)",
                        self._master,
                        len(overdue) - _SILENT_DEBTS_MAX,
                    )
                    for value in overdue[: len(overdue) - _SILENT_DEBTS_MAX]:
                        self._settle(value)
                if self._debts:
                    await asyncio.sleep(delay)
        finally:
            # Done, or the runtime is closing: nobody is left waiting on a clean-up.
            for value in list(self._debts):
                self._settle(value)


def _no_quorum(
    results: list[object], action: str, agreed: Callable[[object], bool] | None = None
) -> QuorumError:
    """The error of a round that got no quorum: how many masters answered in time, and —
    given ``agreed``, the round's "yes" — how many of them agreed (helper-82: "2 of 3 masters
    answered" read as a quorum where one of the two had answered "not held")."""
    replies = [r for r in results if r is not _PENDING and not isinstance(r, BaseException)]
    errors = [describe(r) for r in results if isinstance(r, BaseException)]
    detail = f"; errors: {', '.join(errors[:3])}" if errors else ""
    if agreed is not None and replies:
        yes = sum(1 for r in replies if agreed(r))
        detail = f", {yes} of them agreeing{detail}"
    exc = QuorumError(
        f"no quorum to {action}: {len(replies)} of {len(results)} masters answered in time"
        f"{detail}"
    )
    exc.pool_exhausted = any(isinstance(r, MaxConnectionsError) for r in results)
    return exc


@final
class FanPipeline:
    """Collects the lease keeper's renewals for :meth:`FanOut.renew_batch`."""

    __slots__ = ("_calls", "_fan")

    def __init__(self, fan: FanOut) -> None:
        self._fan = fan
        self._calls: list[tuple[str, tuple[Any, ...]]] = []

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: EncodableArg) -> FanPipeline:
        """Queue one renewal."""
        self._calls.append((sha, keys_and_args))
        return self

    async def execute(self, raise_on_error: bool = True) -> list[object]:
        """Run the queued renewals on every master (errors are returned, never raised)."""
        return await self._fan.renew_batch(self._calls)


# -- waiting: one hub per master, one lot per lock ---------------------------------------------


@final
class MultiHub:
    """The hub of a :class:`FanOut` runtime: a :class:`SubscriptionHub` per master, all
    delivering into one parking lot per channel; a channel counts as subscribed once a quorum
    of masters confirmed it: a release is announced by every master that had the key, and a
    holder's quorum shares a master with any other quorum (one master was not enough: a
    holder of the others' keys released unheard — helper-60)."""

    __slots__ = ("_closing", "_hubs", "_loop", "_subscriptions")

    def __init__(
        self,
        masters: Sequence[Any],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._subscriptions = [Subscriptions(_constant(master)) for master in masters]
        self._hubs = [
            SubscriptionHub(subscriptions.pubsub, spawn) for subscriptions in self._subscriptions
        ]
        self._loop = asyncio.get_running_loop()
        self._closing = False

    @property
    def waiting(self) -> int:
        """How many local waiters are queued, over all channels."""
        return sum(len(lot) for lot in self.lots())

    @property
    def long_lived(self) -> set[asyncio.Task[None]]:
        """Every master's listener."""
        tasks: set[asyncio.Task[None]] = set()
        for hub in self._hubs:
            tasks |= hub.long_lived
        return tasks

    @property
    def reconnects(self) -> int:
        """Pub/sub reconnections, over all masters."""
        return sum(hub.reconnects for hub in self._hubs)

    def waiters(self, channel: str) -> int:
        """How many local waiters are queued on ``channel``."""
        return max(hub.waiters(channel) for hub in self._hubs)

    def lots(self) -> list[ParkingLot]:
        """Every parking lot (each once)."""
        seen: dict[int, ParkingLot] = {}
        for hub in self._hubs:
            for lot in hub.lots():
                seen.setdefault(id(lot), lot)
        return list(seen.values())

    def lot(self, channel: str, active: int = 1, *, shared: ParkingLot | None = None) -> ParkingLot:
        """The one parking lot of ``channel``, subscribed on every master (``shared``: the
        lot to use if no master has one yet)."""
        existing = self.existing_lot(channel)
        if existing is not None:
            shared = existing
        elif shared is None:
            shared = ParkingLot(active)
        for hub in self._hubs:
            hub.lot(channel, active, shared=shared)
        return shared

    def existing_lot(self, channel: str) -> ParkingLot | None:
        """``channel``'s lot if a master has it."""
        for hub in self._hubs:
            lot = hub.existing_lot(channel)
            if lot is not None:
                return lot
        return None

    def done_with(self, channel: str) -> None:
        """A waiter left ``channel``'s lot."""
        for hub in self._hubs:
            hub.done_with(channel)

    def refused(self, channel: str) -> bool:
        """Whether every master refused ``channel``'s latest subscription."""
        return all(hub.refused(channel) for hub in self._hubs)

    async def subscribed(self, channel: str, deadline: float | None) -> bool:
        """Wait until a quorum of masters confirmed ``channel`` (or, once none is left to
        answer, at least one); ``False`` once ``deadline`` passed; a :class:`LockError` when
        every master that answered refused it (an ACL) and none is left to answer."""
        quorum = len(self._hubs) // 2 + 1
        while True:
            confirmations = [hub.confirmation(channel) for hub in self._hubs]
            refusals = []
            confirmed = 0
            for confirmation in confirmations:
                if confirmation.done() and not confirmation.cancelled():
                    refusal = confirmation.exception()
                    if refusal is None:
                        confirmed += 1
                    else:
                        refusals.append(refusal)
            if confirmed >= quorum:
                return True
            if self._closing:
                raise LockError("the redis client was closed; create a new client to use locks")
            pending = [confirmation for confirmation in confirmations if not confirmation.done()]
            if confirmed and not pending:
                return True
            if refusals and not pending:
                raise LockError(f"cannot wait for a lock: {refusals[0]}")
            left = None if deadline is None else deadline - self._loop.time()
            if left is not None and left <= 0:
                return False
            await asyncio.wait(
                pending or confirmations, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )

    def wake_all(self) -> None:
        """Wake every local waiter (closing)."""
        for hub in self._hubs:
            hub.wake_all()

    async def wait_empty(self, timeout: float) -> None:
        """Return once no waiter is queued, or after ``timeout`` seconds."""
        await asyncio.gather(*(hub.wait_empty(timeout) for hub in self._hubs))

    async def aclose(self) -> None:
        """Close every master's pub/sub connection."""
        self._closing = True
        await asyncio.gather(*(hub.aclose() for hub in self._hubs))
        await asyncio.gather(*(subscriptions.aclose() for subscriptions in self._subscriptions))


def _constant(master: Any) -> Callable[[], Any]:
    return lambda: master


@final
class Masters(ClientRef):
    """The topology of N independent masters (a ``RedLock``): the core's client is the
    :class:`FanOut` (held weakly: the runtime is keyed by it); announcements are plain
    pub/sub on every master."""

    __slots__ = ()
    _gone = "the RedLock's masters were garbage-collected"

    @property
    def sharded(self) -> bool:
        """Masters are standalone servers: plain pub/sub."""
        return False

    def node_of(self, channel: str) -> Hashable:
        """One (multi-master) hub serves every channel."""
        return None

    def pubsub(self, node: Hashable) -> Any:
        """Not used: :meth:`make_hub` listens on every master."""
        raise LockError("a RedLock listens through its MultiHub")

    def wait_refusal(self) -> str | None:
        """The first master's that refuses (:func:`subscription_refusal`), naming it."""
        for index, master in enumerate(self.client.masters):
            refusal = subscription_refusal(master)
            if refusal is not None:
                return f"master {index}: {refusal}"
        return None

    def make_hub(
        self, node: Hashable, spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]
    ) -> MultiHub:
        """A hub that listens on every master."""
        return MultiHub(self.client.masters, spawn)

    def transient(self, exc: BaseException) -> bool:
        """As for one server; a :class:`QuorumError` is a connection error."""
        return transient_error(exc)

    def passing(self, exc: BaseException) -> bool:
        """Nothing: a round that missed its quorum is an answer ("held elsewhere"), retried
        after a jittered delay; an error is the caller's."""
        return False

    async def run_batch(self, calls: Sequence[Call], bound: float) -> list[object]:
        """One pipeline per master (:meth:`FanOut.renew_batch`), counted on a quorum."""
        pipe = self.client.pipeline()
        for script, keys, args, _ in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        try:
            return await asyncio.wait_for(pipe.execute(raise_on_error=False), bound)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            return [exc] * len(calls)

    async def aclose(self) -> None:
        """The fan-out closes with its masters' clients (:func:`fan_out`)."""

    def pipeline_for(self, key: str | bytes) -> Any:
        """Replica sync is per server; a RedLock's safety comes from its quorum instead."""
        raise LockError("replica sync (replicas=) is not available for a RedLock")


_FANOUTS: weakref.WeakValueDictionary[tuple[Hashable, ...], FanOut] = weakref.WeakValueDictionary()
_PINNED: Final = "_redis_locks_async_fanouts"


def fan_out(masters: Sequence[Any]) -> FanOut:
    """The fan-out over ``masters``: one per set of clients (in whatever order, whatever the
    ``node_timeout`` of each ``RedLock``), so that ``RedLock`` objects over the same masters
    share their holds (re-entry) and their pub/sub connections.

    A fan-out lives as long as its masters' clients (each client keeps a reference to it):
    were it to die with the last ``RedLock`` object using it, a ``RedLock`` built per request
    would open pub/sub connections of its own every time and never give them back to the
    masters' pools (a garbage-collected runtime cannot close them)."""
    key = tuple(sorted(id(m) for m in masters))
    fan = _FANOUTS.get(key)
    if fan is None:
        fan = _FANOUTS[key] = FanOut(masters)
        ref = weakref.ref(fan)

        async def close() -> None:
            target = ref()
            if target is not None:
                await target.aclose()

        for master in masters:
            close_with(master, close)
            pinned = getattr(master, _PINNED, None)
            if not isinstance(pinned, list):
                pinned = []
                setattr(master, _PINNED, pinned)
            pinned.append(fan)  # a cycle (master -> fan -> master): collected with the masters
    return fan
