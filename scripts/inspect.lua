-- inspect.lua: read a record for operators, without changing it.
--
-- KEYS[1]  the record
-- ARGV[1]  layout version
--
-- Returns {}                                       no record
--         {state, ttl_ms, payload_or_false}        a record
--         {'corrupt', reason}                      something this version cannot read
local ok, fields = pcall(redis.call, 'HMGET', KEYS[1], 'v', 'state', 'payload')
if not ok then
  return {'corrupt', 'the key holds a ' .. redis.call('TYPE', KEYS[1])['ok'] .. ', not a record'}
end
local version, state, payload = fields[1], fields[2], fields[3]
if not version then
  if redis.call('EXISTS', KEYS[1]) == 1 then
    return {'corrupt', 'the key holds a hash that is not a record'}
  end
  return {}
end
if version ~= ARGV[1] then
  return {'corrupt', 'record layout version ' .. version .. ', this version reads ' .. ARGV[1]}
end
if state ~= 'in_flight' and state ~= 'completed' then
  return {'corrupt', 'unknown record state'}
end
return {state, redis.call('PTTL', KEYS[1]), payload}
