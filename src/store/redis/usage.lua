local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local granule = tonumber(ARGV[1])
local all = redis.call('HGETALL', KEYS[1])
local sum = 0
for i = 1, #all, 2 do
  if tonumber(all[i]) * granule <= now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    sum = sum + tonumber(all[i + 1])
  end
end
return sum
