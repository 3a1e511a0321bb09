"""B7 — cross-process handoff on a 6-node Redis Cluster, against the one-hop floor on the same node.

The scenario starts a cluster of its own: 3 primaries and 3 replicas of the run's server binary
on free loopback ports (``tests.servers.running_cluster``). Then B2's ping-pong runs on it, with
the same worker processes and code (``_b2_worker``, ``b2_handoff.measure``), except that each
worker's client is a ``redis.asyncio.cluster.RedisCluster``: for that client the library picks
its Cluster topology by itself — scripts routed to the lock's slot, waiters woken by sharded
pub/sub (``SPUBLISH`` in the release script, ``SSUBSCRIBE`` on the node that owns the slot).

Every name of the run carries the hash tag ``{b7}``, so the floor's lists, the pub/sub hop's
shard channels and every key and channel of the locks live on one primary: the floor and the
lock go through the same node. Rows:

* **one-hop floor** — a bare token pushed with ``RPUSH`` onto a list the other process is
  blocked on with ``BLPOP``, through the cluster client on both sides (B2's floor on the lock's
  node): the reference of every ratio;
* **sharded pub/sub hop** — the token as an ``SPUBLISH`` to a shard channel the other side
  reads with redis-py's ``ClusterPubSub`` — the transport our ``Lock`` wakes waiters with there;
* our ``Lock`` (SPEC §5: ≤ 1.5 x the floor on the same cluster, median and p99) and
  ``FairLock``.

As in B2, traced runs of their own (the clients record when they write and read) split a
handoff into its hops; the latencies come from the untraced runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis

from tests.servers import running_cluster

from ._common import OURS
from ._console import Log
from ._stats import fmt_ratio
from .b2_handoff import (
    FAIR,
    FULL,
    QUICK,
    Plan,
    handoff_failures,
    handoff_rows,
    measure,
    within,
)

TARGET = 1.5  # x the one-hop floor on the same cluster (median and p99), Lock
PRIMARIES = 3
REPLICAS_PER_PRIMARY = 1
HASH_TAG = "b7"  # every name of the run hashes to this tag's slot: one node

PLANS = (
    Plan(
        "floor",
        "one-hop floor (RPUSH → BLPOP)",
        0.002,
        False,
        "",
        "RedisCluster client in both processes; the lock's node",
    ),
    Plan(
        "pubsub-hop",
        "sharded pub/sub hop (SPUBLISH → SSUBSCRIBE)",
        0.002,
        False,
        "",
        "reference: the transport Lock wakes waiters with on a cluster",
    ),
    Plan(
        OURS,
        "redis-locks-async Lock",
        0.002,
        False,
        "redis-locks-async",
        "sharded pub/sub wake-up, direct handover",
    ),
    Plan(
        FAIR,
        "redis-locks-async FairLock",
        0.002,
        False,
        "redis-locks-async",
        "FIFO: the release script hands over to the head waiter and notifies only it",
    ),
)


def _node_of(host: str, port: int, key: str) -> tuple[str, int, int]:
    """``(host, port, slot)`` of the primary that serves ``key``, as a cluster client sees it."""
    cluster = redis.RedisCluster(host=host, port=port)
    try:
        node = cluster.get_node_from_key(key)  # type: ignore[no-untyped-call]
        slot: int = cluster.keyslot(key)  # type: ignore[no-untyped-call]
        return node.host, node.port, slot
    finally:
        cluster.close()


def run(binary: Path, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B7 on a cluster of ``binary`` servers and return its JSON-ready result."""
    config = QUICK if quick else FULL
    stem = f"{prefix}b7:{{{HASH_TAG}}}:"
    started = time.monotonic()
    with running_cluster(
        binary, primaries=PRIMARIES, replicas_per_primary=REPLICAS_PER_PRIMARY
    ) as nodes:
        formed_s = time.monotonic() - started
        entry = nodes[0]
        host, port, slot = _node_of(entry.host, entry.port, stem)
        log(
            f"B7: {len(nodes)} nodes ({PRIMARIES} primaries, "
            f"{PRIMARIES * REPLICAS_PER_PRIMARY} replicas) formed in {formed_s:.1f} s; "
            f"every name on slot {slot}, primary {host}:{port}"
        )
        observer = redis.Redis(host=host, port=port)
        try:
            tallies, clock = measure(
                entry.url, stem, PLANS, config, observer, log, cluster=True, tag="B7"
            )
        finally:
            observer.close()
    rows = handoff_rows(tallies, log, "B7")
    ours = next((r for r in rows if r["key"] == OURS), {})
    fair = next((r for r in rows if r["key"] == FAIR), {})
    met = within(ours, TARGET)
    fatal = handoff_failures(rows)
    return {
        "scenario": "B7",
        "title": "Cross-process handoff on a 6-node cluster",
        "config": {
            "fast_handoffs": config.fast_handoffs,
            "fast_rounds": config.fast_rounds,
            "hold_base_ms": config.hold_base_s * 1000,
            "primaries": PRIMARIES,
            "replicas": PRIMARIES * REPLICAS_PER_PRIMARY,
            "slot": slot,
            "node": f"{host}:{port}",
            "formed_s": round(formed_s, 1),
        },
        "clock_check": clock,
        "reference": "one-hop floor (RPUSH/BLPOP ping-pong through RedisCluster clients) on "
        "the lock's node, same run",
        "rows": rows,
        "skipped": {},
        "target": {
            "text": f"Lock ≤ {TARGET} x the floor on the same cluster (median and p99)",
            "limit": TARGET,
            "value": [ours.get("ratio_median"), ours.get("ratio_p99")],
            "value_text": f"Lock {fmt_ratio(ours.get('ratio_median'))} / "
            f"{fmt_ratio(ours.get('ratio_p99'))} x floor; FairLock "
            f"{fmt_ratio(fair.get('ratio_median'))} / {fmt_ratio(fair.get('ratio_p99'))}",
            "met": met,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
