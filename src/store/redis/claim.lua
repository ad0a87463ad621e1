-- The claim's decision; then, on one server, the record it made or took is filed in its subject's
-- listing index (KEYS[2]) here, best effort, as the store files it apart on a cluster.
local function claim()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local rec = redis.call('HMGET', KEYS[1], 'fp', 'st', 'ts', 'lease', 'gen', 'ct', 'ttl', 'rt', 'sus',
    'srun')
  if not rec[1] then
    redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'st', 'in_progress', 'lease', ARGV[2], 'ts', now,
      'gen', ARGV[5], 'ct', now, 'k', ARGV[6], 'sub', ARGV[7], 'ep', ARGV[8], 'ttl', ARGV[3])
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    return {'claimed', ARGV[5], now}
  end
  if rec[2] == 'in_progress' and rec[4] == '0' then
    if rec[1] == ARGV[1] then
      redis.call('HSET', KEYS[1], 'lease', ARGV[2], 'ts', now, 'ct', now, 'k', ARGV[6],
        'sub', ARGV[7], 'ep', ARGV[8], 'ttl', ARGV[3], 'rt', '0')
      redis.call('PEXPIRE', KEYS[1], ARGV[4])
      return {'claimed', rec[5], now}
    end
    redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'lease', ARGV[2], 'ts', now, 'gen', ARGV[5],
      'ct', now, 'k', ARGV[6], 'sub', ARGV[7], 'ep', ARGV[8], 'ttl', ARGV[3], 'rt', '0')
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    return {'claimed', ARGV[5], now}
  end
  if rec[1] ~= ARGV[1] then return {'mismatch'} end
  if rec[2] ~= 'in_progress' then
    return {'finished', redis.call('HGET', KEYS[1], 'resp'), redis.call('PTTL', KEYS[1])}
  end
  -- This claim's own record (the claim sent twice, its first answer lost): granted again, a retake
  -- if the first one retook it.
  if rec[4] == ARGV[2] then
    if rec[8] == '1' then return {'retaken', rec[5], rec[6]} end
    return {'claimed', rec[5], rec[6]}
  end
  -- Stale only past the holder's TTL too: it renews on its own schedule, whatever the claimer's.
  local ttl = math.max(tonumber(ARGV[3]), tonumber(rec[7]) or 0)
  if now - tonumber(rec[3]) < ttl then return {'in_progress'} end
  -- Not taken at the first look: the first claim to find the holder silent marks the record
  -- (`sus`, its time, and `srun`, the server's run id and replication id), and a claim a TTL after
  -- the mark takes it if no renewal came in between (a renewal removes the mark) and the mark was
  -- made by this very server process in its current role. A failover to a replica (which may lack
  -- the holder's last renewals) or a restart (a record kept by persistence) stops renewals without
  -- the record showing it, and holders need a moment to renew again once the server is back; the
  -- mark, a write, gives the holder a whole TTL from a time this server took writes to renew. Redis
  -- shows no presences: a holder whose renewals are late is marked too, and the run id (new at each
  -- start) and the replication id (new at each promotion) keep a mark made before a restart or a
  -- failover, and back, from counting after it. A user not allowed INFO (`-@dangerous`) gets the
  -- mark alone, rather than a key no claim could ever retake.
  local read, info = pcall(redis.call, 'INFO', 'server')
  local run = read and string.match(info, 'run_id:(%w+)') or ''
  local replicated, replication = pcall(redis.call, 'INFO', 'replication')
  run = run .. ':' .. (replicated and string.match(replication, 'master_replid:(%w+)') or '')
  local sus = tonumber(rec[9])
  if not sus or sus < tonumber(rec[3]) or rec[10] ~= run then
    redis.call('HSET', KEYS[1], 'sus', now, 'srun', run)
    return {'in_progress'}
  end
  if now - sus < ttl then return {'in_progress'} end
  redis.call('HSET', KEYS[1], 'lease', ARGV[2], 'ts', now, 'ttl', ARGV[3], 'rt', '1')
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {'retaken', rec[5], rec[6]}
end
local answer = claim()
if KEYS[2] and (answer[1] == 'claimed' or answer[1] == 'retaken') and answer[3] then
  -- A fourth element tells the caller the filing failed (the claim stands).
  if not pcall(file, KEYS[2], answer[3], ARGV[9], ARGV[4]) then answer[4] = 0 end
end
return answer
