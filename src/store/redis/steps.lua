local rec = redis.call('HMGET', KEYS[1], 'lease', 'st', 'gen', 'sg', 'sp')
if rec[1] ~= ARGV[1] or ARGV[1] == '0' or rec[2] ~= 'in_progress' then return '' end
if rec[4] == (rec[3] or '') then return 'h' .. (rec[5] or '') end
return 'h'
