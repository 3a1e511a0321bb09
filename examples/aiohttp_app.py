"""aiohttp: a read-modify-write on a counter in Redis, made safe by one lock per order.

The same service as ``fastapi_app.py``, on ``aiohttp.web``: ``POST /orders/{order_id}/increment``
reads the order's counter, takes a moment, and writes it back plus one under
``Lock(client, f"orders:{order_id}")``; the write is fenced with the lease's fencing token (a
holder that lost its lease cannot overwrite a newer holder's result).

The Redis client lives in a ``cleanup_ctx`` generator: created at startup, closed at cleanup —
which also stops the library's background tasks for that client. ``web.run_app`` handles
SIGINT and SIGTERM: it stops accepting, runs the cleanup and exits with status 0.

Run::

    REDIS_URL=redis://localhost:6379 PORT=8080 python examples/aiohttp_app.py
    curl -X POST localhost:8080/orders/42/increment
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import redis.asyncio as redis
from aiohttp import web
from redis.commands.core import AsyncScript

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

logger = logging.getLogger("aiohttp_app")

REDIS = web.AppKey("redis", redis.Redis)
FENCED = web.AppKey("fenced_set", AsyncScript)


def counter_keys(order_id: str) -> list[str]:
    """The counter and its fence key; one hash tag, so a Redis Cluster keeps them together."""
    return [f"counter:{{{order_id}}}", f"counter:{{{order_id}}}:fence"]


async def redis_client(app: web.Application) -> AsyncIterator[None]:
    """One client for the whole app; closing it stops the library's tasks too."""
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://localhost:6379"))
    app[REDIS] = client
    app[FENCED] = client.register_script(FENCED_SET)
    try:
        yield
    finally:
        await client.aclose()
        logger.info("closed the Redis client")


async def increment(request: web.Request) -> web.Response:
    """Add one to the order's counter under the order's lock; answer the new value."""
    order_id = request.match_info["order_id"]
    client = request.app[REDIS]
    keys = counter_keys(order_id)
    try:
        async with Lock(client, f"orders:{order_id}", timeout=20) as lease:
            count = int(await client.get(keys[0]) or 0) + 1
            await asyncio.sleep(WORK_TIME)
            written = await request.app[FENCED](keys=keys, args=[count, lease.fencing_token])
    except LockTimeout as exc:
        raise web.HTTPServiceUnavailable(text=f"order {order_id} is busy, try again") from exc
    if not written:
        raise web.HTTPConflict(text="stale write refused: the lock was lost before the write")
    return web.json_response(
        {"order_id": order_id, "count": count, "fencing_token": lease.fencing_token}
    )


async def read(request: web.Request) -> web.Response:
    """The order's counter."""
    order_id = request.match_info["order_id"]
    value = await request.app[REDIS].get(counter_keys(order_id)[0])
    return web.json_response({"order_id": order_id, "count": int(value or 0)})


async def health(request: web.Request) -> web.Response:
    """Ready once the cleanup context has started."""
    return web.json_response({"status": "ok"})


def make_app() -> web.Application:
    """The application: routes and the client's lifetime."""
    app = web.Application()
    app.cleanup_ctx.append(redis_client)
    app.add_routes(
        [
            web.post("/orders/{order_id}/increment", increment),
            web.get("/orders/{order_id}", read),
            web.get("/health", health),
        ]
    )
    return app


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    web.run_app(
        make_app(),
        host=os.environ.get("HOST", "127.0.0.1"),
        port=int(os.environ.get("PORT", "8080")),
        print=None,
    )
