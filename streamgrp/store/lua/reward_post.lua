-- Post one slot's reward (an encoded SlotRewarded header, ARGV[3]) to the group log KEYS[1], where the
-- assembler folds it after the slot's result.
-- With a consumer group (ARGV[1], the rewarders'), the result entry ARGV[2] that was scored is
-- acknowledged in it in the same call, and the reward is written only if this call acknowledged it:
-- two rewarders that scored one result (the second reclaimed it from the first) post one reward.
-- Without one (ARGV[1] = ''), a reward posted from anywhere else (a late score); ARGV[2] is ignored,
-- and a second reward for a slot is counted by the assembler as a duplicate.
-- Returns the reward's entry id, or false when the result was acknowledged already.
-- The whole input is checked before the first write.
if #ARGV ~= 3 or ARGV[3] == '' or string.len(ARGV[3]) > MAX_REWARD_HEADER then
  return redis.error_reply('BAD_INPUT reward_post takes a consumer group, a result entry id and one reward header '
                           .. 'of at most ' .. MAX_REWARD_HEADER .. ' bytes')
end
if ARGV[1] ~= '' then
  if not string.match(ARGV[2], '^%d+%-%d+$') then
    return redis.error_reply('BAD_INPUT the scored result entry id is ' .. string.sub(ARGV[2], 1, 64))
  end
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
    return false
  end
end
return redis.call('XADD', KEYS[1], '*', 'h', ARGV[3])
