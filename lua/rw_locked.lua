-- rw_locked.lua: whether a read/write lock is held, as the server sees it now (read-only).
--
-- KEYS[1]  the lock HASH (see rw_acquire.lua)
-- ARGV[1]  "w": is it held at all (a writer could not take it); "r": is it held for writing
--          (a reader could not take it, writer preference aside)
-- returns  1 held, 0 not
--          -2 KEYS[1] is a hash of another kind of lock, or of no lock at all (a field no
--             read/write lock writes) — as rw_acquire.lua refuses it
-- A key of another type fails the script with WRONGTYPE.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = rw_read(KEYS[1], now_ms)
if state.foreign then
    return -2
end
if state.writer or (ARGV[1] == 'w' and state.readers > 0) then
    return 1
end
return 0
