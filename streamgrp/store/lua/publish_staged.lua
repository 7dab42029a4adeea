-- Publish slot results of a run whose payloads live in keys (streamgrp.store.payloads, layout 'keys'):
-- each header to the group log KEYS[1] and, for a sample, its payload (staged by the caller with SET NX
-- PX in the same pipeline, so no payload byte passes through here) renamed to '<KEYS[2]>:<entry id>',
-- in one atomic call: a slot result is never visible without its payload. The tasks (of the tasks
-- stream KEYS[3]) whose last results these are are acknowledged in the same call.
-- KEYS: 1 the group log, 2 the payloads stream's name (the payload keys' prefix), 3 the tasks stream,
--       then one staged key per sample, in the order of the results that have one.
-- ARGV: the consumer group ('' without tasks to acknowledge), the number n of task entry ids to
--       acknowledge, those n ids, then (slot header, '1' for a sample whose payload is staged, else '')
--       pairs. Returns the slot entry ids, in order.
-- Everything is checked before the first write: STAGED when a staged key is gone (expired, or taken by
-- an earlier call) or is not one of this partition's staging keys; nothing is written then.
local n_done = tonumber(ARGV[2])
if #KEYS < 3 or n_done == nil or n_done < 0 or n_done ~= math.floor(n_done) or n_done > MAX_RESULTS
    or (n_done > 0 and ARGV[1] == '') then
  return redis.error_reply('BAD_INPUT publish_staged takes the group log, the payloads stream, the tasks stream, '
                           .. 'staged keys, then a consumer group, a count of at most ' .. MAX_RESULTS
                           .. ' task ids and those ids first, got ' .. string.sub(tostring(ARGV[1]), 1, 64) .. ', '
                           .. string.sub(tostring(ARGV[2]), 1, 64))
end
local first = 3 + n_done
local n_args = #ARGV - first + 1
if n_args < 0 or n_args % 2 ~= 0 or n_args > 2 * MAX_RESULTS then
  return redis.error_reply('BAD_INPUT publish_staged takes at most ' .. MAX_RESULTS .. ' (header, staged) pairs, got '
                           .. n_args .. ' arguments')
end
local prefix = KEYS[2] .. ':staged:'
local staged = 3
local seen = {}
for i = first, #ARGV, 2 do
  if ARGV[i] == '' then return redis.error_reply('BAD_INPUT an empty slot header at argument ' .. i) end
  if ARGV[i + 1] ~= '' then
    if ARGV[i + 1] ~= '1' then
      return redis.error_reply('BAD_INPUT argument ' .. (i + 1) .. ' is neither \'1\' (a staged payload) nor \'\'')
    end
    staged = staged + 1
    local name = KEYS[staged]
    if name == nil or string.sub(name, 1, #prefix) ~= prefix or seen[name] then
      return redis.error_reply('BAD_INPUT the payload of argument ' .. i .. ' names no staging key of ' .. KEYS[2]
                               .. ' (or one named before)')
    end
    seen[name] = true
    if redis.call('EXISTS', name) == 0 then
      return redis.error_reply('STAGED the staged payload ' .. name .. ' is gone (expired, or published already); '
                               .. 'nothing was published: stage the payload again and publish again')
    end
  end
end
if staged ~= #KEYS then
  return redis.error_reply('BAD_INPUT ' .. (#KEYS - 3) .. ' staged keys for ' .. (staged - 3) .. ' staged payloads')
end
local ids = {}
staged = 3
for i = first, #ARGV, 2 do
  local id = redis.call('XADD', KEYS[1], '*', 'h', ARGV[i])
  if ARGV[i + 1] ~= '' then
    staged = staged + 1
    local target = KEYS[2] .. ':' .. id
    redis.call('RENAME', KEYS[staged], target)
    redis.call('PERSIST', target)
  end
  ids[#ids + 1] = id
end
if n_done > 0 then
  redis.call('XACK', KEYS[3], ARGV[1], unpack(ARGV, 3, 2 + n_done))
end
return ids
