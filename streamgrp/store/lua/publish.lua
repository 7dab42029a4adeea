-- Publish slot results: each header to the group log KEYS[1] and, for a sample, its payload to the
-- payloads stream KEYS[2] at the same entry id, in one atomic call, so a slot result is never visible
-- without its payload and the group log stays small (the assembler reads headers only).
-- ARGV: (header, payload header, payload blob) triples; an empty payload header means no payload (a
-- rejection or a failure). The caller bounds the triples per call (streamgrp.services.worker).
-- Returns the slot entry ids, in order.
-- The whole input is checked before the first write.
local MAX_RESULTS = 256
if #ARGV % 3 ~= 0 or #ARGV > 3 * MAX_RESULTS then
  return redis.error_reply('BAD_INPUT publish takes at most ' .. MAX_RESULTS .. ' (header, payload header, payload '
                           .. 'blob) triples, got ' .. #ARGV .. ' arguments')
end
for i = 1, #ARGV, 3 do
  if ARGV[i] == '' then return redis.error_reply('BAD_INPUT an empty slot header at argument ' .. i) end
end
local ids = {}
for i = 1, #ARGV, 3 do
  local id = redis.call('XADD', KEYS[1], '*', 'h', ARGV[i])
  if ARGV[i + 1] ~= '' then
    local written = redis.pcall('XADD', KEYS[2], id, 'h', ARGV[i + 1], 'b', ARGV[i + 2])
    if type(written) == 'table' and written.err then
      -- Only a write outside streamgrp can put a later id in the payloads stream; refuse it whole.
      redis.call('XDEL', KEYS[1], id)
      return redis.error_reply('PAYLOAD cannot be written at ' .. id .. ' (' .. written.err .. '); the payloads '
                               .. 'stream holds an entry streamgrp did not write')
    end
  end
  ids[#ids + 1] = id
end
return ids
