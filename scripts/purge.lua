-- purge.lua: delete a record whatever its state, and tell every instance's replay cache.
--
-- KEYS[1]  the record
-- ARGV[1]  the invalidation channel    ARGV[2]  the message (the record's digest, hex)
--
-- A deleted record is also announced on KEYS[1] .. ':settled' (SPUBLISH), for requests waiting for
-- it (src/store/redis/notices.rs).
--
-- Returns 1 when there was a record, 0 otherwise. The message is published either way: a cache
-- may hold a copy of a record that has expired or was deleted by hand.
local deleted = redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[1], ARGV[2])
if deleted == 1 then
  redis.call('SPUBLISH', KEYS[1] .. ':settled', '')
end
return deleted
