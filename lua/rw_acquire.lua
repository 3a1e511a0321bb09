-- rw_acquire.lua: take one side of a read/write lock, or register to be handed it
-- (redis-locks-async `ReadWriteLock`).
--
-- KEYS[1]  the lock: one HASH per name (writer fields w, wt, wx, we; one "r:<owner>" field per
--          reader; see prelude.lua, rw_state); its TTL covers the longest hold
-- KEYS[2]  meta HASH (fence, last, "w:<owner>" registrations with their role)
-- KEYS[3]  queue ZSET (registered waiters by arrival), KEYS[4] done ZSET   -- as for Lock
-- KEYS[5]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  owner id of this acquisition (random, never reused)
-- ARGV[2]  side: "r" (read) or "w" (write)
-- ARGV[3]  lease in milliseconds (> 0)
-- ARGV[4]  mode: "try" or "wait" (register when it cannot be taken now)
-- ARGV[5]  registration grace in milliseconds; ARGV[6] claim window in milliseconds
-- ARGV[7]  channel to announce on; ARGV[8] "1" for SPUBLISH
-- ARGV[9]  "1": prefer writers (a reader waits while a live writer is registered); else a
--          reader registers as "R" and is let in past waiting writers (prelude.lua, rw_admit)
-- A grantee that holds nothing any more yet never released gets its process's registrations
-- dropped first, with "x:<process tag>" announced on ARGV[7] (prelude.lua, evict_vanished).
-- ARGV[10] owner id of the caller's own write hold ("" if none): reading then is a downgrade,
--          allowed whatever else waits
-- returns  {1, token, 1, ttl}  ARGV[1] holds this side (taken now, handed over while it
--                              waited, or by an earlier run of this very call)
--          {0, at, 0, ttl}     it cannot be taken now; ttl: when the first of the current
--                              holds ends unless renewed — a dead holder's may end then,
--                              unannounced (-1: unknown); at: as in lock_acquire.lua
--                              (also when nothing is held but a reader must let a registered
--                              writer go first: the front of the line is then handed the lock
--                              now — "g:..." announced, see prelude.lua, rw_admit — and ttl is
--                              its claim window); a reader kept out only by a registered
--                              writer while readers hold ("wait") gets at most ARGV[6]: that
--                              writer's death is announced by nothing
--          {-1, 0, 0, 0}       ARGV[1] already gave up: a late duplicate; nothing changed
--          {-2, 1, 0, 0}       KEYS[1] is a hash of another kind of lock, or of no lock at all
--                              (a field no read/write lock writes); nothing changed
-- A key of another type fails the script with WRONGTYPE before anything is written.

local lock, meta, queue, done = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local me, side, lease, mode = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local grace, claim = tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_us()
local now_ms = math.floor(now / 1000)

-- Every key it may write is read before the first write (rw_state drops expired holds), so a
-- key of the wrong type fails the script before anything changed.
redis.call('HGET', meta, 'fence')
redis.call('ZSCORE', queue, me)
local fenced = redis.call('ZSCORE', done, me) ~= false
local state = rw_state(lock, now_ms)
if state.foreign then
    return {-2, 1, 0, 0}
end
if side == 'w' and state.writer == me then
    return {1, state.token, 1, state.expiry - now_ms}
end
if side == 'r' then
    local mine = redis.call('HGET', lock, 'r:' .. me)
    if mine then
        local expiry, token = string.match(mine, '^(%d+):(%d+)')
        return {1, tonumber(token), 1, tonumber(expiry) - now_ms}
    end
end
if fenced then
    return {-1, 0, 0, 0}
end
evict_vanished(meta, queue, ARGV[7], ARGV[8], function(owner)
    return state.writer == owner or redis.call('HGET', lock, 'r:' .. owner) ~= false
end)

local free
if side == 'w' then
    free = not state.writer and state.readers == 0
else
    free = (not state.writer or state.writer == ARGV[10])
        and (ARGV[10] ~= '' or ARGV[9] ~= '1' or not rw_writer_waiting(meta, queue, now_ms, ARGV[7], ARGV[8]))
end
if free then
    local token = next_fence(meta, now)
    unregister(meta, queue, me)
    if side == 'w' then
        redis.call('HSET', lock, 'w', me, 'wt', int(token), 'wx', int(now_ms + lease), 'we', ',')
    else
        redis.call('HSET', lock, 'r:' .. me, int(now_ms + lease) .. ':' .. int(token) .. ':,')
    end
    redis.call('HSET', meta, 'fence', int(token))
    keep(meta, AUX_TAIL_MS)
    keep(lock, lease)
    return {1, token, 1, lease}
end

if not state.writer and state.readers == 0 then
    -- Nothing is held, yet a reader may not enter: a writer is registered (writer preference).
    -- No release will come to hand the lock over, so do it here, as a release would have: a
    -- writer that died while registered then delays the line by one claim window, not by
    -- what is left of its registration (its own lease and more).
    rw_admit(lock, meta, queue, ARGV[7], ARGV[8], now, state)
    local mine = redis.call('HGET', lock, 'r:' .. me)
    if mine then  -- the caller was at the front of the line, let in with the readers there
        local expiry, token = string.match(mine, '^(%d+):(%d+)')
        return {1, tonumber(token), 1, tonumber(expiry) - now_ms}
    end
end

-- The first of the holds in the way may end unannounced (expiry publishes nothing): a waiter
-- re-checks then, not when the longest lease ends (the key's TTL covers the longest hold).
local ttl = redis.call('PTTL', lock)
if state.first_end then
    ttl = math.max(1, state.first_end - now_ms)
end
if mode == 'wait' then
    -- A reader that does not defer to waiting writers registers as "R" (see rw_admit).
    local role = side
    if side == 'r' and ARGV[9] ~= '1' then
        role = 'R'
        redis.call('HSET', meta, 'R', '1')
    end
    register(meta, queue, me, now, lease, claim, grace, ttl, role)
    if side == 'r' and not state.writer and (ttl < 0 or ttl > claim) then
        -- Kept out only by a registered writer (writer preference) while readers hold: if that
        -- writer's process dies, nothing announces it, and the readers' holds may go on for
        -- long. The reader re-checks within a claim window — the dead-waiter bound — and
        -- enters once the writer is found gone (rw_writer_waiting); one command per claim
        -- window per waiting process, only while a writer waits behind readers.
        return {0, now, 0, claim}
    end
    return {0, now, 0, ttl}
end
return {0, 0, 0, ttl}
