-- lock_release.lua: end one hold of a reentrant lock, or all of them, handing the lock over
-- to the next live waiter (redis-locks-async `Lock`).
--
-- KEYS[1..4]  lock, meta, queue, done                     -- as in lock_acquire.lua
-- ARGV[1]  owner id
-- ARGV[2]  mode: "entry"    drop the re-entry ARGV[3] (the lock stays held);
--                 "final"    the owner's last hold: free the lock or hand it over;
--                 "abandon"  give up everything ARGV[1] reached (a cancelled or timed-out
--                            acquisition, or a task that ended holding it): its registration,
--                            and the lock if it was taken or handed over meanwhile
-- ARGV[3]  entry id (mode "entry")
-- ARGV[4]  channel to announce on
-- ARGV[5]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- returns  {1, count}  ARGV[1] still holds the lock, count holds
--          {0, 0}      released (freed or handed over) — also when this very release already
--                      ran (a retrying client sent it again) or there was nothing to abandon
--          {-1, 0}     ARGV[1] does not hold the lock: its lease ended (expired, taken over)
--          {-2, i}     KEYS[i] is not of this lock's type; nothing was changed
-- On a free: the lock is handed to the oldest live registration ("g:..." announced, see
-- prelude.lua, hand_over), or deleted with "f:1" announced. The owner is remembered in `done`.

local lock, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, mode = ARGV[1], ARGV[2]

local bad = wrong_type(KEYS, {'hash', 'hash', 'zset', 'zset'})
if bad then
    return {-2, bad}
end
unregister(meta, queue, me)
if redis.call('HGET', lock, 'owner') ~= me then
    if mode == 'abandon' then
        mark_done(done, me)
        return {0, 0}
    end
    if mode == 'final' and is_done(done, me) then
        return {0, 0}
    end
    return {-1, 0}
end
if mode == 'entry' then
    redis.call('HDEL', lock, 'e:' .. ARGV[3])
    return {1, redis.call('HLEN', lock) - 1}
end
redis.call('DEL', lock)
mark_done(done, me)
if not hand_over(lock, meta, queue, ARGV[4], ARGV[5]) then
    announce(ARGV[4], ARGV[5], 'f:1')
end
return {0, 0}
