-- A trainer rank commits a step: in order, once, and the policy version advances when every rank
-- of the run has committed it.
-- KEYS: 1 committed hash, 2 commits stream, 3 version key, 4 control stream
-- ARGV: 1 rank, 2 step, 3 world size, 4 StepCommitted header, 5 VersionAdvanced header
-- Returns 0 when the step was already committed, 1 when recorded, 2 when it also advanced the version.
local step = tonumber(ARGV[2])
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if last >= step then return 0 end
if last ~= step - 1 then
  return redis.error_reply('OUT_OF_ORDER rank ' .. ARGV[1] .. ' committed step ' .. last .. ', cannot commit ' .. step)
end
redis.call('HSET', KEYS[1], ARGV[1], step)
redis.call('XADD', KEYS[2], '*', 'h', ARGV[4])
for r = 0, tonumber(ARGV[3]) - 1 do
  if tonumber(redis.call('HGET', KEYS[1], tostring(r)) or '-1') < step then return 1 end
end
if tonumber(redis.call('GET', KEYS[3]) or '0') < step + 1 then
  redis.call('SET', KEYS[3], step + 1)
  redis.call('XADD', KEYS[4], '*', 'h', ARGV[5])
end
return 2
