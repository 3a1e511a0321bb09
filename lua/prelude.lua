-- prelude.lua: functions shared by every script of redis-locks-async. Not a script by itself:
-- _scripts.py prepends it to each script before computing the script's SHA1, so each script
-- reads as if these were built in. Nothing here reads KEYS or ARGV.
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

-- The index of the first key whose type is neither 'none' nor the expected one, or nil.
-- Scripts call it before their first write, so a wrong-type key never leaves a partial write.
local function wrong_type(keys, types)
    for i, want in ipairs(types) do
        local got = redis.call('TYPE', keys[i])['ok']
        if got ~= 'none' and got ~= want then
            return i
        end
    end
    return nil
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

-- The next fencing token of a lock: above every token the counter remembers, and never below
-- the server's clock in microseconds, so tokens keep increasing after the counter is lost
-- (restart without persistence, eviction, failover to a replica that missed writes), within
-- the servers' clock skew. `meta` is a HASH with field `fence`.
local function next_fence(meta)
    local last = tonumber(redis.call('HGET', meta, 'fence') or '0')
    local token = math.max(last + 1, now_us())
    redis.call('HSET', meta, 'fence', int(token))
    keep(meta, AUX_TAIL_MS)
    return token
end

-- Owners whose hold ended (released, or abandoned by a cancelled acquisition) are remembered
-- in `done`, a ZSET of the most recent DONE_KEEP owners: a re-sent release then reports
-- "released" instead of "lost", and a late duplicate of an acquisition cannot take the lock
-- for an owner that already gave up.
local DONE_KEEP = 64

local function mark_done(done, owner)
    redis.call('ZADD', done, now_us(), owner)
    redis.call('ZREMRANGEBYRANK', done, 0, -(DONE_KEEP + 1))
    keep(done, AUX_TAIL_MS)
end

local function is_done(done, owner)
    return redis.call('ZSCORE', done, owner) ~= false
end

local function announce(channel, sharded, message)
    if sharded == '1' then
        redis.call('SPUBLISH', channel, message)
    else
        redis.call('PUBLISH', channel, message)
    end
end

-- Waiter registrations: `queue` is a ZSET owner -> arrival (server microseconds), and `meta`
-- holds "w:<owner>" -> "<deadline ms>:<lease ms>:<claim ms>". A registration is live until its
-- deadline (server time); the waiter's next attempt refreshes it.
local function register(meta, queue, owner, lease, claim, lives)
    local now = now_us()
    local now_ms = math.floor(now / 1000)
    redis.call('ZADD', queue, 'NX', now, owner)
    redis.call('HSET', meta, 'w:' .. owner,
        int(now_ms + lives) .. ':' .. int(lease) .. ':' .. int(claim))
    keep(queue, lives + AUX_TAIL_MS)
    keep(meta, lives + AUX_TAIL_MS)
end

local function unregister(meta, queue, owner)
    if redis.call('ZREM', queue, owner) == 1 then
        redis.call('HDEL', meta, 'w:' .. owner)
    end
end

-- Hand `lock` (a HASH: owner, token) to the oldest waiter whose registration is live, dropping
-- dead registrations on the way, and announce it: "g:<ttl ms>:<owner>:<token>". The grantee
-- gets only its claim window (ttl = min(claim, lease)) until it confirms by renewing: a waiter
-- that died while registered delays the next one by at most its claim window. Returns the new
-- owner, or nil when nobody live waits (the lock is then left free).
local function hand_over(lock, meta, queue, channel, sharded)
    local now_ms = math.floor(now_us() / 1000)
    while true do
        local head = redis.call('ZRANGE', queue, 0, 0)[1]
        if not head then
            return nil
        end
        local entry = redis.call('HGET', meta, 'w:' .. head)
        redis.call('ZREM', queue, head)
        redis.call('HDEL', meta, 'w:' .. head)
        if entry then
            local deadline, lease, claim = string.match(entry, '^(%d+):(%d+):(%d+)$')
            if deadline and tonumber(deadline) >= now_ms then
                local ttl = math.min(tonumber(lease), tonumber(claim))
                local token = next_fence(meta)
                redis.call('HSET', lock, 'owner', head, 'token', int(token))
                redis.call('PEXPIRE', lock, ttl)
                announce(channel, sharded, 'g:' .. int(ttl) .. ':' .. head .. ':' .. int(token))
                return head
            end
        end
    end
end
