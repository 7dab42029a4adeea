-- Free the lease KEYS[1] only if token ARGV[1] still holds it (never another holder's lease).
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
