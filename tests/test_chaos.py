"""S1 — exclusion under faults, with a fenced resource (SPEC §6 S1, S2).

Several worker processes (``tests/_lockworker.py chaos``), several tasks each, contend for one
``Lock`` on a private server while the test injects, at once and repeatedly:

* random task cancellations (inside the workers: in ``acquire`` or in the hold);
* ``CLIENT KILL TYPE pubsub`` (every waiter's wake-up connection) and ``SCRIPT FLUSH``;
* a holder that stops with SIGSTOP right after its first write; the test lets it sleep past
  its lease until another process has written a higher token to the resource, then SIGCONTs it:
  its late write must be **rejected** by the fence;
* a holder that keeps the lock until the test SIGKILLs its process: a waiter must take over
  within lease + 1 s of the kill (S2);
* a server restart (no persistence: every lock and fence record is gone; the tokens must still
  rise, floored by the server's clock).

Every hold is recorded by its process as it happens (``begin``/``end`` on the machine-wide
``time.monotonic_ns`` clock, with its fencing token), as is every write to the fenced resource —
a file keeping the highest token it accepted and refusing lower ones (``fenced_write``).

A hold is **valid** until it ends, except that a hold of a stopped process is valid only until
its lease ends by its own conservative clock (``Lease.remaining()`` when it stopped), a hold
whose loss was signalled (``LockLostError``: a renewal came too late, on a loaded machine) until
the latest lease end its holder saw, a hold of a killed process until the kill, and a hold that
spans the server restart until the restart began (the server forgot it). Asserted: no two valid
holds overlap; tokens strictly increase in the order holds began; every write the fence
rejected came from a hold past its validity, and the stopped holder's late write was rejected;
the killed holder's lock went to a waiter within lease + 1 s; every process finished.

Bounded for CI (about 20 s of contention); ``REDIS_LOCKS_CHAOS_SECONDS=300`` runs longer by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.servers import ServerFactory

REPO = Path(__file__).resolve().parent.parent
SECONDS = float(os.environ.get("REDIS_LOCKS_CHAOS_SECONDS", "20"))
LEASE = 2.0  # seconds; renewals every 0.67 s survive a loaded 2-core machine
PROCESSES, TASKS = 3, 3
NS = 1_000_000_000


@dataclass
class Hold:
    pid: int
    start: int
    token: int
    seen_valid: int  # the latest lease end the holder saw (VALID of its begin/write lines)
    end: int | None = None  # None: the process died holding it
    lost: bool = False  # the holder was told its lease was lost (LockLostError)
    valid_end: int = 0  # filled in by the analysis


@dataclass
class Run:
    """What the workers reported, and what the test did to them."""

    holds: dict[tuple[int, int], Hold] = field(default_factory=dict)  # (pid, start)
    by_token: dict[int, Hold] = field(default_factory=dict)
    writes: list[tuple[int, int, int, bool]] = field(default_factory=list)  # pid, token, t, ok
    stopped: dict[int, tuple[int, int]] = field(default_factory=dict)  # pid -> (valid, token)
    killed: dict[int, int] = field(default_factory=dict)  # pid -> t of SIGKILL
    restarts: list[tuple[int, int]] = field(default_factory=list)  # (began, ready)
    faults: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    late_write_rejected: bool = False

    def count(self, fault: str, n: int = 1) -> None:
        self.faults[fault] = self.faults.get(fault, 0) + n


def _fault_args(index: int) -> list[str]:
    if index == 0:
        return ["--pause-at", "4"]  # a holder stops itself past its lease
    if index == 1:
        return ["--stick-at", "7"]  # a holder the test SIGKILLs
    return []


async def _follow(
    proc: asyncio.subprocess.Process,
    run: Run,
    written: asyncio.Condition,
) -> None:
    """Record every line of one worker; act on ``stopping`` (SIGCONT later) and ``stuck``."""
    assert proc.stdout is not None
    async for raw in proc.stdout:
        word, *rest = raw.decode().split()
        if word == "begin":
            pid, start, token, valid = map(int, rest)
            run.holds[pid, start] = run.by_token[token] = Hold(pid, start, token, valid)
        elif word == "end":
            pid, start, end, _token = map(int, rest)
            run.holds[pid, start].end = end
        elif word == "write":
            pid, token, at = map(int, rest[:3])
            run.writes.append((pid, token, at, rest[3] == "ok"))
            hold = run.by_token[token]
            hold.seen_valid = max(hold.seen_valid, int(rest[4]))
            async with written:
                written.notify_all()
        elif word == "stopping":
            pid, _at, token, valid = map(int, rest)
            run.stopped[pid] = (valid, token)
            run.count("SIGSTOP of a holder")
            asyncio.get_running_loop().create_task(_continue_later(proc, pid, token, run, written))
        elif word == "stuck":
            proc.send_signal(signal.SIGKILL)
            run.killed[int(rest[0])] = time.monotonic_ns()
            run.count("SIGKILL of a holder")
        elif word == "error":
            run.errors[rest[1]] = run.errors.get(rest[1], 0) + 1
        elif word == "lost":
            run.errors["LockLostError"] = run.errors.get("LockLostError", 0) + 1
            if rest[1].isdigit():
                run.by_token[int(rest[1])].lost = True
        elif word == "done":
            run.done.add(int(rest[0]))


async def _continue_later(
    proc: asyncio.subprocess.Process, pid: int, token: int, run: Run, written: asyncio.Condition
) -> None:
    """SIGCONT a stopped holder once another process wrote a higher token (so its lease is
    certainly over and its late write must be rejected)."""

    def overtaken() -> bool:
        return any(p != pid and t > token and ok for p, t, _, ok in run.writes)

    async with written:
        await asyncio.wait_for(written.wait_for(overtaken), LEASE + 10)
    await asyncio.sleep(0.1)
    proc.send_signal(signal.SIGCONT)


async def _inject(server_url: str, run: Run, restart: asyncio.Event, stop: asyncio.Event) -> None:
    """Pub/sub kills and script flushes at random moments, every 0.5 to 1.5 s."""
    admin = aioredis.Redis.from_url(server_url, socket_timeout=2)
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), random.uniform(0.5, 1.5))
            if stop.is_set() or restart.is_set():
                continue
            try:
                if random.random() < 0.5:
                    killed = await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")  # type: ignore[no-untyped-call]
                    run.count("CLIENT KILL TYPE pubsub")
                    run.count("pub/sub connections killed", int(killed))
                else:
                    await admin.script_flush()
                    run.count("SCRIPT FLUSH")
            except (OSError, RedisConnectionError, RedisTimeoutError):
                pass  # the server is restarting
    finally:
        await admin.aclose()


def _analyse(run: Run) -> list[Hold]:
    """Give every hold its validity end (module docstring); holds sorted by start."""
    holds = sorted(run.holds.values(), key=lambda h: h.start)
    for hold in holds:
        ends = [hold.end if hold.end is not None else run.killed.get(hold.pid, 0)]
        if hold.lost:
            ends.append(hold.seen_valid)
        if hold.pid in run.stopped:
            valid, token = run.stopped[hold.pid]
            if token == hold.token:
                ends.append(valid)
        for began, _ready in run.restarts:
            if hold.start < began:
                ends.append(max(hold.start, began))
        hold.valid_end = min(ends)
    return holds


async def _worker(url: str, name: str, fence: Path, index: int) -> asyncio.subprocess.Process:
    """Start one chaos worker; its log (warnings of the library) goes next to the resource."""
    with (fence.parent / f"worker-{index}.log").open("wb") as log:
        return await _spawn(url, name, fence, index, log.fileno())


async def _spawn(
    url: str, name: str, fence: Path, index: int, log: int
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests._lockworker", "--url", url, "--name", name,
        "--lease", str(LEASE), "chaos", "--tasks", str(TASKS), "--seconds", str(SECONDS),
        "--fence", str(fence), "--cancel-rate", "0.25", *_fault_args(index),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log, cwd=REPO,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 90)
async def test_exclusion_under_faults(server_factory: ServerFactory, tmp_path: Path) -> None:
    server = server_factory()
    name = "chaos:orders"
    fence = tmp_path / "fenced-resource"
    fence.write_text("")
    run = Run()
    written = asyncio.Condition()
    workers = [await _worker(server.url, name, fence, index) for index in range(PROCESSES)]
    stop, restarting = asyncio.Event(), asyncio.Event()
    followers: list[asyncio.Task[None]] = []
    injector: asyncio.Task[None] | None = None
    try:
        for proc in workers:
            assert proc.stdout is not None and proc.stdin is not None
            assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"ready\n"
        for proc in workers:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            proc.stdin.close()
        followers = [asyncio.create_task(_follow(proc, run, written)) for proc in workers]
        injector = asyncio.create_task(_inject(server.url, run, restarting, stop))

        await asyncio.sleep(SECONDS * 0.6)
        restarting.set()
        began = time.monotonic_ns()
        await asyncio.to_thread(server.restart)
        run.restarts.append((began, time.monotonic_ns()))
        run.count("server restart")
        restarting.clear()

        await asyncio.wait_for(
            asyncio.gather(*(proc.wait() for proc in workers)), SECONDS * 0.4 + LEASE * 4 + 30
        )
        await asyncio.wait_for(asyncio.gather(*followers), 10)
    finally:
        stop.set()
        if injector is not None:
            await injector
        for proc in workers:
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                await proc.wait()
        for task in followers:
            task.cancel()

    holds = _analyse(run)
    killed = set(run.killed)
    pids = {proc.pid for proc in workers}
    assert run.done == pids - killed, f"workers that did not finish: {pids - killed - run.done}"
    assert killed and run.stopped, f"the faults did not all happen: {run.faults}"

    # Exclusion: no two valid holds overlap.
    latest: Hold | None = None
    for hold in holds:
        if latest is not None:
            assert hold.start > latest.valid_end, (
                f"valid holds overlap: token {latest.token} (pid {latest.pid}) until "
                f"{latest.valid_end}, token {hold.token} (pid {hold.pid}) from {hold.start}"
            )
        if latest is None or hold.valid_end > latest.valid_end:
            latest = hold
    # Fencing tokens strictly increase in the order holds began (also across the restart).
    tokens = [hold.token for hold in holds]
    assert all(a < b for a, b in itertools.pairwise(tokens)), "fencing tokens did not increase"

    # Every rejected write came from a hold past its validity; the stopped holder's did happen.
    by_token = {hold.token: hold for hold in holds}
    rejected = [(pid, token, at) for pid, token, at, ok in run.writes if not ok]
    for pid, token, at in rejected:
        hold = by_token[token]
        assert at > hold.valid_end, f"a valid hold's write (token {token}, pid {pid}) was rejected"
    (stopped_pid,) = run.stopped
    stopped_token = run.stopped[stopped_pid][1]
    assert any(token == stopped_token for _, token, _ in rejected), (
        "the stopped holder's late write was not rejected"
    )

    # Liveness (S2): after the SIGKILL, another process held the lock within lease + 1 s.
    for pid, at in run.killed.items():
        after = [h.start for h in holds if h.pid != pid and h.start > at]
        assert after, "nobody acquired after the holder was killed"
        assert after[0] - at <= (LEASE + 1.0) * NS, (
            f"a waiter took over {(after[0] - at) / NS:.2f} s after the holder's SIGKILL"
        )

    print(
        f"\nS1 chaos: {len(holds)} holds ({sum(h.valid_end < (h.end or 0) for h in holds)} "
        f"outlived their validity), {len(run.writes)} fenced writes, {len(rejected)} rejected; "
        f"faults {run.faults}; errors seen by workers {run.errors}"
    )
