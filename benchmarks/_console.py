"""Progress lines while the benchmarks run (rich when installed, plain ``print`` otherwise)."""

from __future__ import annotations

import sys
import time
from typing import Protocol


class Log(Protocol):
    """Where scenarios report progress."""

    def __call__(self, message: str, *, style: str = "") -> None: ...


class Console:
    """Timestamped progress lines; rich markup is used only when rich is importable."""

    def __init__(self, *, quiet: bool = False) -> None:
        self._started = time.monotonic()
        self._quiet = quiet
        try:
            from rich.console import Console as RichConsole
        except ImportError:
            self._rich: RichConsole | None = None
        else:
            self._rich = RichConsole(stderr=False, highlight=False)

    def __call__(self, message: str, *, style: str = "") -> None:
        if self._quiet:
            return
        stamp = f"[{time.monotonic() - self._started:6.1f}s]"
        if self._rich is not None:
            from rich.markup import escape

            text = escape(message)
            body = f"[{style}]{text}[/{style}]" if style else text
            self._rich.print(f"[dim]{escape(stamp)}[/dim] {body}", soft_wrap=True)
        else:
            print(f"{stamp} {message}", file=sys.stdout, flush=True)
