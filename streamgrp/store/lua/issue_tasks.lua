-- Issue tasks (ARGV[3..], encoded TaskIssued headers) to the workers' queue KEYS[1] and the group log
-- KEYS[2] in one atomic call: a task is either in both or in neither, and its group-log entry
-- precedes its slot results (a worker can only see the task afterwards), which lets the assembler
-- fold one ordered stream. The group-log entry names its queue entry (field q): the assembler opens a
-- group only for a task whose queue entry holds the same header, so entries anyone else appends to the
-- group log cannot take the open-group limit from issued tasks. The caller bounds the number of tasks per call.
--
-- The feeder's calls are fenced: ARGV[1] the batcher lease token (KEYS[4]) and ARGV[2] the dataset
-- cursor expected in KEYS[3], so a restarted or zombie batcher can never issue a prompt twice; the
-- cursor advances with the tasks and the new cursor is returned. An empty ARGV[1] is an unfenced
-- issue (tasks a user publishes directly): no lease, no cursor; returns the number written.
local fenced = ARGV[1] ~= ''
local cursor = 0
if fenced then
  if redis.call('GET', KEYS[4]) ~= ARGV[1] then return redis.error_reply('LEASE lost: feeder is not the lease holder') end
  cursor = tonumber(redis.call('HGET', KEYS[3], 'feeder_cursor') or '0')
  if cursor ~= tonumber(ARGV[2]) then
    return redis.error_reply('CURSOR moved: expected ' .. ARGV[2] .. ' found ' .. cursor)
  end
end
for i = 3, #ARGV do
  local queued = redis.call('XADD', KEYS[1], '*', 'h', ARGV[i])
  local logged = redis.pcall('XADD', KEYS[2], '*', 'h', ARGV[i], 'q', queued)
  if type(logged) == 'table' and logged.err then
    -- The group log takes no more entries (a foreign entry at the largest id there is): take the task
    -- back, so it is in neither stream, and say so; nothing can be issued to this run again.
    redis.call('XDEL', KEYS[1], queued)
    return redis.error_reply('LOG the group log takes no more entries (' .. logged.err .. ')')
  end
end
if fenced then
  redis.call('HINCRBY', KEYS[3], 'feeder_cursor', #ARGV - 2)
end
return cursor + #ARGV - 2
