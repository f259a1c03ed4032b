-- renew.lua: extend the lease of an in-flight record, if the caller still owns it.
--
-- KEYS[1]  the record
-- ARGV[1]  the caller's head (magic, version, owner; see complete.lua)
-- ARGV[2]  'F' and the new lease deadline (9 bytes)    ARGV[3]  lease (ms), counted from now
--
-- A record a request waits for keeps its mark (the lowest bit of the deadline, set by wait.lua; the
-- owner's new deadline is even), so its completion still tells that request.
--
-- Returns 1 when the lease was extended, 0 when the caller lost its claim.
local n = #ARGV[1]
local ok, found = pcall(redis.call, 'GETRANGE', KEYS[1], 0, n + 8)
if ok and string.sub(found, 1, n + 1) == ARGV[1] .. 'F' then
  local state = ARGV[2]
  if (string.byte(found, n + 9) or 0) % 2 == 1 then
    local last = string.byte(state, 9)
    state = string.sub(state, 1, 8) .. string.char(last - last % 2 + 1)
  end
  redis.call('SETRANGE', KEYS[1], n, state)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
