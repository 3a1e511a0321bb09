-- lock_acquire.lua: take a reentrant lock, or register to be handed it (redis-locks-async `Lock`).
--
-- KEYS[1]  the lock: a HASH named like the lock, fields owner, token, and one field "e:<id>"
--          per re-entry (hold count = HLEN - 1); PEXPIRE = the lease
-- KEYS[2]  meta: a HASH, field fence (last fencing token) and "w:<owner>" registrations
-- KEYS[3]  queue: a ZSET of registered waiters, owner -> arrival (server microseconds)
-- KEYS[4]  done: a ZSET of owners whose hold ended (see prelude.lua, mark_done)
-- ARGV[1]  owner id of this acquisition (random, never reused)
-- ARGV[2]  lease in milliseconds (> 0)
-- ARGV[3]  mode: "try"   take the lock if it is free;
--                 "wait"  the same, and when it is held register ARGV[1] so that a release
--                         hands the lock over directly (lock_release.lua)
-- ARGV[4]  registration grace in milliseconds: a registration lives for the holder's
--          remaining lease plus this, and the waiter's next attempt refreshes it
-- ARGV[5]  claim window in milliseconds: how long this waiter has to confirm a hand-over
-- returns  {1, token, count, pttl}  ARGV[1] holds the lock (taken now, or handed over to it
--                                   while it waited, or taken by an earlier run of this very
--                                   call that a retrying client sent again)
--          {0, 0, 0, pttl}          another owner holds it for pttl more ms (-1: no TTL)
--          {-1, 0, 0, 0}            ARGV[1] already gave up (released or abandoned): a late
--                                   duplicate; nothing was changed
--          {-2, i, 0, 0}            KEYS[i] is not of this lock's type; nothing was changed
-- Idempotent: running it twice with the same ARGV changes nothing the first run did not.

local lock, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]

local bad = wrong_type(KEYS, {'hash', 'hash', 'zset', 'zset'})
if bad then
    return {-2, bad, 0, 0}
end
local owner = redis.call('HGET', lock, 'owner')
if owner == me then
    return {1, tonumber(redis.call('HGET', lock, 'token')), redis.call('HLEN', lock) - 1,
            redis.call('PTTL', lock)}
end
if is_done(done, me) then
    return {-1, 0, 0, 0}
end
if not owner then
    if redis.call('EXISTS', lock) == 1 then
        return {-2, 1, 0, 0}
    end
    local token = next_fence(meta)
    redis.call('HSET', lock, 'owner', me, 'token', int(token))
    redis.call('PEXPIRE', lock, lease)
    unregister(meta, queue, me)
    return {1, token, 1, lease}
end

local pttl = redis.call('PTTL', lock)
if mode == 'wait' then
    register(meta, queue, me, lease, tonumber(ARGV[5]),
             tonumber(ARGV[4]) + (pttl > 0 and pttl or lease))
end
return {0, 0, 0, pttl}
