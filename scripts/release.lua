-- release.lua: delete an in-flight record, if the caller still owns it, so a retry runs again.
--
-- KEYS[1]  the record
-- ARGV[1]  owner token
--
-- Returns 1 when the record was deleted, 0 when the caller does not own an in-flight record.
local state, owner = unpack(redis.call('HMGET', KEYS[1], 'state', 'owner'))
if state == 'in_flight' and owner == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
