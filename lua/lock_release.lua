-- lock_release.lua: release one hold of a reentrant lock, handing it to the next live waiter.
--
-- KEYS[1]  the lock HASH (owner, count, token)          -- as in lock_acquire.lua
-- KEYS[2]  fencing counter STRING
-- KEYS[3]  waiter queue ZSET
-- KEYS[4]  waiter info HASH
-- ARGV[1]  owner id releasing (its waiter registration, if any, is always removed)
-- ARGV[2]  channel to announce on
-- ARGV[3]  mode: "one" drops one hold (count - 1); "all" drops every hold of ARGV[1] (used to
--          abandon an acquisition that was cancelled or timed out, whatever it reached)
-- ARGV[4]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- returns  {1, count}  ARGV[1] still holds the lock, count holds left
--          {0, 0}      released: handed over to a waiter, or freed
--          {-1, 0}     ARGV[1] does not hold the lock (expired, taken over, or never held)
-- Handover: the oldest waiter whose registration has not expired (server TIME) becomes the
-- owner with a new fencing token and its own lease, and the announcement
-- "g:<waiter>:<token>:<lease ms>" tells it so; without one the lock is deleted and "r" is
-- announced, which wakes any waiter that was not registered.

local lock, fence, queue, info = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, channel, mode = ARGV[1], ARGV[2], ARGV[3]
local publish = (ARGV[4] == '1') and 'SPUBLISH' or 'PUBLISH'

if redis.call('ZREM', queue, me) == 1 then
    redis.call('HDEL', info, me)
end
if redis.call('HGET', lock, 'owner') ~= me then
    return {-1, 0}
end
if mode == 'one' then
    local left = redis.call('HINCRBY', lock, 'count', -1)
    if left > 0 then
        return {1, left}
    end
end
redis.call('DEL', lock)

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
while true do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not head then
        break
    end
    local entry = redis.call('HGET', info, head)
    redis.call('ZREM', queue, head)
    redis.call('HDEL', info, head)
    if entry then
        local sep = string.find(entry, ':', 1, true)
        local deadline = tonumber(string.sub(entry, 1, sep - 1))
        local lease = tonumber(string.sub(entry, sep + 1))
        if deadline >= now_ms then
            local token = redis.call('INCR', fence)
            redis.call('HSET', lock, 'owner', head, 'count', 1, 'token', token)
            redis.call('PEXPIRE', lock, lease)
            redis.call(publish, channel, 'g:' .. head .. ':' .. token .. ':' .. lease)
            return {0, 0}
        end
    end
end
redis.call(publish, channel, 'r')
return {0, 0}
