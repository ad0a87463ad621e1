local rec = redis.call('HMGET', KEYS[1], 'st', 'lease', 'gen', 'sg', 'sp')
if not rec[1] or (rec[1] == 'in_progress' and rec[2] == '0') then return '' end
if rec[4] == (rec[3] or '') then return rec[5] or '' end
return ''
