-- Publish slot results: each header to the group log KEYS[1] and, for a sample, its payload to the
-- payloads stream KEYS[2] at the same entry id, in one atomic call, so a slot result is never visible
-- without its payload and the group log stays small (the assembler reads headers only). With KEYS[3]
-- (the tasks stream), the tasks whose last results these are are acknowledged in the same call: a
-- task is never left published but unacknowledged (which a reclaim would publish again).
-- ARGV: the consumer group ('' without KEYS[3]), the number n of task entry ids to acknowledge, those
-- n ids, then (header, payload header, payload blob) triples; an empty payload header means no
-- payload (a rejection or a failure). The caller bounds the triples per call (streamgrp.services.worker).
-- Returns the slot entry ids, in order.
-- The whole input is checked before the first write.
local n_done = tonumber(ARGV[2])
if n_done == nil or n_done < 0 or n_done ~= math.floor(n_done) or n_done > MAX_RESULTS
    or (n_done > 0 and (KEYS[3] == nil or ARGV[1] == '')) then
  return redis.error_reply('BAD_INPUT publish takes a consumer group, a count of at most ' .. MAX_RESULTS
                           .. ' task ids (with the tasks stream as KEYS[3]) and those ids first, got '
                           .. string.sub(tostring(ARGV[1]), 1, 64) .. ', ' .. string.sub(tostring(ARGV[2]), 1, 64))
end
local first = 3 + n_done
local n_args = #ARGV - first + 1
if n_args < 0 or n_args % 3 ~= 0 or n_args > 3 * MAX_RESULTS then
  return redis.error_reply('BAD_INPUT publish takes at most ' .. MAX_RESULTS .. ' (header, payload header, payload '
                           .. 'blob) triples, got ' .. n_args .. ' arguments')
end
for i = first, #ARGV, 3 do
  if ARGV[i] == '' then return redis.error_reply('BAD_INPUT an empty slot header at argument ' .. i) end
end
local ids = {}
for i = first, #ARGV, 3 do
  local id = redis.call('XADD', KEYS[1], '*', 'h', ARGV[i])
  if ARGV[i + 1] ~= '' then
    local written = redis.pcall('XADD', KEYS[2], id, 'h', ARGV[i + 1], 'b', ARGV[i + 2])
    if type(written) == 'table' and written.err then
      -- Only a write outside streamgrp puts an id at or after this one in the payloads stream (a plain
      -- XADD in the same millisecond, an explicit id in the future, written and deleted or not). Then the
      -- payload goes after the stream's last id and its header moves there too (above the header's own
      -- id, since the payloads stream had passed it), so both still share one id and no publish fails for it.
      redis.call('XDEL', KEYS[1], id)
      written = redis.pcall('XADD', KEYS[2], '*', 'h', ARGV[i + 1], 'b', ARGV[i + 2])
      if type(written) == 'table' and written.err then  -- the stream's last id is the largest there is
        return redis.error_reply('PAYLOAD cannot be written after ' .. id .. ' (' .. written.err .. '); the '
                                 .. 'payloads stream holds an entry streamgrp did not write')
      end
      id = redis.call('XADD', KEYS[1], written, 'h', ARGV[i])
    end
  end
  ids[#ids + 1] = id
end
if n_done > 0 then
  redis.call('XACK', KEYS[3], ARGV[1], unpack(ARGV, 3, 2 + n_done))
end
return ids
