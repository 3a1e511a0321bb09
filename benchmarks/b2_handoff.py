"""B2 — cross-process handoff latency to a task already waiting, against the one-hop floor.

Two worker processes (``spawn``) play ping-pong with one lock (see ``_b2_worker``): the latency of
handoff ``i`` is ``t1 - t0``, from the moment the holder starts its release to the moment the
waiter's acquire returns, both read from CLOCK_MONOTONIC (checked here to be one clock across
processes). The **one-hop floor** is the same ping-pong where the "lock" is a bare token pushed
with ``RPUSH`` to a list the other side is already blocked on with ``BLPOP`` — the least a
handoff through the server can cost on this machine. Every peer is reported as median and p99
and as a ratio to the floor's median and p99.

Ours run twice, as ``Lock`` (target ≤ 1.3 x floor) and as ``FairLock`` (≤ 1.15 x floor: its
release script hands the lock to the head waiter and notifies only it), with the same worker
code (the peer key names the class).

Hold times: the holder keeps the lock 10 ms (so the other side is surely waiting again) plus a
random jitter as long as the peer's polling period, so a polling waiter's phase is uniformly
random, as it would be in real use, instead of locked to the hold time; event-driven peers get
2 ms of jitter. A sample whose waiter had not yet called acquire when the release began is not a
handoff to a waiting task: it is counted as "late" and left out. The fast peers (floor, ours,
python-redis-lock, redis-py with a 1 ms poll) run interleaved in rounds so that slow drift of a
noisy machine hits them alike; the slow pollers run once each.

Where a handoff's time goes (release, server, wake) is measured in runs of their own, one per
round for the floor, the pub/sub hop and ours: there the clients record when they write and
read (``_metering``), which costs time — and not the same for every peer (our script calls
leave their short way for a connection class that overrides how commands are sent). The
latencies and ratios come only from the runs without it.

:func:`measure`, :func:`handoff_rows` and :func:`handoff_failures` are shared with B7, which
plays the same ping-pong on a cluster.
"""

from __future__ import annotations

import bisect
import contextlib
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any

import redis

from ._b2_worker import (
    GO,
    HOLDING,
    READY,
    TRACED,
    RunError,
    RunResult,
    RunSpec,
    worker_main,
)
from ._common import OURS, WorkerError, is_ours, receive, stop_process
from ._console import Log
from ._peers import available
from ._stats import command_delta, fmt_ratio, ratio, summarize_ns

TARGET = 1.3  # x the one-hop floor (median and p99), Lock
FAIR_TARGET = 1.15  # the same, FairLock
FAIR = "redis-locks-async/fair"


@dataclass(frozen=True, slots=True)
class Plan:
    """One peer as B2 runs it."""

    key: str
    label: str
    jitter_s: float
    slow: bool
    requires: str
    note: str = ""


PLANS = (
    Plan(
        "floor",
        "one-hop floor (RPUSH → BLPOP)",
        0.002,
        False,
        "",
        "redis.asyncio in both processes",
    ),
    Plan(
        "pubsub-hop",
        "pub/sub hop (PUBLISH → subscriber)",
        0.002,
        False,
        "",
        "reference: the transport Lock wakes waiters with",
    ),
    Plan(
        "redis-locks-async",
        "redis-locks-async Lock",
        0.002,
        False,
        "redis-locks-async",
        "pub/sub wake-up, direct handover",
    ),
    Plan(
        "redis-locks-async/fair",
        "redis-locks-async FairLock",
        0.002,
        False,
        "redis-locks-async",
        "FIFO: the release script hands over to the head waiter and notifies only it",
    ),
    Plan(
        "python-redis-lock",
        "python-redis-lock (sync)",
        0.002,
        False,
        "python-redis-lock",
        "sync client, waits in BLPOP",
    ),
    Plan(
        "redis-py/sleep=0.001",
        "redis-py asyncio Lock (sleep=0.001)",
        0.002,
        False,
        "redis-py",
        "polls every 1 ms",
    ),
    Plan(
        "redis-py",
        "redis-py asyncio Lock (default sleep=0.1)",
        0.1,
        True,
        "redis-py",
        "polls every 100 ms",
    ),
    Plan(
        "pottery",
        "pottery AIORedlock (1 master)",
        0.2,
        True,
        "pottery",
        "retries after uniform(0, 0.2) s",
    ),
    Plan(
        "aioredlock",
        "aioredlock (1 instance)",
        0.3,
        True,
        "aioredlock",
        "retries after uniform(0.1, 0.3) s",
    ),
)


@dataclass(frozen=True, slots=True)
class B2Config:
    """How much to measure."""

    fast_handoffs: int
    slow_handoffs: int
    fast_rounds: int
    warmup_fast: int
    warmup_slow: int
    hold_base_s: float
    acquire_timeout_s: float


FULL = B2Config(300, 300, 3, 6, 2, 0.010, 30.0)
QUICK = B2Config(40, 10, 2, 4, 1, 0.010, 10.0)


class _Pair:
    """Two ping-pong worker processes and the parent's ends of their pipes."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[SpawnProcess] = []
        between = ctx.Pipe()
        for index in range(2):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(child_end, between[index]),
                daemon=True,
                name=f"b2-worker-{index}",
            )
            proc.start()
            child_end.close()
            between[index].close()
            self.conns.append(parent_end)
            self.procs.append(proc)

    def send(self, index: int, message: object) -> None:
        try:
            self.conns[index].send(message)
        except (OSError, EOFError) as exc:
            raise WorkerError(f"worker {index} is gone: {exc!r}") from exc

    def receive(self, index: int, timeout: float) -> object:
        message = receive(self.conns[index], timeout, f"worker {index}")
        if isinstance(message, RunError):
            raise WorkerError(f"worker {index}: {message.error}")
        return message

    def clock_check(self, exchanges: int = 20) -> dict[str, Any]:
        """Ask each worker for ``monotonic_ns()`` between two parent readings: with one shared
        clock every answer falls inside its bracket."""
        inside = 0
        widest = 0
        for index in range(2):
            for _ in range(exchanges):
                before = time.monotonic_ns()
                self.send(index, "clock")
                theirs = self.receive(index, 30.0)
                after = time.monotonic_ns()
                if isinstance(theirs, int) and before <= theirs <= after:
                    inside += 1
                widest = max(widest, after - before)
        return {
            "exchanges": 2 * exchanges,
            "inside_bracket": inside,
            "shared": inside == 2 * exchanges,
            "widest_bracket_us": round(widest / 1000, 1),
        }

    def close(self) -> None:
        for index in range(2):
            with contextlib.suppress(OSError, EOFError):
                self.conns[index].send("exit")
        for proc in self.procs:
            stop_process(proc, grace_s=3, force_s=3)
        for conn in self.conns:
            conn.close()


@dataclass(slots=True)
class Tally:
    plan: Plan
    latencies_ns: list[int] = field(default_factory=list)
    handoffs: int = 0
    late: int = 0
    violations: int = 0
    tokens_monotonic: bool = True
    commands: dict[str, int] = field(default_factory=dict)
    commands_handoffs: int = 0
    error: str = ""
    hops: dict[str, list[int]] = field(default_factory=dict)
    hop_commands: dict[str, int] = field(default_factory=dict)
    waiter_writes: list[int] = field(default_factory=list)


def _commandstats(client: redis.Redis) -> dict[str, Any]:
    reply: dict[str, Any] = client.info("commandstats")
    return reply


def _run_once(
    pair: _Pair,
    tally: Tally,
    url: str,
    name: str,
    handoffs: int,
    warmup: int,
    config: B2Config,
    seed: int,
    observer: redis.Redis,
    cluster: bool,
    traced: bool = False,
) -> None:
    """One ping-pong of ``tally``'s plan. A ``traced`` run only splits handoffs into hops
    (its clients record their writes and reads, which costs time); the latencies come from
    runs without tracing."""
    plan = tally.plan
    total = warmup + handoffs
    specs = [
        RunSpec(
            plan.key,
            url,
            name,
            role,
            total,
            config.hold_base_s,
            plan.jitter_s,
            seed,
            config.acquire_timeout_s,
            cluster,
            traced,
        )
        for role in (0, 1)
    ]
    before = _commandstats(observer)
    pair.send(0, specs[0])
    if pair.receive(0, 60.0) != HOLDING:
        raise WorkerError("worker 0 did not report holding the lock")
    pair.send(1, specs[1])
    if pair.receive(1, 60.0) != READY:
        raise WorkerError("worker 1 did not report ready")
    pair.send(0, GO)
    poll = plan.jitter_s if plan.slow else 0.0
    budget = 60.0 + total * (config.hold_base_s + plan.jitter_s + 3 * poll + 0.05)
    deadline = time.monotonic() + budget
    results: list[RunResult] = []
    for index in (0, 1):
        message = pair.receive(index, max(1.0, deadline - time.monotonic()))
        if not isinstance(message, RunResult):
            raise WorkerError(f"worker {index} sent {message!r}")
        results.append(message)
    after = _commandstats(observer)
    for command, calls in command_delta(before, after).items():
        if command != "info":
            tally.commands[command] = tally.commands.get(command, 0) + calls
    tally.commands_handoffs += total
    last_token: int | None = None
    for i in range(total):
        t0 = results[i % 2].released[i]
        t_call, t1, token = results[1 - i % 2].received[i]
        if token is not None:
            if last_token is not None and token <= last_token:
                tally.tokens_monotonic = False
            last_token = token
        if t1 <= t0:
            tally.violations += 1
            continue
        if i < warmup:
            continue
        if traced:
            holder, waiter = results[i % 2].trace, results[1 - i % 2].trace
            if holder and waiter and t_call <= t0:
                _split(tally, holder, waiter, t0, t1)
            continue
        tally.handoffs += 1
        if t_call > t0:
            tally.late += 1
            continue
        tally.latencies_ns.append(t1 - t0)


def _first(trace: list[tuple[int, str]], after: int, prefix: str, until: int | None = None) -> int:
    """Index of the first event of ``trace`` at or after ``after`` (and at or before ``until``)
    whose name starts with ``prefix``; -1 if none."""
    index = bisect.bisect_left(trace, (after, ""))
    for j in range(index, len(trace)):
        at, event = trace[j]
        if until is not None and at > until:
            return -1
        if event.startswith(prefix):
            return j
    return -1


def _split(
    tally: Tally, holder: list[tuple[int, str]], waiter: list[tuple[int, str]], t0: int, t1: int
) -> None:
    """Split handoff ``t0 → t1`` into its hops, from both workers' client traces:

    - ``release``: t0 → the holder's client has written its request (release script, RPUSH,
      PUBLISH);
    - ``server``: that write → the waiter's client has read the wake-up (pub/sub message, BLPOP
      reply): the server's work plus both kernels' and both event loops' wake-ups;
    - ``wake``: that read → the waiter's acquire returned (the library's dispatch);
    - ``reply``: the holder's write → the holder read its own reply (context, not in the sum).
    """
    sent = _first(holder, t0, "send:")
    if sent < 0:
        return
    t_send, event = holder[sent]
    tally.hop_commands[event] = tally.hop_commands.get(event, 0) + 1
    woke = _first(waiter, t_send, "read:message", t1)
    if woke < 0:
        woke = _first(waiter, t_send, "read:", t1)
    if woke < 0:
        return
    t_read = waiter[woke][0]
    reply = _first(holder, t_send, "read:")
    extra = sum(1 for at, ev in waiter if t_read < at <= t1 and ev.startswith("send:"))
    hops = (("release", t_send - t0), ("server", t_read - t_send), ("wake", t1 - t_read))
    for hop, value in hops:
        tally.hops.setdefault(hop, []).append(value)
    tally.waiter_writes.append(extra)
    if reply >= 0:
        tally.hops.setdefault("reply", []).append(holder[reply][0] - t_send)


def _row(tally: Tally, floor: dict[str, float] | None) -> dict[str, Any]:
    plan = tally.plan
    row: dict[str, Any] = {
        "key": plan.key,
        "label": plan.label,
        "note": plan.note,
        "hold_jitter_ms": plan.jitter_s * 1000,
    }
    if tally.error:
        row["error"] = tally.error
    if not tally.latencies_ns:
        row.setdefault("error", "no samples")
        return row
    summary = summarize_ns(tally.latencies_ns)
    per_handoff = sum(tally.commands.values()) / max(1, tally.commands_handoffs)
    row.update(
        summary=summary.as_dict(),
        handoffs=tally.handoffs,
        late=tally.late,
        exclusion_violations=tally.violations,
        commands_per_handoff=round(per_handoff, 2),
        commands_by_type={
            cmd: round(calls / max(1, tally.commands_handoffs), 2)
            for cmd, calls in sorted(tally.commands.items())
        },
    )
    if is_ours(plan.key):
        row["fencing_tokens_increase"] = tally.tokens_monotonic
    if tally.hops:
        row["hops_median_us"] = {
            hop: round(statistics.median(values) / 1000, 1) for hop, values in tally.hops.items()
        }
        row["hops_n"] = len(tally.hops["release"])
        row["hop_first_write"] = tally.hop_commands
        row["hop_waiter_writes_mean"] = round(statistics.fmean(tally.waiter_writes), 2)
    if floor is not None:
        row["ratio_median"] = ratio(summary.median_us, floor["median_us"])
        row["ratio_p99"] = ratio(summary.p99_us, floor["p99_us"])
    return row


def measure(
    url: str,
    stem: str,
    plans: Sequence[Plan],
    config: B2Config,
    observer: redis.Redis,
    log: Log,
    *,
    cluster: bool = False,
    tag: str = "B2",
) -> tuple[dict[str, Tally], dict[str, Any]]:
    """Play every plan's ping-pong in one pair of worker processes: the fast plans interleaved
    in ``config.fast_rounds`` rounds, then the slow ones once each. Lock names are ``stem`` +
    the plan's key + the round; ``observer`` is the server whose ``INFO commandstats`` counts
    the commands; with ``cluster`` the workers use a ``RedisCluster`` client. Returns the
    tallies by plan key and the check that CLOCK_MONOTONIC is shared between processes.
    """
    tallies = {plan.key: Tally(plan) for plan in plans}
    log(f"{tag}: starting 2 worker processes ({', '.join(p.key for p in plans)})")
    pair = _Pair()
    clock: dict[str, Any] = {}
    seed = 0
    try:
        clock = pair.clock_check()
        if not clock["shared"]:
            log(
                f"{tag}: CLOCK_MONOTONIC does not look shared between processes — "
                "latencies are suspect",
                style="bold red",
            )

        def attempt(
            tally: Tally, handoffs: int, warmup: int, round_tag: str, traced: bool = False
        ) -> None:
            nonlocal pair, seed
            if tally.error:
                return
            seed += 1
            started = time.monotonic()
            try:
                _run_once(
                    pair,
                    tally,
                    url,
                    f"{stem}{tally.plan.key}:{round_tag}",
                    handoffs,
                    warmup,
                    config,
                    seed,
                    observer,
                    cluster,
                    traced,
                )
            except WorkerError as exc:
                tally.error = str(exc)
                log(f"{tag}: {tally.plan.label}: {exc}", style="red")
                pair.close()
                pair = _Pair()
                return
            log(
                f"{tag}: {tally.plan.label}: {handoffs} handoffs"
                f"{' (traced)' if traced else ''} in {time.monotonic() - started:.1f} s"
            )

        fast = [tallies[p.key] for p in plans if not p.slow]
        slow = [tallies[p.key] for p in plans if p.slow]
        per_round = max(1, config.fast_handoffs // config.fast_rounds)
        for round_index in range(config.fast_rounds):
            for tally in fast:
                attempt(tally, per_round, config.warmup_fast, f"r{round_index}")
            for tally in fast:
                if tally.plan.key in TRACED:
                    attempt(tally, per_round, config.warmup_fast, f"r{round_index}t", True)
        for tally in slow:
            expected = config.slow_handoffs * (config.hold_base_s + tally.plan.jitter_s * 1.5)
            log(
                f"{tag}: {tally.plan.label}: {config.slow_handoffs} handoffs "
                f"(about {expected:.0f} s)…"
            )
            attempt(tally, config.slow_handoffs, config.warmup_slow, "slow")
    finally:
        pair.close()
    return tallies, clock


def handoff_rows(tallies: dict[str, Tally], log: Log, tag: str) -> list[dict[str, Any]]:
    """One JSON-ready row per plan, with its ratios to the ``floor`` plan's median and p99."""
    floor_ref = _row(tallies["floor"], None).get("summary")
    rows = [_row(tally, floor_ref) for tally in tallies.values()]
    for row in rows:
        if "summary" in row:
            log(
                f"{tag}: {row['label']:<44} median {row['summary']['median_us'] / 1000:8.3f} ms  "
                f"p99 {row['summary']['p99_us'] / 1000:8.3f} ms  "
                f"= {row.get('ratio_median')} / {row.get('ratio_p99')} x floor"
            )
    return rows


def handoff_failures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What fails the run: no floor, an error of ours, a handoff of ours acquired before the
    release began, fencing tokens of ours that did not increase."""
    fatal = [
        r["label"] + ": " + str(r.get("error"))
        for r in rows
        if (r["key"] == "floor" or is_ours(r["key"])) and "error" in r
    ]
    fatal += [
        f"{r['label']}: {r['exclusion_violations']} handoffs acquired before the release began"
        for r in rows
        if is_ours(r["key"]) and r.get("exclusion_violations")
    ]
    fatal += [
        f"{r['label']}: fencing tokens did not increase on every handoff"
        for r in rows
        if is_ours(r["key"]) and r.get("fencing_tokens_increase") is False
    ]
    return fatal


def within(row: dict[str, Any], limit: float) -> bool:
    """Both the row's median and p99 ratios are at most ``limit``."""
    median, p99 = row.get("ratio_median"), row.get("ratio_p99")
    return median is not None and p99 is not None and median <= limit and p99 <= limit


def run(url: str, prefix: str, *, quick: bool, log: Log) -> dict[str, Any]:
    """Run B2 and return its JSON-ready result."""
    config = QUICK if quick else FULL
    plans = [p for p in PLANS if not p.requires or available(p.requires)]
    skipped = {p.key: "not available" for p in PLANS if p not in plans}
    observer = redis.Redis.from_url(url)
    try:
        tallies, clock = measure(url, f"{prefix}b2:", plans, config, observer, log)
    finally:
        observer.close()
    rows = handoff_rows(tallies, log, "B2")
    ours = next((r for r in rows if r["key"] == OURS), {})
    fair = next((r for r in rows if r["key"] == FAIR), {})
    prl = next((r for r in rows if r["key"] == "python-redis-lock" and "summary" in r), None)
    vs_prl = (
        ratio(ours["summary"]["median_us"], prl["summary"]["median_us"])
        if prl is not None and "summary" in ours
        else None
    )
    faster = vs_prl is not None and vs_prl < 1.0
    lock_met = within(ours, TARGET) and faster
    fair_met = within(fair, FAIR_TARGET)
    fatal = handoff_failures(rows)
    return {
        "scenario": "B2",
        "title": "Cross-process handoff to a waiting task",
        "config": {
            "fast_handoffs": config.fast_handoffs,
            "slow_handoffs": config.slow_handoffs,
            "fast_rounds": config.fast_rounds,
            "hold_base_ms": config.hold_base_s * 1000,
        },
        "clock_check": clock,
        "reference": "one-hop floor (RPUSH/BLPOP ping-pong), same run",
        "rows": rows,
        "skipped": skipped,
        "target": {
            "text": f"Lock ≤ {TARGET} x floor (median and p99) and faster than "
            f"python-redis-lock (median); FairLock ≤ {FAIR_TARGET} x floor (median and p99)",
            "limit": TARGET,
            "fair_limit": FAIR_TARGET,
            "value": [ours.get("ratio_median"), ours.get("ratio_p99"), vs_prl],
            "fair_value": [fair.get("ratio_median"), fair.get("ratio_p99")],
            "value_text": f"Lock {fmt_ratio(ours.get('ratio_median'))} / "
            f"{fmt_ratio(ours.get('ratio_p99'))} x floor, "
            f"{fmt_ratio(vs_prl)} x python-redis-lock — {'met' if lock_met else 'not met'}; "
            f"FairLock {fmt_ratio(fair.get('ratio_median'))} / "
            f"{fmt_ratio(fair.get('ratio_p99'))} x floor — {'met' if fair_met else 'not met'}",
            "met": lock_met and fair_met,
            "lock_met": lock_met,
            "fair_met": fair_met,
        },
        "failed": bool(fatal),
        "failures": fatal,
    }
