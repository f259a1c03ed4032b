-- wait.lua: the claim of a request that waits for its key (Store::claim_waiting): the claim itself
-- (SET key <record> NX PX <lease> GET, what every other claim sends without a script) and, when
-- the key holds another owner's record in flight, that record marked as waited for in the same
-- step, so that its completion or release tells the waiting requests (SPUBLISH on
-- KEYS[1] .. ':settled'; src/store/redis/notices.rs). Reading and marking at once is what makes
-- it safe: a record the waiter finds in flight is marked before any completion can run.
--
-- KEYS[1]  the record
-- ARGV[1]  the new in-flight record    ARGV[2]  lease (ms)
-- ARGV[3]  the layout's magic and version (4 bytes; src/store/redis/record.rs)
-- ARGV[4]  the same of the layout before policy tags (an earlier release's records, whose head,
--          state and deadline are where this layout has them: marked alike)
--
-- The mark is the lowest bit of the in-flight deadline, which owners write even: a reader of any
-- release sees a lease 1 ms longer; complete.lua and release.lua publish when it is set, and
-- renew.lua keeps it. The record's TTL is not touched.
--
-- Answers what the claim answers: nil when the key was free and is now claimed, else the record
-- found (marked, if this marked it).
local found = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if not found then
  return false
end
local layout = string.sub(found, 1, 4)
if #found < 6 or (layout ~= ARGV[3] and layout ~= ARGV[4]) then
  return found
end
-- The head: magic, version, owner length (u16 BE), owner; then the state and 8 deadline bytes.
local n = 6 + string.byte(found, 5) * 256 + string.byte(found, 6)
if #found < n + 9 or string.byte(found, n + 1) ~= 70 then -- not 'F'
  return found
end
local last = string.byte(found, n + 9)
if last % 2 == 1 then
  return found
end
local marked = string.char(last + 1)
redis.call('SETRANGE', KEYS[1], n + 8, marked)
return string.sub(found, 1, n + 8) .. marked .. string.sub(found, n + 10)
