--[[
mark_pubrec.lua -- PUBREC received for a QoS 2 message of ONE client: from now on only PUBREL is owed.

KEYS:
  KEYS[1]  <p>{client}_messages   ZSET; message key = KEYS[1] .. "_" .. packet_id
ARGV:
  ARGV[1]  packet id (1..65535)
Returns: integer 1 when the message was found and marked, 0 when it does not exist (expired/removed;
  a dangling ZSET reference is removed).

The packet type is the value's first byte; SETRANGE key 0 "R" rewrites just that byte. Unlike a plain
SET (TBMQ's UPDATE_PACKET_TYPE) it keeps the key's TTL and never touches the protobuf payload. The
serial (ZSET score) is unchanged, so the PUBREL keeps its place in the order.
]]
local mkey = KEYS[1] .. '_' .. ARGV[1]
if redis.call('EXISTS', mkey) == 1 then
  redis.call('SETRANGE', mkey, 0, 'R')
  return 1
end
redis.call('ZREM', KEYS[1], mkey)
return 0
