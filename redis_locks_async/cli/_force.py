"""``force-unlock``: free a lock whoever holds it, after the operator confirms.

The command reads the lock first (``_inspect.read_view``: nothing held means nothing to do),
shows what it is about to remove, asks the operator to type the lock's name (or takes
``--yes``), and then runs ``lua/force_unlock.lua``, which in one step deletes the main key
(every hold of a ``Lock``/``FairLock``, a ``ReadWriteLock`` or a ``Semaphore``), keeps the
fence floor, and announces on the lock's channel so that waiting processes re-check at once
instead of waiting for a lease to run out. It reports what the script removed, which is what
was held at that instant (it may differ from what was shown if the lock changed meanwhile).

The holders are not told: each finds its lease lost at its next renewal (its ``on_lost``
callback runs) or at its release (``LockLostError``) — until then it may still believe it holds
the lock, which is why fencing tokens matter.
"""

from __future__ import annotations

import argparse
import sys
from typing import Final

import redis.asyncio as aioredis

from .._keys import LockKeys
from .._scripts import Script
from ._inspect import (
    EXIT_NOTHING,
    EXIT_OK,
    EXIT_USAGE,
    KIND_TITLES,
    CliError,
    Servers,
    read_view,
    render_view,
    run_command,
    shown,
)

__all__ = ("FORCE_UNLOCK", "force_unlock", "run_force_unlock")

FORCE_UNLOCK: Final = Script("force_unlock.lua")


async def force_unlock(
    client: aioredis.Redis, name: str, kind: str, *, sharded: bool = False
) -> tuple[tuple[str, int | None], ...] | None:
    """Run ``force_unlock.lua`` on the lock ``name`` of ``kind``; the (owner, token) of every
    live hold it removed, or None when the key turned out not to be a lock of that kind.
    ``sharded``: announce with ``SPUBLISH`` (a cluster node: its waiters listen there)."""
    keys = LockKeys.for_name(name, kind)
    reply = await FORCE_UNLOCK.run(
        client,
        (keys.key, keys.meta, keys.guard),
        (kind, keys.wire_channel, "1" if sharded else "0"),
    )
    if not isinstance(reply, list) or not reply:
        raise CliError(f"unexpected reply from force_unlock.lua: {reply!r}")
    count = int(reply[0])
    if count < 0:
        return None
    pairs = reply[1:]
    removed: list[tuple[str, int | None]] = []
    for index in range(0, 2 * count, 2):
        owner, token = pairs[index], pairs[index + 1]
        text = owner.decode("utf-8", "replace") if isinstance(owner, bytes) else str(owner)
        try:
            removed.append((text, int(token)))
        except (TypeError, ValueError):
            removed.append((text, None))
    return tuple(removed)


def _confirmed(name: str) -> bool:
    """Whether the operator typed the lock's name — as it is shown (a name that cannot be
    typed on one line, one with a newline say, is shown and typed as a string literal)."""
    as_shown = shown(name)
    how = "" if as_shown == name else ", as shown here, quotes and escapes included"
    print(f"Type the lock's name ({as_shown}{how}) to force-unlock it: ", end="", flush=True)
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        print()
        return False
    return answer.rstrip("\r\n") in (name, as_shown)


def run_force_unlock(args: argparse.Namespace) -> int:
    """``force-unlock NAME``: exit 0 when something was removed, 1 when nothing was held,
    2 on errors (and when the operator did not confirm)."""

    async def body(servers: Servers) -> int:
        client = await servers.for_name(args.name)
        view = await read_view(client, args.name, args.kind)
        if not view.held or view.kind is None:
            print(f"{args.name!r} is not held: nothing to do", file=sys.stderr)
            return EXIT_NOTHING
        print(f"About to force-unlock {args.name!r}:")
        render_view(view, False, sys.stdout)
        if not args.yes and not _confirmed(args.name):
            print("not confirmed: nothing changed", file=sys.stderr)
            return EXIT_USAGE
        removed = await force_unlock(client, args.name, view.kind, sharded=servers.clustered)
        if removed is None:
            raise CliError(
                f"{args.name!r} is no longer a {KIND_TITLES[view.kind]}; nothing changed"
            )
        if not removed:
            print(f"{args.name!r} was no longer held: nothing removed", file=sys.stderr)
            return EXIT_NOTHING
        for owner, token in removed:
            print(f"removed hold of {shown(owner)} (token {token})")
        print(
            f"force-unlocked {args.name!r}: {len(removed)} hold{'s' if len(removed) != 1 else ''} "
            f"removed; waiters notified on {LockKeys.for_name(args.name, view.kind).channel}"
        )
        return EXIT_OK

    return run_command(args.url, body)
