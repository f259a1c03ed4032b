-- purge.lua: delete a record whatever its state, and tell every instance's replay cache.
--
-- KEYS[1]  the record
-- ARGV[1]  the invalidation channel    ARGV[2]  the message (the record's digest, hex)
-- ARGV[3]  'string': what the caller read at the key (its first bytes, up to the end of the
--          owner for a record), ARGV[4]; 'other': the key held another type
-- ARGV[4]  those bytes ('' for an absent key or an empty string)
--
-- Deletes the key only while it holds what the caller read: a record of the same owner (in
-- flight or completed since), the same foreign bytes, or still another type. So a purge that
-- the client library sends again after a reconnect, late, never deletes a claim made after the
-- caller read the key (a newer owner's record starts with another owner).
--
-- A deleted record is also announced on KEYS[1] .. ':settled' (SPUBLISH), for requests waiting for
-- it (src/store/redis/notices.rs).
--
-- Returns 1 when it deleted the key, 0 otherwise. The message is published either way: a cache
-- may hold a copy of a record that has expired or was deleted by hand.
local kind = redis.call('TYPE', KEYS[1])['ok']
local same
if ARGV[3] == 'other' then
  same = kind ~= 'string' and kind ~= 'none'
elseif kind ~= 'string' then
  same = false
elseif ARGV[4] == '' then
  same = redis.call('STRLEN', KEYS[1]) == 0
else
  same = redis.call('GETRANGE', KEYS[1], 0, #ARGV[4] - 1) == ARGV[4]
end
local deleted = 0
if same then
  deleted = redis.call('DEL', KEYS[1])
end
redis.call('PUBLISH', ARGV[1], ARGV[2])
if deleted == 1 then
  redis.call('SPUBLISH', KEYS[1] .. ':settled', '')
end
return deleted
