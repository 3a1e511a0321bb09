-- sem_acquire.lua: take one permit of a semaphore, or register to be handed one
-- (redis-locks-async `Semaphore`).
--
-- KEYS[1]  holders: a ZSET named like the semaphore, owner -> expiry (server ms)
-- KEYS[2]  meta HASH: permits (the count, set by the first user or set_permits), fence,
--          last (owner of the last release), "t:<owner>" tokens, "w:<owner>" registrations
-- KEYS[3]  queue ZSET (registered waiters by arrival), KEYS[4] done ZSET   -- as for Lock
-- KEYS[5]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  owner id of this acquisition (random, never reused): one permit
-- ARGV[2]  lease in milliseconds; ARGV[3] mode "try" or "wait"
-- ARGV[4]  registration grace in milliseconds; ARGV[5] claim window in milliseconds
-- ARGV[6]  the caller's permit count, used when the semaphore has none recorded yet
-- ARGV[7]  channel to announce on; ARGV[8] "1" for SPUBLISH
-- A grantee that holds nothing any more yet never released gets its process's registrations
-- dropped first, with "x:<process tag>" announced (prelude.lua, evict_vanished).
-- returns  {1, token, 1, ttl}  ARGV[1] holds a permit (taken now, handed over while it waited,
--                              or by an earlier run of this very call); a permit whose token
--                              record is gone (meta evicted) gets a new token
--          {0, at, 0, ttl}     no permit is free; ttl: when the first held one ends at the
--                              latest; at: as in lock_acquire.lua
--          {-1, 0, 0, 0}       ARGV[1] already gave up: a late duplicate; nothing changed
--          {-2, 1, 0, 0}       KEYS[1] is a sorted set that is not a semaphore's: nothing changed
-- A key of another type fails the script with WRONGTYPE before anything is written.

local holders, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now = now_us()
local now_ms = math.floor(now / 1000)

local permits = tonumber(redis.call('HGET', meta, 'permits'))
redis.call('ZSCORE', queue, me)  -- reads every key before the first write (type check)
local mine = redis.call('ZSCORE', holders, me)
if mine and tonumber(mine) >= now_ms then
    local token = tonumber(redis.call('HGET', meta, 't:' .. me))
    if not token then
        -- Its record went with meta (evicted, deleted) since the permit was handed over: a
        -- new token, above every one issued (next_fence's floor from server time), never 0.
        token = next_fence(meta, now)
        redis.call('HSET', meta, 'fence', int(token), 't:' .. me, int(token))
        keep(meta, tonumber(mine) - now_ms + AUX_TAIL_MS)
    end
    return {1, token, 1, tonumber(mine) - now_ms}
end
if is_done(done, me) then
    return {-1, 0, 0, 0}
end
if not permits then
    if sem_foreign(holders) then
        return {-2, 1, 0, 0}
    end
    permits = tonumber(ARGV[6])
    redis.call('HSET', meta, 'permits', permits)
    keep(meta, lease + AUX_TAIL_MS)
end
sem_expire(holders, meta, now_ms)
evict_vanished(meta, queue, ARGV[7], ARGV[8], function(owner)
    return redis.call('ZSCORE', holders, owner) ~= false
end)
if redis.call('ZCARD', holders) < permits then
    local token = next_fence(meta, now)
    unregister(meta, queue, me)
    redis.call('ZADD', holders, now_ms + lease, me)
    redis.call('HSET', meta, 'fence', int(token), 't:' .. me, int(token))
    keep(meta, lease + AUX_TAIL_MS)
    keep(holders, lease)
    return {1, token, 1, lease}
end
local first = redis.call('ZRANGE', holders, 0, 0, 'WITHSCORES')
local ttl = first[2] and (tonumber(first[2]) - now_ms) or -1
if mode == 'wait' then
    register(meta, queue, me, now, lease, tonumber(ARGV[5]), tonumber(ARGV[4]), ttl)
    return {0, now, 0, ttl}
end
return {0, 0, 0, ttl}
