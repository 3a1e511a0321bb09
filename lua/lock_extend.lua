-- lock_extend.lua: renew the lease of a held lock (one call per hold; renewals are pipelined).
--
-- KEYS[1]  the lock HASH (owner, count, token)
-- ARGV[1]  owner id that holds it
-- ARGV[2]  new lease in milliseconds, counted from now (> 0)
-- returns  1  renewed
--          0  ARGV[1] does not hold the lock any more (expired or taken over): the lease is lost

if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
    return 0
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
