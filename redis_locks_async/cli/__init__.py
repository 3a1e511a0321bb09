"""The tools around the library — command line, demo, throwaway server — kept apart from it.

``python -m redis_locks_async …`` (installed as ``redis-locks``) runs :func:`main`. The demo
lives in ``_demo``, the embedded server it (and the benchmarks and tests) start in ``_server``;
the operator's commands in ``_inspect`` (``inspect``, ``list``), ``_force`` (``force-unlock``)
and ``_bench`` (``bench``).

Each subcommand is one ``_add_<name>`` function that declares its options and sets ``handler``,
a function from the parsed arguments to an exit code; :func:`main` only dispatches. Handlers
import what they need lazily, so ``--help`` stays fast and an optional dependency of one
command (``rich`` for the demo) never breaks another.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Final

__all__ = ("main",)

PROG: Final = "redis-locks"
EXIT_ERROR: Final = 2  # what every command exits with on an error (bad arguments included)

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    for stream in (sys.stdout, sys.stderr):
        # A name the terminal's encoding cannot show (a C locale, say) is printed escaped
        # rather than crashing the command half-way with an exit code that means "not held".
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    parser = _build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except BrokenPipeError:
        # The reader of the output went away (`| head`): an error, not "not held"; the output
        # Python would still flush at exit goes nowhere instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR


def _build_parser() -> argparse.ArgumentParser:
    run_as_module = os.path.basename(sys.argv[0]) == "__main__.py"
    parser = argparse.ArgumentParser(
        prog="python -m redis_locks_async" if run_as_module else PROG,
        description="Asyncio-native distributed locks for Redis and Valkey: tools and demo.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_demo(commands)
    _add_inspect(commands)
    _add_list(commands)
    _add_force_unlock(commands)
    _add_bench(commands)
    return parser


def _default_url() -> str:
    return os.environ.get("REDIS_URL") or "redis://localhost:6379"


def _add_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=_default_url(),
        help="server to talk to (default: $REDIS_URL, else redis://localhost:6379)",
    )


def _add_kind(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kind",
        choices=("lock", "rw", "sem"),
        default=None,
        help="read NAME with this key layout: lock (Lock, FairLock), rw (ReadWriteLock), "
        "sem (Semaphore); default: detected from the keys",
    )


# argparse's subparsers action has no public type name: typeshed's private one is used.
def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="watch worker processes contend for locks; verifies exclusion",
        description=(
            "Start WORKERS processes of TASKS asyncio tasks each, contending for a hot lock and "
            "two others for SECONDS; show live progress; verify that no two holders ever "
            "overlapped and that fencing tokens only increased; print handoff latencies. "
            "Uses --url, else $REDIS_URL, else a throwaway server (redis-server on PATH or the "
            "bundled Valkey). Exit code 0: no violation; 1: a violation or a worker failure; "
            "2: no server; 130: interrupted."
        ),
    )
    demo.add_argument(
        "--workers", type=_count(1, 64), default=4, help="worker processes (default: 4)"
    )
    demo.add_argument(
        "--tasks", type=_count(1, 64), default=3, help="asyncio tasks per worker (default: 3)"
    )
    demo.add_argument(
        "--seconds", type=_duration, default=10.0, help="how long to contend (default: 10)"
    )
    demo.add_argument(
        "--url",
        default=None,
        help="server to use, e.g. redis://localhost:6379/0 (default: $REDIS_URL, else an "
        "embedded server); demo keys are prefixed rla-demo: and deleted afterwards",
    )
    demo.set_defaults(handler=_run_demo)


def _add_inspect(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="show who holds a lock, its lease, waiters and fencing token",
        description=(
            "Show the lock NAME as the server has it (one consistent snapshot): its kind, each "
            "holder (owner id, hold count with re-entries, lease left, fencing token), the "
            "waiters registered in Redis (one per waiting process for a Lock; every waiter for "
            "the other kinds), and the fence (the highest token recorded). Works for Lock, "
            "FairLock, ReadWriteLock and Semaphore; the kind is detected from the keys unless "
            "--kind is given. Exit code 0: held; 1: not held; 2: an error (not a lock, bad "
            "arguments, no server)."
        ),
    )
    inspect.add_argument("name", metavar="NAME", type=_lock_name, help="the lock's name")
    _add_kind(inspect)
    inspect.add_argument(
        "-v", "--verbose", action="store_true", help="list every waiter with its registration age"
    )
    inspect.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    _add_url(inspect)
    inspect.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from ._inspect import run_inspect

    return run_inspect(args)


def _add_list(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    listing = commands.add_parser(
        "list",
        help="list the held locks whose names match a pattern (SCAN, never KEYS)",
        description=(
            "Walk the keyspace with SCAN ... MATCH PATTERN (never KEYS, so the server is never "
            "blocked) and show every held lock of this library among the matches — kind, "
            "holders and the longest lease left — skipping other keys and the locks' auxiliary "
            "keys. Exit code 0: locks found; 1: none; 2: an error."
        ),
    )
    listing.add_argument(
        "pattern",
        metavar="PATTERN",
        type=_utf8,
        nargs="?",
        default="*",
        help="glob-style pattern of lock names, as for SCAN MATCH (default: *)",
    )
    listing.add_argument(
        "--count",
        type=_count(1, 100_000),
        default=100,
        help="keys SCAN looks at per call (its COUNT hint; default: 100)",
    )
    listing.add_argument(
        "--limit",
        type=_count(1, 1_000_000),
        default=1000,
        help="stop after this many locks (default: 1000)",
    )
    listing.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    _add_url(listing)
    listing.set_defaults(handler=_run_list)


def _run_list(args: argparse.Namespace) -> int:
    from ._inspect import run_list

    return run_list(args)


def _add_force_unlock(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    force = commands.add_parser(
        "force-unlock",
        help="free a lock whoever holds it (asks for confirmation)",
        description=(
            "Free the lock NAME whoever holds it: show what is held, ask you to type the name "
            "(or take --yes), then delete every hold in one script, keep the fencing floor, and "
            "announce the release on the lock's channel so that waiting processes try again at "
            "once. The holders are not told: each finds its lease lost at its next renewal (or "
            "release) and may act as the holder until then — protect the resource with the "
            "fencing token. Exit code 0: holds were removed; 1: nothing was held; 2: an error "
            "(not a lock, bad arguments, no server, not confirmed)."
        ),
    )
    force.add_argument("name", metavar="NAME", type=_lock_name, help="the lock's name")
    _add_kind(force)
    force.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    _add_url(force)
    force.set_defaults(handler=_run_force_unlock)


def _run_force_unlock(args: argparse.Namespace) -> int:
    from ._force import run_force_unlock

    return run_force_unlock(args)


def _add_bench(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = commands.add_parser(
        "bench",
        help="run the benchmark suite (from a source checkout)",
        description=(
            "Run the benchmark suite (python -m benchmarks) and write its results. The suite "
            "ships with the source checkout, not with the wheel: from an installed package this "
            "command says so and exits with 2. Otherwise the exit code is the suite's."
        ),
    )
    bench.add_argument("--quick", action="store_true", help="smoke run (under a minute)")
    bench.add_argument(
        "--url",
        default=None,
        help="use this running server (default: the suite starts a throwaway server, so that "
        "other traffic does not skew its command counts)",
    )
    bench.add_argument("--out", default=None, metavar="DIR", help="where to write the results")
    bench.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from ._bench import run_bench

    return run_bench(args)


def _run_demo(args: argparse.Namespace) -> int:
    from ._demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(workers=args.workers, tasks=args.tasks, seconds=args.seconds, url=args.url)
    )


def _lock_name(text: str) -> str:
    """A lock name as the library takes it (an empty one is a bad argument: exit code 2)."""
    if not text:
        raise argparse.ArgumentTypeError("a lock name cannot be empty")
    return _utf8(text)


def _utf8(text: str) -> str:
    """A command-line argument as the UTF-8 text it is. Python decodes arguments with the
    locale's encoding, keeping undecodable bytes as lone surrogates: those bytes are read as
    UTF-8 (a name typed under a C locale), and an argument that is not UTF-8 is a bad
    argument (exit code 2), not a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            shown = raw.decode("ascii", "backslashreplace")
            raise argparse.ArgumentTypeError(f"not valid UTF-8: {shown}") from None
    return text


def _count(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def _duration(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0 and at most 3600 seconds, got {text}")
    return value
