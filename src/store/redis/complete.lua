local rec = redis.call('HMGET', KEYS[1], 'lease', 'st')
if rec[1] ~= ARGV[1] or ARGV[1] == '0' then return 0 end
if rec[2] ~= 'in_progress' then return 1 end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
