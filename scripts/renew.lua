-- renew.lua: extend the lease of an in-flight record, if the caller still owns it.
--
-- KEYS[1]  the record
-- ARGV[1]  owner token    ARGV[2]  lease (ms), counted from now
--
-- Returns 1 when the lease was extended, 0 when the caller lost its claim.
local state, owner = unpack(redis.call('HMGET', KEYS[1], 'state', 'owner'))
if state == 'in_flight' and owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
