"""The tools around the library — command line, demo, throwaway server — kept apart from it.

``python -m redis_locks_async …`` (installed as ``redis-locks``) runs :func:`main`. The demo
lives in ``_demo``, the embedded server it (and the benchmarks and tests) start in ``_server``.

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

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


def _build_parser() -> argparse.ArgumentParser:
    run_as_module = os.path.basename(sys.argv[0]) == "__main__.py"
    parser = argparse.ArgumentParser(
        prog="python -m redis_locks_async" if run_as_module else PROG,
        description="Asyncio-native distributed locks for Redis and Valkey: tools and demo.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_demo(commands)
    return parser


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


def _run_demo(args: argparse.Namespace) -> int:
    from ._demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(workers=args.workers, tasks=args.tasks, seconds=args.seconds, url=args.url)
    )


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
