"""``python -m benchmarks``: run the SPEC §5 scenarios and write ``results.json``,
``results.md`` and (with matplotlib) ``results.png``.

Exit status: 0 when every scenario ran (targets missed on a noisy machine are reported, not
failures); 1 when something really failed — the server did not start, a scenario crashed, or
redis-locks-async itself misbehaved (an error, a waiter that acquired before the release began,
overlapping holds, fencing tokens that did not increase, waiters lost while idle, a renewed
lock that did not survive or could not be released); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import os
import platform
import secrets
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

from . import (
    b1_uncontended,
    b2_handoff,
    b3_commands,
    b4_idle,
    b5_renewal,
    b6_redlock,
    b7_cluster,
    b8_throughput,
    b9_rwlock,
    b10_semaphore,
)
from ._console import Console, Log
from ._peers import all_statuses
from ._report import write
from ._server import ServerError, binary_version, default_binary, embedded_server, resolve_binary

Runner = Callable[..., dict[str, Any]]

SCENARIOS: dict[str, Runner] = {
    "B1": b1_uncontended.run,
    "B2": b2_handoff.run,
    "B3": b3_commands.run,
    "B4": b4_idle.run,
    "B5": b5_renewal.run,
    "B6": b6_redlock.run,
    "B7": b7_cluster.run,
    "B8": b8_throughput.run,
    "B9": b9_rwlock.run,
    "B10": b10_semaphore.run,
}
# These start servers of their own from the run's binary (5 masters; a 6-node cluster), so their
# runners take the binary where the others take the URL of the run's server.
OWN_SERVERS = frozenset({"B6", "B7"})
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="redis-locks-async against its peers (SPEC §5): B1 uncontended cycle vs "
        "two bare EVALSHA, B2 cross-process handoff vs the one-hop floor, B3 commands per "
        "handoff (Lock and FairLock), B4 idle cost, B5 10,000 renewed locks, B6 RedLock on 5 "
        "masters vs 1, B7 handoff on a 6-node cluster vs its floor, B8 throughput, B9 "
        "ReadWriteLock reads with one writer, B10 Semaphore(N) throughput vs N.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: fewer samples, shorter windows (under a minute)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--server-bin",
        metavar="PATH",
        help="server binary to start (default: redis-server on PATH, else the "
        "bundled valkey-server)",
    )
    where.add_argument(
        "--url",
        help="use this running server instead of starting one "
        "(its other traffic will pollute the server-side command counts)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        metavar="DIR",
        help="where to write results.json and results.md "
        "(default: benchmarks/results/, git-ignored)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        metavar="LIST",
        help="comma-separated subset of " + ", ".join(SCENARIOS),
    )
    return parser


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _server_meta(url: str, binary: Path | None) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        info: dict[str, Any] = client.info("server")
    finally:
        client.close()
    name = str(info.get("server_name", "redis"))
    version = str(info.get("valkey_version") or info.get("redis_version", "?"))
    return {
        "name": name.capitalize() if name != "valkey" else "Valkey",
        "version": version,
        "binary": str(binary) if binary else f"external server at {url}",
        "version_line": binary_version(binary) if binary else "n/a",
        "external": binary is None,
    }


def _library_revision() -> str:
    """``<commit> (clean|modified)`` of the library in a git checkout, else ``""``."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, timeout=10, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "redis_locks_async", "lua")
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{commit} ({'modified' if dirty else 'clean'})"


def _meta(quick: bool) -> dict[str, Any]:
    return {
        "library_revision": _library_revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": quick,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(terse=True),
        "cpu_count": os.cpu_count(),
        "redis_py": _version("redis"),
        "hiredis": _version("hiredis"),
        "argv": sys.argv[1:],
        "peers": {
            key: {"available": s.available, "version": s.version, "reason": s.reason}
            for key, s in all_statuses().items()
        },
    }


def _cleanup(url: str, prefix: str) -> None:
    """Delete every key this run created (they all contain the run's prefix)."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.unlink(*keys[start : start + 500])
    except redis.RedisError:
        pass
    finally:
        client.close()


def _run_all(
    url: str,
    binary: Path | None,
    prefix: str,
    selected: Sequence[str],
    quick: bool,
    log: Log,
    results: dict[str, Any],
) -> list[str]:
    failures: list[str] = []
    for key in selected:
        log(f"== {key} ==", style="bold")
        if key in OWN_SERVERS and binary is None:
            reason = "it starts servers of its own, and --url names a running one"
            log(f"{key} not run: {reason}", style="yellow")
            results["scenarios"][key] = {"scenario": key, "not_run": reason}
            continue
        try:
            where = binary if key in OWN_SERVERS else url
            result = SCENARIOS[key](where, prefix, quick=quick, log=log)
        except Exception as exc:
            log(f"{key} crashed: {exc!r}", style="bold red")
            log(traceback.format_exc())
            result = {"scenario": key, "failed": True, "failures": [f"{type(exc).__name__}: {exc}"]}
        results["scenarios"][key] = result
        if result.get("failed"):
            failures += [f"{key}: {text}" for text in result.get("failures", ["failed"])]
        target = result.get("target")
        if isinstance(target, dict):
            verdict = "met" if target.get("met") else "NOT met"
            log(
                f"{key} target: {target.get('text')} — {verdict} "
                f"({target.get('value_text', target.get('value'))})",
                style="green" if target.get("met") else "yellow",
            )
    return failures


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks``; returns the exit status."""
    args = _parser().parse_args(argv)
    selected = [part.strip().upper() for part in args.scenarios.split(",") if part.strip()]
    unknown = [key for key in selected if key not in SCENARIOS]
    if unknown:
        _parser().error(f"unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
    log = Console()
    # A CI time-out sends SIGTERM: unwind through the finally blocks (workers, server) instead
    # of dying on the spot.
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    prefix = f"rla-bench:{secrets.token_hex(4)}:"
    results: dict[str, Any] = {"meta": _meta(args.quick), "scenarios": {}}
    server = contextlib.ExitStack()
    try:
        if args.url:
            url, binary = args.url, None
        else:
            binary = resolve_binary(args.server_bin) if args.server_bin else default_binary()
            log(f"starting {binary_version(binary)} ({binary})")
            url = server.enter_context(embedded_server(binary))
        results["meta"]["server"] = _server_meta(url, binary)
        server_meta = results["meta"]["server"]
        log(
            f"server: {server_meta['name']} {server_meta['version']} at {url}; "
            f"{'quick' if args.quick else 'full'} run of {', '.join(selected)}"
        )
        try:
            failures = _run_all(url, binary, prefix, selected, args.quick, log, results)
        finally:
            _cleanup(url, prefix)
    except ServerError as exc:
        log(str(exc), style="bold red")
        return 1
    except KeyboardInterrupt:
        log("interrupted", style="bold red")
        return 130
    finally:
        server.close()
    results["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
    json_path, md_path, png_path = write(results, args.out)
    chart = f", {png_path}" if png_path else " (no chart)"
    log(f"wrote {json_path}, {md_path}{chart} in {results['meta']['elapsed_s']:.0f} s")
    if failures:
        for failure in failures:
            log(f"FAILED {failure}", style="bold red")
        return 1
    return 0
