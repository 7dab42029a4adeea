-- A trainer rank records which rows of its next step are trained (StepRowsTrained), when its optimizer
-- steps do not line up with streamgrp's steps: the step is committed only once all its rows are.
-- KEYS: 1 committed hash, 2 commits stream, 3 attempt hash
-- ARGV: 1 rank, 2 step, 3 attempt, 4 StepRowsTrained header
-- Returns the record's entry id in the commits stream, also kept in the attempt hash as 'rows:<rank>'.
local step, attempt = tonumber(ARGV[2]), tonumber(ARGV[3])
-- The whole input is checked before the first write.
if not step or step < 0 or not attempt or not tonumber(ARGV[1]) or ARGV[4] == '' then
  return redis.error_reply('BAD_INPUT a rows record takes a rank, a step >= 0, an attempt and an event')
end
local current = tonumber(redis.call('HGET', KEYS[3], 'attempt') or '0')
if current ~= attempt then
  return redis.error_reply('STALE_ATTEMPT rank ' .. ARGV[1] .. ' trains in attempt ' .. ARGV[3] .. ' but attempt '
                           .. current .. ' replaced it; restart every rank of the trainer group')
end
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if last ~= step - 1 then
  return redis.error_reply('OUT_OF_ORDER rank ' .. ARGV[1] .. ' committed step ' .. last .. ', so step ' .. step
                           .. ' is not its next step')
end
local id = redis.call('XADD', KEYS[2], '*', 'h', ARGV[4])
redis.call('HSET', KEYS[3], 'rows:' .. ARGV[1], id)
return id
