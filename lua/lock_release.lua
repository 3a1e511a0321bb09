-- lock_release.lua: end one hold of a reentrant lock, or all of them, handing the lock over
-- to the next live waiter (redis-locks-async `Lock`).
--
-- KEYS[1..4]  lock, meta, queue, done                     -- as in lock_acquire.lua
-- KEYS[5]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  owner id
-- ARGV[2]  mode: "entry"    drop the re-entry ARGV[3] (the lock stays held);
--                 "final"    the owner's last hold: free the lock or hand it over;
--                 "abandon"  give up everything ARGV[1] reached (a cancelled or timed-out
--                            acquisition, or a task that ended holding it): its registration,
--                            and the lock if it was taken or handed over meanwhile; ARGV[1] is
--                            remembered in `done`, so a late attempt of it is refused
-- ARGV[3]  entry id (mode "entry")
-- ARGV[4]  channel to announce on
-- ARGV[5]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- ARGV[6]  optional: "1" to announce "f:1" on every free, also with nobody registered
--          (RedLock: its waiters never register, they re-attempt on any announcement)
-- returns  {1, count}  ARGV[1] still holds the lock, count holds
--          {0, 0}      released (freed or handed over) — also when this very release already
--                      ran (a retrying client sent it again), or there was nothing to abandon
--          {-1, 0}     ARGV[1] does not hold the lock: its lease ended (expired, taken over)
-- On a free: the lock is handed to the oldest live registration ("g:..." announced, see
-- prelude.lua, hand_over; the releasing process counts as present), or deleted — with "f:1"
-- announced when registrations were found dead or away on the way (with nobody registered,
-- every waiter has an attempt or a timer coming).
-- A key of another type fails the script with WRONGTYPE before anything is written; an
-- "abandon" over a hash that is not a lock (foreign data), by an owner not registered, changes
-- nothing.

local lock, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, mode, channel, sharded = ARGV[1], ARGV[2], ARGV[4], ARGV[5]

local held = redis.call('HMGET', lock, 'owner', 'token')
if mode == 'abandon' and not held[1] and redis.call('EXISTS', lock) == 1
        and not redis.call('ZSCORE', queue, me) then
    -- The key holds foreign data (a user's hash): no attempt can take it, and ARGV[1] is not
    -- registered. Nothing to give up, and nothing is written beside the user's key.
    return {0, 0}
end
if held[1] ~= me then
    redis.call('HGET', meta, 'fence')  -- reads meta and done before the first write (type check)
    redis.call('ZSCORE', done, me)
    return release_unheld(meta, queue, done, me, mode, now_us())
end
if mode == 'entry' then
    redis.call('HDEL', lock, 'e:' .. ARGV[3])
    return {1, redis.call('HLEN', lock) - 1}
end

local waiting = redis.call('ZRANGE', queue, 0, 0)[1]  -- reads queue first (type check)
local now = nil
if mode == 'abandon' then
    redis.call('ZSCORE', done, me)
    now = now_us()
end
local fields, n = release_fields(meta, held[2], me)  -- (written below, with a grant if any)
redis.call('DEL', lock)
if mode == 'abandon' then
    unregister(meta, queue, me)
    mark_done(done, me, now)
end
-- (The fence recorded last is the released token: this hold's, the latest granted or taken.)
local granted = waiting and hand_over(lock, meta, queue, channel, sharded, now or now_us(), {
    fence = tonumber(held[2]), fields = fields, head = mode ~= 'abandon' and waiting or nil,
    me = me})
if not granted then
    write_release(meta, fields, n)
    if waiting or ARGV[6] == '1' then
        announce(channel, sharded, 'f:1')
    end
end
return {0, 0}
