-- lock_settle.lua: undo a re-entry whose reply was never seen (the caller was cancelled).
--
-- KEYS[1]  the lock HASH (owner, count, token)
-- ARGV[1]  owner id that holds it
-- ARGV[2]  the hold count the caller had before the cancelled re-entry (>= 1)
-- returns  the hold count now, or -1 when ARGV[1] does not hold the lock
-- Idempotent: a re-entry that never reached the server leaves the count as it was.

if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
    return -1
end
local expected = tonumber(ARGV[2])
if tonumber(redis.call('HGET', KEYS[1], 'count')) > expected then
    redis.call('HSET', KEYS[1], 'count', expected)
end
return tonumber(redis.call('HGET', KEYS[1], 'count'))
