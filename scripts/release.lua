-- release.lua: delete an in-flight record, if the caller still owns it, so a retry runs again.
--
-- KEYS[1]  the record
-- ARGV[1]  the caller's head (magic, version, owner; see complete.lua)
--
-- Publishes (SPUBLISH, an empty message) on KEYS[1] .. ':settled' when it deletes the record, so a
-- request waiting for it claims the key (src/store/redis/notices.rs).
--
-- Returns 1 when the record was deleted, 0 when the caller does not own an in-flight record.
local ok, head = pcall(redis.call, 'GETRANGE', KEYS[1], 0, #ARGV[1])
if ok and head == ARGV[1] .. 'F' then
  redis.call('DEL', KEYS[1])
  redis.call('SPUBLISH', KEYS[1] .. ':settled', '')
  return 1
end
return 0
