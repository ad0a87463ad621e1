local rec = redis.call('HMGET', KEYS[1], 'lease', 'st')
if rec[1] ~= ARGV[1] or ARGV[1] == '0' then return {0, 0} end
-- Finished already (this lease's earlier try, whose reply was lost): its steps, for a caller
-- that counts again (an estimate from above, as its body is).
if rec[2] ~= 'in_progress' then return {1, redis.call('HSTRLEN', KEYS[1], 'sp')} end
redis.call('HSET', KEYS[1], 'st', ARGV[2], 'resp', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
-- The steps the record keeps count with its answer: they live as long. Answered as the second
-- element, for the caller to count where the account is not `KEYS[2]`.
local steps = redis.call('HSTRLEN', KEYS[1], 'sp')
local bytes = tonumber(ARGV[5]) + steps
-- On one server, the answer's bytes go to its subject's account here (best effort: the answer is
-- recorded whatever becomes of its count, and `2` tells the caller the count failed). Counted
-- once, when the answer is written.
if KEYS[2] and bytes > 0 and not pcall(count, KEYS[2], bytes, ARGV[4], ARGV[6]) then
  return {2, steps}
end
return {1, steps}
