-- Take the lease KEYS[1] for token ARGV[1] with a TTL of ARGV[2] ms. Taking it again with our own
-- token succeeds: after an outage the process may find the lease it held (its TTL not yet run out),
-- or the reply of its own SET may have been lost.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
