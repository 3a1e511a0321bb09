-- rw_renew.lua: renew one side's lease of a read/write lock; also how a waiter confirms a
-- hand-over (redis-locks-async `ReadWriteLock`; pipelined by the lease keeper).
--
-- KEYS[1]  the lock HASH (see rw_acquire.lua)
-- ARGV[1]  owner id that holds the side; ARGV[2] side "r" or "w"
-- ARGV[3]  new lease in milliseconds, counted from now (> 0)
-- ARGV[4]  optional: the lock's channel — a hold made shorter than it was is announced there
--          ("r": re-check), see prelude.lua, announce_if_shorter
-- ARGV[5]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- returns  1  renewed
--          0  ARGV[1] does not hold that side any more: the lease is lost
-- Idempotent. Never shortens the key's TTL, which covers every hold.

local lock, me, side = KEYS[1], ARGV[1], ARGV[2]
local lease = tonumber(ARGV[3])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if side == 'w' then
    local held = redis.call('HMGET', lock, 'w', 'wx')
    if held[1] ~= me or tonumber(held[2]) < now_ms then
        return 0
    end
    announce_if_shorter(ARGV[4], ARGV[5], tonumber(held[2]), now_ms + lease)
    redis.call('HSET', lock, 'wx', int(now_ms + lease))
else
    local value = redis.call('HGET', lock, 'r:' .. me)
    local expiry, rest = string.match(value or '', '^(%d+)(:.*)$')
    if not expiry or tonumber(expiry) < now_ms then
        return 0
    end
    announce_if_shorter(ARGV[4], ARGV[5], tonumber(expiry), now_ms + lease)
    redis.call('HSET', lock, 'r:' .. me, int(now_ms + lease) .. rest)
end
local ttl = redis.call('PTTL', lock)
if ttl < lease then
    redis.call('PEXPIRE', lock, lease)
end
return 1
