-- renew.lua: extend the lease of an in-flight record, if the caller still owns it.
--
-- KEYS[1]  the record
-- ARGV[1]  the caller's head (magic, version, owner; see complete.lua)
-- ARGV[2]  'F' and the new lease deadline (9 bytes)    ARGV[3]  lease (ms), counted from now
--
-- Returns 1 when the lease was extended, 0 when the caller lost its claim.
local ok, head = pcall(redis.call, 'GETRANGE', KEYS[1], 0, #ARGV[1])
if ok and head == ARGV[1] .. 'F' then
  redis.call('SETRANGE', KEYS[1], #ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
