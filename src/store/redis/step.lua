local rec = redis.call('HMGET', KEYS[1], 'lease', 'st', 'gen', 'sg')
if rec[1] ~= ARGV[1] or ARGV[1] == '0' or rec[2] ~= 'in_progress' then return 0 end
local gen = rec[3] or ''
if rec[4] == gen then
  redis.call('HSET', KEYS[1], 'sp', (redis.call('HGET', KEYS[1], 'sp') or '') .. ARGV[2])
else
  redis.call('HSET', KEYS[1], 'sp', ARGV[2], 'sg', gen)
end
return 1
