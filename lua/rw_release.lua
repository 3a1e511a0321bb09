-- rw_release.lua: end one hold of one side of a read/write lock, or all of them, and hand the
-- lock to what the front of the line may have now (redis-locks-async `ReadWriteLock`).
--
-- KEYS[1..4]  lock, meta, queue, done                     -- as in rw_acquire.lua
-- KEYS[5]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  owner id; ARGV[2] side "r" or "w"
-- ARGV[3]  mode: "entry" (drop re-entry ARGV[4]), "final" (the side's last hold), or
--          "abandon" (give up everything ARGV[1] reached, and fence its late attempts)
-- ARGV[4]  entry id (mode "entry")
-- ARGV[5]  channel to announce on; ARGV[6] "1" for SPUBLISH
-- returns  {1, 1}   ARGV[1] still holds the side (a re-entry was dropped)
--          {0, 0}   released — also when this very release already ran (a retrying client
--                   sent it again), or there was nothing to abandon
--          {-1, 0}  ARGV[1] does not hold that side: its lease ended
--          {-2, 1}  KEYS[1] is a hash of another kind of lock; nothing changed
-- A release that leaves no writer lets the readers at the front of the line in (one
-- announcement for all of them) — also the downgrade of a task that holds both sides — and
-- one that leaves nothing held lets the writer at the front in (see prelude.lua, rw_admit).

local lock, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, side, mode, channel, sharded = ARGV[1], ARGV[2], ARGV[3], ARGV[5], ARGV[6]
local now = now_us()
local now_ms = math.floor(now / 1000)

-- Every key it may write is read before the first write (rw_state drops expired holds), so a
-- key of the wrong type fails the script before anything changed.
redis.call('HGET', meta, 'fence')
redis.call('ZSCORE', queue, me)
redis.call('ZSCORE', done, me)
local state = rw_state(lock, now_ms)
if state.foreign then
    return {-2, 1}
end

local mine
if side == 'w' then
    mine = state.writer == me
else
    mine = redis.call('HGET', lock, 'r:' .. me)
end
if not mine then
    local reply = release_unheld(meta, queue, done, me, mode, now)
    if mode == 'abandon' then
        rw_admit(lock, meta, queue, channel, sharded, now, state)  -- it may have blocked others
    end
    return reply
end

local mark = ',' .. ARGV[4] .. ','
if mode == 'entry' then
    if side == 'w' then
        local entries = redis.call('HGET', lock, 'we') or ','
        local at = string.find(entries, mark, 1, true)
        if at then
            redis.call('HSET', lock, 'we', string.sub(entries, 1, at) .. string.sub(entries, at + #mark))
        end
    else
        local expiry, token, entries = string.match(mine, '^(%d+):(%d+):(.*)$')
        local at = string.find(entries, mark, 1, true)
        if at then
            entries = string.sub(entries, 1, at) .. string.sub(entries, at + #mark)
            redis.call('HSET', lock, 'r:' .. me, expiry .. ':' .. token .. ':' .. entries)
        end
    end
    return {1, 1}
end

local token
if side == 'w' then
    token = state.token
    redis.call('HDEL', lock, 'w', 'wt', 'wx', 'we')
    state.writer = nil
else
    token = tonumber(string.match(mine, '^%d+:(%d+)'))
    redis.call('HDEL', lock, 'r:' .. me)
    state.readers = state.readers - 1
end
record_release(meta, int(token), me, true)
if mode == 'abandon' then
    unregister(meta, queue, me)
    mark_done(done, me, now)
end
if rw_admit(lock, meta, queue, channel, sharded, now, state) == 0
        and not state.writer and state.readers == 0 then
    redis.call('DEL', lock)
end
return {0, 0}
