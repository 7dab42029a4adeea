#!lua flags=no-writes
-- Read entries of the stream KEYS[1] by id (ARGV): one reply instead of one per entry, which is
-- what a trainer rank loading a step's payloads pays for. Each item is the entry's flat field list,
-- or false where the entry is gone. Reads only; the caller bounds the ids per call.
if #ARGV > 4096 then return redis.error_reply('BAD_INPUT read at most 4096 ids per call, got ' .. #ARGV) end
local out = {}
for i = 1, #ARGV do
  local found = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  out[i] = found[1] and found[1][2] or false
end
return out
