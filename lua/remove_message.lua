--[[
remove_message.lua -- remove delivered messages of N clients by packet id (PUBACK, PUBCOMP, or PUBREC
when no PUBREL must be kept): one call for the acknowledgements of many clients.

KEYS:
  KEYS[c]  <p>{client c}_messages   ZSET of client c (1..N); message key = KEYS[c] .. "_" .. packet_id
           (in Redis Cluster the caller groups clients by hash slot, so one call touches one slot)
ARGV:
  ARGV[c]  client c's packet ids (1..65535), comma-separated decimal ("7", "7,8,12")
Returns: integer, how many of them still existed (message key present, i.e. not expired or already
  removed), all clients together. For one packet id: 1 = removed, 0 = unknown/expired. The ZSET
  reference is removed either way.
]]
local removed = 0
for c = 1, #KEYS do
  local zkey = KEYS[c]
  local prefix = zkey .. '_'
  for pid in string.gmatch(ARGV[c] or '', '%d+') do
    local mkey = prefix .. pid
    redis.call('ZREM', zkey, mkey)
    removed = removed + redis.call('DEL', mkey)
  end
end
return removed
