-- lock_acquire.lua: take, re-enter, or queue for a reentrant lock (redis-locks-async `Lock`).
--
-- KEYS[1]  the lock: a HASH named like the lock, fields owner, count, token; PEXPIRE = lease
-- KEYS[2]  fencing counter: a STRING incremented once per fresh acquisition, never expires
-- KEYS[3]  waiter queue: a ZSET waiter id -> arrival (server time, microseconds)
-- KEYS[4]  waiter info: a HASH waiter id -> "<registration deadline ms>:<lease ms>"
-- ARGV[1]  owner id of this acquisition (random, never reused)
-- ARGV[2]  lease in milliseconds (> 0)
-- ARGV[3]  mode: "try"     take the lock if it is free;
--                 "wait"    the same, and when it is held register ARGV[1] as a waiter so that
--                           release hands the lock over directly (lock_release.lua);
--                 "reenter" the caller already holds it: count + 1 and a fresh lease
-- ARGV[4]  grace in milliseconds: a registration lives for the holder's remaining lease plus
--          this, and is refreshed by the waiter's next attempt
-- returns  {1, token, count, lease_ms}  ARGV[1] holds the lock (fresh, re-entered, or handed
--                                       over to it while it waited)
--          {0, 0, 0, pttl}              another owner holds it for pttl more ms (-1: no TTL)
--          {-1, 0, 0, 0}                "reenter", but ARGV[1] no longer holds the lock
--          {-2, 0, 0, 0}                KEYS[1] exists and is not a lock (nothing was changed)
-- Time comes from the server (TIME), never from a client clock.

local lock, fence, queue, info = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]

local owner = redis.call('HGET', lock, 'owner')
if owner == me then
    if mode == 'reenter' then
        local held = redis.call('HINCRBY', lock, 'count', 1)
        redis.call('PEXPIRE', lock, lease)
        return {1, tonumber(redis.call('HGET', lock, 'token')), held, lease}
    end
    -- handed over while this owner waited: the hold is already complete
    return {1, tonumber(redis.call('HGET', lock, 'token')),
            tonumber(redis.call('HGET', lock, 'count')), redis.call('PTTL', lock)}
end
if mode == 'reenter' then
    return {-1, 0, 0, 0}
end
if not owner then
    if redis.call('EXISTS', lock) == 1 then
        return {-2, 0, 0, 0}
    end
    local token = redis.call('INCR', fence)
    redis.call('HSET', lock, 'owner', me, 'count', 1, 'token', token)
    redis.call('PEXPIRE', lock, lease)
    if redis.call('ZREM', queue, me) == 1 then
        redis.call('HDEL', info, me)
    end
    return {1, token, 1, lease}
end

local pttl = redis.call('PTTL', lock)
if mode == 'wait' then
    local grace = tonumber(ARGV[4])
    local now = redis.call('TIME')
    local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    local lives = grace + (pttl > 0 and pttl or lease)
    redis.call('ZADD', queue, 'NX', tonumber(now[1]) * 1000000 + tonumber(now[2]), me)
    redis.call('HSET', info, me, (now_ms + lives) .. ':' .. lease)
    if redis.call('PTTL', queue) < lives then
        redis.call('PEXPIRE', queue, lives)
        redis.call('PEXPIRE', info, lives)
    end
end
return {0, 0, 0, pttl}
