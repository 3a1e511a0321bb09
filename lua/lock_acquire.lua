-- lock_acquire.lua: take a reentrant lock, or register to be handed it (redis-locks-async `Lock`).
--
-- KEYS[1]  the lock: a HASH named like the lock, fields owner, token, and one field "e:<id>"
--          per re-entry (hold count = HLEN - 1); PEXPIRE = the lease
-- KEYS[2]  meta: a HASH, fields fence (last token a release recorded), last (the owner of the
--          last release), and "w:<owner>" waiter registrations
-- KEYS[3]  queue: a ZSET of registered waiters, owner -> arrival (server microseconds)
-- KEYS[4]  done: a ZSET of owners that gave up (see prelude.lua, mark_done)
-- KEYS[5]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  owner id of this acquisition (random, never reused)
-- ARGV[2]  lease in milliseconds (> 0)
-- ARGV[3]  mode: "try"   take the lock if it is free;
--                 "wait"  the same, and when it is held register ARGV[1] so that a release
--                         hands the lock over directly (lock_release.lua)
-- ARGV[4]  registration grace in milliseconds: a registration lives for the longer of the
--          holder's remaining lease and ARGV[2], plus this; the waiter's next attempt
--          refreshes it
-- ARGV[5]  claim window in milliseconds: how long this waiter has to confirm a hand-over
-- returns  {1, token, count, pttl}  ARGV[1] holds the lock (taken now, or handed over to it
--                                   while it waited, or taken by an earlier run of this very
--                                   call that a retrying client sent again)
--          {0, at, 0, pttl}         another owner holds it for pttl more ms (-1: no TTL); at:
--                                   the server's clock (us) when ARGV[1] was registered ("wait"),
--                                   0 in "try" mode — a grant announced later carries its own
--                                   time, so the waiter can tell how long after this it came
--          {-1, 0, 0, 0}            ARGV[1] already gave up: a late duplicate; nothing changed
--          {-2, 1, 0, 0}            KEYS[1] exists but is not a lock; nothing was changed
-- A key of another type fails the script with WRONGTYPE before anything is written.
-- Idempotent: running it twice with the same ARGV changes nothing the first run did not.

local lock, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]

if redis.call('EXISTS', lock) == 1 then
    return attempt_held(lock, meta, queue, done, me, lease, mode, tonumber(ARGV[4]),
                        tonumber(ARGV[5]))
end

if is_done(done, me) then
    return {-1, 0, 0, 0}
end
local token = next_fence(meta, now_us())
if redis.call('ZSCORE', queue, me) then  -- also reads the queue before writing (type check)
    unregister(meta, queue, me)
end
redis.call('HSET', lock, 'owner', me, 'token', int(token))
redis.call('PEXPIRE', lock, lease)
return {1, token, 1, lease}
