-- Create the control stream KEYS[1] with the run's record ARGV[1] unless it exists; return its
-- first entry, so every process joining a run reads the one record that was written first.
if redis.call('XLEN', KEYS[1]) == 0 then
  redis.call('XADD', KEYS[1], '*', 'h', ARGV[1])
end
return redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
