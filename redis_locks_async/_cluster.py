"""Redis Cluster: the topology of a ``redis.asyncio.cluster.RedisCluster`` client.

What changes on a cluster, and where it is handled:

* **Scripts** run on the one primary that owns the lock: every key of a lock hashes to one slot
  (``_keys``: the auxiliary keys carry the name's hash tag). A script call goes straight to
  that primary, by the short way of a plain client (:mod:`._wire`) on a connection pool of the
  topology's own for the node, the node found in the cluster client's slot map
  (:meth:`Cluster.run_script`). Anything but a reply — a redirection (``MOVED``/``ASK``: the
  slot moved or is moving), ``TRYAGAIN``, a slot nobody serves, a connection that failed — sends
  the call through the cluster client instead, whose business redirections and slot-map
  refreshes are (a script may then run twice: every script is idempotent, as redis-py's own
  retries already require); a node whose connection failed is avoided for a second.
* **Announcements** use sharded pub/sub (``SPUBLISH`` in the scripts, ``SSUBSCRIBE`` here): a
  lock's channel lives on the node that owns its slot, and one subscription hub per node
  multiplexes every channel of that node. The hub's connection is a plain connection to that
  node (its own small pool, with the cluster client's connection settings), so the hub's health
  check, reconnection and re-check apply unchanged. After a slot migration the old node drops
  the subscription and answers its renewal with ``MOVED``; after a failover the old node is
  gone and the client's slot map names the promoted replica; after a manual ``CLUSTER
  FAILOVER`` the old node, now a replica, drops the subscription (and would accept it again,
  but the new primary's scripts would not see the waiters' presence there), and the hub asks
  that node whether it still serves the slot (:meth:`Cluster.node_serves`). Either way the
  hub gives the channel up and its waiters re-check, then follow it to the hub of the node
  that serves it now (``LockBase._follow``); their fallback timers bound the wait in any case.
* **Renewals** are pipelined per node (a cluster pipeline refuses ``EVALSHA``): the keeper's
  batch is split by the node that owns each lock's slot, one pipeline per node, sent
  concurrently; a renewal answered with a redirection is re-sent through the cluster client.

Slot migrations and failovers are transient errors: a renewal retries until the lease would
end, exactly as on one server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Final, final

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import ConnectionPool
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._errors import LockError
from ._runtime import ClientRef, pipelined, transient_error
from ._scripts import ROUTES, Call, EncodableArg
from ._wire import fast_pool, unobserved

if TYPE_CHECKING:
    from ._scripts import Script

__all__ = ("Cluster",)

_CLUSTER_TRANSIENT: Final = (
    AskError,
    MovedError,
    TryAgainError,
    ClusterDownError,
    ClusterError,
    SlotNotCoveredError,
)
_REDIRECTED: Final = (AskError, MovedError)
_NODE_DOWN: Final = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)
# What sends a script call from its node's short way through the cluster client instead.
_NOT_HERE: Final = _CLUSTER_TRANSIENT + _NODE_DOWN
_AVOID_FOR: Final = 1.0  # seconds a node whose connection failed gets no short-way calls


@final
class Cluster(ClientRef):
    """The nodes behind a ``RedisCluster`` client (module docstring)."""

    __slots__ = ("__weakref__", "_avoid", "_loop", "_nodes")

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self._nodes: dict[str, Redis] = {}
        self._avoid: dict[str, float] = {}  # node -> loop time until which it is avoided
        self._loop = asyncio.get_running_loop()
        ROUTES[client] = self.run_script  # (the latest runtime's: the client's loop now)

    async def run_script(
        self, script: Script, keys: Sequence[str | bytes], args: Sequence[EncodableArg]
    ) -> object:
        """Run ``script`` on the primary that owns ``keys`` (module docstring): by the short
        way on that node's own pool, else — redirected, refused for now, the node unreachable,
        the client used under another event loop, its commands observed (a tracer's wrapper, a
        subclass's override: they see the library's scripts as before) — through the cluster
        client."""
        client = self.client
        loop = asyncio.get_running_loop()
        if loop is self._loop and unobserved(client):
            try:
                node = client.get_node_from_key(keys[0])
            except SlotNotCoveredError:  # (a client not initialized yet: no slot map)
                node = None
            name = None if node is None else str(node.name)
            if name is not None and (not self._avoid or self._avoid.get(name, 0.0) < loop.time()):
                fast = fast_pool(self._node_client(name))
                if fast is not None:
                    try:
                        return await script.run_fast(fast, keys, args)
                    except _NOT_HERE as exc:
                        if isinstance(exc, _NODE_DOWN):
                            self._avoid[name] = loop.time() + _AVOID_FOR
                        # (the cluster client follows a redirection, and refreshes its map)
        try:
            return await script.run_plain(client, keys, args)
        except RedisClusterException as exc:
            if isinstance(exc, SlotNotCoveredError):
                raise
            # redis-py reached no node to rebuild its slot map from ("Redis Cluster cannot be
            # connected"): the cluster is down for now — a connection error, retried and undone
            # as one (helper-81: it reached the user raw, and killed a clean-up).
            raise RedisConnectionError(f"no node of the cluster answers: {exc}") from exc

    @property
    def sharded(self) -> bool:
        """Announcements use sharded pub/sub."""
        return True

    def node_of(self, channel: str) -> Hashable:
        """The name (``host:port``) of the primary that owns ``channel``'s slot now (of its
        UTF-8 bytes, as it goes out whatever the client's encoding: ``_keys``)."""
        node = self.client.get_node_from_key(channel.encode("utf-8"))
        if node is None:
            raise LockError(f"no cluster node serves the slot of {channel!r} (not initialized?)")
        return str(node.name)

    def pubsub(self, node: Hashable) -> Any:
        """A plain pub/sub connection to ``node``."""
        return PubSub(self._node_client(str(node)).connection_pool)

    def wait_refusal(self) -> str | None:
        """Nothing: the subscriptions use node clients of the topology's own."""
        return None

    async def node_serves(self, node: Hashable, key: str) -> bool | None:
        """Whether ``node`` itself says it serves ``key``'s slot — its own answer, not the
        client's slot map: ``False`` when it redirects (``MOVED``: a replica, or the slot
        moved away), ``None`` when it cannot tell (unreachable, gone)."""
        try:
            await self._node_client(str(node)).pttl(key.encode("utf-8"))
        except MovedError:
            return False
        except (RedisError, OSError, LockError):  # (ASK: a migration under way, not over)
            return None
        return True

    async def refresh(self, key: str) -> None:
        """Make the cluster client look up where ``key``'s slot lives (one cheap read sent
        through it: a dead node's connection error makes redis-py rebuild its slot map)."""
        # (exists() would go through a pipeline; the key's UTF-8 bytes, as every key goes out)
        await self.client.pttl(key.encode("utf-8"))

    def transient(self, exc: BaseException) -> bool:
        """Standalone's transient errors, plus redirections, ``TRYAGAIN`` and a cluster that
        is down for now (a failover in progress)."""
        return isinstance(exc, _CLUSTER_TRANSIENT) or transient_error(exc)

    def passing(self, exc: BaseException) -> bool:
        """Redirections, ``TRYAGAIN`` (a slot migration under way: its keys are split between
        two nodes), a cluster that is down for now, a slot not covered yet (a failover), and
        redis-py giving up after too many of them (``TTL exhausted``)."""
        return isinstance(exc, _CLUSTER_TRANSIENT)

    async def run_batch(self, calls: Sequence[Call], bound: float) -> list[object]:
        """Run ``calls`` in one pipeline per node, concurrently, each bounded by ``bound``
        seconds; errors are returned in place of replies."""
        client = self.client
        groups: dict[str, list[int]] = {}
        for index, call in enumerate(calls):
            node = client.get_node_from_key(call.keys[0])
            groups.setdefault("" if node is None else str(node.name), []).append(index)
        results: list[object] = [None] * len(calls)

        async def one_node(name: str, indexes: list[int]) -> None:
            if not name:
                for index in indexes:
                    results[index] = SlotNotCoveredError("no node serves this slot")
                return
            try:
                replies = await pipelined(
                    self._node_client(name), [calls[index] for index in indexes], bound
                )
            except Exception as exc:  # per call: any failure is that call's reply
                replies = [exc] * len(indexes)
                if isinstance(exc, _NODE_DOWN):
                    # The node may be dead and its replica promoted: one call through the
                    # cluster client lets redis-py find out and refresh its slot map, so the
                    # keeper's next try (soon: the others are transient errors) reaches the
                    # new primary. Without it, renewals went on trying the dead node until
                    # every lease on it ended.
                    try:
                        replies[0] = await asyncio.wait_for(calls[indexes[0]].run(client), bound)
                    except Exception as again:
                        replies[0] = again
            for index, reply in zip(indexes, replies, strict=True):
                call = calls[index]
                if isinstance(reply, TryAgainError) and call.narrow is not None:
                    # A migration has split the call's keys between two nodes: the keys the
                    # hold keeps, through the cluster client (Call.narrow).
                    call = call.narrowed()
                elif not isinstance(reply, _REDIRECTED):
                    results[index] = reply
                    continue
                # The slot moved (is moving): the cluster client follows the redirection
                # (and refreshes its slot map for the next batch).
                try:
                    reply = await asyncio.wait_for(call.run(client), bound)
                except Exception as exc:
                    reply = exc
                results[index] = reply

        await asyncio.gather(*(one_node(name, indexes) for name, indexes in groups.items()))
        return results

    def pipeline_for(self, key: str | bytes) -> Any:
        """A pipeline on the node that owns ``key``'s slot."""
        node = self.client.get_node_from_key(key)
        if node is None:
            raise LockError(f"no cluster node serves the slot of {key!r}")
        return self._node_client(str(node.name)).pipeline(transaction=False)

    async def aclose(self) -> None:
        """Close the per-node connections this topology opened."""
        try:
            if ROUTES.get(self.client) == self.run_script:
                del ROUTES[self.client]
        except LockError:  # the client is gone, and its entry with it
            pass
        nodes, self._nodes = self._nodes, {}
        for node in nodes.values():
            await node.aclose(close_connection_pool=True)

    def _node_client(self, name: str) -> Redis:
        node_client = self._nodes.get(name)
        if node_client is None:
            node = self.client.get_node(node_name=name)
            if node is None:
                raise LockError(f"cluster node {name} is gone")
            kwargs = dict(node.connection_kwargs)
            # Replies as bytes, whatever the client decodes (as redis-py's default does): a
            # channel name in a pub/sub frame is UTF-8 (``_keys``), which a client's own
            # encoding may not decode at all (``ascii``, ``cp1252``).
            kwargs["decode_responses"] = False
            kwargs.pop("maint_notifications_config", None)
            kwargs.pop("oss_cluster_maint_notifications_handler", None)
            pool = ConnectionPool(connection_class=node.connection_class, **kwargs)
            node_client = self._nodes[name] = Redis(connection_pool=pool)
        return node_client
