"""The smallest useful program: two workers share one lock; fencing tokens guard the writes.

Run: ``REDIS_URL=redis://localhost:6379 python examples/basic.py``
"""

from __future__ import annotations

import asyncio
import os

import redis.asyncio as redis

from redis_locks_async import Lock


class FencedStore:
    """A resource that rejects writes carrying an older fencing token than it has seen."""

    def __init__(self) -> None:
        self.highest = 0
        self.log: list[str] = []

    def write(self, text: str, fence: int) -> None:
        if fence < self.highest:
            raise RuntimeError(f"stale write rejected: token {fence} < {self.highest}")
        self.highest = fence
        self.log.append(text)


async def worker(client: redis.Redis, store: FencedStore, who: str) -> None:
    lock = Lock(client, "examples:basic", lease=5, timeout=10)
    for i in range(3):
        async with lock as lease:
            store.write(f"{who} #{i}", fence=lease.fencing_token)
            await asyncio.sleep(0.01)


async def main() -> None:
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://localhost:6379"))
    store = FencedStore()
    try:
        await asyncio.gather(worker(client, store, "a"), worker(client, store, "b"))
    finally:
        await client.aclose()
    print("\n".join(store.log))
    print(f"{len(store.log)} writes, highest token {store.highest}")


if __name__ == "__main__":
    asyncio.run(main())
