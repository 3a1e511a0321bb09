"""``bench``: run the benchmark suite (``python -m benchmarks``) of a source checkout.

The benchmarks are not part of the installed package (the wheel carries only the library), so
this command works from a checkout: it runs ``python -m benchmarks`` in the checkout that
holds this package, or any ``benchmarks`` package already importable that is
ours. From an installed wheel it says so and exits with 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Final

__all__ = ("locate_benchmarks", "run_bench")

EXIT_USAGE: Final = 2
_MARKER: Final = Path("benchmarks") / "run.py"  # what tells our suite from another "benchmarks"


def locate_benchmarks(package_dir: Path) -> Path | None:
    """The directory to put on ``PYTHONPATH`` so that ``python -m benchmarks`` runs our suite:
    the checkout around ``package_dir`` (this package), else wherever an importable
    ``benchmarks`` package with our ``run.py`` lives; None when there is none."""
    checkout = package_dir.resolve().parent
    if (checkout / _MARKER).is_file() and (checkout / "lua").is_dir():
        return checkout
    try:
        spec = importlib.util.find_spec("benchmarks")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).resolve().parent.parent
    return root if (root / _MARKER).is_file() else None


def run_bench(args: argparse.Namespace) -> int:
    """``bench``: the exit code of ``python -m benchmarks`` (2 when it is not available)."""
    package_dir = Path(__file__).resolve().parent.parent
    root = locate_benchmarks(package_dir)
    if root is None:
        print(
            "error: the benchmark suite is not installed: it ships with the source checkout "
            "(git clone, then `make bench` or `python -m redis_locks_async bench` there), not "
            "with the wheel",
            file=sys.stderr,
        )
        return EXIT_USAGE
    command = [sys.executable, "-m", "benchmarks"]
    if args.quick:
        command.append("--quick")
    if args.url is not None:
        command += ["--url", args.url]
    if args.out is not None:
        command += ["--out", str(Path(args.out).resolve())]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    try:
        return subprocess.run(command, cwd=root, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130
