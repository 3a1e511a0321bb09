-- fair_acquire.lua: take a FIFO lock only when nobody is ahead in line, or register to be
-- handed it (redis-locks-async `FairLock`; release, re-entry and renewal are Lock's scripts).
--
-- KEYS[1..4]  lock, meta, queue, done                      -- as in lock_acquire.lua
-- KEYS[5]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  owner id of this acquisition (random, never reused)
-- ARGV[2]  lease in milliseconds (> 0)
-- ARGV[3]  mode: "try"   take the lock if it is free and no live waiter is registered ahead;
--                 "wait"  the same, and otherwise register ARGV[1] at the end of the line
--                         (arrival = server time of its first registration, kept on refresh)
-- ARGV[4]  registration grace in milliseconds (as in lock_acquire.lua)
-- ARGV[5]  claim window in milliseconds
-- ARGV[6]  channel to announce a hand-over on
-- ARGV[7]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- ARGV[8]  "wait": the arrival (server us) the server answered ARGV[1]'s first registration
--          with, or 0 before that. A registration of a waiter the server knew that is no longer
--          there (the server dropped it: its process was taken for dead, a failover lost it)
--          is put back in its place of arrival, not at the end of the line (never later than now;
--          not for an owner that released the lock lately: a late duplicate of its attempt)
-- returns  {1, token, count, pttl}  ARGV[1] holds the lock (as in lock_acquire.lua)
--          {0, at, 0, pttl}         held by another owner for pttl more ms; or free but owed to
--                                   the first live waiter in line, which is handed it now (pttl
--                                   is then its claim window): a newcomer never barges in. at:
--                                   as in lock_acquire.lua
--          {-1, 0, 0, 0}            ARGV[1] already gave up: a late duplicate; nothing changed
--          {-2, 1, 0, 0}            KEYS[1] exists but is not a lock; nothing was changed
--          {-3, at, 0, pttl}        as {0, at, 0, pttl}, and ARGV[1]'s registration was gone:
--                                   it was put back in its place (ARGV[8]) — the process's
--                                   other registrations may be gone too
-- On a free lock whose last grantee never released it (its process died, or was paused past its
-- claim window or lease) every registration of that grantee's process is dropped first, and
-- "x:<process tag>" announced (prelude.lua, evict_vanished).
-- A key of another type fails the script with WRONGTYPE before anything is written.
-- Idempotent: running it twice with the same ARGV changes nothing the first run did not.

local lock, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local grace, claim = tonumber(ARGV[4]), tonumber(ARGV[5])

if redis.call('EXISTS', lock) == 1 then
    return attempt_held(lock, meta, queue, done, me, lease, mode, grace, claim, ARGV[8])
end

if is_done(done, me) then
    return {-1, 0, 0, 0}
end
local now = now_us()
evict_vanished(meta, queue, ARGV[6], ARGV[7])
-- (The caller's own process is there: its waiters ahead of it keep their places, even while
-- its subscriptions move — a slot migration — and the server does not see them yet.)
local walk = new_walk(me)
local head = live_head(meta, queue, math.floor(now / 1000), ARGV[6], ARGV[7], walk)
if head and head ~= me then
    -- Free, but owed to the first in line (its grantee never confirmed, or the holder's lease
    -- ran out): hand it over as a release would have.
    local ttl = hand_over(lock, meta, queue, ARGV[6], ARGV[7], now, {walk = walk})
    if mode == 'wait' then
        if register_known(meta, queue, me, now, lease, claim, grace, ttl, ARGV[8]) then
            return {-3, now, 0, ttl}
        end
        return {0, now, 0, ttl}
    end
    return {0, 0, 0, ttl}
end
local token = next_fence(meta, now)
unregister(meta, queue, me)
redis.call('HSET', lock, 'owner', me, 'token', int(token))
redis.call('PEXPIRE', lock, lease)
return {1, token, 1, lease}
