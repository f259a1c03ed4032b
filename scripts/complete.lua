-- complete.lua: store the result of a claimed record, if the caller still owns it.
--
-- A record is one string (layout in src/store/redis/record.rs): a head of magic, layout version and
-- owner; a state byte ('F' in flight, 'C' completed) and a deadline (the lease's end in flight,
-- the retention's end once completed); the fingerprint and its policy tag (32 and 8 bytes); and,
-- once completed, the stored payload.
-- The claim itself is not a script: it is `SET key <in-flight record> NX PX <lease> GET`.
--
-- KEYS[i]    a record; one or many (completions sent together are one call: see
--            src/store/redis/coalesce.rs). For record i, from j = 4 * (i - 1):
-- ARGV[j+1]  the caller's head: the layout's magic and version (4 bytes), the owner's length
--            (2 bytes, big-endian) and the owner
-- ARGV[j+2]  'C' and the retention's deadline (9 bytes)
-- ARGV[j+3]  the payload
-- ARGV[j+4]  retention (ms)
--
-- Publishes (SPUBLISH, an empty message) on KEYS[i] .. ':settled' when it completes a record that a
-- request waits for (src/store/redis/notices.rs): a shard channel in the record's slot. A waiter
-- marks the record with each of its reads (wait.lua: the lowest bit of the in-flight deadline,
-- which owners write even), so a completion nobody waits for publishes nothing.
--
-- Answers, per record, 1 when the record is completed by this owner (also when it already was, so
-- a completion re-sent after a dropped connection succeeds; the payload is then left as it was),
-- 0 when the owner lost its claim (lease expired, purged, or claimed again by another owner):
-- the newer owner's record is never overwritten. One record: that flag; several: an array of them,
-- in the order of KEYS. Each record is decided on its own: one lost claim fails no other.
local function complete(key, head, state, payload, retention)
  local n = #head
  -- As much of the record as an in-flight one has (the head, 9 bytes of state and deadline, the
  -- 32-byte fingerprint and 8-byte policy tag), so a large record of another owner is not copied.
  local ok, found = pcall(redis.call, 'GETRANGE', key, 0, n + 48)
  if not ok or string.find(found, head, 1, true) ~= 1 then -- not a string, or not this owner's
    return 0
  end
  local current = string.byte(found, n + 1)
  if current == 67 then -- 'C'
    -- Completed already, by this owner: the retention restarts. Writing again also matters to a
    -- WAIT sent after this script on the same connection (RedisStore::with_replica_acks): it
    -- counts the connection's own writes, and the first completion may have gone over another one.
    redis.call('SETRANGE', key, n, state)
    redis.call('PEXPIRE', key, retention)
    return 1
  end
  if current ~= 70 or #found ~= n + 49 then -- not 'F', or not an in-flight record's length
    return 0
  end
  -- One SET of the whole completed record: a string written once takes the allocation its
  -- length needs (APPEND would leave it room for as many bytes again).
  redis.call('SET', key, head .. state .. string.sub(found, n + 10) .. payload, 'PX', retention)
  -- The deadline's last byte, odd when a request waits for the record (wait.lua).
  if string.byte(found, n + 9) % 2 == 1 then
    redis.call('SPUBLISH', key .. ':settled', '')
  end
  return 1
end

if #KEYS == 1 then
  return complete(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
end
local flags = {}
for i, key in ipairs(KEYS) do
  local j = 4 * (i - 1)
  flags[i] = complete(key, ARGV[j + 1], ARGV[j + 2], ARGV[j + 3], ARGV[j + 4])
end
return flags
