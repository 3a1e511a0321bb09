-- sem_renew.lua: renew one permit's lease; also how a waiter confirms a hand-over
-- (redis-locks-async `Semaphore`; pipelined by the lease keeper).
--
-- KEYS[1]  holders ZSET; KEYS[2] meta HASH                 -- as in sem_acquire.lua
--          (KEYS[2] may be left out: a cluster slot migration split the two between nodes;
--          meta then keeps the TTL it has, a lease and a minute at least)
-- ARGV[1]  owner id holding the permit; ARGV[2] new lease in milliseconds from now (> 0)
-- ARGV[3]  optional: the semaphore's channel — a permit made shorter than it was is announced
--          there ("r": re-check), see prelude.lua, announce_if_shorter
-- ARGV[4]  "1" to announce with SPUBLISH (sharded pub/sub), anything else PUBLISH
-- returns  1 renewed, 0 ARGV[1] holds no permit any more (its lease ended): lost
-- Idempotent. Keeps the semaphore's keys alive as long as the lease (meta: if it is a hash).

local holders, meta, me = KEYS[1], KEYS[2], ARGV[1]
local lease = tonumber(ARGV[2])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = redis.call('ZSCORE', holders, me)
if not expiry or tonumber(expiry) < now_ms then
    return 0
end
announce_if_shorter(ARGV[3], ARGV[4], tonumber(expiry), now_ms + lease)
redis.call('ZADD', holders, 'XX', now_ms + lease, me)
-- Always written, even when it changes nothing (run in the same server millisecond as the
-- hand-over or acquisition it renews, the ZADD above is not propagated): replica sync's WAIT
-- follows this script on its connection and counts the replicas that acknowledged that
-- connection's last *propagated* write — with nothing propagated here, an earlier one.
redis.call('PEXPIRE', holders, math.max(redis.call('PTTL', holders), lease))
if meta and redis.call('TYPE', meta)['ok'] == 'hash' then
    -- (a key of another type put at meta's name is not ours: it is never given a TTL
    -- (helper-71); the permit's release fails naming it, and changes nothing)
    keep(meta, lease + AUX_TAIL_MS)
end
return 1
