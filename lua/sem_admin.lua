-- sem_admin.lua: read or change a semaphore's permit count (redis-locks-async `Semaphore`).
--
-- KEYS[1..4]  holders, meta, queue, done                   -- as in sem_acquire.lua
-- KEYS[5]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  "set": record ARGV[2] as the permit count and hand newly free permits to the front
--          of the line; "free": how many permits are free now (read-only)
-- ARGV[2]  permit count (>= 1) for "set", the caller's count (when none is recorded) for "free"
-- ARGV[3]  channel; ARGV[4] "1" for SPUBLISH
-- returns  {1, n}  "set": n waiters were handed a permit; "free": n permits are free (may be
--                   < 0 after a decrease, until enough holders leave)
--          {-2, 1}  KEYS[1] is a sorted set that is not a semaphore's: nothing changed

local holders, meta, queue = KEYS[1], KEYS[2], KEYS[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now / 1000)
local recorded = tonumber(redis.call('HGET', meta, 'permits'))
if not recorded and sem_foreign(holders) then
    return {-2, 1}
end
if ARGV[1] == 'free' then
    return {1, (recorded or tonumber(ARGV[2])) - redis.call('ZCOUNT', holders, now_ms, '+inf')}
end
redis.call('ZSCORE', queue, '')  -- reads every key before the first write (type check)
redis.call('ZSCORE', holders, '')
redis.call('HSET', meta, 'permits', tonumber(ARGV[2]))
keep(meta, AUX_TAIL_MS)
return {1, sem_admit(holders, meta, queue, ARGV[3], ARGV[4], now, tonumber(ARGV[2]))}
