--[[
mark_pubrec.lua -- PUBREC received for a QoS 2 message of ONE client: from now on only PUBREL is owed. Needs lua/packet_ids.lua
prepended (the store does it).

KEYS:
  KEYS[1]  <p>{client}_messages   ZSET "<serial>:<size>"; value at KEYS[1] .. "_" .. serial
  KEYS[2]  <p>{client}_pids       HASH packet id -> member (handed out, not acknowledged)
ARGV:
  ARGV[1]  packet id (1..65535)
  ARGV[2]  optional: the message's serial. With it the id is marked only while it still names that message:
           a PUBREC retried from an earlier connection finds the id handed to a newer message (freed and
           handed out again meanwhile) and leaves that one alone. Absent or '': whatever message holds the id.
Returns: integer 1 when the message was found and marked, 0 when it does not exist (never handed out,
  expired or removed; a dangling reference is removed and the id freed) or the id names another serial.

The packet type is the value's first byte; SETRANGE key 0 "R" rewrites just that byte. Unlike a plain
SET (TBMQ's UPDATE_PACKET_TYPE) it keeps the key's TTL and never touches the protobuf payload. The
serial (ZSET score) and the packet id are unchanged, so the PUBREL keeps its place and its id.
]]
local member = redis.call('HGET', KEYS[2], ARGV[1])
if not member then
  return 0
end
local serial = member_serial(member)
if ARGV[2] and ARGV[2] ~= '' and ARGV[2] ~= serial then
  return 0
end
local mkey = KEYS[1] .. '_' .. serial
if redis.call('EXISTS', mkey) == 1 then
  redis.call('SETRANGE', mkey, 0, 'R')
  return 1
end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], member)
return 0
