local rec = redis.call('HMGET', KEYS[1], 'st', 'lease', 'ct', 'resp', 'k', 'sub', 'ep')
if not rec[1] or (rec[1] == 'in_progress' and rec[2] == '0') then return false end
local status = -1
if rec[1] ~= 'in_progress' and rec[4] and #rec[4] >= 3 then
  status = string.byte(rec[4], 2) * 256 + string.byte(rec[4], 3)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {rec[1], rec[3] or '0', redis.call('PTTL', KEYS[1]), now, status, rec[5] or '',
  rec[6] or '', rec[7] or ''}
