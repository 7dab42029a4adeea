-- A trainer group records a durable checkpoint: the newest by step is kept (never trimmed).
-- KEYS: 1 checkpoint hash, 2 commits stream, 3 attempt hash
-- ARGV: 1 step, 2 attempt, 3 CheckpointSaved header
-- Returns 1 when recorded as the newest, 0 when a newer checkpoint is recorded already.
local step = tonumber(ARGV[1])
-- The whole input is checked before the first write.
if not step or step < 0 or not tonumber(ARGV[2]) then
  return redis.error_reply('BAD_INPUT a checkpoint takes a step >= 0 and an attempt number')
end
local attempt = tonumber(redis.call('HGET', KEYS[3], 'attempt') or '0')
if attempt ~= tonumber(ARGV[2]) then
  return redis.error_reply('STALE_ATTEMPT a checkpoint of attempt ' .. ARGV[2] .. ' but attempt ' .. attempt
                           .. ' replaced it')
end
redis.call('XADD', KEYS[2], '*', 'h', ARGV[3])
local newest = tonumber(redis.call('HGET', KEYS[1], 'step') or '-1')
if step < newest and tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0') == attempt then return 0 end
redis.call('HSET', KEYS[1], 'step', step, 'attempt', attempt, 'h', ARGV[3])
return 1
