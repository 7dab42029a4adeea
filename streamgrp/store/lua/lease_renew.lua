-- Extend the lease KEYS[1] by ARGV[2] ms only while token ARGV[1] holds it; 0 when it is lost.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
