-- complete.lua: store the result of a claimed record, if the caller still owns it.
--
-- A record is one string (layout in src/store/redis.rs): a head of magic and layout version, a
-- state byte ('F' in flight, 'C' completed) and the owner; then the fingerprint, the lease
-- deadline, and, once completed, the stored payload. The claim itself is not a script: it is
-- `SET key <in-flight record> NX PX <lease> GET`, one native command.
--
-- KEYS[1]  the record
-- ARGV[1]  the caller's in-flight head (magic, version, 'F', owner)
-- ARGV[2]  payload    ARGV[3]  retention (ms)
--
-- Returns 1 when the record is completed by this owner (also when it already was, so a
-- completion re-sent after a dropped connection succeeds), 0 when the owner lost its claim
-- (lease expired, purged, or claimed again by another owner): the newer owner's record is
-- never overwritten.
local ok, head = pcall(redis.call, 'GETRANGE', KEYS[1], 0, #ARGV[1] - 1)
if not ok then
  return 0
end
if head == string.sub(ARGV[1], 1, 4) .. 'C' .. string.sub(ARGV[1], 6) then
  return 1
end
if head ~= ARGV[1] then
  return 0
end
redis.call('SETRANGE', KEYS[1], 4, 'C')
redis.call('APPEND', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
