-- complete.lua: store the result of a claimed record, if the caller still owns it.
--
-- KEYS[1]  the record
-- ARGV[1]  owner token    ARGV[2]  payload    ARGV[3]  retention (ms)
--
-- Returns 1 when the record is completed by this owner (also when it already was, so a
-- completion re-sent after a dropped connection succeeds), 0 when the owner lost its claim
-- (lease expired, purged, or claimed again by another owner): the newer owner's record is
-- never overwritten.
local state, owner = unpack(redis.call('HMGET', KEYS[1], 'state', 'owner'))
if owner ~= ARGV[1] then
  return 0
end
if state == 'completed' then
  return 1
end
if state ~= 'in_flight' then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'completed', 'payload', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
