local rec = redis.call('HMGET', KEYS[1], 'lease', 'st')
if rec[1] ~= ARGV[1] or ARGV[1] == '0' then return 0 end
if rec[2] ~= 'in_progress' then return 1 end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
-- On one server, the answer's bytes go to its subject's account here (best effort: the answer is
-- recorded whatever becomes of its count, and `2` tells the caller the count failed). Counted
-- once, when the answer is written.
if KEYS[2] and not pcall(count, KEYS[2], ARGV[5], ARGV[4], ARGV[6]) then return 2 end
return 1
