"""FastAPI: a read-modify-write on a counter in Redis, made safe by one lock per order.

``POST /orders/{order_id}/increment`` reads the order's counter, takes a moment (as real work
would), and writes the counter back plus one. Run concurrently without a lock, such requests
lose updates; under ``Lock(client, f"orders:{order_id}")`` they do not. The write is *fenced*:
a small script stores the value only if the lease's fencing token is not older than the token
of the last write, so a holder that stalled past its lease (and lost the lock) cannot overwrite
a newer holder's result.

The Redis client is created in the lifespan handler and closed at shutdown; closing it also
stops the library's background tasks (lease renewal, pub/sub) for that client.

Run::

    REDIS_URL=redis://localhost:6379 uvicorn fastapi_app:app --app-dir examples
    curl -X POST localhost:8000/orders/42/increment
    curl localhost:8000/orders/42
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as redis
from fastapi import FastAPI, HTTPException, Request

from redis_locks_async import Lock, LockTimeout

# -- KEYS[1] the counter, KEYS[2] the fencing token of its last write
# -- ARGV[1] the new value, ARGV[2] the writer's fencing token (decimal, no leading zeros)
# -- returns 1 when written, 0 when a newer token already wrote (the write is refused)
FENCED_SET = """
local last = redis.call('GET', KEYS[2]) or '0'
local token = ARGV[2]
if #token < #last or (#token == #last and token < last) then
    return 0
end
redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""

WORK_TIME = 0.002  # seconds between the read and the write: the window a lost update needs


def counter_keys(order_id: str) -> list[str]:
    """The counter and its fence key; one hash tag, so a Redis Cluster keeps them together."""
    return [f"counter:{{{order_id}}}", f"counter:{{{order_id}}}:fence"]


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """One client for the whole app; closing it stops the library's tasks too."""
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://localhost:6379"))
    app.state.redis = client
    app.state.fenced_set = client.register_script(FENCED_SET)
    try:
        yield
    finally:
        await client.aclose()


app = FastAPI(title="redis-locks-async example", lifespan=lifespan)


@app.post("/orders/{order_id}/increment")
async def increment(order_id: str, request: Request) -> dict[str, Any]:
    """Add one to the order's counter under the order's lock; answer the new value."""
    client: redis.Redis = request.app.state.redis
    keys = counter_keys(order_id)
    try:
        async with Lock(client, f"orders:{order_id}", timeout=20) as lease:
            count = int(await client.get(keys[0]) or 0) + 1
            await asyncio.sleep(WORK_TIME)
            written = await request.app.state.fenced_set(
                keys=keys, args=[count, lease.fencing_token]
            )
    except LockTimeout as exc:
        raise HTTPException(503, f"order {order_id} is busy, try again") from exc
    if not written:
        raise HTTPException(409, "stale write refused: the lock was lost before the write")
    return {"order_id": order_id, "count": count, "fencing_token": lease.fencing_token}


@app.get("/orders/{order_id}")
async def read(order_id: str, request: Request) -> dict[str, Any]:
    """The order's counter."""
    client: redis.Redis = request.app.state.redis
    return {"order_id": order_id, "count": int(await client.get(counter_keys(order_id)[0]) or 0)}


@app.get("/health")
async def health() -> dict[str, str]:
    """Ready once the lifespan handler has run."""
    return {"status": "ok"}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
