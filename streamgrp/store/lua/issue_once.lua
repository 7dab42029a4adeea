-- A partitioned run's feeder issues tasks to one partition: each to the partition's task queue KEYS[1]
-- and group log KEYS[2] in one atomic call (the log's entry naming the queue's, field q), as issue_tasks.lua does, but only if the partition's
-- issued marker KEYS[3] (hash task id -> 1) does not hold it yet. The feeder's lease and dataset
-- cursor live in the run's hash slot, which a cluster does not let this call touch, so the cursor
-- advances in a second, fenced call (feeder_cursor.lua); a feeder that dies or loses its lease in
-- between leaves tasks that its successor issues again under the same ids, and these are skipped.
-- ARGV: task id, encoded TaskIssued header, repeated. Returns the number written.
local written = 0
for i = 1, #ARGV - 1, 2 do
  if redis.call('HSETNX', KEYS[3], ARGV[i], 1) == 1 then
    local queued = redis.call('XADD', KEYS[1], '*', 'h', ARGV[i + 1])
    local logged = redis.pcall('XADD', KEYS[2], '*', 'h', ARGV[i + 1], 'q', queued)
    if type(logged) == 'table' and logged.err then  -- as issue_tasks.lua: in neither stream, and say so
      redis.call('XDEL', KEYS[1], queued)
      redis.call('HDEL', KEYS[3], ARGV[i])
      return redis.error_reply('LOG the group log takes no more entries (' .. logged.err .. ')')
    end
    written = written + 1
  end
end
return written
