local rec = redis.call('HMGET', KEYS[1], 'lease', 'st')
if rec[1] ~= ARGV[1] or ARGV[1] == '0' or rec[2] ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'lease', '0', 'ts', 0)
return 1
