count(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
return 1
