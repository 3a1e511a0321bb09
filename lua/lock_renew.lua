-- lock_renew.lua: renew a held lock's lease; also how a waiter confirms a hand-over
-- (redis-locks-async `Lock`; the lease keeper pipelines one call per hold).
--
-- KEYS[1]  the lock HASH (owner, token, ...)
-- ARGV[1]  owner id that holds it
-- ARGV[2]  new lease in milliseconds, counted from now (> 0)
-- ARGV[3]  optional: the lock's channel — a lease made shorter than it was is announced there
--          ("r": re-check), see prelude.lua, announce_if_shorter
-- ARGV[4]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- returns  1  renewed
--          0  ARGV[1] does not hold the lock any more (expired or taken over): the lease is lost
-- Idempotent (a PEXPIRE). A KEYS[1] of another type fails with WRONGTYPE: the lease is lost.

if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
    return 0
end
local lease = tonumber(ARGV[2])
if ARGV[3] then
    announce_if_shorter(ARGV[3], ARGV[4], redis.call('PTTL', KEYS[1]), lease)
end
redis.call('PEXPIRE', KEYS[1], lease)
return 1
