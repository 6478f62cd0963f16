--[[
clear_all.lua -- forget everything stored for ONE client (clean start, session removed). Needs lua/packet_ids.lua
prepended (the store does it).

KEYS:
  KEYS[1]  <p>{client}_messages   ZSET "<serial>:<size>"; value at KEYS[1] .. "_" .. serial
  KEYS[2]  <p>{client}_pids       HASH of the handed-out packet ids
  KEYS[3]  <p>{client}_state      HASH pid, serial, bytes, live
  KEYS[4]  <p>{client}_attached   (optional) the client's attachment, deleted too
ARGV: none
Returns: integer, how many stored messages were dropped (values that still existed; expired ones are
  not counted).
]]
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local prefix = KEYS[1] .. '_'
local dropped = 0
for i = 1, #members do
  dropped = dropped + redis.call('DEL', prefix .. member_serial(members[i]))
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
if KEYS[4] then redis.call('DEL', KEYS[4]) end
return dropped
