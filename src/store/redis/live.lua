local rec = redis.call('HMGET', KEYS[1], 'st', 'lease')
if not rec[1] or (rec[1] == 'in_progress' and rec[2] == '0') then return 0 end
return 1
