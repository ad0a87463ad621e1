redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
