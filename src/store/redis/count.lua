-- Adds `bytes` to the subject's account `account`: a hash of bytes by the granule in which they
-- expire (`retention` ms from now, rounded up to `granule` ms), kept as long as its last granule.
local function count(account, bytes, retention, granule)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  granule = tonumber(granule)
  local bucket = math.ceil((now + tonumber(retention)) / granule)
  redis.call('HINCRBY', account, string.format('%d', bucket), bytes)
  local keep = bucket * granule - now
  if redis.call('PTTL', account) < keep then
    redis.call('PEXPIRE', account, string.format('%d', keep))
  end
end
