"""The examples are programs: run them for real against the test server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_basic_example(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "basic.py")],
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "6 writes" in result.stdout
