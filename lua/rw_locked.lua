-- rw_locked.lua: whether a read/write lock is held, as the server sees it now (read-only).
--
-- KEYS[1]  the lock HASH (see rw_acquire.lua)
-- ARGV[1]  "w": is it held at all (a writer could not take it); "r": is it held for writing
--          (a reader could not take it, writer preference aside)
-- returns  1 held, 0 not

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
    local field, value = fields[i], fields[i + 1]
    if field == 'wx' and tonumber(value) >= now_ms then
        return 1
    end
    if ARGV[1] == 'w' and string.sub(field, 1, 2) == 'r:'
            and tonumber(string.match(value, '^(%d+)')) >= now_ms then
        return 1
    end
end
return 0
