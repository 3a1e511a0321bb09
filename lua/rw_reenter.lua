-- rw_reenter.lua: the holder of one side of a read/write lock enters it once more
-- (redis-locks-async `ReadWriteLock`).
--
-- KEYS[1]  the lock HASH (see rw_acquire.lua)
-- ARGV[1]  owner id that holds the side; ARGV[2] side "r" or "w"
-- ARGV[3]  entry id of this re-entry (unique within the hold)
-- ARGV[4]  lease in milliseconds from now (> 0)
-- ARGV[5]  the lock's channel: a hold made shorter than it was is announced there ("r")
-- ARGV[6]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- returns  {1, token, 1, lease}  re-entered, lease renewed
--          {-1, 0, 0, 0}         ARGV[1] does not hold that side (expired or taken over)
-- Idempotent: an entry already recorded is not recorded twice.

local lock, me, side, entry = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local lease = tonumber(ARGV[4])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mark = ',' .. entry .. ','

if side == 'w' then
    local held = redis.call('HMGET', lock, 'w', 'wt', 'wx', 'we')
    if held[1] ~= me or tonumber(held[3]) < now_ms then
        return {-1, 0, 0, 0}
    end
    local entries = held[4] or ','
    if not string.find(entries, mark, 1, true) then
        entries = entries .. entry .. ','
    end
    announce_if_shorter(ARGV[5], ARGV[6], tonumber(held[3]), now_ms + lease)
    redis.call('HSET', lock, 'wx', int(now_ms + lease), 'we', entries)
    keep(lock, lease)
    return {1, tonumber(held[2]), 1, lease}
end
local value = redis.call('HGET', lock, 'r:' .. me)
local expiry, token, entries = string.match(value or '', '^(%d+):(%d+):(.*)$')
if not expiry or tonumber(expiry) < now_ms then
    return {-1, 0, 0, 0}
end
if not string.find(entries, mark, 1, true) then
    entries = entries .. entry .. ','
end
announce_if_shorter(ARGV[5], ARGV[6], tonumber(expiry), now_ms + lease)
redis.call('HSET', lock, 'r:' .. me, int(now_ms + lease) .. ':' .. token .. ':' .. entries)
keep(lock, lease)
return {1, tonumber(token), 1, lease}
