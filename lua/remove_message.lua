--[[
remove_message.lua -- remove delivered messages of ONE client by packet id (PUBACK, PUBCOMP, or PUBREC
when no PUBREL must be kept).

KEYS:
  KEYS[1]  <p>{client}_messages   ZSET; message key = KEYS[1] .. "_" .. packet_id
ARGV:
  ARGV[1..n]  packet ids (1..65535); usually one
Returns: integer, how many of them still existed (message key present, i.e. not expired or already
  removed). For one packet id: 1 = removed, 0 = unknown/expired. The ZSET reference is removed either way.
]]
local prefix = KEYS[1] .. '_'
local removed = 0
for i = 1, #ARGV do
  local mkey = prefix .. ARGV[i]
  redis.call('ZREM', KEYS[1], mkey)
  removed = removed + redis.call('DEL', mkey)
end
return removed
