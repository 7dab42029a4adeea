-- Issue tasks (ARGV[3..], encoded headers) to the workers' queue KEYS[1] and the group log KEYS[2],
-- fenced by the batcher lease KEYS[4] (token ARGV[1]) and the dataset cursor in KEYS[3] (expected
-- ARGV[2]), so a restarted or zombie batcher can never issue a prompt twice. The caller bounds
-- the number of tasks per call. Returns the new cursor.
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return redis.error_reply('LEASE lost: feeder is not the lease holder') end
local cursor = tonumber(redis.call('HGET', KEYS[3], 'feeder_cursor') or '0')
if cursor ~= tonumber(ARGV[2]) then return redis.error_reply('CURSOR moved: expected ' .. ARGV[2] .. ' found ' .. cursor) end
for i = 3, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'h', ARGV[i])
  redis.call('XADD', KEYS[2], '*', 'h', ARGV[i])
end
redis.call('HINCRBY', KEYS[3], 'feeder_cursor', #ARGV - 2)
return cursor + #ARGV - 2
