-- A trainer rank commits a step: in order, once, in its group's current attempt, and the policy
-- version advances when every rank of the run has committed it.
-- KEYS: 1 committed hash, 2 commits stream, 3 version key, 4 control stream, 5 attempt hash
-- ARGV: 1 rank, 2 step, 3 world size, 4 StepCommitted header, 5 VersionAdvanced header, 6 attempt,
--       7 the version this step publishes
-- Returns 0 when the step was already committed, 1 when recorded, 2 when it also advanced the version.
local step, world, version = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[7])
-- The whole input is checked before the first write.
if not step or step < 0 or not world or world < 1 or world > 4096 or not version or version < 1 then
  return redis.error_reply('BAD_INPUT a commit takes a step >= 0, a world size of 1..4096 and a version >= 1')
end
local attempt = tonumber(redis.call('HGET', KEYS[5], 'attempt') or '0')
if attempt ~= tonumber(ARGV[6]) then
  return redis.error_reply('STALE_ATTEMPT rank ' .. ARGV[1] .. ' trains in attempt ' .. ARGV[6] .. ' but attempt '
                           .. attempt .. ' replaced it; restart every rank of the trainer group')
end
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if last >= step then return 0 end
if last ~= step - 1 then
  return redis.error_reply('OUT_OF_ORDER rank ' .. ARGV[1] .. ' committed step ' .. last .. ', cannot commit ' .. step)
end
redis.call('HSET', KEYS[1], ARGV[1], step)
redis.call('XADD', KEYS[2], '*', 'h', ARGV[4])
-- The highest version any rank's commit may have published weights under: a later attempt starts above it.
if version > tonumber(redis.call('HGET', KEYS[5], 'reserved') or '0') then
  redis.call('HSET', KEYS[5], 'reserved', version)
end
-- The highest step any rank ever committed: steps up to it are trained again after a rollback.
if step > tonumber(redis.call('HGET', KEYS[5], 'high') or '-1') then redis.call('HSET', KEYS[5], 'high', step) end
for r = 0, world - 1 do
  if tonumber(redis.call('HGET', KEYS[1], tostring(r)) or '-1') < step then return 1 end
end
-- A version key that holds no integer was not written here: the commit writes a good one.
if (tonumber(redis.call('GET', KEYS[3]) or '0') or -1) < version then
  redis.call('SET', KEYS[3], version)
  redis.call('XADD', KEYS[4], '*', 'h', ARGV[5])
end
return 2
