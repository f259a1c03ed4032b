-- claim.lua: claim an idempotency record, or report what is there, in one round trip.
--
-- A record is one hash, so every key a record has sits in one cluster slot. Fields:
--   v        record layout version        state    'in_flight' | 'completed'
--   owner    the claiming owner's token   fp       request fingerprint (32 raw bytes)
--   payload  the stored result (completed records only)
-- The key's own TTL is the lease while in flight and the retention once completed.
--
-- KEYS[1]  the record
-- ARGV[1]  owner token    ARGV[2]  fingerprint    ARGV[3]  lease (ms)    ARGV[4]  layout version
--
-- Returns one of
--   {'claimed'}                    the caller owns the record now (also when it already did:
--                                  a claim re-sent by the client library must not conflict
--                                  with itself)
--   {'completed', payload}         replay this
--   {'in_flight', lease_left_ms}   another owner is running
--   {'mismatch'}                   same key, different fingerprint
--   {'corrupt', reason}            the key holds something this version cannot read
local ok, fields = pcall(redis.call, 'HMGET', KEYS[1], 'v', 'state', 'owner', 'fp', 'payload')
if not ok then
  return {'corrupt', 'the key holds a ' .. redis.call('TYPE', KEYS[1])['ok'] .. ', not a record'}
end
local version, state, owner, fp, payload = fields[1], fields[2], fields[3], fields[4], fields[5]

if not version then
  if redis.call('EXISTS', KEYS[1]) == 1 then
    return {'corrupt', 'the key holds a hash that is not a record'}
  end
  redis.call('HSET', KEYS[1], 'v', ARGV[4], 'state', 'in_flight', 'owner', ARGV[1], 'fp', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'claimed'}
end

if version ~= ARGV[4] then
  return {'corrupt', 'record layout version ' .. version .. ', this version reads ' .. ARGV[4]}
end
if state == 'in_flight' and owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'claimed'}
end
if fp ~= ARGV[2] then
  return {'mismatch'}
end
if state == 'in_flight' then
  local left = redis.call('PTTL', KEYS[1])
  if left < 0 then
    return {'corrupt', 'an in-flight record without a lease'}
  end
  return {'in_flight', left}
end
if state == 'completed' and payload then
  return {'completed', payload}
end
return {'corrupt', 'unknown record state'}
