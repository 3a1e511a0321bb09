"""``python -m benchmarks [--quick] [--server-bin PATH | --url URL] [--out DIR]``."""

from __future__ import annotations

if __name__ == "__main__":
    from .run import main

    raise SystemExit(main())
