-- lock_reenter.lua: the holder enters its lock once more (redis-locks-async `Lock`).
--
-- KEYS[1]  the lock HASH (owner, token, "e:<id>" per re-entry)   -- as in lock_acquire.lua
-- ARGV[1]  owner id that holds it
-- ARGV[2]  entry id of this re-entry (unique within the hold, never reused)
-- ARGV[3]  lease in milliseconds from now (> 0)
-- ARGV[4]  the lock's channel: a lease made shorter than it was is announced there ("r")
-- ARGV[5]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- returns  {1, token, count, lease}  re-entered (count = holds now, this one included)
--          {-1, 0, 0, 0}             ARGV[1] does not hold the lock (expired or taken over)
-- A KEYS[1] of another type fails the script with WRONGTYPE; nothing is written.
-- Idempotent: the entry is a field, so a re-sent re-entry counts once.

local lock, me = KEYS[1], ARGV[1]
local held = redis.call('HMGET', lock, 'owner', 'token')
if held[1] ~= me then
    return {-1, 0, 0, 0}
end
redis.call('HSET', lock, 'e:' .. ARGV[2], 1)
announce_if_shorter(ARGV[4], ARGV[5], redis.call('PTTL', lock), tonumber(ARGV[3]))
redis.call('PEXPIRE', lock, tonumber(ARGV[3]))
return {1, tonumber(held[2]), redis.call('HLEN', lock) - 1, tonumber(ARGV[3])}
