"""``RedLock``: ``Lock``'s policy over N independent masters, held while a quorum holds it.

The algorithm is the Redis documentation's: the same key and a fresh random value on every
master, all attempts concurrent and each bounded by ``node_timeout``; the lock is held when a
quorum (``N // 2 + 1``) took it and time is left — validity = lease - elapsed - (lease·0.01 +
2 ms) on the monotonic clock; a failed round is released on *every* master; the next round
follows a release announced by any master, the expected expiry of the holder's keys, or a
random delay. Renewal, re-entry and release count only when a quorum confirmed them.
``_fanout`` folds the N masters into one client for the core, so none of the core's waiting,
cancellation or renewal logic exists twice (see its docstring for the details).

Where it is safe: a hold stays exclusive while no more than N - quorum masters lose its key
and the masters' clocks advance at about the same rate. Where it is not:

* **Clock jumps.** A master whose clock jumps forward expires keys early; two such masters (of
  three) let a second client take the lock during a valid hold.
* **A master restarted without persistence during a hold** comes back empty: the hold lives on
  the remaining majority (renewals keep it there), but it now depends on one master fewer. If a
  second master also loses the key, another client can take a quorum while this hold still
  believes it is valid (until its next renewal finds the majority gone and signals the loss).
  Remedy: persistence with ``appendfsync always``, or restart a crashed master only after the
  longest lease in use has passed ("delayed restart").
* **Pauses longer than the validity** (GC, VM freeze, SIGSTOP): as for every lease, pass the
  fencing token to the protected resource.

**Fencing across masters.** ``Lease.fencing_token`` is the largest token among the quorum
that granted the hold. Each master's token is at least its clock in microseconds (and above
the last token a release recorded there), so tokens increase across successive holds as long
as the masters' clocks agree to within the time between the holds — also after masters
restart empty or keys expire. They are not a consensus counter: a master whose clock runs
ahead by more than the gap between two holds can put a larger token into the earlier hold
(when the later quorum does not include it), and a clock set back can do the same. Use them
as a best-effort fence, with clocks kept in sync (NTP slewing, not stepping).
"""

from __future__ import annotations

import ipaddress
import math
import socket
import warnings
from collections.abc import Sequence
from typing import Any, Final, final

from ._core import Attempt, LockBase, _is_async_client
from ._fanout import INSPECT_TIMEOUT, LAYOUT, FanOut, Masters, drift, fan_out
from ._lease import LostCallback
from ._lock import LOCK_ACQUIRE, LOCK_RELEASE, HashLockPolicy
from ._scripts import Call
from ._validation import check_lease

__all__ = ("RedLock", "RedLockPolicy", "default_node_timeout")

NODE_TIMEOUT_CAP: Final = 0.5  # seconds: the default never waits longer for one master


def default_node_timeout(lease: float) -> float:
    """The default per-master timeout for ``lease``: 2 % of it, at least 50 ms and at most
    0.5 s — and never more than a tenth of the lease."""
    return min(NODE_TIMEOUT_CAP, lease / 10, max(0.05, lease * 0.02))


@final
class RedLockPolicy(HashLockPolicy):
    """``Lock``'s scripts as a quorum uses them: attempts never register (a hand-over on one
    master would mean nothing), and every free is announced (waiters re-attempt on it)."""

    kind = "redlock"
    layout = LAYOUT
    __slots__ = ("node_timeout",)

    def __init__(self, name: str, node_timeout: float) -> None:
        super().__init__(name)
        self.node_timeout = node_timeout

    def attempt(self, a: Attempt) -> Call:
        """``lock_acquire.lua`` in mode "try", even for a waiter; the fan-out takes this
        object's ``node_timeout`` (ms, the last argument) off before sending it."""
        timeout_ms = max(1, round(self.node_timeout * 1000))
        args = (a.owner, a.lease_ms, "try", a.grace_ms, a.claim_ms, timeout_ms)
        return Call(LOCK_ACQUIRE, self.keys.script_keys, args)

    def release(self, owner: str, mode: str, entry: str, sharded: bool) -> Call:
        """``lock_release.lua``, announcing every free."""
        keys = self.keys
        return Call(
            LOCK_RELEASE, keys.script_keys, (owner, mode, entry, keys.wire_channel, "0", "1")
        )

    async def locked(self, client: Any) -> bool:
        """Whether a quorum of masters has the lock's key (an inspection, not a round of the
        algorithm: each master is given at least half a second, a first connection included)."""
        fan: FanOut = client
        return await fan.holds_key(self.keys.key, max(self.node_timeout, INSPECT_TIMEOUT))

    def margin(self, lease: float) -> float:
        """The clock-drift allowance: lease·0.01 + 2 ms."""
        return drift(lease)


class EvenMastersWarning(UserWarning):
    """A RedLock over an even number of masters tolerates no more failures than one master
    fewer."""


def _host(host: object) -> object:
    """``host`` as one spelling: an IP literal in its canonical form (``127.1`` and
    ``127.0.0.1`` alike), a name lower-cased without a trailing dot. No DNS lookup: two names
    of one server (``localhost`` and ``127.0.0.1``) are not told apart."""
    if not isinstance(host, str):
        return host
    text = host.strip().lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    try:
        return socket.inet_ntoa(socket.inet_aton(text))  # (IPv4 shorthands: 127.1, 0x7f.1)
    except OSError:
        return text


def _port(port: object) -> object:
    """``port`` as a number, also when given as a string (redis-py accepts ``"6379"``)."""
    try:
        return int(port)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return port


def _identities(client: Any) -> list[tuple[object, ...]]:
    """The server a client talks to, as far as its settings tell: its socket path, or host
    and port, or — for a Sentinel-managed master — each of its Sentinels with the service
    name (a Sentinel watches one master under a name). Not its database: two databases of one
    server fail together, so they are one master, not two votes. Any shared identity makes two
    clients one master."""
    pool = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    manager = getattr(pool, "sentinel_manager", None)
    if isinstance(service, str) and manager is not None:
        found = []
        for sentinel in getattr(manager, "sentinels", ()):
            for where in _identities(sentinel):
                found.append(("sentinel", service, *where[1:]))
        return found
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return []
    if kwargs.get("path"):
        return [("unix", kwargs.get("path"))]
    if "host" not in kwargs:
        return []
    return [("tcp", _host(kwargs.get("host")), _port(kwargs.get("port", 6379)))]


def _check_masters(masters: object) -> tuple[Any, ...]:
    if isinstance(masters, (str, bytes)) or not isinstance(masters, Sequence):
        raise TypeError(
            "masters must be a list or tuple of redis.asyncio clients, one per independent "
            f"master, not {type(masters).__name__}"
        )
    clients = tuple(masters)
    if not clients:
        raise ValueError("RedLock needs at least one master")
    seen: dict[object, int] = {}
    for i, client in enumerate(clients):
        if not _is_async_client(client):
            raise TypeError(
                f"master {i} must be a redis.asyncio client (redis.asyncio.Redis), not "
                f"{type(client).__module__}.{type(client).__name__}"
            )
        for key in dict.fromkeys((("object", id(client)), *_identities(client))):
            if key in seen:
                raise ValueError(
                    f"masters {seen[key]} and {i} are the same server ({key[1:]!r}): a RedLock "
                    "needs independent masters, each listed once"
                )
            seen[key] = i
    if len(clients) % 2 == 0:
        warnings.warn(
            f"RedLock over {len(clients)} masters: an even number tolerates no more failed "
            f"masters than {len(clients) - 1} do (quorum {len(clients) // 2 + 1}); use an odd "
            "number",
            EvenMastersWarning,
            stacklevel=3,
        )
    return clients


@final
class RedLock(LockBase):
    """A lock held on a quorum of N independent Redis masters (the Redlock algorithm).

    ::

        masters = [redis.Redis(host=h) for h in ("r1", "r2", "r3", "r4", "r5")]
        lock = RedLock(masters, "orders:42", lease=30.0, timeout=10)
        async with lock as lease:          # held once 3 of the 5 masters granted it
            await write(order, fence=lease.fencing_token)

    Same shape as :class:`~redis_locks_async.Lock`: owned by the asyncio task (re-entry counts
    only when a quorum confirms it), ``acquire(timeout=…, blocking=…)``, ``release()``,
    ``extend()``, ``locked()`` (does a quorum have the key), ``current_lease``, ``guarded()``,
    ``transfer()``. Each master's attempt is bounded by ``node_timeout`` (default: 2 % of the
    lease, between 50 ms and 0.5 s, at most lease/10), so a stopped or partitioned master
    delays an acquire by at most that; the hold's lease counts from the attempt's start and
    keeps the clock-drift allowance (lease·0.01 + 2 ms) in hand, so ``lease.remaining()`` is the
    validity. Renewal every lease/3 counts when a quorum extended the key; otherwise the lease
    is lost (``LockLostError``, ``on_lost``, ``guarded()`` cancelled). Waiting tasks wake when
    any master announces a release. The module docstring says what this does *not* guarantee
    (clock jumps, masters restarted empty, fencing across masters).

    ``masters`` must be distinct servers (the same client, or host and port whatever the
    database, twice is a ``ValueError``); an even number draws an
    :class:`EvenMastersWarning`. ``RedLock`` objects over the same clients (in any order, with
    any lease or ``node_timeout``) share their local state: a task holding one re-enters
    through the other. The rounds of an acquisition (its
    renewals, re-entries and release included) wait ``node_timeout`` of the object that
    acquired.
    """

    _policy_class = RedLockPolicy
    __slots__ = ("_masters", "_node_timeout")

    def __init__(
        self,
        masters: Sequence[Any],
        name: str,
        *,
        lease: float = 30.0,
        auto_renew: bool = True,
        timeout: float | None = None,
        node_timeout: float | None = None,
        on_lost: LostCallback | None = None,
        max_hold: float | None = None,
    ) -> None:
        clients = _check_masters(masters)
        length = check_lease(lease)
        if node_timeout is None:
            per_node = default_node_timeout(length)
        else:
            if isinstance(node_timeout, bool) or not isinstance(node_timeout, (int, float)):
                raise TypeError(
                    f"node_timeout must be a number of seconds, not {type(node_timeout).__name__}"
                )
            per_node = float(node_timeout)
            if math.isnan(per_node) or per_node <= 0:
                raise ValueError(f"node_timeout must be > 0, got {node_timeout!r}")
            if per_node > length / 10:
                raise ValueError(
                    f"node_timeout must be far below the lease (at most lease/10 = "
                    f"{length / 10:g} s), got {node_timeout!r}: a round that waits that long for "
                    "one master leaves little of the lease to work with"
                )
        self._masters = clients
        self._node_timeout = per_node
        super().__init__(
            fan_out(clients),
            name,
            lease=length,
            auto_renew=auto_renew,
            timeout=timeout,
            on_lost=on_lost,
            max_hold=max_hold,
        )
        self._topology = Masters

    def _make_policy(self) -> RedLockPolicy:
        return RedLockPolicy(self._name, self._node_timeout)

    @property
    def masters(self) -> tuple[Any, ...]:
        """The masters' clients, in the order given."""
        return self._masters

    @property
    def quorum(self) -> int:
        """How many masters must agree: ``N // 2 + 1``."""
        fan: FanOut = self._redis
        return fan.quorum

    @property
    def node_timeout(self) -> float:
        """Seconds each master's reply is waited for in a round."""
        return self._node_timeout
