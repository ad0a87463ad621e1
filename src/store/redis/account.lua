local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local granule = tonumber(ARGV[3])
local bucket = math.ceil((now + tonumber(ARGV[2])) / granule)
redis.call('HINCRBY', KEYS[1], string.format('%d', bucket), ARGV[1])
local keep = bucket * granule - now
if redis.call('PTTL', KEYS[1]) < keep then
  redis.call('PEXPIRE', KEYS[1], string.format('%d', keep))
end
return 1
