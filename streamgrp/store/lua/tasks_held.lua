-- Keep the tasks a worker is running from turning idle (streamgrp.services.worker_client, for rollouts
-- longer than the claim time): each task entry still pending under the caller's name in the consumer group
-- of the task queue KEYS[1] is claimed again by it (XAUTOCLAIM from the entry itself, JUSTID: the delivery
-- count stays), so its idle time starts over and no other worker takes it over while it runs. An entry no
-- longer pending, or held by another consumer now, is left as it is.
-- ARGV: 1 the consumer group, 2 the caller's consumer name, then at most MAX_RESULTS task entry ids.
-- Returns how many entries were claimed again. The whole input is checked before the first write.
local n = #ARGV - 2
if n < 1 or n > MAX_RESULTS or ARGV[1] == '' or ARGV[2] == '' then
  return redis.error_reply('BAD_INPUT tasks_held takes a consumer group, a consumer name and 1 to ' .. MAX_RESULTS
                           .. ' task entry ids, got ' .. #ARGV .. ' arguments')
end
for i = 3, #ARGV do
  if not string.match(ARGV[i], '^%d+%-%d+$') then
    return redis.error_reply('BAD_INPUT tasks_held: argument ' .. i .. ' is not an entry id (ms-seq)')
  end
end
local held = 0
for i = 3, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #pending == 1 and pending[1][2] == ARGV[2] then
    redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'COUNT', 1, 'JUSTID')
    held = held + 1
  end
end
return held
