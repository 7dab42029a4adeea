-- Create the control stream KEYS[1] with the run's record ARGV[1] unless it exists; return its first
-- entry, so every process joining a run reads the one record that was written first.
-- KEYS[2] (the batcher's state hash, which only the batcher's user may write) notes the record's entry
-- id under 'record'. A trainer's credential may append to control too (its version events), so before a
-- batcher created the run it could append a record of its own: the third value returned says whether a
-- batcher wrote the first entry (1), or nothing vouches for it (0). A run a batcher of an older release
-- created (state written, no note) is taken as it is and noted now.
if #KEYS ~= 2 or type(ARGV[1]) ~= 'string' or ARGV[1] == '' then
  return redis.error_reply('BAD_INPUT create_run takes the control stream, the batcher state hash and a record')
end
if redis.call('XLEN', KEYS[1]) == 0 then
  local id = redis.call('XADD', KEYS[1], '*', 'h', ARGV[1])
  redis.call('HSET', KEYS[2], 'record', id)
end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
local noted = redis.call('HGET', KEYS[2], 'record')
if not noted and redis.call('HLEN', KEYS[2]) > 0 then
  redis.call('HSET', KEYS[2], 'record', first[1])
  noted = first[1]
end
return {first[1], first[2], noted == first[1] and 1 or 0}
