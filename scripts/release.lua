-- release.lua: delete an in-flight record, if the caller still owns it, so a retry runs again.
--
-- KEYS[1]  the record
-- ARGV[1]  the caller's head (magic, version, owner; see complete.lua)
--
-- Publishes (SPUBLISH, an empty message) on KEYS[1] .. ':settled' when it deletes a record that a
-- request waits for (marked by wait.lua: see complete.lua), so that request claims the key
-- (src/store/redis/notices.rs).
--
-- Returns 1 when the record was deleted, 0 when the caller does not own an in-flight record.
local n = #ARGV[1]
-- The head, the state and the deadline, whose last byte is odd when a request waits (wait.lua).
local ok, found = pcall(redis.call, 'GETRANGE', KEYS[1], 0, n + 8)
if ok and string.sub(found, 1, n + 1) == ARGV[1] .. 'F' then
  redis.call('DEL', KEYS[1])
  if (string.byte(found, n + 9) or 0) % 2 == 1 then
    redis.call('SPUBLISH', KEYS[1] .. ':settled', '')
  end
  return 1
end
return 0
