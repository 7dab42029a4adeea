-- A trainer group starts a new attempt, or a rank joins the one its group already started.
-- KEYS: 1 attempt hash, 2 committed hash, 3 commits stream
-- ARGV: 1 the attempt number the caller read as current, 2 the group's token, 3 first step,
--       4 version base, 5 world size, 6 TrainingResumed header
-- Returns {'new'} when this call started the attempt (every rank's position set to first - 1, the
-- event recorded), {'same', attempt, first, base} when the group's token already holds the attempt,
-- {'changed'} when another group's attempt replaced the one the caller read (read again).
local first = tonumber(ARGV[3])
local world = tonumber(ARGV[5])
-- The whole input is checked before the first write.
if not first or first < 0 or not world or world < 1 or world > 4096 or not tonumber(ARGV[4])
    or not tonumber(ARGV[1]) or ARGV[2] == '' then
  return redis.error_reply('BAD_INPUT an attempt takes the attempt read, a token, a first step >= 0, a version base '
                           .. 'and a world size of 1..4096')
end
local current = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
local token = redis.call('HGET', KEYS[1], 'token')
if token == ARGV[2] then
  return {'same', current, redis.call('HGET', KEYS[1], 'first'), redis.call('HGET', KEYS[1], 'base')}
end
if current ~= tonumber(ARGV[1]) then return {'changed'} end
redis.call('HSET', KEYS[1], 'attempt', current + 1, 'token', ARGV[2], 'first', first, 'base', ARGV[4],
           'world_size', world)
for r = 0, world - 1 do
  local last = tonumber(redis.call('HGET', KEYS[2], tostring(r)) or '-1')
  if last >= first then
    if first == 0 then redis.call('HDEL', KEYS[2], tostring(r)) else redis.call('HSET', KEYS[2], tostring(r), first - 1) end
  end
end
redis.call('XADD', KEYS[3], '*', 'h', ARGV[6])
return {'new'}
