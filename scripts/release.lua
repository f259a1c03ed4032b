-- release.lua: delete an in-flight record, if the caller still owns it, so a retry runs again.
--
-- KEYS[1]  the record
-- ARGV[1]  the caller's head (magic, version, owner; see complete.lua)
--
-- Returns 1 when the record was deleted, 0 when the caller does not own an in-flight record.
local ok, head = pcall(redis.call, 'GETRANGE', KEYS[1], 0, #ARGV[1])
if ok and head == ARGV[1] .. 'F' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
