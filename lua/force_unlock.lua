-- force_unlock.lua: an operator frees a lock whoever holds it (the `redis-locks force-unlock`
-- command): every hold is dropped, the fence floor is kept, and the waiters are told to
-- re-check. The holders are not told: each finds its lease lost at its next renewal (or
-- release), exactly as if its lease had expired.
--
-- KEYS[1]  the lock: a Lock/FairLock HASH (owner, token, "e:<id>"), a ReadWriteLock HASH
--          (w, wt, wx, we, "r:<owner>"), or a Semaphore ZSET of holders (owner -> expiry ms)
-- KEYS[2]  the meta HASH of that kind (fence; a semaphore's "t:<owner>" tokens)
-- KEYS[3]  guard: never written (_keys.py). A cluster node migrating the slot finds it missing
--          and refuses the script before it runs (TRYAGAIN), instead of failing it half-way
--          at a key the script itself emptied
-- ARGV[1]  kind KEYS[1] must be: "lock", "rw" or "sem"
-- ARGV[2]  channel to announce on; ARGV[3] "1" to announce with SPUBLISH, else PUBLISH
-- returns  {n, owner1, token1, ..., ownerN, tokenN}  KEYS[1] was deleted; these n holds were
--          live (n = 0: it held only expired holds, or did not exist — then nothing changed)
--          {-2}  KEYS[1] exists but is not a lock of kind ARGV[1]; nothing changed
-- The fence in KEYS[2] is raised to the highest token removed (never lowered); "last" is left
-- alone, so a removed holder's release reports its lease lost; a pending grantee (field c) is
-- forgotten, so its process is not taken for dead (prelude.lua, evict_vanished). The
-- announcement is not a grant nor a count of freed units: every active waiter re-checks (see
-- _parking.py).
-- A KEYS[2] of another type fails the script with WRONGTYPE before anything is written.

local lock, meta = KEYS[1], KEYS[2]
local kind, channel, sharded = ARGV[1], ARGV[2], ARGV[3]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local ktype = redis.call('TYPE', lock)['ok']
if ktype == 'none' then
    return {0}
end

local removed, top = {0}, nil
local function add(owner, token)
    removed[1] = removed[1] + 1
    removed[#removed + 1] = owner
    removed[#removed + 1] = token
    local value = tonumber(token)
    if value and (not top or value > top) then
        top = value
    end
end

local fence = tonumber(redis.call('HGET', meta, 'fence') or '0')  -- type check before writing
if kind == 'sem' then
    if ktype ~= 'zset' then
        return {-2}
    end
    local held = redis.call('ZRANGE', lock, 0, -1, 'WITHSCORES')
    for i = 1, #held, 2 do
        local owner = held[i]
        if tonumber(held[i + 1]) >= now_ms then
            add(owner, redis.call('HGET', meta, 't:' .. owner) or '0')
        end
        redis.call('HDEL', meta, 't:' .. owner)
    end
else
    if ktype ~= 'hash' then
        return {-2}
    end
    local fields = redis.call('HGETALL', lock)
    local f = {}
    for i = 1, #fields, 2 do
        local field = fields[i]
        if kind == 'lock' then
            if field ~= 'owner' and field ~= 'token' and string.sub(field, 1, 2) ~= 'e:' then
                return {-2}
            end
        elseif field ~= 'w' and field ~= 'wt' and field ~= 'wx' and field ~= 'we'
                and string.sub(field, 1, 2) ~= 'r:' then
            return {-2}
        end
        f[field] = fields[i + 1]
    end
    if kind == 'lock' then
        if not (f['owner'] and f['token']) then
            return {-2}
        end
        add(f['owner'], f['token'])
    else
        if f['w'] and tonumber(f['wx'] or '0') >= now_ms then
            add(f['w'], f['wt'] or '0')
        end
        for i = 1, #fields, 2 do
            local field, value = fields[i], fields[i + 1]
            if string.sub(field, 1, 2) == 'r:' then
                local expiry, token = string.match(value, '^(%d+):(%d+)')
                if expiry and tonumber(expiry) >= now_ms then
                    add(string.sub(field, 3), token)
                end
            end
        end
    end
end

redis.call('DEL', lock)
if redis.call('HGET', meta, 'c') then
    redis.call('HSET', meta, 'c', '')  -- a removed grantee did not vanish (evict_vanished)
end
if top and top > fence then
    redis.call('HSET', meta, 'fence', int(top))
    keep(meta, AUX_TAIL_MS)
end
announce(channel, sharded, 'force')
return removed
