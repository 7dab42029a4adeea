-- Dead-letter one entry of the task queue or the control stream, once, and count it.
--
-- KEYS: 1 the entry's stream, 2 deadletter, 3 counts, 4 the deadlettered marker hash
-- ARGV: 1 consumer group ('' for a stream read without one), 2 entry id, 3 reason, 4 detail,
--       5 counter field (invalid:tasks, invalid:control, invalid:decisions), 6 n_fields, then (name value) pairs
-- With a group, the entry is acknowledged and only a real acknowledgement dead-letters it; without
-- one, a marker does the same, so readers that meet the same bad entry count it once.
-- Returns 1 when this call dead-lettered the entry, 0 when it was already done.
local n_fields = count_at(6, 2, 'dead-letter fields')
if n_fields > MAX_DEAD_LETTER_FIELDS then
  error('BAD_INPUT a dead letter of ' .. n_fields .. ' fields; streamgrp.store.deadletter sends at most '
        .. MAX_DEAD_LETTER_FIELDS)
end
local fresh
if ARGV[1] ~= '' then
  fresh = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1
else
  fresh = redis.call('HSETNX', KEYS[4], KEYS[1] .. ' ' .. ARGV[2], 1) == 1
end
if not fresh then return 0 end
local fields = {'reason', ARGV[3], 'detail', ARGV[4], 'stream', KEYS[1], 'entry', ARGV[2]}
for f = 0, n_fields - 1 do
  fields[#fields + 1] = ARGV[7 + 2 * f]
  fields[#fields + 1] = ARGV[8 + 2 * f]
end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HINCRBY', KEYS[3], 'deadletter:' .. ARGV[3], 1)
redis.call('HINCRBY', KEYS[3], ARGV[5], 1)
return 1
