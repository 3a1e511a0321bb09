"""Worker processes (``python -m tests._lockworker``) for the cross-process tests, and what
they print: start one, read its lines, run several contending workers and check their holds."""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Protocol

__all__ = ("Hold", "Spawn", "assert_exclusive", "contend", "readline", "worker_process")

REPO = Path(__file__).resolve().parent.parent

Hold = tuple[int, int, int]  # start ns, end ns, fencing token


class Spawn(Protocol):
    """``await spawn(name, *worker args)``: a started ``tests._lockworker`` process."""

    def __call__(
        self, name: str, *args: str, stdin: int | None = None
    ) -> Awaitable[asyncio.subprocess.Process]: ...


async def worker_process(
    url: str, name: str, *args: str, stdin: int | None = None, redlock: bool = False
) -> asyncio.subprocess.Process:
    """A worker on the server at ``url`` (with ``redlock``: comma-separated masters' URLs)."""
    where = "--redlock" if redlock else "--url"
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests._lockworker", where, url, "--name", name, *args,
        stdin=stdin, stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip


async def reap(procs: Sequence[asyncio.subprocess.Process], within: float = 10.0) -> None:
    """Kill the workers of ``procs`` still running, and collect every one (its output read to
    the end, each within ``within`` seconds): a test's teardown."""
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.communicate(), within)


async def readline(proc: asyncio.subprocess.Process, within: float = 15.0) -> str:
    """The next line the worker prints (fails if it ends or stays silent)."""
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), within)
    assert line, f"worker exited (status {proc.returncode}) without a line"
    return line.decode().strip()


async def contend(
    spawn: Spawn, name: str, kinds: Sequence[str], *, tasks: int, rounds: int, **opts: str
) -> list[list[Hold]]:
    """One contending worker per entry of ``kinds`` (``tests._lockworker contend``), started
    together; the holds each one recorded. Workers still running on the way out are killed."""
    options = [f"--{key.replace('_', '-')}={value}" for key, value in opts.items()]
    workers = []
    try:
        for kind in kinds:
            args = ("--lease", "5", "--kind", kind, *options, "contend")
            args += ("--tasks", str(tasks), "--rounds", str(rounds), "--stay-ms", "3")
            workers.append(await spawn(name, *args, stdin=asyncio.subprocess.PIPE))
        for proc in workers:
            assert await readline(proc) == "ready"
        for proc in workers:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
            proc.stdin.close()
        outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in workers)), 40)
    finally:
        for proc in workers:
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()
    holds: list[list[Hold]] = []
    for proc, (out, _) in zip(workers, outputs, strict=True):
        lines = out.decode().splitlines()
        assert proc.returncode == 0 and lines and lines[-1] == "done", out
        mine = [(int(a), int(b), int(c)) for _, a, b, c in (line.split() for line in lines[:-1])]
        assert len(mine) == tasks * rounds
        holds.append(mine)
    return holds


def assert_exclusive(holds: list[Hold]) -> None:
    """No two holds overlap, and tokens strictly increase in the order of the holds."""
    ordered = sorted(holds)
    for (_, end, token), (start, _, later) in itertools.pairwise(ordered):
        assert end < start, f"holds overlap: token {token} and token {later}"
        assert token < later, f"token {later} came after {token}"
