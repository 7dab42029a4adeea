-- A follower's durable position in one stream of a run (streamgrp.store.follow): KEYS[1] is the run's
-- follow hash, ARGV[1] the operation, ARGV[2] the follower's name, ARGV[3] the stream's name (decisions,
-- slots@2, steps), ARGV[4] an entry id (register: where to start; ack: the last entry handled).
--   register  sets the position to ARGV[4] unless the follower has one there already (a restart resumes)
--   ack       moves the position forward to ARGV[4]; never back (an older ack, a replayed one, changes nothing)
--   forget    removes the follower's position and skip records for the stream: retention stops keeping for it
-- Returns the position now stored (false after forget). The whole input is checked before the first write.
if #ARGV ~= 4 then
  return redis.error_reply('BAD_INPUT follow_position takes an operation, a name, a stream and an entry id')
end
local op, name, stream, id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if op ~= 'register' and op ~= 'ack' and op ~= 'forget' then
  return redis.error_reply('BAD_INPUT unknown operation ' .. string.sub(op, 1, 32))
end
if #name > 64 or not string.match(name, '^[%w][%w_.%-]*$') then
  return redis.error_reply('BAD_INPUT follower name ' .. string.sub(name, 1, 80))
end
if #stream > 32 or not (string.match(stream, '^%l+$') or string.match(stream, '^%l+@%d+$')) then
  return redis.error_reply('BAD_INPUT stream name ' .. string.sub(stream, 1, 40))
end
-- An entry id without leading zeros in either part, so that ids compare by (length, text).
local ms, seq = string.match(id, '^(%d+)%-(%d+)$')
local function canonical(part)
  return part ~= nil and #part <= 20 and (part == '0' or string.sub(part, 1, 1) ~= '0')
end
if not canonical(ms) or not canonical(seq) then
  return redis.error_reply('BAD_INPUT entry id ' .. string.sub(id, 1, 48))
end
local field = name .. '|' .. stream
if op == 'forget' then
  redis.call('HDEL', KEYS[1], field, field .. '|skip', field .. '|skipped')
  return false
end
local current = redis.call('HGET', KEYS[1], field)
if op == 'register' then
  if current then
    return current
  end
  redis.call('HSET', KEYS[1], field, id)
  return id
end
if not current then
  return redis.error_reply('NOT_REGISTERED ' .. field .. ' has no position: register it first')
end
local function before(a_ms, a_seq, b_ms, b_seq)
  if #a_ms ~= #b_ms then return #a_ms < #b_ms end
  if a_ms ~= b_ms then return a_ms < b_ms end
  if #a_seq ~= #b_seq then return #a_seq < #b_seq end
  return a_seq < b_seq
end
local c_ms, c_seq = string.match(current, '^(%d+)%-(%d+)$')
if c_ms == nil or before(c_ms, c_seq, ms, seq) then
  redis.call('HSET', KEYS[1], field, id)
  return id
end
return current
