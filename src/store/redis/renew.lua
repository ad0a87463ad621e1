local rec = redis.call('HMGET', KEYS[1], 'lease', 'st')
if rec[1] ~= ARGV[1] or ARGV[1] == '0' or rec[2] ~= 'in_progress' then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'ts', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('HDEL', KEYS[1], 'sus')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
