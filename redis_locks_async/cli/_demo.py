"""``python -m redis_locks_async demo``: worker processes contend for locks; the parent checks.

What runs: ``workers`` processes (spawned, so nothing is shared but the server), each running
``tasks`` asyncio tasks that loop for ``seconds``: pick a lock (one hot lock gets most of the
traffic, two others the rest), ``async with lock as lease:``, do a few milliseconds of work,
release. The parent starts them together, shows live progress, and verifies afterwards.

How exclusion is verified, independently of the lock's own bookkeeping:

* **inside counter**: each entering holder ``INCR``\\s a per-lock counter and must read 1; it
  ``DECR``\\s it before releasing. A second holder inside would read 2 (counted live as a
  violation);
* **hold intervals**: every hold is recorded as (token, acquired, released) with
  ``time.monotonic_ns()`` taken just after the acquisition returned and just before the release
  was sent — both inside the real hold, and on one clock, since ``CLOCK_MONOTONIC`` is
  system-wide on Linux and every worker runs on this machine. Sorted by acquisition time, no
  interval may overlap the next;
* **fencing**: each holder presents its fencing token to a "fenced resource" (a tiny script that
  remembers the highest token it accepted and rejects anything not higher), and afterwards the
  tokens, ordered by acquisition time, must be strictly increasing.

Handoff latency is the time from a release (just before it was sent) to the next acquisition
returning in a task of *another process* that was already waiting then — the cost a contended
lock adds on top of the work it protects. Successive fencing tokens identify the pairs.

Exit codes: 0 when no violation was seen, 1 on a violation or a worker failure, 2 when the demo
could not run (no server), 130 when interrupted. Ctrl-C (or SIGTERM) stops the workers first,
then the embedded server; every demo key written to a server given with ``--url`` is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import random
import secrets
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Final, TextIO

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from .._errors import LockError, LockTimeout
from .._keys import LockKeys
from .._lock import Lock
from ._inspect import redacted, scrubbed
from ._server import ServerUnavailableError, die_with_parent, embedded_server

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess
    from multiprocessing.synchronize import Event

    from rich.console import Console, RenderableType

__all__ = ("DemoOptions", "run_demo")

#: Which lock a task picks: the hot one most of the time.
_LOCKS: Final = (("hot", 0.6), ("warm-1", 0.2), ("warm-2", 0.2))
_WORK_SECONDS: Final = (0.001, 0.004)  # the "work" inside each hold: a sleep in this range
_LEASE: Final = 10.0  # far above any hold: a lost lease here would be a finding, not noise
_WAIT_SLICE: Final = 0.5  # acquire timeout, so a stopping worker never waits long
_READY_TIMEOUT: Final = 60.0  # spawning workers on a loaded 2-core machine can be slow
_STOP_GRACE: Final = 5.0  # after the deadline: time for workers to finish their last hold
_KEY_TTL: Final = 3600  # safety net for a demo killed before it could clean up
_REFRESH: Final = 0.2

# The fenced resource: accept a token only if it is higher than every token seen before.
# Returns 0 when accepted, else the highest token seen (the write would be refused).
_FENCED_WRITE: Final = """
local seen = tonumber(redis.call('GET', KEYS[1]) or '0')
local token = tonumber(ARGV[1])
if token <= seen then
    return seen
end
redis.call('SET', KEYS[1], token, 'EX', ARGV[2])
return 0
"""


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``demo`` was asked to do (the CLI's options)."""

    workers: int = 4
    tasks: int = 3
    seconds: float = 10.0
    url: str | None = None


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything a worker process needs (pickled into it)."""

    url: str
    run_id: str
    workers: int
    tasks: int
    seconds: float

    @property
    def prefix(self) -> str:
        return f"rla-demo:{self.run_id}"

    def lock_name(self, short: str) -> str:
        return f"{self.prefix}:{short}"

    @property
    def stats_key(self) -> str:
        return f"{self.prefix}:stats"

    @property
    def violations_key(self) -> str:
        return f"{self.prefix}:violations"

    @property
    def errors_key(self) -> str:
        return f"{self.prefix}:errors"

    @property
    def ready_key(self) -> str:
        return f"{self.prefix}:ready"

    def inside_key(self, short: str) -> str:
        return f"{self.prefix}:inside:{short}"

    def holder_key(self, short: str) -> str:
        return f"{self.prefix}:holder:{short}"

    def fenced_key(self, short: str) -> str:
        return f"{self.prefix}:fenced:{short}"

    def holds_key(self, short: str) -> str:
        return f"{self.prefix}:holds:{short}"

    def expiring_keys(self) -> list[str]:
        """The demo's own keys (the locks' keys expire by themselves)."""
        keys = [self.stats_key, self.violations_key, self.errors_key, self.ready_key]
        for short, _ in _LOCKS:
            keys += [
                self.inside_key(short),
                self.holder_key(short),
                self.fenced_key(short),
                self.holds_key(short),
            ]
        return keys

    def all_keys(self) -> list[str | bytes]:
        """Every key a run may leave behind."""
        keys: list[str | bytes] = list(self.expiring_keys())
        for short, _ in _LOCKS:
            keys += LockKeys.for_name(self.lock_name(short)).script_keys
        return keys


# ------------------------------------------------------------------------------------------
# Worker processes
# ------------------------------------------------------------------------------------------


def _worker_main(index: int, plan: _Plan, go: Event, stop: Event) -> None:
    """Entry point of one worker process."""
    # Ctrl-C in a terminal reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()  # a parent killed outright must not leave workers running
    try:
        asyncio.run(_worker(index, plan, go, stop))
    except Exception:
        text = traceback.format_exc()
        print(f"demo worker w{index} failed:\n{text}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            redis.Redis.from_url(plan.url).rpush(plan.errors_key, f"w{index}: {text}")
        raise SystemExit(1) from None


async def _worker(index: int, plan: _Plan, go: Event, stop: Event) -> None:
    client = aioredis.Redis.from_url(plan.url)
    try:
        locks = {
            short: Lock(client, plan.lock_name(short), lease=_LEASE, timeout=_WAIT_SLICE)
            for short, _ in _LOCKS
        }
        await client.incr(plan.ready_key)
        while not go.is_set():  # polled, so that a stop before the start is seen too
            if stop.is_set():
                return
            await asyncio.sleep(0.005)
        deadline = time.monotonic() + plan.seconds
        stopping = asyncio.Event()
        tasks = [
            asyncio.create_task(_contend(client, plan, locks, f"w{index}", t, stopping))
            for t in range(plan.tasks)
        ]
        while time.monotonic() < deadline and not stop.is_set():
            left = max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait(
                tasks, timeout=min(0.05, left), return_when=asyncio.FIRST_EXCEPTION
            )
            if any(not t.cancelled() and t.exception() is not None for t in done):
                break
        stopping.set()
        await asyncio.gather(*tasks)
    finally:
        await client.aclose()


async def _contend(
    client: aioredis.Redis,
    plan: _Plan,
    locks: dict[str, Lock],
    worker: str,
    task_index: int,
    stopping: asyncio.Event,
) -> None:
    """One task's loop: pick a lock, hold it for a few ms with the checks around, release."""
    rng = random.Random()
    me = f"{worker}/t{task_index}"
    shorts = [short for short, _ in _LOCKS]
    weights = [weight for _, weight in _LOCKS]
    while not stopping.is_set():
        short = rng.choices(shorts, weights)[0]
        waited_from = time.monotonic_ns()
        try:
            async with locks[short] as lease:
                acquired = time.monotonic_ns()
                token = lease.fencing_token
                await _enter(client, plan, short, me, token)
                await asyncio.sleep(rng.uniform(*_WORK_SECONDS))
                await client.decr(plan.inside_key(short))
                released = time.monotonic_ns()
        except LockTimeout:
            await client.hincrby(plan.stats_key, f"{worker}:timeouts", 1)
            continue
        except LockError as exc:
            # A lease lost or a failed release is not expected here: report it, keep going.
            await client.hincrby(plan.stats_key, f"{worker}:errors", 1)
            await client.rpush(plan.errors_key, f"{me} on {short}: {exc!r}")
            continue
        record = f"{token} {acquired} {released} {waited_from} {worker} {task_index}"
        pipe = client.pipeline(transaction=False)
        pipe.rpush(plan.holds_key(short), record)
        pipe.hincrby(plan.stats_key, worker, 1)
        pipe.hincrby(plan.stats_key, f"lock:{short}", 1)
        await pipe.execute()


async def _enter(client: aioredis.Redis, plan: _Plan, short: str, me: str, token: int) -> None:
    """The independent checks on entry: the inside counter and the fenced resource."""
    pipe = client.pipeline(transaction=False)
    pipe.incr(plan.inside_key(short))
    pipe.eval(_FENCED_WRITE, 1, plan.fenced_key(short), token, _KEY_TTL)
    pipe.set(plan.holder_key(short), f"{me} #{token}", ex=_KEY_TTL)
    inside, refused_by, _ = await pipe.execute()
    if int(inside) != 1:
        await client.hincrby(plan.violations_key, "exclusion", 1)
        await client.rpush(
            plan.errors_key,
            f"{me} entered {short} with token {token} while {inside - 1} "
            "other holder(s) were inside",
        )
    if int(refused_by) != 0:
        await client.hincrby(plan.violations_key, "fencing", 1)
        await client.rpush(
            plan.errors_key, f"{me} on {short}: token {token} refused, {refused_by} seen before"
        )


# ------------------------------------------------------------------------------------------
# Analysis
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Hold:
    token: int
    acquired: int
    released: int
    waited_from: int
    worker: str


@dataclass(slots=True)
class _Findings:
    holds: int = 0
    per_lock: dict[str, int] = field(default_factory=dict)
    overlaps: int = 0
    live_exclusion: int = 0
    live_fencing: int = 0
    token_disorder: int = 0
    handoffs_ms: list[float] = field(default_factory=list)

    @property
    def exclusion_violations(self) -> int:
        return self.overlaps + self.live_exclusion

    @property
    def fencing_violations(self) -> int:
        return self.token_disorder + self.live_fencing


def _parse_holds(raw: Sequence[bytes]) -> list[_Hold]:
    holds = []
    for item in raw:
        token, acquired, released, waited_from, worker, _task = item.decode().split()
        holds.append(_Hold(int(token), int(acquired), int(released), int(waited_from), worker))
    return holds


def _analyse(per_lock: dict[str, list[_Hold]], violations: dict[str, int]) -> _Findings:
    found = _Findings(
        live_exclusion=violations.get("exclusion", 0), live_fencing=violations.get("fencing", 0)
    )
    for short, holds in per_lock.items():
        found.holds += len(holds)
        found.per_lock[short] = len(holds)
        by_time = sorted(holds, key=lambda h: h.acquired)
        for before, after in itertools.pairwise(by_time):
            if after.acquired < before.released:
                found.overlaps += 1
            if after.token <= before.token:
                found.token_disorder += 1
        by_token = sorted(holds, key=lambda h: h.token)
        for before, after in itertools.pairwise(by_token):
            # Only a direct successor (tokens only grow, so the next one in token order), in
            # another process, already waiting at the release.
            if after.waited_from <= before.released and after.worker != before.worker:
                found.handoffs_ms.append((after.acquired - before.released) / 1e6)
    return found


def _percentiles(values: list[float]) -> tuple[float, float, float] | None:
    if len(values) < 2:
        return None
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return statistics.median(values), cuts[89], cuts[98]


# ------------------------------------------------------------------------------------------
# Live view
# ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Snapshot:
    elapsed: float
    per_worker: dict[str, int]
    timeouts: dict[str, int]
    per_lock: dict[str, int]
    holders: dict[str, str]
    violations: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.per_worker.values())


def _snapshot(client: redis.Redis, plan: _Plan, elapsed: float) -> _Snapshot:
    pipe = client.pipeline(transaction=False)
    for key in plan.expiring_keys():
        # A safety net on a shared server: keys of a demo killed outright expire in time.
        pipe.expire(key, _KEY_TTL)
    pipe.hgetall(plan.stats_key)
    pipe.hgetall(plan.violations_key)
    for short, _ in _LOCKS:
        pipe.get(plan.holder_key(short))
    replies = pipe.execute()[len(plan.expiring_keys()) :]
    stats_raw, violations_raw, *holders_raw = replies
    stats = {k.decode(): int(v) for k, v in stats_raw.items()}
    holders = {
        short: holder.decode() if holder is not None else ""
        for (short, _), holder in zip(_LOCKS, holders_raw, strict=True)
    }
    workers = [f"w{i}" for i in range(plan.workers)]
    return _Snapshot(
        elapsed=elapsed,
        per_worker={w: stats.get(w, 0) for w in workers},
        timeouts={w: stats.get(f"{w}:timeouts", 0) for w in workers},
        per_lock={short: stats.get(f"lock:{short}", 0) for short, _ in _LOCKS},
        holders=holders,
        violations={k.decode(): int(v) for k, v in violations_raw.items()},
    )


class _View:
    """Progress output: a rich live table on a terminal, periodic plain lines otherwise."""

    def __init__(self, out: TextIO, title: str, plan: _Plan) -> None:
        self._out = out
        self._title = title
        self._plan = plan
        self._last_line = 0.0
        self._console: Console | None = None
        if out.isatty():
            with contextlib.suppress(ImportError):  # rich is optional (the demo extra)
                from rich.console import Console

                self._console = Console(file=out, highlight=False)

    @property
    def rich(self) -> bool:
        return self._console is not None

    @contextlib.contextmanager
    def running(self) -> Iterator[Callable[[_Snapshot], None]]:
        """Context in which the returned callable shows a snapshot."""
        if self._console is None:
            self.say(self._title)
            yield self._plain
            return
        from rich.live import Live

        with Live(console=self._console, refresh_per_second=8, transient=False) as live:
            yield lambda snap: live.update(self._render(snap))

    def say(self, text: str, style: str = "") -> None:
        """Print one line (styled on a terminal)."""
        if self._console is not None:
            self._console.print(text, style=style or None, markup=False)
        else:
            print(text, file=self._out, flush=True)

    def _plain(self, snap: _Snapshot) -> None:
        if snap.elapsed - self._last_line < 1.0:
            return
        self._last_line = snap.elapsed
        workers = " ".join(f"{w}={n}" for w, n in snap.per_worker.items())
        bad = sum(snap.violations.values())
        print(
            f"[{snap.elapsed:5.1f}s/{self._plan.seconds:g}s] acquisitions {snap.total} "
            f"({workers}), violations {bad}",
            file=self._out,
            flush=True,
        )

    def _render(self, snap: _Snapshot) -> RenderableType:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        seconds = self._plan.seconds
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            ProgressBar(total=seconds, completed=min(snap.elapsed, seconds), width=40),
            Text(f"{min(snap.elapsed, seconds):4.1f} / {seconds:g} s"),
        )
        workers = Table(title="workers", title_justify="left", expand=False)
        workers.add_column("worker")
        workers.add_column("acquisitions", justify="right")
        workers.add_column("share", justify="right")
        workers.add_column("timeouts", justify="right")
        for worker, count in snap.per_worker.items():
            share = f"{100 * count / snap.total:.0f}%" if snap.total else "-"
            workers.add_row(worker, str(count), share, str(snap.timeouts.get(worker, 0)))
        locks = Table(title="locks", title_justify="left", expand=False)
        locks.add_column("lock")
        locks.add_column("acquisitions", justify="right")
        locks.add_column("latest holder (task #token)")
        for short, _ in _LOCKS:
            locks.add_row(short, str(snap.per_lock.get(short, 0)), snap.holders.get(short) or "-")
        exclusion = snap.violations.get("exclusion", 0)
        fencing = snap.violations.get("fencing", 0)
        style = "bold red" if exclusion or fencing else "green"
        status = Text(
            f"acquisitions {snap.total} · violations so far: {exclusion} exclusion, "
            f"{fencing} fencing",
            style=style,
        )
        return Group(Text(self._title, style="bold"), bar, workers, locks, status)


# ------------------------------------------------------------------------------------------
# The parent
# ------------------------------------------------------------------------------------------


def run_demo(options: DemoOptions, out: TextIO | None = None) -> int:
    """Run the demo (see the module docstring); returns the process exit code.

    Uses ``options.url``, else ``$REDIS_URL``, else an embedded server started for the run.
    """
    stream = out if out is not None else sys.stdout
    with _stop_on_sigterm():
        resources = contextlib.ExitStack()
        try:
            url = options.url or os.environ.get("REDIS_URL") or None
            origin = "given"
            if url is None:
                try:
                    url = resources.enter_context(embedded_server())
                except ServerUnavailableError as exc:
                    print(f"demo: {exc}", file=sys.stderr)
                    return 2
                origin = "started for this demo"
            return _orchestrate(options, url, origin, stream)
        except KeyboardInterrupt:
            # Only reachable if the interrupt came before the workers were started.
            print("demo: interrupted", file=sys.stderr)
            return 130
        finally:
            with _interrupts_ignored():
                resources.close()  # stops the embedded server, if any


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so ``kill`` also gets an orderly shutdown."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """While cleaning up after Ctrl-C, a second Ctrl-C must not abandon processes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)


def _describe_server(client: redis.Redis) -> str:
    info = client.info("server")
    name = str(info.get("server_name") or "redis").capitalize()
    version = info.get("valkey_version") or info.get("redis_version") or "?"
    return f"{name} {version}"


def _orchestrate(options: DemoOptions, url: str, origin: str, out: TextIO) -> int:
    plan = _Plan(url, secrets.token_hex(4), options.workers, options.tasks, options.seconds)
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        server = _describe_server(client)
    except RedisError as exc:
        print(f"demo: cannot reach {redacted(url)}: {scrubbed(str(exc), url)}", file=sys.stderr)
        client.close()
        return 2
    title = (
        f"redis-locks-async demo: {plan.workers} processes x {plan.tasks} tasks, "
        f"{len(_LOCKS)} locks, {plan.seconds:g} s\n"
        f"server: {server} at {redacted(url)} ({origin})"
    )
    view = _View(out, title, plan)
    ctx = multiprocessing.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    procs: list[SpawnProcess] = [
        ctx.Process(target=_worker_main, args=(i, plan, go, stop), name=f"demo-w{i}", daemon=True)
        for i in range(plan.workers)
    ]
    interrupted = False
    started_at = time.monotonic()
    elapsed = 0.0
    try:
        try:
            for proc in procs:
                proc.start()
            with view.running() as show:
                _wait_ready(client, plan, procs)
                go.set()
                started_at = time.monotonic()
                deadline = started_at + plan.seconds + _STOP_GRACE
                while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                    elapsed = time.monotonic() - started_at
                    show(_snapshot(client, plan, elapsed))
                    time.sleep(_REFRESH)
                elapsed = min(time.monotonic() - started_at, plan.seconds)
                show(_snapshot(client, plan, elapsed))
        except KeyboardInterrupt:
            interrupted = True
            elapsed = time.monotonic() - started_at if go.is_set() else 0.0
            view.say("interrupted: stopping the workers, then the server", "yellow")
        finally:
            with _interrupts_ignored():
                stop.set()
                _reap(procs)
        with _interrupts_ignored():
            return _report(client, plan, procs, view, elapsed, interrupted)
    except _WorkersNotReady as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    except RedisError as exc:
        print(
            f"demo: lost the server at {redacted(url)}: {scrubbed(str(exc), url)}",
            file=sys.stderr,
        )
        return 1
    finally:
        with _interrupts_ignored(), contextlib.suppress(RedisError):
            client.delete(*plan.all_keys())
        client.close()


class _WorkersNotReady(Exception):
    pass


def _wait_ready(client: redis.Redis, plan: _Plan, procs: list[SpawnProcess]) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT
    while int(client.get(plan.ready_key) or 0) < plan.workers:
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise _WorkersNotReady(f"worker {dead[0].name} exited with code {dead[0].exitcode}")
        if time.monotonic() > deadline:
            raise _WorkersNotReady(f"workers not ready after {_READY_TIMEOUT:g} s")
        time.sleep(0.02)


def _reap(procs: list[SpawnProcess]) -> None:
    """Wait for workers to finish their last hold; terminate, then kill, stragglers."""
    deadline = time.monotonic() + _STOP_GRACE
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _report(
    client: redis.Redis,
    plan: _Plan,
    procs: list[SpawnProcess],
    view: _View,
    elapsed: float,
    interrupted: bool,
) -> int:
    pipe = client.pipeline(transaction=False)
    for short, _ in _LOCKS:
        pipe.lrange(plan.holds_key(short), 0, -1)
    pipe.hgetall(plan.violations_key)
    pipe.lrange(plan.errors_key, 0, 9)
    pipe.llen(plan.errors_key)
    pipe.hgetall(plan.stats_key)
    *raw_holds, violations_raw, errors_raw, errors_total, stats_raw = pipe.execute()
    per_lock = {short: _parse_holds(raw) for (short, _), raw in zip(_LOCKS, raw_holds, strict=True)}
    violations = {k.decode(): int(v) for k, v in violations_raw.items()}
    stats = {k.decode(): int(v) for k, v in stats_raw.items()}
    found = _analyse(per_lock, violations)
    failed = [p for p in procs if p.exitcode not in (0, None)]
    lock_errors = sum(v for k, v in stats.items() if k.endswith(":errors"))
    timeouts = sum(v for k, v in stats.items() if k.endswith(":timeouts"))

    rate = found.holds / elapsed if elapsed > 0 else 0.0
    lock_mix = ", ".join(f"{short} {n}" for short, n in found.per_lock.items())
    ok_exclusion = found.exclusion_violations == 0
    ok_fencing = found.fencing_violations == 0
    view.say("")
    view.say(f"total acquisitions     {found.holds} in {elapsed:.1f} s ({rate:.0f}/s)")
    view.say(f"  per lock             {lock_mix}")
    view.say(
        f"exclusion verified     {'yes' if ok_exclusion else 'NO'} "
        f"({found.live_exclusion} seen inside, {found.overlaps} overlapping intervals)",
        "green" if ok_exclusion else "bold red",
    )
    view.say(
        f"fencing tokens         monotonic: {'yes' if ok_fencing else 'NO'} "
        f"({found.live_fencing} refused, {found.token_disorder} out of order)",
        "green" if ok_fencing else "bold red",
    )
    cross = _percentiles(found.handoffs_ms)
    if not ok_exclusion:
        view.say("handoff latency        meaningless: holds overlapped")
    elif cross is None:
        view.say("handoff latency        not enough cross-process handoffs to measure")
    else:
        view.say(
            f"handoff latency        median {cross[0]:.2f} ms, p90 {cross[1]:.2f} ms, "
            f"p99 {cross[2]:.2f} ms (n={len(found.handoffs_ms)})"
        )
        view.say("                       release → next holder, a waiter in another process")
    view.say(f"acquire timeouts       {timeouts} (each wait is capped at {_WAIT_SLICE:g} s)")
    problems = []
    if failed:
        codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in failed)
        problems.append(f"worker process(es) failed ({codes})")
    if lock_errors:
        problems.append(f"{lock_errors} lock error(s)")
    if found.holds == 0 and not interrupted:
        problems.append("no acquisition at all")
    if errors_raw:
        view.say(f"first problems reported by the workers (of {errors_total}):", "red")
    for error in errors_raw:
        view.say(f"  ! {error.decode(errors='replace').strip()}", "red")

    violated = not (ok_exclusion and ok_fencing)
    if violated:
        broken = []
        if not ok_exclusion:
            broken.append("two holders were inside at once")
        if not ok_fencing:
            broken.append("fencing tokens went backwards")
        view.say(f"verdict: FAIL — {' and '.join(broken)}", "bold red")
        return 1
    if problems:
        view.say(f"verdict: FAIL — {'; '.join(problems)} (no violation seen)", "bold red")
        return 1
    if interrupted:
        view.say(
            f"verdict: interrupted after {elapsed:.1f} s — no violation in {found.holds} holds",
            "yellow",
        )
        return 130
    view.say(
        f"verdict: OK — never two holders at once in {found.holds} holds; tokens always rose",
        "bold green",
    )
    return 0
