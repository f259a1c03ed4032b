-- inspect.lua: read a record and its time to live for operators, without changing it.
--
-- KEYS[1]  the record
--
-- Returns {}                  no record
--         {record, ttl_ms}    the record as stored (parsed by the caller)
--         {'wrongtype', type} the key holds something that is not a string
local ok, record = pcall(redis.call, 'GET', KEYS[1])
if not ok then
  return {'wrongtype', redis.call('TYPE', KEYS[1])['ok']}
end
if not record then
  return {}
end
return {record, redis.call('PTTL', KEYS[1])}
