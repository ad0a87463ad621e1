local rec = redis.call('HMGET', KEYS[1], 'st', 'lease', 'ct')
if not rec[1] then return {0} end
if rec[1] ~= 'in_progress' then
  redis.call('DEL', KEYS[1])
  return {2, rec[3] or '0'}
end
if rec[2] == '0' then return {0} end
return {1}
