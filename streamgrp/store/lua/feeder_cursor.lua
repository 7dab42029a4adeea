-- Advance a partitioned run's dataset cursor (KEYS[1] batcher state, field feeder_cursor) by ARGV[3]
-- once those tasks are issued to their partitions (issue_once.lua), fenced like issue_tasks.lua: ARGV[1]
-- the batcher lease token (KEYS[2]) and ARGV[2] the cursor expected. Returns the new cursor.
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return redis.error_reply('LEASE lost: feeder is not the lease holder') end
local cursor = tonumber(redis.call('HGET', KEYS[1], 'feeder_cursor') or '0')
if cursor ~= tonumber(ARGV[2]) then
  return redis.error_reply('CURSOR moved: expected ' .. ARGV[2] .. ' found ' .. cursor)
end
return redis.call('HINCRBY', KEYS[1], 'feeder_cursor', tonumber(ARGV[3]))
