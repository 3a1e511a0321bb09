-- prelude.lua: functions shared by every script of redis-locks-async. Not a script by itself:
-- _scripts.py prepends it to each script before computing the script's SHA1, so each script
-- reads as if these were built in. Nothing here reads KEYS or ARGV.
--
-- Cost matters (each redis.call is a round through the command table): the hot paths — take a
-- free lock, free it with nobody waiting — make a handful of calls each. Wrong-type keys are
-- detected without extra calls: every script reads each key it will write before its first
-- write, and a read of a key of the wrong type fails the script (WRONGTYPE) before anything
-- was written; the client then names the key.
--
-- Time is the server's (TIME), in microseconds (< 2^53, exact in a Lua number). Numbers are
-- never concatenated with `..` (Lua formats them with %.14g, which rounds 16-digit values):
-- `int` formats them exactly.

local function int(n)
    return string.format('%.0f', n)
end

local function now_us()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Make an existing `key` live at least `ms` more milliseconds (never shortens its TTL).
local function keep(key, ms)
    local ttl = redis.call('PTTL', key)
    if ttl ~= -2 and ttl < ms then
        redis.call('PEXPIRE', key, ms)
    end
end

-- Auxiliary keys outlive the state they describe by this much: long enough for a re-sent
-- command (a client retrying after a lost reply) to find the traces it needs.
local AUX_TAIL_MS = 60000

-- The next fencing token of a lock: above the last token a release recorded in `meta` (a
-- HASH, field fence), and never below the server's clock in microseconds — so tokens keep
-- increasing after the record is gone (expired, evicted, a restart without persistence, a
-- failover to a replica that missed writes), within the servers' clock skew.
local function next_fence(meta, now)
    local last = tonumber(redis.call('HGET', meta, 'fence') or '0')
    return math.max(last + 1, now)
end

-- What a release leaves behind in `meta`: the token it ended (the fence floor, if higher than
-- the one recorded); its owner, in
-- the ring of the RECENT_RELEASES latest releases of the lock (fields r0..r15, the slot from the
-- counter n; each the owner id's last 16 hex digits, 64 random bits), so that the same release
-- re-sent by a retrying client reports "released", not "lost", also after others took and
-- released the lock meanwhile (one `last` owner: a single release by another in between made
-- it "lost"); and the last grantee (c, see evict_vanished) forgotten: it released. Where
-- several hold at once (`shared`: read/write lock, semaphore) only the grantee's own release
-- forgets it. Short fields in one small hash keep `meta` in Redis's compact encoding (one
-- field of 16 whole ids was 7 times the memory). A `meta` created here gets its TTL; one that
-- existed has one already (every writer sets it).
local RECENT_RELEASES = 16

local function release_mark(owner)
    return string.sub(owner, -16)
end

-- The fields record_release writes to `meta`, as a list for HSET, and the release counter n
-- (read here: the ring slot). Reads `meta` (type check). A release that hands the lock over
-- gives them to grant_batch (hint.fields), which writes them with its own in one HSET.
local function release_fields(meta, token, owner, shared)
    -- (HMGET + HSET, not HINCRBY: the documented ACL grants no more than that)
    local known = redis.call('HMGET', meta, 'n', 'fence')
    local n = (tonumber(known[1]) or 0) + 1
    -- The fence never goes down: where several hold at once, the last to release may hold an
    -- older token than one issued since (helper-71); a token not known (0) records nothing new.
    local fence = int(math.max(tonumber(token) or 0, tonumber(known[2]) or 0))
    local fields = {'fence', fence, 'n', n, 'r' .. (n % RECENT_RELEASES), release_mark(owner)}
    if shared then
        if redis.call('HGET', meta, 'c') == owner then
            fields[#fields + 1], fields[#fields + 2] = 'c', ''
        end
    else
        fields[#fields + 1], fields[#fields + 2] = 'c', ''
    end
    return fields, n
end

local function write_release(meta, fields, n)
    redis.call('HSET', meta, unpack(fields))
    if n == 1 then
        keep(meta, AUX_TAIL_MS)
    end
end

local function record_release(meta, token, owner, shared)
    write_release(meta, release_fields(meta, token, owner, shared))
end

-- Whether `owner` made one of the RECENT_RELEASES latest releases (record_release). (The slot
-- names are made here, on this rare path: top-level code runs on every call of a script.)
local function released_recently(meta, owner)
    local mark = release_mark(owner)
    local slots = {}
    for i = 0, RECENT_RELEASES - 1 do
        slots[#slots + 1] = 'r' .. i
    end
    for _, seen in ipairs(redis.call('HMGET', meta, unpack(slots))) do
        if seen == mark then
            return true
        end
    end
    return false
end

-- Owners that gave up (a cancelled or timed-out acquisition, a task that ended holding the
-- lock, a failed RedLock round) are remembered in `done`, a ZSET scored by server time (µs):
-- an attempt of theirs that reaches the server late (a client retrying after a lost reply, a
-- slow network) is refused. Each is kept for AUX_TAIL_MS, as long as any trace a re-sent
-- command needs; DONE_CAP bounds the set under a storm of give-ups on one name (the oldest go
-- first). It used to keep the last 64 only: a burst of give-ups on one name — contenders
-- timing out, RedLock rounds failing — forgot a fence while its attempt could still land.
local DONE_CAP = 1024

local function mark_done(done, owner, now)
    redis.call('ZADD', done, now, owner)
    redis.call('ZREMRANGEBYSCORE', done, '-inf', '(' .. int(now - AUX_TAIL_MS * 1000))
    redis.call('ZREMRANGEBYRANK', done, 0, -(DONE_CAP + 1))
    keep(done, AUX_TAIL_MS)
end

local function is_done(done, owner)
    return redis.call('ZSCORE', done, owner) ~= false
end

-- Announce `message` on `channel`. A refusal (an ACL user without the lock's channels) does not
-- fail the script half-way: what it wrote stands — a release has freed or handed over the lock
-- whether or not anyone hears of it, and the waiters find out at their next re-check (within
-- the holder's lease). The refusal goes to the server's log.
local function announce(channel, sharded, message)
    local sent = redis.pcall(sharded == '1' and 'SPUBLISH' or 'PUBLISH', channel, message)
    if type(sent) == 'table' and sent.err then
        redis.log(redis.LOG_WARNING, 'redis-locks-async: not announced on a lock channel: '
            .. sent.err)
    end
end

-- A hold that ended at `old_end` ends at `new_end` now (the same clock, any unit): if that is
-- sooner, the waiters — who sleep at most until the end they were last told of — re-check ("r").
-- (An extend or a re-entry to a shorter lease; or a renewal at a lease shortened by a setting
-- given up on before it was sent.) `channel` nil or empty: nothing to announce.
local function announce_if_shorter(channel, sharded, old_end, new_end)
    if channel and channel ~= '' and new_end < old_end then
        announce(channel, sharded, 'r')
    end
end

-- Waiter registrations: `queue` is a ZSET owner -> arrival (server microseconds), and `meta`
-- holds "w:<owner>" -> "<deadline ms>:<lease ms>:<claim ms>:<role>" (role: "" for a plain
-- lock; "r"/"w" for the sides of a read/write lock). A registration is live until its
-- deadline (server time): `grace` ms after the longer of `ttl` (when the current holds end;
-- -1: unknown) and the waiter's own `lease` — so a waiter far back in a line need not refresh
-- it while the holds ahead of it change hands. The waiter's next attempt refreshes it.
-- `register` keeps a registration's first arrival (`at`, default `now`: the arrival of one that
-- is not there) and returns whether it was not there.
local function registration(deadline, lease, claim, role)
    return int(deadline) .. ':' .. int(lease) .. ':' .. int(claim) .. ':' .. (role or '')
end

local function register(meta, queue, owner, now, lease, claim, grace, ttl, role, at)
    local lives = grace + math.max(ttl, lease)
    local added = redis.call('ZADD', queue, 'NX', at or now, owner) == 1
    redis.call('HSET', meta, 'w:' .. owner,
        registration(math.floor(now / 1000) + lives, lease, claim, role))
    keep(queue, lives + AUX_TAIL_MS)
    keep(meta, lives + AUX_TAIL_MS)
    return added
end

-- The arrival a waiter that the server knew says it had (`arrival`, server microseconds, from
-- the reply to its first registration) — never later than `now` — or nil (not known: 0).
local function claimed_arrival(arrival, now)
    arrival = tonumber(arrival)
    if not arrival or arrival <= 0 then
        return nil
    end
    return math.min(arrival, now)
end

-- Register `owner` (see register), a waiter the server knew if `arrival` is its claimed
-- arrival (claimed_arrival): a registration found gone is put back at it — unless `owner`
-- released the lock lately (a late duplicate of an attempt of an owner already served: it
-- goes to the back, like any late attempt). Returns whether it was put back.
local function register_known(meta, queue, owner, now, lease, claim, grace, ttl, arrival)
    local at = claimed_arrival(arrival, now)
    if register(meta, queue, owner, now, lease, claim, grace, ttl, nil, at) and at then
        if not released_recently(meta, owner) then
            return true
        end
        redis.call('ZADD', queue, 'XX', now, owner)
    end
    return false
end

local function unregister(meta, queue, owner)
    if redis.call('ZREM', queue, owner) == 1 then
        redis.call('HDEL', meta, 'w:' .. owner)
    end
end

-- Every owner id of one process begins with the same tag of this many characters
-- (_owners.py, process_tag).
local PROCESS_TAG_LEN = 8

-- Drop every registration of the process whose owner ids begin with `tag`, and tell it with
-- "x:<tag>" (a process that was only paused or cut off registers its waiters again).
local function drop_process(meta, queue, channel, sharded, tag)
    for _, waiter in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
        if string.sub(waiter, 1, PROCESS_TAG_LEN) == tag then
            unregister(meta, queue, waiter)
        end
    end
    announce(channel, sharded, 'x:' .. tag)
end

-- Whether the process that registered `owner` is still there. While a process has waiters for
-- a lock, its subscription hub keeps "<channel>:<process tag>" subscribed on this server, and
-- subscribed it before registering them (_notify.py); a killed process has no subscription
-- left (the server dropped its connection). An error (an ACL without PUBSUB) counts as
-- "there": the claim window decides then, as it does for a paused process.
local function registrant_alive(channel, sharded, owner)
    local reply = redis.pcall('PUBSUB', sharded == '1' and 'SHARDNUMSUB' or 'NUMSUB',
        channel .. ':' .. string.sub(owner, 1, PROCESS_TAG_LEN))
    if type(reply) ~= 'table' or reply.err then
        return true
    end
    return tonumber(reply[2]) ~= 0
end

-- If the last grantee (meta field c, cleared by its release — see record_release) holds
-- nothing any more yet never released — its claim window or its lease ran out: its process
-- died, or was paused that long — that process is taken for dead: every registration of its
-- tag is dropped at once (a killed process with k waiters in line delays the line by one claim
-- window, not k), and "x:<tag>" tells a process that was only paused to register its waiters
-- again. `holds(owner)`: whether
-- owner holds the lock now (expired holds already dropped); nil: nobody holds it (a free lock).
-- Reads meta (type check) in any case.
local function evict_vanished(meta, queue, channel, sharded, holds)
    local grantee = redis.call('HGET', meta, 'c')
    if not grantee or grantee == '' or (holds and holds(grantee)) then
        return
    end
    -- (drop_process reads the queue before anything is written: a queue of the wrong type
    -- fails the script with nothing changed — helper-71: meta's c was cleared first)
    drop_process(meta, queue, channel, sharded, string.sub(grantee, 1, PROCESS_TAG_LEN))
    redis.call('HSET', meta, 'c', '')
end

local function parse_registration(entry)
    local deadline, lease, claim, role = string.match(entry or '', '^(%d+):(%d+):(%d+):?(%a*)$')
    if not deadline then
        return nil
    end
    return tonumber(deadline), tonumber(lease), tonumber(claim), role
end

-- A walk along `queue` to its first live registration (live_head): `index`, where the walk
-- stands (the registrations before it were skipped: their processes are away); `first`, the
-- member at `index` when the caller has just read it (saves reading it again); `present`, per
-- process tag, whether that process is on the server (asked once per script; the process of
-- `me`, which is running this script, is there).
local function new_walk(me, first)
    local walk = {index = 0, first = first, present = {}}
    if me then
        walk.present[string.sub(me, 1, PROCESS_TAG_LEN)] = true
    end
    return walk
end

local function present(walk, channel, sharded, owner)
    local tag = string.sub(owner, 1, PROCESS_TAG_LEN)
    local here = walk.present[tag]
    if here == nil then
        here = registrant_alive(channel, sharded, owner)
        walk.present[tag] = here
    end
    return here
end

-- The first live registration of `queue` from where `walk` stands, as owner, lease ms, claim
-- ms, role — or nil; the walk then stands on it. A registration whose deadline passed (server
-- time) is dropped. One whose process is away (see registrant_alive) is skipped, and its
-- deadline brought within a claim window: a process that is only moving its subscription —
-- its slot migrating to another node, its pub/sub connection being re-made — keeps its place
-- in line (its waiters' next attempts refresh their registrations), and one that died drops
-- out of line within a claim window. (Dropping an away process's registrations at once sent
-- a process caught in a slot migration to the back of a FairLock's line, its own tasks in
-- whatever order they registered again.)
local function live_head(meta, queue, now_ms, channel, sharded, walk)
    while true do
        local head = walk.first or redis.call('ZRANGE', queue, walk.index, walk.index)[1]
        walk.first = nil
        if not head then
            return nil
        end
        local deadline, lease, claim, role = parse_registration(
            redis.call('HGET', meta, 'w:' .. head))
        if not (deadline and deadline >= now_ms) then
            unregister(meta, queue, head)
        elseif present(walk, channel, sharded, head) then
            walk.first = head
            return head, lease, claim, role
        else
            if deadline > now_ms + claim then
                redis.call('HSET', meta, 'w:' .. head,
                    registration(now_ms + claim, lease, claim, role))
            end
            walk.index = walk.index + 1
        end
    end
end

-- Hand what is free to the live registrations at the front of the line, as long as
-- `take(role, granted)` says so (granted: how many so far); `record(head, window, token, role)`
-- stores each grant. Where the front stops at a waiter that may not enter yet, `pass(role)`
-- (optional) says which live registrations behind it may enter all the same (a reader that
-- does not defer to a waiting writer). A grantee gets only its claim window (window =
-- min(claim, lease)) until it confirms by renewing: a waiter that died while registered
-- delays the next one by at most its claim window. One announcement names every grantee:
-- "g:<ttl>:<at>:<owner>:<token>[:...]" (ttl: the shortest window; at: the server's clock in
-- microseconds, from which a grantee that reads the announcement late measures its window);
-- `meta` field c names the (last) grantee, see evict_vanished. Returns how many were granted,
-- and the ttl.
-- `hint` (optional) spares what the caller knows already — every call saved shortens the
-- hand-over, which the waiter sees only once the script is over: hint.fence, the last token
-- recorded in meta (else read, next_fence); hint.walk, the caller's walk to the front of the
-- line (live_head), else one from hint.head, the front of `queue` the caller has just read,
-- and hint.me, the owner running the script (its process is there); hint.limit, the most
-- there can be granted (the line is not read past the last grant, and `pass` is not asked);
-- hint.fields, field/value pairs the caller has to write to meta, written in the grant's own
-- HSET before its fields (so its fence and c win) — when nothing is granted the caller writes
-- them itself.
local function grant_batch(meta, queue, channel, sharded, now, take, record, pass, hint)
    hint = hint or {}
    local now_ms = math.floor(now / 1000)
    local granted, ttl, message, grantee = 0, nil, '', nil
    local token = (hint.fence and math.max(hint.fence + 1, now) or next_fence(meta, now)) - 1
    local function grant(head, lease, claim, role)
        unregister(meta, queue, head)
        local window = math.min(lease, claim)
        ttl = ttl and math.min(ttl, window) or window
        token = token + 1
        record(head, window, token, role)
        grantee = head
        message = message .. ':' .. head .. ':' .. int(token)
        granted = granted + 1
    end
    local head, lease, claim, role
    local walk = hint.walk or new_walk(hint.me, hint.head)
    while not (hint.limit and granted >= hint.limit) do
        head, lease, claim, role = live_head(meta, queue, now_ms, channel, sharded, walk)
        if not head or not take(role, granted) then
            break
        end
        walk.first = nil  -- (unregistered by the grant: the next one stands at its index now)
        grant(head, lease, claim, role)
    end
    if head and pass and not hint.limit then
        for _, owner in ipairs(redis.call('ZRANGE', queue, walk.index + 1, -1)) do
            local deadline
            deadline, lease, claim, role =
                parse_registration(redis.call('HGET', meta, 'w:' .. owner))
            if deadline and deadline >= now_ms and pass(role)
                    and present(walk, channel, sharded, owner) then
                grant(owner, lease, claim, role)
            end
        end
    end
    if granted > 0 then
        local fields = hint.fields or {}
        local n = #fields
        fields[n + 1], fields[n + 2] = 'fence', int(token)
        fields[n + 3], fields[n + 4] = 'c', grantee
        redis.call('HSET', meta, unpack(fields))
        keep(meta, ttl + AUX_TAIL_MS)
        announce(channel, sharded, 'g:' .. int(ttl) .. ':' .. int(now) .. message)
    end
    return granted, ttl
end

-- Hand `lock` (a HASH: owner, token) to the oldest waiter whose registration is live (see
-- grant_batch; `hint` as there, its limit set here). Returns the claim window granted, or nil
-- when nobody live waits (the lock is then left free).
local function hand_over(lock, meta, queue, channel, sharded, now, hint)
    hint = hint or {}
    hint.limit = 1
    local granted, ttl = grant_batch(meta, queue, channel, sharded, now,
        function(_, count) return count == 0 end,
        function(head, window, token)
            redis.call('HSET', lock, 'owner', head, 'token', int(token))
            redis.call('PEXPIRE', lock, window)
        end, nil, hint)
    return granted > 0 and ttl or nil
end

-- What an attempt on an existing (held) `lock` HASH answers: the caller's own hold (handed
-- over while it waited, or taken by an earlier run of the same call), a foreign hash, or
-- "held by another" — registering the caller in "wait" mode; `arrival` (optional, see
-- fair_acquire.lua) puts a registration the server dropped back in its place, answering -3.
-- Shared by the lock and fair lock.
local function attempt_held(lock, meta, queue, done, me, lease, mode, grace, claim, arrival)
    local held = redis.call('HMGET', lock, 'owner', 'token')
    if held[1] == me then
        return {1, tonumber(held[2]), redis.call('HLEN', lock) - 1, redis.call('PTTL', lock)}
    end
    if not held[1] then
        return {-2, 1, 0, 0}
    end
    local pttl = redis.call('PTTL', lock)
    if mode == 'wait' then
        if is_done(done, me) then
            return {-1, 0, 0, 0}
        end
        redis.call('HGET', meta, 'fence')  -- reads meta before the first write (type check)
        local now = now_us()
        if register_known(meta, queue, me, now, lease, claim, grace, pttl, arrival) then
            return {-3, now, 0, pttl}
        end
        return {0, now, 0, pttl}
    end
    return {0, 0, 0, pttl}
end

-- What a release or abandon by an owner that holds nothing (any more) answers: an abandon
-- drops its registration and fences its late attempts; a re-sent final release finds its own
-- trace in `meta` ("released"; record_release); anything else finds the lease gone (-1).
local function release_unheld(meta, queue, done, me, mode, now)
    if mode == 'abandon' then
        unregister(meta, queue, me)
        mark_done(done, me, now)
        return {0, 0}
    end
    if mode == 'final' and released_recently(meta, me) then
        return {0, 0}
    end
    return {-1, 0}
end

-- Read/write locks (``ReadWriteLock``) keep one HASH per name: the writer in fields w (owner),
-- wt (token), wx (expiry, server ms) and we (its re-entries, ",e1,e2,"); each reader in a field
-- "r:<owner>" -> "<expiry ms>:<token>:<re-entries>". Every hold has its own expiry; the key's
-- TTL is kept at least as long as the longest. rw_read reads the holds that are live at
-- `now_ms` (read-only): the writer's owner (or nil), its token and expiry, how many readers
-- there are and when the first hold ends — and the fields of the holds that expired. A hash
-- with anything else in it (another kind's lock, a user's data) is `foreign`. rw_state is
-- rw_read that also drops the expired holds (nothing of a foreign hash is dropped: the caller
-- refuses it).
local function rw_read(lock, now_ms)
    local fields = redis.call('HGETALL', lock)
    local state = {readers = 0, expired = {}}
    local writer_fields = 0
    for i = 1, #fields, 2 do
        local field, value = fields[i], fields[i + 1]
        if field == 'w' then
            state.writer, writer_fields = value, writer_fields + 1
        elseif field == 'wt' then
            state.token, writer_fields = tonumber(value), writer_fields + 1
        elseif field == 'wx' then
            state.expiry, writer_fields = tonumber(value), writer_fields + 1
        elseif string.sub(field, 1, 2) == 'r:' and string.match(value, '^%d+:%d+:') then
            local expiry = tonumber(string.match(value, '^(%d+)'))
            if expiry >= now_ms then
                state.readers = state.readers + 1
                state.first_end = math.min(state.first_end or expiry, expiry)
            else
                state.expired[#state.expired + 1] = field
            end
        elseif field ~= 'we' then  -- ('we': the writer's entries, read where needed)
            -- A field no read/write lock writes (a Lock's "owner", a user's own data): not
            -- ours, and nothing of it is touched.
            state.foreign = true
            return state
        end
    end
    if writer_fields ~= 0 and not (writer_fields == 3 and state.token and state.expiry) then
        state.foreign = true  -- a writer's fields, but not as a read/write lock writes them
        return state
    end
    if state.writer and not (state.expiry and state.expiry >= now_ms) then
        state.writer, state.writer_expired = nil, true
    elseif state.writer then
        state.first_end = math.min(state.first_end or state.expiry, state.expiry)
    end
    return state
end

local function rw_state(lock, now_ms)
    local state = rw_read(lock, now_ms)
    if state.foreign then
        return state
    end
    for _, field in ipairs(state.expired) do
        redis.call('HDEL', lock, field)
    end
    if state.writer_expired then
        redis.call('HDEL', lock, 'w', 'wt', 'wx', 'we')
    end
    return state
end

-- Whether a live writer is registered in line (readers then wait, with writer preference); a
-- writer whose process is gone does not count (see registrant_alive).
local function rw_writer_waiting(meta, queue, now_ms, channel, sharded)
    for _, owner in ipairs(redis.call('ZRANGE', queue, 0, -1)) do
        local deadline, _, _, role = parse_registration(redis.call('HGET', meta, 'w:' .. owner))
        if role == 'w' and deadline >= now_ms and registrant_alive(channel, sharded, owner) then
            return true
        end
    end
    return false
end

-- Hand the lock to what the front of the line may have now: a writer when nothing is held, or
-- the readers at the front (one after the other, up to the first writer) when no writer holds
-- it — and then every reader further back that does not defer to waiting writers (role "R":
-- registered with prefer_writers off; it would enter by itself, so it is not kept waiting
-- behind a writer that waits for the readers) — in one announcement (see grant_batch). Meta
-- field R marks that such readers registered: without it the line is not searched for them.
-- Returns how many were granted.
local function rw_admit(lock, meta, queue, channel, sharded, now, state)
    if state.writer then
        return 0
    end
    local now_ms = math.floor(now / 1000)
    local passing = nil
    if redis.call('HGET', meta, 'R') then
        passing = function(role)
            return role == 'R' and not state.writer
        end
    end
    return (grant_batch(meta, queue, channel, sharded, now,
        function(role, count)
            if role == 'w' then
                return state.readers == 0 and count == 0
            end
            return not state.writer
        end,
        function(head, window, token, role)
            if role == 'w' then
                redis.call('HSET', lock, 'w', head, 'wt', int(token), 'wx',
                    int(now_ms + window), 'we', ',')
                state.writer = head
            else
                redis.call('HSET', lock, 'r:' .. head,
                    int(now_ms + window) .. ':' .. int(token) .. ':,')
                state.readers = state.readers + 1
            end
            keep(lock, window)
        end,
        passing))
end

-- Whether a semaphore's `holders` is someone else's sorted set. Asked only when no permit
-- count is recorded (a new semaphore, whose holders set is empty): members that are not owner
-- ids (40 hex digits) are foreign data, which no script touches.
local function sem_foreign(holders)
    for _, member in ipairs(redis.call('ZRANGE', holders, 0, -1)) do
        if #member ~= 40 or string.find(member, '[^0-9a-f]') then
            return true
        end
    end
    return false
end

-- Semaphores (``Semaphore``) keep their holders in a ZSET owner -> expiry (server ms) under the
-- semaphore's name; `meta` holds the permit count ("permits"), the fence, and each holder's
-- token ("t:<owner>").
-- sem_expire drops the holders whose lease ended before `now_ms`, and their tokens with them
-- (a permit that ended without a release — its lease lost, its process killed — left its
-- token in meta for as long as the semaphore stayed in use: one field per lost permit).
local SEM_EXPIRE_BATCH = 512  -- (unpack's arguments go on the Lua stack: bounded)

local function sem_expire(holders, meta, now_ms)
    while true do
        -- (ZRANGE BYSCORE, not ZRANGEBYSCORE: one command less for an ACL to allow)
        local gone = redis.call('ZRANGE', holders, '-inf', now_ms - 1, 'BYSCORE',
            'LIMIT', 0, SEM_EXPIRE_BATCH)
        if #gone == 0 then
            return
        end
        local tokens = {}
        for i, owner in ipairs(gone) do
            tokens[i] = 't:' .. owner
        end
        redis.call('ZREM', holders, unpack(gone))
        redis.call('HDEL', meta, unpack(tokens))
    end
end

-- sem_admit drops expired holders and hands the free permits to the live registrations at the
-- front of the line, one announcement naming them all. Returns how many.
local function sem_admit(holders, meta, queue, channel, sharded, now, permits)
    local now_ms = math.floor(now / 1000)
    sem_expire(holders, meta, now_ms)
    local free = permits - redis.call('ZCARD', holders)
    return (grant_batch(meta, queue, channel, sharded, now,
        function(_, count) return count < free end,
        function(head, window, token)
            redis.call('ZADD', holders, now_ms + window, head)
            redis.call('HSET', meta, 't:' .. head, int(token))
            keep(holders, window)
        end))
end
