-- sem_release.lua: give a permit back, or abandon what an owner reached, and hand the free
-- permits to the front of the line (redis-locks-async `Semaphore`).
--
-- KEYS[1..4]  holders, meta, queue, done                   -- as in sem_acquire.lua
-- KEYS[5]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  owner id (one permit)
-- ARGV[2]  mode: "final" (give the permit back), "abandon" (give up everything ARGV[1]
--          reached: its registration, a permit taken or handed over meanwhile; fence its late
--          attempts), "entry" (permits are not re-entered: answers "still held")
-- ARGV[3]  entry id (unused); ARGV[4] channel; ARGV[5] "1" for SPUBLISH
-- ARGV[6]  the caller's permit count (when none is recorded)
-- returns  {1, 1}   still held (mode "entry")
--          {0, 0}   released — also when this very release already ran (a retrying client
--                   sent it again), or there was nothing to abandon
--          {-1, 0}  ARGV[1] holds no permit: its lease ended
-- A key of another type fails the script with WRONGTYPE before anything is written; an
-- "abandon" over a sorted set that is not a semaphore's (foreign data) touches nothing of it.
-- Holders whose lease ended are dropped with their tokens (prelude.lua, sem_expire). The last
-- release (nobody holds or waits any more) leaves meta a minute to live.

local holders, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, mode, channel, sharded = ARGV[1], ARGV[2], ARGV[4], ARGV[5]
local now = now_us()
local now_ms = math.floor(now / 1000)

redis.call('HGET', meta, 'fence')  -- reads every key before the first write (type check)
redis.call('ZSCORE', queue, me)
redis.call('ZSCORE', done, me)
local mine = redis.call('ZSCORE', holders, me)
local live = mine and tonumber(mine) >= now_ms
if mode == 'entry' then
    return live and {1, 1} or {-1, 0}
end
local permits = tonumber(redis.call('HGET', meta, 'permits'))
if mode == 'abandon' then
    release_unheld(meta, queue, done, me, mode, now)
    if not mine and not permits and sem_foreign(holders) then
        return {0, 0}  -- KEYS[1] is someone else's sorted set: nothing of it is touched
    end
elseif not live then
    if mine then
        sem_expire(holders, meta, now_ms)  -- (its own ended permit among them)
    end
    return release_unheld(meta, queue, done, me, mode, now)
end
if mine then
    redis.call('ZREM', holders, me)
    local token = redis.call('HGET', meta, 't:' .. me)
    redis.call('HDEL', meta, 't:' .. me)
    if live then
        record_release(meta, token or '0', me, true)
    end
end
permits = permits or tonumber(ARGV[6])
sem_admit(holders, meta, queue, channel, sharded, now, permits)
if redis.call('ZCARD', holders) == 0 then
    redis.call('DEL', holders)
    if redis.call('ZCARD', queue) == 0 then
        -- Nobody holds it or waits for it: the permit count (and the rest of meta) is kept a
        -- minute from now, not until the longest lease it was kept for would have ended.
        redis.call('PEXPIRE', meta, AUX_TAIL_MS)
    end
end
return {0, 0}
