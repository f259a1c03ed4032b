-- complete.lua: store the result of a claimed record, if the caller still owns it.
--
-- A record is one string (layout in src/store/redis.rs): a head of magic, layout version and
-- owner; a state byte ('F' in flight, 'C' completed) and a deadline (the lease's end in flight,
-- the retention's end once completed); the fingerprint; and, once completed, the stored payload.
-- The claim itself is not a script: it is `SET key <in-flight record> NX PX <lease> GET`.
--
-- KEYS[1]  the record
-- ARGV[1]  the caller's head (magic, version, owner)
-- ARGV[2]  'C' and the retention deadline (9 bytes)    ARGV[3]  payload    ARGV[4]  retention (ms)
--
-- Publishes (SPUBLISH, an empty message) on KEYS[1] .. ':settled' when it completes the record, for
-- requests waiting for it (src/store/redis_notices.rs): a shard channel in the record's slot.
--
-- Returns 1 when the record is completed by this owner (also when it already was, so a
-- completion re-sent after a dropped connection succeeds; the payload is then left as it was),
-- 0 when the owner lost its claim (lease expired, purged, or claimed again by another owner):
-- the newer owner's record is never overwritten.
local ok, head = pcall(redis.call, 'GETRANGE', KEYS[1], 0, #ARGV[1])
if not ok then
  return 0
end
if head == ARGV[1] .. 'C' then
  -- Completed already, by this owner: the retention restarts. Writing again also matters to a
  -- WAIT sent after this script on the same connection (RedisStore::with_replica_acks): it counts
  -- the connection's own writes, and the first completion may have gone over another one.
  redis.call('SETRANGE', KEYS[1], #ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return 1
end
if head ~= ARGV[1] .. 'F' then
  return 0
end
redis.call('SETRANGE', KEYS[1], #ARGV[1], ARGV[2])
redis.call('APPEND', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('SPUBLISH', KEYS[1] .. ':settled', '')
return 1
