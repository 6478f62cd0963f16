--[[
clear_all.lua -- forget everything stored for ONE client (clean start, session removed).

KEYS:
  KEYS[1]  <p>{client}_messages        ZSET of message keys
  KEYS[2]  <p>{client}_last_packet_id
  KEYS[3]  <p>{client}_serial
  KEYS[4]  <p>{client}_attached        (optional) the client's attachment, deleted too
ARGV: none
Returns: integer, how many stored messages were dropped (message keys that still existed; expired
  ones are not counted).
]]
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local dropped = 0
for i = 1, #members do
  dropped = dropped + redis.call('DEL', members[i])
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
if KEYS[4] then redis.call('DEL', KEYS[4]) end
return dropped
