-- Files record `member` in the listing index `index` at its creation time `created` (an entry only
-- ever moves later), and keeps the index at least `lifetime` (ms) more.
local function file(index, created, member, lifetime)
  redis.call('ZADD', index, 'GT', created, member)
  if redis.call('PTTL', index) < tonumber(lifetime) then
    redis.call('PEXPIRE', index, lifetime)
  end
end
